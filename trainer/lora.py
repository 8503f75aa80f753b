"""LoRA on the diffusion model: peft injects the adapters; export is kohya format (`lora_unet_<module path>`
with lora_down / lora_up / alpha), the format ComfyUI, A1111 and kohya tools all load."""
from __future__ import annotations

import torch
from diffusers.utils.state_dict_utils import convert_state_dict_to_kohya
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

from .errors import LeanLoRAError
from .settings import LoraSettings

ADAPTER = "leanlora"


def inject_lora(module: torch.nn.Module, settings: LoraSettings, seed: int) -> list[torch.nn.Parameter]:
    """Adds LoRA layers in place and freezes everything else. Returns the trainable parameters (fp32)."""
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), init_lora_weights=True)
    module.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # seeded lora_A init without disturbing the caller's RNG
        torch.manual_seed(seed)
        try:
            inject_adapter_in_model(config, module, adapter_name=ADAPTER)
        except ValueError as error:
            raise LeanLoRAError(f"LoRA targets {settings.targets!r} matched no layer of this model ({error}); "
                                "pick another target preset") from error
    for layer in module.modules():
        if hasattr(layer, "cast_input_dtype_enabled"):
            # peft casts each LoRA layer's input to the LoRA weights' dtype (fp32): under autocast an
            # activation-sized fp32 copy per layer that autocast casts straight back (and the reverse in backward),
            # 16% of an SDXL batch-8 step on an H200, plus a second saved copy of the input. Autocast computes in
            # the compute dtype either way; without autocast ("no" precision) inputs are fp32 already.
            layer.cast_input_dtype_enabled = False
    params = [p for n, p in module.named_parameters() if "lora_" in n]
    for p in params:
        p.data = p.data.float()  # master weights stay fp32 whatever the base dtype
        p.requires_grad_(True)
    return params


def kohya_state_dict(module: torch.nn.Module, settings: LoraSettings,
                     dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    peft_sd = get_peft_model_state_dict(module, adapter_name=ADAPTER)
    if not peft_sd:
        raise LeanLoRAError("the model holds no LoRA weights to export")
    kohya = convert_state_dict_to_kohya({f"unet.{k}": v for k, v in peft_sd.items()})
    out = {}
    for key, value in kohya.items():
        if key.endswith(".alpha"):
            # diffusers writes alpha = rank; the scale the weights were trained with is lora_alpha / rank.
            out[key] = torch.tensor(float(settings.alpha))
        else:
            out[key] = value.detach().to("cpu", dtype).contiguous()
    return out


def lora_metadata(settings: LoraSettings, extra: dict[str, str]) -> dict[str, str]:
    """kohya's `ss_` keys, so tools that show LoRA info (and kohya scripts) understand the file."""
    return {"ss_network_module": "networks.lora", "ss_network_dim": str(settings.rank),
            "ss_network_alpha": str(settings.alpha), "ss_network_dropout": str(settings.dropout),
            "leanlora_targets": settings.targets, **extra}
