"""An exponential moving average of the LoRA weights (Train's ema_decay). With it on, the LoRA file, the samples
and the validation loss use the average; training steps the raw weights as before. The average is one fp32 copy
of the LoRA on its device (plus a temporary of that size during each update); the training state keeps it, so a
resume goes on with the same average."""
from __future__ import annotations

import contextlib

import torch


class LoraEMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.updates = 0
        self.average = self._current()

    def _current(self) -> torch.Tensor:
        return torch.cat([p.detach().float().reshape(-1) for p in self.params])

    @property
    def nbytes(self) -> int:
        return self.average.numel() * self.average.element_size()

    def rate(self) -> float:
        """diffusers' EMAModel warm-up: min(decay, (1 + t) / (10 + t)), so the first steps' average is not held
        at the initial weights (LoRA's B starts at zero) for thousands of steps."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step, without a host sync: a step whose weights are not finite leaves the average
        as it was (the loop then stops and goes back to the last finite weights)."""
        current = self._current()
        finite = torch.isfinite(current).all()
        self.average.lerp_(torch.where(finite, current, self.average), 1 - self.rate())
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the LoRA tensors for the block (in place: CUDA graphs keep their addresses), the
        trained weights back after it."""
        saved = [p.detach().clone() for p in self.params]
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.average[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, kept in zip(self.params, saved):
                    p.copy_(kept)

    def state_dict(self) -> dict:
        return {"average": self.average.detach().cpu().clone(), "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["average"].shape) != tuple(self.average.shape):
            raise ValueError(f"EMA of {state['average'].numel()} weights, this LoRA has {self.average.numel()}")
        self.average.copy_(state["average"].to(self.average.device, torch.float32))
        self.updates = int(state["updates"])
