"""One LoRA training run, top to bottom: cache -> training copy + LoRA -> steps -> LoRA file.

`adapter` is the model as the trainer needs it (trainer/model.py; ComfyUI's is bridge/comfy_adapter.py):
encoders, a training copy of the diffusion model, its noise schedule and forward. Progress goes out through `emit`.
An out-of-memory inside a step frees memory, moves one rung down the memory ladder and repeats that step."""
from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from . import __version__
from .cache import CacheStats, build_cache, control_encoder_for
from .cache_store import LatentTextStore
from .dataset import Dataset
from .distributed import Distributed
from .errors import LeanLoRAError, TrainingCancelled, is_out_of_memory, one_line
from .memory.estimate import estimate_error
from .files import SAVE_ERRORS, check_writable, non_finite_tensors, sanitize_name, save_with_fallback
from .lora import adapter_type, inject_lora, kohya_state_dict, lora_metadata, tag_frequency, with_file_hashes
from .lora.continue_from import ContinuedLora, continue_from_file
from .loop import StepInfo
from .objective import KOHYA_SAMPLING, LossFunction, LossKind, TimestepSampling
from .optimizers import OPTIONAL, adapted_step, check_learning_rate, optional_class
from .memory.fit import room_for_sampling
from .memory.host_ram import HostRamPlan, ResidentPeak
from .memory.ladder import resolve_for_device
from .model import ModelAdapter
from .report import RunReport
from .session import RunEvents, TrainingSession
from .settings import AdapterKind, LoraSettings, LoraTargets, LoraWeights, MemorySettings, TrainSettings
from .training_state import (Resume, capture_state, check_base_weights, dataset_fingerprint, lora_fingerprint,
                             model_fingerprint, save_training_state, state_path)
from .validation import ValidationSet, held_out_count, split_fingerprint, split_validation
from .device.vram import GIB, DevicePeak, Timeline, device_memory_gib, process_ram_peak_gib, reset_peak


LOSS_READ_EVERY = 8  # CUDA steps between host syncs for the loss (each read stalls the GPU queue)
# A sampler step may take this many training steps' time (and at least MIN_SAMPLE_STEP_BOUND seconds, where steps
# are fast anyway); a slower sample is skipped: it would hold the run for minutes to hours (2048 px on a CPU)
SAMPLE_STEP_BOUND = 10
MIN_SAMPLE_STEP_BOUND = 1.0


@dataclass(frozen=True)
class StepPace:
    """A training step's measured time and size, which bound a sample's time (on_sample's third argument)."""
    seconds: float
    latent_pixels: int  # latent pixels one optimizer step trains (images x latent height x width)

    @property
    def sampler_step_allowed(self) -> float:
        return max(SAMPLE_STEP_BOUND * self.seconds, MIN_SAMPLE_STEP_BOUND)

    def sampler_step_estimate(self, latent_pixels: int, forwards: int) -> float:
        """A sampler step's seconds: a forward costs about a third of a training step's forward and backward, in
        proportion to the latent pixels (attention grows faster: this is a floor)."""
        return self.seconds * latent_pixels * forwards / (3 * self.latent_pixels)


@dataclass
class TrainOutcome:
    lora_path: Path
    lora_state_dict: dict[str, torch.Tensor]
    losses: list[float]
    partial: bool
    report: str  # for people, written from `run`
    run: RunReport
    save_note: str | None = None  # set when the loras folder failed and the file went to the fallback folder
    timeline: Timeline = field(default_factory=Timeline)  # device memory per step

    @property
    def recoveries(self) -> list[str]:
        return [recovery.describe() for recovery in self.run.recoveries]

    @property
    def validation_losses(self) -> list[tuple[int, float]]:
        return self.run.validation_losses


def train_lora(adapter: ModelAdapter, dataset: Dataset, memory: MemorySettings, lora: LoraSettings, train: TrainSettings,
               loras_dir: Path, emit: Callable[..., None], should_stop: Callable[[], bool],
               store: LatentTextStore | None = None, fallback_dir: Path | None = None,
               timeline: Timeline | None = None, sample_every: int = 0,
               on_sample: Callable[[int, dict[str, torch.Tensor], StepPace | None], list[Path]] | None = None,
               launcher_env: Mapping[str, str] | None = None) -> TrainOutcome:
    """`store` keeps latents and text embeddings between runs (keyed by content, preprocessing and encoder).
    `fallback_dir` receives the LoRA where `loras_dir` fails at save time (read-only, disk full).
    `timeline` records device memory per step (emptied first); the caller may read it during the run.
    `on_sample(step, kohya state dict, StepPace or None)` renders images from the LoRA at that step and returns their
    files: every `sample_every` steps between optimizer steps, and after the final save; a failure is reported, never
    fatal. A TimeoutError from it (a sampler step estimated or measured past StepPace.sampler_step_allowed) skips
    this and every later sample of the run, with a note. `launcher_env`: a data-parallel world's RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT given for this process (the Train node's rank 0, nodes/workers.py) instead of its
    environment's (a launcher's)."""
    run = Run(adapter, dataset, memory, lora, train, Path(loras_dir), emit, should_stop, store, fallback_dir,
              timeline if timeline is not None else Timeline(), sample_every if on_sample is not None else 0, on_sample, launcher_env)
    with run.resident:  # the job's host RAM peak, whatever happens
        run.check()  # everything that can be refused, before any encoding
        run.cache()
        with run.training_copy():  # freed when the block ends, whatever happened
            with run.stopping():  # Cancel or a failure ends the steps; what was learned is saved before it is reported
                run.start()
                run.steps()
            run.save()
        return run.finish()


class Run(RunEvents):
    """One training run: its stages in order (check, cache, training_copy, start, steps, save, finish) and the
    loop's events between steps (on_step, on_evaluate, on_save, should_stop, on_recovery). Resume is
    training_state.Resume: read and checked in check(), checked against the LoRA in training_copy(), put back in
    start()."""

    def __init__(self, adapter: ModelAdapter, dataset: Dataset, memory: MemorySettings, lora: LoraSettings,
                 train: TrainSettings, loras_dir: Path, emit: Callable[..., None], should_stop: Callable[[], bool],
                 store: LatentTextStore | None, fallback_dir: Path | None, timeline: Timeline, sample_every: int,
                 on_sample: Callable[[int, dict[str, torch.Tensor], StepPace | None], list[Path]] | None,
                 launcher_env: Mapping[str, str] | None = None):
        """As train_lora's arguments (`sample_every` 0 without `on_sample`); `memory` is resolved for the device
        by check()."""
        self.adapter, self.dataset, self.requested, self.lora, self.train = adapter, dataset, memory, lora, train
        self.loras_dir, self.emit, self.stop_asked, self.timeline = loras_dir, emit, should_stop, timeline
        self.store, self.fallback_dir, self.sample_every, self.on_sample = store, fallback_dir, sample_every, on_sample
        self.save_every = math.gcd(train.save_every_steps, sample_every)  # the loop's stops for on_save
        self.device = adapter.device
        self.cancel_errors = (TrainingCancelled, *adapter.cancel_errors)
        self.sync_every = LOSS_READ_EVERY if self.device.type == "cuda" else 1
        self.report: list[str] = []  # for people, in order
        self.unet = self.text_encoder = self.continued = self.session = self.validation = None
        self.pace, self.samples = Pace(), SampleLog()
        self.resident = ResidentPeak()  # the job's host RAM, sampled while train_lora runs
        self.step_files: list[Path] = []  # this run's <name>_step<N> files, oldest first (keep_last_saves prunes)
        self.estimate = self.failure = self.diverged_at = None
        self.cancelled = self.from_start = self.released = False
        # launched by torchrun / accelerate: this process's rank (None for one process); rank 0 alone saves and samples
        self.distributed = Distributed.from_environment(self.device, launcher_env)
        self.is_main = self.distributed is None or self.distributed.is_main
        if not self.is_main:
            self.sample_every, self.on_sample = 0, None

    def phase(self, text: str) -> None:
        self.emit(kind="phase", text=text)

    def warn(self, text: str) -> None:
        """A line for the report that the panel shows as it happens."""
        self.report.append(text)
        self.phase(text)

    # --- stages ---------------------------------------------------------------------------------------------------

    def check(self) -> None:
        """The folders, the memory settings on this device, the objective, optimizer, text encoder and resume state:
        each refused here, before any encoding. Starts the report."""
        adapter, lora, train, store = self.adapter, self.lora, self.train, self.store
        check_writable(self.loras_dir, 0, "loras folder")
        if store is not None and store.folder is not None:
            try:
                check_writable(store.folder, 0, "latent cache folder")
            except LeanLoRAError as error:  # the disk layer is optional: warn and cache in RAM only
                store.disk_problem, store.folder = str(error), None
        self.record = RunReport(requested=self.requested)
        self.memory, device_notes = resolve_for_device(self.requested, self.device)
        memory = self.memory
        # an unusable attention backend fails here, before any encoding
        attention_note = adapter.set_attention(memory.attention, compiled=memory.compile)
        device_notes += [attention_note] if attention_note else []
        report = self.report
        report += [f"LeanLoRA {__version__} on {self.device}: {adapter.describe()}", self.dataset.summary(),
                   f"{adapter_type(lora).label} rank {lora.rank}, alpha {lora.alpha}, dropout {lora.dropout}, targets "
                   f"{lora.targets.value}" + (f", factor {lora.factor}" if lora.type is AdapterKind.LOKR else ""),
                   f"learning rate {train.learning_rate:g}, schedule {train.lr_schedule}, warm-up {train.warmup_steps}"
                   " steps", memory.describe(), *device_notes]
        if self.distributed is not None:
            report.append(self.distributed.describe())
        if train.min_snr_gamma:  # refused for flow models here
            LossFunction.of(train.loss, train.huber_c, train.min_snr_gamma, adapter.identity().prediction)
        if train.objective_changes():
            report.append("timesteps and loss: " + ", ".join(f"{key} {value}"
                                                              for key, value in train.objective_changes().items()))
        check_optimizer(memory.optimizer, train)
        if lora.trains_text_encoder:  # a model whose text encoder cannot be trained is refused
            check_text_encoder(adapter, lora, memory)
            report.append(f"text encoder trained too: LoRA on the CLIP text encoder(s) at learning rate "
                          f"{lora.text_encoder_lr:g} (text_encoder_lr)")
        if train.option_changes():
            report.append("training options: " + ", ".join(f"{key} {value}"
                                                           for key, value in train.option_changes().items()))
        held_out_count(train.validation_fraction, len(self.dataset.samples))  # too few images
        self.dataset_id = dataset_fingerprint(self.dataset)
        self.resume = Resume.of(train.resume_from, self.dataset_id, len(self.dataset.samples), train.steps,
                                world_size=self.distributed.world if self.distributed is not None else 1)
        self.first_step, self.losses, self.started_at = self.resume.beginning(time.time())

    def cache(self) -> None:
        """Latents and text embeddings, once (and from the store where it has them); the encoders go after; the
        held-out split comes off (validation)."""
        adapter, dataset, train, store = self.adapter, self.dataset, self.train, self.store
        self.phase("caching latents and text embeddings")
        stats = CacheStats()
        try:
            cache = build_cache(dataset, adapter.encode_image, adapter.encode_text,
                                on_item=lambda done, total: self.emit(kind="cache", done=done, total=total),
                                store=store, image_encoder_id=adapter.image_encoder_id() if store else "",
                                text_encoder_id=adapter.text_encoder_id() if store else "", stats=stats,
                                captions=train.caption_options(), seed=train.seed, masked_loss=train.masked_loss,
                                tokenize=adapter.text_encoder_tokens if self.lora.trains_text_encoder else None,
                                controls=control_encoder_for(adapter, dataset))  # edit pairs (or a refusal)
        except self.cancel_errors as cancel:
            raise TrainingCancelled("cancelled while caching; nothing was trained, no LoRA was saved") from cancel
        self.report.append(stats.describe())
        if store is not None and store.disk_problem:  # the disk layer is optional: training goes on from RAM
            self.warn(f"WARNING: latent cache on disk off for this run: {store.disk_problem}; cached in RAM only")
        adapter.release_encoders()
        if self.should_stop():
            raise TrainingCancelled("cancelled while caching; nothing was trained, no LoRA was saved")
        self.all_cached, self.cached_images = cache, len(cache)
        self.cached, self.held_out = split_validation(cache, train.validation_fraction, train.seed)  # RNG of its own

    @contextlib.contextmanager
    def training_copy(self):
        """The training copy with its LoRA (and the text encoder's), continued from a file where asked, checked
        against the resume state, in a session, for the block; freed when the block ends, whatever happened (the
        final samples and the KSampler after Train find the card as it was before the run)."""
        self.phase("preparing the training copy")
        self.unet = self.adapter.training_unet()
        try:
            self._prepare()
            yield
        finally:
            self.release()

    def _prepare(self) -> None:
        adapter, lora, train, unet, report = self.adapter, self.lora, self.train, self.unet, self.report
        check_base_weights(unet)
        fingerprints = {"dataset": self.dataset_id, "model": model_fingerprint(unet)}
        presets = {targets: adapter.lora_targets(unet, targets) for targets in LoraTargets}  # before LoRA wraps layers
        params = inject_lora(unet, lora, train.seed, presets[lora.targets])
        if lora.trains_text_encoder:  # its LoRA weights come after the UNet's: one list for clipping, EMA and state
            self.text_encoder = adapter.training_text_encoder(lora, train.seed)
            params = params + self.text_encoder.params
            fingerprints["text_encoder"] = self.text_encoder.fingerprint()
            report.append(self.text_encoder.describe())
        if lora.continue_from:
            self.continued = continue_from_file(unet, lora, adapter.diffusers_module_names(), adapter.identity(),
                                                presets, self.text_encoder)
            report.append(self.continued.describe())
        fingerprints["lora"] = lora_fingerprint(lora, params, adapter_type(lora).fingerprint(lora)
                                                + (("text_encoder_lr on",) if self.text_encoder is not None else ()))
        if self.held_out:
            fingerprints["validation"] = split_fingerprint(self.cached_images, self.held_out)
        self.resume.check(fingerprints, params, lora.type.value)
        self.fingerprints = fingerprints
        unet.train()
        report.append(f"trainable LoRA parameters: {sum(p.numel() for p in params):,}")
        check_writable(self.loras_dir, 2 * sum(p.numel() for p in params), "loras folder")  # fp16: 2 bytes a weight
        self.session = session = TrainingSession(adapter, unet, params, self.cached, self.dataset.repeats, train,
                                                 text_encoder=self.text_encoder, text_encoder_lr=lora.text_encoder_lr)
        self.record.recoveries = session.recoveries
        session.distributed = self.distributed
        if self.held_out:
            self.validation = ValidationSet.build([self.all_cached[i] for i in self.held_out],
                                                  train.validation_every_steps, session.sampling_on_cpu, train.seed,
                                                  sampling=adapter.timestep_sampling)
            self.evaluate_every = self.validation.every
            names = [sample.name for sample in self.validation.samples]
            report.append(self.validation.describe(self.cached_images) + f": {', '.join(names[:5])}"
                          + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
            self.record.validation_losses = self.validation.losses
        self.state_settings = {
            "started_at": repr(self.started_at), "memory": "", "seed": str(train.seed),
            "lora_type": lora.type.value,  # a resume refuses another type by name (check_resumable)
            "learning_rate": repr(train.learning_rate), "lr_schedule": train.lr_schedule,
            "warmup_steps": str(train.warmup_steps),
            # a resume checks it is on or off as the state trained (check_resumable)
            **({"text_encoder_lr": repr(lora.text_encoder_lr)} if lora.trains_text_encoder else {}),
            **train.objective_values(), **train.option_values(),
            # a resume refuses another number of processes (training_state.Resume.of)
            **({"world_size": str(self.distributed.world)} if self.distributed is not None else {})}
        self.exporter = LoraExporter(adapter, unet, lora, presets[lora.targets], self.dataset, train, self.started_at,
                                     self.continued, len(self.held_out), self.text_encoder)

    @contextlib.contextmanager
    def stopping(self):
        """Around start and steps: Cancel or a failure ends them and is kept (save reports it once what was learned
        is saved); then the session closes and the run's record is complete."""
        self.timeline.reset()
        self.started = time.perf_counter()  # reset by steps(), once the estimate's probe steps are done
        self.device_peak = DevicePeak(self.device).__enter__()  # the whole card (NVML), probes included
        try:
            yield
        except self.cancel_errors:  # Cancel while measuring memory, before the first step
            self.cancelled = True
        except Exception as error:  # keep what was learned before the failure, then report it
            self.failure = error
        self.seconds = time.perf_counter() - self.started - self.samples.seconds  # sampling is reported on its own
        self.device_peak.__exit__(None, None, None)
        session, record = self.session, self.record
        session.close()  # the session's notes are complete from here (report.run_notes)
        self.steps_done = session.steps_done  # after a divergence: the last step checked finite
        record.notes, record.used = session.notes, session.memory
        record.steps_done, record.cancelled, record.diverged_at = self.steps_done, self.cancelled, self.diverged_at
        record.seconds = self.seconds
        self.report += record.notes
        self.partial = self.cancelled or self.failure is not None or self.diverged_at is not None

    def start(self) -> None:
        """The session on the device: auto-fit or the memory probe, the estimate, the seed, and the resume state
        put back."""
        session, train, memory = self.session, self.train, self.memory
        # compiling is silent and long the first time (H200 machines: SDXL 33-62 s, SD1.5 with fp8 weights 83 s)
        self.phase("compiling the diffusion model (torch.compile: about a minute the first time), then measuring "
                   "memory" if memory.compile else "measuring memory before step 1")
        # host RAM planned like the card (memory/host_ram.py): the copy as made, before the plan converts it
        session.host_ram = HostRamPlan(self.adapter, session.unet, self.all_cached, memory.ram)
        estimate, fit_lines = session.start(memory)
        self.estimate = self.record.estimate = estimate
        self.record.before_step_one = fit_lines
        for line in fit_lines:
            self.warn(line)
        self.report.append(estimate.format())
        self.check_host_ram(estimate)
        if session.ema is not None:
            self.report.append(f"EMA of the LoRA weights (decay {train.ema_decay:g}): "
                               f"{session.ema.nbytes / 2 ** 20:.1f} MiB on the device, in the estimate's LoRA "
                               "parameters (and as much again for a moment at each update, after the optimizer step)")
        self.emit(kind="estimate", text=estimate.format(), total=estimate.total)
        reset_peak(self.device)  # the run's peak, not the probes'
        cache, repeats = self.cached, self.dataset.repeats
        used = batch_used(cache, repeats, session.memory.batch_size)
        if used < session.memory.batch_size:
            self.report.append(
                f"batch used: {used} images per step, not the {session.memory.batch_size} requested: an epoch holds "
                f"{len(cache)} images x {repeats} repeats"
                + (" and batches hold one image size" if len({s.latent.shape for s in cache}) > 1 else "")
                + f" (effective batch {used * session.memory.gradient_accumulation})")
        # torch's process-wide generators, seeded here after the probes, so that anything in the model drawing
        # from them gives the same run for a seed (a resume puts the state's generators back instead); LoRA
        # dropout draws from the run's own generator (lora.StepSeededDropout)
        torch.manual_seed(train.seed)
        for text in self.resume.restore(session, self.state_settings, self.validation):
            self.warn(text)
        if self.distributed is not None:
            self.distributed.broadcast(session.params)

    def check_host_ram(self, estimate) -> None:
        """Before step 1: what the plan holds in host RAM, against Memory Settings' `ram` (memory/host_ram.py).
        Auto-fit's plan over it is refused (auto-fit left out what it could); settings as given run, with a warning."""
        session, record = self.session, self.record
        host, micro_step = session.host_ram, session.micro_step
        for line in host.lines:
            self.warn(line)
        offload = getattr(micro_step, "offload", None)  # what the latest probe offloaded, at batch 1
        offloaded = offload.offloaded_bytes * session.run_batch_size() if offload is not None else 0
        record.host_ram = host.estimate(
            session.memory, offloaded or estimate.activations or 0, graphs=bool(getattr(micro_step, "graphed", 0)),
            lora_and_optimizer=estimate.lora_parameters + estimate.gradients + estimate.optimizer_state)
        record.host_ram_limit = host.limit.limit
        self.report.append(record.host_ram.format() + f"; limit: {host.limit.source}")
        warning = host.check_plan(record.host_ram, session.memory, fitted=self.memory.auto_fit.on)
        if warning:
            self.warn(warning)

    def steps(self) -> None:
        """The steps to the end (or Cancel, divergence), then the finished LoRA's validation loss."""
        session, validation = self.session, self.validation
        self.started = time.perf_counter()
        result = session.run(self)
        self.cancelled, self.diverged_at = result.cancelled, result.diverged_at
        # a NaN/inf loss at the run's first step came from the model as loaded, before any update of this run
        self.from_start = self.diverged_at == self.first_step + 1 and result.loss_diverged
        if validation is not None and not self.cancelled and self.diverged_at is None \
                and session.steps_done > self.first_step \
                and (not validation.losses or validation.losses[-1][0] != session.steps_done):
            try:
                self.on_evaluate(session.steps_done)  # the end: the finished LoRA's validation loss
            except self.cancel_errors:
                self.report.append("validation loss at the end skipped: cancelled (the training had finished)")

    def save(self) -> None:
        """The LoRA file (partial where the steps stopped early) and, where it can be resumed, its state. Before the
        first step nothing is saved: the Cancel, divergence or failure is raised here."""
        session, steps_done = self.session, self.steps_done
        # Nothing trained: also a resume stopped before it restored its step (0 < first_step). training_copy frees
        # the copy as this raises.
        if steps_done <= self.first_step:
            if self.diverged_at is not None:
                raise _diverged(self.diverged_at, None, self.lora, self.train, session.memory,
                                from_start=self.from_start)
            if self.failure is not None:
                raise _explain(self.failure, None, before_first_step=not session.recoveries,
                               memory=self.memory) from self.failure
            raise TrainingCancelled("cancelled before the first step; no LoRA was saved" + self.resume.unchanged())
        stem = f"{self.exporter.stem}_partial_step{steps_done}" if self.partial else self.exporter.stem
        with session.evaluation_weights():  # the saved LoRA: schedule-free's average or the EMA where on
            self.state_dict, metadata = self.exporter.contents(steps_done, self.partial, stem)
        if not self.is_main:  # rank 0 writes the file and state; the others learn where (or why not)
            self.path, self.save_note = self.distributed.saved_by_main(None, self.failure is None)
            return
        try:
            self.path, self.save_note = save_with_fallback(self.state_dict, self.loras_dir, stem, metadata,
                                                           self.fallback_dir)
        except Exception as error:
            if self.distributed is not None:
                self.distributed.saved_by_main(error, self.failure is None)
            raise
        if self.partial or self.train.save_every_steps:  # resumable: a stopped run always, a finished one when saving
            try:
                self.write_state(self.path)
                self.report.append(f"training state for resume: {state_path(self.path)}")
            except SAVE_ERRORS as error:
                self.report.append(f"WARNING: the training state could not be written beside {self.path} ({error}); "
                                   "the LoRA is saved, but this run cannot be resumed exactly")
        if self.distributed is not None:
            self.distributed.saved_by_main((self.path, self.save_note), self.failure is None)

    def release(self) -> None:
        """The training copy off the device, then everything the session holds (once)."""
        if self.released or self.unet is None:
            return
        self.released = True
        self.adapter.free(self.unet)
        if self.text_encoder is not None:
            self.text_encoder.to("cpu")
        if self.session is not None:
            self.session.release()

    def finish(self) -> TrainOutcome:
        """After the training copy is freed: the final samples, the error a stopped run ends with, or the report."""
        session, train, report, steps_done, first_step = self.session, self.train, self.report, self.steps_done, \
            self.first_step
        path, save_note, samples, recoveries = self.path, self.save_note, self.samples, session.recoveries
        if save_note:
            self.phase(save_note)
        if self.sample_every and not self.partial and steps_done % self.sample_every == 0:  # once the LoRA is saved
            try:
                self.sample(steps_done, self.state_dict)
            except self.cancel_errors:  # the LoRA is saved complete: only these samples are skipped
                report.append(f"the samples at step {steps_done} were cancelled; the LoRA is saved complete")
        if self.diverged_at is not None:
            raise _diverged(self.diverged_at, path, self.lora, train, session.memory, save_note, self.from_start)
        if self.failure is not None:
            raise _explain(self.failure, path, note=save_note) from self.failure
        trained, seconds = steps_done - first_step, self.seconds
        report.append(f"trained {trained}/{train.steps - first_step} steps"
                      + (f" (steps {first_step + 1}-{steps_done} of {train.steps})" if first_step else "")
                      + f" in {seconds:.1f} s ({seconds / trained:.3f} s/step)")
        ram_peak = process_ram_peak_gib()
        if ram_peak is not None:
            report.append(f"host RAM: this process's peak since it started {ram_peak:.2f} GiB")
        if recoveries:
            report.append(f"memory recoveries ({len(recoveries)}), finished with: {session.memory.describe()}")
            report += [f"  {recovery.describe()}" for recovery in recoveries]
        if session.precision.skipped_steps:
            report.append(f"fp16 loss scaling skipped {session.precision.skipped_steps} overflowed steps")
        losses = self.losses
        if losses:
            head, tail = losses[first_step:first_step + 10], losses[-10:]
            report.append(f"loss: first {len(head)} steps mean {sum(head) / len(head):.4f}, "
                          f"last {len(tail)} mean {sum(tail) / len(tail):.4f}")
        if self.validation is not None and self.validation.summary():
            report.append(self.validation.summary())
        peak = device_memory_gib(self.device)
        if peak:
            report.append(f"peak VRAM: {peak['peak_allocated']:.2f} GiB allocated, {peak['peak_reserved']:.2f} GiB "
                          "reserved" + (f"; whole card (NVML, CUDA context included) {self.device_peak.peak / GIB:.2f}"
                                        " GiB" if self.device_peak.peak else "")
                          + ("; sampling included (the estimate is for training alone)" if samples.paths else ""))
            if self.estimate is not None and not recoveries and not samples.paths:
                report.append(estimate_error(self.estimate, int(peak["peak_allocated"] * GIB)))
        self.resident.sample()
        self.record.host_ram_peak, self.record.host_ram_grown = self.resident.peak, self.resident.grown
        report.append(self.resident.describe(self.record.host_ram, self.record.host_ram_limit))
        if self.sample_every:
            report.append(samples.describe(self.sample_every))
        if save_note:
            report.append(save_note)
        report.append((f"CANCELLED after step {steps_done}: partial LoRA (what was learned so far) saved to "
                       if self.cancelled else "saved ") + str(path))
        return TrainOutcome(path, self.state_dict, losses, self.partial, "\n".join(report), self.record, save_note,
                            self.timeline)

    # --- the loop's events (loop.LoopEvents, session.RunEvents) --------------------------------------------------

    def should_stop(self) -> bool:
        """Data-parallel: whether any rank was asked, agreed by all before each step (so all stop at the same one)."""
        if self.distributed is None:
            return self.stop_asked()
        memory = self.session.memory if self.session is not None else None
        return self.distributed.agree(self.stop_asked(), (memory.batch_size, memory.gradient_accumulation)
                                      if memory is not None else (0, 0))

    def on_recovery(self, recovery) -> None:
        self.phase(f"recovered ({recovery.cause}): {recovery.rung}")

    def on_step(self, info: StepInfo) -> None:
        self.losses.append(info.loss)
        self.timeline.record(info.step, self.device)
        s_per_step = self.pace.seconds_per_step(info.step, info.seconds / max(1, info.step - self.first_step))
        self.emit(kind="step", step=info.step, total=info.total, loss=info.loss, seconds=info.seconds,
                  first_step=self.first_step, s_per_step=s_per_step, d=adapted_step(self.session.optimizer),
                  eta_s=None if s_per_step is None else s_per_step * (info.total - info.step))

    def on_evaluate(self, step: int) -> None:
        """The validation loss at this step's weights; out of memory skips it (training goes on)."""
        session = self.session
        if not self.is_main:  # every rank holds the same weights: rank 0's curve is the run's
            return
        try:
            with session.evaluation_weights():
                value = self.validation.evaluate(session.forward_loss, step)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            error.__traceback__ = None  # its frames hold the forward's tensors
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.warn(f"WARNING: the validation loss at step {step} ran out of GPU memory and was skipped; "
                      "training went on")
            return
        self.emit(kind="validation", step=step, loss=value, first_step=self.first_step)

    def on_save(self, step: int) -> None:
        """Between steps, every `save_every`: a LoRA file every save_every_steps, samples every sample_every."""
        if not self.is_main:
            return
        if self.train.save_every_steps and step % self.train.save_every_steps == 0:
            self.save_step(step)
        if self.sample_every and step % self.sample_every == 0:
            self.sample(step)

    def write_state(self, lora_path: Path) -> None:
        """The training state beside `lora_path`: what a resume goes on from (training_state.py)."""
        self.state_settings["memory"] = self.session.memory.describe()
        state = capture_state(self.session, self.losses, self.fingerprints, self.state_settings,
                              self.record.validation_losses)
        save_training_state(state_path(lora_path), state)

    def save_step(self, step: int) -> None:
        """A complete LoRA file and its training state at this step; a file that cannot be written is said and
        training goes on (the final save still comes)."""
        stem = f"{self.exporter.stem}_step{step}"
        try:
            with self.session.evaluation_weights():
                state_dict, metadata = self.exporter.contents(step, partial=False, stem=stem)
            path, _ = save_with_fallback(state_dict, self.loras_dir, stem, metadata, None)  # no fallback mid-run
            self.write_state(path)
        except (LeanLoRAError, *SAVE_ERRORS) as error:
            self.warn(f"WARNING: the save at step {step} failed ({error}); training went on")
            return
        self.step_files.append(path)
        self.emit(kind="saved", step=step, path=str(path))
        keep = self.train.keep_last_saves
        if keep:
            for old in self.step_files[:-keep]:
                for stale in (old, state_path(old)):
                    stale.unlink(missing_ok=True)
            del self.step_files[:-keep]

    def sample(self, step: int, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Images from the LoRA at this step. A failure (out of memory while sampling, a file that cannot be
        written) is said and training goes on; Cancel while sampling stops the run like Cancel in a step."""
        samples, session, cache = self.samples, self.session, self.cached
        if samples.too_slow:
            return
        self.phase(f"rendering samples at step {step}")
        started_sampling = time.perf_counter()
        images = batch_used(cache, self.dataset.repeats, session.memory.batch_size) \
            * session.memory.gradient_accumulation
        area = sum(sample.latent.shape[-2] * sample.latent.shape[-1] for sample in cache) / len(cache)
        step_pace = StepPace(self.pace.latest, round(images * area)) if self.pace.latest else None
        try:
            if state_dict is None:  # mid-run: the training copy is on the device
                with session.evaluation_weights():
                    tensors = self.exporter.tensors()
                with room_for_sampling(session) as made_room:
                    paths = self.on_sample(step, tensors, step_pace)
                samples.made_room += made_room
            else:  # the final samples: the run was released before them
                paths = self.on_sample(step, state_dict, step_pace)
        except self.cancel_errors:
            raise
        except TimeoutError as slow:
            samples.too_slow = f"WARNING: samples skipped from step {step} on: {slow}; the LoRA is not affected"
            self.warn(samples.too_slow)
            return
        except Exception as error:  # noqa: BLE001 - a sample never loses the run
            self.warn(f"WARNING: the samples at step {step} failed ({one_line(error)}); training went on")
            samples.failed.append(step)
            return
        finally:
            samples.seconds += time.perf_counter() - started_sampling
            self.pace.exclude(time.perf_counter() - started_sampling)
        samples.paths += paths
        self.emit(kind="sample", step=step, paths=[str(path) for path in paths])


class Pace:
    """Steady-state seconds per step for the progress line and time left: measured from the first reported step
    on (its warm-up, CUDA-graph capture or compile stays out), over the recent window of steps."""

    WINDOW = 50

    def __init__(self):
        self.marks: list[tuple[float, int]] = []  # (time, step) as steps were reported
        self.latest: float | None = None  # the last measure (before a second step: the first step's time)

    def seconds_per_step(self, step: int, first_guess: float | None = None) -> float | None:
        """`first_guess`: a step's time so far, warm-up included, for `latest` until two steps are reported."""
        self.marks.append((time.perf_counter(), step))
        self.marks = self.marks[-self.WINDOW:]
        (t0, s0), (t1, s1) = self.marks[0], self.marks[-1]
        if s1 > s0:
            self.latest = (t1 - t0) / (s1 - s0)
            return self.latest
        self.latest = self.latest or first_guess
        return None

    def exclude(self, seconds: float) -> None:
        """Time spent between steps on something else (sampling): out of the measure."""
        self.marks = [(mark + seconds, step) for mark, step in self.marks]


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


@dataclass
class SampleLog:
    """The sample images of a run: their files, the steps whose samples failed, the time spent sampling."""
    paths: list[Path] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    seconds: float = 0.0
    made_room: int = 0  # samplings for which the training copy's weights waited in CPU RAM
    too_slow: str = ""  # why samples were skipped from some step on (a sampler step past the bound)

    def describe(self, every: int) -> str:
        where = f" in {self.paths[0].parent}" if self.paths else ""
        failed = f"; failed at steps {', '.join(map(str, self.failed))}" if self.failed else ""
        room = (f"; for {self.made_room} of them the training copy's weights waited in CPU RAM (the card has no room "
                "for ComfyUI's model beside them)" if self.made_room else
                "; ComfyUI loads the base model, CLIP and VAE beside the training copy, partially where they do not fit")
        return f"samples every {every} steps: {len(self.paths)} images rendered{where} ({self.seconds:.1f} s){failed}{room}"


class LoraExporter:
    """The LoRA file's tensors (kohya's keys, fp16, fp32 where fp16 would overflow) and metadata at a step."""

    def __init__(self, adapter: ModelAdapter, unet: torch.nn.Module, lora: LoraSettings,
                 target_modules: tuple[str, ...], dataset: Dataset, train: TrainSettings, started_at: float,
                 continued: ContinuedLora | None = None, held_out: int = 0, text_encoder=None):
        self.adapter, self.unet, self.lora, self.dataset, self.train = adapter, unet, lora, dataset, train
        self.text_encoder = text_encoder  # its kohya te keys go into the same file
        self.target_modules = target_modules
        self.held_out = held_out  # images validation keeps out of training
        self.continued = continued  # the LoRA file this run started from: its steps count in ss_steps
        self.started_at, self.stem = started_at, sanitize_name(train.output_name)
        self.module_names = adapter.kohya_module_names()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA file's tensors at the current weights, checked finite."""
        state_dict = self._state_dict(torch.float16)
        if non_finite_tensors(state_dict) and not non_finite_tensors(self._state_dict(torch.float32)):
            state_dict = self._state_dict(torch.float32)  # finite beyond fp16's range
        bad = non_finite_tensors(state_dict)
        if bad:  # the loop's checks should make this unreachable; never write or apply such weights
            raise LeanLoRAError(f"the trained LoRA has NaN/inf weights ({len(bad)} tensors, e.g. {bad[0]}); "
                                "nothing was saved. Lower the learning rate or alpha/rank, or use mixed precision bf16")
        return state_dict

    def _state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        state_dict = kohya_state_dict(self.unet, self.lora, self.module_names, dtype=dtype)
        if self.text_encoder is not None:
            state_dict.update(self.text_encoder.state_dict(dtype))
        return state_dict

    def contents(self, steps_done: int, partial: bool, stem: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        state_dict, lora, dataset, train = self.tensors(), self.lora, self.dataset, self.train
        metadata = lora_metadata(
            lora, self.adapter.identity(), target_modules=self.target_modules, output_name=stem,
            resolution=(dataset.resolution, dataset.resolution),
            tags=tag_frequency(dataset.folder.name, (sample.caption for sample in dataset.samples)),
            timestamp=self.started_at, extra={"leanlora_version": __version__, "ss_steps": str(steps_done),
                                              "ss_max_train_steps": str(train.steps),
                                              "ss_learning_rate": str(train.learning_rate), "ss_seed": str(train.seed),
                                              **({"ss_unet_lr": str(train.learning_rate),  # only where on: a
                                                  # run without it writes the file it always wrote
                                                  "ss_text_encoder_lr": str(lora.text_encoder_lr),
                                                  "ss_network_train_unet_only": "False"}
                                                 if lora.trains_text_encoder else {}),
                                              "ss_lr_scheduler": train.lr_schedule,
                                              "ss_lr_warmup_steps": str(train.warmup_steps),
                                              "ss_num_train_images": str((len(dataset.samples) - self.held_out) * dataset.repeats),
                                              "ss_enable_bucket": str(dataset.buckets),
                                              **objective_metadata(train, self.adapter.timestep_sampling),
                                              "leanlora_partial": str(partial),
                                              **(self.continued.metadata(steps_done) if self.continued else {})})
        return state_dict, with_file_hashes(state_dict, metadata)


def check_text_encoder(adapter: ModelAdapter, lora: LoraSettings, memory: MemorySettings) -> None:
    """text_encoder_lr against the model and the memory settings, before any work: a LeanLoRAError naming the field."""
    check = getattr(adapter, "check_text_encoder", None)
    if check is None:
        raise LeanLoRAError(f"text_encoder_lr: got {lora.text_encoder_lr:g}, but this model comes without a text "
                            "encoder LeanLoRA can train (SD1.5 and SDXL through ComfyUI's CLIP only): set LoRA "
                            "Config's text_encoder_lr to 0")
    check(lora)
    if memory.lora_weights is not LoraWeights.FP32:
        raise LeanLoRAError(f"text_encoder_lr: got {lora.text_encoder_lr:g} with lora_weights "
                            f"{memory.lora_weights.value}, which steps one group of LoRA weights: set Memory Settings' "
                            "lora_weights to fp32, or text_encoder_lr to 0")
    try:
        check_learning_rate(memory.optimizer, lora.text_encoder_lr)
    except LeanLoRAError as error:  # the same rule for the encoder's rate, named as its field
        raise LeanLoRAError(str(error).replace("learning_rate", "text_encoder_lr")) from None


def check_optimizer(optimizer: str, train: TrainSettings) -> None:
    """The optimizer against Train's settings, and its package, before any work: each a LeanLoRAError naming the
    field and what to do."""
    check_learning_rate(optimizer, train.learning_rate)
    if optimizer in OPTIONAL:
        optional_class(optimizer)
    if train.ema_decay and optimizer == "AdamWScheduleFree":
        raise LeanLoRAError(f"ema_decay: got {train.ema_decay:g} with optimizer AdamWScheduleFree, which averages "
                            "the weights itself (its average is what is saved): set ema_decay to 0, or choose "
                            "another optimizer")


def objective_metadata(train: TrainSettings, family_sampling) -> dict[str, str]:
    """The timestep and loss knobs in kohya's keys and words ("None" where kohya's option is unset)."""
    sampling = train.timestep_sampling or family_sampling
    huber = train.loss is not LossKind.MSE
    return {"ss_noise_offset": str(train.noise_offset) if train.noise_offset else "None",
            "ss_min_snr_gamma": str(train.min_snr_gamma) if train.min_snr_gamma else "None",
            "ss_loss_type": train.loss.value, "ss_huber_schedule": "constant" if huber else "None",
            "ss_huber_c": str(train.huber_c) if huber else "None",
            "ss_timestep_sampling": KOHYA_SAMPLING[sampling],
            # LeanLoRA's own key (kohya has no EMA): the file holds the average's weights
            "leanlora_ema_decay": str(train.ema_decay) if train.ema_decay else "None",
            "ss_shuffle_caption": str(train.shuffle_tags), "ss_keep_tokens": str(train.keep_tokens),
            "ss_caption_dropout_rate": str(train.caption_dropout),
            "ss_caption_tag_dropout_rate": str(train.tag_dropout),
            "ss_multires_noise_iterations": str(train.multires_noise_iterations or "None"),
            "ss_multires_noise_discount": str(train.multires_noise_discount),
            "ss_masked_loss": str(train.masked_loss),
            **({"ss_discrete_flow_shift": str(train.timestep_shift)}
               if sampling is TimestepSampling.SHIFTED_SIGMOID else {})}


def batch_used(cache: list, repeats: int, batch_size: int) -> int:
    """The most images a batch can hold: batches never span epochs or image sizes (see cache.batches)."""
    per_size = Counter(tuple(sample.latent.shape) for sample in cache)
    return min(batch_size, max(per_size.values()) * repeats)


def _diverged(step: int, saved: Path | None, lora: LoraSettings, train: TrainSettings, memory: MemorySettings,
              save_note: str | None = None, from_start: bool = False) -> LeanLoRAError:
    kept = (f"the last LoRA checked finite is saved as {saved}" if saved else
            "no finite LoRA was learned before it, so nothing was saved")
    precision = ("use mixed precision bf16 (fp16's range overflows)" if memory.mixed_precision == "fp16" else
                 f"mixed precision 'no' (fp32) if it persists (now {memory.mixed_precision})")
    if from_start:  # no update of this run came before it: its learning rate and alpha are not the cause
        return LeanLoRAError(
            f"the loss was NaN/inf at step {step}, the first this run computed, before any of its updates: the model "
            f"gives NaN/inf on these images as it was loaded, so the learning rate and alpha are not the cause; "
            f"{kept}. To fix: check the checkpoint (it may hold NaN/inf weights: pick another or download it again)"
            + (f", or {precision}" if memory.mixed_precision == "fp16" else ""))
    return LeanLoRAError(
        f"training diverged: at step {step} the loss (or its gradients) turned NaN/inf, so training stopped "
        f"there; {kept}"
        + (f" ({save_note})" if save_note else "")
        + f". To fix: lower the learning rate (now {train.learning_rate:g}; 1e-4 is a safe start), lower alpha "
        f"relative to rank (alpha {lora.alpha:g} / rank {lora.rank} = scale {lora.alpha / lora.rank:g}; 1 is usual), "
        f"or {precision}")


def _explain(error: BaseException, saved: Path | None, before_first_step: bool = False,
             note: str | None = None, memory: MemorySettings | None = None) -> LeanLoRAError:
    kept = f"; what was learned so far is saved as {saved}" if saved else ""
    kept += f" ({note})" if note else ""
    if is_out_of_memory(error) and before_first_step:
        return LeanLoRAError("out of GPU memory while placing the training copy or measuring memory, before step 1. "
                             + _out_of_memory_advice(memory))
    if is_out_of_memory(error):
        return LeanLoRAError(f"out of GPU memory during training, even after every memory-saving fallback{kept}. "
                             "Lower the resolution or the LoRA rank, or free VRAM used by other programs")
    if isinstance(error, LeanLoRAError):
        return LeanLoRAError(f"{error}{kept}")
    return LeanLoRAError(f"training failed: {error.__class__.__name__}: {error}{kept}")


def _out_of_memory_advice(memory: MemorySettings | None) -> str:
    """What to change, for the card setting the user has (Memory Settings' `card`)."""
    auto_fit = memory.auto_fit if memory is not None else None
    if auto_fit is not None and auto_fit.card_gib is not None:
        return (f"Memory Settings' card is {auto_fit.card_gib:g} GiB and even the leanest plan for it did not fit what "
                "this GPU has free now (other programs, or models ComfyUI keeps loaded, hold the rest): pick a smaller "
                "card size, or close what holds VRAM; a lower resolution or LoRA rank also needs less")
    if auto_fit is not None and auto_fit.free_vram:
        return ("Memory Settings' card is auto (the free VRAM) and even the leanest plan did not fit it: close what "
                "holds VRAM (other programs, models ComfyUI keeps loaded), or lower the resolution or LoRA rank")
    return ("Memory Settings' card is manual, so nothing was traded for memory: set card to auto (or your GPU's size) "
            "and the plan picks fp8 or streamed weights where the model itself does not fit, or choose them by hand")
