"""Data-parallel training over torch.distributed: one process per GPU (NCCL) or per CPU worker (gloo), started by a
launcher (torchrun, accelerate launch), which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. A
multi-node run is the launcher's flags; nothing here knows about nodes.

Every rank draws the single-process run's batch of world x batch_size images (the same generator, seeded alike, so
the same batch order, noise and timesteps) and trains its own contiguous share of it. Each rank weighs its share's
mean loss by its share of the batch, and the gradients (with the loss) are summed over the ranks once per optimizer
step, in one flat buffer: the update is the single process's with the larger batch, within float rounding, also
where a batch does not split evenly (an epoch's last, smaller batch). Rank 0 alone saves, samples and writes the
state; a Cancel on any rank stops every rank before the next step."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from .errors import LeanLoRAError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Rank 0 saves and renders samples between steps while the others wait at the next collective: a sample on a slow
# card can take minutes, so the wait allowed is far above torch's default 10 minutes
COLLECTIVE_TIMEOUT = timedelta(minutes=60)
# A stop asked by a signal (the headless runner's Ctrl-C or the launcher's SIGTERM): read before each step and agreed by
# every rank (Distributed.agree), so all stop at the same step and rank 0 keeps the partial LoRA
STOP = threading.Event()
# Set by the Train node for its worker processes: the file a worker writes as it joins the process group
READY_FILE_ENV = "LEANLORA_READY_FILE"
LAUNCH_HINT = "launch with `torchrun --nproc_per_node N -m leanlora train CONFIG` (or accelerate launch), which sets them"


@dataclass(frozen=True)
class World:
    """Where this process is among the launcher's processes."""
    rank: int
    size: int
    local_rank: int


def world_from_environment(env: Mapping[str, str] = os.environ) -> World | None:
    """The launcher's world, or None for a single process (WORLD_SIZE unset or 1)."""
    try:
        size = int(env.get("WORLD_SIZE") or 1)
    except ValueError:
        raise LeanLoRAError(f"WORLD_SIZE is {env['WORLD_SIZE']!r}, not a number of processes; {LAUNCH_HINT}") from None
    if size <= 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        raise LeanLoRAError(f"WORLD_SIZE is {size} but {', '.join(missing)} is not set; {LAUNCH_HINT}")
    try:
        rank, local_rank = int(env["RANK"]), int(env.get("LOCAL_RANK") or env["RANK"])
    except ValueError:
        raise LeanLoRAError(f"RANK ({env['RANK']!r}) and LOCAL_RANK ({env.get('LOCAL_RANK')!r}) must be numbers; "
                            f"{LAUNCH_HINT}") from None
    if not 0 <= rank < size:
        raise LeanLoRAError(f"RANK is {rank}, outside 0..{size - 1} (WORLD_SIZE {size}); {LAUNCH_HINT}")
    return World(rank, size, local_rank)


class Distributed:
    """This process's part of a data-parallel run: its rank, the world size, and the collectives the run needs
    (the gradients' all-reduce, the initial weights' broadcast, a barrier, the per-step stop flag)."""

    def __init__(self, world: World, device: torch.device, stop_group=None):
        self.rank, self.world, self.device = world.rank, world.size, device
        self.stop_group = stop_group  # a gloo group: the stop flag is read on the host without waiting for the GPU

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, device: torch.device, env: Mapping[str, str] | None = None) -> Distributed | None:
        """None for a single process; else joins the launcher's process group (NCCL on CUDA, gloo on the CPU),
        once per process (a second run in the same process reuses it). `env`: a launcher's variables given
        instead of this process's (the Train node's rank 0 in the server, nodes/workers.py), joined by TCP."""
        world = world_from_environment(os.environ if env is None else env)
        if world is None:
            return None
        if device.type not in ("cuda", "cpu"):
            raise LeanLoRAError(f"data-parallel training runs on NVIDIA GPUs (NCCL) or the CPU (gloo), not on "
                                f"{device.type}: run one process (without torchrun)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_available():
            raise LeanLoRAError("this PyTorch build has no torch.distributed: run one process, or install a build "
                                "with it (the official wheels have it)")
        if dist.is_initialized():
            if dist.get_world_size() != world.size or dist.get_rank() != world.rank:
                raise LeanLoRAError(f"the process group here has rank {dist.get_rank()} of {dist.get_world_size()}, "
                                    f"the launcher says rank {world.rank} of {world.size}")
            backend = dist.get_backend()
        else:
            if device.type == "cuda":
                if device.index is None:  # NCCL binds its communicator to one numbered device
                    device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_device(device)
            if env is None and os.environ.get(READY_FILE_ENV):  # a worker of the Train node (nodes/workers.py):
                Path(os.environ[READY_FILE_ENV]).touch()  # rank 0 in the server joins once every worker is here
            address = (env if env is not None else os.environ)
            address = f"{address['MASTER_ADDR']}:{address['MASTER_PORT']}"
            try:
                dist.init_process_group(backend, rank=world.rank, world_size=world.size, timeout=COLLECTIVE_TIMEOUT,
                                        **({"init_method": f"tcp://{address}"} if env is not None else {}),
                                        **({"device_id": device} if device.type == "cuda" else {}))
            except (RuntimeError, ValueError) as error:
                raise LeanLoRAError(f"could not join the launcher's {world.size} processes as rank {world.rank} "
                                    f"({backend} on {device}, MASTER_ADDR {address}): {error}") from error
        global _stop_group
        if backend != "gloo" and _stop_group is None:  # made once: every rank makes its groups in the same order
            _stop_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        return cls(world, device, _stop_group if backend != "gloo" else None)

    def describe(self) -> str:
        return (f"data-parallel: rank {self.rank} of {self.world} processes ({dist.get_backend()}); each step trains "
                f"{self.world} x batch_size images, split by rank; rank 0 saves, samples and writes the state")

    # --- the batch ------------------------------------------------------------------------------------------------

    def share(self, count: int) -> tuple[int, int]:
        """This rank's images [start, end) of a batch of `count`: contiguous, the first ranks take one more where it
        does not split evenly (torch.tensor_split's rule); a rank may get none of a small last batch."""
        base, extra = divmod(count, self.world)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def sharded(self, prepare: Callable[[object], dict], micro_step) -> ShardedStep:
        return ShardedStep(prepare, micro_step, self)

    # --- the collectives ------------------------------------------------------------------------------------------

    def reduce(self, params: list[torch.nn.Parameter], step_loss: torch.Tensor) -> torch.Tensor:
        """After a step's micro-steps, before clipping: every rank's weighted gradients and loss summed into one flat
        fp32 buffer (one all-reduce a step), written back; returns the step's loss over the whole batch. A rank
        that trained no image this step adds zeros."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([*(g.detach().reshape(-1).float() for g in grads),
                          step_loss.detach().reshape(1).float().to(grads[0].device if grads else self.device)])
        dist.all_reduce(flat)
        offset = 0
        for param, grad in zip(params, grads):
            summed = flat[offset:offset + grad.numel()].view_as(grad)
            offset += grad.numel()
            if param.grad is None:
                param.grad = summed.to(param.dtype)
            else:
                param.grad.copy_(summed)
        return flat[-1]

    def broadcast(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's weights on every rank (they start alike from the seed or the state; this makes it certain)."""
        with torch.no_grad():
            for param in params:
                dist.broadcast(param.data, src=0)

    def barrier(self) -> None:
        dist.barrier(group=self.stop_group) if self.stop_group is not None else dist.barrier()

    def agree(self, stop: bool, layout: tuple[int, int]) -> bool:
        """Before each step: whether any rank asks to stop, on every rank. `layout` (batch size, gradient
        accumulation) must be every rank's: a rank whose memory plan differs would train other images."""
        flags = torch.tensor([float(stop or STOP.is_set()), *layout, *(-value for value in layout)], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.stop_group)
        highest, lowest = flags[1:3].tolist(), (-flags[3:5]).tolist()
        if highest != lowest:
            raise LeanLoRAError(
                f"the ranks' memory plans differ (batch size x gradient accumulation from {lowest[0]:g} x "
                f"{lowest[1]:g} to {highest[0]:g} x {highest[1]:g}): every rank must train the same batch layout. "
                "Set Memory Settings' card to the same size on every GPU (or manual), or use GPUs of one size")
        return bool(flags[0])

    def saved_by_main(self, saved, exchange: bool):
        """After the final save. Rank 0 passes `saved`, (path, note) or the error its save raised, to every rank;
        the others return rank 0's (path, note), or raise its error. Without `exchange` (this rank failed: its
        peers may be gone or stuck) nothing is exchanged and the others get (None, None)."""
        if not exchange:
            return None, None
        sent = [saved if not isinstance(saved, BaseException) else f"{type(saved).__name__}: {saved}"]
        try:
            dist.broadcast_object_list(sent, src=0, group=self.stop_group)
        except (RuntimeError, ValueError) as error:  # (DistBackendError is a RuntimeError) a peer gone
            if self.is_main:
                return saved  # rank 0 saved already; the others ended on their own
            raise LeanLoRAError(f"rank {self.rank}: lost rank 0 while it saved the LoRA ({error})") from error
        if isinstance(sent[0], str):
            raise LeanLoRAError(f"rank 0 could not save the LoRA ({sent[0]}); rank {self.rank} saved nothing")
        return tuple(sent[0])


_stop_group = None  # the gloo group of the stop flag beside NCCL's (one per process)


def leave() -> None:
    """The end of a launched process's runs: its process group goes (the launcher's processes then exit cleanly)."""
    global _stop_group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _stop_group = None


def refused_world(state_name: str, state_world: str, world: int) -> LeanLoRAError:
    """A state resumed by another number of processes than wrote it (`state_world`, as the state records it)."""
    if not state_world.isdigit() or int(state_world) < 1:
        return LeanLoRAError(f"cannot resume from {state_name}: its world size {state_world!r} is not a number of "
                             "processes (the file was edited or is damaged): pick another state or set resume to 'off'")
    trained = int(state_world)
    launch = (f"`torchrun --nproc_per_node {trained} -m leanlora train CONFIG`" if trained > 1 else
              "one process (python -m leanlora train CONFIG, or the Train node)")
    return LeanLoRAError(f"cannot resume from {state_name}: it was trained by {trained} process"
                         f"{'es' if trained > 1 else ''} (world size {trained}) and this run has {world}; a resume is "
                         f"exact only with the same world size: launch it with {launch}, or start a new run from "
                         "its LoRA file (LoRA Config's continue_from)")


class ShardedStep:
    """The training loop's step (as micro_steps.BatchStep) on this rank's share of the batch: the draws are made
    for the whole batch (the same noise and timesteps as one process), then cut. The share's mean loss is scaled
    by its part of the batch (the `accumulation` divisor the micro-step applies), so the summed gradients are
    those of the whole batch's mean."""

    def __init__(self, prepare: Callable[[object], dict], micro_step, distributed: Distributed):
        self.prepare, self.micro_step, self.distributed = prepare, micro_step, distributed

    def __call__(self, batch, accumulation: int) -> torch.Tensor:
        inputs = self.prepare(batch)
        count = inputs["clean"].shape[0]
        start, end = self.distributed.share(count)
        if start == end:  # nothing of this batch here: no gradient, no loss (the sum's zeros)
            return torch.zeros((), device=inputs["clean"].device)
        share = {name: value[start:end] if _per_image(value, count) else value for name, value in inputs.items()}
        return self.micro_step(share, accumulation * count / (end - start))

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.micro_step.zero_grad(optimizer)


def _per_image(value, count: int) -> bool:
    """An input with one entry per image of the batch (latents, noise, timesteps, conditioning, masks, tokens)."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == count
    return isinstance(value, (list, tuple)) and len(value) == count
