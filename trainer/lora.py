"""LoRA on the diffusion model: peft injects the adapters; export is kohya's format and naming
(`lora_unet_<module>` with lora_down / lora_up / alpha, kohya's `ss_*` metadata, the SAI model spec and the
sd-webui hashes), the files ComfyUI, A1111/Forge, diffusers and kohya's own scripts load."""
from __future__ import annotations

import datetime
import hashlib
import json
import time
from collections.abc import Mapping

import safetensors.torch
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

from .errors import LeanLoRAError
from .model import FamilyIdentity
from .settings import LoraSettings

ADAPTER = "leanlora"
UNET_PREFIX = "lora_unet_"  # kohya's prefix; its text encoder ones (lora_te_, lora_te1_/lora_te2_) stay unused:
#                             LeanLoRA trains the diffusion model only


class DropoutSeed:
    """The current micro-step's LoRA dropout: its seed, a device tensor the step writes in place (`feed`: inside a
    CUDA graph the copy is recorded, so every replay reads its own step's seed), and the step's keep mask for every
    layer, hashed once per micro-step from that seed. Layer `salt` reads the window of that one mask starting at
    its own offset (`keep`), so each layer's dropout is one masked multiply instead of a hash of its whole input
    (an SDXL step hashed ~1.1 G input elements, 4–5 int64 passes each: +0.13 s per step on an H200).

    Element i of layer `salt` is kept iff hash(seed, offset(salt) + i) clears p, whether read from the shared mask
    or hashed on the spot (an input larger than the mask inside a capture, where it cannot grow), so a mask never
    depends on which path made it or on the inputs seen before. The windows of different layers are shifted views
    of one random sequence: every element still has its own independent draw per layer (distinct offsets)."""

    OFFSETS = 2 ** 20  # distinct window starts: layers sharing an input (q, k, v) never share a mask
    GROWTH = 2 ** 20   # the mask grows in steps of this many elements

    def __init__(self, p: float):
        self.p = p
        self.value: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []  # earlier masks a recorded CUDA graph still fills and reads

    def feed(self, seed: torch.Tensor) -> None:
        if self.value is None or self.value.device != seed.device:
            self.value = seed.detach().clone()  # the first step is an eager one (probe or warm-up), never a capture
        else:
            self.value.copy_(seed)
        if self._mask is not None and self._mask.device == seed.device:
            torch.ge(self._hashed_bits(0, self._mask.numel()), self._threshold, out=self._mask)

    def keep(self, salt: int, count: int, device: torch.device) -> torch.Tensor:
        """Layer `salt`'s keep mask for an input of `count` elements (bool, flat)."""
        start = salt * 7919 % self.OFFSETS  # odd multiplier: distinct for every salt below OFFSETS
        end = start + count
        if self._mask is None or self._mask.device != device or self._mask.numel() < end:
            if _capturing(device):  # a capture may neither free a mask earlier graphs use nor own one eager steps use
                return self._hashed_bits(start, count) >= self._threshold
            self._grow(-(-end // self.GROWTH) * self.GROWTH, device)
        return self._mask[start:end]

    @property
    def _threshold(self) -> int:
        return round(self.p * 2 ** 32)

    def _grow(self, size: int, device: torch.device) -> None:
        if self._mask is not None:
            self._retired.append(self._mask)
        self.value = self.value.to(device)
        self._mask = self._hashed_bits(0, size) >= self._threshold

    def _hashed_bits(self, start: int, count: int) -> torch.Tensor:
        """32 pseudo-random bits (0 .. 2^32 - 1, int64) for elements start .. start + count - 1 of this step's
        sequence: an integer mix of (seed, index) in plain tensor ops, in place (two int64 tensors of `count` at a
        time). Every multiplier is < 2^31 and every operand < 2^32, so no product leaves int64."""
        mask = 0xFFFFFFFF
        bits = torch.arange(start, start + count, device=self.value.device, dtype=torch.int64)
        bits.mul_(0x2545F491).add_(self.value * 0x1B873593).bitwise_and_(mask)
        for multiplier, shift in ((0x7FEB352D, 15), (0x5BD1E995, 13), (0x68E31DA5, 16)):
            bits.bitwise_xor_(bits >> 16).mul_(multiplier).bitwise_and_(mask)
            bits.bitwise_xor_(bits >> shift)
        return bits


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class StepSeededDropout(torch.nn.Module):
    """LoRA dropout whose mask is a hash of (the micro-step's seed, this layer, the element) instead of draws from
    a random generator. A checkpointed block's recompute then makes the forward's mask again without saving and
    restoring the generator's state, which a CUDA graph cannot capture: runs with LoRA dropout keep their graphs.
    The seed comes from the run's own generator (TrainingSession.inputs), so a seed gives the same run and a resume
    continues it exactly. Before any step has fed a seed (a layer called on its own) it draws like nn.Dropout."""

    def __init__(self, salt: int, seed: DropoutSeed):
        super().__init__()
        self.salt, self.seed = salt, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.seed.p  # the one p the masks are made with
        if not self.training or p == 0:
            return x
        if self.seed.value is None:
            return torch.nn.functional.dropout(x, p, training=True)
        keep = self.seed.keep(self.salt, x.numel(), x.device).view(x.shape)
        return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)

    def extra_repr(self) -> str:
        return f"p={self.seed.p}, salt={self.salt}"


def seed_lora_dropout(module: torch.nn.Module) -> DropoutSeed | None:
    """Where a step feeds its LoRA dropout seed; None if `module`'s LoRA has no dropout."""
    return getattr(module, "leanlora_dropout_seed", None)


def _step_seeded_dropout(module: torch.nn.Module) -> None:
    """Replaces peft's nn.Dropout in every LoRA layer with a StepSeededDropout sharing one DropoutSeed."""
    seed: DropoutSeed | None = None
    replaced = 0
    for layer in module.modules():
        dropouts = getattr(layer, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict) or ADAPTER not in dropouts:
            continue
        dropout = dropouts[ADAPTER]
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            seed = seed or DropoutSeed(dropout.p)  # one LoraConfig: every layer's p is the same
            dropouts[ADAPTER] = StepSeededDropout(replaced, seed)
            replaced += 1
    if replaced:
        module.leanlora_dropout_seed = seed


def inject_lora(module: torch.nn.Module, settings: LoraSettings, seed: int,
                target_modules: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """Adds LoRA layers in place and freezes everything else. Returns the trainable parameters (fp32).
    `target_modules`: module paths or path suffixes (peft's matching), what the model's family names for
    `settings.targets` (ModelAdapter.lora_targets). LoRA dropout, if any, is StepSeededDropout."""
    if not target_modules:
        raise LeanLoRAError(f"LoRA targets {settings.targets.value!r} name no layer of this model; pick another "
                            "target preset")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(target_modules), init_lora_weights=True)
    module.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # seeded lora_A init without disturbing the caller's RNG
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, module, adapter_name=ADAPTER)
        except ValueError as error:
            raise LeanLoRAError(f"LoRA targets {settings.targets.value!r} matched no layer of this model ({error}); "
                                "pick another target preset") from error
    for layer in module.modules():
        if hasattr(layer, "cast_input_dtype_enabled"):
            # peft casts each LoRA layer's input to the LoRA weights' dtype (fp32): under autocast an
            # activation-sized fp32 copy per layer that autocast casts straight back (and the reverse in backward),
            # 16% of an SDXL batch-8 step on an H200, plus a second saved copy of the input. Autocast computes in
            # the compute dtype either way; without autocast ("no" precision) inputs are fp32 already.
            layer.cast_input_dtype_enabled = False
    _step_seeded_dropout(module)
    params = [p for n, p in module.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()  # master weights stay fp32 whatever the base dtype
        p.requires_grad_(True)
    return params


def kohya_state_dict(module: torch.nn.Module, settings: LoraSettings, module_names: Mapping[str, str] | None = None,
                     dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """kohya's keys for the LoRA layers in `module`. `module_names` maps each LoRA'd module path of the training
    copy to the name kohya gives it for this model family (SD1.x: diffusers' `down_blocks.0.attentions.0...`,
    from ModelAdapter.kohya_module_names); None keeps the copy's own paths (ComfyUI's, kohya's names for SDXL and
    the DiTs: ComfyUI reads `lora_unet_<its path>` for every family)."""
    # peft reads module.peft_config and raises AttributeError on a module that never had a LoRA injected
    peft_sd = get_peft_model_state_dict(module, adapter_name=ADAPTER) if hasattr(module, "peft_config") else {}
    if not peft_sd:
        raise LeanLoRAError("the model holds no LoRA weights to export")
    out: dict[str, torch.Tensor] = {}
    for key, value in peft_sd.items():
        path, _, part = key.rpartition(".lora_")  # "<module>.lora_A.weight" / "<module>.lora_B.weight"
        if part not in ("A.weight", "B.weight"):
            raise LeanLoRAError(f"cannot export LoRA weight {key!r}: only plain LoRA layers have a kohya form")
        if module_names is not None:
            if path not in module_names:
                raise LeanLoRAError(f"cannot export the LoRA on {path!r}: kohya's naming for this model has no "
                                    "name for that module; pick the attention targets")
            path = module_names[path]
        name = UNET_PREFIX + path.replace(".", "_")
        out[f"{name}.{'lora_down' if part == 'A.weight' else 'lora_up'}.weight"] = \
            value.detach().to("cpu", dtype).contiguous()
        # the scale the weights were trained with is lora_alpha / rank (kohya stores alpha, not the scale)
        out[f"{name}.alpha"] = torch.tensor(float(settings.alpha))
    return out


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
    width, height = resolution
    metadata = {
        "ss_network_module": "networks.lora", "ss_network_dim": str(settings.rank),
        "ss_network_alpha": str(settings.alpha), "ss_network_dropout": str(settings.dropout),
        "ss_network_args": json.dumps({"targets": settings.targets.value,
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
