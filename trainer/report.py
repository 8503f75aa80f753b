"""What a run decided and measured, as data (RunReport): the settings asked for and those it finished with, the
estimate, auto-fit's and compile's decisions, each out-of-memory recovery and the session's notes. train_lora
writes the report text from it; tests assert on it instead of on the text's wording."""
from __future__ import annotations

from dataclasses import dataclass, field

from .memory.estimate import MemoryEstimate
from .settings import MemorySettings


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
    before_step_one: list[str] = field(default_factory=list)  # auto-fit's and the compile step's decisions
    recoveries: list[Recovery] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the session's: fallbacks taken, techniques applied
    steps_done: int = 0
    cancelled: bool = False
    diverged_at: int | None = None
    seconds: float = 0.0  # the training steps' wall time (the estimate's probes excluded)
    validation_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), resumed ones too
