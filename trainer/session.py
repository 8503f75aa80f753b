"""The parts of a run that memory settings control, as one object: the training copy with its LoRA, precision,
optimizer and batches. `configure` moves between settings mid-run (OOM recovery, auto-fit); `estimate` says
where memory goes; `run` steps. Fitting to a card lives in memory/fit.py."""
from __future__ import annotations

import contextlib
import copy
import gc
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .cache import MASK_KEY, CachedSample, batches, collate
from .ema import LoraEMA
from .errors import is_out_of_memory
from .loop import LoopEvents, LoopResult, StepInfo, StepParts, train_loop
from .lora import seed_lora_dropout
from .device.allocator import apply_allocator_settings, trim_graph_memory, trim_host_memory
from .device.card import device_memory, is_gpu
from .memory.estimate import GIB, PROBE_SIDES, MemoryEstimate, probe_activations, static_terms
from .memory.fit import CardBudget, budget_bytes, card_budget, fit_to_card, keep_graphs_within_limit, recover
from .memory.ladder import streams_more
from .model import ModelAdapter
from .objective import PLAIN_MSE, LossFunction, denoising_loss, draw_noise
from .optimizers import build_lr_schedule, build_optimizer, evaluation_weights
from .report import Recovery, run_notes
from .settings import CheckpointDepth, LoraWeights, MemorySettings, TrainSettings
from .step.activation_offload import ActivationOffload
from .step.checkpointing import (RankedUnits, checkpoint_blocks, uncheckpoint_blocks, units_for_share,
                                 uses_randomness)
from .step.compiled_blocks import compile_before_first_step, compile_blocks
from .step.frozen_weights import park_frozen_on_cpu, place_on_device
from .step.micro_steps import BatchStep, GraphDoesNotFit, build_micro_step, graphs_incompatible
from .step.precision import Precision, norms_in_compute_dtype
from .step.weight_prefetch import WeightPrefetch
from .text_encoder import TrainedTextEncoder, is_token_entry
from .training_state import rng_states


@dataclass(frozen=True)
class Install:
    """One step of TrainingSession.configure: a memory technique (or a setting it depends on) installed or undone,
    and why it sits where it does in INSTALL_ORDER."""
    name: str
    install: Callable[[TrainingSession, MemorySettings | None, MemorySettings], MemorySettings]
    why: str


class TrainingSession:
    """The mutable parts of a run that memory settings control; `configure` moves between settings mid-run."""

    def __init__(self, adapter: ModelAdapter, unet, params, cache: list[CachedSample], repeats: int,
                 train: TrainSettings, inductor_settings: dict | None = None, offload_settings: dict | None = None,
                 text_encoder: TrainedTextEncoder | None = None, text_encoder_lr: float = 0.0):
        """inductor_settings, offload_settings: experiment knobs (the bench's), the product's defaults if None:
        the inductor options compiled blocks use (compiled_blocks.INDUCTOR_OPTIONS) and ActivationOffload's keyword
        arguments. `text_encoder` (LoRA Config's text_encoder_lr): its LoRA weights are the last of `params`,
        stepped at `text_encoder_lr`; each step encodes the batch's captions through it."""
        self.adapter, self.unet, self.params, self.cache, self.repeats, self.train = \
            adapter, unet, params, cache, repeats, train
        self.text_encoder, self.text_encoder_lr = text_encoder, text_encoder_lr
        self.inductor_settings, self.offload_settings = inductor_settings, offload_settings or {}
        self.generator = torch.Generator().manual_seed(train.seed)
        # Random draws and timesteps are computed from a CPU copy of the schedule: no step waits for the GPU.
        self.sampling_on_cpu = copy.deepcopy(adapter.model_sampling).to("cpu")
        self.timestep_sampling = train.timestep_sampling or adapter.timestep_sampling
        self.loss_function = LossFunction.of(train.loss, train.huber_c, train.min_snr_gamma,
                                             adapter.identity().prediction if train.min_snr_gamma else "epsilon")
        self.memory: MemorySettings | None = None
        self.notes: list[str] = []
        shifts = {size: adapter.resolution_shift(size)
                  for size in sorted({tuple(sample.latent.shape[-2:]) for sample in cache})}
        if any(shift != 1.0 for shift in shifts.values()):  # the family's schedule moves with the size (Flux dev)
            self.notes.append("noise levels: shifted per image size as the model samples that size (" + ", ".join(
                f"{h * 8}x{w * 8}: x{shift:.2f}" for (h, w), shift in shifts.items()) + " along the schedule)")
        rank_streaming = getattr(adapter, "rank_streaming", None)  # before anything streams (ModelAdapter)
        if rank_streaming is not None:
            rank_streaming(unet, tuple(self._largest_sample().latent.shape[-2:]))
        self.checkpointed = 0.0  # the checkpoint share wrapped now
        self.selective = False  # whether those units keep their matmul/attention outputs (selective checkpointing)
        self._checkpoint_units: tuple[CheckpointDepth, RankedUnits] | None = None
        self.steps_done = 0  # optimizer steps applied (run() keeps it); a rebuilt LR schedule resumes from here
        self.recoveries: list[Recovery] = []
        # (steps done, RNG states, batch order) when the latest step began: training_state.capture_state reads it
        self.step_start: tuple[int, dict, dict] | None = None
        self.restore_allocator = lambda: None
        self.micro_step = self.step = None
        self.compiled = None  # the CompiledBlocks, once compile is asked for
        self.compiled_batch: int | None = None  # the batch size the compile step compiled
        self.unplaced: BaseException | None = None  # the out-of-memory error that kept the weights off the device
        self.estimated_peak: int | None = None  # the estimate's total before step 1 (None: not measured)
        self.ema: LoraEMA | None = None  # with train.ema_decay: made once the LoRA is on its device (configure)
        # the host RAM plan (memory/host_ram.HostRamPlan, set by the run before start): the ladder leaves out what
        # the `ram` limit cannot hold
        self.host_ram = None
        # a data-parallel run's rank (trainer/distributed.py, set by the run before start): the batches drawn are
        # world x batch_size, each step trains this rank's share and sums the gradients over the ranks
        self.distributed = None

    def configure(self, memory: MemorySettings) -> None:
        """Moves to `memory` from the current settings, through INSTALL_ORDER's steps in turn (a step may adjust the
        settings the later ones see). Storage changes go in the ladder's direction only (fp8 and streaming are not
        undone); the checkpoint share moves both ways (auto-fit gives budget back as less recompute)."""
        old = self.memory
        for step in self.INSTALL_ORDER:
            memory = step.install(self, old, memory)
        self.memory = memory

    # The install steps, each (session, settings before or None at the first configure, settings wanted) ->
    # the settings the later steps see. Their order is INSTALL_ORDER's (at the end of the class).

    def _install_full_checkpointing_for_streaming(self, old, memory):
        if memory.base_weights.streamed and not (memory.gradient_checkpointing and memory.checkpoint_share == 1):
            memory = replace(memory, gradient_checkpointing=True, checkpoint_share=1.0)
            self.notes.append("streaming needs every block checkpointed: turned full gradient checkpointing on")
        return memory

    def _install_compile(self, old, memory):
        if memory.compile and self.compiled is None:
            self.compiled = compile_blocks(self.adapter.prepare_compile_units(self.unet), self.inductor_settings)
        return memory

    def _install_grouped_upcasts(self, old, memory):
        if old is None:
            self.adapter.group_upcasts(self.unet)
        return memory

    def _install_selective_recompute_check(self, old, memory):
        if memory.selective_recompute and memory.compile:
            memory = replace(memory, selective_recompute=False)
            self._set_note("selective recompute: ", "off with torch.compile (the compiled blocks recompute whole)")
        return memory

    def _install_checkpointing(self, old, memory):
        share = memory.checkpoint_share if memory.gradient_checkpointing else 0.0
        if share != self.checkpointed or memory.selective_recompute != self.selective:
            # The first `count` units of the best-first order are wrapped, the rest not: auto-fit moves both ways.
            units = self.checkpoint_units(memory.checkpoint_depth)
            count = units_for_share(len(units), share) if share else 0
            # dropout drawing from a generator inside the step (LoRA's does not: lora.StepSeededDropout): recompute
            # must replay its draws (and CUDA graphs cannot: _install_step)
            checkpoint_blocks(units[:count], preserve_rng_state=uses_randomness(self.unet),
                              selective=memory.selective_recompute)
            uncheckpoint_blocks(units[count:])
            self.checkpointed, self.selective = share, memory.selective_recompute
            self._set_note("gradient checkpointing: ",
                           f"{count} of {len(units)} blocks recomputed, those that free the most activation memory "
                           "per recomputed FLOP" if 0 < count < len(units) else None)
        return memory

    def _install_precision(self, old, memory):
        if old is None or old.mixed_precision != memory.mixed_precision:
            self.precision = Precision(memory.mixed_precision, self.adapter.device)
            self.adapter.set_compute_dtype(self.unet, self.precision.compute_dtype)
            if old is None:
                norms_in_compute_dtype(self.unet)  # a no-op outside autocast, so installed once
                note = self.adapter.set_conv_layout(self.unet, self.adapter.device, self.precision.compute_dtype)
                if note:
                    self.notes.append(note)
        return memory

    def _install_weight_storage(self, old, memory):
        streamed = memory.base_weights.streamed
        to_fp8 = memory.base_weights.fp8 and (old is None or not old.base_weights.fp8)
        to_stream = streamed if old is None else streams_more(old, memory)
        if (to_fp8 or to_stream) and is_gpu(self.adapter.device):
            park_frozen_on_cpu(self.unet)
        if to_fp8:
            saved = self.adapter.store_weights_fp8(self.unet)
            self.notes.append(f"frozen weights stored as fp8: {saved / 2 ** 30:.2f} GiB saved")
        if to_stream:
            moved = self.adapter.stream_weights_from_cpu(self.unet, memory.stream_share)
            self._set_note("frozen weights streamed from CPU: ",
                           f"{moved / 2 ** 30:.2f} GiB stay off the GPU"
                           + (f" (the layers cheapest to stream, {memory.stream_share:.0%} of the weights; the rest "
                              "stays on the GPU)" if memory.stream_share < 1 else ""))
        return memory

    def _install_placement(self, old, memory):
        try:
            place_on_device(self.unet, self.adapter.device)
            self.unplaced = None
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            # Not an error yet: the frozen weights wait in CPU RAM, the settings are complete, and auto-fit takes
            # the next rung that stores less (memory/fit.configure_placed); without auto-fit start() raises it.
            self.unplaced = error
            error.__traceback__ = None
            park_frozen_on_cpu(self.unet)
        if old is None and self.text_encoder is not None:
            self.text_encoder.to(self.adapter.device)  # as loaded (no fp8, no streaming): the ladder works on the UNet
        return memory

    def _install_ema(self, old, memory):
        if self.train.ema_decay and self.ema is None:
            self.ema = LoraEMA(self.params, self.train.ema_decay)
        return memory

    def _install_optimizer(self, old, memory):
        if old is None or old.optimizer != memory.optimizer:
            self.optimizer = None  # drop the old state before the new one is allocated
            encoder_params = {id(p) for p in self.text_encoder.params} if self.text_encoder is not None else set()
            self.optimizer, note = build_optimizer(
                memory.optimizer, [p for p in self.params if id(p) not in encoder_params], self.train.learning_rate,
                device=self.adapter.device, flat=True, bf16_weights=memory.lora_weights is not LoraWeights.FP32,
                extra_groups=((self.text_encoder.params, self.text_encoder_lr),) if encoder_params else ())
            self.lr_schedule = build_lr_schedule(self.optimizer, self.train.lr_schedule, self.train.warmup_steps,
                                                 self.train.steps, self.steps_done)
            if note:
                self.notes.append(note)
        return memory

    def _install_batches(self, old, memory):
        if old is None or old.batch_size != memory.batch_size:
            self.data = batches(self.cache, memory.batch_size * (self.distributed.world if self.distributed else 1),
                                self.repeats, self.generator,
                                self.adapter.sequence_conditioning, self.train.caption_dropout)
        return memory

    def _install_step(self, old, memory):
        device = self.adapter.device
        if self.micro_step is not None:
            self.notes += [n for n in self.micro_step.notes if n not in self.notes]
        had_graphs = bool(getattr(self.micro_step, "graphs", None))
        pool_size = getattr(self.micro_step, "pool_size", None)  # what a capture measured outlives the rebuild
        flattened = getattr(self.optimizer, "leanlora_flat", None) is not None
        self.micro_step = self.step = None
        gc.collect()
        if device.type == "cuda" and (had_graphs or flattened):
            # Freed memory that cannot serve the next allocations goes back to the driver: a released graph pool
            # (else a recovery rung runs next to the old graph's memory) and the per-tensor LoRA storage a flat
            # optimizer replaced (else it stays reserved in small holes).
            torch.cuda.empty_cache()
            trim_graph_memory(device)
        self.micro_step, note = build_micro_step(
            memory.fast_path, self.compute_loss, self.precision, self.params, device,
            passthrough_errors=self.adapter.cancel_errors,
            incompatible=graphs_incompatible(uses_randomness(self.unet)) or self.adapter.graph_blocker or (
                "the text encoder is trained (its captions' tokens are read on the host every step)"
                if self.text_encoder is not None else None),
            offload=ActivationOffload(**self.offload_settings) if memory.activation_offload else None,
            prefetch=WeightPrefetch() if memory.base_weights.streamed and memory.prefetch_streamed else None,
            pool_size=pool_size)
        if note and note not in self.notes:
            self.notes.append(note)
        self.micro_step.budget = budget_bytes(memory.auto_fit, device, self.comfy_reserve())
        self.step = BatchStep(self.inputs, self.micro_step) if self.distributed is None else \
            self.distributed.sharded(self.inputs, self.micro_step)
        return memory

    INSTALL_ORDER: tuple[Install, ...] = (
        Install("full checkpointing for streaming", _install_full_checkpointing_for_streaming,
                "a streamed layer's device copy would otherwise stay alive for backward"),
        Install("compile", _install_compile,
                "before checkpointing wraps the units: checkpoint(compiled unit) recomputes with the compiled code, "
                "shared by units of equal shapes"),
        Install("grouped fp8 upcasts", _install_grouped_upcasts,
                "around each block's eager forward, inside checkpointing's wrapper and outside compiled code: fp8 "
                "weights, whenever a rung stores them, are upcast a block at a time"),
        Install("selective recompute off with compile", _install_selective_recompute_check,
                "off with compile, before checkpointing wraps: compiled code runs as inductor kernels, whose ops "
                "selective checkpointing's policy never sees"),
        Install("gradient checkpointing", _install_checkpointing,
                "wraps the best-first share of the units and unwraps the rest (the share moves both ways); with "
                "dropout drawing inside the step, recompute replays its draws"),
        Install("mixed precision", _install_precision,
                "the compute dtype (and the conv layout that depends on it) before weights are stored or placed"),
        Install("fp8 / streamed base weights", _install_weight_storage,
                "decides what goes to the device, so before placement; storage only moves down the ladder"),
        Install("placement", _install_placement,
                "only once fp8/streaming decided what goes there; an out-of-memory here leaves the weights on the "
                "host for auto-fit's next rung"),
        Install("EMA of the LoRA weights", _install_ema, "once the LoRA is on its device"),
        Install("optimizer (8-bit state, bf16 LoRA weights)", _install_optimizer,
                "after placement: its state lives where the LoRA does; the old state is dropped first"),
        Install("batches", _install_batches, "the batch size the step will see"),
        Install("step: CUDA graphs, activation offload, prefetch", _install_step,
                "last, rebuilt on every change: captured graphs hold the old settings' kernels and memory"),
    )

    def checkpoint_units(self, depth: CheckpointDepth) -> RankedUnits:
        """The family's checkpoint units for the largest sample, best first, with their costs (computed once)."""
        if self._checkpoint_units is None or self._checkpoint_units[0] is not depth:
            latent_size = tuple(self._largest_sample().latent.shape[-2:])
            units = self.adapter.checkpoint_blocks(self.unet, depth, latent_size=latent_size)
            if not isinstance(units, RankedUnits):  # a model without a cost model: every unit alike
                units = RankedUnits(units, [(1, 1)] * len(units))
            self._checkpoint_units = depth, units
        return self._checkpoint_units[1]

    def _set_note(self, topic: str, text: str | None) -> None:
        """The report's one note on `topic` (a rung that goes further replaces it), or none."""
        self.notes = [n for n in self.notes if not n.startswith(topic)]
        if text is not None:
            self.notes.append(topic + text)

    def start(self, memory: MemorySettings) -> tuple[MemoryEstimate, list[str]]:
        """First configuration and the estimate before step 1. With an auto-fit budget the planner picks the
        fastest settings that fit (memory/fit.py): weights and optimizer are planned before anything reaches the
        GPU, then probes measure and verify."""
        self.restore_allocator = apply_allocator_settings(memory.allocator, self.adapter.device, self.notes)
        card = card_budget(memory.auto_fit, self.adapter.device, self.comfy_reserve())
        budget = None if card is None else card.usable()
        if card is not None:
            self.notes.append(f"auto-fit: {memory.auto_fit.describe()} = a {card.card / GIB:.2f} GiB card; "
                              f"{CardBudget.outside_torch(self.adapter.device) / GIB:.2f} GiB of it is held outside "
                              f"PyTorch (CUDA context, libraries), {card.margin / GIB:.2f} GiB kept free for "
                              f"allocator rounding; {budget / GIB:.2f} GiB left for training")
        if budget is None:
            self.configure(memory)
            if self.unplaced is not None:
                raise self.unplaced
            lines, self.compiled_batch = compile_before_first_step(self.compiled, self)
            estimate = self.estimate()
        else:
            # The planner's probes run uncompiled (each plan's shapes and dtypes would be a full compile of their
            # own); compiled code needs less memory than they measure. Then the fitted settings compile.
            estimate, lines = fit_to_card(self, memory, card)
            compile_lines, self.compiled_batch = compile_before_first_step(self.compiled, self)
            lines += compile_lines
            if self.compiled_batch:
                estimate = self.estimate()  # the compiled run's own, for the report
        keep_graphs_within_limit(self, estimate)
        if self.is_compiled:
            self.compiled.training_starts()
        self.estimated_peak = estimate.total
        return estimate, lines

    def comfy_reserve(self) -> int:
        """VRAM the host application keeps for itself (ComfyUI's --reserve-vram), from the adapter."""
        return int(self.adapter.reserved_vram())

    def estimate(self, raise_oom: bool = False, measured: list | None = None,
                 sides: tuple[float, ...] = PROBE_SIDES) -> MemoryEstimate:
        """Exact static terms, plus probed activations on CUDA (throwaway steps: the run's RNG stream is untouched)."""
        flat = getattr(self.optimizer, "leanlora_flat", None)  # what the optimizer keeps state for
        estimate = static_terms(self.unet, self.params, type(self.optimizer).__name__, self.adapter.device,
                                state_params=flat.state_shapes() if flat is not None else None)
        if self.ema is not None:  # its fp32 average counts with the LoRA weights (not as `other` when probed)
            estimate.lora_parameters += self.ema.nbytes
        if self.text_encoder is not None:  # its LoRA, gradients and optimizer state are in self.params already
            estimate.frozen_weights += self.text_encoder.frozen_bytes(self.adapter.device)
        # Compiled blocks: probe the shape compile_before_first_step compiled, once (another probe shape would cost a full
        # compile); before or without a compile step, probe uncompiled.
        at_run_shape = self.is_compiled and self.compiled_batch == self.run_batch_size()
        uncompiled = self.compiled.uncompiled() if self.is_compiled and not at_run_shape else contextlib.nullcontext()
        try:
            with uncompiled:
                return probe_activations(estimate, self.throwaway_step,
                                         self.largest_batch(self.compiled_batch if at_run_shape else 1),
                                         self.memory.batch_size, self.adapter.device, *self.held_between_steps(),
                                         at_run_shape=at_run_shape, measured=measured, sides=sides)
        except Exception as error:
            if not is_out_of_memory(error) or raise_oom:
                raise
            self.free_failed_step(error)
            self.notes.append("the memory probe itself ran out of memory; training relies on OOM recovery")
            return estimate

    def training_kernels(self):
        """The host's switch to kernels that have a backward, where it has one (ComfyAdapter.training_kernels)."""
        return getattr(self.adapter, "training_kernels", contextlib.nullcontext)()

    def free_failed_step(self, error: BaseException) -> None:
        """After a step that ran out of memory: its gradients go, and the memory its frames held (pinned by the
        error's traceback) goes back to the driver."""
        self.optimizer.zero_grad(set_to_none=True)
        while error is not None:  # and the errors it was raised while handling (autograd's engine re-raises)
            error.__traceback__ = None
            error = error.__cause__ or error.__context__
        gc.collect()
        memory = device_memory(self.adapter.device)
        if memory is not None:
            memory.empty_cache()

    def held_between_steps(self) -> tuple[int, int]:
        """Bytes of LoRA gradients kept allocated between steps (flat ones are) and of optimizer state now."""
        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        gradients = sum(nbytes(p.grad) for p in self.params if p.grad is not None)
        state = sum(nbytes(v) for per_param in self.optimizer.state.values() for v in per_param.values()
                    if isinstance(v, torch.Tensor) and v.device.type == self.adapter.device.type)
        return gradients, state

    def largest_batch(self, batch_size: int = 1) -> tuple:
        """The largest sample, `batch_size` times: the biggest bucket sets the peak."""
        return collate([self._largest_sample()] * batch_size, self.adapter.sequence_conditioning)

    def run_batch_size(self, batch_size: int | None = None) -> int:
        """How many images the largest bucket's batches hold: the batch size (the run's, or `batch_size`), or the
        whole bucket (with its repeats) where that is smaller."""
        shape = self._largest_sample().latent.shape
        in_bucket = sum(sample.latent.shape == shape for sample in self.cache) * self.repeats
        return min(batch_size or self.memory.batch_size, in_bucket)

    def _largest_sample(self) -> CachedSample:
        return max(self.cache, key=lambda sample: sample.latent.numel())

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None and not self.compiled.failed

    def throwaway_step(self, batch) -> None:
        """Forward + backward (eager, with the run's precision and activation offload), gradients discarded and
        the run's RNG stream untouched (the training steps draw the same noise with or without it)."""
        rng = self.generator.get_state()
        try:
            with self.training_kernels():
                self.micro_step.throwaway(self.inputs(batch))
        finally:  # also when it failed part-way (compile errors, out of memory): no gradients left behind
            self.generator.set_state(rng)
            self.optimizer.zero_grad(set_to_none=True)

    def inputs(self, batch) -> dict[str, torch.Tensor]:
        """One batch with its random draws, on the device. Copies go through pinned memory without blocking,
        so preparing the next step overlaps the GPU's work on this one."""
        clean, cond = batch
        draws = draw_noise(self.sampling_on_cpu, clean.shape, self.generator, self.timestep_sampling,
                           self.train.noise_offset, self.train.timestep_shift, self.train.multires_noise_iterations,
                           self.train.multires_noise_discount, self.adapter.resolution_shift(tuple(clean.shape[-2:])))
        if seed_lora_dropout(self.unet) is not None:  # drawn only with dropout: other runs keep their noise
            draws["dropout_seed"] = torch.randint(0, 2 ** 31, (), generator=self.generator)
        mask = {"mask": cond[MASK_KEY]} if MASK_KEY in cond else {}  # masked_loss
        return self._on_device({"clean": clean, **draws, **mask,
                                **{f"cond.{name}": value for name, value in cond.items() if name != MASK_KEY}})

    def _on_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """All but the trained text encoder's tokens, which it reads on the host (text_encoder.TOKEN_KEY)."""
        device = self.adapter.device
        tokens = {name: t for name, t in tensors.items() if is_token_entry(name.removeprefix("cond."))}
        tensors = {name: t for name, t in tensors.items() if name not in tokens}
        if device.type != "cuda":
            return {**{name: t.to(device) for name, t in tensors.items()}, **tokens}
        return {**{name: t.pin_memory().to(device, non_blocking=True) for name, t in tensors.items()}, **tokens}

    def compute_loss(self, inputs: dict[str, torch.Tensor], loss: LossFunction | None = None) -> torch.Tensor:
        if "dropout_seed" in inputs:  # read by the forward and by checkpointing's recompute in backward
            seed_lora_dropout(self.unet).feed(inputs["dropout_seed"])
        cond = {name[len("cond."):]: t for name, t in inputs.items() if name.startswith("cond.")}
        if self.text_encoder is not None:  # the captions through the trained encoder, with gradients
            cond = self.text_encoder.condition(cond)
        predict = lambda x, t, c: self.adapter.predict(self.unet, x, t, c)  # noqa: E731
        # the mask weighs the training loss only: validation's plain MSE stays comparable between runs
        return denoising_loss(self.adapter.model_sampling, predict, inputs["clean"], cond, inputs["noise"],
                              inputs["sigma"], inputs["timestep"], loss or self.loss_function,
                              inputs.get("mask") if loss is None else None)

    def loss(self, batch) -> torch.Tensor:
        return self.compute_loss(self.inputs(batch))

    def forward_loss(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The training loss of one batch whose draws are given (validation): forward only, without gradients,
        with the run's precision, eagerly (outside CUDA graphs; compiled blocks would compile a no-grad variant)
        and in eval mode (LoRA dropout off). Every random stream, the optimizer and the gradients stay as they
        were: training goes on as if it had not run. Always plain MSE, whatever the training loss is (Huber,
        min-SNR weighting): with the fixed draws, validation numbers stay comparable between runs."""
        was_training = self.unet.training
        device = self.adapter.device
        uncompiled = self.compiled.uncompiled() if self.is_compiled else contextlib.nullcontext()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), \
                    uncompiled, self.precision.autocast():
                self.unet.eval()
                return self.compute_loss(self._on_device(inputs), PLAIN_MSE).float()
        finally:
            self.unet.train(was_training)

    def run(self, events: RunEvents | None = None, until: int | None = None) -> LoopResult:
        """Steps from steps_done to `until` (the run's total by default), telling `events` (loop.LoopEvents, and
        `on_recovery`). An out-of-memory inside a step (or, under auto-fit, a first CUDA graph too big for the card)
        frees memory, moves one rung down the memory ladder and repeats that step (self.recoveries says where)."""
        events = events if events is not None else RunEvents()
        memory = device_memory(self.adapter.device)
        while True:
            try:
                with memory.computing() if memory is not None else contextlib.nullcontext(), self.training_kernels():
                    parts = StepParts(self.params, self.step, self.optimizer, self.precision,
                                      self.memory.gradient_accumulation, lr_schedule=self.lr_schedule,
                                      reduce=self.distributed.reduce if self.distributed is not None else None)
                    result = train_loop(parts, self.data, until or self.train.steps, _Counted(self, events),
                                        first_step=self.steps_done)
                if result.diverged_at is not None:  # the weights went back to the last step checked finite
                    self.steps_done = result.steps_done
                return result
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                graph_too_big = isinstance(error, GraphDoesNotFit)
                cause = "the CUDA graph would not fit the card" if graph_too_big else "out of memory"
                rung = recover(self, error, self.adapter.device)
                self.recoveries.append(Recovery(self.steps_done + 1, rung, cause))
                events.on_recovery(self.recoveries[-1])

    def _mark_step_start(self, done: int) -> None:
        # A step stopped part-way (Cancel, out of memory) has drawn batches and noise already: a state written
        # after it takes the RNG and batch order from before that step, so a resume draws what it would have.
        self.step_start = (done, rng_states(self.generator), self.data.state_dict())

    @contextlib.contextmanager
    def evaluation_weights(self):
        """The LoRA weights as samples, validation and the saved file see them: schedule-free AdamW's average
        (optimizers.evaluation_weights), or the EMA with ema_decay on; the trained weights come back after."""
        with evaluation_weights(self.optimizer), \
                (self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()):
            yield

    def close(self) -> None:
        """Ends the run: releases captured graphs (and their memory pool) and puts the allocator setting back.
        The training copy stays the caller's (its LoRA is still to be saved)."""
        self.notes = run_notes(self)
        self.micro_step = self.step = None
        self.restore_allocator()
        self.restore_allocator = lambda: None

    def release(self) -> None:
        """After the LoRA is saved (the training copy already moved off the device by the adapter): drops the
        optimizer state, gradients, batches, compiled blocks and the training copy, which refer to each other in
        cycles (bound step functions, wrapped forwards) that reference counting alone never frees, then gives the
        device memory back to the driver, so that what runs next (the KSampler after Train) finds the card as
        it was."""
        for param in self.params:
            param.grad = None
        self.optimizer = self.lr_schedule = self.data = self.micro_step = self.step = self.compiled = None
        self.unet = self.params = self.cache = self._checkpoint_units = self.step_start = None
        self.text_encoder = None
        gc.collect()
        if self.adapter.device.type == "cuda":
            torch.cuda.synchronize(self.adapter.device)
            torch.cuda.empty_cache()  # the native allocator's cache; under cudaMallocAsync the pool is trimmed
            trim_graph_memory(self.adapter.device)  # and the driver's graph pool (uncounted by PyTorch)
        trim_host_memory()


class RunEvents(LoopEvents):
    """What TrainingSession.run tells its caller: the loop's events, and each memory recovery."""

    def on_recovery(self, recovery: Recovery) -> None:
        """After an out-of-memory moved the run one rung down the ladder (the step is repeated)."""


class _Counted(LoopEvents):
    """The caller's events, with what the session keeps at each: the step count, the EMA, where a step began."""

    def __init__(self, session: TrainingSession, events: LoopEvents):
        self.session, self.events = session, events
        self.cancel_errors, self.sync_every = events.cancel_errors, events.sync_every
        self.save_every, self.evaluate_every = events.save_every, events.evaluate_every

    def should_stop(self) -> bool:
        return self.events.should_stop()

    def on_step_start(self, done: int) -> None:
        self.session._mark_step_start(done)
        self.events.on_step_start(done)

    def after_step(self) -> None:
        if self.session.ema is not None:
            self.session.ema.update()
        self.events.after_step()

    def on_step(self, info: StepInfo) -> None:
        self.session.steps_done = info.step
        self.events.on_step(info)

    def on_evaluate(self, step: int) -> None:
        self.events.on_evaluate(step)

    def on_save(self, step: int) -> None:
        self.events.on_save(step)
