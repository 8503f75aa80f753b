from ..trainer.comfy_adapter import apply_lora
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
        return apply_lora(model, clip, lora, strength_model, strength_clip)
