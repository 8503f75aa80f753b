"""Chroma (lodestones' 8.9B model from FLUX.1-schnell) as ComfyUI loads it: comfy/ldm/chroma, FLUX.1's double and
single blocks without their per-block modulation (one distilled guidance approximator makes every block's shift,
scale and gate from the timestep), T5-XXL alone (no CLIP-L pooled vector, no guidance embedding), flow matching.

The blocks are comfy.ldm.flux.layers' own, so everything FLUX.1 does for them holds: the same LoRA targets and
kohya names, the same units, and the same out-of-place block forwards (Flux.prepare), which take the
modulations Chroma hands each block."""
from __future__ import annotations

import comfy.model_base

from .common import prediction_of
from .flux import Flux
from ..trainer_api import FamilyIdentity, SampleLimits


class Chroma(Flux):
    name = "Chroma"
    sample_limits = SampleLimits("Chroma", 2048, 150, "its native size is 1024")  # checked before training
    # ComfyUI conditions Chroma at guidance 0 (model_base.Chroma.extra_conds' default) and samples it with real
    # CFG and negative prompts: training keeps that default
    text_conditioning: dict = {}
    # ComfyUI's Chroma tokenizer (PixArt's T5, min_length 1) does not pad to FLUX.1's 256: the caption's own length,
    # which the cost model does not know, counts none (as Qwen-Image's and Z-Image's)
    text_tokens = 0

    def matches(self, base) -> bool:
        return type(base) is comfy.model_base.Chroma  # not Chroma Radiance: pixel space, other blocks

    def unsupported(self, base) -> str | None:
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Chroma", "chroma", "chroma", "https://huggingface.co/lodestones/Chroma",
                              prediction_of(model_sampling), recorded_as=("chroma",))

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        return 1.0  # ComfyUI samples Chroma on its model's own schedule at every size (no ModelSamplingFlux node)
