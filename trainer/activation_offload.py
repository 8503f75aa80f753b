"""Activation offloading: what autograd saves for backward waits in pinned CPU memory instead of VRAM.

With gradient checkpointing, what stays saved between forward and backward is mostly each checkpointed block's
input (PyTorch's non-reentrant checkpoint saves them like any other saved tensor) plus the few layers outside
blocks: ~0.5 GiB on SDXL at 1024². Copying them to the host after the forward pass uses them and back when
backward reaches them trades PCIe traffic for that memory. Small tensors (< 1 MiB) and parameters stay put.

CUDA graphs: a captured copy writes to the host buffer it was captured with, forever. The eager warm-up step
records which buffers the forward pass needs; capture then takes preallocated buffers in the same order and
they live as long as the graph (`GraphBuffers`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

MIN_BYTES = 1 << 20


class ActivationOffload:
    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self.recorded: list[tuple[torch.Size, torch.dtype]] = []  # host buffers the last recorded pass needed
        self._recording = False
        self._static: list[torch.Tensor] | None = None  # capture: buffers handed out in order
        self._next = 0
        self.offloaded_bytes = 0  # of the latest forward pass

    def _wants(self, tensor: torch.Tensor) -> bool:
        return (tensor.is_cuda and not isinstance(tensor, torch.nn.Parameter)
                and tensor.numel() * tensor.element_size() >= self.min_bytes)

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._static is not None:  # capturing: the buffer recorded for this position
            if self._next >= len(self._static) or self._static[self._next].shape != tensor.shape \
                    or self._static[self._next].dtype != tensor.dtype:
                raise RuntimeError("activation offload: the captured pass saves other tensors than the warm-up did")
            buffer = self._static[self._next]
            self._next += 1
            return buffer
        if self._recording:
            self.recorded.append((tensor.shape, tensor.dtype))
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def pack(self, tensor: torch.Tensor):
        if not self._wants(tensor):
            return tensor
        host = self._host_buffer(tensor)
        host.copy_(tensor, non_blocking=True)  # stream-ordered: the block is reused only after the copy ran
        self.offloaded_bytes += host.numel() * host.element_size()
        return tensor.device, host

    @staticmethod
    def unpack(packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    @contextlib.contextmanager
    def saving(self, record: bool = False) -> Iterator[None]:
        """Offloads what the forward pass inside saves. record=True notes the host buffers it needed."""
        self.offloaded_bytes = 0
        if record:
            self.recorded = []
        self._recording = record
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        """For CUDA-graph capture (around a `saving()` pass): host buffers like the recorded pass's,
        preallocated; the caller keeps the yielded list alive as long as the graph."""
        buffers = [torch.empty(shape, dtype=dtype, pin_memory=True) for shape, dtype in self.recorded]
        self._static, self._next = buffers, 0
        try:
            yield buffers
        finally:
            self._static = None
