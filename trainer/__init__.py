"""LeanLoRA's training library: folder -> samples -> cache -> steps -> LoRA file.

Imports no ComfyUI: what it needs from a model is trainer/model.py's ModelAdapter, which ../bridge
implements for ComfyUI (tests/test_imports.py keeps it so).
"""
from .errors import LeanLoRAError

__version__ = "0.1.0"
__all__ = ["LeanLoRAError", "__version__"]
