"""The LoRA file: kohya's keys for every adapter type (`lora_unet_<module>.<part>`, LyCORIS' part names for LoHa,
LoKr and DoRA), kohya's `ss_*` metadata, the SAI model spec and the sd-webui hashes: the files ComfyUI,
A1111/Forge, diffusers and kohya's own scripts load."""
from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Mapping

import safetensors.torch
import torch

from ..errors import LeanLoRAError
from ..model import FamilyIdentity
from ..settings import LoraSettings
from .registry import adapter_type

UNET_PREFIX = "lora_unet_"  # kohya's prefix; its text encoder ones (lora_te_, lora_te1_/lora_te2_): see
#                             text_encoder_state_dict


def kohya_state_dict(module: torch.nn.Module, settings: LoraSettings, module_names: Mapping[str, str] | None = None,
                     dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """kohya's keys for the adapter layers of `settings.type` in `module`. `module_names` maps each adapted module
    path of the training copy to the name kohya gives it for this model family (SD1.x: diffusers'
    `down_blocks.0.attentions.0...`, from ModelAdapter.kohya_module_names); None keeps the copy's own paths
    (ComfyUI's, kohya's names for SDXL and the DiTs: ComfyUI reads `lora_unet_<its path>` for every family).
    Alphas stay fp32 scalars (kohya's form); every other tensor is `dtype`."""
    kind = adapter_type(settings)
    layers = kind.layers(module)
    if not layers:
        raise LeanLoRAError("the model holds no LoRA weights to export")
    out: dict[str, torch.Tensor] = {}
    for path, layer in layers.items():
        if module_names is not None:
            if path not in module_names:
                raise LeanLoRAError(f"cannot export the LoRA on {path!r}: kohya's naming for this model has no "
                                    "name for that module; pick the attention targets")
            path = module_names[path]
        _export_layer(out, UNET_PREFIX + path.replace(".", "_"), kind, layer, settings, dtype)
    return out


def text_encoder_state_dict(module: torch.nn.Module, settings: LoraSettings, prefixes: Mapping[str, str],
                            dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """kohya's keys for the LoRA layers of a text-encoder copy: `prefixes` maps each encoder's path prefix in
    `module` (`clip_l.transformer.`) to kohya's (`lora_te_`, SDXL's `lora_te1_` / `lora_te2_`), followed by the
    layer's path from there, underscored (`text_model_encoder_layers_0_self_attn_q_proj`)."""
    kind = adapter_type(settings)
    out: dict[str, torch.Tensor] = {}
    for path, layer in kind.layers(module).items():
        start = next((p for p in prefixes if path.startswith(p)), None)
        if start is None:
            raise LeanLoRAError(f"cannot export the text-encoder LoRA on {path!r}: kohya names no such encoder")
        _export_layer(out, prefixes[start] + path[len(start):].replace(".", "_"), kind, layer, settings, dtype)
    if not out:
        raise LeanLoRAError("the text encoder holds no LoRA weights to export")
    return out


def _export_layer(out: dict[str, torch.Tensor], name: str, kind, layer, settings: LoraSettings,
                  dtype: torch.dtype) -> None:
    for part, value in kind.export(layer, settings).items():
        value = value.detach().to("cpu", torch.float32 if part == "alpha" else dtype)
        out[f"{name}.{part}"] = value.contiguous()


# --- what the file says about itself: kohya's `ss_*` keys and the SAI model spec (kohya's library/sai_model_spec) ---

def tag_frequency(folder_name: str, captions) -> dict[str, dict[str, int]]:
    """kohya's ss_tag_frequency for one dataset folder: each comma-separated tag of each caption, lower-cased,
    counted once per image (repeats are not counted)."""
    counts: dict[str, int] = {}
    for caption in captions:
        for tag in caption.split(","):
            tag = tag.strip().lower()
            if tag:
                counts[tag] = counts.get(tag, 0) + 1
    return {folder_name: counts}


def lora_metadata(settings: LoraSettings, family: FamilyIdentity, *, target_modules: tuple[str, ...],
                  output_name: str, resolution: tuple[int, int], tags: dict[str, dict[str, int]],
                  extra: dict[str, str], timestamp: float | None = None) -> dict[str, str]:
    """kohya's `ss_` keys (its minimum set included) plus the SAI model spec, all strings like kohya writes them."""
    timestamp = time.time() if timestamp is None else timestamp
    kind = adapter_type(settings)
    width, height = resolution
    metadata = {
        "ss_network_module": kind.network_module, "ss_network_dim": str(settings.rank),
        "ss_network_alpha": str(settings.alpha), "ss_network_dropout": str(settings.dropout),
        "ss_network_args": json.dumps({**kind.network_args(settings), "targets": settings.targets.value,
                                       "target_modules": ",".join(target_modules)}),
        "ss_base_model_version": family.base_model_version, "ss_v2": str(family.v2),
        "ss_output_name": output_name, "ss_resolution": str((width, height)),
        "ss_training_started_at": str(timestamp), "ss_tag_frequency": json.dumps(tags),
        "leanlora_targets": settings.targets.value, **extra,
        "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": f"{family.architecture}/lora",
        "modelspec.implementation": family.implementation, "modelspec.title": output_name,
        "modelspec.resolution": f"{width}x{height}",
        "modelspec.date": datetime.datetime.fromtimestamp(int(timestamp)).isoformat(),
        "modelspec.prediction_type": family.prediction,
    }
    return metadata


def with_file_hashes(state_dict: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, str]:
    """Adds sshs_model_hash / sshs_legacy_hash as kohya precomputes them (train_util.precalculate_safetensors_hashes),
    so sd-webui's additional-networks need not hash the file: the model hash is the sha256 of the tensor payload of
    the file serialized with the `ss_` metadata only; the legacy hash is 8 hex digits of the sha256 of its 64 KiB
    at offset 1 MiB (of an empty slice for a file smaller than that, as there)."""
    blob = safetensors.torch.save(state_dict, {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header_end = 8 + int.from_bytes(blob[:8], "little")
    return {**metadata, "sshs_model_hash": hashlib.sha256(blob[header_end:]).hexdigest(),
            "sshs_legacy_hash": hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]}
