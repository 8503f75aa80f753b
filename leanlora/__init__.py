"""LeanLoRA without a ComfyUI server: `python -m leanlora train CONFIG` (docs/HEADLESS.md).

ComfyUI is imported as a library (its loaders, folders and model management) and the run is the Train node's own
(nodes/train.py -> trainer/train_lora.py). ComfyUI does not load this package: the pack's __init__.py never imports it.
"""
