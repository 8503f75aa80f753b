"""What every adapter type shares: the contract registry.py's ordered list holds them to, and the
wrapper layer of the types LeanLoRA builds itself (LoHa, LoKr, DoRA).

Those wrap each target Linear (`base_layer`, never changed in place, as peft does) instead of using peft's LoHa/LoKr
and DoRA: peft's LyCORIS layers draw `torch.rand(1)` on every training forward (module dropout, a host-side draw a
CUDA graph replay skips), and peft's DoRA reads `base_layer.weight` as stored (fp8 numbers without their scale, or a
weight streamed in CPU RAM) and puts the magnitude on the output axis, where ComfyUI's loader does not apply it as
trained (see plain.DoraLinear)."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import LeanLoRAError
from ..settings import AdapterKind, LoraSettings
from ..step.frozen_weights import FP8, FP8_SCALE
from .dropout import step_seeded_dropouts


class AdapterType(ABC):
    """One adapter type. Subclasses fill in the class attributes and the abstract methods."""
    kind: AdapterKind
    label: str  # how messages name it ("LoHa")
    prefixes: tuple[str, ...]  # a part of each of its trainable parameters' dotted names starts with one of these
    file_parts: tuple[str, ...]  # a file module holding one of these parts is this type's (the list's order decides)
    required_parts: tuple[str, ...]  # what each file module of this type must hold (`down`/`up`: lora_down/lora_up)
    # Its file keys after the module name (continue_from's pattern is built from every type's): parts written
    # `<module>.<part>` as LyCORIS names them, and regex spellings of lora_down/lora_up (a group `down|up` or `A|B`)
    key_parts: tuple[str, ...] = ()
    key_spellings: tuple[str, ...] = ()
    network_module = "networks.lora"  # kohya's ss_network_module

    @abstractmethod
    def inject(self, module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...]) -> None:
        """Wraps the target layers of `module` in this type's adapter layers and freezes everything else."""

    @abstractmethod
    def layers(self, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """Its adapted layers in `module`, by path."""

    @abstractmethod
    def export(self, layer: torch.nn.Module, settings: LoraSettings) -> dict[str, torch.Tensor]:
        """The layer's file tensors by key suffix (`lora_down.weight`, `hada_w1_a`, `alpha`...), as trained."""

    @abstractmethod
    def load(self, layer: torch.nn.Module, parts: dict[str, torch.Tensor], where: str) -> None:
        """Copies a file module's tensors (by part: `down`, `up`, `alpha`, `hada_w1_a`...) into `layer`; a shape
        that does not fit raises a LeanLoRAError saying which (`where`: the file and its key)."""

    @abstractmethod
    def rank_of(self, shapes: dict[str, tuple[int, ...]]) -> int | None:
        """The rank a file module's tensor shapes say (None: its form has none, e.g. LoKr's full w2)."""

    def network_args(self, settings: LoraSettings) -> dict[str, str]:
        """Its entries of kohya's ss_network_args (LyCORIS' `algo`, `factor`, DoRA's `dora_wd`)."""
        return {}

    def fingerprint(self, settings: LoraSettings) -> tuple:
        """Its part of the resume fingerprint: what makes the same parameter shapes train another way."""
        return ("type", self.kind.value)

    def trainable(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        return [p for name, p in module.named_parameters()
                if any(part.startswith(self.prefixes) for part in name.split("."))]


class AdapterLinear(torch.nn.Module):
    """A target Linear with an adapter beside it: `base_layer(x) + x @ delta().T`, the adapter's input through the
    run's step-seeded dropout. Subclasses own their parameters and `delta` (the weight difference, scale included)."""

    def __init__(self, base_layer: torch.nn.Linear, dropout: torch.nn.Module):
        super().__init__()
        self.base_layer = base_layer
        self.lora_dropout = dropout
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features

    def delta(self) -> torch.Tensor:
        """The weight difference (out x in), scale included; subclasses that never make it override adapter_output."""
        raise NotImplementedError(type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.adapter_output(self.lora_dropout(x))

    def adapter_output(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, _in_compute_dtype(self.delta(), x))


def _in_compute_dtype(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Autocast casts for the matmul itself; without it the adapter's fp32 weights meet the input's dtype."""
    return weight if torch.is_autocast_enabled(x.device.type) else weight.to(x.dtype)


def wrap_targets(module: torch.nn.Module, settings: LoraSettings, target_modules: tuple[str, ...], label: str,
                 make) -> int:
    """Wraps every Linear whose path is a target or ends with `.<target>` (peft's matching) in `make(linear,
    dropout)`, freezing everything else. Returns how many were wrapped; a target that is not a Linear is an error."""
    if not target_modules:
        raise LeanLoRAError(f"LoRA targets {settings.targets.value!r} name no layer of this model; pick another "
                            "target preset")
    module.requires_grad_(False)
    chosen = [(path, layer) for path, layer in module.named_modules()
              if path and any(path == t or path.endswith(f".{t}") for t in target_modules)]
    if not chosen:
        raise LeanLoRAError(f"LoRA targets {settings.targets.value!r} matched no layer of this model; pick another "
                            "target preset")
    other = next((path for path, layer in chosen if not isinstance(layer, torch.nn.Linear)), None)
    if other is not None:
        raise LeanLoRAError(f"LoRA Config's type {settings.type.value}: {label} trains Linear layers, and target "
                            f"{other!r} is a {type(module.get_submodule(other)).__name__}; pick type lora or the "
                            "attention targets")
    dropouts = step_seeded_dropouts(settings.dropout, len(chosen))
    for (path, layer), dropout in zip(chosen, dropouts):
        parent, _, name = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, name, make(layer, dropout))
    if settings.dropout > 0:
        module.leanlora_dropout_seed = dropouts[0].seed
    return len(chosen)


def adapter_layers(module: torch.nn.Module, kind: type) -> dict[str, torch.nn.Module]:
    return {path: layer for path, layer in module.named_modules() if isinstance(layer, kind)}


def computed_weight(base: torch.nn.Linear, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The base layer's weight as its forward computes with it, not as stored: fp8 storage (bridge/cast_weights)
    times its scale, ComfyUI's scaled-fp8 `scale_weight` and per-layer `weight_function`s applied, a weight
    streamed in CPU RAM brought to `device`. Always a new tensor, never the stored one. Frozen: no gradient."""
    with torch.no_grad():
        weight = base.weight.to(device, non_blocking=True)  # a streamed weight: asynchronous, like its forward
        weight = weight.to(dtype, copy=True)  # a copy: callers work in place on it
        scale = getattr(base, FP8_SCALE, None)  # the buffer, not the Python float: compiled code would guard on it
        if base.weight.dtype == FP8 and scale is not None:
            weight = weight * scale.to(device, dtype)
        scale_weight = getattr(base, "scale_weight", None)
        if isinstance(scale_weight, torch.Tensor):
            weight = weight * scale_weight.to(device, dtype)
        for function in getattr(base, "weight_function", ()) or ():
            weight = function(weight)
        return weight


def kaiming(*shape: int) -> torch.Tensor:
    """A factor's initial values as kohya, LyCORIS and peft draw them (kaiming uniform, a = sqrt(5))."""
    tensor = torch.empty(shape)
    torch.nn.init.kaiming_uniform_(tensor, a=5 ** 0.5)
    return tensor


def check_shape(where: str, part: str, tensor: torch.Tensor, wanted: tuple[int, ...], fix: str) -> None:
    if tuple(tensor.shape) != tuple(wanted):
        raise LeanLoRAError(f"{where} does not fit this model: its {part} has shape {tuple(tensor.shape)}, and this "
                            f"layer needs {tuple(wanted)}. {fix}")

