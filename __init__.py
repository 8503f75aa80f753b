"""LeanLoRA: train LoRA adapters for SD1.5/SDXL inside ComfyUI. ComfyUI imports this file as the pack."""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
