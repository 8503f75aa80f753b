"""Activation offloading: what autograd saves for backward waits in pinned CPU memory instead of VRAM.

With gradient checkpointing, what stays saved between forward and backward is mostly each checkpointed block's
input (PyTorch's non-reentrant checkpoint saves them like any other saved tensor) plus the few layers outside
blocks: ~0.5 GiB on SDXL at 1024². Copying them to the host after the forward pass uses them and back when
backward reaches them trades PCIe traffic for that memory. Small tensors (< 1 MiB) and parameters stay put.

The copies run on their own stream so they overlap compute (on the compute stream they cost an SDXL step 20 ms
on an H200): a saved tensor's device memory is released to the compute stream only once its copy has run, two
saved tensors later, and backward fetches the tensor it will ask for next while the current block recomputes
(the order of the previous pass with the same saved shapes; the first pass guesses reverse pack order).
`finish()` after backward joins the copy stream again.

CUDA graphs: a captured copy writes to the host buffer it was captured with, forever. The eager warm-up step
records which buffers the forward pass needs; capture then takes preallocated buffers in the same order and
they live as long as the graph (`GraphBuffers`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..layout import memory_format_of

MIN_BYTES = 1 << 20


def _spec(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.memory_format]:
    """What a host buffer for `tensor` must match. The layout too: a channels-last activation in an NCHW buffer
    would be transposed by both copies and come back in the layout its convolution converts again."""
    return tensor.shape, tensor.dtype, memory_format_of(tensor)


class _Saved:
    """A saved tensor waiting on the host, with its position in the pass's pack order."""
    __slots__ = ("index", "device", "host", "fetched", "used", "pass_number")

    def __init__(self, index: int, device: torch.device, host: torch.Tensor, pass_number: int):
        self.index, self.device, self.host = index, device, host
        self.pass_number = pass_number  # a later pass's bookkeeping must not take it for one of its own
        self.fetched: tuple[torch.cuda.Event, torch.Tensor] | None = None  # a copy back already under way
        self.used = False  # handed to backward (a second unpack copies again)


class ActivationOffload:
    IN_FLIGHT = 2  # saved tensors whose device memory waits for their copy to the host: overlap vs. memory
    FETCH_AHEAD = 1  # saved tensors on their way back while backward works on the current one

    def __init__(self, min_bytes: int = MIN_BYTES, in_flight: int = IN_FLIGHT, fetch_ahead: int = FETCH_AHEAD):
        self.min_bytes, self.in_flight, self.fetch_ahead = min_bytes, in_flight, fetch_ahead
        # host buffers the last recorded pass needed: (shape, dtype, memory format)
        self.recorded: list[tuple[torch.Size, torch.dtype, torch.memory_format]] = []
        self._recording = False
        self._static: list[torch.Tensor] | None = None  # capture: buffers handed out in order
        self._next = 0
        self.offloaded_bytes = 0  # of the latest forward pass
        self._copy_stream: torch.cuda.Stream | None = None
        self._saved: list[_Saved] = []  # this pass's, in pack order
        self._pass_number = 0  # counts finished passes
        self._unpacked: list[int] = []  # this pass's, in the order backward asked for them
        self._learned: tuple[list, list[int]] | None = None  # an earlier pass: (what it saved, its unpack order)
        self._next_wanted: dict[int, int] = {}  # for this pass, from a learned order: index -> the next one
        self._to_host: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # copies out whose source is still held
        self._fetching: dict[int, _Saved] = {}  # copies back not yet handed to backward
        # the latest pass's unpacks: fetched ahead (overlapped), on demand (waited for); fetches never used
        self.fetched_ahead = self.fetched_on_demand = self.fetched_unused = 0

    def _wants(self, tensor: torch.Tensor) -> bool:
        return (tensor.is_cuda and not isinstance(tensor, torch.nn.Parameter)
                and tensor.numel() * tensor.element_size() >= self.min_bytes)

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        spec = _spec(tensor)
        if self._static is not None:  # capturing: the buffer recorded for this position
            if self._next >= len(self._static) or _spec(self._static[self._next]) != spec:
                raise RuntimeError("activation offload: the captured pass saves other tensors than the warm-up did")
            buffer = self._static[self._next]
            self._next += 1
            return buffer
        if self._recording:
            self.recorded.append(spec)
        shape, dtype, layout = spec
        return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available(), memory_format=layout)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)  # copies only: no cuBLAS workspace
        return self._copy_stream

    def pack(self, tensor: torch.Tensor):
        if not self._wants(tensor):
            # Detached: a node's own output returned as is would hold its grad_fn, which holds the saved output (a
            # cycle through C++ that Python's gc cannot see). Backward breaks it; a forward that fails (out of memory
            # in a probe or a step) left the whole partial graph allocated for good.
            return tensor.detach()
        host = self._host_buffer(tensor)
        compute, copy = torch.cuda.current_stream(tensor.device), self._stream(tensor.device)
        copy.wait_stream(compute)  # the tensor has been written
        with torch.cuda.stream(copy):
            host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy)
        self._to_host.append((done, tensor))  # its memory must not serve the compute stream before the copy ran
        while len(self._to_host) > self.in_flight:
            self._release_oldest(compute)
        self.offloaded_bytes += host.numel() * host.element_size()
        self._saved.append(_Saved(len(self._saved), tensor.device, host, self._pass_number))
        return self._saved[-1]

    def _release_oldest(self, compute: torch.cuda.Stream) -> None:
        done, _tensor = self._to_host.pop(0)
        compute.wait_event(done)  # later work on the compute stream may reuse the tensor's memory

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        compute = torch.cuda.current_stream(packed.device)
        if packed.fetched is not None:
            done, tensor = packed.fetched
            compute.wait_event(done)
            del self._fetching[id(packed)]
            self.fetched_ahead += 1
        else:
            tensor = packed.host.to(packed.device, non_blocking=True)  # keeps the layout
            self.fetched_on_demand += 1
        packed.fetched, packed.used = None, True
        if packed.pass_number != self._pass_number:  # a pass that ended without its backward: no bookkeeping
            return tensor
        self._unpacked.append(packed.index)
        upcoming = packed
        for _ in range(self.fetch_ahead):
            upcoming = self._upcoming(upcoming)
            if upcoming is None:
                break
            if upcoming.fetched is None:
                self._fetch(upcoming, compute)
        return tensor

    def _upcoming(self, unpacked: _Saved) -> _Saved | None:
        """The saved tensor backward will most likely ask for next: the one that followed in an earlier pass's
        unpack order (same saved shapes), else the latest earlier one not handed out yet (nodes come in reverse
        order, but one node unpacks its several tensors in forward order)."""
        if unpacked.index in self._next_wanted:
            candidate = self._saved[self._next_wanted[unpacked.index]]
            return None if candidate.used else candidate
        for index in range(unpacked.index - 1, -1, -1):
            if not self._saved[index].used:
                return self._saved[index]
        return None

    def _fetch(self, saved: _Saved, compute: torch.cuda.Stream) -> None:
        """Starts copying `saved` back, overlapping the compute queued before its turn."""
        tensor = torch.empty_like(saved.host, device=saved.device)  # the compute stream's; same layout
        copy = self._stream(saved.device)
        copy.wait_stream(compute)  # the memory may have served kernels still queued there
        with torch.cuda.stream(copy):
            tensor.copy_(saved.host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy)
        saved.fetched = (done, tensor)
        self._fetching[id(saved)] = saved

    def finish(self) -> None:
        """After backward (or a failed pass): the compute stream waits for every copy (capture needs the copy
        stream joined), copies back that backward never asked for are dropped, and the order backward asked
        in is kept for the next pass's fetches."""
        if self._copy_stream is not None and (self._to_host or self._fetching or self._saved):
            torch.cuda.current_stream(self._copy_stream.device).wait_stream(self._copy_stream)
        for saved in self._fetching.values():
            saved.fetched = None
        self.fetched_unused += len(self._fetching)
        if self._unpacked:
            self._learned = (self._signature(), list(dict.fromkeys(self._unpacked)))
        self._to_host, self._fetching, self._saved, self._unpacked, self._next_wanted = [], {}, [], [], {}
        self._pass_number += 1

    def _signature(self) -> list:
        return [_spec(saved.host) for saved in self._saved]

    @contextlib.contextmanager
    def saving(self, record: bool = False) -> Iterator[None]:
        """Offloads what the forward pass inside saves. record=True notes the host buffers it needed."""
        self.finish()  # whatever an interrupted pass left in flight
        self.offloaded_bytes = self.fetched_ahead = self.fetched_on_demand = self.fetched_unused = 0
        if record:
            self.recorded = []
        self._recording = record
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._recording = False
            while self._to_host:  # the pass is over: its saved tensors' memory may be reused once copied
                self._release_oldest(torch.cuda.current_stream(self._to_host[0][1].device))
            if self._learned is not None and self._learned[0] == self._signature():
                order = self._learned[1]
                self._next_wanted = dict(zip(order, order[1:]))

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        """For CUDA-graph capture (around a `saving()` pass): host buffers like the recorded pass's,
        preallocated; the caller keeps the yielded list alive as long as the graph."""
        buffers = [torch.empty(shape, dtype=dtype, pin_memory=True, memory_format=layout)
                   for shape, dtype, layout in self.recorded]
        self._static, self._next = buffers, 0
        try:
            yield buffers
        finally:
            self._static = None
