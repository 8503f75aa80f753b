"""FLUX.2 (dev, klein 4B, klein 9B) as ComfyUI 0.33 loads it: comfy/ldm/flux's Flux with image_model "flux2" (FLUX.1's
double- and single-stream blocks without biases, SiLU-gated MLPs, no per-block modulation: one shared modulation per
stream for all blocks), flow matching at shift 2.02, the FLUX.2 VAE's 128-channel latents (32 channels, 2x2 patched,
16x down; patch size 1), text as three of the text encoder's hidden states stacked and padded to 512 tokens.

Which FLUX.2 a file is, from its weights (ComfyUI's model_detection reads them so): dev has a guidance embedding and
Mistral-Small-3.1-24B's text (3 x 5120 = 15360 wide; 8 double + 48 single blocks, 6144 wide); klein 4B takes Qwen3-4B's
(3 x 2560 = 7680; 5 + 20 blocks, 3072 wide) and klein 9B Qwen3-8B's (3 x 4096 = 12288; 8 + 24 blocks, 4096 wide), with
no guidance embedding. klein's base and step-distilled releases have the same weights' shapes: nothing tells them
apart (peers train on base; the distilled ones sample in 4 steps at cfg 1).

The blocks are comfy.ldm.flux.layers' own, so FLUX.1's family serves: the same LoRA targets and kohya names (ComfyUI's
module paths), the same units, the same out-of-place block forwards (Flux.prepare; they take the shared
modulations as Chroma's blocks take theirs). ComfyUI 0.3.75 loads FLUX.2 dev too (not klein: no Qwen3 text encoder
for it there); LeanLoRA's FLUX.2 is tested on 0.33."""
from __future__ import annotations

import math

import comfy.model_base
import comfy.model_sampling

from .common import prediction_of
from .flux import FLUX2_RECORDED_AS, Flux
from ..trainer_api import FamilyIdentity, SampleDefaults, SampleLimits

FLUX2_SHIFT = 2.02  # the mu of comfy.supported_models.Flux2's own table (ModelSamplingFlux)
# The step count of ComfyUI's FLUX.2 dev and klein base templates (Flux2Scheduler): the schedule training follows
TEMPLATE_STEPS = 20
# Text encoder width (3 hidden states stacked) -> which klein (dev is told by its guidance embedding)
_KLEIN_BY_CONTEXT = {3 * 2560: ("klein 4B", "klein-4b"), 3 * 4096: ("klein 9B", "klein-9b")}


def flux2_scheduler_mu(image_tokens: int, steps: int) -> float:
    """The mu (log time shift) ComfyUI's Flux2Scheduler samples an image of `image_tokens` latent positions with in
    `steps` steps (comfy_extras/nodes_flux.py compute_empirical_mu, Black Forest Labs' fit): linear in the tokens
    at 10 and at 200 steps and interpolated in the steps between, the 200-step line alone past 4300 tokens."""
    at_200 = 0.00016927 * image_tokens + 0.45666666
    if image_tokens > 4300:
        return at_200
    at_10 = 8.73809524e-05 * image_tokens + 1.89833333
    slope = (at_200 - at_10) / 190.0
    return slope * steps + at_200 - 200.0 * slope


class Flux2(Flux):
    name = "FLUX.2"
    text_tokens = 512  # ComfyUI pads the text to 512 tokens (model_base.Flux2.extra_conds)
    # ComfyUI's FLUX.2 templates: euler with Flux2Scheduler, whose schedule is the model's own shift-2.02 table's
    # shape ("simple" on it); a latent position is 16 pixels (VAE 16x, patch 1)
    sample_defaults = SampleDefaults(sampler="euler", scheduler="simple", size_multiple=16)
    sample_limits = SampleLimits("FLUX.2", 2048, 150, "its native size is 1024")  # checked before training
    # dev's distilled guidance trains at 1.0 as FLUX.1-dev's (kohya, ai-toolkit); klein has no guidance embedding
    # and ignores it
    text_conditioning = {"guidance": 1.0}

    def matches(self, base) -> bool:
        flux2 = getattr(comfy.model_base, "Flux2", None)  # ComfyUI 0.3.75 (dev only) and newer
        return flux2 is not None and type(base) is flux2

    def unsupported(self, base) -> str | None:
        """A file whose input takes more than the latent's channels (a conditioned variant) would fail inside the
        first step. (Quantized files train: the training copy takes their dequantized weights.)"""
        unet = base.diffusion_model
        takes = unet.img_in.weight.shape[1] // unet.patch_size ** 2
        latent = base.latent_format.latent_channels
        if takes != latent:
            return (f"this FLUX.2 model takes {takes} input channels and FLUX.2's latents have {latent}: a variant with "
                    "extra input channels is not supported; train on FLUX.2 dev or klein (Load Diffusion Model)")
        return None

    def variant(self, base) -> tuple[str, str]:
        """(what users call it, its modelspec architecture as musubi-tuner writes it), from the weights."""
        unet = base.diffusion_model
        if unet.params.guidance_embed:
            return "dev", "Flux.2-dev"
        name, arch = _KLEIN_BY_CONTEXT.get(unet.params.context_in_dim, ("klein", "klein"))
        return name, f"Flux.2-{arch}"

    def identity(self, base, model_sampling) -> FamilyIdentity:
        name, architecture = self.variant(base)
        return FamilyIdentity(f"FLUX.2 {name}", "flux2", architecture, "https://github.com/black-forest-labs/flux2",
                              prediction_of(model_sampling), recorded_as=FLUX2_RECORDED_AS)

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"FLUX.2 {self.variant(base)[0]} ({len(unet.double_blocks)} double + {len(unet.single_blocks)} single "
                f"blocks, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B parameters, dtype {unet.dtype}, "
                f"text {unet.params.context_in_dim} wide), flow matching")

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        """ComfyUI samples FLUX.2 with Flux2Scheduler (its templates: 20 steps for dev and klein base), whose shift
        grows with the image: mu 1.92 at 512², 2.20 at 1024², against the model's own table's 2.02. An image trains
        where it is sampled: the noise levels move by exp(mu(size) - 2.02). A schedule the user set (any other
        shift) is trained as it is."""
        if not isinstance(model_sampling, comfy.model_sampling.ModelSamplingFlux) or \
                abs(model_sampling.shift - FLUX2_SHIFT) > 1e-6:
            return 1.0
        tokens = latent_size[0] * latent_size[1]  # patch size 1: one token per latent position
        return math.exp(flux2_scheduler_mu(tokens, TEMPLATE_STEPS) - model_sampling.shift)

    def edit_variant(self, base):
        return None  # FLUX.2 takes reference latents natively; training on pairs is not built for it yet
