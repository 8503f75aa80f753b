"""The device's memory, as training asks about it: one home for every question the memory code puts to the GPU
(allocated, peak, free, the process's cap) and for every move of a tensor onto it or back to host RAM.

`device_memory(device)` answers with:
- `CudaMemory` on a CUDA device: PyTorch's allocator and the driver, as they are;
- `SimulatedCard` on the CPU while a test has installed one: a GPU of N GiB made of host RAM, so the paths that
  otherwise run only on CUDA (memory probes, placement, the static plan, fit_to_card, the ladder walk, release)
  run in CPU tests with the numbers a card of that size would give;
- None otherwise (the CPU: there is no VRAM to plan).

The simulated card counts the bytes of every storage that is on it: what `place` copies there, and what PyTorch
allocates while device work runs (`computing`: the probe steps and the training loop), tracked until freed. Past
its capacity (less the CUDA context a real card loses, and the process's cap where one is set) it raises torch's
own `OutOfMemoryError`, as the CUDA allocator does. What cannot run without CUDA (graph capture, copy streams,
pinned memory) stays off on it, as on the CPU: docs/TESTING.md lists those paths."""
from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2 ** 30


class CudaMemory:
    """A CUDA device's memory through PyTorch's allocator and the driver."""

    simulated = False

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> bool:
        """Starts a new peak measurement; False where the allocator keeps no peak statistics (not every torch build
        tracks them for cudaMallocAsync, ComfyUI's default backend)."""
        if not torch.cuda.is_available():
            return False
        try:
            torch.cuda.reset_peak_memory_stats(self.device)
            torch.cuda.max_memory_allocated(self.device)
            return True
        except RuntimeError:
            return False

    def free_and_total(self) -> tuple[int, int]:
        """The driver's view of the whole device (every process, the CUDA context included)."""
        return torch.cuda.mem_get_info(self.device)

    def total(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def fraction(self) -> float | None:
        """This process's cap (set_per_process_memory_fraction), None where PyTorch cannot tell: under ComfyUI 0.33
        (comfy-aimdo hooks the driver's memory queries) the getter read 122888273.8 on an H200, whatever cap was
        set, and setting that value back raised."""
        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get is None:
            return None
        fraction = get(self.device)
        return fraction if 0.0 < fraction <= 1.0 else None

    def set_fraction(self, fraction: float) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is in this device's memory."""
        return tensor.is_cuda and (self.device.index is None or tensor.device.index == self.device.index)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def to_host(self, tensor: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """A copy in host RAM; pinned pages let later host-to-device copies run asynchronously."""
        host = tensor.to("cpu")
        return host.pin_memory() if pinned else host

    def computing(self):
        return contextlib.nullcontext()


# Host memory page-locked where it lies, by storage address -> bytes: tensors the training copy shares with
# ComfyUI's model (bridge/comfy_adapter._host_aliases) stream from ComfyUI's own pages instead of a pinned second
# copy (Qwen-Image's fp8 file at 8 GiB: ~19 GiB of host RAM). Through the driver API (cuMemHostRegister): a
# refusal there is a return code, where the runtime's cudaHostRegister leaves a sticky error that the next kernel
# launch raised (H100, 6 Dec: "part or all of the requested memory range is already mapped", when two small
# storages shared a page). Given back by unpin_in_place.
_PINNED_IN_PLACE: dict[int, int] = {}
PIN_IN_PLACE_MIN = 2 ** 20  # smaller storages may share pages with others (malloc's arenas): copied as before
_driver = None


def _cuda_driver():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
        _driver.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        _driver.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    return _driver


def pin_in_place(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in page-locked host memory: its own pages registered with the driver where it can (the same
    tensor back), else a pinned copy (pin_memory) as before. The registration covers the whole storage, once."""
    storage = tensor.untyped_storage()
    address, size = storage.data_ptr(), storage.nbytes()
    if address in _PINNED_IN_PLACE:
        return tensor
    if size >= PIN_IN_PLACE_MIN and torch.cuda.is_available():
        torch.cuda.synchronize()  # a runtime call: the primary context exists and is current in this thread (the
        # driver call below needs one; without it the registration was refused and a copy pinned, H100 6 Dec)
        try:
            refused = _cuda_driver().cuMemHostRegister_v2(address, size, 0)
        except (OSError, AttributeError):
            refused = True
        if not refused:
            if tensor.is_pinned():
                _PINNED_IN_PLACE[address] = size
                return tensor
            _cuda_driver().cuMemHostUnregister(address)  # PyTorch would not copy from it asynchronously
    return tensor.pin_memory()


def unpin_in_place() -> int:
    """Gives every page pin_in_place registered back to the pageable pool (before ComfyUI may free them: the
    driver must not keep a registration over freed memory); returns the bytes released."""
    released = 0
    for address, size in list(_PINNED_IN_PLACE.items()):
        _cuda_driver().cuMemHostUnregister(address)
        del _PINNED_IN_PLACE[address]
        released += size
    return released


class SimulatedCard:
    """A GPU of `gib` GiB for CPU tests: tensors stay host tensors, but the card counts the bytes on it and raises
    torch.OutOfMemoryError as a card of that size would. `context_gib`: what the CUDA context and libraries take
    outside PyTorch's allocator on a real card (~0.5 GiB on an H100; the driver counts it, PyTorch does not).

        with SimulatedCard(8).installed() as card:
            ...  # torch.device("cpu") is an 8 GiB GPU for the memory code

    `log` keeps what happened, for tests: ("place" | "host" | "oom", bytes, bytes on the card after)."""

    simulated = True

    def __init__(self, gib: float, context_gib: float = 0.5):
        self.device = torch.device("cpu")
        self.capacity, self.context = int(gib * GIB), int(context_gib * GIB)
        self.cap: float | None = None  # set_per_process_memory_fraction's value while one is set
        self.rounding_margin = 0  # no caching allocator: nothing rounds a block up
        self._on_card: dict[int, int] = {}  # storage key -> bytes
        self._bytes = self._peak = 0
        self._lock = threading.Lock()
        self._counting = threading.local()
        self.log: list[tuple[str, int, int]] = []

    # --- what training asks ---
    def allocated(self) -> int:
        return self._bytes

    reserved = allocated  # no caching allocator: a freed block goes back at once

    def peak_allocated(self) -> int:
        return self._peak

    peak_reserved = peak_allocated

    def reset_peak(self) -> bool:
        self._peak = self._bytes
        return True

    def free_and_total(self) -> tuple[int, int]:
        return max(0, self.capacity - self.context - self._bytes), self.capacity

    def total(self) -> int:
        return self.capacity

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def fraction(self) -> float | None:
        return self.cap

    def set_fraction(self, fraction: float) -> None:
        self.cap = None if fraction >= 1.0 else fraction

    def limit(self) -> int:
        """Bytes PyTorch may hold: the card less its context, and less again under the process's cap."""
        limit = self.capacity - self.context
        return limit if self.cap is None else min(limit, int(self.cap * self.capacity))

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy on the card (what `.to("cuda")` makes); already there: the tensor itself."""
        if self._key(tensor) in self._on_card:
            return tensor
        self._check(self._nbytes(tensor), "place")
        with self.quiet():
            copy = tensor.clone(memory_format=torch.preserve_format)
        self._count(copy)
        self.log.append(("place", self._nbytes(copy), self._bytes))
        return copy

    def to_host(self, tensor: torch.Tensor, pinned: bool = False) -> torch.Tensor:
        """A copy in host RAM (what `.to("cpu")` makes): the card's copy is freed once nothing holds it."""
        with self.quiet():
            host = tensor.clone(memory_format=torch.preserve_format)
        self.log.append(("host", self._nbytes(host), self._bytes))
        return host

    @contextlib.contextmanager
    def computing(self):
        """Device work: what PyTorch allocates meanwhile (in this thread, where autograd runs CPU backward too) is
        on the card until freed. Re-entrant."""
        if getattr(self._counting, "active", False):
            yield
            return
        self._counting.active = True
        try:
            with _CountAllocations(self):
                yield
        finally:
            self._counting.active = False

    @contextlib.contextmanager
    def quiet(self):
        """Host work inside device work (the card's own copies)."""
        before = getattr(self._counting, "paused", False)
        self._counting.paused = True
        try:
            yield
        finally:
            self._counting.paused = before

    @contextlib.contextmanager
    def installed(self):
        """The CPU device is this card until the block ends; nothing it counted outlives it."""
        global _SIMULATED
        if _SIMULATED is not None:
            raise RuntimeError("a simulated card is installed already")
        _SIMULATED = self
        try:
            yield self
        finally:
            _SIMULATED = None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is on the card."""
        return self._key(tensor) in self._on_card

    # --- the bookkeeping ---
    @staticmethod
    def _key(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage()._cdata

    @staticmethod
    def _nbytes(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().nbytes()

    def _check(self, nbytes: int, what: str) -> None:
        if self._bytes + nbytes > self.limit():
            self.log.append(("oom", nbytes, self._bytes))
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / GIB:.2f} GiB. GPU 0 has a total capacity of "
                f"{self.capacity / GIB:.2f} GiB of which {max(0, self.limit() - self._bytes) / GIB:.2f} GiB is "
                f"free (simulated card, {what}; {self._bytes / GIB:.2f} GiB allocated by PyTorch)")

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        with self._lock:
            if key in self._on_card or nbytes == 0:
                return
            self._on_card[key] = nbytes
            self._bytes += nbytes
            self._peak = max(self._peak, self._bytes)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        with self._lock:
            self._bytes -= self._on_card.pop(key, 0)

    def _allocated_by_op(self, output) -> None:
        if getattr(self._counting, "paused", False):
            return
        for tensor in tree_flatten(output)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.is_sparse:
                continue
            try:
                key, nbytes = self._key(tensor), self._nbytes(tensor)
            except (RuntimeError, NotImplementedError):  # a tensor without storage (a wrapper subclass)
                continue
            if key in self._on_card:
                continue
            self._check(nbytes, "allocation")
            self._count(tensor)


class _CountAllocations(TorchDispatchMode):
    """Sees every op's outputs while device work runs and counts the new storages on the card."""

    def __init__(self, card: SimulatedCard):
        super().__init__()
        self.card = card

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        self.card._allocated_by_op(output)
        return output


_SIMULATED: SimulatedCard | None = None


def device_memory(device: torch.device | str | None) -> CudaMemory | SimulatedCard | None:
    """The memory of `device` when it is a GPU (or a simulated one), None on a plain CPU."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMemory(device)
    if device.type == "cpu" and _SIMULATED is not None:
        return _SIMULATED
    return None


def card_of(tensors) -> CudaMemory | SimulatedCard | None:
    """The memory of the GPU (or simulated card) the first of `tensors` that is on one is on; None if none is."""
    for tensor in tensors:
        memory = device_memory(tensor.device)
        if memory is not None and memory.holds(tensor):
            return memory
    return None


def is_gpu(device: torch.device | str | None) -> bool:
    """Whether `device` has memory to plan: a CUDA device, or the simulated card of a CPU test."""
    return device_memory(device) is not None
