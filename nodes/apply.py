import math

from ..trainer.errors import LeanLoRAError
from ..trainer.files import non_finite_tensors
from .common import CATEGORY


class LeanLoRAApplyLoRA:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The model to apply the LoRA to (it is not modified; a clone is returned)."}),
                "clip": ("CLIP", {"tooltip": "The text encoder, passed through with any text-encoder LoRA weights applied."}),
                "lora": ("LORA_MODEL", {"tooltip": "LoRA weights, e.g. the lora output of LeanLoRA Train."}),
                "strength_model": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                             "tooltip": "How strongly the LoRA changes the diffusion model."}),
                "strength_clip": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                            "tooltip": "How strongly the LoRA changes the text encoder."}),
            }
        }

    RETURN_TYPES = ("MODEL", "CLIP")
    FUNCTION = "execute"
    CATEGORY = CATEGORY

    def execute(self, model, clip, lora, strength_model, strength_clip):
        # a link can carry any float past the widget's limits; NaN/inf weights render pure black
        for name, value in (("strength_model", strength_model), ("strength_clip", strength_clip)):
            if not math.isfinite(value):
                raise LeanLoRAError(f"LeanLoRA Apply LoRA: {name} is {value}; use a finite number such as 1.0 "
                                    "(check the node that feeds it)")
        bad = non_finite_tensors(lora) if isinstance(lora, dict) else []
        if bad:
            raise LeanLoRAError(f"LeanLoRA Apply LoRA: the LoRA holds NaN/inf weights ({len(bad)} tensors, e.g. "
                                f"{bad[0]}); it would render black. Train it again with a lower learning rate")
        from ..bridge.comfy_adapter import apply_lora  # imports peft: when it runs, not at pack load
        return apply_lora(model, clip, lora, strength_model, strength_clip)
