"""What the trainer needs from a model, as typed contracts: the identity of its family (FamilyIdentity, what LoRA
files record), one model family's knowledge (ModelFamily: bridge/families/, one file per family, first match wins)
and the model as the trainer drives it (ModelAdapter: ComfyUI's is bridge/comfy_adapter.py, which asks its family;
tests/test_pure_torch_training.py implements it for a tiny pure-torch model)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from .objective import TimestepSampling
from .settings import Attention, BaseWeights, CheckpointDepth, LoraTargets, SampleLimits


@dataclass(frozen=True)
class FamilyIdentity:
    """The base model a LoRA is trained on, in the words LoRA files use: kohya's `ss_base_model_version` and
    `ss_v2`, the SAI model spec's architecture, implementation and prediction type."""
    name: str                  # shown to users ("SDXL", "FLUX.1-dev", ...)
    base_model_version: str    # kohya's ss_base_model_version (A1111/Forge sort LoRAs by it)
    architecture: str          # modelspec.architecture, without the "/lora" suffix
    implementation: str        # modelspec.implementation
    prediction: str = "epsilon"  # modelspec.prediction_type: epsilon, v or flow
    v2: bool = False           # kohya's ss_v2
    # how other tools record this family in a file's ss_base_model_version or modelspec.architecture: prefixes,
    # compared lower-case without separators ("flux1", "flux-1-dev" and "FLUX.1" are one). Empty: no file check
    recorded_as: tuple[str, ...] = ()
    # prefixes of a later family that begin with one of recorded_as ("flux" is FLUX.1 in older tools, "flux2" is not)
    not_recorded_as: tuple[str, ...] = ()

    def recognises(self, recorded: str) -> bool:
        """Whether a file's recorded base model names this family."""
        value = _plain(recorded)
        return any(value.startswith(_plain(prefix)) for prefix in self.recorded_as) \
            and not any(value.startswith(_plain(prefix)) for prefix in self.not_recorded_as)


def _plain(text: str) -> str:
    return re.sub(r"[\s._/-]", "", text.lower())


@dataclass(frozen=True)
class SampleDefaults:
    """How ComfyUI's own templates sample the family: what in-training samples use (bridge/samples.py)."""
    sampler: str = "euler"
    scheduler: str = "normal"
    size_multiple: int = 8   # pixels per latent position the image size must be a multiple of (patch x VAE)


class NoiseSchedule(Protocol):
    """The model's noise schedule (ComfyUI's model_sampling): what objective.py draws and denoises with."""

    sigmas: torch.Tensor

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor: ...
    def noise_scaling(self, sigma, noise, latent_image, max_denoise: bool = False) -> torch.Tensor: ...
    def calculate_input(self, sigma, noisy) -> torch.Tensor: ...
    def calculate_denoised(self, sigma, model_output, model_input) -> torch.Tensor: ...


class ModelFamily(Protocol):
    """One family's knowledge of its diffusion model (`base`: the host's model object, e.g. ComfyUI's BaseModel;
    `unet`: the training copy of its diffusion network). Families are tried in order; the first that `matches`
    trains the model. Adding one is a file and a list entry (docs/ARCHITECTURE.md)."""

    name: str
    timestep_sampling: TimestepSampling     # how training draws noise levels from the model's own schedule
    sequence_conditioning: tuple[str, ...]  # token-sequence conditioning that may be repeated to a common length
    sample_defaults: SampleDefaults
    sample_limits: SampleLimits  # the largest sample size and step count worth their time
    # why CUDA graphs cannot capture this family's step, or None (the report says it)
    graph_blocker: str | None
    text_conditioning: dict  # what the family's conditioning gets beside the caption (Flux: its guidance)
    # optional: the prefix of the MODEL's weights its conditioning runs on the text (Anima's LLM adapter), which the
    # text cache keys on beside the text encoder's (ComfyAdapter.text_encoder_id)
    # conditioning_weights: str

    def matches(self, base) -> bool: ...
    def unsupported(self, base) -> str | None: ...  # why this member of the family cannot train, or None
    def identity(self, base, model_sampling) -> FamilyIdentity: ...
    def describe(self, base) -> str: ...
    def prepare(self, unet: torch.nn.Module) -> None: ...  # the training copy made ready to train (once)
    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]: ...
    # the units to recompute; with latent_size (height, width) best first for partial checkpointing
    def checkpoint_units(self, unet: torch.nn.Module, depth: CheckpointDepth,
                         latent_size: tuple[int, int] | None) -> list[torch.nn.Module]: ...
    def compile_units(self, unet: torch.nn.Module) -> list[torch.nn.Module]: ...
    def upcast_groups(self, unet: torch.nn.Module) -> Iterable[torch.nn.Module]: ...
    def predict(self, unet: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                cond: dict[str, torch.Tensor], transformer_options: dict) -> torch.Tensor: ...
    def set_conv_layout(self, base, unet: torch.nn.Module, device: torch.device,
                        compute_dtype: torch.dtype) -> str | None: ...
    def kohya_module_names(self, base) -> dict[str, str] | None: ...
    def diffusers_module_names(self, base) -> dict[str, str] | None: ...
    # how much further up the schedule a latent of this size trains than the table says (1.0: as it is)
    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float: ...


class ModelAdapter(Protocol):
    device: torch.device
    model_sampling: torch.nn.Module  # the noise schedule (see NoiseSchedule); copied to the CPU for random draws
    cancel_errors: tuple[type[BaseException], ...]  # errors the host raises inside a step to mean Cancel
    # conditioning entries that are token sequences: captions of other lengths are repeated to a common length
    sequence_conditioning: tuple[str, ...]
    timestep_sampling: TimestepSampling
    graph_blocker: str | None  # why CUDA graphs cannot run this model, or None

    def describe(self) -> str: ...

    # --- encoders, used once to fill the cache ---
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor: ...
    def encode_text(self, caption: str, width: int, height: int) -> dict[str, torch.Tensor]: ...
    def image_encoder_id(self) -> str: ...
    def text_encoder_id(self) -> str: ...
    def release_encoders(self) -> None: ...

    # --- the training copy ---
    def training_unet(self) -> torch.nn.Module: ...
    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]: ...
    def set_attention(self, backend: Attention, compiled: bool = False) -> str | None: ...
    def set_compute_dtype(self, unet: torch.nn.Module, dtype: torch.dtype) -> None: ...
    def set_conv_layout(self, unet: torch.nn.Module, device: torch.device,
                        compute_dtype: torch.dtype) -> str | None: ...
    def checkpoint_blocks(self, unet: torch.nn.Module, depth: CheckpointDepth = ...,
                          latent_size: tuple[int, int] | None = None) -> list[torch.nn.Module]: ...
    def prepare_compile_units(self, unet: torch.nn.Module) -> list[torch.nn.Module]: ...
    def store_weights_fp8(self, unet: torch.nn.Module) -> int: ...
    def group_upcasts(self, unet: torch.nn.Module) -> None: ...
    def stream_weights_from_cpu(self, unet: torch.nn.Module, share: float = 1.0) -> int: ...
    def projected_weight_bytes(self, unet: torch.nn.Module, compute_dtype: torch.dtype,
                               base_weights: BaseWeights, stream_share: float = 1.0) -> int: ...
    def reserved_vram(self) -> int: ...
    def predict(self, unet: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                cond: dict[str, torch.Tensor]) -> torch.Tensor: ...
    def resolution_shift(self, latent_size: tuple[int, int]) -> float: ...
    def free(self, unet: torch.nn.Module) -> None: ...
    # Optional: rank_streaming(unet, latent_size), the order streamed layers take at the largest latent (the
    # family's cost model), called once before anything streams; and stream_costs(unet, share) -> ([(weight bytes,
    # multiply-adds per image)] of the layers streamed at `share`, the step's multiply-adds per image): the streaming
    # time model's terms (memory/planner.streaming_time). Without them the largest layers stream first, untimed.
    # Optional: the addresses of the host's own storages the training copy shares (the host RAM plan counts the
    # copy's other tensors as its own; without it, every host tensor of the copy is; ComfyAdapter's).
    # def shared_host_storages(self) -> set[int]: ...
    # Optional: a context manager the session runs training steps and memory probes in (the host's switch to
    # kernels that have a backward; ComfyAdapter.training_kernels).
    # def training_kernels(self): ...

    # --- the text encoder, trained too (LoRA Config's text_encoder_lr; text_encoder.py). Optional: an adapter
    # without them refuses text_encoder_lr, naming the field (train_lora.check_text_encoder) ---
    # def check_text_encoder(self, lora: LoraSettings) -> None: ...  # a LeanLoRAError before any work
    # def text_encoder_tokens(self, caption: str) -> dict[str, torch.Tensor]: ...  # at cache time
    # def training_text_encoder(self, lora: LoraSettings, seed: int) -> TrainedTextEncoder: ...

    # --- the LoRA file ---
    def identity(self) -> FamilyIdentity: ...
    def kohya_module_names(self) -> dict[str, str] | None: ...
    # training-copy path -> diffusers path of each weight module, to read diffusers/peft files; None: no map
    def diffusers_module_names(self) -> dict[str, str] | None: ...
