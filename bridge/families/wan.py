"""Wan 2.1 and Wan 2.2 T2V-A14B (Alibaba's text-to-video DiTs) as ComfyUI loads them: comfy/ldm/wan WanModel
(30 blocks at 1.3B, 40 at 14B; self-attention, cross-attention over umt5-xxl's 512 tokens, a GELU MLP), flow
matching at ComfyUI's shift 8, the Wan 2.1 VAE's 5-D latents (batch, 16, frames, height/8, width/8). LeanLoRA trains
an image LoRA: each image is a one-frame video (latent time axis 1), as musubi-tuner trains Wan on image datasets.

Wan 2.2 T2V-A14B is two such models (high noise, low noise): ComfyUI loads each as a Wan 2.1 model, and a LoRA
trains on the one connected. Refused, with what they need: the image-to-video and control models (extra input
channels: a start image, a mask, CLIP vision features), Wan 2.2 TI2V-5B (48-channel latents of the Wan 2.2 VAE) and
the VACE, camera, S2V, HuMo and Animate models (their own conditioning)."""
from __future__ import annotations

import torch

import comfy.model_base

from .common import TransformerFamily, prediction_of
from ..trainer_api import FamilyIdentity, LoraTargets, SampleDefaults, SampleLimits

# module-name suffixes in ComfyUI's WanAttentionBlock, the official Wan code's and musubi-tuner's names
_ATTENTION = tuple(f"{attn}.{p}" for attn in ("self_attn", "cross_attn") for p in "qkvo")


class Wan(TransformerFamily):
    name = "Wan 2.1/2.2 T2V"
    LORA_TARGETS = {
        LoraTargets.ATTENTION: _ATTENTION,
        LoraTargets.ATTENTION_FEED_FORWARD: (*_ATTENTION, "ffn.0", "ffn.2"),  # musubi-tuner's set: every block Linear
    }
    text_tokens = 512  # umt5-xxl's padded prompt, attended by every block's cross-attention
    # no joint sequence: the image's tokens run every Linear but cross-attention's keys and values, the text's
    TEXT_LINEARS = ("cross_attn.k", "cross_attn.v")
    IMAGE_LINEARS = ("self_attn", "cross_attn.q", "cross_attn.o", "ffn")
    # ComfyUI's Wan 2.1 text-to-video template: KSampler uni_pc / simple after ModelSamplingSD3 (shift 8); one frame
    sample_defaults = SampleDefaults(sampler="uni_pc", scheduler="simple", size_multiple=16)
    sample_limits = SampleLimits("Wan", 2048, 150, "its native size is 1280x720, 832x480 at 1.3B")
    # Not measured on a GPU yet: whether Wan's forward (RoPE over the latent grid) captures into a CUDA graph
    graph_blocker = "CUDA graphs are not verified on Wan yet"

    def matches(self, base) -> bool:
        return isinstance(base, comfy.model_base.WAN21)  # every Wan variant: the ones it cannot train are refused

    def unsupported(self, base) -> str | None:
        model = type(base.model_config).__name__
        if type(base) is not comfy.model_base.WAN21:
            what = ("Wan 2.2 TI2V-5B (48-channel latents of the Wan 2.2 VAE)" if type(base).__name__ == "WAN22"
                    else f"this Wan variant ({model}: VACE, camera, S2V, HuMo or Animate conditioning)")
            return (f"{what} is not supported; LeanLoRA trains Wan 2.1 and Wan 2.2 T2V-A14B text-to-video models "
                    "(Load Diffusion Model with a wan2.1_t2v_* or wan2.2_t2v_*_noise_14B_* file)")
        unet = base.diffusion_model
        extra = unet.patch_embedding.weight.shape[1] - unet.out_dim
        if extra or getattr(unet, "img_emb", None) is not None:
            return (f"this Wan model ({model}) is an image-to-video or control model: it takes {extra} extra input "
                    "channels (a start image and its mask, or a control video) and CLIP vision features, which "
                    "LeanLoRA does not build; train a LoRA on the text-to-video model instead")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        # musubi-tuner writes modelspec.architecture "wan2.1" for Wan 2.1 and 2.2 alike; ComfyUI's files of the two
        # T2V releases build the same model, so which one was loaded is not known here
        return FamilyIdentity("Wan 2.1/2.2 T2V", "wan2.1", "wan2.1", "https://github.com/Wan-Video/Wan2.1",
                              prediction_of(model_sampling), recorded_as=("wan2.1", "wan2.2", "wan"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        shift = getattr(base.model_sampling, "shift", None)
        return (f"Wan T2V ({len(unet.blocks)} blocks, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B "
                f"parameters, dtype {unet.dtype}), flow matching{f' at shift {shift:g}' if shift else ''}; "
                "each image trains as a one-frame video")

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return list(unet.blocks)

    def latent_patch(self, unet: torch.nn.Module) -> tuple[int, int]:
        _, patch_h, patch_w = unet.patch_size  # (frames, height, width): one frame
        return patch_h, patch_w
