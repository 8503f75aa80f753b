"""One LoRA training run, top to bottom: cache -> training copy + LoRA -> steps -> LoRA file.

`adapter` is the thin bridge to the model (ComfyUI's in production, see comfy_adapter.py): encoders, a
training copy of the diffusion model, its noise schedule and forward. Progress goes out through `emit`."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import __version__
from .cache import batches, build_cache
from .checkpointing import checkpoint_blocks
from .dataset import Dataset
from .errors import LeanLoRAError
from .files import sanitize_name, save_safetensors_atomic, unused_path
from .lora import inject_lora, kohya_state_dict, lora_metadata
from .loop import StepInfo, train_loop
from .objective import diffusion_loss
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


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def train_lora(adapter, dataset: Dataset, memory: MemorySettings, lora: LoraSettings, train: TrainSettings,
               loras_dir: Path, emit: Callable[..., None], should_stop: Callable[[], bool]) -> TrainOutcome:
    device = adapter.device
    report = [f"LeanLoRA {__version__} on {device}: {adapter.describe()}", dataset.summary(),
              f"LoRA rank {lora.rank}, alpha {lora.alpha}, dropout {lora.dropout}, targets {lora.targets}",
              f"precision {memory.mixed_precision}, gradient checkpointing {'on' if memory.gradient_checkpointing else 'off'}, "
              f"batch {memory.batch_size} x accumulation {memory.gradient_accumulation} = effective batch {memory.effective_batch}"]

    emit(kind="phase", text="caching latents and text embeddings")
    cache = build_cache(dataset, adapter.encode_image, adapter.encode_text,
                        on_item=lambda done, total: emit(kind="cache", done=done, total=total))
    adapter.release_encoders()
    if should_stop():
        raise LeanLoRAError("cancelled while caching; nothing was trained, no LoRA was saved")

    emit(kind="phase", text="preparing the training copy")
    unet = adapter.training_unet()
    params = inject_lora(unet, lora, train.seed)
    if memory.gradient_checkpointing:
        checkpoint_blocks(adapter.checkpoint_blocks(unet))
    unet.train()
    report.append(f"trainable LoRA parameters: {sum(p.numel() for p in params):,}")

    precision = Precision(memory.mixed_precision, device)
    optimizer = torch.optim.AdamW(params, lr=train.learning_rate, weight_decay=1e-2)
    generator = torch.Generator().manual_seed(train.seed)
    data = batches(cache, memory.batch_size, dataset.repeats, generator)
    model_sampling = adapter.model_sampling

    def loss_fn(batch):
        clean, cond = batch
        clean = clean.to(device)
        cond = {k: v.to(device) for k, v in cond.items()}
        return diffusion_loss(model_sampling, lambda x, t, c: adapter.predict(unet, x, t, c), clean, cond, generator)

    losses: list[float] = []

    def on_step(info: StepInfo):
        losses.append(info.loss)
        TIMELINE.record(info.step, device)
        emit(kind="step", step=info.step, total=info.total, loss=info.loss, seconds=info.seconds)

    TIMELINE.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    failure: BaseException | None = None
    cancelled = False
    started = time.perf_counter()
    try:
        result = train_loop(params, loss_fn, data, optimizer, precision, train.steps,
                            memory.gradient_accumulation, should_stop, on_step)
        cancelled = result.cancelled
    except Exception as error:  # keep what was learned before the failure, then report it
        failure = error
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started
    steps_done = len(losses)

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
    if precision.skipped_steps:
        report.append(f"fp16 loss scaling skipped {precision.skipped_steps} overflowed steps")
    if losses:
        head, tail = losses[:10], losses[-10:]
        report.append(f"loss: first {len(head)} steps mean {sum(head) / len(head):.4f}, "
                      f"last {len(tail)} mean {sum(tail) / len(tail):.4f}")
    peak = device_memory_gib(device)
    if peak:
        report.append(f"peak VRAM: {peak['peak_allocated']:.2f} GiB allocated, {peak['peak_reserved']:.2f} GiB reserved")
    report.append(("CANCELLED: partial LoRA (what was learned so far) saved to " if cancelled else "saved ") + str(path))
    return TrainOutcome(path, state_dict, losses, partial, "\n".join(report))


def _explain(error: BaseException, saved: Path | None) -> LeanLoRAError:
    kept = f"; what was learned so far is saved as {saved}" if saved else ""
    if _is_oom(error):
        return LeanLoRAError(f"out of GPU memory during training{kept}. Lower batch size, resolution or rank, "
                             "or turn on gradient checkpointing and bf16/fp16 in LeanLoRA Memory Settings")
    if isinstance(error, LeanLoRAError):
        return LeanLoRAError(f"{error}{kept}")
    return LeanLoRAError(f"training failed: {error.__class__.__name__}: {error}{kept}")
