"""Anima (CircleStone Labs and Comfy Org's 2B anime model, ComfyUI 0.33) as ComfyUI loads it: comfy/ldm/anima, Cosmos-
Predict2's MiniTrainDIT (28 blocks of self-attention, cross-attention and a GELU MLP, each modulated by adaLN-LoRA
from the timestep) with an LLM adapter that reads Qwen3-0.6B's hidden states through T5 token embeddings; flow
matching at ComfyUI's shift 3; the Qwen-Image (= Wan 2.1) VAE's 5-D latents (batch, 16, 1, height/8, width/8).

The LLM adapter is part of the diffusion model's file but not of its blocks: ComfyUI runs it once per prompt, in the
model's extra_conds while sampling (inference mode), and hands the blocks its output padded to 512 tokens. LeanLoRA's
text cache is built the same way, so the adapter is a frozen text encoder here, as kohya's sd-scripts leaves it by
default (its `train_llm_adapter` is off); the LoRA goes on the DiT blocks. ComfyUI 0.3.75 has no Anima: matches()
answers no there."""
from __future__ import annotations

import types

import torch
from einops import rearrange

import comfy.model_base

from .common import TransformerFamily, prediction_of
from ..trainer_api import FamilyIdentity, LoraTargets, SampleDefaults, SampleLimits

# module-name suffixes in ComfyUI's Cosmos-Predict2 Block (comfy/ldm/cosmos/predict2.py), the names kohya's
# lora_anima writes (lora_unet_blocks_0_self_attn_q_proj ...): every Linear of a block but its adaLN modulations,
# which kohya excludes (`.*(_modulation|_norm|_embedder|final_layer).*`)
_ATTENTION = tuple(f"{attn}.{p}_proj" for attn in ("self_attn", "cross_attn") for p in ("q", "k", "v", "output"))


def _anima_model():
    return getattr(comfy.model_base, "Anima", None)  # ComfyUI 0.33 and later


class Anima(TransformerFamily):
    name = "Anima"
    LORA_TARGETS = {
        LoraTargets.ATTENTION: _ATTENTION,
        LoraTargets.ATTENTION_FEED_FORWARD: (*_ATTENTION, "mlp.layer1", "mlp.layer2"),  # kohya's default set
    }
    text_tokens = 512  # the LLM adapter's output, padded to 512 tokens, attended by every block's cross-attention
    # Cosmos-Predict2's blocks: the image's tokens run every Linear but cross-attention's keys and values (the
    # text's) and the adaLN modulations (the timestep's, one row per image)
    PER_IMAGE_LINEARS = ("adaln_modulation_self_attn", "adaln_modulation_cross_attn", "adaln_modulation_mlp")
    TEXT_LINEARS = ("cross_attn.k_proj", "cross_attn.v_proj")
    IMAGE_LINEARS = ("self_attn", "cross_attn.q_proj", "cross_attn.output_proj", "mlp")
    # the MODEL's weights extra_conds runs on the text: the cached conditioning is kept per adapter (a fine-tune's own
    # adapter, or a LoRA patching it, as kohya's train_llm_adapter writes, encodes captions differently)
    conditioning_weights = "diffusion_model.llm_adapter."
    # Anima's model card: about 1 megapixel, 30-50 steps at CFG 4-5 with er_sde (its default sampler); ComfyUI's
    # simple schedule over the model's shift-3 table
    sample_defaults = SampleDefaults(sampler="er_sde", scheduler="simple", size_multiple=16)
    sample_limits = SampleLimits("Anima", 2048, 150, "its native size is 1024 (about a megapixel)")
    # Not measured on a GPU yet: whether its forward (RoPE, fused RMSNorm+RoPE kernels) captures into a CUDA graph
    graph_blocker = "CUDA graphs are not verified on Anima yet"

    def matches(self, base) -> bool:
        model = _anima_model()
        return model is not None and type(base) is model

    def unsupported(self, base) -> str | None:
        """A file whose patch embedding takes other channels than the latent's (and the padding mask ComfyUI adds)
        would fail inside the first step: the latents LeanLoRA encodes have the VAE's only. (Quantized files
        train: the training copy takes their dequantized weights.)"""
        unet = base.diffusion_model
        patch = unet.patch_spatial ** 2 * unet.patch_temporal
        takes = unet.x_embedder.proj[1].in_features // patch - int(unet.concat_padding_mask)
        latent = base.latent_format.latent_channels
        if takes != latent:
            return (f"this Anima model takes {takes} input channels and its latents have {latent}: a variant with "
                    "extra input channels is not supported; train on Anima itself (Load Diffusion Model with an "
                    "anima-* file)")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Anima", "anima", "anima", "https://huggingface.co/circlestone-labs/Anima",
                              prediction_of(model_sampling), recorded_as=("anima",))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        shift = getattr(base.model_sampling, "shift", None)
        return (f"Anima ({len(unet.blocks)} blocks, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B "
                f"parameters with its LLM adapter, dtype {unet.dtype}), flow matching"
                f"{f' at shift {shift:g}' if shift else ''}; the LLM adapter runs once per caption, frozen")

    def prepare(self, unet: torch.nn.Module) -> None:
        """The training copy without its LLM adapter: the cached conditioning is the adapter's output already (its
        forward runs the adapter only when given T5 token ids, which training never passes), so the adapter would
        only take memory, and its blocks' self_attn/cross_attn q/k/v_proj would take the LoRA's suffixes. Its
        blocks' self-attention computes the fused norm and RoPE differentiably (_self_attention_qkv)."""
        unet.llm_adapter = None
        for block in unet.blocks:
            block.self_attn.compute_qkv = types.MethodType(_self_attention_qkv, block.self_attn)

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return list(unet.blocks)

    def latent_patch(self, unet: torch.nn.Module) -> tuple[int, int]:
        return unet.patch_spatial, unet.patch_spatial


def _rope_split_half(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Split-half rotary embedding (element i pairs with i + head_dim/2) with Cosmos' rope table (..., 2, 2), as
    comfy_kitchen's eager backend computes it."""
    pairs = x.reshape(*x.shape[:-1], 2, -1).movedim(-2, -1).unsqueeze(-2).to(freqs.dtype)
    rotated = freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]
    return rotated.movedim(-1, -2).reshape(*x.shape).type_as(x)


def _self_attention_qkv(self, x, context=None, rope_emb=None, transformer_options={}):
    """comfy.ldm.cosmos.predict2.Attention.compute_qkv (0.33) for a block's self-attention, with the fused RMSNorm +
    split-half RoPE kernel it calls (comfy_kitchen's rms_rope_split_half, a custom op without a backward) computed
    as that op's eager version computes it: the norm module, then the rotation. On the CPU, where the op runs that
    eager code, the numbers are the same bit for bit."""
    context = x if context is None else context
    q_input, k_input, v_input = x, context, context
    patches = transformer_options.get("patches", {})
    if "attn1_patch" in patches:
        extra_options = {**transformer_options, "n_heads": self.n_heads, "dim_head": self.head_dim}
        for patch in patches["attn1_patch"]:
            out = patch(q_input, k_input, v_input, pe=rope_emb, attn_mask=None, extra_options=extra_options)
            q_input, k_input, v_input = out.get("q", q_input), out.get("k", k_input), out.get("v", v_input)
            rope_emb = out.get("pe", rope_emb)
    q, k, v = (rearrange(t, "b ... (h d) -> b ... h d", h=self.n_heads, d=self.head_dim)
               for t in (self.q_proj(q_input), self.k_proj(k_input), self.v_proj(v_input)))
    q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
    if rope_emb is not None:
        q, k = _rope_split_half(q, rope_emb), _rope_split_half(k, rope_emb)
    return q, k, v
