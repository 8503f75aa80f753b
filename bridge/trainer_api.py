"""What bridge/ uses of the trainer, imported once from where the trainer package is: `<pack>.trainer` when ComfyUI
imports the pack as a package (custom_nodes/<name>), the top-level `trainer` when tests and the bench put the
repository on sys.path (`bridge` beside it). Every bridge module imports these names from here
(`from .trainer_api import LeanLoRAError`, in families/ `from ..trainer_api import ...`); a name the bridge newly
needs is added to NAMES. Each is imported when first asked for, with its module only."""
from __future__ import annotations

import importlib

# what `..trainer` means from this package: the pack's trainer, or the top-level one
ROOT = f"{__package__.rpartition('.')[0]}.trainer".lstrip(".")

NAMES = {  # trainer module -> the names bridge/ imports from it
    "cache": ("CONTROL_KEY",),
    "dataset": ("PAIRS_LAYOUT", "load_image"),
    "device.card": ("PIN_IN_PLACE_MIN", "device_memory", "pin_in_place", "unpin_in_place"),
    "device.vram": ("GIB", "available_ram_bytes"),
    "errors": ("LeanLoRAError",),
    "files": ("new_folder", "write_atomic"),
    "layer_patch": ("mix_into",),
    "layout": ("store_frozen_convs_channels_last",),
    "lora": ("adapter_type", "inject_lora"),
    "lora.file": ("text_encoder_state_dict",),
    "model": ("FamilyIdentity", "SampleDefaults"),
    "objective": ("TimestepSampling",),
    "settings": ("SD_SAMPLE_LIMITS", "Attention", "BaseWeights", "CheckpointDepth", "LoraSettings", "LoraTargets",
                 "SampleLimits", "SampleSettings"),
    "step.checkpointing": ("most_memory_per_flop_first",),
    "step.frozen_weights": ("FP8", "FP8_CONVERSION_CHUNK", "FP8_MAX", "FP8_SCALE", "FP8_SCALE_VALUE", "HOST_STORAGES",
                            "cast_frozen_weights", "dequantize", "frozen_weight_bytes", "move_to_host"),
    "step.weight_prefetch": ("fetch_streamed",),
    "text_encoder": ("TOKEN_KEY",),
    "train_lora": ("StepPace",),
    "training_state": ("model_fingerprint",),
}

_HOME = {name: module for module, names in NAMES.items() for name in names}


def __getattr__(name: str):
    """A name's trainer module is imported when the name is first asked for: each bridge module loads only what it
    imports (loading the pack stays quiet: no peft before a training starts)."""
    if name not in _HOME:
        raise AttributeError(f"{__name__} has no {name!r}: add it to NAMES (its trainer module)")
    value = globals()[name] = getattr(importlib.import_module(f"{ROOT}.{_HOME[name]}"), name)
    return value
