"""What compiling before step 1 and auto-fit's probes run through: the narrow interface the training session hands
down to step/compiled_blocks.py and memory/fit.py instead of itself (TrainingSession satisfies it; the planner's
tests hand a simulated one). Neither package imports the session."""
from __future__ import annotations

from typing import Protocol


class ProbeSteps(Protocol):
    """Throwaway steps on the largest bucket's batch, and the clean-up after one that ran out of memory."""

    def throwaway_step(self, batch) -> None:
        """Forward + backward with the run's precision and mechanisms; gradients discarded, the run's RNG stream
        untouched."""

    def largest_batch(self, batch_size: int = 1) -> tuple:
        """The largest sample, `batch_size` times (latent, conditioning): the biggest bucket sets the peak."""

    def run_batch_size(self, batch_size: int | None = None) -> int:
        """How many images the largest bucket's batches hold (the batch size, or the bucket where smaller)."""

    def free_failed_step(self, error: BaseException) -> None:
        """After a step that ran out of memory: its gradients and the memory its frames held go."""

