"""Any other ComfyUI diffusion model built from comfy.ops Linear layers, as ComfyUI's own trainer takes it
(comfy_extras/nodes_train.py): LoRA on the Linear layers of its repeated blocks, those blocks as the checkpoint,
stream, compile and upcast units, and the loss through its model_sampling. Last in the family list."""
from __future__ import annotations

import re

import torch

from .common import call_diffusion_model, empty_latent, linear_cost, linear_paths, prediction_of, repeated_blocks
from ..trainer_api import (CheckpointDepth, FamilyIdentity, LoraTargets, SampleDefaults, SampleLimits,
                           TimestepSampling, most_memory_per_flop_first)

# Linear layers named like attention's projections in the common transformer codebases (ComfyUI's, diffusers')
_ATTENTION = re.compile(r"(^|\.)(attn\w*|attention\w*|self_attn|cross_attn)\.|(^|\.)(to_[qkv]|to_out|qkv|q_proj|k_proj"
                        r"|v_proj|o_proj|out_proj|to_add_out|add_[qkv]_proj)(\.|$)")


def _builds_concat_channels(base) -> bool:
    """Whether the model's own concat_cond adds input channels to a plain latent of its format (e.g. Wan's
    image-to-video models: zero image and mask channels). Such a model's diffusion model cannot take the latent
    alone, and the generic path does not concatenate them."""
    latent_format = getattr(base, "latent_format", None)
    if latent_format is None or not hasattr(base, "concat_cond"):
        return False
    try:
        return base.concat_cond(noise=empty_latent(latent_format, 8, 8), device=torch.device("cpu")) is not None
    except (KeyError, TypeError, AttributeError):  # a concat_cond that needs inputs only a sampler has
        return False


class Generic:
    name = "generic (any ComfyUI diffusion model of comfy.ops Linear layers)"
    timestep_sampling = TimestepSampling.UNIFORM
    sequence_conditioning = ()
    sample_defaults = SampleDefaults(sampler="euler", scheduler="simple", size_multiple=16)
    sample_limits = SampleLimits("this model's", 2048, 150, "twice a 1024 training size")  # checked before training
    # Its forward is unknown code: it may read a tensor's value on the host (a token count, a mask's sum), which
    # a CUDA graph cannot hold, and a failed capture costs a step. The DiT families that are known say None.
    graph_blocker = "the generic model path cannot tell whether this model's forward syncs with the host"
    text_conditioning: dict = {}

    def matches(self, base) -> bool:
        unet = getattr(base, "diffusion_model", None)
        return isinstance(unet, torch.nn.Module) and bool(linear_paths(unet, repeated_blocks(unet)))

    def unsupported(self, base) -> str | None:
        if getattr(base, "concat_keys", ()) or _builds_concat_channels(base):
            return (f"{type(base).__name__} takes extra input channels (inpainting/edit/video conditioning), which "
                    "the generic path does not build")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        model = type(base.model_config).__name__
        return FamilyIdentity(f"{model} (generic)", f"comfyui_{model.lower()}", f"comfyui-{model.lower()}",
                              "https://github.com/comfyanonymous/ComfyUI", prediction_of(model_sampling),
                              recorded_as=(f"comfyui_{model.lower()}", f"comfyui-{model.lower()}"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        blocks = repeated_blocks(unet)
        return (f"{type(base).__name__} via the generic path ({type(unet).__name__}, "
                f"{sum(p.numel() for p in unet.parameters()) / 1e6:.1f}M parameters, {len(blocks)} repeated blocks, "
                f"dtype {unet.dtype}): LoRA on the Linear layers of its repeated blocks; no CUDA graphs "
                "(see the fast path note)")

    def prepare(self, unet: torch.nn.Module) -> None:
        pass  # its blocks run as ComfyUI wrote them

    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]:
        paths = linear_paths(unet, repeated_blocks(unet))
        if targets is LoraTargets.ATTENTION:
            return tuple(p for p in paths if _ATTENTION.search(p))
        return tuple(paths)

    def checkpoint_units(self, unet: torch.nn.Module, depth: CheckpointDepth = CheckpointDepth.LAYER,
                         latent_size: tuple[int, int] | None = None) -> list[torch.nn.Module]:
        units = [block for _, block in repeated_blocks(unet)]
        if latent_size is None:
            return units
        tokens = latent_size[0] * latent_size[1]
        return most_memory_per_flop_first(units, [linear_cost(unit, tokens) for unit in units])

    def compile_units(self, unet: torch.nn.Module, scope: str = "layers") -> list[torch.nn.Module]:
        return [block for _, block in repeated_blocks(unet)]

    def upcast_groups(self, unet: torch.nn.Module):
        return [block for _, block in repeated_blocks(unet)]

    def predict(self, unet, x, timestep, cond, transformer_options):
        return call_diffusion_model(unet, x, timestep, cond, transformer_options)

    def set_conv_layout(self, base, unet, device, compute_dtype) -> str | None:
        return None

    def kohya_module_names(self, base) -> dict[str, str] | None:
        return None  # ComfyUI reads lora_unet_<its own path> for every model

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        return None

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        return 1.0  # an unknown model's schedule is trained as its table says
