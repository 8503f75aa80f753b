"""HunyuanImage 2.1 (Tencent's 17B text-to-image DiT) as ComfyUI loads it (0.3.75 and 0.33): model_base.HunyuanImage21
over comfy/ldm/hunyuan_video's HunyuanVideo network with 2-D 1x1 patches (20 double-stream and 40 single-stream blocks
in the full model, FLUX.1's own DoubleStreamBlock / SingleStreamBlock from comfy.ldm.flux.layers), flow matching at
ComfyUI's shift 5, Qwen2.5-VL-7B text features through a token refiner, byT5 glyph features for quoted text
(`txt_byt5`: HunyuanImageTokenizer encodes the text between quotes, so only captions with quotes carry them), and
the HunyuanImage 2.1 VAE's 64-channel latents at 1/32 of the image size.

The blocks are FLUX.1's, so what FLUX.1 does for them holds here: the same LoRA targets (kohya's sd-scripts
`networks.lora_hunyuan_image` puts LoRA on every Linear of these two block classes, as its lora_flux does) and the
same out-of-place block forwards (Flux.prepare: ComfyUI's blocks add into their residual streams in place).

Refused, with what to load instead: the refiner (model_base.HunyuanImage21Refiner: 3-D latents of its own VAE and
the base image as extra input channels) and the distilled model (meanflow: its second timestep embedding reads the
sampler's schedule, which a training step has none of). HunyuanVideo 1.0 and 1.5 build the same network class but
are other model_base classes, so they never match."""
from __future__ import annotations

import torch

import comfy.model_base

from .common import TransformerFamily, prediction_of
from .flux import Flux
from ..trainer_api import FamilyIdentity, SampleDefaults, SampleLimits

# ComfyUI's module paths -> the official HunyuanImage 2.1 names, which sd-scripts' LoRA files (lora_unet_...) and
# diffusion-pipe style files (transformer.<path>) use; ComfyUI converts the model's own weights the same way
# (supported_models.HunyuanVideo.process_unet_state_dict) but reads LoRA keys by its own paths only.
_OFFICIAL_NAMES = ((".img_mod.lin", ".img_mod.linear"), (".txt_mod.lin", ".txt_mod.linear"),
                   (".modulation.lin", ".modulation.linear"), (".img_attn.qkv", ".img_attn_qkv"),
                   (".txt_attn.qkv", ".txt_attn_qkv"), (".img_attn.proj", ".img_attn_proj"),
                   (".txt_attn.proj", ".txt_attn_proj"), (".img_mlp.0", ".img_mlp.fc1"), (".img_mlp.2", ".img_mlp.fc2"),
                   (".txt_mlp.0", ".txt_mlp.fc1"), (".txt_mlp.2", ".txt_mlp.fc2"))


class HunyuanImage(Flux):
    name = "HunyuanImage 2.1"
    # ComfyUI does not pad Qwen2.5-VL's sequence: a caption's own tokens (tens) beside a 1024² image's 1024
    text_tokens = 0
    # ComfyUI's HunyuanImage 2.1 example: KSampler euler / simple on the model's own shift-5 schedule, 2048² images
    # (EmptyHunyuanImageLatent); a latent position is 32 pixels (the VAE's 32x, 1x1 patches)
    sample_defaults = SampleDefaults(sampler="euler", scheduler="simple", size_multiple=32)
    # checked before training; its native size already makes 4096 tokens per image (FLUX.1's at 2048 px)
    sample_limits = SampleLimits("HunyuanImage 2.1", 2048, 150, "its native size is 2048")
    # ComfyUI conditions every HunyuanImage model with guidance 6.0 (model_base.HunyuanImage21.extra_conds'
    # default); the base model has no guidance embedding and ignores it, so training keeps that default
    text_conditioning: dict = {}
    graph_blocker = "CUDA graphs are not verified on HunyuanImage 2.1 yet"  # not measured on a GPU

    def matches(self, base) -> bool:
        image = getattr(comfy.model_base, "HunyuanImage21", None)  # absent from a ComfyUI before HunyuanImage 2.1
        return image is not None and isinstance(base, image)  # the refiner too: unsupported() names it

    def unsupported(self, base) -> str | None:
        if type(base).__name__ == "HunyuanImage21Refiner":
            return ("the HunyuanImage 2.1 refiner (hunyuanimage2.1_refiner_*) is not supported: it refines a base "
                    "image in its own VAE's 3-D latents. Train on the base model instead: Load Diffusion Model with "
                    "hunyuanimage2.1_bf16.safetensors (or its fp8 file), DualCLIPLoader type hunyuan_image with "
                    "qwen_2.5_vl_7b and byt5_small_glyphxl, and Load VAE with hunyuan_image_2.1_vae_fp16.safetensors")
        unet = base.diffusion_model
        if getattr(unet, "time_r_in", None) is not None:
            return ("the distilled HunyuanImage 2.1 model (hunyuanimage2.1_distilled_*: a meanflow model whose second "
                    "timestep embedding reads the sampler's schedule) is not supported; train on the base model "
                    "(Load Diffusion Model with hunyuanimage2.1_bf16.safetensors or its fp8 file)")
        takes = unet.img_in.proj.weight.shape[1]
        latent = base.latent_format.latent_channels
        if takes != latent:
            return (f"this HunyuanImage 2.1 model takes {takes} input channels and the HunyuanImage 2.1 VAE's latents "
                    f"have {latent}: a variant with extra input channels is not supported; train on the base model "
                    "(Load Diffusion Model with hunyuanimage2.1_bf16.safetensors)")
        return None

    def identity(self, base, model_sampling) -> FamilyIdentity:
        # sd-scripts' modelspec words (library/sai_model_spec.py: ARCH_HUNYUAN_IMAGE_2_1, IMPL_HUNYUAN_IMAGE)
        return FamilyIdentity("HunyuanImage 2.1", "hunyuan_image_2.1", "hunyuan-image-2.1",
                              "https://github.com/Tencent-Hunyuan/HunyuanImage-2.1", prediction_of(model_sampling),
                              recorded_as=("hunyuan_image", "hunyuan-image", "hunyuanimage"))

    def describe(self, base) -> str:
        unet = base.diffusion_model
        shift = getattr(base.model_sampling, "shift", None)
        return (f"HunyuanImage 2.1 ({len(unet.double_blocks)} double + {len(unet.single_blocks)} single blocks, "
                f"{sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B parameters, dtype {unet.dtype}), flow "
                f"matching{f' at shift {shift:g}' if shift else ''}")

    def edit_variant(self, base):
        return None

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        return TransformerFamily.resolution_shift(self, model_sampling, latent_size)  # a fixed shift (5) at any size

    checkpoint_units = TransformerFamily.checkpoint_units  # FLUX.1's counts 2x2 patches and no text

    def latent_patch(self, unet: torch.nn.Module) -> tuple[int, int]:
        patch_h, patch_w = unet.patch_size  # [1, 1]: a token per latent position
        return patch_h, patch_w

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        """The official names of the blocks' layers (see _OFFICIAL_NAMES), so continue_from reads sd-scripts'
        HunyuanImage LoRAs (`lora_unet_double_blocks_0_img_mlp_fc1`) and diffusion-pipe style ones as they are.
        Saved files keep ComfyUI's paths, the names its LoRA loader reads (sd-scripts' own files need its
        convert_hunyuan_image_lora_to_comfy.py first)."""
        names = {}
        for path, module in base.diffusion_model.named_modules():
            if isinstance(module, torch.nn.Linear) and path.startswith(("double_blocks.", "single_blocks.")):
                official = path
                for comfy_name, their_name in _OFFICIAL_NAMES:
                    if official.endswith(comfy_name):
                        official = official[: -len(comfy_name)] + their_name
                names[path] = official
        return names
