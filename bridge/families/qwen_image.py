"""Qwen-Image (Alibaba's 20B MMDiT) as ComfyUI loads it: comfy/ldm/qwen_image (60 dual-stream transformer blocks
in the full model, module names as in diffusers), flow matching, Qwen2.5-VL-7B text features, the Wan 2.1 VAE's
5-D latents (batch, 16, 1, height/8, width/8)."""
from __future__ import annotations

import torch

import comfy.model_base

from .common import call_diffusion_model, linear_cost, prediction_of

if __package__ and __package__.count(".") >= 2:  # inside the pack, as ComfyUI imports it
    from ...trainer.checkpointing import most_memory_per_flop_first
    from ...trainer.model import FamilyIdentity, SampleDefaults
    from ...trainer.objective import TimestepSampling
    from ...trainer.settings import SampleLimits, CheckpointDepth, LoraTargets
else:  # `bridge` beside `trainer` on sys.path (tests, bench)
    from trainer.checkpointing import most_memory_per_flop_first
    from trainer.model import FamilyIdentity, SampleDefaults
    from trainer.objective import TimestepSampling
    from trainer.settings import SampleLimits, CheckpointDepth, LoraTargets

_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
              "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
LORA_TARGETS = {  # module-name suffixes, the same in ComfyUI's model and in diffusers' (musubi-tuner's set)
    LoraTargets.ATTENTION: _ATTENTION,
    LoraTargets.ATTENTION_FEED_FORWARD: (*_ATTENTION, "img_mlp.net.0.proj", "img_mlp.net.2",
                                         "txt_mlp.net.0.proj", "txt_mlp.net.2"),
}


class QwenImage:
    name = "Qwen-Image"
    timestep_sampling = TimestepSampling.LOGIT_NORMAL
    sequence_conditioning = ()
    sample_defaults = SampleDefaults(sampler="euler", scheduler="simple", latent_channels=16, size_multiple=16)
    sample_limits = SampleLimits("Qwen-Image", 2048, 150, "its native size is 1328")  # checked before training
    graph_blocker = None
    text_conditioning: dict = {}

    def matches(self, base) -> bool:
        return type(base) is comfy.model_base.QwenImage

    def unsupported(self, base) -> str | None:
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Qwen-Image", "qwen_image", "qwen-image", "https://github.com/QwenLM/Qwen-Image",
                              prediction_of(model_sampling), recorded_as=("qwen_image", "qwen-image", "qwenimage"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"Qwen-Image ({len(unet.transformer_blocks)} blocks, "
                f"{sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B parameters, dtype {unet.dtype}), "
                "flow matching")

    def prepare(self, unet: torch.nn.Module) -> None:
        pass  # its blocks add out of place: they recompute as they ran

    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]:
        return LORA_TARGETS[targets]

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return list(unet.transformer_blocks)

    def checkpoint_units(self, unet: torch.nn.Module, depth: CheckpointDepth = CheckpointDepth.LAYER,
                         latent_size: tuple[int, int] | None = None) -> list[torch.nn.Module]:
        units = self.blocks(unet)
        if latent_size is None:
            return units
        tokens = (latent_size[0] // unet.patch_size) * (latent_size[1] // unet.patch_size)
        return most_memory_per_flop_first(units, [linear_cost(unit, tokens) for unit in units])

    def compile_units(self, unet: torch.nn.Module, scope: str = "layers") -> list[torch.nn.Module]:
        return self.blocks(unet)

    def upcast_groups(self, unet: torch.nn.Module):
        return self.blocks(unet)

    def predict(self, unet, x, timestep, cond, transformer_options):
        return call_diffusion_model(unet, x, timestep, cond, transformer_options)

    def set_conv_layout(self, base, unet, device, compute_dtype) -> str | None:
        return None

    def kohya_module_names(self, base) -> dict[str, str] | None:
        return None  # ComfyUI reads lora_unet_<its path>; its paths are diffusers' names

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        """ComfyUI's paths are diffusers' own: diffusers/peft files (`transformer.<path>`) name them as they are."""
        return {path: path for path, module in base.diffusion_model.named_modules()
                if isinstance(getattr(module, "weight", None), torch.Tensor)}
