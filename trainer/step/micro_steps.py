"""How one micro-step (forward + backward of one batch) is executed: eagerly, or replayed from a CUDA graph.

At batch 1 an eager step is bound by the host, not the GPU: ComfyUI's UNet makes thousands of Python-level layer
calls (each checking Cancel, casting weights, dispatching through autocast and peft), and the GPU finishes every
kernel before the next one is launched. A CUDA graph records the kernels of the whole forward + backward once per
batch shape and launches them with one call. Optimizer step, gradient clipping and loss scaling stay eager (a few
fused kernels), so every optimizer, bitsandbytes' included, works unchanged.

The graph reads its inputs from fixed tensors and adds its gradients into the parameters' existing `.grad`
tensors, so gradients are zeroed in place (never set to None) while graphs are in use. The first micro-step of
each shape runs eagerly as the warm-up that capture needs; its gradients are then put back and the new graph
replays that same micro-step at once.

ComfyUI runs PyTorch on the cudaMallocAsync backend by default. There, memory allocated during capture belongs to
the graph and exists only once the graph has been launched: freeing such memory before the first launch fails
inside a C++ destructor, which aborts the whole process (no Python exception). So nothing the step keeps is
allocated during capture (the loss goes into a buffer made before it), every graph is launched right after its
capture, and what a failed capture allocated is kept, never freed (`_never_free`). Triton kernels cannot run
in such a capture at all (`allocator.compiled_kernels_blocked`): compiled blocks and fp8 upcasts capture their
eager forms there."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import traceback
from typing import Callable, Protocol, runtime_checkable

import torch

from .activation_offload import ActivationOffload
from ..device.allocator import backend as allocator_backend, graph_memory_reserved, memory_limit, trim_graph_memory
from ..errors import is_out_of_memory, one_line
from .frozen_weights import host_launched_upcasts
from .precision import Precision
from .weight_prefetch import WeightPrefetch
from ..settings import FastPath
from ..device.vram import device_memory_bytes

# (inputs already on the device) -> scalar loss; all randomness is drawn before, on the CPU generator
ComputeLoss = Callable[[dict[str, torch.Tensor]], torch.Tensor]
# The fallback for the graph's pool before anything measured it (GraphPoolSize): no probe with allocator
# statistics and no capture yet. What a graphed run reserved beyond the eagerly probed estimate, from H200 runs
# (SD1.5/SDXL, 5 settings, under caps): peak allocated within 0.04 GiB of the estimate (the graph's pool replaces
# eager activations), peak reserved 0.13-0.20 GiB above it: the side stream's cuBLAS workspace (64 MiB; the
# estimate now counts it, see _side_stream), the pool's block rounding and a share of the activations. Uncapped,
# the allocator keeps more cached (up to +0.45 GiB), which a cap trims.
GRAPH_OVERHEAD = 160 * 2 ** 20
# ...and the pool's block rounding on top of the step's transient memory, in that fallback (issue 32's 12 GiB
# card: four recoveries at step 1 with 0.1 here and 0.25 at capture). A probe's measured rounding replaces it.
GRAPH_ACTIVATION_SHARE = 0.25
MAX_GRAPHS = 8  # one per batch shape (aspect-ratio buckets); more shapes than this run eagerly
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one per device: each new stream costs a cuBLAS workspace


class GraphPoolSize:
    """The CUDA graph's private memory pool, sized from the best number there is, as bytes per byte of the step's
    transient memory (what an eager step allocates above what stays: activations and workspace):
    - measured: the pool the latest capture took (`record_capture`: allocator-reserved bytes plus the driver's
      graph memory, before the capture and after its first launch) per byte of transient its warm-up measured;
    - modelled: the probe's own rounding (estimate.reserve_ratio: the full-size probe step's reserved growth per
      allocated byte), which the pool's blocks follow: one step's allocations, freed blocks reused; not under the
      fallback's share until a capture measured it (modelled_ratio);
    - fallback, before any probe or capture: the transient, GRAPH_ACTIVATION_SHARE of it and GRAPH_OVERHEAD.
    What capture demands (graph_pool_fits) and what auto-fit plans for (extra_memory) are this one number, else a
    plan that fits finds at step 1 that its graph does not. The session keeps it across rebuilds of the step (a
    recovery rung captures again with the ratio the last capture measured)."""

    def __init__(self):
        self.captured = 0  # bytes the captures into the current pool took (shapes share it: their growth summed)
        self.captured_transient = 0  # the largest transient their warm-ups measured
        self.reserve_ratio: float | None = None  # the latest probe's (MemoryEstimate.reserve_ratio)

    def record_capture(self, pool_bytes: int, transient: int, new_pool: bool) -> None:
        if new_pool:
            self.captured, self.captured_transient = 0, 0
        self.captured += max(0, pool_bytes)
        self.captured_transient = max(self.captured_transient, transient)

    def source(self) -> str:
        if self.captured and self.captured_transient:
            return "measured"
        return "modelled" if self.reserve_ratio else "fallback"

    def pool_bytes(self, transient: int) -> int:
        """The pool a step of `transient` bytes captures into."""
        source = self.source()
        if source == "measured":
            return transient * self.captured // self.captured_transient
        if source == "modelled":
            return int(transient * self.modelled_ratio())
        return int((1 + GRAPH_ACTIVATION_SHARE) * transient)

    def modelled_ratio(self) -> float:
        """The probe's rounding, but never under the fallback's share before a capture measured the pool: a pool
        planned too small fails its capture, and a failed capture costs the whole run its graphs (eager steps,
        several times slower; under cudaMallocAsync its memory too), where planning a quarter of the transient too
        much costs a few hundredths more streamed. No GPU has yet compared the probe's ratio with a capture (the
        CUDA test test_graph_pool's probe-vs-capture does); issue 32's 12 GiB card took four recoveries with 0.1."""
        return max(self.reserve_ratio, 1 + GRAPH_ACTIVATION_SHARE)

    def extra_memory(self, estimate) -> int:
        """Reserved bytes a graphed run needs beyond `estimate` (eagerly probed): its pool, less the transient
        memory the pool takes the place of; in the fallback GRAPH_OVERHEAD too. The estimate's probed rounding,
        where it has one, becomes the model."""
        if getattr(estimate, "reserve_ratio", None):
            self.reserve_ratio = estimate.reserve_ratio
        transient = (estimate.activations or 0) + (estimate.workspace or 0)
        extra = max(0, self.pool_bytes(transient) - transient)
        return extra + GRAPH_OVERHEAD if self.source() == "fallback" else extra

    def describe(self) -> str:
        """The report's words for the pool as it stands (after a capture: measured)."""
        if self.source() == "measured":
            return (f"CUDA graph pool: {self.captured / 2 ** 30:.2f} GiB measured at capture "
                    f"({self.captured / self.captured_transient:.2f}x the step's transient memory)")
        if self.source() == "modelled":
            return (f"CUDA graph pool: modelled from the probe, {self.modelled_ratio():.2f}x the step's transient "
                    f"memory (its rounding {self.reserve_ratio:.2f}x, at least {1 + GRAPH_ACTIVATION_SHARE:.2f}x until "
                    "a capture measures it)")
        return (f"CUDA graph pool: fallback, {1 + GRAPH_ACTIVATION_SHARE:.2f}x the step's transient memory + "
                f"{GRAPH_OVERHEAD / 2 ** 30:.2f} GiB (nothing measured it)")


def pool_reading(device: torch.device) -> dict[str, int] | None:
    """What a capture's pool is measured from: the allocator's bytes (device_memory_bytes) and the driver's graph
    memory (`graph`: where cudaMallocAsync's captured allocations live). None without allocator statistics."""
    reading = device_memory_bytes(device)
    return None if reading is None else {**reading, "graph": graph_memory_reserved(device)}


def captured_pool_bytes(before: dict[str, int], after: dict[str, int]) -> int:
    """The bytes a capture took between two pool_readings: the growth of what the allocator reserves (the native
    allocator's private pool) and of the driver's graph memory (cudaMallocAsync, after the first launch)."""
    return max(0, after["reserved"] - before["reserved"]) + max(0, after.get("graph", 0) - before.get("graph", 0))


class GraphDoesNotFit(torch.OutOfMemoryError):
    """Under auto-fit, the first graph's private pool (its size measured by the eager warm-up) would not fit the
    card. Raised instead of going on eagerly: at batch 1 losing CUDA graphs costs more speed (4-6x) than any rung
    of the memory ladder, so the session takes the next rung and repeats the step, like after an out-of-memory
    error (session.recover); only at the bottom of the ladder do the steps run eagerly. Seen on the H200: SDXL
    auto-fit 12 GiB planned 20% checkpointing with its graph, whose pool then did not fit, and ran eager steps of
    0.52-0.60 s where the 8 GiB card's full checkpointing runs graphed at 0.117. `shortfall`: the bytes missing,
    what the recovery's finer rung sizes from (fit.recover)."""

    def __init__(self, why: str, shortfall: int = 0):
        super().__init__(why)
        self.shortfall = shortfall


def _never_free(*objects) -> None:
    """What a failed capture allocated under cudaMallocAsync: its graph was never launched, so freeing it would
    abort the process (module docstring), at exit too. One extra reference that nothing drops keeps it; bounded,
    since a failed capture turns graphs off for the run."""
    for item in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(item))


def _give_back_failed_capture_pool(device: torch.device, graph: torch.cuda.CUDAGraph, pool) -> None:
    """What a capture that CUDA itself ended with an error leaves in PyTorch's native allocator: a CUDAGraph
    releases its private memory pool only after a capture that ended well, and newer PyTorch stops routing
    allocations to the pool only then too. SD1.5 auto-fit 2 GiB in a ComfyUI server (H200, --disable-cuda-malloc):
    after the failed capture 1.36 GiB stayed reserved beside 0.36 allocated, and ComfyUI's VAE decode after the
    Train node ran out of memory on the 2 GiB card. Ends the pool's recording (already ended on older PyTorch)
    and drops the capture's claim on it, so that empty_cache() can return its memory once the capture's tensors
    are gone. A capture that ended well (the error was raised in Python) is the graph's to release: a second
    release would fail inside its destructor, which aborts the process.

    Only on PyTorch whose CUDAGraph has `instantiate` (the keep_graph era): there `pool()` and the destructor's
    release test the same flag (capture_ended_). Before it, `pool()` tests "instantiated" while the destructor
    releases once the capture itself ended, so a failed cudaGraphInstantiate (out of memory on a small card)
    would be released twice; those versions keep the leak instead."""
    if not hasattr(torch.cuda.CUDAGraph, "instantiate"):
        return
    try:
        graph.pool()  # raises unless the capture ended well
        return
    except RuntimeError:
        pass
    index = device.index if device.index is not None else torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        step = getattr(torch._C, name, None)
        if step is None:
            continue
        try:
            step(index, pool)
        except RuntimeError:  # "not currently recording": this PyTorch ended it in capture_end already
            pass


def _end_random_generator_capture(device: torch.device, stream: torch.cuda.Stream) -> bool:
    """A capture that CUDA ended with an error leaves the GPU's default random generator in capture mode (PyTorch
    ends it only after a capture that ended well): every later random draw on that GPU in the process, ComfyUI's
    GPU noise included, fails with "Offset increment outside graph capture encountered unexpectedly" (H200, torch
    2.11). A small capture that ends well ends it. False where that capture is refused too (cudaMallocAsync may
    still count the failed capture as under way)."""
    try:
        torch.empty(1, device=device).uniform_()
        return True  # the generator is fine: the capture failed in Python, and torch.cuda.graph ended it
    except RuntimeError as error:
        if "outside graph capture" not in str(error):
            raise
    target = torch.zeros(1, device=device)  # made before the capture: never the graph's memory
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            target.add_(1)  # allocates nothing: the graph may go without ever being launched
        return True
    except RuntimeError:
        return False


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        stream = torch.cuda.Stream(device)
        # cuBLAS allocates a workspace per stream on first use and keeps it: allocate it now, before the memory
        # estimate's probes, so the estimate counts it (under "other") instead of the run finding it later.
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16):
                square = torch.ones(16, 16, device=device, dtype=dtype)
                square @ square
        stream.synchronize()
        _SIDE_STREAMS[device] = stream
    return _SIDE_STREAMS[device]


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream):
    """Work on `stream`, ordered after what the current stream queued before and before what it queues after."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


def _pin_gradient_accumulators(params: list[torch.nn.Parameter], stream: torch.cuda.Stream) -> list:
    """Each parameter's AccumulateGrad node, made on `stream` and kept for as long as the step lives.
    Autograd makes that node when a parameter first enters a graph, on the stream current then, and reuses it while
    any graph holding it lives. One made on the default stream by an eager step (an auto-fit probe whose graph an
    out-of-memory traceback kept alive) makes a captured backward sync the legacy stream with the capturing one:
    CUDA invalidates the capture (cudaErrorStreamCaptureImplicit, SD1.5 auto-fit 2 GiB in a ComfyUI server, H200,
    2 Dec 2026). Made here first, every graph of these parameters accumulates on the capture's stream."""
    with torch.enable_grad(), torch.cuda.stream(stream):
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in params if p.requires_grad]


def graph_pool_fits(held: int, transient: int, limit: int | None, pool: GraphPoolSize | None = None) -> bool:
    """Whether a graph's private memory pool, which holds the step's transient memory (the peak seen above what
    was held), fits under the limit next to `held`: what stays reserved once the eager warm-up's cached blocks
    are released (what is allocated, plus fragments the allocator cannot give back). Counting the warm-up's
    cached blocks counted the activations twice (campaign 7: auto-fit under 4 GiB planned 3.54 GiB with the
    graph, and then ran eagerly, 9x slower). The pool is sized as auto-fit planned it (GraphPoolSize)."""
    return graph_pool_shortfall(held, transient, limit, pool) == 0


def graph_pool_shortfall(held: int, transient: int, limit: int | None, pool: GraphPoolSize | None = None) -> int:
    """The bytes by which the graph's pool would overrun the limit next to `held` (graph_pool_fits); 0 where it
    fits or nothing limits it."""
    if limit is None:
        return 0
    return max(0, held + (pool or GraphPoolSize()).pool_bytes(transient) - limit)


class EagerMicroStep:
    """The plain step: autocast forward, (scaled) backward. Also the fallback of every faster path."""

    graphed = False
    budget: int | None = None  # bytes the run may hold (auto-fit); only a graphed step needs it

    def __init__(self, compute_loss: ComputeLoss, precision: Precision, offload: ActivationOffload | None = None,
                 prefetch: WeightPrefetch | None = None):
        self.compute_loss, self.precision, self.offload, self.prefetch = compute_loss, precision, offload, prefetch
        self.notes: list[str] = []

    def forward_backward(self, inputs: dict[str, torch.Tensor], accumulation: int, record: bool = False) -> torch.Tensor:
        saving = self.offload.saving(record) if self.offload else contextlib.nullcontext()
        # around backward too: checkpointing's recompute streams the weights again
        prefetching = self.prefetch.active() if self.prefetch else contextlib.nullcontext()
        with prefetching:
            # Autocast's weight-cast cache must be off under capture: its cached copies would outlive the graph.
            with self.precision.autocast(cache_enabled=not self.graphed), saving:
                loss = self.compute_loss(inputs) / accumulation
            try:
                self.precision.backward(loss)
            finally:  # also when backward fails: capture needs the copy stream joined, recovery the fetched memory
                if self.offload:
                    self.offload.finish()
        return loss.detach()

    def __call__(self, inputs: dict[str, torch.Tensor], accumulation: int) -> torch.Tensor:
        return self.eager_step(inputs, accumulation)

    def eager_step(self, inputs: dict[str, torch.Tensor], accumulation: int) -> torch.Tensor:
        """A micro-step that no capture follows (the host launches every kernel)."""
        with host_launched_upcasts():
            return self.forward_backward(inputs, accumulation)

    def throwaway(self, inputs: dict[str, torch.Tensor]) -> None:
        """A forward + backward outside training (the estimate's probes, the compile step); the caller clears the
        gradients."""
        self.forward_backward(inputs, 1)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)  # gradients need no memory between steps

    def extra_memory(self, estimate) -> int:
        """Bytes this way of stepping needs beyond the (eagerly probed) memory estimate."""
        return 0

    def run_eagerly(self, note: str) -> None:
        """From now on every step is eager (here they are already); the note goes into the report."""
        self.notes.append(note)

    def forget_graphs(self) -> None:
        """Before the frozen weights move (they wait in CPU RAM while ComfyUI samples): graphs replay fixed
        addresses, so they are dropped with their pool and captured again at the next step. Eager: nothing."""


class GraphedMicroStep(EagerMicroStep):
    """Replays a captured forward + backward per batch shape. Capture failures fall back to eager steps and say
    why in `notes`; out-of-memory and Cancel propagate like in an eager step."""

    graphed = True

    def __init__(self, compute_loss: ComputeLoss, precision: Precision, params: list[torch.nn.Parameter],
                 passthrough_errors: tuple[type[BaseException], ...] = (), offload: ActivationOffload | None = None,
                 prefetch: WeightPrefetch | None = None, pool_size: GraphPoolSize | None = None):
        super().__init__(compute_loss, precision, offload, prefetch)
        self.pool_size = pool_size if pool_size is not None else GraphPoolSize()
        side = _side_stream(torch.cuda.current_stream().device)  # its cuBLAS workspace exists before the estimate
        self.params = params
        self.accumulators = _pin_gradient_accumulators(params, side)
        self.passthrough_errors = passthrough_errors  # Cancel: re-raised, never a reason to give up on graphs
        # shape key -> (graph, its input tensors, its loss tensor, host buffers its offload copies use)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor, list]] = {}
        self.pool = None  # graphs of different shapes share one memory pool (they never run at the same time)
        self.grads: list[torch.Tensor] | None = None  # the tensors the graphs add into
        self.disabled: str | None = None
        self.eager_keys: set[tuple] = set()  # batch shapes whose graph would not fit next to the others

    @staticmethod
    def key(inputs: dict[str, torch.Tensor], accumulation: int) -> tuple:
        return (accumulation, *((name, tuple(t.shape), t.dtype) for name, t in sorted(inputs.items())))

    def __call__(self, inputs: dict[str, torch.Tensor], accumulation: int) -> torch.Tensor:
        if self.disabled:
            # eager steps run on the default stream: accumulators there, so that backward needs no stream syncs
            self.accumulators.clear()
            return self.eager_step(inputs, accumulation)
        self._attach_grads()
        key = self.key(inputs, accumulation)
        if key in self.eager_keys:
            return self.eager_step(inputs, accumulation)
        entry = self.graphs.get(key)
        if entry is None:
            return self._warm_up_and_capture(key, inputs, accumulation)
        graph, static_inputs, static_loss, _ = entry
        for name, tensor in inputs.items():
            static_inputs[name].copy_(tensor, non_blocking=True)
        graph.replay()
        return static_loss.clone()  # the next replay overwrites static_loss

    def throwaway(self, inputs: dict[str, torch.Tensor]) -> None:
        """On the capture's stream, as the warm-up: an autograd graph these steps leave alive (an out-of-memory
        error's traceback holds one) then holds no accumulator of another stream's (see _pin_gradient_accumulators)."""
        with _on_stream(_side_stream(torch.cuda.current_stream().device)):
            super().throwaway(inputs)

    def extra_memory(self, estimate) -> int:
        """Reserved bytes a graphed run needs beyond the estimate: what its private pool takes beyond the eager
        step's transient memory, which it replaces (GraphPoolSize: measured, modelled or the fallback)."""
        if self.disabled:
            return 0
        return self.pool_size.extra_memory(estimate)

    def run_eagerly(self, note: str) -> None:
        self.disabled = "memory limit"
        super().run_eagerly(note)

    def forget_graphs(self) -> None:
        if not self.graphs:
            return
        self.graphs.clear()
        self.pool = None
        self.eager_keys.clear()
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        trim_graph_memory(torch.cuda.current_stream().device)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.disabled or self.grads is None:
            return super().zero_grad(optimizer)
        optimizer.zero_grad(set_to_none=False)
        self._attach_grads()

    def _attach_grads(self) -> None:
        """Gradients the graphs write into must stay the same tensors; anything that reset them to None (an
        optimizer's zero_grad elsewhere) gets them back, zeroed."""
        if self.grads is None:
            return
        for param, grad in zip(self.params, self.grads):
            if param.grad is not grad:
                if param.grad is None:
                    grad.zero_()
                else:
                    grad.copy_(param.grad)
                param.grad = grad

    def _warm_up_and_capture(self, key: tuple, inputs: dict[str, torch.Tensor], accumulation: int) -> torch.Tensor:
        # The real micro-step, on a side stream as capture requires for warm-up (lazy cuBLAS/cuDNN setup).
        device = torch.cuda.current_stream().device
        side = _side_stream(device)  # warm-up and capture share it: each stream costs a cuBLAS workspace
        capturing = len(self.graphs) < MAX_GRAPHS  # more shapes than that stay eager
        # The gradients before this micro-step (on the host: no device memory), put back before the new graph
        # replays the micro-step; None where a parameter had none.
        before_step = [None if p.grad is None else p.grad.to("cpu") for p in self.params] if capturing else None
        before = device_memory_bytes(device)
        with _on_stream(side):
            loss = self.forward_backward(inputs, accumulation, record=True)
        if not capturing:
            return loss
        after = device_memory_bytes(device)
        # unknown (0) without allocator statistics
        transient = after["peak_allocated"] - before["allocated"] if before and after else 0
        if self.grads is None:
            # Backward must add into existing tensors: with .grad None a captured backward would hand the
            # parameters fresh tensors from the graph's private pool.
            for param in self.params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
            self.grads = [param.grad for param in self.params]
        static_inputs = {name: tensor.clone() for name, tensor in inputs.items()}
        static_loss = torch.zeros((), device=device, dtype=loss.dtype)  # made before capture: never the graph's
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()  # blocks cached by the eager warm-up cannot serve the graph's private pool
        limit, now = memory_limit(device, self.budget), pool_reading(device)
        shortfall = graph_pool_shortfall(now["reserved"], transient, limit, self.pool_size) if now else 0
        if shortfall:
            pool_bytes = self.pool_size.pool_bytes(transient)
            why = (f"the graph's own memory pool (~{pool_bytes / 2 ** 30:.2f} GiB, {self.pool_size.source()}) "
                   f"does not fit the {limit / 2 ** 30:.2f} GiB limit")
            note = f"fast path: CUDA graphs skipped: {why}; "
            if self.graphs:  # the shapes already captured keep their graphs
                self.eager_keys.add(key)
                self.notes.append(note + "this batch shape runs eagerly")
            elif self.budget is not None:  # auto-fit: a rung down with graphs beats eager steps
                raise GraphDoesNotFit(why, shortfall)
            else:
                self.disabled = "memory limit"
                self.notes.append(note + "steps run eagerly")
            return loss
        graph = torch.cuda.CUDAGraph()
        # the pool named here, not left to the graph: a failed capture's pool must be given back by its id
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        host_buffers: list = []
        # thread_local: training runs in its own thread; CUDA calls ComfyUI's other threads might make during the
        # capture must neither break it nor fail themselves.
        try:
            with self.offload.capturing() if self.offload else contextlib.nullcontext([]) as host_buffers, \
                    torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                captured_loss = self.forward_backward(static_inputs, accumulation)
                static_loss.copy_(captured_loss)
                del captured_loss  # freed inside the capture: the graph frees it on every replay
        except self.passthrough_errors:
            raise
        except Exception as error:
            # Capture records kernels without running them, so the gradients of the eager step above are intact.
            # Out of memory here means the graph's pool does not fit next to what is already held: eager steps
            # need no extra pool, so they go on (and OOM recovery still handles a real shortage later).
            self.disabled = one_line(error, 300)
            # the console keeps where the capture broke (the report has one line), as text: a log record holding
            # the traceback would pin the capture's tensors
            logging.getLogger(__name__).warning("LeanLoRA: CUDA graph capture failed; steps run eagerly\n%s",
                                                traceback.format_exc(limit=-12))
            why = "it needs more memory than is left" if is_out_of_memory(error) else self.disabled
            self.notes.append(f"fast path: CUDA graph capture failed ({why}); steps run eagerly")
            if allocator_backend() == "cudaMallocAsync":
                _never_free(error, graph, host_buffers)  # the error's frames hold the capture's tensors
            elif self.pool is None:  # a pool of its own: no other graph's claim can be dropped by mistake
                _give_back_failed_capture_pool(device, graph, pool)
            if not _end_random_generator_capture(device, side):
                self.notes.append("fast path: after the failed capture PyTorch keeps this GPU's random generator in "
                                  "capture mode: samplers that draw noise on the GPU fail until ComfyUI restarts")
        if self.disabled:  # outside the except block: the error's traceback no longer pins the capture's tensors
            del graph, host_buffers
            self.graphs.clear()
            self.pool = None
            gc.collect()
            torch.cuda.empty_cache()
            return loss
        new_pool = self.pool is None
        if new_pool:
            self.pool = pool
        self.graphs[key] = (graph, static_inputs, static_loss, host_buffers)
        # Launch the graph now, as this micro-step: from here on whatever it allocated exists and may be freed.
        for param, grad, kept in zip(self.params, self.grads, before_step):
            if kept is None:
                grad.zero_()
            else:
                grad.copy_(kept, non_blocking=False)
        graph.replay()
        if now:  # what the capture took, once launched (cudaMallocAsync maps graph memory at the first launch)
            torch.cuda.synchronize(device)
            taken = pool_reading(device)
            if taken:
                self.pool_size.record_capture(captured_pool_bytes(now, taken), transient, new_pool)
        return static_loss.clone()


@runtime_checkable
class MicroStep(Protocol):
    """What the training loop steps with: (batch, accumulation) -> forward + backward, the detached loss; it also
    zeroes the gradients its own way (BatchStep, EagerMicroStep and GraphedMicroStep are such steps)."""

    def __call__(self, batch, accumulation: int) -> torch.Tensor: ...
    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...


class BatchStep:
    """What the training loop calls: batch -> device inputs with their random draws -> micro-step."""

    def __init__(self, prepare: Callable[[object], dict[str, torch.Tensor]], micro_step: EagerMicroStep):
        self.prepare, self.micro_step = prepare, micro_step

    def __call__(self, batch, accumulation: int) -> torch.Tensor:
        return self.micro_step(self.prepare(batch), accumulation)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.micro_step.zero_grad(optimizer)


def build_micro_step(fast_path: FastPath, compute_loss: ComputeLoss, precision: Precision,
                     params: list[torch.nn.Parameter], device: torch.device,
                     passthrough_errors: tuple[type[BaseException], ...] = (),
                     incompatible: str | None = None,
                     offload: ActivationOffload | None = None,
                     prefetch: WeightPrefetch | None = None,
                     pool_size: GraphPoolSize | None = None) -> tuple[EagerMicroStep, str | None]:
    """The micro-step for `fast_path`, with a note when it cannot be honoured here. `pool_size`: the graph pool's
    size as an earlier step of the run measured it (kept across rebuilds)."""
    if fast_path is FastPath.OFF:
        return EagerMicroStep(compute_loss, precision, offload, prefetch), None
    if device.type != "cuda":
        return EagerMicroStep(compute_loss, precision, offload, prefetch), \
            f"fast path: CUDA graphs need an NVIDIA GPU; steps run normally on {device.type}"
    if incompatible:
        return EagerMicroStep(compute_loss, precision, offload, prefetch), \
            f"fast path: CUDA graphs off because {incompatible}"
    return GraphedMicroStep(compute_loss, precision, params, passthrough_errors, offload, prefetch, pool_size), None


def graphs_incompatible(random_forward: bool) -> str | None:
    """Why this run's steps cannot be CUDA graphs, None when they can. Streamed weights are graphed under both
    allocators: the streamed capture that aborted a ComfyUI server under cudaMallocAsync (SD1.5 auto-fit 2 GiB)
    was broken by a gradient accumulator an auto-fit probe left on the default stream (see
    micro_steps._pin_gradient_accumulators), not by streaming."""
    if random_forward:
        return "the model's dropout draws random numbers inside the step"
    return None
