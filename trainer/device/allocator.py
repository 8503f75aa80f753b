"""The CUDA caching allocator's settings for a training run.

Expandable segments let PyTorch's native allocator grow one mapping instead of keeping many fixed blocks, so
memory reserved stays close to memory allocated (fragmentation otherwise adds 10-25% on SDXL runs). The setting
normally has to be in PYTORCH_CUDA_ALLOC_CONF before CUDA starts, which a custom node cannot do for a running
ComfyUI; PyTorch can also switch it for segments allocated from now on, which is what a run does here, putting
the previous value back afterwards. ComfyUI starts PyTorch on the cudaMallocAsync backend by default, where the
driver manages the pool and this setting does not exist: the report says so."""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from ..settings import Allocator
from .card import device_memory


def _env_setting(name: str) -> str | None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


@functools.cache  # fixed once CUDA has started
def backend() -> str:
    try:
        return torch.cuda.get_allocator_backend()
    except Exception:  # noqa: BLE001 - torch builds without CUDA
        return "none"


def memory_fraction(device: torch.device) -> float | None:
    """This process's cap (set_per_process_memory_fraction) on `device`, None where there is none to tell (the CPU)
    or PyTorch cannot tell it (ComfyUI 0.33: device/card.CudaMemory.fraction)."""
    memory = device_memory(device)
    return None if memory is None else memory.fraction()


def memory_limit(device: torch.device, budget: int | None) -> int | None:
    """The tighter of the auto-fit budget and this process's cap (set_per_process_memory_fraction), if any."""
    limits = [budget] if budget else []
    fraction = memory_fraction(device)
    if fraction is not None and fraction < 1.0:
        limits.append(int(fraction * device_memory(device).total()))
    return min(limits) if limits else None


def compiled_kernels_blocked() -> bool:
    """Whether torch.compile's Triton kernels must not run here: inside a CUDA-graph capture under cudaMallocAsync.
    There memory allocated during the capture has no mapping until the graph is launched, and Triton's launcher
    rejects such pointers ("CUDA driver error: invalid argument": every fp8 and compiled capture failed on an H200,
    torch 2.11). Their eager forms capture fine."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing() and backend() == "cudaMallocAsync"


def apply_allocator_settings(choice: Allocator, device: torch.device, notes: list[str]) -> Callable[[], None]:
    """Applies `choice` (expandable segments, or the allocator as started); returns what puts the previous setting
    back."""
    if choice is Allocator.AS_STARTED or torch.device(device).type != "cuda":
        return lambda: None
    if backend() != "native":
        notes.append(f"allocator: expandable segments not applied: this process uses PyTorch's {backend()} "
                     "allocator (ComfyUI's default; the driver keeps its own pool). Start ComfyUI with "
                     "--disable-cuda-malloc to use PyTorch's native allocator with expandable segments")
        return lambda: None
    if (_env_setting("expandable_segments") or "False").lower() == "true":
        return lambda: None  # already on for the whole process
    _set_allocator_settings("expandable_segments:True")
    notes.append("allocator: expandable segments on for this run (reserved memory stays close to allocated)")
    return lambda: _set_allocator_settings("expandable_segments:False")


def _set_allocator_settings(setting: str) -> None:
    # Newer torch moved this to the accelerator-generic call (the CUDA one warns it is deprecated).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(setting)


def trim_graph_memory(device: torch.device) -> None:
    """Gives the driver's graph memory back: under cudaMallocAsync a CUDA graph's allocations come from the
    driver's own graph pool, which PyTorch neither counts (memory_reserved) nor trims (empty_cache), and which
    keeps what a destroyed graph freed. On an H200 in a ComfyUI server that was 1.4-5.5 GiB "outside PyTorch" after
    a job: the KSampler after Train and the next job's auto-fit found the card that much smaller. A no-op where
    the runtime has no such call (it is CUDA 11.4+) or nothing is cached."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_initialized():
        return  # no CUDA work in this process yet: nothing cached
    trim = _graph_mem_trim()
    if trim is not None:
        torch.cuda.synchronize(device)
        trim(torch.device(device).index if torch.device(device).index is not None else torch.cuda.current_device())


def trim_host_memory() -> None:
    """Gives host memory back after a job: PyTorch's pinned-memory cache (streamed weights, offloaded activations
    and batch copies are pinned; freed pinned blocks stay cached for the process's life) and glibc's free heap
    (large tensors freed inside the heap are not returned until trimmed). On an H200 a ComfyUI server's RSS grew
    ~0.4 GiB per job over 20 re-queues without this."""
    empty_pinned_cache = getattr(torch._C, "_host_emptyCache", None)  # private, and absent from older torch
    if empty_pinned_cache is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        empty_pinned_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes
    import ctypes.util
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to trim this way
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def graph_memory_reserved(device: torch.device) -> int:
    """Bytes the driver's graph memory pool holds on `device` (cudaGraphMemAttrReservedMemCurrent): under
    cudaMallocAsync a captured graph's allocations live there, outside memory_reserved, once the graph has been
    launched. 0 off CUDA, before any CUDA work, or where the runtime has no such call."""
    import ctypes
    if torch.device(device).type != "cuda" or not torch.cuda.is_initialized():
        return 0
    query = _runtime_function("cudaDeviceGetGraphMemAttribute", (ctypes.c_int, ctypes.c_int, ctypes.c_void_p))
    if query is None:
        return 0
    index = torch.device(device).index
    value = ctypes.c_uint64(0)
    reserved_current = 2  # cudaGraphMemAttrReservedMemCurrent
    if query(index if index is not None else torch.cuda.current_device(), reserved_current, ctypes.byref(value)):
        return 0  # an error code: nothing to read
    return value.value


@functools.cache
def _graph_mem_trim() -> Callable[[int], int] | None:
    """cudaDeviceGraphMemTrim of the CUDA runtime this process loaded (PyTorch's)."""
    import ctypes
    return _runtime_function("cudaDeviceGraphMemTrim", (ctypes.c_int,))


@functools.cache
def _runtime_function(name: str, argtypes: tuple) -> Callable[..., int] | None:
    """A function of the CUDA runtime this process loaded (PyTorch's), found by its path in the process's memory
    map: torch exposes no binding. Returns its cudaError_t."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            function = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = list(argtypes), ctypes.c_int
        return function
    return None
