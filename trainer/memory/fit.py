"""Fitting a run to a card before step 1 and recovering from out-of-memory during it: the card's budget, the
static plan (weights, LoRA and optimizer before anything reaches the GPU), the planner's choice verified by probes,
and the ladder walk that follows where the choice did not fit."""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Protocol

import torch

from ..errors import LeanLoRAError, is_out_of_memory, one_line
from ..optimizers import optimizer_state_bytes
from ..settings import AutoFit, BaseWeights, MemorySettings
from ..step.frozen_weights import park_frozen_on_cpu, place_on_device
from ..step.micro_steps import GraphDoesNotFit
from ..device.allocator import memory_limit, trim_graph_memory
from ..device.card import device_memory
from ..step.precision import DTYPES
from ..step.probe_steps import ProbeSteps
from .estimate import GIB, PROBE_SIDES, MemoryEstimate
from .host_ram import next_rung_for
from .ladder import next_rung, streaming_described, streams_more
from .planner import RECOMPUTE_COST, ActivationModel, Plan, choose, relaxed, streaming_time


class FitTarget(ProbeSteps, Protocol):
    """What fitting and recovery read and drive of a training session (TrainingSession satisfies it): the narrow
    interface the session hands down instead of itself, so memory/ never imports the session. Besides the probe
    steps: moving to settings, estimating them, the checkpoint units, and the state those leave."""

    memory: MemorySettings  # the settings configured now
    unplaced: BaseException | None  # the out-of-memory error that kept the frozen weights off the device, if any
    adapter: Any  # model.ModelAdapter: its device and projected_weight_bytes
    unet: Any  # the training copy (torch.nn.Module)
    params: list  # the LoRA parameters
    micro_step: Any  # step.micro_steps.MicroStep: budget, extra_memory, graphs
    precision: Any  # step.precision.Precision: the compute dtype
    text_encoder: Any  # text_encoder.TrainedTextEncoder or None (text_encoder_lr)
    train: Any  # settings.TrainSettings (ema_decay)
    ema: Any  # ema.LoraEMA or None
    estimated_peak: int | None  # the estimate's total before step 1
    host_ram: Any  # memory.host_ram.HostRamPlan or None: the ladder leaves out what its limit cannot hold

    def configure(self, memory: MemorySettings) -> None:
        """Moves to `memory` (TrainingSession.INSTALL_ORDER)."""

    def estimate(self, raise_oom: bool = False, measured: list | None = None,
                 sides: tuple[float, ...] = PROBE_SIDES) -> MemoryEstimate:
        """Exact static terms plus probed activations of the settings configured now."""

    def checkpoint_units(self, depth) -> Any:
        """The family's checkpoint units for the largest sample, best first (step.checkpointing.RankedUnits)."""

FIT_HEADROOM = 0.92  # the caching allocator reserves more than it hands out; leave it room
STATIC_SHARE = 0.75  # weights + LoRA + optimizer may take this share of a budget before activations are probed
# Before step 1 the streaming share is sized in hundredths of the fp8 weights (largest layers first), not the
# ladder's fifths: on Qwen-Image at 8 GiB the fifths streamed every weight where 80% was 0.34 GiB over the budget,
# and each streamed byte crosses PCIe twice a step. STREAM_SLACK: what a share sized from a probe keeps in hand for
# the next probe's noise (allocator rounding, the graph pool's share of a slightly different step), at most
# STREAM_SLACK_SHARE of the budget (a card of a few MiB in the CPU tests would otherwise stream every weight).
STREAM_UNIT = 0.01
STREAM_SLACK = 64 * 2 ** 20
STREAM_SLACK_SHARE = 0.02
PROBE_OOM_STREAM_STEP = 0.05  # a probe that ran out of memory: the next streaming share, a probe each


def recover(session: FitTarget, error: BaseException, device: torch.device) -> str:
    """Frees what the failed step held, then takes one rung down the ladder (or re-raises at the bottom; a graph
    that does not fit then gives way to eager steps)."""
    session.free_failed_step(error)
    rung = next_rung_for(session)  # within the host RAM limit
    if rung is None:
        if isinstance(error, GraphDoesNotFit):
            session.micro_step.run_eagerly(f"fast path: CUDA graphs off: {error}, and no memory setting is left to "
                                           "trade for it; steps run eagerly")
            return "steps run eagerly (nothing left on the memory ladder to make room for the CUDA graph)"
        raise error
    memory, description = rung
    if isinstance(error, GraphDoesNotFit):
        memory, description = unit_for_graph(session, memory, description, error.shortfall)
    lines = configure_placed(session, memory)
    return "; ".join([description, *lines])


def unit_for_graph(session: FitTarget, rung: MemorySettings, description: str,
                   shortfall: int) -> tuple[MemorySettings, str]:
    """Where the CUDA graph's pool, as sized at capture, leaves the plan `shortfall` bytes short, the ladder's rung
    moves a share by one unit, not a fifth: one checkpoint unit more, or the streamed hundredths that free the
    shortfall (FLUX.1 at 8 GiB went from 60% to 80% streamed for a 0.52 GiB graph margin). Other rungs as they are."""
    memory = session.memory
    if streams_more(memory, rung) and shortfall > 0:
        sized, words = stream_enough(session, rung, shortfall, session.micro_step.budget or 0)
        return sized, f"{words} (sized to the CUDA graph's pool)"
    before = memory.checkpoint_share if memory.gradient_checkpointing else 0.0
    if rung.gradient_checkpointing and rung.checkpoint_share > before:
        share = min(1.0, before + 1 / len(session.checkpoint_units(rung.checkpoint_depth)))
        return (replace(rung, checkpoint_share=share),
                f"gradient checkpointing {before:.0%} -> {share:.0%} of the blocks (one unit more for the CUDA "
                "graph's pool)")
    return rung, description


def graph_words(session: FitTarget, extra: int) -> str:
    """The fit's words for the CUDA graph's part of a peak: its bytes, and whether its pool's size was measured at
    a capture, modelled from the probe or the fallback (step.micro_steps.GraphPoolSize)."""
    pool = getattr(session.micro_step, "pool_size", None)
    return f"{extra / GIB:.2f} GiB for the CUDA graph" + (f" (its pool {pool.source()})" if pool is not None else "")


def configure_placed(session: FitTarget, memory: MemorySettings) -> list[str]:
    """Configures `memory`; where placing the frozen weights on the device runs out of memory, takes the next rung
    that stores less (fp8, streaming more) until they are placed. Out of memory while placing is a rung, not an
    error: on a real card the driver, not the plan, has the last word (fragmentation, other programs). Raises the
    last out-of-memory error where no rung is left."""
    lines = []
    session.configure(memory)
    while session.unplaced is not None:
        rung = next_static_rung(session.memory, session.adapter.device)
        if rung is None:
            raise session.unplaced
        lines.append(f"auto-fit: placing the frozen weights ran out of memory ({one_line(session.unplaced)}) -> "
                     f"{rung[1]}")
        session.configure(rung[0])
    return lines


def next_static_rung(memory: MemorySettings, device: torch.device) -> tuple[MemorySettings, str] | None:
    """The next rung that can shrink weights, LoRA or optimizer state. Checkpointing and batch-split rungs trade
    activations only: skipped here, they stay for the probes and the planner (fit_to_card), so a card that needs fp8
    weights gets fp8 with as little checkpointing and as large a batch as its activations allow, not fp8 with every
    block recomputed at batch 1. Activation offload moves activations only: skipped too (on Qwen-Image at 24 GiB the
    static plan took it, and its copies then shared PCIe with the streamed weights every step)."""
    walked = memory
    while True:
        rung = next_rung(walked, device)
        if rung is None:
            return None
        walked, description = rung
        kept = replace(walked, gradient_checkpointing=memory.gradient_checkpointing,
                       checkpoint_share=memory.checkpoint_share, batch_size=memory.batch_size,
                       gradient_accumulation=memory.gradient_accumulation,
                       activation_offload=memory.activation_offload)
        if kept != memory:
            return kept, description


def static_bytes(memory: MemorySettings, weight_bytes: Callable[[torch.dtype, BaseWeights, float], int],
                 params: list, ema: bool = False) -> int:
    """Device bytes of frozen weights (as `memory` stores them), fp32 LoRA, its gradients and the optimizer's state,
    and with `ema` the fp32 average of the LoRA weights (ema.LoraEMA)."""
    dtype = DTYPES[memory.mixed_precision] or torch.float32
    lora = sum(p.numel() * 4 for p in params)
    return weight_bytes(dtype, memory.base_weights, memory.stream_share) + (3 if ema else 2) * lora + \
        optimizer_state_bytes(memory.optimizer, params)


def smallest_stream_share(fits: Callable[[float], bool], above: float) -> float:
    """The smallest streaming share, in STREAM_UNITs above `above` (a share known not to fit; 0: nothing streamed),
    for which fits(share) holds; 1 where none does. Bisection: a larger share streams a superset of the layers
    (cast_weights.streamed_layers), so what fits at one share fits at every larger one."""
    low, high = round(above / STREAM_UNIT), round(1 / STREAM_UNIT)
    if low >= high or not fits(1.0):
        return 1.0
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle * STREAM_UNIT):
            high = middle
        else:
            low = middle
    return round(high * STREAM_UNIT, 2)


def sized_stream_rung(memory: MemorySettings, rung: MemorySettings,
                      fits: Callable[[float], bool]) -> tuple[MemorySettings, str]:
    """`rung` (streaming more than `memory` does) at the smallest share above memory's for which fits(share) holds,
    and the report's words for it."""
    before = memory.stream_share if memory.base_weights.streamed else None
    share = smallest_stream_share(fits, before or 0.0)
    return replace(rung, stream_share=share), streaming_described(before, share)


def plan_static(memory: MemorySettings, weight_bytes: Callable[[torch.dtype, BaseWeights, float], int], params: list,
                budget: int, device: torch.device, card: int | None = None,
                ema: bool = False) -> tuple[MemorySettings, list[str]]:
    """Before anything is placed on the GPU: walk the ladder until weights, LoRA, gradients and optimizer state
    leave room for activations. A model larger than the budget never has to be loaded to find that out.
    weight_bytes(compute dtype, base weights, stream share): device bytes the frozen weights would take (the model
    adapter's projected_weight_bytes)."""
    lines = []
    while True:
        static = static_bytes(memory, weight_bytes, params, ema)
        if static <= budget * STATIC_SHARE:
            return memory, lines
        rung = next_static_rung(memory, device)
        if rung is None:
            if card is not None and static > budget:
                outside = card - budget
                smallest = -(-(static / STATIC_SHARE + outside) // GIB)  # GiB, rounded up
                raise LeanLoRAError(
                    f"auto-fit: this model does not fit a {card / GIB:.1f} GiB card even with the leanest settings "
                    f"({memory.describe()}): weights, LoRA and optimizer alone take {static / GIB:.2f} GiB and "
                    f"{outside / GIB:.2f} GiB of the card is held outside training (CUDA context, libraries). The "
                    f"smallest card it trains on is about {smallest:.0f} GiB: raise auto_fit, or free VRAM")
            return memory, lines
        walked, description = rung
        if streams_more(memory, walked):  # to the hundredth the budget needs, not the ladder's next fifth
            walked, description = sized_stream_rung(memory, walked, lambda share: static_bytes(
                replace(walked, stream_share=share), weight_bytes, params, ema) <= budget * STATIC_SHARE)
        lines.append(f"auto-fit: weights, LoRA and optimizer alone would take {static / GIB:.2f} GiB of the "
                     f"{budget / GIB:.2f} GiB budget -> {description}")
        memory = walked


class Probe:
    """One estimate of the session's current settings under the card's cap: `estimate` is None where even the
    probe ran out of memory; `measured` holds each probe step that ended, (latent area, transient bytes)."""

    def __init__(self, session: FitTarget, card: CardBudget, sides: tuple[float, ...] = PROBE_SIDES):
        self.measured: list[tuple[int, int]] = []
        self.budget = card.usable()
        try:
            with probes_capped_at(self.budget, session.adapter.device):
                self.estimate = session.estimate(raise_oom=True, measured=self.measured, sides=sides)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            session.free_failed_step(error)  # its traceback holds the probe's activations: the next probe needs them
            self.estimate = None
        if self.estimate is not None and self.estimate.total is None:  # a single size measures no line
            self.estimate = None
        self.budget = card.usable()  # again: the probe loaded library kernels outside PyTorch
        self.extra = session.micro_step.extra_memory(self.estimate) if self.estimate is not None else 0
        session.micro_step.budget = self.budget

    @property
    def peak(self) -> int | None:
        return None if self.estimate is None else self.estimate.total + self.extra

    def fits(self) -> bool:
        return self.peak is not None and self.peak <= self.budget * FIT_HEADROOM

    def why_not(self) -> str:
        return "the probe ran out of memory" if self.peak is None else f"estimated {self.peak / GIB:.2f} GiB"


def activation_model(none: Probe, full: Probe) -> ActivationModel | None:
    """Activation bytes per latent element with no unit and with every unit recomputed, from the two probes; None
    where the every-unit probe, or even the no-recompute probe's quarter-size step, ran out of memory."""
    if full.estimate is None or len(full.measured) < 2 or not none.measured:
        return None
    (area_q, bytes_q), (area_f, bytes_f) = full.measured
    slope_full = (bytes_f - bytes_q) / (area_f - area_q)
    intercept = bytes_f - slope_full * area_f  # per-step workspace, LoRA gradients included
    if len(none.measured) == 2:
        (area_a, bytes_a), (area_b, bytes_b) = none.measured
        slope_none = (bytes_b - bytes_a) / (area_b - area_a)
    else:  # the full-size step ran out of memory: the quarter one and the workspace measured above
        area_a, bytes_a = none.measured[0]
        slope_none = (bytes_a - intercept) / area_a
    return ActivationModel(none=max(slope_none, slope_full), full=slope_full, workspace=full.estimate.workspace)


def fit_to_card(session: FitTarget, memory: MemorySettings,
                card: CardBudget) -> tuple[MemoryEstimate, list[str]]:
    """Configures the session with the fastest settings that fit the card and returns their estimate:
    1. the fastest settings that keep the user's results (planner.relaxed), with storage savers only as far as
       weights, LoRA and optimizer must leave room for activations (plan_static);
    2. probed as they are: if they fit, done;
    3. probed with every unit recomputed; from the two probes the planner picks the fastest plan that fits
       (a partial checkpoint share, with the 8-bit optimizer or fp8 weights where they buy back recompute), and
       that plan is probed for real, its share raised until the probe fits;
    4. where full checkpointing does not fit either, the ladder goes on (offload, streaming)."""
    device, params = session.adapter.device, session.params
    memory, lines = relaxed(memory)
    encoder = session.text_encoder.resident_bytes() if session.text_encoder is not None else 0  # text_encoder_lr
    weight_bytes = lambda dtype, base, share: session.adapter.projected_weight_bytes(  # noqa: E731
        session.unet, dtype, base, share) + encoder
    memory, static_lines = plan_static(memory, weight_bytes, params, card.usable(), device, card.card,
                                       ema=bool(session.train.ema_decay))
    lines += static_lines
    lines += configure_placed(session, memory)
    fastest = Probe(session, card)
    if fastest.fits():
        how = "as planned" if session.memory.gradient_checkpointing else "with no recompute"
        lines.append(f"auto-fit: estimated peak {fastest.peak / GIB:.2f} GiB fits the {fastest.budget / GIB:.2f} GiB "
                     f"budget {how}: {session.memory.describe()}")
        return fastest.estimate, lines
    if session.memory.base_weights.streamed:  # streaming recomputes every block: no share to choose
        estimate, ladder_lines = walk_ladder(session, card)
        return estimate, lines + ladder_lines
    if not fastest.measured and not session.memory.gradient_checkpointing:
        # Even the quarter-size step ran out of memory: a sixteenth of the area still gives the slope
        fastest.measured = Probe(session, card, sides=(0.25,)).measured
    lines += configure_placed(session, replace(session.memory, gradient_checkpointing=True, checkpoint_share=1.0))
    full = Probe(session, card)
    model = activation_model(fastest, full)
    if model is not None:
        best, runner_up = choose_plan(session, model, full, weight_bytes)
        if best is not None:
            lines.append(f"auto-fit: {fastest.why_not()} with no recompute > the {fastest.budget / GIB:.2f} GiB "
                         f"budget; the planner chose {best.describe()}"
                         + (f"; runner-up {runner_up.describe()}" if runner_up else ""))
            estimate, verify_lines = verify(session, best.memory, card)
            lines += verify_lines
            if estimate is not None:
                return estimate, lines
    elif full.fits():
        lines.append(f"auto-fit: estimated peak {full.peak / GIB:.2f} GiB fits the {full.budget / GIB:.2f} GiB budget "
                     f"with every block recomputed (no model of partial shares: with no recompute even a step at a "
                     f"sixteenth of the image's area ran out of memory): {session.memory.describe()}")
        return full.estimate, lines
    estimate, ladder_lines = walk_ladder(session, card)
    return estimate, lines + ladder_lines


def choose_plan(session: FitTarget, model: ActivationModel, full: Probe,
                weight_bytes: Callable[[torch.dtype, BaseWeights, float], int]) -> tuple[Plan | None, Plan | None]:
    """The planner's choice from the session's settings (storage as configured, recompute free to move)."""
    params, memory = session.params, session.memory
    dtype = DTYPES[memory.mixed_precision] or torch.float32
    units = session.checkpoint_units(memory.checkpoint_depth)
    conv_bytes = [sum(m.weight.numel() for m in unit.modules() if isinstance(m, torch.nn.Conv2d)
                      and not m.weight.requires_grad) * dtype.itemsize for unit in units]

    latent = session.largest_batch()[0]
    batch_area = latent.shape[-2] * latent.shape[-1] * session.run_batch_size()
    graph_extra = lambda transient: session.micro_step.extra_memory(  # noqa: E731
        MemoryEstimate(0, 0, 0, 0, activations=transient, workspace=0))
    other = full.estimate.other  # what the probe measured beyond its own terms stays
    return choose(replace(memory, gradient_checkpointing=False),
                  lambda plan: static_bytes(plan, weight_bytes, params, session.ema is not None), model, units,
                  batch_area, other,
                  graph_extra, full.budget * FIT_HEADROOM, RECOMPUTE_COST,
                  held_upcasts=lambda count: sum(conv_bytes[count:]), images=session.run_batch_size)


def verify(session: FitTarget, memory: MemorySettings,
           card: CardBudget) -> tuple[MemoryEstimate | None, list[str]]:
    """Probes the planner's choice; where it does not fit, recomputes a tenth more of the units and probes again,
    up to every unit. None (settings left at full recompute) where even that does not fit."""
    lines = []
    while True:
        lines += configure_placed(session, memory)
        memory = session.memory  # a rung further where placing ran out of memory
        probe = Probe(session, card)
        if probe.fits():
            lines.append(f"auto-fit: probed {probe.peak / GIB:.2f} GiB"
                         + (f" (with {graph_words(session, probe.extra)})" if probe.extra else "")
                         + f", fits the {probe.budget / GIB:.2f} GiB budget with: {session.memory.describe()}")
            return probe.estimate, lines
        if memory.gradient_checkpointing and memory.checkpoint_share >= 1:
            lines.append(f"auto-fit: the planner's choice probed {probe.why_not()} > the {probe.budget / GIB:.2f} "
                         "GiB budget even with every block recomputed; the ladder goes on")
            return None, lines
        unit = 1 / len(session.checkpoint_units(memory.checkpoint_depth))
        share = min(1.0, (memory.checkpoint_share if memory.gradient_checkpointing else 0.0) + unit)
        lines.append(f"auto-fit: the planner's choice probed {probe.why_not()} > the {probe.budget / GIB:.2f} GiB "
                     f"budget -> gradient checkpointing for {share:.0%} of the blocks (one unit more)")
        memory = replace(memory, gradient_checkpointing=True, checkpoint_share=share)


def walk_ladder(session: FitTarget, card: CardBudget | int) -> tuple[MemoryEstimate, list[str]]:
    """Walks the memory ladder from the session's settings until the estimated peak fits the card (re-measured
    after every probe: the probes load library kernels that take device memory outside PyTorch)."""
    device, lines = session.adapter.device, []
    while True:
        try:
            with probes_capped_at(card if isinstance(card, int) else card.usable(), device):
                estimate = session.estimate(raise_oom=True)
            total = estimate.total
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            # its traceback holds the probe's activations and autograd graph: on a small card they are what the
            # next rung's probe needs
            session.free_failed_step(error)
            estimate, total = None, None  # even the small probe did not fit
        budget = card if isinstance(card, int) else card.usable()
        session.micro_step.budget = budget
        # Losing CUDA graphs costs more speed (4-6x at batch 1) than any rung, so their pool counts in the fit.
        extra = session.micro_step.extra_memory(estimate) if total is not None else 0
        if total is not None and total + extra <= budget * FIT_HEADROOM:
            lines.append(f"auto-fit: estimated peak {(total + extra) / GIB:.2f} GiB"
                         + (f" (with {graph_words(session, extra)})" if extra else "")
                         + f" fits the {budget / GIB:.2f} GiB budget with: {session.memory.describe()}")
            return estimate, lines
        rung = next_rung_for(session, estimate)  # within the host RAM limit
        if rung is None:
            if total is not None and total <= budget * FIT_HEADROOM:
                lines.append(f"auto-fit: estimated peak {total / GIB:.2f} GiB fits the {budget / GIB:.2f} GiB budget "
                             f"only without CUDA graphs; with: {session.memory.describe()}")
            else:
                lines.append("auto-fit: nothing left to trade for memory; training starts and OOM recovery stays on")
            return estimate or session.estimate(), lines
        why = (f"estimated {total / GIB:.2f} GiB" + (f" + {graph_words(session, extra)}" if extra else "")
               if total is not None else "the probe ran out of memory")
        memory, description = rung
        if total is not None and streams_more(session.memory, memory):
            memory, description = stream_enough(session, memory, total + extra - budget * FIT_HEADROOM, budget)
        elif streams_more(session.memory, memory) and session.memory.base_weights.streamed:
            memory, description = probe_oom_stream_rung(session.memory, memory)
        if streams_more(session.memory, memory):
            description += streaming_time_words(session, memory)
        lines.append(f"auto-fit: {why} > budget -> {description}")
        lines += configure_placed(session, memory)


def probe_oom_stream_rung(memory: MemorySettings, rung: MemorySettings) -> tuple[MemorySettings, str]:
    """A probe that ran out of memory with part of the weights streamed measured nothing to size the next share
    from: it streams PROBE_OOM_STREAM_STEP more, not the ladder's fifth (H100, FLUX.1-dev at 8 GiB with the prefetch:
    60% ran out of memory and the fifth streamed 80%)."""
    share = min(rung.stream_share, round(memory.stream_share + PROBE_OOM_STREAM_STEP, 2))
    return replace(rung, stream_share=share), streaming_described(memory.stream_share, share)


def stream_enough(session: FitTarget, rung: MemorySettings, overshoot: float,
                  budget: int) -> tuple[MemorySettings, str]:
    """The streaming rung sized to the probe: the smallest share (in STREAM_UNITs, above the session's) whose
    frozen weights take `overshoot` bytes (+ the slack) fewer on the device than the session's do. The
    activations, workspace and graph pool the probe measured stay as they were: streaming moves weights only."""
    memory, adapter, unet = session.memory, session.adapter, session.unet
    dtype = DTYPES[memory.mixed_precision] or torch.float32
    now = adapter.projected_weight_bytes(unet, dtype, memory.base_weights, memory.stream_share)
    target = now - overshoot - min(STREAM_SLACK, STREAM_SLACK_SHARE * budget)
    return sized_stream_rung(memory, rung, lambda share: adapter.projected_weight_bytes(
        unet, dtype, rung.base_weights, share) <= target)


def streaming_time_words(session: FitTarget, memory: MemorySettings) -> str:
    """The report's words for what streaming at `memory` costs by the planner's streaming model (per streamed layer:
    its copy less the compute it hides behind), where the adapter gives the model's terms (ModelAdapter)."""
    costs = getattr(session.adapter, "stream_costs", None)
    if costs is None:
        return ""
    streamed, step_macs = costs(session.unet, memory.stream_share)
    if not step_macs:
        return ""
    time = streaming_time(streamed, step_macs, session.run_batch_size(memory.batch_size), memory.prefetch_streamed)
    return f" (by the streaming model ~+{time:.2f}x the step's time)"


@contextlib.contextmanager
def probes_capped_at(budget: int, device: torch.device):
    """PyTorch's allocator may hand out at most `budget` bytes meanwhile: a probe of settings that do not fit runs
    out of memory at the budget, as it would on the card, instead of taking whatever the GPU has (an 8 GiB card
    emulated on an H200 peaked at 9.4 GiB device-level in a probe that failed only at the process's own cap)."""
    memory = device_memory(device)
    if memory is None or (not memory.simulated and not hasattr(torch.cuda, "get_per_process_memory_fraction")):
        yield
        return
    # Where PyTorch cannot tell the cap (ComfyUI 0.33), none is assumed: the probes are capped all the same and
    # the process is left uncapped after them, as an unemulated card is.
    before = memory.fraction() or 1.0
    memory.set_fraction(min(before, max(budget, 1) / memory.total()))
    try:
        yield
    finally:
        memory.set_fraction(before)


class CardBudget:
    """What an auto_fit setting means on the device: a card of N GiB ('N GiB'), or the card as it is now minus
    ComfyUI's own reserve ('free VRAM'). The whole process must fit it, as NVML sees it: so what the process holds
    outside PyTorch's allocator (the CUDA context, library kernels loaded on first use, other programs on the card)
    comes off it, measured again whenever asked (probe steps load more kernels)."""

    # Kept free beyond what is measured: probes stopped at the cap still peaked above the card, NVML, H200 (1 Dec
    # 2026): 0.094-0.098 GiB under cudaMallocAsync on 2-8 GiB cards (its fraction cap counts the bytes PyTorch
    # handed out, the driver's pool holds whole chunks around them), 0.07 GiB under the native allocator on 6 GiB
    # (library workspaces a probe step loads on first use, after the budget was measured).
    MARGIN = 160 * 2 ** 20

    def __init__(self, card: int, device: torch.device):
        self.card, self.device = card, device

    @staticmethod
    def outside_torch(device: torch.device) -> int:
        """Device memory in use that PyTorch's allocator does not hold: context, modules, other processes."""
        memory = device_memory(device)
        free, total = memory.free_and_total()
        return max(0, total - free - memory.reserved())

    @property
    def margin(self) -> int:
        """MARGIN on a real card; a CPU test's simulated card has no allocator rounding to keep room for."""
        memory = device_memory(self.device)
        return memory.rounding_margin if memory.simulated else self.MARGIN

    def usable(self) -> int:
        """Bytes training's own allocations (the estimate's total) may take now."""
        return max(0, self.card - self.outside_torch(self.device) - self.margin)


def card_budget(auto_fit: AutoFit, device: torch.device, comfy_reserve: int = 0) -> CardBudget | None:
    """The budget an auto_fit setting names (a card size or the free VRAM), None when off or not on CUDA.
    comfy_reserve: the VRAM ComfyUI keeps free for itself (--reserve-vram)."""
    memory = device_memory(device)
    if not auto_fit.on or memory is None:
        return None
    # What only waits to be reused counts as free: a re-queue plans the card the first job planned (the graph
    # pool a finished run left behind measured as "outside PyTorch" otherwise).
    memory.empty_cache()
    trim_graph_memory(device)
    if auto_fit.free_vram:
        _, total = memory.free_and_total()
        return CardBudget(total - comfy_reserve, device)
    return CardBudget(int(auto_fit.card_gib * GIB), device)


def budget_bytes(auto_fit: AutoFit, device: torch.device, comfy_reserve: int = 0) -> int | None:
    """Bytes training's own allocations may take now under an auto_fit setting (see CardBudget)."""
    budget = card_budget(auto_fit, device, comfy_reserve)
    return None if budget is None else budget.usable()


# Beside ComfyUI's copy of the model, what its sampler and VAE decode take at sample sizes (SDXL 1024²: ~1 GiB)
SAMPLING_WORKSPACE = 1 * GIB


@contextlib.contextmanager
def room_for_sampling(session: FitTarget):
    """While ComfyUI renders samples mid-run it loads its own copy of the model beside the training copy.
    Where the budget has no room for both (auto-fit), the training copy's frozen weights wait in CPU RAM
    meanwhile and the CUDA graphs are captured again afterwards (they replay fixed addresses): a second or
    two per sampling, instead of a sampler that overflows the card. Yields whether it made room."""
    device, budget = session.adapter.device, getattr(session.micro_step, "budget", None)
    if device_memory(device) is None or budget is None or session.estimated_peak is None:
        yield False
        return
    dtype = session.precision.compute_dtype
    comfy_model = session.adapter.projected_weight_bytes(session.unet, dtype, BaseWeights.AS_LOADED, 1.0)
    if session.estimated_peak + comfy_model + SAMPLING_WORKSPACE <= budget:
        yield False
        return
    session.micro_step.forget_graphs()
    park_frozen_on_cpu(session.unet)
    try:
        yield True
    finally:
        place_on_device(session.unet, device)


def keep_graphs_within_limit(session: FitTarget, estimate: MemoryEstimate) -> None:
    """Before step 1: where the budget or the process's cap leaves no room for the CUDA graphs' extra memory, steps
    run eagerly from the start (a failed capture under a cap can leave memory behind)."""
    micro_step = session.micro_step
    if not micro_step.graphed or micro_step.disabled or estimate.total is None:
        return
    limit = memory_limit(session.adapter.device, micro_step.budget)
    need = estimate.total + micro_step.extra_memory(estimate)
    if limit is not None and need > limit * 0.95:
        micro_step.run_eagerly(f"fast path: CUDA graphs off: with their extra memory (~{need / GIB:.2f} GiB "
                               f"expected) the run would not fit the {limit / GIB:.2f} GiB limit; steps run eagerly")
