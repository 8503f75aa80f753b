"""Gradient checkpointing: keep only block inputs during the forward pass and recompute each block's
activations during backward, trading ~30% more compute for most of the activation memory. Selective
checkpointing keeps the outputs of the expensive ops (matmuls, convolutions, attention) as well and recomputes only
the cheap ones between them (norms, activations, adds): most of the FLOPs are not repeated, part of the memory
is still saved."""
from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


_UNWRAPPED = object()  # the block had no forward of its own (the class's): unwrapping deletes the wrapper
# What selective checkpointing keeps: the ops whose recompute costs FLOPs. Composite ops (linear, conv2d,
# scaled_dot_product_attention) reach the policy as these.
_ATEN = torch.ops.aten
_KEPT_OPS = frozenset(getattr(_ATEN, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward")
    if hasattr(_ATEN, name))


def _keep_expensive_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, _keep_expensive_outputs)


def _checkpointed(forward, preserve_rng_state: bool, own_forward, selective: bool):
    extra = {"context_fn": _SELECTIVE_CONTEXTS} if selective else {}

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # Non-reentrant: works with kwargs and with inputs that do not require grad (frozen base weights).
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **extra,
                          **kwargs)
    run.leanlora_checkpointed = True
    run.leanlora_selective = selective
    run.leanlora_unwrapped = own_forward
    return run


def uses_randomness(module: torch.nn.Module) -> bool:
    """Whether a forward pass in training mode draws random numbers (dropout), which recomputation must replay."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def checkpoint_blocks(blocks: Iterable[torch.nn.Module], preserve_rng_state: bool = True,
                      selective: bool = False) -> int:
    """Wraps each block's forward in place (on the training copy only). Returns how many were wrapped.
    preserve_rng_state=False skips saving/restoring the RNG per block: only correct without dropout, and needed
    for CUDA-graph capture (reading the CUDA RNG state is not a capturable operation). selective: keep the
    expensive ops' outputs, recompute the rest (a block wrapped the other way is wrapped again)."""
    count = 0
    for block in blocks:
        if getattr(block.forward, "leanlora_checkpointed", False):
            if block.forward.leanlora_selective == selective:
                continue  # wrapped by an earlier, smaller share: a second wrap would recompute it twice
            uncheckpoint_blocks([block])
        block.forward = _checkpointed(block.forward, preserve_rng_state, block.__dict__.get("forward", _UNWRAPPED),
                                      selective)
        _mark_recomputed(block, True)
        count += 1
    return count


def _mark_recomputed(block: torch.nn.Module, recomputed: bool) -> None:
    """Layers read this to choose what to keep for backward: inside a recomputed block what the recompute saves
    lives for that block's backward only, outside it until backward reaches the layer (bridge/cast_weights.py
    keeps fp8 weights there instead of their upcast copies)."""
    for module in block.modules():
        module.leanlora_recomputed = recomputed


def uncheckpoint_blocks(blocks: Iterable[torch.nn.Module]) -> int:
    """Undoes checkpoint_blocks (auto-fit gives memory back as less recompute). Returns how many were unwrapped."""
    count = 0
    for block in blocks:
        wrapper = block.__dict__.get("forward")
        if not getattr(wrapper, "leanlora_checkpointed", False):
            continue
        if wrapper.leanlora_unwrapped is _UNWRAPPED:
            del block.forward
        else:
            block.forward = wrapper.leanlora_unwrapped
        _mark_recomputed(block, False)
        count += 1
    return count


class RankedUnits(list):
    """Checkpoint units, best first, with each one's cost (activation elements checkpointing it frees, multiply-adds
    its recompute costs): what the auto-fit planner predicts a partial share's memory and time from."""

    def __init__(self, units: Sequence[torch.nn.Module], costs: Sequence[tuple[int, int]]):
        super().__init__(units)
        self.costs = list(costs)

    def freed_share(self, count: int) -> float:
        """The share of the units' activations that recomputing the first `count` frees."""
        total = sum(saved for saved, _ in self.costs)
        return sum(saved for saved, _ in self.costs[:count]) / total if total else count / max(len(self), 1)

    def recompute_share(self, count: int) -> float:
        """The share of the units' forward multiply-adds that recomputing the first `count` repeats."""
        total = sum(macs for _, macs in self.costs)
        return sum(macs for _, macs in self.costs[:count]) / total if total else count / max(len(self), 1)


def most_memory_per_flop_first(units: Sequence[torch.nn.Module],
                               costs: Sequence[tuple[int, int]]) -> RankedUnits:
    """Partial checkpointing recomputes the units that free the most activation memory per recomputed
    multiply-add first. `costs`: per unit, (activation elements checkpointing it frees, multiply-adds its
    recompute costs), from the model family's cost model (e.g. bridge/families/sd_unet.recompute_cost). Ties keep
    the model's order."""
    def freed_per_mac(pair):
        saved, macs = pair[1]
        return saved / max(macs, 1)
    ranked = sorted(zip(units, costs), key=freed_per_mac, reverse=True)
    return RankedUnits([unit for unit, _ in ranked], [cost for _, cost in ranked])


def units_for_share(count: int, share: float) -> int:
    """How many of `count` units a checkpoint share recomputes: at least one, all at share 1."""
    return min(count, max(1, math.ceil(share * count - 1e-9)))  # 1e-9: 0.3 x 10 is 3.0000000000000004 in floats
