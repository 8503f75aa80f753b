"""Edit variants of a family (Qwen-Image-Edit of Qwen-Image, FLUX.1 Kontext of FLUX.1-dev): the same weights and
ComfyUI classes, trained on before/after pairs. No model is matched to one by itself (nothing in the weights tells
Qwen-Image-Edit 2509 from Qwen-Image, or Kontext from FLUX.1-dev): a folder of pairs switches the family to its
edit variant (bridge/edit_pairs.py). What differs: the identity, and the call, which hands the pair's cached control
latents to the model as `ref_latents`, the list ComfyUI's extra_conds makes of the conditioning's reference latents."""
from __future__ import annotations

import torch

from ..trainer_api import CONTROL_KEY


def reference_latents(cond: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[dict, list[torch.Tensor] | None]:
    """(the conditioning without the control latents, them as the model's ref_latents list in order, or None), in
    the model's dtype as ComfyUI's _apply_model casts a list in the conditioning."""
    keys = sorted((key for key in cond if key.startswith(CONTROL_KEY)), key=lambda key: int(key[len(CONTROL_KEY):]))
    if not keys:
        return cond, None
    rest = {key: value for key, value in cond.items() if not key.startswith(CONTROL_KEY)}
    return rest, [cond[key].to(dtype) for key in keys]


class EditVariant:
    """Mixed in before the family's class: `controls(adapter)` is the ControlEncoder of its ComfyUI node."""
    edits = True

    def matches(self, base) -> bool:
        return False  # chosen by a folder of pairs, never by the model alone

    def edit_variant(self, base):
        return self

    def controls(self, adapter):
        raise NotImplementedError

    def predict(self, unet, x, timestep, cond, transformer_options):
        """ComfyUI's _apply_model call (common.call_diffusion_model) with the control latents as ref_latents."""
        cond, refs = reference_latents(cond, unet.dtype)
        dtype = unet.dtype
        extra = {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items() if k != "c_crossattn"}
        context = cond.get("c_crossattn")
        return unet(x.to(dtype), timestep, context=None if context is None else context.to(dtype), ref_latents=refs,
                    transformer_options=transformer_options, **extra)
