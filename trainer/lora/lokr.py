"""LoKr (LyCORIS' Kronecker-product adapter, `algo=lokr`): dW = kron(w1, w2) with w1 of (out_l, in_m) and w2 of
(out_k, in_n), each layer's sizes split by `factor` (out = out_l * out_k, in = in_m * in_n). w2 is a low-rank
product w2_a w2_b (scaled alpha / rank) when the rank is below half its larger side, else one full matrix (scale 1),
LyCORIS' rule. Keys `lokr_w1` and `lokr_w2` or `lokr_w2_a`/`lokr_w2_b`, with `alpha`, as LyCORIS writes them and
ComfyUI's comfy/weight_adapter/lokr.py reads them."""
from __future__ import annotations

import torch

from ..errors import LeanLoRAError
from ..settings import AdapterKind, LoraSettings
from .base import AdapterLinear, AdapterType, _in_compute_dtype, adapter_layers, check_shape, kaiming, wrap_targets


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """LyCORIS' split of `dimension` into (m, n), m <= n, m * n = dimension: `factor` itself when it divides
    evenly, else the most even split with m at most `factor` (-1: no bound)."""
    if factor > 0 and dimension % factor == 0:
        m, n = factor, dimension // factor
        return (n, m) if m > n else (m, n)
    factor = dimension if factor < 0 else factor
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m != 0:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > m + n or new_m > factor:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


class LokrLinear(AdapterLinear):
    def __init__(self, base_layer: torch.nn.Linear, dropout: torch.nn.Module, rank: int, alpha: float, factor: int):
        super().__init__(base_layer, dropout)
        device = base_layer.weight.device
        out_l, out_k = factorization(self.out_features, factor)
        in_m, in_n = factorization(self.in_features, factor)
        self.in_split = (in_m, in_n)
        self.lokr_w1 = torch.nn.Parameter(kaiming(out_l, in_m).to(device))
        if rank < max(out_k, in_n) / 2:  # LyCORIS: a low-rank w2, scaled alpha / rank
            self.scale = alpha / rank
            self.lokr_w2_a = torch.nn.Parameter(kaiming(out_k, rank).to(device))
            self.lokr_w2_b = torch.nn.Parameter(torch.zeros(rank, in_n, device=device))
        else:  # a full w2; LyCORIS and ComfyUI apply it unscaled
            self.scale = 1.0
            self.lokr_w2 = torch.nn.Parameter(torch.zeros(out_k, in_n, device=device))

    @property
    def decomposed(self) -> bool:
        return hasattr(self, "lokr_w2_a")

    def w2(self) -> torch.Tensor:
        return self.lokr_w2_a @ self.lokr_w2_b if self.decomposed else self.lokr_w2

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        # kron(w1, w2) x = w1 X w2^T with x as an (in_m, in_n) matrix: no out x in weight is ever made
        rows = x.reshape(*x.shape[:-1], *self.in_split)
        w1, w2 = _in_compute_dtype(self.lokr_w1, x), _in_compute_dtype(self.w2() * self.scale, x)
        out = torch.matmul(w1, torch.matmul(rows, w2.T))
        return out.reshape(*x.shape[:-1], self.out_features)


class Lokr(AdapterType):
    kind, label = AdapterKind.LOKR, "LoKr"
    prefixes = ("lokr_",)
    file_parts = ("lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w1_a")
    required_parts = ("lokr_w1",)  # and w2 in one of its forms: Lokr.load names the one it needs
    key_parts = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b")
    network_module = "lycoris.kohya"

    def inject(self, module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...]) -> None:
        wrap_targets(module, settings, target_modules, self.label,
                     lambda layer, dropout: LokrLinear(layer, dropout, settings.rank, settings.alpha, settings.factor))

    def layers(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return adapter_layers(module, LokrLinear)

    def export(self, layer: LokrLinear, settings: LoraSettings) -> dict[str, torch.Tensor]:
        w2 = {"lokr_w2_a": layer.lokr_w2_a, "lokr_w2_b": layer.lokr_w2_b} if layer.decomposed \
            else {"lokr_w2": layer.lokr_w2}
        return {"lokr_w1": layer.lokr_w1, **w2, "alpha": torch.tensor(float(settings.alpha))}

    def load(self, layer: LokrLinear, parts: dict[str, torch.Tensor], where: str) -> None:
        fix = ("It was made for another model, or with another factor or rank: set LoRA Config's factor and rank as "
               "the file was trained (its ss_network_args and ss_network_dim say them) or pick another file")
        names = ("lokr_w1", "lokr_w2_a", "lokr_w2_b") if layer.decomposed else ("lokr_w1", "lokr_w2")
        for part in names:
            if part not in parts:
                form = "a low-rank lokr_w2_a/lokr_w2_b" if layer.decomposed else "one full lokr_w2"
                raise LeanLoRAError(f"{where} has no {part}: LoRA Config's rank and factor give this layer {form}. "
                                    + fix)
            check_shape(where, part, parts[part], tuple(getattr(layer, part).shape), fix)
        for part in names:
            getattr(layer, part).copy_(parts[part].float())

    def rank_of(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        return int(shapes["lokr_w2_b"][0]) if "lokr_w2_b" in shapes else None

    def network_args(self, settings: LoraSettings) -> dict[str, str]:
        return {"algo": "lokr", "factor": str(settings.factor)}

    def fingerprint(self, settings: LoraSettings) -> tuple:
        return ("type", self.kind.value, "factor", settings.factor)


LOKR = Lokr()
