"""Shared bits of the node shells: category and PIL -> ComfyUI IMAGE."""
import numpy as np
import torch

CATEGORY = "LeanLoRA"


def pil_to_image(pil) -> torch.Tensor:
    """ComfyUI IMAGE: float [1, H, W, 3] in 0..1."""
    return torch.from_numpy(np.asarray(pil.convert("RGB"), dtype=np.float32) / 255.0)[None]
