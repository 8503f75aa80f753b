"""The memory ladder: the order in which settings give up speed for memory. OOM recovery walks it one rung at a
time during a run; every rung keeps the effective batch and what has been learned."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..settings import BaseWeights, LoraWeights, MemorySettings
from ..device.card import is_gpu

EIGHT_BIT = {"AdamW": "AdamW8bit", "Lion": "Lion8bit"}
# Gradient checkpointing in steps of a fifth of the units, those that free the most memory per recomputed FLOP
# first (trainer/step/checkpointing.py): a card that needs only part of the activations gone keeps most of the speed
# (full checkpointing: ~1.36x an SDXL step). SDXL 1024², by that model: 0.2 frees 31% of the activations for 24%
# of the recompute, 0.4 49% for 42%, 0.6 69% for 61%, 0.8 88% for 79%.
CHECKPOINT_SHARES = (0.2, 0.4, 0.6, 0.8, 1.0)
# Streaming in steps of a fifth of the fp8 weights, cheapest first (bridge/cast_weights.streamed_layers: the most
# compute per weight byte by the family's cost model, the largest layers among equals): each streamed
# byte crosses PCIe twice per step (forward and recompute), so a card that needs only part of the weights off the
# GPU pays only for that part (SDXL 1024² on an H200, every weight streamed: ~0.13 s of a 0.28 s step). These
# fifths are the rungs of OOM recovery mid-run; before step 1 auto-fit sizes the share to the hundredth from the
# static plan and the probes (memory/fit.py, STREAM_UNIT).
STREAM_SHARES = (0.2, 0.4, 0.6, 0.8, 1.0)


def bf16_supported(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def cpu_computes_natively(mode: str) -> bool:
    """Whether this CPU has bf16/fp16 instructions (AVX512-BF16, AMX, AVX512-FP16). Without them PyTorch emulates
    16-bit convolutions: an SDXL-shaped conv's forward+backward takes ~28 s in bf16 or fp16 against 0.16 s in fp32
    on an AVX2 EPYC, which is why ComfyUI never runs bf16 on a CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported() if mode == "bf16"
                    else torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a PyTorch without these private checks: keep what was asked
        return True


def resolve_for_device(memory: MemorySettings, device: torch.device) -> tuple[MemorySettings, list[str]]:
    """Settings the device cannot run become the closest ones it can, with a note for the report."""
    notes = []
    if memory.mixed_precision == "bf16" and not bf16_supported(device):
        memory = replace(memory, mixed_precision="fp16", lora_weights=LoraWeights.FP32)
        notes.append("this GPU has no bf16: using fp16 with loss scaling (and fp32 LoRA weights) instead")
    if device.type == "cpu" and memory.mixed_precision != "no" and not cpu_computes_natively(memory.mixed_precision):
        notes.append(f"this CPU has no {memory.mixed_precision} instructions (PyTorch would emulate them, ~100x "
                     f"slower): training in fp32 instead, as ComfyUI computes on a CPU")
        memory = replace(memory, mixed_precision="no", lora_weights=LoraWeights.FP32)
    return memory, notes


def next_rung(memory: MemorySettings, device: torch.device) -> tuple[MemorySettings, str] | None:
    """One step down the ladder that can be taken mid-run, or None when nothing is left."""
    if memory.batch_size > 1:
        accumulation = memory.batch_size * memory.gradient_accumulation
        return (replace(memory, batch_size=1, gradient_accumulation=accumulation),
                f"batch {memory.batch_size} -> 1 with gradient accumulation {accumulation} "
                f"(effective batch stays {accumulation})")
    if memory.mixed_precision == "no":
        mode = "bf16" if bf16_supported(device) else "fp16"
        return replace(memory, mixed_precision=mode), f"mixed precision off -> {mode}"
    if memory.gradient_checkpointing and memory.selective_recompute:
        # what selective recompute keeps (every recomputed block's matmul and attention outputs) is not in
        # auto-fit's model: taken first, before any storage saver (H100, SDXL at 8 GiB: with it kept the ladder
        # streamed every weight, 2.91x uncapped, against 1.27x without it)
        return (replace(memory, selective_recompute=False),
                "selective recompute off: recomputed blocks recompute their matmuls and attention too")
    if not memory.gradient_checkpointing:
        share = CHECKPOINT_SHARES[0]
        return (replace(memory, gradient_checkpointing=True, checkpoint_share=share),
                f"gradient checkpointing on for {share:.0%} of the blocks")
    if memory.checkpoint_share < 1:
        share = next(s for s in CHECKPOINT_SHARES if s > memory.checkpoint_share)
        return (replace(memory, checkpoint_share=share),
                f"gradient checkpointing {memory.checkpoint_share:.0%} -> {share:.0%} of the blocks"
                if share < 1 else "gradient checkpointing on for every block")
    if memory.optimizer in EIGHT_BIT:
        target = EIGHT_BIT[memory.optimizer]
        return (replace(memory, optimizer=target),
                f"optimizer {memory.optimizer} -> {target} (optimizer moments restart; LoRA weights are kept)")
    if memory.base_weights is BaseWeights.AS_LOADED:
        return replace(memory, base_weights=BaseWeights.FP8), "frozen base weights stored as fp8"
    if not memory.activation_offload and is_gpu(device):
        return (replace(memory, activation_offload=True),
                "activations saved for backward wait in CPU RAM (copied out after forward, back for backward)")
    if memory.base_weights is BaseWeights.FP8 and is_gpu(device):
        share = STREAM_SHARES[0]
        return (replace(memory, base_weights=BaseWeights.FP8_STREAMED, stream_share=share),
                streaming_described(None, share))
    if memory.base_weights.streamed and memory.stream_share < 1 and is_gpu(device):
        share = next(s for s in STREAM_SHARES if s > memory.stream_share)
        return replace(memory, stream_share=share), streaming_described(memory.stream_share, share)
    if memory.base_weights.streamed and memory.prefetch_streamed and is_gpu(device):
        # the copy a layer ahead holds one more layer's weights on the device: the last thing to give up, as it
        # is worth more than streaming less (FLUX.1-dev at 8 GiB, H100: 80% prefetched beat 65% not)
        return replace(memory, prefetch_streamed=False), "streamed weights no longer fetched a layer ahead"
    return None


def streams_more(before: MemorySettings, after: MemorySettings) -> bool:
    """Whether `after` is a rung that streams frozen weights where `before` streamed fewer (or none)."""
    return after.base_weights.streamed and (not before.base_weights.streamed
                                            or after.stream_share > before.stream_share)


def streaming_described(before: float | None, share: float) -> str:
    """The report's words for a streaming rung from `before` (None: nothing streamed yet) to `share`."""
    if before is None:
        return ("frozen base weights streamed from CPU memory, layer by layer: "
                + (f"the layers cheapest to stream, {share:.0%} of the weights" if share < 1 else "every weight"))
    return (f"frozen weights streamed from CPU memory {before:.0%} -> {share:.0%}" if share < 1
            else "every frozen weight streamed from CPU memory")
