"""What the trainer asks of a trained text encoder (LoRA Config's text_encoder_lr; ComfyUI's is
bridge/text_encoder.py). The adapter makes one (ModelAdapter.training_text_encoder) after refusing, before any
work, a model whose text encoder cannot be trained (ModelAdapter.check_text_encoder).

Its captions are tokenized once, when the cache is built: the tokens ride in each sample's conditioning under
TOKEN_KEY (CPU tensors, never moved to the device) and `condition` turns them, every step and with gradients, into
the conditioning the cached text embeddings stood for. Everything else about a run stays as it was."""
from __future__ import annotations

from typing import Protocol

import torch

TOKEN_KEY = "leanlora_te."  # conditioning entries holding a caption's tokens for the trained text encoder


class TrainedTextEncoder(Protocol):
    params: list[torch.nn.Parameter]  # its LoRA weights (fp32), stepped at LoraSettings.text_encoder_lr

    def describe(self) -> str: ...
    def tokens(self, caption: str) -> dict[str, torch.Tensor]: ...  # TOKEN_KEY entries, batch dim 1
    def condition(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...  # tokens -> encoded
    def to(self, device: torch.device) -> None: ...
    def resident_bytes(self) -> int: ...  # its frozen weights, on the device for the whole run
    def frozen_bytes(self, device: torch.device | None) -> int: ...
    def state_dict(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]: ...  # kohya's te keys
    def layers(self) -> dict[str, torch.nn.Module]: ...  # its LoRA layers by kohya module name
    def fingerprint(self) -> str: ...  # its base weights, for the resume check


def is_token_entry(name: str) -> bool:
    return name.startswith(TOKEN_KEY)
