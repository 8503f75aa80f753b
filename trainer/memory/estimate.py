"""Where the memory goes, before step 1, in the categories users know.

Weights, LoRA parameters, gradients and optimizer state are counted exactly from the tensors. Activations and
workspace are measured, not guessed: on CUDA two probe steps (1/4 of the latent area and the full size, at
batch 1) run with the real settings; the peak grows linearly in batch x latent area (SDPA attention is linear in
tokens), so the line through them gives the real batch. (Probing at 1/16 and 1/4 and extrapolating came out
10-25% low: workspaces of the full-size kernels do not scale down.) A compiled model is probed once, at the run's
own batch shape: compiled graphs are specialized to shapes, and another probe shape would cost a full compile.
On CPU there is no VRAM to plan, and no probe runs (a CPU test's simulated card
(device/card.py) runs them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..step.frozen_weights import frozen_weight_bytes
from ..optimizers import optimizer_state_bytes
from ..device.card import device_memory

GIB = 2 ** 30


@dataclass
class MemoryEstimate:
    frozen_weights: int
    lora_parameters: int
    gradients: int
    optimizer_state: int
    activations: int | None = None   # None when not probed (CPU)
    workspace: int | None = None
    # Held on the device by the process but by none of the above: cuBLAS/cuDNN workspaces (one per stream),
    # tensors ComfyUI keeps loaded. It counts against the same VRAM and caps.
    other: int = 0
    workspace_in_activations: bool = False  # probed once at the run's shape: the two are not told apart
    # The full-size probe step's reserved growth per allocated byte (>= 1): the caching allocator's rounding of
    # this step, which a CUDA graph's private pool follows (micro_steps.GraphPoolSize). None where not measured.
    reserve_ratio: float | None = None

    @property
    def total(self) -> int | None:
        if self.activations is None:
            return None
        return (self.frozen_weights + self.lora_parameters + self.gradients + self.optimizer_state
                + self.activations + self.workspace + self.other)

    def format(self) -> str:
        transient = [("activations + workspace", self.activations)] if self.workspace_in_activations else \
            [("activations", self.activations), ("workspace", self.workspace)]
        rows = [("frozen weights", self.frozen_weights), ("LoRA parameters", self.lora_parameters),
                ("gradients", self.gradients), ("optimizer state", self.optimizer_state), *transient,
                ("other (CUDA libraries, loaded models)", self.other)]
        text = ", ".join(f"{name} {value / GIB:.2f}" if value is not None else f"{name} n/a (not measured)"
                         for name, value in rows)
        total = self.total
        return f"memory estimate (GiB): {text}" + (f"; peak {total / GIB:.2f} GiB" if total is not None else "")


def static_terms(unet: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: str,
                 device: torch.device | None = None, state_params: list | None = None) -> MemoryEstimate:
    """Streamed weights live in CPU memory: only what is resident on `device` counts. `state_params`: the tensors
    (or shapes) the optimizer actually steps, when not `params` (flat tensors or their chunks)."""
    lora = sum(p.numel() * p.element_size() for p in params)
    return MemoryEstimate(frozen_weights=frozen_weight_bytes(unet, device), lora_parameters=lora, gradients=lora,
                          optimizer_state=optimizer_state_bytes(optimizer, state_params or params))


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope through (x, y) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
    return mean_y - slope * mean_x, slope


PROBE_SIDES = (0.5, 1.0)


def _probe_sizes(height: int, width: int, sides: tuple[float, ...] = PROBE_SIDES,
                 multiple: int = 8) -> list[tuple[int, int]]:
    """By default a quarter of the area and the full size: the line through them is exact at the real size (one
    real-size forward+backward is the only way to see every kernel's workspace), the quarter gives the slope."""
    def at(fraction: float, side: int) -> int:
        return max(multiple, round(side * fraction / multiple) * multiple)
    return [(at(fraction, height), at(fraction, width)) for fraction in sides]


def resize_latent(latent: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The latent at another height and width, whatever its rank: images (batch, channels, h, w) and the video
    latents of Qwen-Image and Wan (batch, channels, frames, h, w) alike. Only the last two sides change."""
    if latent.shape[-2:] == (height, width):
        return latent
    flat = latent.reshape(-1, 1, *latent.shape[-2:])
    return F.interpolate(flat, size=(height, width), mode="nearest").reshape(*latent.shape[:-2], height, width)


def probe_activations(estimate: MemoryEstimate, step: Callable[[tuple], torch.Tensor], sample: tuple,
                      batch_size: int, device: torch.device, gradients_kept: int = 0,
                      state_held: int = 0, at_run_shape: bool = False,
                      measured: list[tuple[int, int]] | None = None,
                      sides: tuple[float, ...] = PROBE_SIDES) -> MemoryEstimate:
    """Runs forward+backward at a quarter of the area and at full size (`step(batch)`; gradients are cleared by
    the caller) and fills in activations and workspace for the real batch and latent size, and `other`: what the
    process holds beyond the estimate's terms. `gradients_kept` / `state_held`: bytes of gradients kept between
    steps (a flat gradient) and of optimizer state already allocated, both part of the probes' baseline.
    `at_run_shape`: `sample` is already the run's batch; one probe at full size measures activations and
    workspace together. `measured` gets each probe's (latent area, transient bytes) as it ends: what
    the auto-fit planner models from, also when a later probe runs out of memory. `sides`: the probes' sizes as
    fractions of the latent's sides; a single one only fills `measured` (a line needs two points)."""
    memory = device_memory(device)
    if memory is None or not memory.reset_peak():  # CPU, or an allocator without peak statistics
        return estimate
    latent, cond = sample
    height, width = latent.shape[-2:]
    points = []
    for h, w in [(height, width)] if at_run_shape else _probe_sizes(height, width, sides):
        small = resize_latent(latent, h, w)
        memory.synchronize()
        memory.empty_cache()  # the reserved growth below is then this step's own blocks, not earlier ones reused
        baseline, reserved = memory.allocated(), memory.reserved()
        memory.reset_peak()
        with memory.computing():
            step((small, cond))
        memory.synchronize()
        # What stayed allocated after the step (a library's first workspace) is not the step's transient memory.
        stayed = max(0, memory.allocated() - baseline)
        points.append((h * w, memory.peak_allocated() - baseline - stayed))
        if measured is not None:
            measured.append(points[-1])
        grown = memory.peak_allocated() - baseline
        if grown > 0:  # the last (full-size) probe's is kept
            estimate.reserve_ratio = max(1.0, (memory.peak_reserved() - reserved) / grown)
    memory.empty_cache()  # the probes' cached blocks would otherwise stay reserved next to the run's
    if len(points) < 2 and not at_run_shape:
        return estimate
    # The probe's delta holds the LoRA gradients (when backward allocates them), activations and workspace.
    new_gradients = estimate.gradients - gradients_kept
    if at_run_shape:
        estimate.activations, estimate.workspace = max(0, int(points[0][1]) - new_gradients), 0
        estimate.workspace_in_activations = True
    else:
        intercept, slope = fit_line(points)
        estimate.activations = max(0, int(slope * height * width * batch_size))
        estimate.workspace = max(0, int(intercept) - new_gradients)
    resident = estimate.frozen_weights + estimate.lora_parameters + gradients_kept + state_held
    estimate.other = max(0, memory.allocated() - resident)
    return estimate


def estimate_error(estimate: MemoryEstimate, measured_peak: int) -> str:
    total = estimate.total
    if total is None or measured_peak <= 0:
        return ""
    return (f"memory estimate check: estimated {total / GIB:.2f} GiB, measured peak "
            f"{measured_peak / GIB:.2f} GiB ({100 * (total - measured_peak) / measured_peak:+.1f}%)")

