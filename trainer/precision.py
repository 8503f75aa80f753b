"""Mixed precision as one unit: autocast for the forward pass, dynamic loss scaling for fp16.

Built on torch.amp directly (what accelerate wraps): accelerate's Accelerator turns autocast off on CPU and
keeps process-wide state, while a ComfyUI process runs many trainings with different precisions."""
from __future__ import annotations

import contextlib

import torch

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
