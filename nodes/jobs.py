"""One training job at a time per process, in a background thread. The ComfyUI node thread waits on it,
forwards its events to the progress bar and turns Cancel into `cancel()`; the job stops within one step."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from ..trainer.errors import LeanLoRAError


class Job:
    def __init__(self, target: Callable[["Job"], Any]):
        self.events: queue.Queue[dict] = queue.Queue()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        self._target = target
        self.thread = threading.Thread(target=self._run, name="leanlora-train", daemon=True)

    def emit(self, **event) -> None:
        self.events.put(event)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def drain(self) -> list[dict]:
        items = []
        while True:
            try:
                items.append(self.events.get_nowait())
            except queue.Empty:
                return items

    def _run(self) -> None:
        try:
            self.result = self._target(self)
        except BaseException as error:  # handed to the waiting node thread, never lost in this thread
            self.error = error
        finally:
            self.done.set()


class JobManager:
    def __init__(self):
        self._lock = threading.Lock()
        self._current: Job | None = None

    def start(self, target: Callable[[Job], Any]) -> Job:
        with self._lock:
            if self._current is not None and not self._current.done.is_set():
                raise LeanLoRAError("another LeanLoRA training is still running in this ComfyUI; "
                                    "wait for it or cancel it, then queue again")
            self._current = Job(target)
            self._current.thread.start()
            return self._current

    def cancelled(self) -> bool:
        """Whether the running job's Cancel was pressed (asked between sampler steps by its sample renderer)."""
        job = self._current
        return job is not None and job.cancelled


JOBS = JobManager()
