"""Memory layout of 4-D tensors: cuDNN's bf16 convolutions on recent NVIDIA GPUs compute channels-last (NHWC).
NCHW operands are transposed on every call; NHWC ones are used as they are, and the outputs stay NHWC."""
from __future__ import annotations

import torch


def is_channels_last(tensor: torch.Tensor) -> bool:
    """NHWC in memory (and not also plain contiguous, as a 1x1 or single-channel tensor can be both)."""
    return tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)


def memory_format_of(tensor: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if is_channels_last(tensor) else torch.contiguous_format


def store_frozen_convs_channels_last(module: torch.nn.Module) -> int:
    """Stores every frozen Conv2d weight of `module` channels-last, in place. Returns how many changed layout
    (1x1 convolutions with a 1x1 kernel are the same bytes either way)."""
    changed = 0
    for conv in (m for m in module.modules() if isinstance(m, torch.nn.Conv2d) and not m.weight.requires_grad):
        conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
        changed += is_channels_last(conv.weight)
    return changed
