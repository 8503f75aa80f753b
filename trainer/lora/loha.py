"""LoHa (LyCORIS' Hadamard-product adapter, `algo=loha`): dW = (w1_a w1_b) * (w2_a w2_b) * alpha / rank, element
by element, so rank r reaches rank r^2 at the parameters of two LoRAs. Keys `hada_w1_a`, `hada_w1_b`, `hada_w2_a`,
`hada_w2_b` and `alpha`, as LyCORIS writes them and ComfyUI's comfy/weight_adapter/loha.py reads them."""
from __future__ import annotations

import torch

from ..settings import AdapterKind, LoraSettings
from .base import AdapterLinear, AdapterType, adapter_layers, check_shape, wrap_targets

PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


class _HadaWeight(torch.autograd.Function):
    """(w1_a w1_b) * (w2_a w2_b) * scale, its backward recomputing the two products from the factors: autograd
    would keep both out x in products of every layer until backward (LyCORIS and ComfyUI do the same)."""

    @staticmethod
    def forward(ctx, w1a, w1b, w2a, w2b, scale):
        ctx.save_for_backward(w1a, w1b, w2a, w2b)
        ctx.scale = scale
        return (w1a @ w1b) * (w2a @ w2b) * scale

    @staticmethod
    def backward(ctx, grad):
        w1a, w1b, w2a, w2b = ctx.saved_tensors
        grad = grad * ctx.scale
        other = grad * (w2a @ w2b)
        grad_w1a, grad_w1b = other @ w1b.T, w1a.T @ other
        other = grad * (w1a @ w1b)
        return grad_w1a, grad_w1b, other @ w2b.T, w2a.T @ other, None


class LohaLinear(AdapterLinear):
    def __init__(self, base_layer: torch.nn.Linear, dropout: torch.nn.Module, rank: int, alpha: float):
        super().__init__(base_layer, dropout)
        self.scale = alpha / rank
        out, inp, device = self.out_features, self.in_features, base_layer.weight.device
        # LyCORIS' initialisation: w2_a zero, so the layer starts as the base layer and every factor gets gradients
        self.hada_w1_a = torch.nn.Parameter(torch.randn(out, rank).mul_(0.1).to(device))
        self.hada_w1_b = torch.nn.Parameter(torch.randn(rank, inp).to(device))
        self.hada_w2_a = torch.nn.Parameter(torch.zeros(out, rank, device=device))
        self.hada_w2_b = torch.nn.Parameter(torch.randn(rank, inp).to(device))

    def delta(self) -> torch.Tensor:
        return _HadaWeight.apply(self.hada_w1_a, self.hada_w1_b, self.hada_w2_a, self.hada_w2_b, self.scale)


class Loha(AdapterType):
    kind, label = AdapterKind.LOHA, "LoHa"
    prefixes = ("hada_",)
    file_parts = required_parts = key_parts = PARTS
    network_module = "lycoris.kohya"

    def inject(self, module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...]) -> None:
        wrap_targets(module, settings, target_modules, self.label,
                     lambda layer, dropout: LohaLinear(layer, dropout, settings.rank, settings.alpha))

    def layers(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return adapter_layers(module, LohaLinear)

    def export(self, layer: LohaLinear, settings: LoraSettings) -> dict[str, torch.Tensor]:
        return {**{part: getattr(layer, part) for part in PARTS}, "alpha": torch.tensor(float(settings.alpha))}

    def load(self, layer: LohaLinear, parts: dict[str, torch.Tensor], where: str) -> None:
        for part in PARTS:
            check_shape(where, part, parts[part], tuple(getattr(layer, part).shape),
                        "It was made for another model or rank: pick a LoHa file trained on this model with this rank")
        for part in PARTS:
            getattr(layer, part).copy_(parts[part].float())

    def rank_of(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return int(shapes["hada_w1_b"][0]) if "hada_w1_b" in shapes else None

    def network_args(self, settings: LoraSettings) -> dict[str, str]:
        return {"algo": "loha"}


LOHA = Loha()
