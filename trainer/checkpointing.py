"""Gradient checkpointing: keep only block inputs during the forward pass and recompute each block's
activations during backward, trading ~30% more compute for most of the activation memory."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, preserve_rng_state: bool):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # Non-reentrant: works with kwargs and with inputs that do not require grad (frozen base weights).
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)
    run.leanlora_checkpointed = True
    return run


def uses_randomness(module: torch.nn.Module) -> bool:
    """Whether a forward pass in training mode draws random numbers (dropout), which recomputation must replay."""
    return any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


def checkpoint_blocks(blocks: Iterable[torch.nn.Module], preserve_rng_state: bool = True) -> int:
    """Wraps each block's forward in place (on the training copy only). Returns how many were wrapped.
    preserve_rng_state=False skips saving/restoring the RNG per block: only correct without dropout, and needed
    for CUDA-graph capture (reading the CUDA RNG state is not a capturable operation)."""
    count = 0
    for block in blocks:
        if getattr(block.forward, "leanlora_checkpointed", False):
            continue  # wrapped by an earlier, smaller share: a second wrap would recompute it twice
        block.forward = _checkpointed(block.forward, preserve_rng_state)
        count += 1
    return count


# Partial checkpointing recomputes the units that free the most activation memory per recomputed multiply-add.
# The model, per unit of the ldm UNet at `tokens` positions (its output's height x width), counts what autograd
# keeps for backward inside the unit (beyond the input, which checkpointing keeps too) and what a forward costs:
#   ResBlock (C_in -> C_out): two GroupNorm -> SiLU -> conv chains, each keeping the norm's, SiLU's and conv's
#     inputs: tokens x (2 C_in + 3 C_out) saved; tokens x the convs' weight elements multiply-adds.
#   transformer layer (width D, feed-forward width F, GEGLU; frozen linears keep no input, LoRA's rank-sized
#     tensors are small): norm2's and norm3's inputs, self-attention's normed input, q, k, v and output (the
#     out-projection's input), cross-attention's normed input, q and output (and its context-sized k and v),
#     GEGLU's projection (value and gate) and gelu(gate): tokens x (10 D + 3 F) saved; tokens x the linears' weights (context tokens for
#     cross-attention's keys and values) plus 2 x tokens x (tokens + context) x D multiply-adds for the attentions.
# Per multiply-add, a ResBlock frees ~5 / (18 C), a layer 22 / (18 D + 2 tokens): lower widths (= higher
# resolutions) first. SDXL 1024² (elements per multiply-add x 1e4): layers at 64² 11.1, ResBlocks at 128² 7.2-8.7,
# layers at 32² 8.7, ResBlocks at 64² 3.6-4.5, at 32² 1.9-2.2; all units together 4.9 GiB in bf16 (full
# checkpointing measured 4.8 GiB less). Against autograd's saved tensors on CPU (pytorch SDPA, LoRA on attention)
# the saved terms are within 10%, and the linears' and convs' multiply-adds match torch's FLOP counter.
# Recompute time is taken as FLOPs (norms and activations are memory-bound, cheap beside convs and matmuls).
CONTEXT_TOKENS = 77  # one CLIP chunk: the length of the cross-attention keys and values the model assumes


def recompute_model(unit: torch.nn.Module, tokens: int) -> tuple[int, int]:
    """(activation elements that checkpointing `unit` frees, multiply-adds its recompute costs), by the model
    above; `unit` is a ResBlock, a transformer layer or a whole SpatialTransformer ("per block")."""
    if hasattr(unit, "transformer_blocks"):
        parts = [recompute_model(layer, tokens) for layer in unit.transformer_blocks]
        return sum(saved for saved, _ in parts), sum(macs for _, macs in parts)
    linears = [m for m in unit.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    if hasattr(unit, "attn1"):
        width, feed_forward = unit.attn1.to_q.in_features, unit.ff.net[-1].in_features
        context = CONTEXT_TOKENS if unit.attn2 is not None else 0
        context_side = {id(m) for projection in ((unit.attn2.to_k, unit.attn2.to_v) if context else ())
                        for m in projection.modules()}
        macs = sum(m.weight.numel() * (context if id(m) in context_side else tokens) for m in linears)
        attention = 2 * tokens * (tokens + context) * unit.attn1.to_q.out_features
        return tokens * (10 * width + 3 * feed_forward) + 2 * context * width, macs + attention
    convs = sum(m.weight.numel() for m in linears if isinstance(m, torch.nn.Conv2d))  # the time embedding is per image
    return tokens * (2 * unit.channels + 3 * unit.out_channels), tokens * convs


def most_memory_per_flop_first(units: Sequence[torch.nn.Module], tokens: Sequence[int]) -> list[torch.nn.Module]:
    """`units` ordered by activation memory freed per recomputed multiply-add (recompute_model), best first; ties
    keep the model's order."""
    def freed_per_mac(pair):
        saved, macs = recompute_model(*pair)
        return saved / max(macs, 1)
    return [unit for unit, _ in sorted(zip(units, tokens), key=freed_per_mac, reverse=True)]


def units_for_share(count: int, share: float) -> int:
    """How many of `count` units a checkpoint share recomputes: at least one, all at share 1."""
    return min(count, max(1, math.ceil(share * count - 1e-9)))  # 1e-9: 0.3 x 10 is 3.0000000000000004 in floats
