"""Adapters on the diffusion model, one file per type behind an ordered list (ComfyUI's comfy/weight_adapter/ idea):
plain.py (LoRA through peft, and DoRA, its variant), loha.py, lokr.py, oft.py. Each type owns its injection, its trainable
parameters (by name prefix), its file keys (kohya / LyCORIS) for export and continue_from, its metadata and its part
of the resume fingerprint. registry.py holds ADAPTER_TYPES, the ordered list (a file module is read by the first type
whose parts it holds).

dropout.py: the step-seeded LoRA dropout every type uses; file.py: the file's keys and metadata;
continue_from.py: reading a file back into the injected layers."""
from __future__ import annotations

import torch

from ..settings import LoraSettings
from .dropout import ADAPTER, DropoutSeed, StepSeededDropout, seed_lora_dropout
from .file import UNET_PREFIX, kohya_state_dict, lora_metadata, tag_frequency, with_file_hashes
from .registry import ADAPTER_TYPES, adapter_type


def inject_lora(module: torch.nn.Module, settings: LoraSettings, seed: int,
                target_modules: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """Adds `settings.type`'s adapter layers in place and freezes everything else. Returns the trainable parameters
    (fp32). `target_modules`: module paths or path suffixes (peft's matching), what the model's family names for
    `settings.targets` (ModelAdapter.lora_targets). Dropout, if any, is StepSeededDropout."""
    kind = adapter_type(settings)
    with torch.random.fork_rng(devices=[]):  # seeded initial factors without disturbing the caller's RNG
        torch.manual_seed(seed)
        kind.inject(module, settings, target_modules)
    params = kind.trainable(module)
    for p in params:
        p.data = p.data.float()  # master weights stay fp32 whatever the base dtype
        p.requires_grad_(True)
    return params

__all__ = ["ADAPTER", "ADAPTER_TYPES", "DropoutSeed", "StepSeededDropout", "UNET_PREFIX", "adapter_type",
           "inject_lora", "kohya_state_dict", "lora_metadata", "seed_lora_dropout", "tag_frequency",
           "with_file_hashes"]
