"""Host RAM is a card too (issue 44 item 5): what a plan holds in host RAM, planned against Memory Settings' `ram`
limit as auto-fit plans the card's VRAM.

What a run adds to host RAM beside the host application's own copy of the model (which the training copy shares
wherever it can: bridge/comfy_adapter._host_aliases):
- the training copy's own tensors: those it could not share (tensor subclasses, tensors the host kept elsewhere);
- conversions made on the host before the weights are placed: frozen tensors cast to the compute dtype, fp8 copies
  of weights that were not cast (a cast copy is replaced by its fp8 copy), and the fp32 temporary of the fp8
  conversion (a chunk of the largest layer);
- fp8 weights streamed from CPU that are copies (a bf16 file's weights converted to fp8, each on pages of its own so
  it is page-locked where it lies); an fp8 file's streamed weights are the host's own pages, page-locked in place,
  and cost nothing (a rung that parks placed weights points them back there: frozen_weights.HOST_ORIGIN);
- activation offload's pinned buffers: the activations one forward pass offloads, counted twice with CUDA graphs, an
  upper bound: PyTorch's pinned pool rounds each buffer up to a power of two, and the capture's buffers reuse the
  warm-up's cached blocks (tests/test_host_ram.py checks both on a GPU);
- the latent cache: every cached latent and text embedding;
- on a device with no memory of its own (a CPU run): everything training holds, weights, LoRA, gradients and
  optimizer state.
Before placement the copy's own tensors and the conversions are held; during training the streamed copies and the
offload buffers (on a CPU device, the copy, its conversions, LoRA and optimizer state stay). The estimate's peak is
the latent cache plus the larger of the two.

The limit: `ram` N GiB, or auto: what the machine has free when training starts (MemAvailable) plus what the run
already holds (its latent cache and training copy, made before the plan). Auto-fit leaves out activation offload
where its buffers would not fit (next_rung_within); a fitted plan over the limit is refused before step 1
(check_plan). Settings the user gave as they are (card manual) run as set, with a warning."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..errors import LeanLoRAError
from ..settings import BaseWeights, MemorySettings, RamLimit
from ..step.frozen_weights import FP8_CONVERSION_CHUNK, FP8_SCALE
from ..step.precision import DTYPES
from ..device.allocator import trim_host_memory
from ..device.card import GIB, is_gpu
from .ladder import next_rung
from ..device.vram import available_ram_bytes

# Offloaded activations under CUDA graphs, an upper bound: the captured graph copies into buffers of its own
# (ActivationOffload.capturing), taken from PyTorch's pinned pool after a synchronize, so they are the eager
# warm-up's cached blocks again; each block is its buffer rounded up to a power of two (less than twice it).
OFFLOAD_COPIES_WITH_GRAPHS = 2
# cast_weights.store_weights_fp8 converts a weight FP8_CONVERSION_CHUNK elements at a time through one fp32
# temporary (bytes per element)
FP8_CONVERSION_TEMPORARY = 4


@dataclass
class HostRamEstimate:
    """Bytes of host RAM a plan adds beside the host application's own (see the module's docstring)."""
    training_copy: int = 0
    conversions: int = 0
    streamed: int = 0
    activation_offload: int = 0
    latent_cache: int = 0
    on_host_device: int = 0  # a CPU run: the LoRA, its gradients and the optimizer state live in host RAM too
    gpu: bool = True  # placement moves the copy's own tensors and the conversions off the host

    @property
    def before_training(self) -> int:
        return self.training_copy + self.conversions

    @property
    def during_training(self) -> int:
        held = self.streamed + self.activation_offload
        return held if self.gpu else held + self.before_training + self.on_host_device

    @property
    def total(self) -> int:
        return self.latent_cache + max(self.before_training, self.during_training)

    def terms(self) -> list[tuple[str, int]]:
        return [("training copy's own tensors", self.training_copy),
                ("conversions before placement", self.conversions), ("streamed fp8 copies", self.streamed),
                ("activation offload", self.activation_offload), ("latent cache", self.latent_cache),
                ("LoRA + optimizer (CPU run)", self.on_host_device)]

    def format(self) -> str:
        text = ", ".join(f"{name} {value / GIB:.2f}" for name, value in self.terms() if value)
        return f"host RAM estimate (GiB): {text or 'nothing beyond the host application'}; peak {self.total / GIB:.2f} GiB"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def latent_cache_bytes(cache) -> int:
    """Bytes of the cached samples (latents, conditionings, caption variants, masks), each storage once."""
    seen: dict[int, int] = {}

    def add(tensor):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    for sample in cache:
        add(sample.latent)
        add(sample.mask)
        for cond in (sample.cond, *sample.variants, *([sample.dropped] if sample.dropped else [])):
            for value in cond.values():
                add(value)
    return sum(seen.values())


@dataclass(frozen=True)
class CopyOnHost:
    """The training copy as it is before the first configuration, in the numbers the estimate needs per plan."""
    own: int  # host bytes of frozen tensors not shared with the host application
    cast: dict[torch.dtype, int]  # compute dtype -> new host bytes casting the frozen tensors to it makes
    fp8_layers: Callable[[torch.dtype, float], int]  # (compute dtype, stream share) -> bytes streaming moves off
    converted_share: float  # of the fp8 layers' bytes, the share fp8 storage converts (the rest: an fp8 file's)
    # compute dtype -> of the weights fp8 storage converts, the share already in it (not cast: their fp8 copy is new)
    uncast_share: dict[torch.dtype, float]
    largest_weight: int  # elements of the largest weight fp8 storage converts

    @classmethod
    def of(cls, adapter, unet: torch.nn.Module) -> "CopyOnHost":
        shared = getattr(adapter, "shared_host_storages", None)
        shared = shared() if shared is not None else set()
        frozen = [(name, t) for name, t in [*unet.named_parameters(), *unet.named_buffers()]
                  if not t.requires_grad and t.device.type == "cpu"]
        own = sum(_nbytes(t) for _, t in {t.untyped_storage().data_ptr(): (n, t) for n, t in frozen}.values()
                  if t.untyped_storage().data_ptr() not in shared)
        cast = {dtype: _cast_bytes(frozen, dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}

        def fp8_layers(dtype: torch.dtype, share: float) -> int:
            keep = adapter.projected_weight_bytes(unet, dtype, BaseWeights.FP8, 1.0)
            return max(0, keep - adapter.projected_weight_bytes(unet, dtype, BaseWeights.FP8_STREAMED, share))
        weights = [t for name, t in frozen if name.endswith("weight") and t.dim() >= 2]
        converted = [t for t in weights if t.element_size() > 1]  # an fp8 file's weights stay as they are
        total, count = sum(t.numel() for t in weights), sum(t.numel() for t in converted)
        uncast = {dtype: sum(t.numel() for t in converted if t.dtype == dtype) / count if count else 0.0
                  for dtype in cast}
        return cls(own, cast, fp8_layers, count / total if total else 0.0, uncast,
                   max((t.numel() for t in converted), default=0))


def _cast_bytes(frozen: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> int:
    """New host bytes cast_frozen_weights makes casting `frozen` to `dtype` (its rule: floating tensors wider than
    a byte, scales and scalars excepted)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * size for name, t in frozen
               if t.is_floating_point() and t.dtype != dtype and t.element_size() > 1 and t.numel() > 1
               and not name.endswith(FP8_SCALE))


def estimate_plan(copy: CopyOnHost, memory: MemorySettings, device: torch.device, latent_cache: int,
                  offload_bytes: int = 0, graphs: bool = False, lora_and_optimizer: int = 0) -> HostRamEstimate:
    """The host RAM `memory` needs. `offload_bytes`: the activations one forward pass offloads (measured, or the
    probe's activations before offload is on); `lora_and_optimizer`: the LoRA, gradients and optimizer state, which a
    CPU run holds in host RAM."""
    dtype = DTYPES[memory.mixed_precision] or torch.float32
    gpu = is_gpu(device)
    fp8_copies = 0
    if memory.base_weights.fp8:
        fp8_copies = int(copy.fp8_layers(dtype, 1.0) * copy.converted_share * copy.uncast_share.get(dtype, 0.0)) \
            + FP8_CONVERSION_TEMPORARY * min(copy.largest_weight, FP8_CONVERSION_CHUNK)
    streamed = 0
    if memory.base_weights.streamed and gpu:
        streamed = int(copy.fp8_layers(dtype, memory.stream_share) * copy.converted_share)
    offload = offload_bytes * (OFFLOAD_COPIES_WITH_GRAPHS if graphs else 1) if memory.activation_offload and gpu else 0
    return HostRamEstimate(training_copy=copy.own, conversions=copy.cast.get(dtype, 0) + fp8_copies,
                           streamed=streamed, activation_offload=offload, latent_cache=latent_cache,
                           on_host_device=0 if gpu else lora_and_optimizer, gpu=gpu)


@dataclass(frozen=True)
class HostRamLimit:
    """The bytes a run may hold in host RAM (None: unknown, nothing is checked) and how the number came about."""
    limit: int | None
    source: str

    @classmethod
    def of(cls, ram: RamLimit, held_now: int, available: int | None = None) -> "HostRamLimit":
        """`held_now`: what the run holds already (latent cache, training copy): with auto it counts as free."""
        if ram.gib is not None:
            return cls(int(ram.gib * GIB), f"ram {ram.gib:g} GiB")
        available = available_ram_bytes() if available is None else available
        if available is None:
            return cls(None, "ram auto (this machine's free RAM could not be read)")
        return cls(available + held_now, f"ram auto: {available / GIB:.2f} GiB free now + {held_now / GIB:.2f} GiB "
                                         "the run holds already")

    def fits(self, estimate: HostRamEstimate) -> bool:
        return self.limit is None or estimate.total <= self.limit


class HostRamPlan:
    """One run's host RAM: the training copy as made, the latent cache and the limit; what each plan would take."""

    def __init__(self, adapter, unet: torch.nn.Module, cache, ram: RamLimit, available: int | None = None):
        self.device = adapter.device
        self.copy = CopyOnHost.of(adapter, unet)
        self.latent_cache = latent_cache_bytes(cache)
        self.limit = HostRamLimit.of(ram, self.copy.own + self.latent_cache, available)
        self.lines: list[str] = []  # auto-fit's host-RAM decisions, for the report
        self.probed_activations: int | None = None  # the latest probe's activation bytes (next_rung_within)

    def estimate(self, memory: MemorySettings, offload_bytes: int = 0, graphs: bool = False,
                 lora_and_optimizer: int = 0) -> HostRamEstimate:
        return estimate_plan(self.copy, memory, self.device, self.latent_cache, offload_bytes, graphs,
                             lora_and_optimizer)

    def next_rung_within(self, memory: MemorySettings, offload_bytes: int | None = None,
                         graphs: bool = False) -> tuple[MemorySettings, str] | None:
        """The ladder's next rung (ladder.next_rung), but where it turns activation offload on and the offload
        buffers would not fit the host RAM limit, the rung after it with offload left off (streaming instead), or
        None. `offload_bytes`: what offload would move, the latest probe's activations (None: the last ones given
        here; none ever: the rung is taken)."""
        if offload_bytes is not None:
            self.probed_activations = offload_bytes
        rung = next_rung(memory, self.device)
        offload = self.probed_activations
        if rung is None or offload is None or memory.activation_offload or not rung[0].activation_offload:
            return rung
        needed = self.estimate(rung[0], offload, graphs)
        if self.limit.fits(needed):
            return rung
        line = (f"auto-fit: activation offload left out: with it the run would take {needed.total / GIB:.2f} GiB of "
                f"host RAM, over the {self.limit.limit / GIB:.2f} GiB limit ({self.limit.source})")
        if line not in self.lines:
            self.lines.append(line)
        walked = next_rung(rung[0], self.device)
        if walked is None:
            return None
        return replace(walked[0], activation_offload=False), walked[1]

    def check_plan(self, estimate: HostRamEstimate, memory: MemorySettings, fitted: bool) -> str | None:
        """Before step 1: a plan over the limit is refused when auto-fit chose it (nothing it could choose fits);
        settings given as they are run as set, with the warning this returns. None where it fits."""
        if self.limit.fits(estimate):
            return None
        terms = sorted(((value, name) for name, value in estimate.terms() if value), reverse=True)
        biggest = ", ".join(f"{name} {value / GIB:.2f} GiB" for value, name in terms[:3])
        advice = _advice(estimate, memory)
        text = (f"this run needs about {estimate.total / GIB:.2f} GiB of host RAM ({biggest}) and the limit is "
                f"{self.limit.limit / GIB:.2f} GiB ({self.limit.source})")
        if fitted:
            raise LeanLoRAError(f"host RAM: {text}, and no plan auto-fit can choose needs less. Before step 1, "
                                f"nothing trained. To train: {advice}")
        return f"WARNING: host RAM: {text}; the settings run as set (card manual). {advice[0].upper()}{advice[1:]}"


def next_rung_for(session, probed=None) -> tuple[MemorySettings, str] | None:
    """ladder.next_rung for the session's settings, within its host RAM limit where it has one (session.host_ram;
    a session without a plan, as the bench's and the tests' stand-ins, walks the plain ladder). `probed`: the latest
    probe's MemoryEstimate, whose activations are what offload would move."""
    host = getattr(session, "host_ram", None)
    if host is None:
        return next_rung(session.memory, session.adapter.device)
    activations = probed.activations if probed is not None else None
    return host.next_rung_within(session.memory, activations, graphs=bool(getattr(session.micro_step, "graphed", 0)))


def _advice(estimate: HostRamEstimate, memory: MemorySettings) -> str:
    """What would bring the largest terms down, most effective first."""
    steps = []
    if estimate.streamed or estimate.conversions:
        steps.append("load the model as fp8 (Load Diffusion Model's weight_dtype fp8_e4m3fn, or an fp8 file: its "
                     "streamed weights are then the host's own pages, not copies)")
    if estimate.activation_offload:
        steps.append("turn activation_offload off (card manual) or give the run a larger card")
    if estimate.latent_cache > GIB // 4:
        steps.append("train on fewer or smaller images (the latent cache is held in RAM)")
    steps.append("close other programs or unload other models to free RAM, or raise `ram` if the machine has more "
                 "than it says")
    return "; ".join(steps)


# --- the job's measured peak ---------------------------------------------------------------------------------------
def resident_bytes() -> int | None:
    """This process's resident set now (Linux /proc/self/statm; psutil elsewhere), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        try:
            import psutil
            return int(psutil.Process().memory_info().rss)
        except ImportError:
            return None


class ResidentPeak:
    """The process's peak resident set while a job runs, sampled every `every` seconds on a thread of its own (the
    kernel's own high-water mark, VmHWM, is the process's lifetime peak: a ComfyUI server's earlier jobs would
    count). `start` is the resident set when it began, read after glibc's free heap went back to the system: pages
    an earlier job freed but the heap kept would otherwise serve this job's tensors without the resident set rising.
    `peak` is the largest seen. Samples can miss a spike shorter than `every`; `sample()` adds one where the caller
    knows a peak is (after placing the weights)."""

    def __init__(self, every: float = 0.05):
        trim_host_memory()
        self.every, self.start, self.peak = every, resident_bytes(), resident_bytes()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        now = resident_bytes()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now

    def __enter__(self) -> "ResidentPeak":
        if self.start is not None:
            self._thread = threading.Thread(target=self._run, name="leanlora-rss", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    @property
    def grown(self) -> int | None:
        """Bytes the peak rose above the job's start."""
        return None if self.start is None or self.peak is None else max(0, self.peak - self.start)

    def describe(self, estimate: HostRamEstimate | None, limit: int | None) -> str:
        if self.peak is None:
            return "host RAM of this job: not measured (no resident-set reading here)"
        return (f"host RAM of this job: peak {self.peak / GIB:.2f} GiB resident, {self.grown / GIB:.2f} GiB above its "
                "start" + (f"; estimated {estimate.total / GIB:.2f} GiB" if estimate is not None else "")
                + (f", limit {limit / GIB:.2f} GiB" if limit is not None else ""))
