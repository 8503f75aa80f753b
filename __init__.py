"""LeanLoRA: train LoRA adapters inside ComfyUI for SD1.5/SDXL, Z-Image, FLUX.1, Chroma, Qwen-Image and Wan 2.1/2.2
(image LoRAs), plus a generic path (bridge/families/). ComfyUI imports this file as the pack."""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"  # web/leanlora.js: the Train node's live panel, Memory Settings' card and advanced widgets

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
