"""Plain LoRA (peft injects it; kohya's lora_down / lora_up / alpha) and DoRA, its variant: the same two factors
plus a learned magnitude per input column (`dora_scale`)."""
from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer

from ..errors import LeanLoRAError
from ..settings import AdapterKind, LoraSettings
from .base import AdapterLinear, AdapterType, _in_compute_dtype, adapter_layers, check_shape, computed_weight, \
    kaiming, wrap_targets
from .dropout import ADAPTER, step_seeded_peft_dropout

# lora_down / lora_up as the tools spell them after the module name; each group's name is the style
DOWN_UP_SPELLINGS = (
    r"\.lora_(?P<kohya>down|up)\.weight",          # kohya, ComfyUI (its trainer and LoRA extraction)
    r"\.lora_(?P<peft>A|B)(?:\.[^.]+)?\.weight",  # peft / diffusers (optionally with peft's adapter name)
    r"\.lora\.(?P<compatible>down|up)\.weight",   # diffusers' LoRACompatibleLinear
    r"_lora\.(?P<processor>down|up)\.weight")      # diffusers' attention processors (to_q_lora.down)


class PlainLora(AdapterType):
    kind, label = AdapterKind.LORA, "LoRA"
    prefixes = ("lora_",)
    file_parts = required_parts = ("down", "up")
    key_spellings = DOWN_UP_SPELLINGS

    def inject(self, module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...]) -> None:
        if not target_modules:
            raise LeanLoRAError(f"LoRA targets {settings.targets.value!r} name no layer of this model; pick another "
                                "target preset")
        config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                            target_modules=list(target_modules), init_lora_weights=True)
        module.requires_grad_(False)
        try:
            inject_adapter_in_model(config, module, adapter_name=ADAPTER)
        except ValueError as error:
            raise LeanLoRAError(f"LoRA targets {settings.targets.value!r} matched no layer of this model ({error}); "
                                "pick another target preset") from error
        for layer in module.modules():
            if hasattr(layer, "cast_input_dtype_enabled"):
                # peft casts each LoRA layer's input to the LoRA weights' dtype (fp32): under autocast an
                # activation-sized fp32 copy per layer that autocast casts straight back (and the reverse in
                # backward), 16% of an SDXL batch-8 step on an H200, plus a second saved copy of the input. Autocast
                # computes in the compute dtype either way; without autocast ("no" precision) inputs are fp32.
                layer.cast_input_dtype_enabled = False
        step_seeded_peft_dropout(module)

    def layers(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return {p: m for p, m in module.named_modules() if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}

    def export(self, layer, settings: LoraSettings) -> dict[str, torch.Tensor]:
        # the scale the weights were trained with is lora_alpha / rank (kohya stores alpha, not the scale)
        return {"lora_down.weight": layer.lora_A[ADAPTER].weight, "lora_up.weight": layer.lora_B[ADAPTER].weight,
                "alpha": torch.tensor(float(settings.alpha))}

    def load(self, layer, parts: dict[str, torch.Tensor], where: str) -> None:
        layer.lora_A[ADAPTER].weight.copy_(parts["down"].to(torch.float32))
        layer.lora_B[ADAPTER].weight.copy_(parts["up"].to(torch.float32))

    def rank_of(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return int(shapes["down"][0]) if "down" in shapes else None

    def fingerprint(self, settings: LoraSettings) -> tuple:
        return ()  # the fingerprint of states saved before adapter types existed


class DoraLinear(AdapterLinear):
    """DoRA (Liu et al. 2024): W' = m * (W + s B A) / ||W + s B A||, the norm per input column, m learned (initially
    that norm: W' = W). The magnitude is per input column, the paper's form and the one ComfyUI's loader (and
    Forge's, a copy) applies exactly: for a `dora_scale` on the output axis it divides by the norm of the base
    weight instead of the adapted one. Scaling columns of the weight scales the input, so the layer is
    `base_layer(c * x) + s B A (c * x)` with c = m / norm: the base layer computes as it always does (fp8, streamed,
    ComfyUI's casts). Only the norm needs the base weight itself, as computed (base.computed_weight), and it is
    taken without gradient (the paper's "detach" saving; peft does the same)."""

    def __init__(self, base_layer: torch.nn.Linear, dropout: torch.nn.Module, rank: int, alpha: float):
        super().__init__(base_layer, dropout)
        self.scale = alpha / rank
        device = base_layer.weight.device
        self.lora_down = torch.nn.Parameter(kaiming(rank, self.in_features).to(device))
        self.lora_up = torch.nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        with torch.no_grad():
            norm = computed_weight(base_layer, device, torch.float32).norm(dim=0, keepdim=True)
        self.dora_scale = torch.nn.Parameter(norm)  # (1, in): LyCORIS' and ComfyUI's shape for this axis

    def column_scale(self, device: torch.device) -> torch.Tensor:
        with torch.no_grad():
            weight = computed_weight(self.base_layer, device, torch.float32)
            weight.addmm_(self.lora_up.float(), self.lora_down.float(), alpha=self.scale)  # bf16 LoRA weights too
            norm = weight.norm(dim=0, keepdim=True)
        return (self.dora_scale / norm).reshape(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = x * self.column_scale(x.device).to(x.dtype)  # x's dtype: an fp32 product would double what is saved
        lora = torch.nn.functional.linear(self.lora_dropout(scaled), _in_compute_dtype(self.lora_down, x))
        up = torch.nn.functional.linear(lora, _in_compute_dtype(self.lora_up, x))
        return self.base_layer(scaled) + up * self.scale


class Dora(AdapterType):
    kind, label = AdapterKind.DORA, "DoRA"
    prefixes = ("lora_", "dora_scale")
    file_parts = key_parts = ("dora_scale",)
    required_parts = ("down", "up", "dora_scale")
    key_spellings = DOWN_UP_SPELLINGS

    def inject(self, module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...]) -> None:
        wrap_targets(module, settings, target_modules, self.label,
                     lambda layer, dropout: DoraLinear(layer, dropout, settings.rank, settings.alpha))

    def layers(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return adapter_layers(module, DoraLinear)

    def export(self, layer: DoraLinear, settings: LoraSettings) -> dict[str, torch.Tensor]:
        return {"lora_down.weight": layer.lora_down, "lora_up.weight": layer.lora_up,
                "alpha": torch.tensor(float(settings.alpha)), "dora_scale": layer.dora_scale}

    def load(self, layer: DoraLinear, parts: dict[str, torch.Tensor], where: str) -> None:
        scale = parts["dora_scale"]
        if scale.dim() == 2 and scale.shape == (layer.out_features, 1) and layer.out_features != 1:
            raise LeanLoRAError(
                f"{where} has its DoRA magnitude on the output axis (LyCORIS' wd_on_out, shape {tuple(scale.shape)}); "
                "LeanLoRA trains it per input column, the form ComfyUI's loader applies as trained. Pick a DoRA "
                "file trained with wd_on_out off, or train a new one")
        fix = "It was made for another model or rank: pick a DoRA file trained on this model with this rank"
        check_shape(where, "dora_scale", scale, tuple(layer.dora_scale.shape), fix)
        check_shape(where, "lora_down", parts["down"], tuple(layer.lora_down.shape), fix)
        check_shape(where, "lora_up", parts["up"], tuple(layer.lora_up.shape), fix)
        layer.lora_down.copy_(parts["down"].float())
        layer.lora_up.copy_(parts["up"].float())
        layer.dora_scale.copy_(scale.float())

    def rank_of(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return int(shapes["down"][0]) if "down" in shapes else None

    def network_args(self, settings: LoraSettings) -> dict[str, str]:
        return {"dora_wd": "True", "wd_on_output": "False"}  # LyCORIS' words: DoRA, magnitude per input column


PLAIN, DORA = PlainLora(), Dora()
