"""The memory ladder: the order in which settings give up speed for memory. OOM recovery walks it one rung at a
time during a run; every rung keeps the effective batch and what has been learned."""
from __future__ import annotations

from dataclasses import replace

import torch

from .settings import MemorySettings

EIGHT_BIT = {"AdamW": "AdamW8bit", "Lion": "Lion8bit"}


def bf16_supported(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.is_bf16_supported()


def resolve_for_device(memory: MemorySettings, device: torch.device) -> tuple[MemorySettings, list[str]]:
    """Settings the device cannot run become the closest ones it can, with a note for the report."""
    notes = []
    if memory.mixed_precision == "bf16" and not bf16_supported(device):
        memory = replace(memory, mixed_precision="fp16", lora_weights="fp32")
        notes.append("this GPU has no bf16: using fp16 with loss scaling (and fp32 LoRA weights) instead")
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
    if not memory.gradient_checkpointing:
        return replace(memory, gradient_checkpointing=True), "gradient checkpointing on"
    if memory.optimizer in EIGHT_BIT:
        target = EIGHT_BIT[memory.optimizer]
        return (replace(memory, optimizer=target),
                f"optimizer {memory.optimizer} -> {target} (optimizer moments restart; LoRA weights are kept)")
    if memory.base_weights == "as loaded":
        return replace(memory, base_weights="fp8"), "frozen base weights stored as fp8"
    if not memory.activation_offload and device.type == "cuda":
        return (replace(memory, activation_offload=True),
                "activations saved for backward wait in CPU RAM (copied out after forward, back for backward)")
    if memory.base_weights == "fp8" and device.type == "cuda":
        return (replace(memory, base_weights="fp8 streamed from CPU"),
                "frozen base weights streamed from CPU memory, layer by layer")
    return None
