"""LeanLoRA's training library: folder -> samples -> cache -> steps -> LoRA file.

Importable without a ComfyUI server; only `comfy_adapter` touches ComfyUI objects.
"""
from .errors import LeanLoRAError

__version__ = "0.1.0"
__all__ = ["LeanLoRAError", "__version__"]
