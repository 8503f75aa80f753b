"""Model families, one file each (see trainer/model.py's ModelFamily). The first family whose `matches` answers
yes trains the model; the generic path comes last. Adding a family: a file here and an entry in FAMILIES."""
from __future__ import annotations

from .anima import Anima
from .chroma import Chroma
from .flux import Flux
from .flux2 import Flux2
from .generic import Generic
from .hunyuan_image import HunyuanImage
from .krea2 import Krea2
from .qwen_image import QwenImage
from .sd_unet import SdUnet
from .wan import Wan
from .z_image import ZImage
from ..trainer_api import LeanLoRAError

FAMILIES = [SdUnet(), ZImage(), Flux(), Chroma(), Flux2(), QwenImage(), Wan(), HunyuanImage(), Krea2(), Anima(),
            Generic()]


def family_for(base):
    """The family that trains ComfyUI model `base` (MODEL.model), or a clear error naming the model and the
    families there are."""
    for family in FAMILIES:
        if family.matches(base):
            problem = family.unsupported(base)
            if problem:
                raise LeanLoRAError(f"LeanLoRA Train: {problem}")
            return family
    names = ", ".join(family.name for family in FAMILIES)
    raise LeanLoRAError(f"LeanLoRA Train cannot train this MODEL ({type(base).__name__}, diffusion model "
                        f"{type(getattr(base, 'diffusion_model', None)).__name__}): no model family knows it "
                        f"(families: {names}). Connect a diffusion model ComfyUI loads with its own layers "
                        "(Load Checkpoint or Load Diffusion Model)")
