"""Memory Settings' `gpus`: the Train node's run on several GPUs of this machine (issue 43 item 3).

The server process is rank 0 on its own GPU: it trains with the node's MODEL, renders the samples, saves, and sends
the progress, as for one GPU. Each other GPU gets a worker process that runs the headless path (`python -m leanlora
train CONFIG`, leanlora/cli.py) with the config of the same workflow (leanlora/config.from_workflow: the same
loaders' files, the same settings), loading the model with ComfyUI's own loaders, as torchrun's ranks do
(trainer/distributed.py). The server joins the process group once every worker has loaded its model and says it is
joining (a file; a worker that dies before fails the run with its log's tail, and never leaves rank 0 waiting). A
worker that dies during training fails the job with its log's tail; a Cancel is the ranks' agreed stop.

For tests on a machine without GPUs, LEANLORA_CPU_WORKERS=N makes this machine count as N devices that are CPU
processes (gloo): 'all N GPUs' then means the server and N-1 CPU workers. Nothing else changes."""
from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from ..trainer.distributed import READY_FILE_ENV
from ..trainer.errors import LeanLoRAError, TrainingCancelled
from ..trainer.settings import THIS_GPU

CPU_WORKERS_ENV = "LEANLORA_CPU_WORKERS"
PACK_DIR = Path(__file__).resolve().parents[1]
LOG_TAIL_LINES = 30
STOPPED_EXIT = 130  # a worker whose run stopped (the agreed Cancel) exits with leanlora/cli.py's STOPPED
EXIT_WAIT_S = 120.0  # after rank 0's run: how long a worker may take to free its model and exit before it is ended
WATCH_EVERY_S = 0.2
TRAINING_THREAD = "leanlora-train"  # nodes/jobs.py's thread of a training job
SUBSETS_UP_TO = 4  # up to this many GPUs every list with this GPU is a choice; above, pairs and leading runs


def _cpu_workers() -> int | None:
    raw = os.environ.get(CPU_WORKERS_ENV)
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise LeanLoRAError(f"{CPU_WORKERS_ENV} is {raw!r}: a number of CPU processes (1 or more), for tests")
    return int(raw)


def _server_device():
    """The device ComfyUI trains on in this process (torch's CPU where ComfyUI is not imported: unit tests)."""
    try:
        import comfy.model_management
        return comfy.model_management.get_torch_device()
    except ImportError:
        import torch
        return torch.device("cpu")


def machine_devices() -> list[str]:
    """The devices `gpus` chooses from, by index: CUDA's as this process sees them when ComfyUI trains on CUDA;
    with LEANLORA_CPU_WORKERS=N, N CPU processes. Fewer than two: the choice is not offered."""
    cpu = _cpu_workers()
    if cpu is not None:
        return [f"CPU process {index}" for index in range(cpu)]
    device = _server_device()
    if getattr(device, "type", None) != "cuda":
        return []
    import torch
    return [f"cuda:{index} ({torch.cuda.get_device_name(index)})" for index in range(torch.cuda.device_count())]


def own_index() -> int:
    """The index of the server's own device among machine_devices(): rank 0's."""
    if _cpu_workers() is not None:
        return 0
    device = _server_device()
    if device.index is not None:
        return device.index
    import torch
    return torch.cuda.current_device()


def all_label(count: int) -> str:
    return f"all {count} GPUs"


def gpu_choices() -> list[str]:
    """Memory Settings' gpus list: 'this GPU' alone on a machine of one GPU (a stable input for saved workflows);
    else also 'all N GPUs' and lists of CUDA indices that hold this server's GPU."""
    count = len(machine_devices())
    if count < 2:
        return [THIS_GPU]
    own, others = own_index(), [index for index in range(count) if index != own_index()]
    if count <= SUBSETS_UP_TO:
        groups = [group for size in range(1, count - 1) for group in itertools.combinations(others, size)]
    else:
        groups = [(other,) for other in others] + [tuple(others[:size]) for size in range(2, count - 1)]
    lists = [",".join(map(str, sorted({own, *group}))) for group in groups]
    return [THIS_GPU, all_label(count), *dict.fromkeys(lists)]


def chosen_devices(choice: str) -> list[int] | None:
    """`gpus` as the device indices of a data-parallel run (rank 0, the server's own, first); None for one GPU.
    Refused clearly: an index this machine does not have (naming those it has), a list without the server's GPU."""
    if choice in (None, "", THIS_GPU):
        return None
    devices = machine_devices()
    have = ", ".join(f"{index}: {name}" for index, name in enumerate(devices)) or "no CUDA GPU ComfyUI trains on"
    text = str(choice).strip()
    if text == "all" or (text.startswith("all ") and text.endswith(" GPUs")):
        if len(devices) < 2:
            raise LeanLoRAError(f"gpus: {choice!r}, but this machine has {len(devices)} device(s) to train on "
                                f"({have}); set gpus to {THIS_GPU!r}")
        if text != "all" and text != all_label(len(devices)):
            raise LeanLoRAError(f"gpus: {choice!r}, but this machine has {len(devices)} GPUs ({have}): choose "
                                f"{all_label(len(devices))!r}")
        indices = list(range(len(devices)))
    else:
        parts = [part.strip() for part in text.split(",")]
        if not all(part.isdigit() for part in parts):
            raise LeanLoRAError(f"gpus: {choice!r} is not {THIS_GPU!r}, 'all N GPUs' or a list of CUDA indices such "
                                f"as 0,1 (this machine: {have})")
        indices = [int(part) for part in parts]
        unknown = [index for index in indices if index >= len(devices)]
        if unknown:
            raise LeanLoRAError(f"gpus: GPU {', '.join(map(str, unknown))} is not on this machine; it has {have}")
        if len(set(indices)) != len(indices):
            raise LeanLoRAError(f"gpus: {choice!r} names a GPU twice; each GPU runs one process")
    own = own_index()
    if own not in indices:
        raise LeanLoRAError(f"gpus: {choice!r} leaves out this server's GPU ({own}: {devices[own]}), which trains "
                            f"as rank 0 with the node's model: add {own} to the list")
    if len(indices) == 1:
        return None
    return [own, *(index for index in indices if index != own)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _forwarded_arguments(cpu: bool) -> list[str]:
    """This server's ComfyUI arguments for a worker (its folders, extra model paths, precision flags), without
    --cuda-device (each worker is given its GPU) and with --cpu for CPU workers."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--cuda-device":
            skip = True
            continue
        if arg.startswith("--cuda-device="):
            continue
        args.append(arg)
    try:  # a wrapper's own flags in sys.argv (a launcher script running main.py) are no ComfyUI argument
        import comfy.cli_args
        _, unknown = comfy.cli_args.parser.parse_known_args(args)
        for token in unknown:
            args.remove(token)
    except (ImportError, AttributeError, SystemExit):
        pass
    if cpu and "--cpu" not in args:
        args.append("--cpu")
    return args


def _worker_config(prompt: dict, node_id: str) -> dict:
    """The run's config, as `config-from-workflow` writes it from the queued prompt; refused where a model part
    comes from a node whose output a config cannot name (a merge, a LoRA loader...), before any work."""
    from ..leanlora import config  # the headless config (imports the nodes under the headless runner's name)
    from ..leanlora.library import ConfigError
    problems, prompt = [], copy.deepcopy(prompt)
    memory = prompt.get(node_id, {}).get("inputs", {}).get("memory")
    if isinstance(memory, list) and str(memory[0]) in prompt:  # each worker is one rank of this run
        prompt[str(memory[0])]["inputs"]["gpus"] = THIS_GPU
    try:
        values = config.from_workflow(prompt, node_id, warn=problems.append)
    except ConfigError as error:
        raise LeanLoRAError(f"gpus: the worker processes take this run's settings from the workflow, which "
                            f"failed: {error}; set gpus to {THIS_GPU!r}") from error
    if problems:
        raise LeanLoRAError(
            "gpus: the worker processes load the model from files, with ComfyUI's loaders (Load Checkpoint, Load "
            "Diffusion Model, Load CLIP, DualCLIPLoader, Load VAE), and " + "; ".join(
                problem.removeprefix("warning: ").split(", which")[0] for problem in problems)
            + ", which they cannot load. Connect Train's model, clip and vae to those loaders directly (merge or "
            f"add LoRAs into a file first), or set gpus to {THIS_GPU!r}")
    return values


def _die_with_server() -> None:
    """In a worker before it starts (Linux): killed when the server's thread that started it ends (the server
    stopped or died), instead of waiting in a collective for a rank 0 that is gone."""
    import ctypes
    import signal
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(an empty log)"


class Workers:
    """The worker processes of one run (ranks 1..N-1), started before rank 0's job."""

    def __init__(self, devices: list[int], values: dict, cpu: bool):
        from ..leanlora import config
        self.devices, self.cpu, self.world = devices, cpu, len(devices)
        self.folder = Path(tempfile.mkdtemp(prefix="leanlora_workers_"))
        self.config = self.folder / "config.toml"
        self.config.write_text(config.to_toml(values, comments=False), encoding="utf-8")
        self.port = _free_port()
        self.processes: list[subprocess.Popen] = []
        self.failure: str | None = None  # why a worker failed the run (with its log's tail)

    @classmethod
    def for_run(cls, gpus: str, prompt: dict | None, node_id: str | None) -> Workers | None:
        """None for one GPU; else the run's workers, started (refusals come first, before any work)."""
        devices = chosen_devices(gpus)
        if devices is None:
            return None
        if int(os.environ.get("WORLD_SIZE") or 1) > 1:
            raise LeanLoRAError(f"gpus: {gpus!r} under a launcher (WORLD_SIZE is {os.environ['WORLD_SIZE']}), which "
                                f"gives the processes already: set gpus to {THIS_GPU!r}")
        if prompt is None or node_id is None:
            raise LeanLoRAError(f"gpus: {gpus!r} is for the Train node in ComfyUI's server; from the command line "
                                "launch `torchrun --nproc_per_node N -m leanlora train CONFIG` (docs/HEADLESS.md)")
        workers = cls(devices, _worker_config(prompt, str(node_id)), _cpu_workers() is not None)
        try:
            workers.start()
        except BaseException:
            workers.end(at_once=True)
            raise
        return workers

    def launcher_env(self, rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)}

    def _ready_file(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.joining"

    def _log(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.log"

    def describe(self, rank: int) -> str:
        device = f"CPU process {self.devices[rank]}" if self.cpu else f"cuda:{self.devices[rank]}"
        process = self.processes[rank - 1] if rank - 1 < len(self.processes) else None
        return f"worker rank {rank} ({device}{f', pid {process.pid}' if process else ''})"

    def start(self) -> None:
        import folder_paths
        comfyui = Path(folder_paths.__file__).resolve().parent
        command = [sys.executable, str(PACK_DIR / "leanlora"), "train", str(self.config), "--comfyui", str(comfyui),
                   "--comfyui-args", shlex.join(_forwarded_arguments(self.cpu))]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",") if visible else None
        for rank in range(1, self.world):
            env = {**os.environ, **self.launcher_env(rank), READY_FILE_ENV: str(self._ready_file(rank)),
                   "PYTHONUNBUFFERED": "1"}
            env.pop(CPU_WORKERS_ENV, None)
            if not self.cpu:  # the worker sees its GPU alone (as torchrun's ranks, leanlora/cli.py)
                index = self.devices[rank]
                env["CUDA_VISIBLE_DEVICES"] = physical[index] if physical else str(index)
            with open(self._log(rank), "wb") as log:
                self.processes.append(subprocess.Popen(command, cwd=os.getcwd(), env=env, stdout=log,
                                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                       preexec_fn=_die_with_server if sys.platform == "linux"
                                                       else None))
            logging.info("LeanLoRA: %s started, log %s", self.describe(rank), self._log(rank))

    def _dead(self) -> str | None:
        """The first worker that ended with an error, described with its log's tail."""
        for rank, process in enumerate(self.processes, start=1):
            code = process.poll()
            if code is not None and code not in (0, STOPPED_EXIT):
                return (f"{self.describe(rank)} ended with exit code {code}; its log ({self._log(rank)}) ends:\n"
                        f"{_tail(self._log(rank))}")
        return None

    def join(self, cancelled: Callable[[], bool]) -> dict[str, str]:
        """In rank 0's job, before train_lora: waits (interruptibly) until every worker has loaded its model and is
        joining, then returns rank 0's launcher variables. A worker that died fails the run; a Cancel ends them."""
        while not all(self._ready_file(rank).exists() for rank in range(1, self.world)):
            problem = self._dead()
            if problem is not None:
                self.failure = f"before training, {problem}"
                raise LeanLoRAError(self.failure)
            if cancelled():
                self.end(at_once=True)
                raise TrainingCancelled("cancelled while the worker processes loaded the model; nothing was trained")
            time.sleep(WATCH_EVERY_S)
        if not self.cpu:  # NCCL's watchdog on an error: abort the communicators, never end the ComfyUI server (its
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # default tears the process down)
        return self.launcher_env(0)

    def failed(self, error: BaseException, wait_s: float = 5.0) -> str | None:
        """Where rank 0's run ended with `error`: the failed run's message if a worker died (rank 0's collective
        may fail before the watcher sees the death: it is looked for a while), else None."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline and not isinstance(
                error, (TrainingCancelled, KeyboardInterrupt)):
            self.failure = self._dead()
            if self.failure is None:
                time.sleep(WATCH_EVERY_S)
        if self.failure is None:
            return None
        echo = str(error) if str(error) and str(error) not in self.failure else ""
        return (f"LeanLoRA's run on {self.world} processes failed: {self.failure}"
                + (f"\nrank 0 (this server): {echo}" if echo else ""))

    def watch(self, job) -> None:
        """A thread for the run: a worker that dies fails it (Cancel on rank 0: the ranks' agreed stop ends the
        steps; a collective with the dead worker then fails, or is aborted on NCCL, where it could wait)."""
        def run():
            while not job.done.wait(WATCH_EVERY_S):
                problem = self._dead()
                if problem is not None and self.failure is None:
                    self.failure = problem
                    logging.error("LeanLoRA: %s", problem)
                    job.cancel()
                    _abort_collectives()
                    return
        threading.Thread(target=run, name="leanlora-workers", daemon=True).start()

    def end(self, at_once: bool = False) -> None:
        """Every worker gone: after rank 0's run they exit by themselves (given EXIT_WAIT_S), else are ended."""
        deadline = time.monotonic() + (0 if at_once else EXIT_WAIT_S)
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()  # SIGTERM: leanlora/cli.py's stop, then its exit
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

    def finish(self, job) -> None:
        """After rank 0's run (job done, or given up): the process group left, the workers ended, their files
        removed unless a worker failed (its log is named in the error)."""
        from ..trainer.distributed import leave
        if job is None or job.done.is_set():
            try:
                leave()
            except Exception as error:  # noqa: BLE001 - the group of a failed run: the next run makes a new one
                logging.warning("LeanLoRA: leaving the workers' process group: %s", error)
        self.end(at_once=job is None)
        problem = self._dead()
        if problem is not None and self.failure is None and job is not None and job.error is None:
            logging.warning("LeanLoRA: the LoRA is saved, but %s", problem)
            return
        if self.failure is None and problem is None:
            shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def cancel_between_steps():
    """While a data-parallel run trains in this server: ComfyUI's Cancel does not surface inside rank 0's training
    thread. ComfyUI's ops raise on Cancel in whichever thread checks first (comfy/ops.py), and its sampler asks too:
    rank 0 would leave its step, or its samples, while the other ranks wait in the step's collective. The node
    thread still sees the Cancel (wait_for) and turns it into job.cancel(): the stop every rank agrees before the
    next step (trainer/distributed.py). Restored when the run ends."""
    import comfy.model_management as management
    throw, interrupted = management.throw_exception_if_processing_interrupted, management.processing_interrupted

    def in_training() -> bool:
        return threading.current_thread().name == TRAINING_THREAD

    def throw_outside_training():
        if not in_training():
            throw()

    def interrupted_outside_training():
        return False if in_training() else interrupted()

    management.throw_exception_if_processing_interrupted = throw_outside_training
    management.processing_interrupted = interrupted_outside_training
    try:
        yield
    finally:
        management.throw_exception_if_processing_interrupted = throw
        management.processing_interrupted = interrupted


def _abort_collectives() -> None:
    """NCCL's collectives with a dead peer wait on the GPU: aborted, they fail and rank 0's run ends (gloo's fail
    by themselves when the peer's connection closes)."""
    try:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_backend() == "nccl":
            dist.distributed_c10d._abort_process_group()
    except Exception as error:  # noqa: BLE001 - best effort: the run still fails by the watcher's message
        logging.warning("LeanLoRA: could not abort the NCCL collectives: %s", error)
