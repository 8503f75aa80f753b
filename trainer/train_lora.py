"""One LoRA training run, top to bottom: cache -> training copy + LoRA -> steps -> LoRA file.

`adapter` is the thin bridge to the model (ComfyUI's in production, see comfy_adapter.py): encoders, a
training copy of the diffusion model, its noise schedule and forward. Progress goes out through `emit`.
An out-of-memory inside a step frees memory, moves one rung down the memory ladder and repeats that step."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .cache import CachedSample, batches, build_cache, collate
from .checkpointing import checkpoint_blocks
from .dataset import Dataset
from .errors import LeanLoRAError
from .estimate import MemoryEstimate, estimate_error, probe_activations, static_terms
from .files import sanitize_name, save_safetensors_atomic, unused_path
from .frozen_weights import store_weights_fp8, stream_weights_from_cpu
from .lora import inject_lora, kohya_state_dict, lora_metadata
from .loop import StepInfo, train_loop
from .memory_plan import next_rung, resolve_for_device
from .objective import diffusion_loss
from .optimizers import build_optimizer
from .precision import Precision
from .settings import LoraSettings, MemorySettings, TrainSettings
from .vram import TIMELINE, device_memory_gib


@dataclass
class TrainOutcome:
    lora_path: Path
    lora_state_dict: dict[str, torch.Tensor]
    losses: list[float]
    partial: bool
    report: str
    recoveries: list[str] = field(default_factory=list)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


class _Session:
    """The mutable parts of a run that memory settings control; `configure` moves between settings mid-run."""

    def __init__(self, adapter, unet, params, cache: list[CachedSample], repeats: int, train: TrainSettings):
        self.adapter, self.unet, self.params, self.cache, self.repeats, self.train = \
            adapter, unet, params, cache, repeats, train
        self.generator = torch.Generator().manual_seed(train.seed)
        self.memory: MemorySettings | None = None
        self.notes: list[str] = []
        self.checkpointed = False

    def configure(self, memory: MemorySettings) -> None:
        old, device = self.memory, self.adapter.device
        if memory.gradient_checkpointing and not self.checkpointed:
            checkpoint_blocks(self.adapter.checkpoint_blocks(self.unet))
            self.checkpointed = True
        if memory.base_weights == "fp8 streamed from CPU" and not memory.gradient_checkpointing:
            memory = replace(memory, gradient_checkpointing=True)  # without it every streamed copy stays for backward
            checkpoint_blocks(self.adapter.checkpoint_blocks(self.unet))
            self.checkpointed = True
            self.notes.append("streaming needs gradient checkpointing: turned it on")
        if memory.base_weights != "as loaded" and (old is None or old.base_weights == "as loaded"):
            saved = store_weights_fp8(self.unet)
            self.notes.append(f"frozen weights stored as fp8: {saved / 2 ** 30:.2f} GiB saved")
        if memory.base_weights == "fp8 streamed from CPU" and (old is None or old.base_weights != memory.base_weights):
            moved = stream_weights_from_cpu(self.unet)
            self.notes.append(f"frozen weights streamed from CPU: {moved / 2 ** 30:.2f} GiB left the GPU")
        if old is None or old.optimizer != memory.optimizer:
            self.optimizer = None  # drop the old state before the new one is allocated
            self.optimizer, note = build_optimizer(memory.optimizer, self.params, self.train.learning_rate,
                                                   device=device)
            if note:
                self.notes.append(note)
        if old is None or old.mixed_precision != memory.mixed_precision:
            self.precision = Precision(memory.mixed_precision, device)
        if old is None or old.batch_size != memory.batch_size:
            self.data = batches(self.cache, memory.batch_size, self.repeats, self.generator)
        self.memory = memory

    def estimate(self) -> MemoryEstimate:
        """Exact static terms, plus probed activations on CUDA; the run's RNG stream is left untouched."""
        estimate = static_terms(self.unet, self.params, type(self.optimizer).__name__, self.adapter.device)
        rng = self.generator.get_state()

        def probe_step(batch):
            with self.precision.autocast():
                loss = self.loss(batch)
            loss.backward()
            self.optimizer.zero_grad(set_to_none=True)
        try:
            return probe_activations(estimate, probe_step, collate([self.cache[0]]), self.memory.batch_size,
                                     self.adapter.device)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            self.optimizer.zero_grad(set_to_none=True)
            self.notes.append("the memory probe itself ran out of memory; training relies on OOM recovery")
            return estimate
        finally:
            self.generator.set_state(rng)

    def loss(self, batch) -> torch.Tensor:
        device = self.adapter.device
        clean, cond = batch
        clean = clean.to(device)
        cond = {k: v.to(device) for k, v in cond.items()}
        predict = lambda x, t, c: self.adapter.predict(self.unet, x, t, c)  # noqa: E731
        return diffusion_loss(self.adapter.model_sampling, predict, clean, cond, self.generator)


def train_lora(adapter, dataset: Dataset, memory: MemorySettings, lora: LoraSettings, train: TrainSettings,
               loras_dir: Path, emit: Callable[..., None], should_stop: Callable[[], bool]) -> TrainOutcome:
    device = adapter.device
    memory, device_notes = resolve_for_device(memory, device)
    report = [f"LeanLoRA {__version__} on {device}: {adapter.describe()}", dataset.summary(),
              f"LoRA rank {lora.rank}, alpha {lora.alpha}, dropout {lora.dropout}, targets {lora.targets}",
              memory.describe(), *device_notes]

    emit(kind="phase", text="caching latents and text embeddings")
    cache = build_cache(dataset, adapter.encode_image, adapter.encode_text,
                        on_item=lambda done, total: emit(kind="cache", done=done, total=total))
    adapter.release_encoders()
    if should_stop():
        raise LeanLoRAError("cancelled while caching; nothing was trained, no LoRA was saved")

    emit(kind="phase", text="preparing the training copy")
    unet = adapter.training_unet()
    params = inject_lora(unet, lora, train.seed)
    unet.train()
    report.append(f"trainable LoRA parameters: {sum(p.numel() for p in params):,}")
    session = _Session(adapter, unet, params, cache, dataset.repeats, train)

    losses: list[float] = []

    def on_step(info: StepInfo):
        losses.append(info.loss)
        TIMELINE.record(info.step, device)
        emit(kind="step", step=info.step, total=info.total, loss=info.loss, seconds=info.seconds)

    TIMELINE.reset()
    recoveries: list[str] = []
    failure: BaseException | None = None
    cancelled = False
    started = time.perf_counter()
    estimate = None
    try:
        session.configure(memory)
        estimate = session.estimate()
        report.append(estimate.format())
        emit(kind="estimate", text=estimate.format(), total=estimate.total)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the run's peak, not the probes'
        while True:
            try:
                result = train_loop(params, session.loss, session.data, session.optimizer, session.precision,
                                    train.steps, session.memory.gradient_accumulation, should_stop, on_step,
                                    first_step=len(losses))
                cancelled = result.cancelled
                break
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                rung = _recover(session, error, device)
                recoveries.append(f"step {len(losses) + 1}: out of memory -> {rung}")
                emit(kind="phase", text=f"recovered from out of memory: {rung}")
    except Exception as error:  # keep what was learned before the failure, then report it
        failure = error
    seconds = time.perf_counter() - started
    steps_done = len(losses)
    report += session.notes

    partial = cancelled or failure is not None
    if steps_done == 0:
        adapter.free(unet)
        if failure is not None:
            raise _explain(failure, None) from failure
        raise LeanLoRAError("cancelled before the first step; no LoRA was saved")

    stem = sanitize_name(train.output_name)
    if partial:
        stem = f"{stem}_partial_step{steps_done}"
    state_dict = kohya_state_dict(unet, lora)
    path = unused_path(Path(loras_dir), stem)
    metadata = lora_metadata(lora, {"leanlora_version": __version__, "ss_steps": str(steps_done),
                                    "ss_learning_rate": str(train.learning_rate), "ss_seed": str(train.seed),
                                    "ss_resolution": str(dataset.resolution), "leanlora_partial": str(partial)})
    save_safetensors_atomic(state_dict, path, metadata)
    adapter.free(unet)

    if failure is not None:
        raise _explain(failure, path) from failure
    report.append(f"trained {steps_done}/{train.steps} steps in {seconds:.1f} s ({seconds / steps_done:.3f} s/step)")
    if recoveries:
        report.append(f"out-of-memory recoveries ({len(recoveries)}), finished with: {session.memory.describe()}")
        report += [f"  {line}" for line in recoveries]
    if session.precision.skipped_steps:
        report.append(f"fp16 loss scaling skipped {session.precision.skipped_steps} overflowed steps")
    if losses:
        head, tail = losses[:10], losses[-10:]
        report.append(f"loss: first {len(head)} steps mean {sum(head) / len(head):.4f}, "
                      f"last {len(tail)} mean {sum(tail) / len(tail):.4f}")
    peak = device_memory_gib(device)
    if peak:
        report.append(f"peak VRAM: {peak['peak_allocated']:.2f} GiB allocated, {peak['peak_reserved']:.2f} GiB reserved")
        if estimate is not None and not recoveries:
            report.append(estimate_error(estimate, torch.cuda.max_memory_allocated(device)))
    report.append(("CANCELLED: partial LoRA (what was learned so far) saved to " if cancelled else "saved ") + str(path))
    return TrainOutcome(path, state_dict, losses, partial, "\n".join(report), recoveries)


def _recover(session: _Session, error: BaseException, device: torch.device) -> str:
    """Frees what the failed step held, then takes one rung down the ladder (or re-raises at the bottom)."""
    session.optimizer.zero_grad(set_to_none=True)
    error.__traceback__ = None  # the traceback pins the failed step's tensors
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rung = next_rung(session.memory, device)
    if rung is None:
        raise error
    memory, description = rung
    session.configure(memory)
    return description


def _explain(error: BaseException, saved: Path | None) -> LeanLoRAError:
    kept = f"; what was learned so far is saved as {saved}" if saved else ""
    if is_out_of_memory(error):
        return LeanLoRAError(f"out of GPU memory during training, even after every memory-saving fallback{kept}. "
                             "Lower the resolution or the LoRA rank, or free VRAM used by other programs")
    if isinstance(error, LeanLoRAError):
        return LeanLoRAError(f"{error}{kept}")
    return LeanLoRAError(f"training failed: {error.__class__.__name__}: {error}{kept}")
