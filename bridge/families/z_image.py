"""Z-Image (Tongyi's 6B single-stream DiT) as ComfyUI loads it: comfy/ldm/lumina NextDiT with its Z-Image
modulation (30 layers plus 2 noise- and 2 context-refiner layers in the full model), flow matching, Qwen3-4B
text features."""
from __future__ import annotations

import torch

import comfy.model_base

from .common import TransformerFamily, prediction_of
from ..trainer_api import FamilyIdentity, LoraTargets, SampleLimits


class ZImage(TransformerFamily):
    name = "Z-Image"
    # module-name suffixes in ComfyUI's NextDiT (JointTransformerBlock: fused qkv, SwiGLU w1/w2/w3)
    LORA_TARGETS = {
        LoraTargets.ATTENTION: ("attention.qkv", "attention.out"),
        LoraTargets.ATTENTION_FEED_FORWARD: ("attention.qkv", "attention.out", "feed_forward.w1", "feed_forward.w2",
                                             "feed_forward.w3"),
    }
    sample_limits = SampleLimits("Z-Image", 2048, 150, "its native size is 1024")  # checked before training
    PER_IMAGE_LINEARS = ("adaLN_modulation",)  # the main layers' and noise refiners': on the timestep's vector

    def matches(self, base) -> bool:
        return isinstance(base, comfy.model_base.Lumina2) and type(base.model_config).__name__ == "ZImage"

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Z-Image", "z_image", "z-image", "https://github.com/Tongyi-MAI/Z-Image",
                              prediction_of(model_sampling), recorded_as=("z_image", "z-image", "zimage"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"Z-Image ({len(unet.layers)} layers + {len(unet.noise_refiner)} noise / "
                f"{len(unet.context_refiner)} context refiners, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B "
                f"parameters, dtype {unet.dtype}), flow matching")

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return [*unet.context_refiner, *unet.noise_refiner, *unet.layers]

    def unit_tokens(self, unet: torch.nn.Module, units: list[torch.nn.Module], image: int) -> list[tuple[int, int]]:
        """The context refiners run on the caption's tokens alone and the noise refiners on the image's, before
        the main layers join them into one sequence (comfy/ldm/lumina NextDiT.patchify_and_embed)."""
        context, noise = {id(b) for b in unet.context_refiner}, {id(b) for b in unet.noise_refiner}
        return [(0, self.text_tokens) if id(unit) in context else (image, 0) if id(unit) in noise
                else (image, self.text_tokens) for unit in units]
