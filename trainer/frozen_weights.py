"""How the frozen base weights are stored during training.

fp8 (e4m3fn) storage halves the frozen weights' memory against fp16/bf16 (a quarter against fp32). Compute
stays in the compute dtype: layers that can cast per call (ComfyUI's ops: `comfy_cast_weights`) upcast each
weight only while that layer runs. With gradient checkpointing the upcast copies live for one block at a
time; without it autograd keeps them for backward, so fp8 pays off together with checkpointing."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class _Rescale:
    """Per-tensor scale applied after ComfyUI's per-call upcast (a `weight_function` of ComfyUI's ops)."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


def _castable_layers(module: torch.nn.Module):
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if hasattr(layer, "comfy_cast_weights") and isinstance(weight, torch.Tensor) and weight.dim() >= 2 \
                and not weight.requires_grad:
            yield layer


def store_weights_fp8(module: torch.nn.Module) -> int:
    """Converts every frozen matmul/conv weight of a castable layer to fp8 in place. Returns bytes saved.

    Each tensor is scaled so its largest magnitude maps to fp8's largest: SD weights are mostly ~1e-2, where
    unscaled e4m3 is subnormal and keeps almost no precision."""
    saved = 0
    for layer in _castable_layers(module):
        weight = layer.weight
        if weight.dtype == FP8:
            continue
        scale = max(weight.detach().abs().max().item(), 1e-12) / FP8_MAX
        saved += weight.numel() * (weight.element_size() - 1)
        layer.weight = torch.nn.Parameter((weight.data.float() / scale).to(FP8), requires_grad=False)
        layer.weight_function = [*layer.weight_function, _Rescale(scale)]  # per instance: the class list is shared
        layer.comfy_cast_weights = True  # upcast to the input's dtype on every call
    return saved


def frozen_weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every frozen parameter and buffer (what stays resident for the whole run)."""
    tensors = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
