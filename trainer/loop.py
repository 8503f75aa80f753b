"""The training loop: one readable loop; memory techniques (precision, checkpointing, accumulation) are
units plugged into it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .errors import TrainingCancelled
from .fast_path import EagerMicroStep
from .precision import Precision


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step (mean over micro-batches)
    steps_done: int = 0
    cancelled: bool = False


@dataclass
class StepInfo:
    step: int
    total: int
    loss: float
    lr: float
    seconds: float


def train_loop(params: list[torch.nn.Parameter], step_fn: Callable,
               batches: Iterator, optimizer: torch.optim.Optimizer, precision: Precision,
               steps: int, accumulation: int, should_stop: Callable[[], bool],
               on_step: Callable[[StepInfo], None] = lambda info: None,
               max_grad_norm: float | None = 1.0, first_step: int = 0,
               cancel_errors: tuple[type[BaseException], ...] = (), sync_every: int = 1,
               lr_schedule: torch.optim.lr_scheduler.LRScheduler | None = None,
               after_step: Callable[[], None] = lambda: None) -> LoopResult:
    """Runs steps first_step..steps-1 (first_step > 0 continues a run, e.g. after an OOM recovery).
    `step_fn` is a loss function (batch -> loss, run eagerly here) or a micro-step (fast_path.BatchStep: called
    with (batch, accumulation) it runs forward + backward and returns the detached loss; it also zeroes grads).
    TrainingCancelled or one of `cancel_errors` raised inside a step ends the run like a cancel between steps.
    Losses stay on the device and are read (one host sync) every `sync_every` steps; on_step then reports each
    of those steps in order (also when an exception ends the loop, so applied steps are never repeated).
    `after_step` runs right after each optimizer step, without waiting for the device (e.g. to record a CUDA
    event for timing)."""
    micro_step = step_fn if hasattr(step_fn, "zero_grad") else EagerMicroStep(step_fn, precision)
    result = LoopResult(steps_done=first_step)
    start = time.perf_counter()
    pending: list[tuple[int, torch.Tensor, float]] = []

    def report() -> None:
        if not pending:
            return
        values = torch.stack([loss for _, loss, _ in pending]).tolist()
        elapsed = time.perf_counter() - start
        for (step, _, lr), value in zip(pending, values):
            result.losses.append(value)
            result.steps_done = step
            on_step(StepInfo(step, steps, value, lr, elapsed))
        pending.clear()

    try:
        for step in range(first_step, steps):
            if should_stop():
                result.cancelled = True
                break
            step_loss = None
            try:
                for _ in range(accumulation):
                    loss = micro_step(next(batches), accumulation).float()
                    step_loss = loss if step_loss is None else step_loss + loss
            except (TrainingCancelled, *cancel_errors):
                micro_step.zero_grad(optimizer)  # a half-accumulated step is dropped, earlier ones are kept
                result.cancelled = True
                break
            if max_grad_norm:
                if precision.scaler is not None:
                    precision.scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used, for the report
            precision.step(optimizer)
            micro_step.zero_grad(optimizer)
            if lr_schedule is not None:
                lr_schedule.step()
            after_step()
            pending.append((step + 1, step_loss, lr))
            if len(pending) >= sync_every:
                report()
    finally:  # an OOM or error still reports the steps that were applied
        report()
    return result
