"""The training loop: one readable loop; memory techniques (precision, checkpointing, accumulation) are
units plugged into it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .errors import TrainingCancelled
from .step.micro_steps import EagerMicroStep, MicroStep
from .step.precision import Precision


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)  # one per optimizer step (mean over micro-batches)
    steps_done: int = 0
    cancelled: bool = False
    # The first step whose loss (or, outside fp16 loss scaling, gradient) was NaN/inf: the run stopped there and
    # the LoRA weights are back at `steps_done`, the last step at which they were checked and finite.
    diverged_at: int | None = None
    loss_diverged: bool = False  # the loss itself was NaN/inf at diverged_at (else a gradient, or the weights)


class LastFiniteWeights:
    """CPU copies of the LoRA weights at the last step whose weights were checked finite. Checked and copied
    where the loop reads its losses anyway (one host sync), so a diverged run can go back to them."""

    def __init__(self, params: list[torch.nn.Parameter], step: int):
        self.params = params
        pin = any(p.is_cuda for p in params)
        self.copies = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]
        self.step = step
        self.keep(step)

    def finite(self) -> torch.Tensor:
        """On the device, no sync: whether every weight is finite (a NaN/inf anywhere makes the sum of norms so)."""
        if not self.params:
            return torch.tensor(True)
        return torch.isfinite(torch.stack(torch._foreach_norm([p.detach() for p in self.params])).sum())

    def keep(self, step: int) -> None:
        torch._foreach_copy_(self.copies, [p.detach() for p in self.params], non_blocking=True)
        self.step = step

    def restore(self) -> int:
        """Called after a host sync (so the copies are complete); returns the step the weights are from."""
        with torch.no_grad():
            for param, copy in zip(self.params, self.copies):
                param.copy_(copy)
        return self.step


@dataclass
class StepInfo:
    step: int
    total: int
    loss: float
    lr: float
    seconds: float


@dataclass
class StepParts:
    """What one optimizer step is made of: the weights it trains, the micro-step, the optimizer and precision.
    `step_fn` is a loss function (batch -> loss, run eagerly here) or a micro-step (micro_steps.BatchStep: called
    with (batch, accumulation) it runs forward + backward and returns the detached loss; it also zeroes grads)."""
    params: list[torch.nn.Parameter]
    step_fn: Callable
    optimizer: torch.optim.Optimizer
    precision: Precision
    accumulation: int = 1
    max_grad_norm: float | None = 1.0
    lr_schedule: torch.optim.lr_scheduler.LRScheduler | None = None
    # data-parallel (distributed.Distributed.reduce): (params, step loss) -> the whole batch's loss, after the
    # micro-steps and before clipping, with every rank's gradients summed into each rank's
    reduce: Callable[[list[torch.nn.Parameter], torch.Tensor], torch.Tensor] | None = None


class LoopEvents:
    """What the loop tells its caller and asks it, as one object (a run implements it: train_lora.Run). Each
    method does nothing here; the attributes say how often the loop stops for them.
    TrainingCancelled or one of `cancel_errors` raised inside a step ends the run like a cancel between steps.
    Losses stay on the device and are read (one host sync) every `sync_every` steps; `on_step` then reports each of
    those steps in order (also when an exception ends the loop, so applied steps are never repeated).
    Every `save_every` steps (the last one excepted: the caller saves the end) the pending losses are read and,
    with the weights finite, `on_save(step)` runs with everything at that step. Every `evaluate_every` steps (the
    last one excepted, as for saves) `on_evaluate(step)` runs the same way, before that step's save (so a state
    written there holds its evaluation); a Cancel inside it ends the run."""

    cancel_errors: tuple[type[BaseException], ...] = ()
    sync_every = 1
    save_every = 0
    evaluate_every = 0

    def should_stop(self) -> bool:
        return False

    def on_step_start(self, done: int) -> None:
        """Before a step draws its batches (`done` steps applied so far)."""

    def after_step(self) -> None:
        """Right after each optimizer step, without waiting for the device (e.g. to record a CUDA event)."""

    def on_step(self, info: StepInfo) -> None:
        """A step's loss, once read (in order; see sync_every)."""

    def on_evaluate(self, step: int) -> None:
        """Every evaluate_every steps (validation)."""

    def on_save(self, step: int) -> None:
        """Every save_every steps, with the weights, optimizer and RNG at that step."""


def train_loop(parts: StepParts, batches: Iterator, steps: int, events: LoopEvents | None = None,
               first_step: int = 0) -> LoopResult:
    """Runs steps first_step..steps-1 (first_step > 0 continues a run, e.g. after an OOM recovery), telling `events`
    (see LoopEvents: when it is called and what a Cancel inside a step does).
    Divergence: the first step with a NaN/inf loss (or gradient norm, outside fp16, whose loss scaler skips such
    steps itself) ends the run; the weights go back to their last copy checked finite (see LastFiniteWeights)
    and `diverged_at` names the step."""
    events = events if events is not None else LoopEvents()
    params, step_fn, optimizer, precision = parts.params, parts.step_fn, parts.optimizer, parts.precision
    accumulation, max_grad_norm, lr_schedule = parts.accumulation, parts.max_grad_norm, parts.lr_schedule
    cancel_errors, sync_every = events.cancel_errors, events.sync_every
    save_every, evaluate_every = events.save_every, events.evaluate_every
    micro_step = step_fn if isinstance(step_fn, MicroStep) else EagerMicroStep(step_fn, precision)  # a bare loss fn
    result = LoopResult(steps_done=first_step)
    start = time.perf_counter()
    pending: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []  # (step, loss, step was finite, lr)
    last_finite = LastFiniteWeights(params, first_step)

    def report() -> None:
        if not pending:
            return
        # one host sync for the losses, each step's finiteness and the weights' finiteness
        read = torch.stack([*(loss for _, loss, _, _ in pending), *(ok.float() for _, _, ok, _ in pending),
                            last_finite.finite().float()]).tolist()
        values, finite, weights_finite = read[:len(pending)], read[len(pending):-1], read[-1]
        elapsed = time.perf_counter() - start
        for (step, _, _, lr), value, ok in zip(pending, values, finite):
            if not ok:
                result.diverged_at, result.loss_diverged = step, not math.isfinite(value)
                break
            result.losses.append(value)
            result.steps_done = step
            events.on_step(StepInfo(step, steps, value, lr, elapsed))
        else:
            if weights_finite:
                last_finite.keep(pending[-1][0])
            else:  # finite losses and norms but not weights (no clipping measured them): the window's first step
                result.diverged_at = pending[0][0]
        pending.clear()

    try:
        for step in range(first_step, steps):
            if events.should_stop():
                result.cancelled = True
                break
            events.on_step_start(step)
            step_loss = None
            try:
                for _ in range(accumulation):
                    loss = micro_step(next(batches), accumulation).float()
                    step_loss = loss if step_loss is None else step_loss + loss
            except (TrainingCancelled, *cancel_errors):
                micro_step.zero_grad(optimizer)  # a half-accumulated step is dropped, earlier ones are kept
                result.cancelled = True
                break
            if parts.reduce is not None:
                step_loss = parts.reduce(params, step_loss)
            finite = torch.isfinite(step_loss)
            if max_grad_norm:
                if precision.scaler is not None:
                    precision.scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                if precision.scaler is None:  # fp16: an overflowed gradient is the scaler's to skip, not divergence
                    finite = finite & torch.isfinite(norm)
            lr = optimizer.param_groups[0]["lr"]  # the rate this step used, for the report
            precision.step(optimizer)
            micro_step.zero_grad(optimizer)
            if lr_schedule is not None:
                lr_schedule.step()
            events.after_step()
            pending.append((step + 1, step_loss, finite, lr))
            save_now = save_every and (step + 1) % save_every == 0 and step + 1 < steps
            evaluate_now = evaluate_every and (step + 1) % evaluate_every == 0 and step + 1 < steps
            if len(pending) >= sync_every or save_now or evaluate_now:
                report()
            if evaluate_now and result.diverged_at is None:
                try:
                    events.on_evaluate(step + 1)
                except (TrainingCancelled, *cancel_errors):
                    result.cancelled = True
                    break
            if save_now and result.diverged_at is None:
                events.on_save(step + 1)
            if result.diverged_at is not None:
                break
    finally:  # an OOM or error still reports the steps that were applied
        report()
        if result.diverged_at is not None:
            result.steps_done = last_finite.restore()  # never hand on the non-finite weights
    return result
