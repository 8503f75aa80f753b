"""Streamed weights fetched ahead (issue 32's prefetch ring): each streamed layer's fp8 weight and bias are copied
from pinned CPU memory on a copy stream while the layers before it compute.

Without it a streamed layer copies its weight on the compute stream right before it runs, so every streamed byte
waits for the GPU, twice per step with checkpointing (the forward and backward's recompute): FLUX.1-dev at 8 GiB
streams 8.9 GiB of fp8 weights, ~18 GB over PCIe per step, all of it in the step's critical path.

Which layer runs next is the order of the previous pass (the forward, then backward's recomputes, block by block
in reverse; the same every step); a pass starts by fetching its first layers. The first pass, and a layer out of
that order, copies on demand as before; the order is learned again from every pass that completes. A copy's device memory is allocated in the compute stream's
order before the copy stream waits for it, and the compute stream waits for the copy's event before the layer
reads it, as activation offload's copies do (activation_offload.py). The copies read the same bytes either way:
the numbers are unchanged.

CUDA graphs: the copy stream joins a capture through those events and is joined again when the pass ends
(`active`), so a graph replays the prefetches with the rest of the step. Off the GPU the "copies" are plain,
synchronous ones: the order bookkeeping is the same and testable anywhere."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_ACTIVE: list[WeightPrefetch] = []  # the pass under way (any thread: checkpointing recomputes in autograd's)


def fetch_streamed(layer: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A streamed layer's stored weight and bias on `device`: fetched ahead where a prefetching pass is under way
    (and not inside compiled code, which cannot wait on events), else copied now without blocking the host."""
    if not torch.compiler.is_compiling() and _ACTIVE:  # compiled code never reads the list (no guard on it)
        return _ACTIVE[-1].take(layer, device)
    return _copy_now(layer, device)


def _copy_now(layer: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = layer.bias
    return layer.weight.to(device, non_blocking=True), None if bias is None else bias.to(device, non_blocking=True)


class WeightPrefetch:
    """Copies the streamed layers' weights `ahead` layers ahead of their use, in the order the previous pass used
    them. One per micro-step executor; `active()` spans a forward + backward."""

    def __init__(self, ahead: int = 1):
        self.ahead = ahead
        self.order: list[torch.nn.Module] = []  # the last complete pass's streamed layer calls, in order
        self._positions: dict[int, list[int]] = {}  # id(layer) -> its indices in `order`
        self._calls: list[torch.nn.Module] = []  # this pass's
        self._next = 0  # the index in `order` expected to be called next
        # order index -> (the copy's event, None off the GPU; weight; bias) copied ahead, not yet taken
        self._fetched: dict[int, tuple[torch.cuda.Event | None, torch.Tensor, torch.Tensor | None]] = {}
        self._compute_streams: list = []  # the streams that took copies this pass (joined at its end)
        self._copy_stream: torch.cuda.Stream | None = None
        self._device: torch.device | None = None  # where the layers asked for their weights last
        self.fetched_ahead = self.fetched_on_demand = 0  # of the latest pass: the report's and the tests' measure

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """One pass (forward + backward): the streamed layers inside take their weights from here."""
        self._calls, self._next, self._fetched, self._compute_streams = [], 0, {}, []
        self.fetched_ahead = self.fetched_on_demand = 0
        _ACTIVE.append(self)
        completed = False
        try:  # (an out-of-memory error in the first fetches still ends the pass: the copy stream is joined)
            if self.order and self._device is not None:  # the pass's first layers come over while it starts
                compute = self._compute_stream(self._device)
                for index in range(min(self.ahead, len(self.order))):
                    self._fetch(index, self._device, compute)
            yield
            completed = True
        finally:
            _ACTIVE.remove(self)
            self._finish(learn=completed)

    @staticmethod
    def _uses_streams(device: torch.device) -> bool:
        return device.type == "cuda"

    def _compute_stream(self, device: torch.device):
        """The stream the layers compute on now (None off the GPU), joined again when the pass ends."""
        compute = torch.cuda.current_stream(device) if self._uses_streams(device) else None
        if compute is not None and all(compute != s for s in self._compute_streams):
            self._compute_streams.append(compute)
        return compute

    def take(self, layer: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        compute = self._compute_stream(device)
        self._device = device
        self._calls.append(layer)
        index = self._locate(layer)
        fetched = self._fetched.pop(index, None) if index is not None else None
        if fetched is not None:
            done, weight, bias = fetched
            if done is not None:
                compute.wait_event(done)
            self.fetched_ahead += 1
        else:
            weight, bias = _copy_now(layer, device)
            self.fetched_on_demand += 1
        if index is not None:
            self._next = index + 1
            for upcoming in range(self._next, min(self._next + self.ahead, len(self.order))):
                if upcoming not in self._fetched:
                    self._fetch(upcoming, device, compute)
        return weight, bias

    def _locate(self, layer: torch.nn.Module) -> int | None:
        """Where this call is in the learned order: the expected next one, else this layer's next use after it
        (copies fetched for the calls skipped over are dropped), else nowhere (no prefetch until it matches)."""
        if self._next < len(self.order) and self.order[self._next] is layer:
            return self._next
        later = next((i for i in self._positions.get(id(layer), ()) if i >= self._next), None)
        if later is not None:
            for skipped in [i for i in self._fetched if i < later]:
                self._drop(skipped)
        return later

    def _fetch(self, index: int, device: torch.device, compute) -> None:
        layer = self.order[index]
        bias = layer.bias
        if compute is None:  # off the GPU: a plain copy, taken later like a prefetched one
            self._fetched[index] = (None, layer.weight.to(device, copy=True),
                                    None if bias is None else bias.to(device, copy=True))
            return
        # allocated in the compute stream's order: the memory may have served kernels still queued there
        weight = torch.empty_like(layer.weight, device=device)  # same strides: a channels-last conv stays so
        bias_copy = None if bias is None else torch.empty_like(bias, device=device)
        copy = self._stream(device)
        copy.wait_stream(compute)
        with torch.cuda.stream(copy):
            weight.copy_(layer.weight, non_blocking=True)
            if bias_copy is not None:
                bias_copy.copy_(bias, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy)
        self._fetched[index] = (done, weight, bias_copy)

    def _drop(self, index: int) -> None:
        """A copy fetched ahead that will not be taken: its memory goes back once the copy has run."""
        done, _, _ = self._fetched.pop(index)
        if done is not None:
            torch.cuda.current_stream(self._copy_stream.device).wait_event(done)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)  # copies only: no cuBLAS workspace
        return self._copy_stream

    def _finish(self, learn: bool) -> None:
        """The end of a pass (or its failure): every compute stream waits for the copy stream (a capture needs it
        joined), copies never taken are dropped, and a completed pass's order is the next one's."""
        if self._copy_stream is not None:
            for stream in self._compute_streams:
                stream.wait_stream(self._copy_stream)
        self._fetched, self._compute_streams = {}, []
        if learn and self._calls:
            self.order, self._positions = self._calls, {}
            for index, layer in enumerate(self.order):
                self._positions.setdefault(id(layer), []).append(index)
        self._calls = []
