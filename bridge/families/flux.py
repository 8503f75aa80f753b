"""FLUX.1 (dev and schnell) as ComfyUI loads it: comfy/ldm/flux (19 double-stream and 38 single-stream blocks in
the full model), flow matching, CLIP-L's pooled vector and T5-XXL's sequence, the guidance embedding."""
from __future__ import annotations

import math
import types

import torch

import comfy.ldm.flux.layers as flux_layers
import comfy.model_base
import comfy.model_sampling

from .common import TransformerFamily, prediction_of
from .edit import EditVariant
from ..trainer_api import FamilyIdentity, LoraTargets, SampleLimits

# how LoRA files name FLUX.1 (older tools write plain "flux"); FLUX.2's names begin with it but are not FLUX.1
FLUX1_RECORDED_AS = ("flux1", "flux-1", "flux.1", "flux")
FLUX2_RECORDED_AS = ("flux2", "flux-2", "flux.2")


# (image tokens, mu) at both ends of FLUX.1-dev's resolution-dependent shift (ComfyUI's ModelSamplingFlux node)
FLUX_SHIFT_LOW, FLUX_SHIFT_HIGH = (256, 0.5), (4096, 1.15)


class Flux(TransformerFamily):
    name = "FLUX.1"
    # module-name suffixes in ComfyUI's (= Black Forest Labs') Flux, as kohya's lora_flux names them
    LORA_TARGETS = {
        LoraTargets.ATTENTION: ("img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj", "linear1",
                                "linear2"),
        LoraTargets.ATTENTION_FEED_FORWARD: ("img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj",
                                             "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2", "linear1", "linear2"),
    }
    text_tokens = 256  # ComfyUI pads T5's sequence to at least 256 tokens
    # a double block's two streams run their own layers on their own tokens; the single blocks' linear1/linear2 run
    # on the joined sequence; the per-block modulations (FLUX.1, HunyuanImage 2.1; not Chroma's nor FLUX.2's) on the
    # timestep's vector
    PER_IMAGE_LINEARS = ("img_mod", "txt_mod", "modulation")
    TEXT_LINEARS = ("txt_attn", "txt_mlp")
    IMAGE_LINEARS = ("img_attn", "img_mlp")
    sample_limits = SampleLimits("FLUX.1", 2048, 150, "its native size is 1024")  # checked before training
    # Train dev's distilled guidance at 1.0, as kohya's docs and ai-toolkit do (ComfyUI's default for sampling is
    # 3.5): the LoRA then learns the images, not the guidance embedding's push, and samples at any guidance
    text_conditioning = {"guidance": 1.0}

    def matches(self, base) -> bool:
        return type(base) is comfy.model_base.Flux

    def unsupported(self, base) -> str | None:
        unet = base.diffusion_model  # as comfy.model_base.Flux.concat_cond tells them apart
        if unet.img_in.weight.shape[1] // unet.patch_size ** 2 > base.model_config.unet_config["out_channels"]:
            return ("FLUX.1 Fill/Depth/Canny models (extra input channels) are not supported yet; train on FLUX.1 "
                    "dev or schnell")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        schnell = type(base.model_config).__name__ == "FluxSchnell"
        return FamilyIdentity("FLUX.1-schnell" if schnell else "FLUX.1-dev", "flux1",
                              "flux-1-schnell" if schnell else "flux-1-dev",
                              "https://github.com/black-forest-labs/flux", prediction_of(model_sampling),
                              recorded_as=FLUX1_RECORDED_AS, not_recorded_as=FLUX2_RECORDED_AS)

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        """FLUX.1-dev samples with a shift that grows with the image (Black Forest Labs' mu: 0.5 at 256 image
        tokens, 1.15 at 4096, linear between; ComfyUI's ModelSamplingFlux node with its defaults), while the MODEL's
        own table is the 1024² one (shift 1.15). A smaller image trains where it is sampled: at 512², mu 0.63, so
        the noise levels move down by exp(0.63 - 1.15) (kohya's `flux_shift`). A schedule the user set (any other
        shift: the ModelSamplingFlux node at a chosen size, schnell's 1.0) is trained as it is."""
        if not isinstance(model_sampling, comfy.model_sampling.ModelSamplingFlux) or \
                abs(model_sampling.shift - FLUX_SHIFT_HIGH[1]) > 1e-6:
            return 1.0
        tokens = (latent_size[0] // 2) * (latent_size[1] // 2)  # 2x2 latent patches
        (low_tokens, low_mu), (high_tokens, high_mu) = FLUX_SHIFT_LOW, FLUX_SHIFT_HIGH
        mu = low_mu + (high_mu - low_mu) * (tokens - low_tokens) / (high_tokens - low_tokens)
        return math.exp(mu - model_sampling.shift)

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"{self.identity(base, base.model_sampling).name} ({len(unet.double_blocks)} double + "
                f"{len(unet.single_blocks)} single blocks, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B "
                f"parameters, dtype {unet.dtype}), flow matching")

    def prepare(self, unet: torch.nn.Module) -> None:
        """0.3.75's blocks add into their input in place (`img += ...`) after a LayerNorm saved it for backward:
        backward then fails, checkpointed or not. The training copy's blocks get the same computation with
        out-of-place adds."""
        for block in unet.double_blocks:
            block.forward = types.MethodType(_double_block_forward, block)
        for block in unet.single_blocks:
            block.forward = types.MethodType(_single_block_forward, block)

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return [*unet.double_blocks, *unet.single_blocks]

    def edit_variant(self, base):
        """FLUX.1 Kontext: FLUX.1-dev's model class and weights, trained from a folder of pairs (schnell and the
        families built on Flux's blocks have no edit variant)."""
        dev = type(self) is Flux and type(base.model_config).__name__ != "FluxSchnell"
        return FLUX_KONTEXT if dev else None


class FluxKontext(EditVariant, Flux):
    """FLUX.1 Kontext dev trained on pairs: each control image as FluxKontextImageScale + VAEEncode +
    ReferenceLatent give it (bridge/edit_pairs.py); the caption and guidance as FLUX.1's."""
    name = "FLUX.1 Kontext"

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("FLUX.1-Kontext-dev", "flux1", "flux-1-kontext-dev",
                              "https://github.com/black-forest-labs/flux", prediction_of(model_sampling),
                              recorded_as=FLUX1_RECORDED_AS, not_recorded_as=FLUX2_RECORDED_AS)

    def describe(self, base) -> str:
        return super().describe(base) + ", edit pairs: control images as reference latents"

    def controls(self, adapter):
        from ..edit_pairs import KontextControls
        return KontextControls(adapter)


FLUX_KONTEXT = FluxKontext()


def _double_block_forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None,
                          modulation_dims_txt=None, transformer_options={}):
    """comfy.ldm.flux.layers.DoubleStreamBlock.forward (0.3.75 and 0.33) with out-of-place residual adds (see
    Flux.prepare). The attention patches 0.33 added are for sampling; the training copy runs none."""
    apply_mod, attention = flux_layers.apply_mod, flux_layers.attention
    if self.modulation:
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
    else:
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec

    def qkv(norm, attn, x, mod, dims):
        projected = attn.qkv(apply_mod(norm(x), (1 + mod.scale), mod.shift, dims))
        q, k, v = projected.view(projected.shape[0], projected.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = attn.norm(q, k, v)
        return q, k, v

    img_q, img_k, img_v = qkv(self.img_norm1, self.img_attn, img, img_mod1, modulation_dims_img)
    txt_q, txt_k, txt_v = qkv(self.txt_norm1, self.txt_attn, txt, txt_mod1, modulation_dims_txt)
    flipped = getattr(self, "flipped_img_txt", False)  # 0.3.75's option; newer ComfyUI puts the text first always
    first, second = ((img_q, img_k, img_v), (txt_q, txt_k, txt_v)) if flipped else \
        ((txt_q, txt_k, txt_v), (img_q, img_k, img_v))
    attn = attention(*(torch.cat((a, b), dim=2) for a, b in zip(first, second)), pe=pe, mask=attn_mask,
                     transformer_options=transformer_options)
    if flipped:
        img_attn, txt_attn = attn[:, : img.shape[1]], attn[:, img.shape[1]:]
    else:
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]

    img = img + apply_mod(self.img_attn.proj(img_attn), img_mod1.gate, None, modulation_dims_img)
    img = img + apply_mod(self.img_mlp(apply_mod(self.img_norm2(img), (1 + img_mod2.scale), img_mod2.shift,
                                                 modulation_dims_img)), img_mod2.gate, None, modulation_dims_img)
    txt = txt + apply_mod(self.txt_attn.proj(txt_attn), txt_mod1.gate, None, modulation_dims_txt)
    txt = txt + apply_mod(self.txt_mlp(apply_mod(self.txt_norm2(txt), (1 + txt_mod2.scale), txt_mod2.shift,
                                                 modulation_dims_txt)), txt_mod2.gate, None, modulation_dims_txt)
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def _single_block_forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
    """comfy.ldm.flux.layers.SingleStreamBlock.forward with an out-of-place residual add (see Flux.prepare)."""
    apply_mod = flux_layers.apply_mod
    mod = self.modulation(vec)[0] if self.modulation else vec
    qkv, mlp = torch.split(self.linear1(apply_mod(self.pre_norm(x), (1 + mod.scale), mod.shift, modulation_dims)),
                           [3 * self.hidden_size, self.mlp_hidden_dim_first], dim=-1)
    q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, k = self.norm(q, k, v)
    attn = flux_layers.attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
    if getattr(self, "yak_mlp", False):  # newer ComfyUI's gated MLP variant (0.33)
        half = self.mlp_hidden_dim_first // 2
        mlp = self.mlp_act(mlp[..., half:]) * mlp[..., :half]
    else:
        mlp = self.mlp_act(mlp)
    output = self.linear2(torch.cat((attn, mlp), 2))
    x = x + apply_mod(output, mod.gate, None, modulation_dims)
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x
