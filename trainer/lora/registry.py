"""The adapter types, most specific first, apart from the package face (peft's tuners/ layout): the type modules and
file.py / continue_from.py import this, never trainer/lora/__init__.py back.

A DoRA module also holds lora_down/lora_up, so DoRA is asked before plain LoRA (LoHa, LoKr and OFT have parts of their
own). A file module is read by the first type whose parts it holds; each type names its own file keys (`key_parts`,
`key_spellings`), from which continue_from builds its pattern."""
from __future__ import annotations

from ..settings import LoraSettings
from .base import AdapterType
from .loha import LOHA
from .lokr import LOKR
from .oft import OFT
from .plain import DORA, PLAIN

ADAPTER_TYPES: list[AdapterType] = [LOHA, LOKR, OFT, DORA, PLAIN]


def adapter_type(settings: LoraSettings) -> AdapterType:
    """The type LoRA Config asks for."""
    return next(kind for kind in ADAPTER_TYPES if kind.kind is settings.type)
