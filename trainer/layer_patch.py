"""Per-layer behaviour of the private training copy, changed by class: a layer's class is swapped for a
subclass that puts a mixin's methods first. Every patched layer of a type then runs the same code, which
torch.compile compiles once for all of them (per-instance callables are guarded by identity: one compile each)."""
from __future__ import annotations

import torch

_SUBCLASSES: dict[tuple[type, type], type] = {}


def mix_into(layer: torch.nn.Module, mixin: type) -> bool:
    """Makes `layer` an instance of a subclass of its class with `mixin` first in the MRO; False if it already is."""
    cls = type(layer)
    if issubclass(cls, mixin):
        return False
    if (mixin, cls) not in _SUBCLASSES:
        _SUBCLASSES[(mixin, cls)] = type(f"{cls.__name__}{mixin.__name__}", (mixin, cls), {})
    layer.__class__ = _SUBCLASSES[(mixin, cls)]
    return True
