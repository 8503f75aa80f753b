"""Krea 2 (Krea's single-stream MMDiT, ComfyUI 0.33 and later) as ComfyUI loads it: comfy/ldm/krea2 SingleStreamDiT
(28 blocks of 6144 wide in the full model, each attending over the text and image tokens together: grouped-query
attention with a sigmoid gate, a SwiGLU MLP), before them a text fusion of 2 layer-wise and 2 refiner blocks over
12 hidden states of Qwen3-VL-4B (CLIPLoader type krea2), flow matching at ComfyUI's fixed shift 1.15, the Wan 2.1
VAE's 5-D latents (batch, 16, 1, height/8, width/8). ComfyUI 0.3.75 has no Krea 2: there the family matches nothing."""
from __future__ import annotations

import torch

import comfy.model_base

from .common import TransformerFamily, prediction_of
from ..trainer_api import FamilyIdentity, LoraTargets, SampleLimits

# module-name suffixes in ComfyUI's Krea 2 blocks (its Attention and SwiGLU): ComfyUI's own paths, and its diffusers
# map (comfy.utils.krea2_to_diffusers) names the same layers. No peer trainer has a Krea 2 set yet: attention is its
# q, k, v, gate and output projections, feed-forward the SwiGLU's three.
_ATTENTION = ("attn.wq", "attn.wk", "attn.wv", "attn.gate", "attn.wo")


class Krea2(TransformerFamily):
    name = "Krea 2"
    LORA_TARGETS = {
        LoraTargets.ATTENTION: _ATTENTION,
        LoraTargets.ATTENTION_FEED_FORWARD: (*_ATTENTION, "mlp.gate", "mlp.up", "mlp.down"),
    }
    # Qwen3-VL's prompt is not padded: a caption of a few dozen words (the checkpointing cost model)
    text_tokens = 64
    sample_limits = SampleLimits("Krea 2", 2048, 150, "its native size is 1024")  # checked before training
    # Not measured on a GPU yet: whether Krea 2's step (a caption-length text fusion, RoPE over the grid) captures
    graph_blocker = "CUDA graphs are not verified on Krea 2 yet"

    def matches(self, base) -> bool:
        krea2 = getattr(comfy.model_base, "Krea2", None)  # ComfyUI 0.33 and later
        return krea2 is not None and type(base) is krea2

    def unsupported(self, base) -> str | None:
        """A file whose patch embedding takes more than the latent's channels (a conditioned variant) would fail
        inside the first step: the latents LeanLoRA encodes have the VAE's channels only. (Quantized files train:
        the training copy takes their dequantized weights.)"""
        unet = base.diffusion_model
        takes = unet.first.weight.shape[1] // unet.patch ** 2
        latent = base.latent_format.latent_channels
        if takes != latent:
            return (f"this Krea 2 model takes {takes} input channels and Krea 2's latents have {latent}: a variant "
                    "with extra input channels is not supported; train on Krea 2 (Load Diffusion Model with a "
                    "krea2 file)")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Krea 2", "krea2", "krea-2", "https://www.krea.ai",
                              prediction_of(model_sampling), recorded_as=("krea2", "krea-2"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        shift = getattr(base.model_sampling, "shift", None)  # a sampling node the user put before Train may set it
        return (f"Krea 2 ({len(unet.blocks)} blocks + {len(self._text_fusion(unet))} text fusion blocks, "
                f"{sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B parameters, dtype {unet.dtype}), "
                f"flow matching{f' at shift {shift:g}' if shift else ''}")

    @staticmethod
    def _text_fusion(unet: torch.nn.Module) -> list[torch.nn.Module]:
        return [*unet.txtfusion.layerwise_blocks, *unet.txtfusion.refiner_blocks]

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return [*self._text_fusion(unet), *unet.blocks]

    def latent_patch(self, unet: torch.nn.Module) -> tuple[int, int]:
        return unet.patch, unet.patch

    def unit_tokens(self, unet: torch.nn.Module, units: list[torch.nn.Module], image: int) -> list[tuple[int, int]]:
        """The layer-wise text fusion blocks run over every text token's 12 hidden states, the refiners over the
        text, the main blocks over the text and the image together (the checkpoint and stream order both)."""
        layerwise, fusion = len(unet.txtfusion.layerwise_blocks), len(self._text_fusion(unet))
        return [(0, self.text_tokens * unet.txtlayers) if index < layerwise else (0, self.text_tokens)
                if index < fusion else (image, self.text_tokens) for index in range(len(units))]

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        """diffusers/peft Krea 2 files (`transformer.transformer_blocks.0.attn.to_q`, ...), as ComfyUI's loader maps
        them (comfy.utils.krea2_to_diffusers): {ComfyUI path: diffusers path}."""
        import comfy.utils
        names = comfy.utils.krea2_to_diffusers(base.model_config.unet_config)
        return {ours[:-len(".weight")]: theirs[:-len(".weight")] for theirs, ours in names.items()
                if not theirs.endswith(".attn.to_out.weight")}  # its alias without diffusers' ".0"
