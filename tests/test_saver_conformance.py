"""Every memory saver (a MemorySettings lever auto-fit or the user can turn on to trade speed for device memory) meets
one contract, as tests/test_families.py holds every family to one: on the tiny SD1.5 checkpoint, trained by the
product's TrainingSession (its private training copy, configure, run, close, release) on the CPU against a
simulated card (trainer/device/card.py),
- it learns what the run without it learns: the same losses and LoRA within the tolerance its case states;
- the device bytes it claims to save (its term of the memory estimate, measured on the card) fall, and the card's
  peak does not rise (where the bytes show on CUDA only, its case says why and which test measures them there);
- the report's plan line names it;
- docs/ARCHITECTURE.md's "Adding a memory technique" page lists it, and it has its step in configure's
  TrainingSession.INSTALL_ORDER;
- it uninstalls cleanly: ComfyUI's model after the run equals the model before (weights, dtypes, devices, forwards).
A new MemorySettings field is either a saver case here or named in NOT_SAVERS with the reason."""
from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch

from trainer.device.card import SimulatedCard
from trainer.settings import Attention, BaseWeights, CheckpointDepth, LoraSettings, LoraWeights, MemorySettings, \
    TrainSettings

REPO = Path(__file__).resolve().parents[1]
STEPS = 2  # the LoRA's A matrices move from the second step on (B starts at zero)
# fp32, eager steps, PyTorch's SDPA (ComfyUI's CPU default, sub-quadratic attention, asks psutil for free memory
# mid-forward, which dynamo cannot trace), nothing saved: the run every saver is compared with, unless its case
# names another (a saver that builds on one, as streaming does on fp8)
PLAIN = MemorySettings("no", False, 1, 1, fast_path="off", attention=Attention.SDPA)
# Exact savers reorder float sums only (recompute, copies to host and back): fp32 noise over three Adam steps.
EXACT = 1e-4


@dataclass(frozen=True)
class Saver:
    name: str
    fields: dict  # what turns it on, over `base`
    install: str  # its TrainingSession.INSTALL_ORDER step
    words: str  # what the report's plan line says of it
    claims: str | None  # the MemoryEstimate term it shrinks; None where it saves nothing by itself (a speed lever)
    tolerance: float = EXACT  # the largest relative difference of the LoRA's change over the run
    loss_tolerance: float | None = None  # of each step's loss (`tolerance` where None)
    base: dict = field(default_factory=dict)  # over PLAIN: the run it is compared with
    on_card: bool = True  # trained against the simulated card (compiled kernels allocate outside its dispatch)
    needs: str | None = None  # why the CPU cannot run it, where it cannot
    claim_on_cuda: str | None = None  # why the bytes it saves show on CUDA only (the rest is checked here)

    @property
    def without(self) -> MemorySettings:
        return replace(PLAIN, **self.base)

    @property
    def settings(self) -> MemorySettings:
        return replace(self.without, **self.fields)


OPTIMIZER = "optimizer (8-bit state, bf16 LoRA weights)"  # the INSTALL_ORDER step of the optimizer's savers
STREAMED_40 = dict(base_weights=BaseWeights.FP8_STREAMED, stream_share=0.4, gradient_checkpointing=True)
SAVERS = (
    Saver("gradient checkpointing", dict(gradient_checkpointing=True), "gradient checkpointing",
          "gradient checkpointing on (per layer)", "activations"),
    Saver("checkpoint share", dict(gradient_checkpointing=True, checkpoint_share=0.4), "gradient checkpointing",
          "gradient checkpointing on (per layer, 40% of the blocks)", "activations"),
    Saver("checkpoint depth block", dict(gradient_checkpointing=True, checkpoint_depth=CheckpointDepth.BLOCK),
          "gradient checkpointing", "gradient checkpointing on (per block)", "activations"),
    Saver("selective recompute", dict(gradient_checkpointing=True, selective_recompute=True), "gradient checkpointing",
          "selective: matmul/attention outputs kept", "activations"),
    # fp8 rounds every frozen weight (3 mantissa bits): the losses stay within 5%, but Adam's first steps move each
    # LoRA weight by the learning rate whatever its gradient's size, so each near-zero gradient whose sign the
    # rounding flips moves its weight the other way (measured 0.33 here; an unrelated LoRA would be ~1.4)
    Saver("fp8 base weights", dict(base_weights=BaseWeights.FP8), "fp8 / streamed base weights",
          "base weights fp8", "frozen_weights", tolerance=0.5, loss_tolerance=0.05),
    # streaming moves fp8 weights between host and card: bit for bit the fp8 run (with its full checkpointing)
    Saver("streaming a share", STREAMED_40, "fp8 / streamed base weights",
          "base weights fp8 streamed from CPU (40% of them)", "frozen_weights",
          base=dict(base_weights=BaseWeights.FP8, gradient_checkpointing=True)),
    Saver("streaming every weight", dict(base_weights=BaseWeights.FP8_STREAMED, gradient_checkpointing=True),
          "fp8 / streamed base weights", "base weights fp8 streamed from CPU,", "frozen_weights",
          base=dict(base_weights=BaseWeights.FP8, gradient_checkpointing=True)),
    Saver("prefetch of streamed weights", dict(prefetch_streamed=True), "step: CUDA graphs, activation offload, "
          "prefetch", "fetched a layer ahead", None, base=STREAMED_40),
    Saver("activation offload", dict(activation_offload=True), "step: CUDA graphs, activation offload, prefetch",
          "activations offloaded to CPU RAM", "activations",
          claim_on_cuda="it moves CUDA tensors only (ActivationOffload packs tensor.is_cuda): "
                        "tests/test_fast_path.py measures them off the GPU"),
    # blockwise 8-bit moments: Adam's first steps divide by them, so the update differs by their rounding
    Saver("8-bit AdamW", dict(optimizer="AdamW8bit"), OPTIMIZER, "optimizer AdamW8bit",
          "optimizer_state", tolerance=0.05),
    Saver("8-bit Lion", dict(optimizer="Lion8bit"), OPTIMIZER, "optimizer Lion8bit",
          "optimizer_state", tolerance=0.05, base=dict(optimizer="Lion")),
    Saver("paged 8-bit AdamW", dict(optimizer="PagedAdamW8bit"), OPTIMIZER, "optimizer PagedAdamW8bit",
          "optimizer_state", needs="bitsandbytes pages through CUDA unified memory"),
    # bf16 rounds activations and weights at every op (8 mantissa bits): as fp8, sign flips of near-zero gradients
    # (measured 0.089 here)
    Saver("mixed precision bf16", dict(mixed_precision="bf16"), "mixed precision", "precision bf16",
          "activations", tolerance=0.15, loss_tolerance=0.05),
    # stochastic rounding of the bf16 LoRA weights: the same bf16 run up to one bf16 step of each weight
    Saver("bf16 LoRA weights", dict(lora_weights=LoraWeights.BF16_STOCHASTIC_ROUNDING), OPTIMIZER,
          "LoRA weights bf16 + stochastic rounding", "lora_parameters", tolerance=0.05,
          base=dict(mixed_precision="bf16")),
    # inductor's C++ kernels fuse and reorder fp32 sums (test_train_inprocess: losses within 1e-3)
    Saver("torch.compile", dict(compile=True), "compile", "torch.compile", None, tolerance=1e-3, on_card=False),
    Saver("CUDA graphs", dict(fast_path="cuda_graphs"), "step: CUDA graphs, activation offload, prefetch",
          "fast path CUDA graphs", None, needs="graph capture needs CUDA (tests/test_fast_path.py)"),
)
# MemorySettings fields that are no saver of their own, and why
NOT_SAVERS = {
    "batch_size": "with gradient_accumulation, auto-fit's batch split: it changes the step's random draws, not "
                  "only its memory; its agreement is the agreement run's (issue 44), its rung "
                  "tests/test_card_budget.py's",
    "gradient_accumulation": "see batch_size",
    "auto_fit": "chooses among the savers (tests/test_auto_fit_planner.py, tests/test_simulated_card.py)",
    "latent_cache": "host RAM and disk before training, not the step's device memory (tests/test_cache_store.py)",
    "attention": "the attention kernel ComfyUI runs (its own memory behaviour), not one of this pack's mechanisms",
    "allocator": "the CUDA caching allocator's setting, nothing to run on a CPU (tests/test_cuda_allocators.py)",
    "ram": "the host-RAM limit auto-fit plans within (memory/host_ram.py), not a saver of device memory",
    "gpus": "which GPUs run the job (nodes/workers.py): each rank plans its own card (tests/test_node_gpus.py)",
}


def _model_state(adapter) -> dict:
    """ComfyUI's model as the user holds it: every tensor's values, dtype and device, and every module's forward."""
    model = adapter.base
    tensors = {name: (t.detach().clone(), t.dtype, t.device) for name, t in model.state_dict(keep_vars=True).items()}
    forwards = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    return {"tensors": tensors, "forwards": forwards}


@dataclass
class Run:
    losses: list[float]
    lora_change: list[torch.Tensor]  # each LoRA tensor after the run less before it
    plan: str  # the report's plan line (MemorySettings.describe of the settings the session ran)
    notes: list[str]
    # bytes on the simulated card (None off it): what placing put there, what stays between steps (weights, LoRA,
    # optimizer state, gradients dropped) and the step's own peak above what was there before it
    placed: int | None = None
    held: int | None = None
    transient: int | None = None


@pytest.fixture(scope="module")
def cache(comfy_objects, dataset):
    """The tiny dataset's two images, encoded once: every run trains on the same latents and embeddings."""
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.cache import build_cache
    adapter = ComfyAdapter(*comfy_objects)
    return build_cache(dataset, adapter.encode_image, adapter.encode_text)


_runs: dict[tuple[MemorySettings, bool], Run] = {}


def _train(adapter, cache, memory: MemorySettings, on_card: bool) -> Run:
    """STEPS steps of the product's session (the private training copy, its LoRA, configure and run as OOM recovery
    drives them, then close and release) with `memory`, each settings once per module."""
    from trainer.lora import inject_lora
    from trainer.session import TrainingSession
    from helpers import sd_targets
    if (memory, on_card) in _runs:
        return _runs[memory, on_card]
    lora = LoraSettings(rank=4, alpha=4.0)
    card = SimulatedCard(gib=1.0, context_gib=0.0)
    unet = adapter.training_unet()
    params = inject_lora(unet, lora, 0, target_modules=sd_targets(lora))
    unet.train()
    initial = [p.detach().float().clone() for p in params]
    session = TrainingSession(adapter, unet, params, cache, 1, TrainSettings(STEPS, 1e-3, 0))
    with card.installed() if on_card else contextlib.nullcontext():
        session.configure(memory)
        placed = card.allocated()
        result = session.run()
        for param in session.params:
            param.grad = None
        held = card.allocated()
        change = [p.detach().float() - before for p, before in zip(session.params, initial)]
        run = Run(result.losses, change, session.memory.describe(), list(session.notes))
        if on_card:
            run.placed, run.held, run.transient = placed, held, card.peak_allocated() - placed
        session.close()
        session.release()
    _runs[memory, on_card] = run
    return run


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# which Run measure holds each estimate term a saver claims: the weights as placed, state between steps, the step's
CLAIMED = {"frozen_weights": "placed", "optimizer_state": "held", "lora_parameters": "held", "activations": "transient"}


@pytest.mark.parametrize("saver", SAVERS, ids=[saver.name.replace(" ", "_") for saver in SAVERS])
def test_saver_learns_what_the_run_without_it_learns_saves_what_it_claims_and_leaves_the_model_as_it_was(
        adapter, cache, saver):
    if saver.needs:
        pytest.skip(f"{saver.name}: {saver.needs}")
    before = _model_state(adapter)
    plain = _train(adapter, cache, saver.without, saver.on_card)
    saved = _train(adapter, cache, saver.settings, saver.on_card)
    after = _model_state(adapter)

    # the plan line names it (and the run without it does not)
    assert saver.words in saved.plan and saver.words not in plain.plan, (saved.plan, plain.plan)

    # the same losses and LoRA, within its tolerance
    assert len(saved.losses) == STEPS
    loss_tolerance = saver.tolerance if saver.loss_tolerance is None else saver.loss_tolerance
    assert saved.losses == pytest.approx(plain.losses, rel=loss_tolerance), (saved.losses, plain.losses)
    change, plain_change = (torch.cat([t.flatten() for t in run.lora_change]) for run in (saved, plain))
    differs = _relative(change, plain_change)
    assert differs <= saver.tolerance, f"{saver.name}: the LoRA's change differs by {differs:.2e} (tolerance " \
                                       f"{saver.tolerance})"

    # the bytes it claims to save fall, and the card's peak does not rise (a speed lever claims none: what it holds
    # for its speed, the prefetch's layers ahead, is its own tests')
    if saver.on_card and saver.claims is not None and saver.claim_on_cuda is None:
        measure = CLAIMED[saver.claims]
        claimed, without = getattr(saved, measure), getattr(plain, measure)
        assert claimed < without, f"{saver.name}: {measure} {claimed} bytes, {without} without it"
        assert saved.placed + saved.transient <= plain.placed + plain.transient, \
            f"{saver.name}: the card peaked at {saved.placed + saved.transient} bytes, " \
            f"{plain.placed + plain.transient} without it"

    # ComfyUI's model is as it was: the saver changed the private training copy only
    assert after["forwards"] == before["forwards"]
    assert after["tensors"].keys() == before["tensors"].keys()
    for name, (tensor, dtype, device) in before["tensors"].items():
        now, now_dtype, now_device = after["tensors"][name]
        assert (now_dtype, now_device) == (dtype, device) and torch.equal(now, tensor), name


def test_every_memory_setting_is_a_saver_here_or_named_as_none():
    """A new MemorySettings field gets its saver case (or its reason in NOT_SAVERS): the contract covers it."""
    covered = {name for saver in SAVERS for name in saver.fields} | set(NOT_SAVERS)
    fields = {f.name for f in dataclasses.fields(MemorySettings)}
    assert fields - covered == set(), "add a Saver case (or a NOT_SAVERS reason) for these MemorySettings fields"
    assert covered <= fields


def test_every_saver_is_on_the_architecture_page_and_has_its_install_step():
    from trainer.session import TrainingSession
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    page = re.search(r"### Adding a memory technique\n(.*?)\n## ", text, re.S)
    assert page, "docs/ARCHITECTURE.md has no 'Adding a memory technique' page"
    steps = {step.name for step in TrainingSession.INSTALL_ORDER}
    for saver in SAVERS:
        assert saver.install in steps, f"{saver.name}: no INSTALL_ORDER step {saver.install!r}"
        for name in saver.fields:
            assert f"`{name}`" in page.group(1), f"{saver.name}: `{name}` is not on the page"
