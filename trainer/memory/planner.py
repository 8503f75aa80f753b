"""Auto-fit's choice: the fastest settings whose estimated peak fits the budget.

Auto-fit owns the memory savers. It starts from the fastest settings that keep what the user chose for the results
(optimizer family, precision, batch), then weighs the savers against each other with two models built from the
memory probes:
- memory: exact static terms per plan (weights as stored, LoRA, gradients, optimizer state), plus activations that
  fall from "no block recomputed" to "every block recomputed" as the family's cost model says each unit frees
  them (trainer/step/checkpointing.RankedUnits);
- time, relative to a step with no saver: recompute costs its share of the forward multiply-adds times what full
  checkpointing costs (RECOMPUTE_COST, measured), fp8 storage and an 8-bit optimizer a fixed share each, and a
  batch split into smaller batches with gradient accumulation (the same effective batch) what smaller batches lose
  in efficiency (BATCH_EFFICIENCY, measured).
The chosen plan is then probed for real (trainer/memory/fit.py): the models only pick, the probe decides."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..settings import BaseWeights, MemorySettings
from ..step.checkpointing import RankedUnits, units_for_share
from .ladder import EIGHT_BIT

# The step-time share each storage saver adds (H200, real ComfyUI server, SDXL 1024²: fp8 weights + AdamW8bit with
# full checkpointing ran 0.132 s/step against 0.115 with neither, 2026-12-01). Only their order against recompute
# matters: the planner takes a saver where it buys back more recompute than it costs.
FP8_COST = 0.12
EIGHT_BIT_COST = 0.02
# Full checkpointing's cost: one more forward of every unit, ~35% of a step (SDXL 1024², real server: 0.115
# against 0.085 s/step; Z-Image 0.427 against 0.307). The probe steps cannot time it: each is the first at its
# shapes and settings (first-use kernel selection), and SDXL's timed +5% against the measured +35%.
RECOMPUTE_COST = 0.35
FULL_PRECISION = {eight: full for full, eight in EIGHT_BIT.items()} | {"PagedAdamW8bit": "AdamW"}
# The streaming model (streamed weights fetched a layer ahead, on a copy stream beside compute): each streamed
# layer's fp8 weight crosses PCIe twice a step (forward, and backward's recompute: streaming recomputes every block)
# while the layer computes three times its forward (forward, recompute, input gradients); the copy costs only what
# outlasts that compute. Host-to-device copies ran ~40 GB/s (H200, SDXL's streamed rows, docs/benchmarks-history.md);
# FLUX.1-dev at 1024² does ~1.0e14 multiply-adds a step (4352 tokens x 11.9B weights, forward and input gradients) in
# its 0.448 s floor (H200, shared/ANCHORS.md): ~2.3e14 a second. Their ratio, multiply-adds per copied byte, is what
# the model needs; the GPU rows (bench.gpu_matrix flux_levers) tell how close it is.
STREAM_COPIES, STREAM_COMPUTE_PASSES = 2, 3
HIDING_MACS_PER_BYTE = 2.3e14 / 40e9
# Time per image falls with the batch as batch^-BATCH_EFFICIENCY (H200, SDXL 1024², fast: 0.0848 s/step at batch 1,
# 0.3725 at batch 8, i.e. 0.0466 per image = 8^-0.29 of batch 1's): a split to half the batch costs 2^0.29 = 1.22x
# per optimizer step, less than full checkpointing.
BATCH_EFFICIENCY = 0.29


def relaxed(memory: MemorySettings) -> tuple[MemorySettings, list[str]]:
    """The fastest settings that keep the user's results: every saver auto-fit may add is taken off (it adds back
    only what the card needs); precision, batch and the optimizer family stay. Notes say what was relaxed."""
    # prefetch_streamed: the weights auto-fit streams are fetched a layer ahead, overlapped with compute (H100,
    # FLUX.1-dev at 8 GiB: 0.8154 s/step against 1.0098 without, though the ladder then streamed 80% against 65%;
    # docs/BENCHMARKS.md "The whole card and its levers"). The ladder's last rung turns it off.
    fastest = replace(memory, gradient_checkpointing=False, checkpoint_share=1.0,
                      optimizer=FULL_PRECISION.get(memory.optimizer, memory.optimizer),
                      base_weights=BaseWeights.AS_LOADED, stream_share=1.0, activation_offload=False,
                      prefetch_streamed=True)
    relaxed_ones = [what for what, changed in (
        ("gradient checkpointing", memory.gradient_checkpointing),
        (f"{memory.optimizer} -> {fastest.optimizer}", fastest.optimizer != memory.optimizer),
        ("fp8/streamed base weights", memory.base_weights is not BaseWeights.AS_LOADED),
        ("activation offload", memory.activation_offload)) if changed]
    notes = [f"auto-fit: started from the fastest settings ({', '.join(relaxed_ones)} taken off; each comes back "
             "only if the card needs it)"] if relaxed_ones else []
    return fastest, notes


@dataclass(frozen=True)
class ActivationModel:
    """Activation bytes per image and latent element with no unit recomputed (`none`) and with every unit
    recomputed (`full`); `workspace`: per-step bytes that do not grow with the image (kernel workspaces and the LoRA
    gradients backward allocates)."""
    none: float
    full: float
    workspace: int

    def bytes(self, freed_share: float, batch_area: int) -> int:
        return int(max(self.full, self.none - (self.none - self.full) * freed_share) * batch_area)


@dataclass(frozen=True)
class Plan:
    memory: MemorySettings
    peak: int  # estimated bytes, graph pool included
    time: float  # relative to the step with no saver

    def describe(self) -> str:
        return f"~{self.peak / 2 ** 30:.2f} GiB, ~{self.time:.2f}x the step with no saver: {self.memory.describe()}"


def time_of(memory: MemorySettings, units: RankedUnits, recompute_cost: float, full_memory: MemorySettings) -> float:
    """Step time relative to no saver: recompute, plus the storage savers this plan adds over `full_memory`."""
    count = units_for_share(len(units), memory.checkpoint_share) if memory.gradient_checkpointing else 0
    time = 1.0 + recompute_cost * units.recompute_share(count)
    if memory.base_weights.fp8 and not full_memory.base_weights.fp8:
        time += FP8_COST
    if memory.optimizer != full_memory.optimizer:
        time += EIGHT_BIT_COST
    return time


def streaming_time(streamed: list[tuple[int, int]], step_macs: int, images: int = 1,
                   prefetched: bool = True) -> float:
    """Step time streaming adds, relative to the step with no saver (forward and input gradients of `step_macs`
    multiply-adds per image): each streamed layer's (weight bytes, multiply-adds per image) copy less the compute it
    runs beside (none where the copy waits on the compute stream: prefetch off). Layers whose compute outlasts their
    copy stream nearly free, which is why the family's cost model streams the most multiply-adds per byte first."""
    if step_macs <= 0:
        return 0.0
    exposed = sum(max(0.0, STREAM_COPIES * weight_bytes
                      - (STREAM_COMPUTE_PASSES * macs * images / HIDING_MACS_PER_BYTE if prefetched else 0.0))
                  for weight_bytes, macs in streamed)
    return exposed / (2 * step_macs * images / HIDING_MACS_PER_BYTE)


def splits(start: MemorySettings) -> list[MemorySettings]:
    """The user's batch and each smaller batch that divides it, with the accumulation that keeps the effective
    batch (the user's results): 4 x 1 -> 4 x 1, 2 x 2, 1 x 4."""
    return [replace(start, batch_size=batch, gradient_accumulation=start.effective_batch // batch)
            for batch in range(start.batch_size, 0, -1) if start.batch_size % batch == 0]


def shares(units: RankedUnits) -> list[float]:
    """Every distinct checkpoint share down to a single unit: 0 (off), 1/n, 2/n ... 1."""
    return [0.0] + [count / len(units) for count in range(1, len(units) + 1)]


def candidates(start: MemorySettings) -> list[MemorySettings]:
    """The storage choices the planner weighs, cheapest first: as they are, with the 8-bit optimizer, and with fp8
    weights too. Offload and streaming stay on the ladder (fit.py): they are for cards that full checkpointing
    does not fit."""
    plans = [start]
    if start.optimizer in EIGHT_BIT:
        plans.append(replace(plans[-1], optimizer=EIGHT_BIT[start.optimizer]))
    if start.base_weights is BaseWeights.AS_LOADED:
        plans.append(replace(plans[-1], base_weights=BaseWeights.FP8))
    return plans


def choose(start: MemorySettings, static_bytes: Callable[[MemorySettings], int], model: ActivationModel,
           units: RankedUnits, batch_area: int, other: int, graph_extra: Callable[[int], int], budget: float,
           recompute_cost: float, held_upcasts: Callable[[int], int] = lambda count: 0,
           images: Callable[[int], int] = lambda batch: batch) -> tuple[Plan | None, Plan | None]:
    """The fastest plan whose estimate fits `budget`, and the runner-up (the fastest with other storage or batch,
    or the next share); (None, None) when none fits. batch_area: latent elements of the start's largest batch;
    images(batch size): how many images such a batch holds (fewer where the largest bucket is smaller).
    static_bytes(plan): weights, LoRA, gradients and optimizer state; graph_extra(transient bytes): the CUDA
    graph's memory beyond the eager estimate; other: what the process holds beyond every term (measured);
    held_upcasts(count): bytes of upcast copies fp8 layers keep for backward when the first `count` units are
    recomputed (convs keep theirs; bridge/cast_weights.py), where the probes ran without fp8."""
    plans = []
    per_image = batch_area / images(start.batch_size)
    for split in splits(start):
        split_area = int(per_image * images(split.batch_size))
        split_cost = (images(start.batch_size) / images(split.batch_size)) ** BATCH_EFFICIENCY
        for storage in candidates(split):
            static = static_bytes(storage)
            upcasts_unseen = storage.base_weights.fp8 and not start.base_weights.fp8
            for share in shares(units):
                memory = replace(storage, gradient_checkpointing=share > 0, checkpoint_share=share or 1.0)
                count = units_for_share(len(units), share) if share else 0
                transient = model.bytes(units.freed_share(count), split_area) + model.workspace \
                    + (held_upcasts(count) if upcasts_unseen else 0)
                peak = static + transient + other + graph_extra(transient)
                if peak <= budget:
                    time = time_of(memory, units, recompute_cost, start) * split_cost
                    plans.append(Plan(memory, peak, time))
                    break  # larger shares of this storage only cost more time
    plans.sort(key=lambda plan: plan.time)
    return (plans[0] if plans else None), (plans[1] if len(plans) > 1 else None)
