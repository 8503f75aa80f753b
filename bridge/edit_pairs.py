"""Edit LoRAs from before/after pairs: how an edit model's ComfyUI nodes take a control image, done the same way for
training (trainer/cache.py's ControlEncoder), so the control latents reach the model as the conditioning carries
them at sampling:

- Qwen-Image-Edit 2509/2511 (TextEncodeQwenImageEditPlus, comfy_extras/nodes_qwen.py): each control image resized by
  area to about 1024x1024 pixels (sides multiples of 8) and VAE-encoded into `reference_latents`; the instruction
  encoded by Qwen2.5-VL together with each control image at about 384x384 ("Picture N: <image>" before it, the
  edit system prompt).
- FLUX.1 Kontext (FluxKontextImageScale, comfy_extras/nodes_flux.py, then VAEEncode and ReferenceLatent,
  comfy_extras/nodes_edit_model.py): the control resized (lanczos, center crop) to the preferred Kontext resolution
  of its aspect, VAE-encoded into `reference_latents`; the caption as for FLUX.1.

The model's extra_conds turns `reference_latents` into `ref_latents` (process_latent_in on each, comfy/model_base.py);
the edit variants (families/edit.py) hand the cached control latents to the model as that list. Samples during
training (bridge/samples.py) build their CONDITIONING by the same rules from the first pair's control images
(`sample_edit`), as the node does at sampling."""
from __future__ import annotations

import math

import torch

import comfy.utils
import node_helpers

from .families.common import empty_latent
from .trainer_api import PAIRS_LAYOUT, LeanLoRAError, load_image

QWEN_EDIT_REFERENCE_PIXELS = 1024 * 1024  # TextEncodeQwenImageEditPlus: the VAE's reference image
QWEN_EDIT_VISION_PIXELS = 384 * 384       # ... and the vision-language encoder's
QWEN_EDIT_TEMPLATE = (  # TextEncodeQwenImageEditPlus's llama_template
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
KONTEXT_RESOLUTIONS = (  # FluxKontextImageScale's PREFERED_KONTEXT_RESOLUTIONS
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688),
    (1568, 672))


def qwen_edit_size(width: int, height: int, total: int | None = None, multiple: int = 8) -> tuple[int, int]:
    """TextEncodeQwenImageEditPlus's size for an image of (width, height): its area scaled to `total` (the
    reference image's, QWEN_EDIT_REFERENCE_PIXELS, by default)."""
    scale = math.sqrt((QWEN_EDIT_REFERENCE_PIXELS if total is None else total) / (width * height))
    if multiple == 1:
        return round(width * scale), round(height * scale)
    return round(width * scale / multiple) * multiple, round(height * scale / multiple) * multiple


def kontext_size(width: int, height: int) -> tuple[int, int]:
    """FluxKontextImageScale's size: the preferred resolution nearest in aspect."""
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
    return w, h


class _Controls:
    """The ControlEncoder of one ComfyUI model (trainer/cache.py): the control latents as the model's conditioning
    gets them, the caption's conditioning as ComfyAdapter.encode_text builds it."""
    text_sees_controls = False
    max_controls = 3

    def __init__(self, adapter):
        self.adapter, self.base, self.vae, self.clip = adapter, adapter.base, adapter.vae, adapter.clip

    def resize(self, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode_control(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, H, W, 3] -> the reference latent as extra_conds hands it to the model (process_latent_in)."""
        with torch.inference_mode():
            latent = self.base.process_latent_in(self.vae.encode(self.resize(pixels)[:, :, :, :3]))
        return latent.clone()

    def encode_text(self, caption: str, width: int, height: int, controls: list[torch.Tensor]):
        return self.adapter.encode_text(caption, width, height)

    def reference_latents(self, controls: list[torch.Tensor]) -> list[torch.Tensor]:
        """The conditioning's reference latents of control images [1, H, W, 3] (VAEEncode's, before
        process_latent_in)."""
        with torch.inference_mode():
            return [self.vae.encode(self.resize(image)[:, :, :, :3]) for image in controls]

    def conditioning(self, prompt: str, controls: list[torch.Tensor], clip=None, latents=None) -> list:
        """ComfyUI's CONDITIONING of `prompt` with control images [1, H, W, 3] as the model's nodes make it at
        sampling (`clip`: another CLIP, e.g. one with the text encoder's LoRA; `latents`: their reference_latents,
        if already encoded). Here FLUX.1 Kontext's: CLIPTextEncode, then per control FluxKontextImageScale +
        VAEEncode + ReferenceLatent."""
        clip = self.clip if clip is None else clip
        with torch.inference_mode():
            conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(prompt))
        return self._with_references(conditioning, controls, latents)

    def _with_references(self, conditioning: list, controls: list[torch.Tensor], latents) -> list:
        latents = self.reference_latents(controls) if latents is None else latents
        return node_helpers.conditioning_set_values(conditioning, {"reference_latents": latents}, append=True)


class QwenImageEditControls(_Controls):
    name = "Qwen-Image-Edit 2509/2511"
    preprocess = "TextEncodeQwenImageEditPlus: area to 1024x1024 px, multiples of 8; vision 384x384 px"
    text_sees_controls = True

    def control_size(self, width: int, height: int) -> tuple[int, int]:
        return qwen_edit_size(width, height)

    def resize(self, pixels: torch.Tensor) -> torch.Tensor:
        width, height = qwen_edit_size(pixels.shape[2], pixels.shape[1])
        return comfy.utils.common_upscale(pixels.movedim(-1, 1), width, height, "area", "disabled").movedim(1, -1)

    def encode_text(self, caption: str, width: int, height: int, controls: list[torch.Tensor]):
        """The instruction with each control image, as TextEncodeQwenImageEditPlus tokenizes it, through the
        model's extra_conds as the sampler builds them (ComfyAdapter.encode_text's path)."""
        with torch.inference_mode():
            encoded = dict(self.clip.encode_from_tokens(self._tokens(self.clip, caption, controls), return_dict=True))
            cross_attn = encoded.pop("cond")
            noise = empty_latent(self.base.latent_format, max(1, height // 8), max(1, width // 8))
            conds = self.base.extra_conds(cross_attn=cross_attn, **encoded, width=width, height=height, noise=noise,
                                          device=torch.device("cpu"))
        return {name: value.cond.clone() for name, value in conds.items() if isinstance(value.cond, torch.Tensor)}

    def conditioning(self, prompt: str, controls: list[torch.Tensor], clip=None, latents=None) -> list:
        """TextEncodeQwenImageEditPlus's CONDITIONING (with the VAE): the instruction encoded with each control,
        each control's reference latent."""
        clip = self.clip if clip is None else clip
        with torch.inference_mode():
            conditioning = clip.encode_from_tokens_scheduled(self._tokens(clip, prompt, controls))
        return self._with_references(conditioning, controls, latents)

    @staticmethod
    def _tokens(clip, caption: str, controls: list[torch.Tensor]):
        """The instruction after "Picture N: <image>" for each control (the vision encoder's ~384x384 px copy)."""
        images, prompt = [], ""
        for index, image in enumerate(controls):
            w, h = qwen_edit_size(image.shape[2], image.shape[1], QWEN_EDIT_VISION_PIXELS, 1)
            images.append(comfy.utils.common_upscale(image.movedim(-1, 1), w, h, "area", "disabled").movedim(1, -1))
            prompt += f"Picture {index + 1}: <|vision_start|><|image_pad|><|vision_end|>"
        return clip.tokenize(prompt + caption, images=images, llama_template=QWEN_EDIT_TEMPLATE)


class KontextControls(_Controls):
    name = "FLUX.1 Kontext"
    preprocess = "FluxKontextImageScale: lanczos to the preferred Kontext resolution"

    def control_size(self, width: int, height: int) -> tuple[int, int]:
        return kontext_size(width, height)

    def resize(self, pixels: torch.Tensor) -> torch.Tensor:
        width, height = kontext_size(pixels.shape[2], pixels.shape[1])
        return comfy.utils.common_upscale(pixels.movedim(-1, 1), width, height, "lanczos", "center").movedim(1, -1)


def is_edit_only(base) -> bool:
    """A model that says it is an edit model (ComfyUI 0.33 detects Qwen-Image-Edit-2511 by its
    __index_timestep_zero__ marker). Qwen-Image-Edit 2509 and FLUX.1 Kontext have the weights and classes of
    Qwen-Image and FLUX.1-dev: nothing tells them apart, so a folder of pairs is what makes their edit training."""
    return getattr(base.diffusion_model, "default_ref_method", None) == "index_timestep_zero"


def control_encoder(adapter, dataset):
    """The ControlEncoder for `dataset` on this adapter's model, switching the adapter to the family's edit variant
    (its identity, samples); None for plain images. Refusals: an edit-only model given plain images (naming the
    layout of pairs), a family without an edit variant given pairs (trainer/cache.py's refusal names it)."""
    find = getattr(adapter.family, "edit_variant", None)
    variant = find(adapter.base) if find is not None else None
    if not dataset.pairs:
        if is_edit_only(adapter.base):
            raise LeanLoRAError(f"LeanLoRA Train: this model is an edit model ({adapter.describe()}) and learns from "
                                f"before/after pairs, and {dataset.folder} holds plain images (no control images). "
                                f"Lay the folder out as {PAIRS_LAYOUT}")
        return None
    if variant is None:
        return None
    adapter.family = variant
    return variant.controls(adapter)


class SampleEdit:
    """Samples during training on a folder of pairs: the family's edit variant (its sampler defaults), its
    ControlEncoder, and the first pair's control images, framed to the sample's square as training frames a control
    to its target's bucket, at the node's size (control_size). `conditioning(prompt)` is the sample's CONDITIONING;
    the reference latents are encoded once (the images do not change during a run)."""

    def __init__(self, family, controls, paths: list, size: int):
        self.family, self.controls, self.paths = family, controls, paths
        framed = controls.control_size(size, size)
        self.images = [load_image(path, framed)[None] for path in paths]
        self.latents = None

    def conditioning(self, prompt: str, clip=None) -> list:
        if self.latents is None:
            self.latents = self.controls.reference_latents(self.images)
        return self.controls.conditioning(prompt, self.images, clip, self.latents)


def sample_edit(adapter, dataset, size: int) -> SampleEdit | None:
    """SampleEdit for samples of `size` px from `dataset` on this adapter's model; None for plain images, or a family
    without an edit variant (training refuses that folder before any sample)."""
    find = getattr(adapter.family, "edit_variant", None)
    variant = find(adapter.base) if find is not None and dataset.pairs else None
    if variant is None:
        return None
    return SampleEdit(variant, variant.controls(adapter), list(dataset.samples[0].controls), size)
