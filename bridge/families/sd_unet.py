"""Stable Diffusion 1.x / 2.x / SDXL: ComfyUI's ldm UNet (comfy/ldm/modules/diffusionmodules/openaimodel.py) with
its SpatialTransformer layers, eps- or v-prediction, CLIP text encoders."""
from __future__ import annotations

import types

import torch

import comfy.ldm.modules.attention as comfy_attention
import comfy.model_base
import comfy.utils
from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample, ResBlock, TimestepBlock, Upsample

from .common import call_diffusion_model, prediction_of
from ..trainer_api import (SD_SAMPLE_LIMITS, CheckpointDepth, FamilyIdentity, LoraTargets, SampleDefaults,
                           TimestepSampling, most_memory_per_flop_first, store_frozen_convs_channels_last)

# Module-name suffixes inside ComfyUI's (ldm) UNet; peft matches them against full module paths.
LORA_TARGETS = {
    LoraTargets.ATTENTION: ("to_q", "to_k", "to_v", "to_out.0"),
    LoraTargets.ATTENTION_FEED_FORWARD: ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
}


class SdUnet:
    name = "SD1.x/SD2.x/SDXL UNet"
    timestep_sampling = TimestepSampling.UNIFORM
    sequence_conditioning = ("c_crossattn",)  # captions over 75 tokens encode to longer ones (CONDCrossAttn)
    sample_defaults = SampleDefaults(sampler="euler", scheduler="normal", size_multiple=8)
    sample_limits = SD_SAMPLE_LIMITS  # checked before training
    graph_blocker = None
    text_conditioning: dict = {}

    def matches(self, base) -> bool:
        return hasattr(getattr(base, "diffusion_model", None), "input_blocks")

    def unsupported(self, base) -> str | None:
        if getattr(base, "concat_keys", ()):
            return "inpainting/instruct checkpoints (extra input channels) are not supported yet"
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        """SD1.x / SD2.x / SDXL and the prediction type (model_sampling: the MODEL's own, which ComfyUI's
        ModelSamplingDiscrete node may have patched), as kohya's metadata names them."""
        prediction = prediction_of(model_sampling)  # "flow" too, for a schedule patched to flow matching
        v_prediction = prediction == "v"
        if isinstance(base, (comfy.model_base.SDXL, comfy.model_base.SDXLRefiner)):
            # kohya: SDXL LoRAs follow Stability's ldm layout, SD1/SD2 LoRAs diffusers' module names
            return FamilyIdentity("SDXL", "sdxl_base_v1-0", "stable-diffusion-xl-v1-base",
                                  "https://github.com/Stability-AI/generative-models", prediction,
                                  recorded_as=("sdxl", "stable-diffusion-xl"))
        if type(base.model_config).__name__.startswith("SD2"):
            return FamilyIdentity("SD2.x", "sd_v2" + ("_v" if v_prediction else ""),
                                  "stable-diffusion-v2-768-v" if v_prediction else "stable-diffusion-v2-512",
                                  "diffusers", prediction, v2=True, recorded_as=("sd_v2", "stable-diffusion-v2"))
        return FamilyIdentity("SD1.x", "sd_v1" + ("_v" if v_prediction else ""), "stable-diffusion-v1",
                              "diffusers", prediction, recorded_as=("sd_v1", "stable-diffusion-v1"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"{type(base).__name__} ({base.model_type.name} prediction), "
                f"{sum(p.numel() for p in unet.parameters()) / 1e6:.1f}M UNet parameters, dtype {unet.dtype}")

    def prepare(self, unet: torch.nn.Module) -> None:
        pass  # its blocks run as ComfyUI wrote them

    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]:
        return LORA_TARGETS[targets]

    def checkpoint_units(self, unet: torch.nn.Module, depth: CheckpointDepth = CheckpointDepth.LAYER,
                         latent_size: tuple[int, int] | None = None) -> list[torch.nn.Module]:
        """Every ResBlock, plus every transformer layer (CheckpointDepth.LAYER) or every whole SpatialTransformer
        (BLOCK). ComfyUI's UNet runs the layers of its TimestepEmbedSequential blocks one by one
        (forward_timestep_embed), never the block's own forward, so checkpointing must wrap the layers. SDXL's
        deep levels stack 10 transformer layers in one SpatialTransformer: per-layer units keep one layer's
        activations alive during recompute, not ten; per-block units keep fewer inputs (and recompute the norm
        and projections around the layers too). With `latent_size` (height, width), the units come best first
        for partial checkpointing, each counted at its level's resolution (recompute_cost)."""
        units, tokens = [], []
        size, skip_sizes = latent_size or (1, 1), []  # Downsample rounds odd sizes up; Upsample returns to the skip's
        for block in [*unet.input_blocks, unet.middle_block, *unet.output_blocks]:
            for layer in block:
                if hasattr(layer, "transformer_blocks"):
                    found = list(layer.transformer_blocks) if depth is CheckpointDepth.LAYER else [layer]
                elif isinstance(layer, TimestepBlock):
                    found = [layer]
                else:
                    found = []
                units += found
                tokens += [size[0] * size[1]] * len(found)
                resampler = getattr(layer, "h_upd", layer)  # a ResBlock may resample too (resblock_updown)
                if isinstance(resampler, Downsample):
                    skip_sizes.append(size)
                    size = ((size[0] + 1) // 2, (size[1] + 1) // 2)
                elif isinstance(resampler, Upsample) and skip_sizes:
                    size = skip_sizes.pop()
        if latent_size is None:
            return units
        return most_memory_per_flop_first(units, [recompute_cost(u, t) for u, t in zip(units, tokens)])

    def compile_units(self, unet: torch.nn.Module, scope: str = "layers") -> list[torch.nn.Module]:
        """Makes the training copy ready for torch.compile and returns what compiles, each module on its own:
        ResBlocks, plus whole transformer layers ("layers": their norms and residual adds fuse with attention and
        feed-forward; SDXL batch 8 steps were 0.5-1.3% faster than with "modules" in two H200 runs, from fewer
        graphs) or only the layers' attention and feed-forward modules ("modules"). For "layers" it installs two
        forwards: a position-free one on each layer (ComfyUI's layer forward reads its position in the UNet from
        transformer_options, which would make every layer a compile of its own, SDXL: 70; see
        _position_free_forward) and a GEGLU in two matmuls on each feed-forward (_split_geglu_forward).

        ResBlocks at the UNet's widest channel count stay uncompiled (_resblocks_worth_compiling)."""
        if scope == "modules":
            kinds = (ResBlock, comfy_attention.CrossAttention, comfy_attention.FeedForward)
            return [module for module in unet.modules() if isinstance(module, kinds)]
        layers = [m for m in unet.modules() if isinstance(m, comfy_attention.BasicTransformerBlock)]
        for layer in layers:
            layer.forward = types.MethodType(_position_free_forward, layer)
        for geglu in (m for m in unet.modules() if isinstance(m, comfy_attention.GEGLU)):
            geglu.forward = types.MethodType(_split_geglu_forward, geglu)
        return _resblocks_worth_compiling(unet) + layers

    def upcast_groups(self, unet: torch.nn.Module):
        """Each ResBlock's and each transformer layer's fp8 weights are upcast together."""
        return [m for m in unet.modules() if isinstance(m, (ResBlock, comfy_attention.BasicTransformerBlock))]

    def predict(self, unet: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                cond: dict[str, torch.Tensor], transformer_options: dict) -> torch.Tensor:
        return call_diffusion_model(unet, x, timestep, cond, transformer_options)  # SD's conds are all floating

    def set_conv_layout(self, base, unet: torch.nn.Module, device: torch.device,
                        compute_dtype: torch.dtype) -> str | None:
        """Stores the training copy's frozen conv weights channels-last where that measured faster (trainer/layout:
        with NCHW weights, an SD1.5 step at 512² spent 8 ms transposing for 4 ms of convolution). H200, bf16, CUDA
        graphs, batch 1: SD1.5 512² 0.0248 -> 0.0204 s/step (fast), 0.0333 -> 0.0270 (checkpointing); SDXL 1024²
        1% slower. So only where it was measured, or where the same cuDNN NHWC kernels run: SD1.5/SD2's BaseModel,
        half-precision compute, NVIDIA GPUs from Ampere on. Returns a note for the report, or None."""
        nvidia_ampere_or_newer = device.type == "cuda" and torch.version.hip is None \
            and torch.cuda.get_device_capability(device)[0] >= 8
        if not nvidia_ampere_or_newer or compute_dtype not in (torch.bfloat16, torch.float16) \
                or type(base) is not comfy.model_base.BaseModel:
            return None
        count = store_frozen_convs_channels_last(unet)
        return f"convolutions: {count} frozen conv weights stored channels-last (NHWC), as cuDNN computes them"

    def kohya_module_names(self, base) -> dict[str, str] | None:
        """kohya names SD1.x/SD2.x modules as in a diffusers UNet (its networks/lora.py walks one:
        down_blocks.0.attentions.0...), SDXL ones as in the ldm UNet the training copy is (its sdxl_original_unet:
        input_blocks.4.1...). For SD1/SD2 this is ComfyUI's own ldm -> diffusers map (the one its LoRA loader reads
        diffusers-named keys with), per module: {ldm path: diffusers path}. None: keep the ldm paths."""
        if isinstance(base, (comfy.model_base.SDXL, comfy.model_base.SDXLRefiner)):
            return None
        return self.diffusers_module_names(base)

    def diffusers_module_names(self, base) -> dict[str, str]:
        """{ldm path: diffusers path} of every weight module, for any UNet family: how diffusers/peft LoRA files name
        them (ComfyUI's LoRA loader reads diffusers-named keys through the same map)."""
        diffusers_to_ldm = comfy.utils.unet_to_diffusers(base.model_config.unet_config)
        return {ldm[: -len(".weight")]: diffusers[: -len(".weight")]
                for diffusers, ldm in diffusers_to_ldm.items() if diffusers.endswith(".weight")}

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        return 1.0  # discrete DDPM schedules do not move with the image size


# The cost model of partial checkpointing (trainer/checkpointing.most_memory_per_flop_first).
# The model, per unit of the ldm UNet at `tokens` positions (its output's height x width), counts what autograd
# keeps for backward inside the unit (beyond the input, which checkpointing keeps too) and what a forward costs:
#   ResBlock (C_in -> C_out): two GroupNorm -> SiLU -> conv chains, each keeping the norm's, SiLU's and conv's
#     inputs: tokens x (2 C_in + 3 C_out) saved; tokens x the convs' weight elements multiply-adds.
#   transformer layer (width D, feed-forward width F, GEGLU; frozen linears keep no input, LoRA's rank-sized
#     tensors are small): norm2's and norm3's inputs, self-attention's normed input, q, k, v and output (the
#     out-projection's input), cross-attention's normed input, q and output (and its context-sized k and v),
#     GEGLU's projection (value and gate) and gelu(gate): tokens x (10 D + 3 F) saved; tokens x the linears' weights (context tokens for
#     cross-attention's keys and values) plus 2 x tokens x (tokens + context) x D multiply-adds for the attentions.
# Per multiply-add, a ResBlock frees ~5 / (18 C), a layer 22 / (18 D + 2 tokens): lower widths (= higher
# resolutions) first. SDXL 1024² (elements per multiply-add x 1e4): layers at 64² 11.1, ResBlocks at 128² 7.2-8.7,
# layers at 32² 8.7, ResBlocks at 64² 3.6-4.5, at 32² 1.9-2.2; all units together 4.9 GiB in bf16 (full
# checkpointing measured 4.8 GiB less). Against autograd's saved tensors on CPU (pytorch SDPA, LoRA on attention)
# the saved terms are within 10%, and the linears' and convs' multiply-adds match torch's FLOP counter.
# Recompute time is taken as FLOPs (norms and activations are memory-bound, cheap beside convs and matmuls).
CONTEXT_TOKENS = 77  # one CLIP chunk: the length of the cross-attention keys and values the model assumes


def recompute_cost(unit: torch.nn.Module, tokens: int) -> tuple[int, int]:
    """(activation elements that checkpointing `unit` frees, multiply-adds its recompute costs), by the model
    above; `unit` is a ResBlock, a transformer layer or a whole SpatialTransformer ("per block")."""
    if hasattr(unit, "transformer_blocks"):
        parts = [recompute_cost(layer, tokens) for layer in unit.transformer_blocks]
        return sum(saved for saved, _ in parts), sum(macs for _, macs in parts)
    linears = [m for m in unit.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    if hasattr(unit, "attn1"):
        width, feed_forward = unit.attn1.to_q.in_features, unit.ff.net[-1].in_features
        context = CONTEXT_TOKENS if unit.attn2 is not None else 0
        context_side = {id(m) for projection in ((unit.attn2.to_k, unit.attn2.to_v) if context else ())
                        for m in projection.modules()}
        macs = sum(m.weight.numel() * (context if id(m) in context_side else tokens) for m in linears)
        attention = 2 * tokens * (tokens + context) * unit.attn1.to_q.out_features
        return tokens * (10 * width + 3 * feed_forward) + 2 * context * width, macs + attention
    convs = sum(m.weight.numel() for m in linears if isinstance(m, torch.nn.Conv2d))  # the time embedding is per image
    return tokens * (2 * unit.channels + 3 * unit.out_channels), tokens * convs



def _resblocks_worth_compiling(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The ResBlocks whose compiled graphs pay for their compile time. Every ResBlock shape is a graph of its own
    (SDXL: 13), and each cost 5-6 s of a cold compile on an H200 machine whatever its size, while what compiling
    gains (fused norms and activations) grows with the activations: at the widest channel count the image is
    smallest (SDXL 1024²: 1280 x 32², a quarter of the top level's elements). Campaign 9, SDXL batch 8, each cold
    on H200 machines: all ResBlocks compiled in 90 s (0.3246 s/step) and 112 s (0.3194, one kernel config fewer);
    without the widest level's 5 shapes, 61 s (0.3229; 44 s in the issue-4 run); without any ResBlock, 19 s
    (0.3311). A one-width UNet keeps all of its ResBlocks."""
    resblocks = [m for m in unet.modules() if isinstance(m, ResBlock)]
    widths = {m.out_channels for m in resblocks}
    if len(widths) < 2:
        return resblocks
    return [m for m in resblocks if m.out_channels < max(widths)]


_LAYER_POSITION = ("block", "block_index", "transformer_index")


def _position_free_forward(self, x, context=None, transformer_options={}):
    """A transformer layer's forward without its position in the UNet. Only patches (attention replacements,
    ControlNet-style hooks) look the position up, and the training copy runs none (its transformer_options hold
    at most the attention override), so the layer computes the same; every layer of one shape then shares one
    compiled graph."""
    options = {k: v for k, v in transformer_options.items() if k not in _LAYER_POSITION}
    return type(self).forward(self, x, context=context, transformer_options=options)


def _split_geglu_forward(self, x):
    """ComfyUI's GEGLU (one projection to value and gate, split with chunk) as two matmuls on row slices of the
    same frozen weight: the same products, but backward needs no concatenation of the two halves' gradients.
    Compiled, an SDXL batch-8 step's 70 GEGLUs took 54.5 instead of 66.7 ms, forward and backward (H200,
    bench/kernels.py). A projection that computes its weight per call (fp8, LoRA patches, a LoRA on it) keeps
    ComfyUI's forward. Where the compiled layers run eagerly (compiling failed, auto-fit's probes) this runs
    eagerly too: the same math, its eager speed not measured."""
    proj = self.proj
    if not isinstance(proj, torch.nn.Linear) or proj.weight.requires_grad or getattr(proj, "comfy_cast_weights", False) \
            or getattr(proj, "weight_function", None) or getattr(proj, "bias_function", None):
        return type(self).forward(self, x)
    half, bias = proj.weight.shape[0] // 2, proj.bias
    value = torch.nn.functional.linear(x, proj.weight[:half], None if bias is None else bias[:half])
    gate = torch.nn.functional.linear(x, proj.weight[half:], None if bias is None else bias[half:])
    return value * torch.nn.functional.gelu(gate)
