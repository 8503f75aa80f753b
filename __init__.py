"""LeanLoRA: train LoRA adapters for SD1.5/SDXL inside ComfyUI. ComfyUI imports this file as the pack."""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"  # web/leanlora.js: the Train node's live panel, Memory Settings' card and advanced widgets

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
