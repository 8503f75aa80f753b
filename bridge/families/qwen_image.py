"""Qwen-Image (Alibaba's 20B MMDiT) as ComfyUI loads it: comfy/ldm/qwen_image (60 dual-stream transformer blocks
in the full model, module names as in diffusers), flow matching, Qwen2.5-VL-7B text features, the Wan 2.1 VAE's
5-D latents (batch, 16, 1, height/8, width/8)."""
from __future__ import annotations

import torch

import comfy.model_base

from .common import TransformerFamily, prediction_of
from .edit import EditVariant
from ..trainer_api import FamilyIdentity, LoraTargets, SampleLimits

_ATTENTION = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
              "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")


class QwenImage(TransformerFamily):
    name = "Qwen-Image"
    LORA_TARGETS = {  # module-name suffixes, the same in ComfyUI's model and in diffusers' (musubi-tuner's set)
        LoraTargets.ATTENTION: _ATTENTION,
        LoraTargets.ATTENTION_FEED_FORWARD: (*_ATTENTION, "img_mlp.net.0.proj", "img_mlp.net.2",
                                             "txt_mlp.net.0.proj", "txt_mlp.net.2"),
    }
    sample_limits = SampleLimits("Qwen-Image", 2048, 150, "its native size is 1328")  # checked before training
    # every block is dual-stream: the image's and the text's projections and MLPs run on their own tokens, the
    # modulations on the timestep's vector
    PER_IMAGE_LINEARS = ("img_mod", "txt_mod")
    TEXT_LINEARS = ("txt_mlp", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    IMAGE_LINEARS = ("img_mlp", "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out")

    def matches(self, base) -> bool:
        return type(base) is comfy.model_base.QwenImage

    def unsupported(self, base) -> str | None:
        """A file whose patch embedding takes more than the latent's channels (an inpainting, control or other
        conditioned variant) would fail inside the first step: the latents LeanLoRA encodes have the VAE's channels
        only, and nothing builds the rest."""
        unet = base.diffusion_model
        takes = unet.img_in.weight.shape[1] // unet.patch_size ** 2
        latent = base.latent_format.latent_channels
        if takes != latent:
            return (f"this Qwen-Image model takes {takes} input channels and Qwen-Image's latents have {latent}: a "
                    f"variant with extra input channels ({takes - latent}: inpainting, control or other image "
                    "conditioning) is not supported; train on Qwen-Image (Load Diffusion Model with a qwen_image_* "
                    "file)")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Qwen-Image", "qwen_image", "qwen-image", "https://github.com/QwenLM/Qwen-Image",
                              prediction_of(model_sampling), recorded_as=("qwen_image", "qwen-image", "qwenimage"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        return (f"Qwen-Image ({len(unet.transformer_blocks)} blocks, "
                f"{sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B parameters, dtype {unet.dtype}), "
                "flow matching")

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        return list(unet.transformer_blocks)

    def edit_variant(self, base):
        """Qwen-Image-Edit (2509/2511): the same model class and weights, trained from a folder of pairs."""
        return QWEN_IMAGE_EDIT

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        """ComfyUI's paths are diffusers' own: diffusers/peft files (`transformer.<path>`) name them as they are."""
        return {path: path for path, module in base.diffusion_model.named_modules()
                if isinstance(getattr(module, "weight", None), torch.Tensor)}


class QwenImageEdit(EditVariant, QwenImage):
    """Qwen-Image-Edit 2509/2511 trained on pairs: each control image as TextEncodeQwenImageEditPlus takes it (a
    reference latent, and an image the instruction is encoded with: bridge/edit_pairs.py)."""
    name = "Qwen-Image-Edit"

    def identity(self, base, model_sampling) -> FamilyIdentity:
        return FamilyIdentity("Qwen-Image-Edit", "qwen_image_edit", "qwen-image-edit",
                              "https://github.com/QwenLM/Qwen-Image", prediction_of(model_sampling),
                              recorded_as=("qwen_image", "qwen-image", "qwenimage"))

    def describe(self, base) -> str:
        return super().describe(base).replace("Qwen-Image (", "Qwen-Image-Edit (", 1) + \
            ", edit pairs: control images as reference latents"

    def controls(self, adapter):
        from ..edit_pairs import QwenImageEditControls
        return QwenImageEditControls(adapter)


QWEN_IMAGE_EDIT = QwenImageEdit()
