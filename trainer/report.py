"""What a run decided and measured, as data (RunReport): the settings asked for and those it finished with, the
estimate, auto-fit's and compile's decisions, each out-of-memory recovery and the session's notes. train_lora
writes the report text from it; tests assert on it instead of on the text's wording."""
from __future__ import annotations

from dataclasses import dataclass, field

from .device.allocator import backend as allocator_backend
from .memory.estimate import MemoryEstimate
from .memory.host_ram import HostRamEstimate
from .settings import MemorySettings
from .step.frozen_weights import fused_upcast_failure


@dataclass(frozen=True)
class Recovery:
    step: int  # the step that ran out of memory (or whose graph would not fit); repeated with the new settings
    rung: str  # what the memory ladder gave up for it (memory.ladder.next_rung's description)
    cause: str = "out of memory"  # or: the CUDA graph would not fit the card (micro_steps.GraphDoesNotFit)

    def describe(self) -> str:
        return f"step {self.step}: {self.cause} -> {self.rung}"


@dataclass
class RunReport:
    requested: MemorySettings  # as the MEMORY input gave them
    used: MemorySettings | None = None  # at the end: after device fallbacks, auto-fit and recoveries
    estimate: MemoryEstimate | None = None  # before step 1
    host_ram: HostRamEstimate | None = None  # before step 1: what the plan holds in host RAM (memory/host_ram.py)
    host_ram_limit: int | None = None  # the `ram` limit in bytes (None: unknown)
    # the job's measured resident set: its peak, and that peak above the job's start (None: not measured)
    host_ram_peak: int | None = None
    host_ram_grown: int | None = None
    before_step_one: list[str] = field(default_factory=list)  # auto-fit's and the compile step's decisions
    recoveries: list[Recovery] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the session's: fallbacks taken, techniques applied
    steps_done: int = 0
    cancelled: bool = False
    diverged_at: int | None = None
    seconds: float = 0.0  # the training steps' wall time (the estimate's probes excluded)
    validation_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), resumed ones too


def run_notes(session) -> list[str]:
    """The session's notes with what the step machinery adds at the end: the fast path's and compile's own notes,
    the fp8 upcast's fallback, and why compiled code ran uncompiled inside CUDA graphs."""
    micro_step, compiled = session.micro_step, session.compiled
    extra = (micro_step.notes if micro_step is not None else []) + (compiled.report() if compiled is not None else [])
    prefetch = getattr(micro_step, "prefetch", None)
    if prefetch is not None and prefetch.order:
        extra.append(f"streamed weights: {prefetch.fetched_ahead} of {len(prefetch.order)} copies of the latest "
                     "step fetched a layer ahead on a copy stream")
    upcast_failure = fused_upcast_failure()
    if upcast_failure and session.memory.base_weights.fp8:
        extra.append("fp8 weights: the fused upcast kernel could not be compiled here "
                     f"({upcast_failure}); upcasts run as two eager kernels (slower)")
    graphs = len(getattr(micro_step, "graphs", {}))
    if graphs:
        extra.append(f"fast path: steps replayed from {graphs} CUDA graph{'s' if graphs > 1 else ''} "
                     "(one per batch shape)")
        if getattr(micro_step, "pool_size", None) is not None:
            extra.append(f"fast path: {micro_step.pool_size.describe()}")
        compiled_parts = [what for what, used in (
            ("the compiled blocks", session.is_compiled),
            # (those of ResBlocks and transformer layers are multi-tensor kernels, the same either way)
            ("the fp8 upcasts outside ResBlocks and transformer layers", session.memory.base_weights.fp8)) if used]
        if compiled_parts and allocator_backend() == "cudaMallocAsync":
            extra.append(f"fast path: inside the CUDA graphs {' and '.join(compiled_parts)} run uncompiled: under "
                         "ComfyUI's default cudaMallocAsync allocator Triton kernels cannot be captured; start "
                         "ComfyUI with --disable-cuda-malloc to capture them compiled (faster)")
    return session.notes + [n for n in extra if n not in session.notes]
