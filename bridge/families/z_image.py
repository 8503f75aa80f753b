"""Z-Image (Tongyi's 6B single-stream DiT) as ComfyUI loads it: comfy/ldm/lumina NextDiT with its Z-Image
modulation (30 layers plus 2 noise- and 2 context-refiner layers in the full model), flow matching, Qwen3-4B
text features."""
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

# Module-name suffixes in ComfyUI's NextDiT (JointTransformerBlock: fused qkv, SwiGLU w1/w2/w3)
LORA_TARGETS = {
    LoraTargets.ATTENTION: ("attention.qkv", "attention.out"),
    LoraTargets.ATTENTION_FEED_FORWARD: ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2",
                                         "feed_forward.w3"),
}


class ZImage:
    name = "Z-Image"
    timestep_sampling = TimestepSampling.LOGIT_NORMAL
    sequence_conditioning = ()
    sample_defaults = SampleDefaults(sampler="euler", scheduler="simple", latent_channels=16, size_multiple=16)
    sample_limits = SampleLimits("Z-Image", 2048, 150, "its native size is 1024")  # checked before training
    graph_blocker = None
    text_conditioning: dict = {}

    def matches(self, base) -> bool:
        return isinstance(base, comfy.model_base.Lumina2) and type(base.model_config).__name__ == "ZImage"

    def unsupported(self, base) -> str | None:
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Z-Image", "z_image", "z-image", "https://github.com/Tongyi-MAI/Z-Image",
                              prediction_of(model_sampling), recorded_as=("z_image", "z-image", "zimage"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"Z-Image ({len(unet.layers)} layers + {len(unet.noise_refiner)} noise / "
                f"{len(unet.context_refiner)} context refiners, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B "
                f"parameters, dtype {unet.dtype}), flow matching")

    def prepare(self, unet: torch.nn.Module) -> None:
        pass  # its blocks add out of place: they recompute as they ran

    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]:
        return LORA_TARGETS[targets]

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return [*unet.context_refiner, *unet.noise_refiner, *unet.layers]

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
        return None  # ComfyUI reads lora_unet_<its path> (and diffusion_model.<path>) for Z-Image

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        return None
