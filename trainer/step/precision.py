"""Mixed precision as one unit: autocast for the forward pass, dynamic loss scaling for fp16.

Built on torch.amp directly (what accelerate wraps): accelerate's Accelerator turns autocast off on CPU and
keeps process-wide state, while a ComfyUI process runs many trainings with different precisions."""
from __future__ import annotations

import contextlib

import torch

from ..layer_patch import mix_into

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


class Precision:
    def __init__(self, mode: str, device: torch.device, initial_scale: float = 2.0 ** 16):
        self.mode = mode
        self.device = torch.device(device)
        self.dtype = DTYPES[mode]
        self.compute_dtype = self.dtype or torch.float32  # what frozen weights are stored in
        # fp16 gradients underflow without scaling; bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=initial_scale) if mode == "fp16" else None
        self.skipped_steps = 0  # fp16 steps dropped because a gradient overflowed

    def autocast(self, cache_enabled: bool = True):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=cache_enabled)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Applies the accumulated gradients; returns False when an fp16 overflow made it skip the step."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= scale  # the scaler backs off only after an overflow
        self.skipped_steps += not stepped
        return stepped


class _NormInComputeDtype:
    """Mixin for GroupNorm/LayerNorm layers: the forward stays in the autocast dtype. Autocast runs these norms in
    fp32, so on SDXL at 1024² each norm (and the SiLU after it) briefly holds fp32 copies of 128x128 feature maps;
    the kernels accumulate their statistics in fp32 either way, only the output is kept in bf16/fp16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if not torch.is_autocast_enabled(device_type):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device_type)
        weight = None if self.weight is None else self.weight.to(x.device, dtype, non_blocking=True)
        bias = None if self.bias is None else self.bias.to(x.device, dtype, non_blocking=True)
        with torch.autocast(device_type, enabled=False):
            if isinstance(self, torch.nn.GroupNorm):
                return torch.nn.functional.group_norm(x.to(dtype), self.num_groups, weight, bias, self.eps)
            return torch.nn.functional.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


def norms_in_compute_dtype(module: torch.nn.Module) -> int:
    """Gives every GroupNorm/LayerNorm of the training copy the compute-dtype forward; returns how many."""
    return sum(mix_into(layer, _NormInComputeDtype) for layer in module.modules()
               if isinstance(layer, (torch.nn.GroupNorm, torch.nn.LayerNorm)))
