"""The GPU server matrix: the Train node as users run it, in a real ComfyUI server, under emulated card sizes.

    python -m bench.server_matrix --plan core --out DIR [--comfyui PATH] [--budget-s S] [--only NAME,...]
    python -m bench.server_matrix --plan smoke --tiny --out DIR      # CPU: tiny SD1.5, no caps, no NVML
    python -m bench.server_matrix --plan core --list                 # the plan, with time estimates

Each server is a real ComfyUI (.cache/comfyui, or --comfyui PATH, e.g. 0.33) with only this pack, started through
bench/comfy_launcher.py. A card of N GiB (--emulation, default holder; env BENCH_CARD_EMULATION):
- holder: before the server starts, bench/card_holder.py (a separate process, plain device allocations) takes
  the rest of the device, so the server's free memory is the card's and running out of it is a real
  out-of-memory error; the launcher reports the card's total (N GiB) from mem_get_info and keeps the fraction
  cap below as a second check. The NVML baseline is taken with the holder up: peaks are used - holder - idle.
- fraction: the whole process capped to N GiB (set_per_process_memory_fraction before ComfyUI's main runs,
  keeping the allocator ComfyUI picks: cudaMallocAsync by default, PyTorch's native one with
  --disable-cuda-malloc) and told the same with --reserve-vram <total - N> (what every row used until 6 Dec).
Each row records which (card_emulation) and the holder's bytes. Its jobs are API-format prompts queued
over HTTP in order (loaders -> LeanLoRA Dataset / Memory Settings / LoRA Config / Train -> KSampler -> images, and
the Train report into PreviewAny); a re-queue is the next job in the same server, a cancel is POST /interrupt once
the job has reported K steps.

Per job: status, error, whether the server is still alive (process running and GET /system_stats answering),
NVML device-level used memory (baseline before the server started, peak during the job, sampled every 20 ms in a
thread of this process, which never touches CUDA itself), torch's peak (the Train report's "peak VRAM" line),
steady-state s/step (the trainer's own clock in the `leanlora.progress` step events on the websocket: the
node forwards each step with `seconds` since the loop started, read after the device sync that ends each burst of
8 steps; s/step = time between the end of the first burst, which holds warm-up and graph capture, and the last
step, over the steps between), and the whole job's wall time (queue -> done). A hung job is interrupted, then the
server killed; a dead or hung server is recorded with its log tail (abort lines included) and restarted for the
next job. The time budget skips what would not finish (recorded as skipped); results.json is rewritten after
every job, the markdown table printed at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
from bench.card_holder import CardHolder  # noqa: E402  (it also runs as a script of its own: the holder process)

PACK_NAME = "LeanLoRA"
EMULATIONS = ("holder", "fraction")
DEFAULT_EMULATION = os.environ.get("BENCH_CARD_EMULATION", "holder")
GIB = 2 ** 30
ASSET_FOLDERS = ("checkpoints", "unet", "diffusion_models", "clip", "text_encoders", "vae")
# What "the process aborted" looks like in a ComfyUI log (CUDA errors raise no Python exception there).
ABORT_PATTERN = re.compile(r"terminate called|Aborted|core dumped|Segmentation fault|AcceleratorError|"
                           r"CUDA error|uncaptured free|illegal memory access|Fatal Python error|Killed")
# Uncapped fast-preset step times the speed targets are ratios of (H200), when the run has no fast row.
REFERENCE_FAST_S = {"sdxl": 0.085, "sd15": 0.0204}

# --- settings: LeanLoRA Memory Settings inputs ---------------------------------------------------------------

# The README's presets as LeanLoRA Memory Settings inputs (the node has no preset input; bench/run.py uses the same).
FAST = {"mixed_precision": "bf16", "gradient_checkpointing": False, "batch_size": 1, "gradient_accumulation": 1,
        "optimizer": "AdamW", "base_weights": "as loaded", "auto_fit": "off", "latent_cache": "RAM",
        "attention": "auto"}
PRESETS = {
    "fast": FAST,
    "balanced": {**FAST, "gradient_checkpointing": True},
    "lean": {**FAST, "gradient_checkpointing": True, "optimizer": "AdamW8bit", "base_weights": "fp8",
             "activation_offload": True},
    "leanest": {**FAST, "gradient_checkpointing": True, "optimizer": "AdamW8bit",
                "base_weights": "fp8 streamed from CPU", "activation_offload": True},
}


def settings(preset: str, **changes) -> dict:
    """A preset's inputs with changes; auto_fit="N GiB"/"free VRAM" starts from fast, as the trainer's ladder does."""
    return {**PRESETS[preset], **changes}


# --- plans ---------------------------------------------------------------------------------------------------

@dataclass
class Job:
    """One queued prompt. kind "train": Train + KSampler with the trained MODEL (+ the base MODEL when
    sample_base); kind "sample": the base MODEL only (the before-image of a byte-identity check); kind "peer":
    ComfyUI's own TrainLoraNode (comfy_extras/nodes_train.py) in the same server, a peer run as users run it."""
    name: str
    memory: dict = field(default_factory=dict)
    steps: int = 110
    kind: str = "train"
    cancel_after: int | None = None    # POST /interrupt once this many steps were reported
    framing: str = "center crop (square)"
    sample_base: bool = False
    form: str | None = None            # the server's form unless set: "split" or "checkpoint"
    est_step_s: float = 0.15           # for the time budget (H200)
    est_setup_s: float = 25.0          # queue -> first step (loading, caching, probes, capture; compile)
    timeout_s: float = 240.0
    train_extra: dict = field(default_factory=dict)  # more Train inputs (save_every_n_steps, resume, ...)
    output_name: str | None = None     # the LoRA's name; None: one per job (matrix_<run tag>)
    peer_inputs: dict = field(default_factory=dict)  # kind "peer": TrainLoraNode inputs beside its defaults
    lora_dropout: float = 0.0          # LeanLoRA LoRA Config's dropout (graphed since 0c3427a; eager before)
    kill_after: int | None = None      # SIGKILL the ComfyUI process once this many steps were reported (a crash);
    #                                    the next job starts a server on the same folders (its states, its LoRAs)
    trace_every: int = 0               # every N steps: trainer clock, NVML used and the server's RSS (a soak)
    lora_config: dict = field(default_factory=dict)  # more LeanLoRA LoRA Config inputs (type: loha, lokr, ...)
    load_lora: str | None = None       # kind "lora_load": this LoRA (an output_name) through LoraLoaderModelOnly
    check: str = "speed"               # "speed": >= 100 steps after the first burst; "fits": fewer, memory only;
    #                                    "check": no training (base image, LoRA loading)


@dataclass
class Server:
    name: str
    model: str                          # "sdxl" or "sd15"
    jobs: list[Job]
    form: str = "split"                 # "split": UNETLoader + (Dual)CLIPLoader + VAELoader; "checkpoint"
    card_gib: float | None = None       # None: the whole device
    native_allocator: bool = False      # --disable-cuda-malloc
    extra_args: tuple[str, ...] = ()
    base_identity: bool = False         # the first job's base image must equal every later base image
    lora_identity: tuple[str, str] | None = None  # two jobs (with output_name) whose LoRA tensors must be equal
    # ComfyUI 0.33: also --vram-headroom <total - N>, DynamicVRAM's own "keep this much of the device free, other
    # processes counted" (NVML): comfy-aimdo allocates outside PyTorch, where the per-process cap cannot reach
    aimdo_headroom: bool = False
    est_start_s: float = 15.0
    # after every job, what the idle server holds (NVML over the baseline, its RSS), and after the last job the same
    # once ComfyUI's cached models were unloaded (POST /free): what a job leaves behind (issue 34)
    held_memory: bool = False
    emulation: str | None = None        # "holder" / "fraction" for a card; None: the matrix's --emulation
    families: str | None = None         # the launcher's --families (bench/dit_launcher.py), e.g. "generic"


def _fit(card: float) -> str:
    return f"{card:g} GiB"


def plan_core() -> list[Server]:
    """Default allocator, the pinned ComfyUI: SDXL uncapped (fast, re-queue balanced, cancel + new queue), SDXL
    auto-fit at 6/4/3/8/12 GiB, SD1.5 auto-fit at 2/3 GiB and fast uncapped. Most important first: under a 9-minute
    command the budget may skip the last one (SD1.5 fast; "more" measures it too)."""
    sdxl = [Server("sdxl_24_default", "sdxl", [
        Job("fast", settings("fast"), est_step_s=0.09, est_setup_s=25),
        Job("requeue_balanced", settings("balanced"), est_step_s=0.12, est_setup_s=10),
        Job("cancel_fast", settings("fast"), steps=400, cancel_after=16, est_step_s=0.09, est_setup_s=6),
        Job("after_cancel_balanced", settings("balanced"), steps=30, est_step_s=0.12, est_setup_s=8)],
        card_gib=24)]
    for card, step_s in ((6, 0.16), (4, 0.2), (3, 0.35), (8, 0.13), (12, 0.1)):
        sdxl.append(Server(f"sdxl_{card}_default", "sdxl", [
            Job(f"autofit_{card}", settings("fast", auto_fit=_fit(card)), est_step_s=step_s, est_setup_s=30)],
            card_gib=card))
    sd15 = [Server(f"sd15_{card}_default", "sd15", [
        Job(f"autofit_{card}", settings("fast", auto_fit=_fit(card)), est_step_s=0.06, est_setup_s=15)],
        card_gib=card, est_start_s=12) for card in (2, 3)]
    sd15.append(Server("sd15_24_default", "sd15", [Job("fast", settings("fast"), est_step_s=0.03, est_setup_s=15)],
                       card_gib=24, est_start_s=12))
    return sdxl + sd15


def plan_more() -> list[Server]:
    """The presets as they are (lean, leanest), cancel inside graphed lean steps, compile, fast path off, auto-fit
    free VRAM under a cap, the native allocator, the checkpoint form, SD1.5's presets. Most important first; the
    budget skips the tail of a 9-minute command (plan "extra" has what is left)."""
    return [
        Server("sdxl_24_default_presets", "sdxl", [
            Job("lean", settings("lean"), est_step_s=0.15, est_setup_s=25),
            Job("cancel_lean", settings("lean"), steps=400, cancel_after=16, est_step_s=0.15, est_setup_s=8),
            Job("fast_compile", settings("fast", compile=True), est_step_s=0.08, est_setup_s=80, timeout_s=300),
            Job("leanest", settings("leanest"), est_step_s=0.32, est_setup_s=12),
            Job("lean_fast_path_off", settings("lean", fast_path="off"), steps=24, est_step_s=1.6, est_setup_s=10)],
            card_gib=24),
        Server("sdxl_6_native", "sdxl", [
            Job("autofit_6", settings("fast", auto_fit=_fit(6)), est_step_s=0.16, est_setup_s=30)],
            card_gib=6, native_allocator=True),
        Server("sdxl_8_default_checkpoint", "sdxl", [
            Job("autofit_free_vram", settings("fast", auto_fit="free VRAM"), est_step_s=0.13, est_setup_s=30),
            Job("requeue_balanced_fast_path_off", settings("balanced", fast_path="off", auto_fit=_fit(8)), steps=30,
                est_step_s=0.3, est_setup_s=10)],
            form="checkpoint", card_gib=8),
        Server("sd15_24_default_checkpoint", "sd15", [
            Job("fast", settings("fast"), est_step_s=0.03, est_setup_s=15),
            Job("lean", settings("lean"), est_step_s=0.05, est_setup_s=8),
            Job("leanest", settings("leanest"), est_step_s=0.09, est_setup_s=8)],
            form="checkpoint", card_gib=24, est_start_s=12),
    ]


def plan_extra() -> list[Server]:
    """What "more" leaves out: the native allocator uncapped with re-queues, a cancel in an auto-fitted low-VRAM
    server, SD1.5 compiled lean and aspect-ratio buckets (a second graph for the 5:4 image), SD1.5 native at 3 and 2 GiB,
    eager steps (LoRA dropout; fast path off with compiled blocks), and the presets, compile (its Triton kernels
    captured: only the native allocator allows it) and a cancel under the native allocator."""
    return [
        Server("sdxl_24_native", "sdxl", [
            Job("fast", settings("fast"), est_step_s=0.09, est_setup_s=25),
            Job("requeue_lean", settings("lean"), est_step_s=0.15, est_setup_s=10),
            Job("requeue_autofit_free_vram", settings("fast", auto_fit="free VRAM"), est_step_s=0.09, est_setup_s=12)],
            card_gib=24, native_allocator=True),
        Server("sdxl_4_default_cancel", "sdxl", [
            Job("cancel_autofit_4", settings("fast", auto_fit=_fit(4)), steps=400, cancel_after=16, est_step_s=0.2,
                est_setup_s=30),
            Job("after_cancel_autofit_free_vram", settings("fast", auto_fit="free VRAM"), steps=30, est_step_s=0.2,
                est_setup_s=12)],
            card_gib=4),
        Server("sd15_24_default_compile_buckets", "sd15", [
            Job("lean_compile", settings("lean", compile=True), est_step_s=0.035, est_setup_s=95, timeout_s=300),
            Job("buckets_fast", settings("fast"), framing="aspect-ratio buckets", est_step_s=0.03, est_setup_s=8)],
            card_gib=24, est_start_s=12),
        Server("sd15_3_native", "sd15", [
            Job("autofit_3", settings("fast", auto_fit=_fit(3)), est_step_s=0.05, est_setup_s=15)],
            card_gib=3, native_allocator=True, est_start_s=12),
        # the row whose streamed capture once aborted the server under cudaMallocAsync, here under the native one
        Server("sd15_2_native", "sd15", [
            Job("autofit_2", settings("fast", auto_fit=_fit(2)), est_step_s=0.05, est_setup_s=25)],
            card_gib=2, native_allocator=True, est_start_s=12),
        # LoRA dropout, which forced eager steps until 0c3427a (its masks now follow the step's seed: graphed), and
        # whether compiled blocks (Triton runs outside a capture under either allocator) bring an eager lean step
        # near the 3x graphed lean
        Server("sdxl_24_default_eager", "sdxl", [
            Job("lean_dropout", settings("lean"), lora_dropout=0.1, est_step_s=0.17, est_setup_s=30),
            Job("lean_compile_fast_path_off", settings("lean", compile=True, fast_path="off"), steps=40,
                est_step_s=0.6, est_setup_s=80, timeout_s=300)],
            card_gib=24),
        Server("sdxl_24_native_presets", "sdxl", [
            Job("fast_compile", settings("fast", compile=True), est_step_s=0.08, est_setup_s=80, timeout_s=300),
            Job("requeue_balanced", settings("balanced"), est_step_s=0.12, est_setup_s=10),
            Job("requeue_leanest", settings("leanest"), est_step_s=0.3, est_setup_s=12),
            Job("cancel_lean", settings("lean"), steps=400, cancel_after=16, est_step_s=0.15, est_setup_s=8),
            Job("after_cancel_fast", settings("fast"), steps=30, est_step_s=0.09, est_setup_s=8)],
            card_gib=24, native_allocator=True),
    ]


def plan_v033() -> list[Server]:
    """ComfyUI 0.33 (--comfyui PATH) with its default model patcher (DynamicVRAM on CUDA): sample -> train ->
    sample in one server with the base images pixel-identical, re-queue, cancel, small cards, the checkpoint form
    (0.33 re-runs the core loader for a non-inference copy). Most important first."""
    def identity_jobs(train: dict, step_s: float, setup_s: float) -> list[Job]:
        return [Job("sample_base_before", kind="sample", est_setup_s=15),
                Job("train_then_sample", train, sample_base=True, est_step_s=step_s, est_setup_s=setup_s)]

    def builtin(name: str, checkpointing: bool) -> Job:  # 0.33's own trainer with its offloading (2.02 s/step, 3 Dec)
        return Job(name, kind="peer", peer_inputs={"offloading": True, "gradient_checkpointing": checkpointing},
                   est_step_s=2.0, est_setup_s=12, timeout_s=300)
    return [
        Server("v033_sdxl_24", "sdxl", [
            *identity_jobs(settings("fast"), 0.09, 20),
            Job("requeue_lean", settings("lean"), sample_base=True, est_step_s=0.15, est_setup_s=10),
            Job("cancel_fast", settings("fast"), steps=400, cancel_after=16, est_step_s=0.09, est_setup_s=6),
            Job("after_cancel_balanced", settings("balanced"), steps=30, sample_base=True, est_step_s=0.12,
                est_setup_s=8)],
            card_gib=24, base_identity=True, est_start_s=18),
        Server("v033_sdxl_6", "sdxl", identity_jobs(settings("fast", auto_fit=_fit(6)), 0.16, 30),
               card_gib=6, base_identity=True, est_start_s=18),
        Server("v033_sd15_2", "sd15", identity_jobs(settings("fast", auto_fit=_fit(2)), 0.06, 15),
               card_gib=2, base_identity=True, est_start_s=15),
        Server("v033_sdxl_24_checkpoint", "sdxl", identity_jobs(settings("fast"), 0.09, 20),
               form="checkpoint", card_gib=24, base_identity=True, est_start_s=18),
        Server("v033_sdxl_4", "sdxl", [Job("autofit_4", settings("fast", auto_fit=_fit(4)), est_step_s=0.2,
                                           est_setup_s=30)], card_gib=4, est_start_s=18),
        # whether DynamicVRAM's own headroom keeps ComfyUI's encoders and sampling inside the emulated card (its
        # base sample alone took 2.16 GiB of a "2 GiB" card with --reserve-vram only)
        Server("v033_sd15_2_headroom", "sd15", identity_jobs(settings("fast", auto_fit=_fit(2)), 0.06, 15),
               card_gib=2, base_identity=True, est_start_s=15, aimdo_headroom=True),
        # the peer: 0.33's own trainer with its lowest-memory setting (offloading), on the 24 GiB card of our fast
        # row; its gradient checkpointing once failed on torch 2.11 in bench/peers.py (in this server it ran),
        # hence a row without it too
        Server("v033_builtin_sdxl_24", "sdxl", [builtin("builtin_offloading", True),
                                                builtin("builtin_offloading_no_gc", False)],
               card_gib=24, est_start_s=18),
        # with room it keeps the model resident (22.68 GiB on the 24 GiB card): whether its offloading fits a
        # small card, as the ~4 GB it is known for says. With DynamicVRAM's own headroom: the per-process cap alone
        # does not bind comfy-aimdo (4 Dec: 19.24 GiB of the device on a "6 GiB" server, 2.55 s/step)
        Server("v033_builtin_sdxl_6", "sdxl", [builtin("builtin_offloading", True)], card_gib=6, est_start_s=18,
               aimdo_headroom=True),
    ]


# ComfyUI's TrainLoraNode as the peer: our Train node's choices where it has the same input (batch 1, rank 16,
# the learning rate, AdamW, bf16, seed); what it lacks (LoRA on attention only, alpha) stays its own.
PEER_TRAIN_INPUTS = {"batch_size": 1, "grad_accumulation_steps": 1, "learning_rate": 1e-4, "rank": 16,
                     "optimizer": "AdamW", "loss_function": "MSE", "seed": 0, "training_dtype": "bf16",
                     "lora_dtype": "bf16", "existing_lora": "[None]"}
PEER_FOLDER = "matrix_peer"  # the dataset's square images, in the server's input folder before it starts
PEER_WARMUP_STEPS = 10  # left out of the peer's s/step (its first step holds its setup)


def plan_resume() -> list[Server]:
    """Exact resume on the GPU: 40 steps straight (a state every 20) vs the same run resumed from step 20's state,
    SD1.5 with AdamW8bit and CUDA graphs; the two LoRA files are compared tensor by tensor."""
    memory = settings("fast", optimizer="AdamW8bit")
    return [Server("resume_sd15_8bit", "sd15", [
        Job("straight", memory, steps=40, train_extra={"save_every_n_steps": 20}, output_name="resume_straight",
            est_step_s=0.03, est_setup_s=15),
        Job("resumed", memory, steps=40, train_extra={"resume": "resume_straight_step20.leanlora-state"},
            output_name="resume_resumed", est_step_s=0.03, est_setup_s=10)],
        card_gib=24, lora_identity=("straight", "resumed"), est_start_s=12)]


def lora_difference(a: Path, b: Path) -> dict:
    """How far two LoRA files are apart: bit-identical, max |a - b| and max |a| over all tensors, and ||a - b|| /
    ||a|| over all of them (Adam moves a weight whose gradient is mostly noise by ~lr per step in either direction,
    so the max alone says little after hundreds of steps)."""
    from safetensors.torch import load_file
    ta, tb = load_file(a), load_file(b)
    if ta.keys() != tb.keys():
        return {"identical": False, "error": "different keys"}
    weights = [k for k in ta if not k.endswith(".alpha")]
    diff = max((ta[k].float() - tb[k].float()).abs().max().item() for k in weights)
    scale = max(ta[k].float().abs().max().item() for k in weights)
    squared = lambda tensors: sum(float(t.float().pow(2).sum()) for t in tensors)  # noqa: E731
    relative = (squared(ta[k] - tb[k] for k in weights) / max(squared(ta[k] for k in weights), 1e-30)) ** 0.5
    return {"identical": all(torch_equal(ta[k], tb[k]) for k in ta), "max_abs_diff": diff, "max_abs": scale,
            "relative_l2": relative}


def torch_equal(a, b) -> bool:
    import torch
    return bool(torch.equal(a, b))


def plan_smoke() -> list[Server]:
    """CPU, tiny SD1.5: train + KSampler (split files), cancel, a new queue (checkpoint form), base identity, and
    ComfyUI's own trainer as the peer rows run it."""
    tiny = dict(est_step_s=0.5, est_setup_s=15, timeout_s=150)
    return [Server("smoke_sd15_cpu", "sd15", [
        Job("sample_base_before", kind="sample", **tiny),
        Job("train_balanced", settings("balanced"), steps=3, sample_base=True, **tiny),
        Job("cancel_fast", settings("fast"), steps=2000, cancel_after=2, **tiny),
        Job("after_cancel_checkpoint", settings("fast"), steps=2, form="checkpoint", **tiny),
        Job("peer_builtin", kind="peer", steps=PEER_WARMUP_STEPS + 2, **tiny)],
        base_identity=True, est_start_s=15)]


def plan_all() -> list[Server]:
    """Every 0.3.75 server of core, more and extra, for an --only that picks across them (one device command for
    what earlier calls left out)."""
    return plan_core() + plan_more() + plan_extra()


# The shipped templates' Memory Settings: the card widget on auto, every other widget at its node default.
TEMPLATE = {"card": "auto (this GPU)", **FAST}
LIFECYCLE = {"sample_prompts": "a red circle on a blue background\na blue square", "sample_every_n_steps": 40,
             "save_every_n_steps": 40, "validation_fraction": 0.25, "validation_every_n_steps": 40}


def plan_cards() -> list[Server]:
    """Issue 32's matrix: what a user gets from the Memory Settings' card widget with the defaults, per card
    (SDXL 24/12/8/6/4/3, SD1.5 3/2; each job then a KSampler, its peak in the job's), against fast on the whole
    card; the template as shipped and re-queued (free VRAM after the KSampler), the old template's savers under
    auto (relaxed), and the lifecycle row (samples, saves and validation every 40 steps, 6 GiB)."""
    card = lambda gib: {**FAST, "card": f"{gib:g} GiB"}  # noqa: E731
    step_s = {24: 0.09, 12: 0.1, 8: 0.11, 6: 0.12, 4: 0.15, 3: 0.2}
    sdxl = [Server("sdxl_24_cards", "sdxl", [
        Job("fast", settings("fast"), est_step_s=0.09, est_setup_s=25),
        Job("template", TEMPLATE, est_step_s=0.09, est_setup_s=20),
        Job("template_requeue", TEMPLATE, est_step_s=0.09, est_setup_s=15),
        Job("balanced_savers_card_auto", {**settings("lean"), "card": "auto (this GPU)"}, est_step_s=0.09,
            est_setup_s=20)], card_gib=24)]
    for gib in (12, 8):
        sdxl.append(Server(f"sdxl_{gib}_cards", "sdxl", [Job(f"card_{gib}", card(gib), est_step_s=step_s[gib],
                                                             est_setup_s=35)], card_gib=gib))
    sdxl.append(Server("sdxl_6_cards", "sdxl", [
        Job("card_6", card(6), est_step_s=step_s[6], est_setup_s=35),
        Job("card_6_lifecycle", card(6), train_extra=LIFECYCLE, est_step_s=step_s[6], est_setup_s=60,
            timeout_s=360)], card_gib=6))
    for gib in (4, 3):
        sdxl.append(Server(f"sdxl_{gib}_cards", "sdxl", [Job(f"card_{gib}", card(gib), est_step_s=step_s[gib],
                                                             est_setup_s=40)], card_gib=gib))
    sd15 = [Server(f"sd15_{gib}_cards", "sd15", [Job(f"card_{gib}", card(gib), est_step_s=0.03, est_setup_s=15)],
                   card_gib=gib, est_start_s=12) for gib in (3, 2)]
    sd15.append(Server("sd15_24_cards", "sd15", [Job("fast", settings("fast"), est_step_s=0.022, est_setup_s=15)],
                       card_gib=24, est_start_s=12))
    return sdxl + sd15


def plan_requeue() -> list[Server]:
    """Issue 34's records. 20 re-queues in one SD1.5 server capped to 4 GiB across auto-fit (card 4 GiB, the card
    on auto), streamed weights (leanest), compile and cancel, each followed by a KSampler: what the idle server holds
    after each job (NVML over the baseline, RSS), and once ComfyUI's cached models are unloaded at the end."""
    card4 = {**FAST, "card": "4 GiB"}
    jobs = []
    for cycle in range(4):
        jobs += [Job(f"card_4_{cycle}", card4, steps=24, est_step_s=0.04, est_setup_s=15),
                 Job(f"leanest_{cycle}", settings("leanest"), steps=24, est_step_s=0.09, est_setup_s=10),
                 Job(f"cancel_card_4_{cycle}", card4, steps=2000, cancel_after=16, est_step_s=0.04, est_setup_s=12),
                 Job(f"compile_lean_{cycle}", settings("lean", compile=True), steps=24, est_step_s=0.035,
                     est_setup_s=90, timeout_s=300) if cycle == 0 else
                 Job(f"free_vram_{cycle}", settings("fast", auto_fit="free VRAM"), steps=24, est_step_s=0.04,
                     est_setup_s=12),
                 Job(f"template_{cycle}", TEMPLATE, steps=24, est_step_s=0.04, est_setup_s=12)]
    return [Server("requeue20_sd15_4", "sd15", jobs, card_gib=4, held_memory=True, est_start_s=12)]


def plan_soak(steps: int = 1800) -> list[Server]:
    """Issue 34's crash and soak. A crash: 600 SD1.5 steps straight, then the same run killed (SIGKILL) at a random
    step and resumed from its last state in a new server on the same folders; the resumed LoRA against the straight
    one, and the same straight run twice (run-to-run drift on the GPU). The soak: SDXL 1024² on a 6 GiB card (the card widget), saves every 500 steps and samples every 1,000,
    s/step, device memory and RSS traced every 100 steps; as many steps as one device command leaves room for."""
    import random
    memory = settings("fast", optimizer="AdamW8bit")
    saves = {"save_every_n_steps": 100}
    kill_at = random.randint(250, 550)
    crash = Server("kill_resume_sd15", "sd15", [
        Job("straight", memory, steps=600, train_extra=saves, output_name="crash_straight", est_step_s=0.03,
            est_setup_s=15),
        Job("killed", memory, steps=600, train_extra=saves, output_name="crash_killed", kill_after=kill_at,
            est_step_s=0.03, est_setup_s=10),
        Job("resumed", memory, steps=600, train_extra={**saves, "resume": "latest state of this output name"},
            output_name="crash_killed", est_step_s=0.03, est_setup_s=15)],
        card_gib=24, lora_identity=("straight", "resumed"), est_start_s=12)
    # the same 600 steps twice: how far two uninterrupted GPU runs drift apart (the crash's yardstick)
    repeat = Server("repeat_sd15", "sd15", [
        Job(name, memory, steps=600, train_extra=saves, output_name=f"repeat_{name}", est_step_s=0.03, est_setup_s=15)
        for name in ("first", "second")], card_gib=24, lora_identity=("first", "second"), est_start_s=12)
    return [crash, repeat, _soak_server(steps, timeout_s=560)]


def plan_soak5000() -> list[Server]:
    """Issue 34's soak at its full length, 5,000 steps (~12 minutes with the saves and samples): longer than one
    device command, so it runs detached across two (bench/server_gpu.sh, DETACH=1)."""
    return [_soak_server(5000, timeout_s=1400)]


def _soak_server(steps: int, timeout_s: float) -> Server:
    """SDXL 1024² on a 6 GiB card (the card widget), saves every 500 steps and samples every 1,000; s/step, device
    memory and the server's RSS traced every 100 steps."""
    soak = {"save_every_n_steps": 500, "sample_every_n_steps": 1000,
            "sample_prompts": "a red circle on a blue background"}
    return Server("soak_sdxl_6", "sdxl", [
        Job("soak", {**FAST, "card": "6 GiB"}, steps=steps, train_extra=soak, trace_every=100, est_step_s=0.14,
            est_setup_s=60, timeout_s=timeout_s)], card_gib=6, held_memory=True)


PLANS = {"core": plan_core, "more": plan_more, "extra": plan_extra, "all": plan_all, "v033": plan_v033,
         "smoke": plan_smoke, "resume": plan_resume, "cards": plan_cards,
         "requeue": plan_requeue, "soak": plan_soak, "soak5000": plan_soak5000}


# --- prompts -------------------------------------------------------------------------------------------------

def build_prompt(job: Job, model: str, form: str, assets: dict, memory_inputs: dict, run_tag: str,
                 sampler_steps: int, cfg: float = 5.0, peer_lora_output: int = 0) -> dict:
    """API-format prompt: loaders -> LeanLoRA nodes -> KSampler(s) -> images; the report into PreviewAny."""
    files = assets[model]
    if form == "checkpoint":
        prompt = {"ckpt": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": files["checkpoint"]}}}
        model_link, clip_link, vae_link = ["ckpt", 0], ["ckpt", 1], ["ckpt", 2]
    else:
        prompt = {"unet": {"class_type": "UNETLoader", "inputs": {"unet_name": files["unet"], "weight_dtype": "default"}},
                  "vae": {"class_type": "VAELoader", "inputs": {"vae_name": files["vae"]}}}
        if model == "sdxl":
            prompt["clip"] = {"class_type": "DualCLIPLoader", "inputs": {
                "clip_name1": files["clip"][0], "clip_name2": files["clip"][1], "type": "sdxl"}}
        else:
            prompt["clip"] = {"class_type": "CLIPLoader", "inputs": {"clip_name": files["clip"][0],
                                                                     "type": "stable_diffusion"}}
        model_link, clip_link, vae_link = ["unet", 0], ["clip", 0], ["vae", 0]
    side = files["resolution"]

    def sample(tag: str, model_in: list, clip_in: list, save: bool) -> None:
        prompt[f"pos_{tag}"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle on a blue background",
                                                                          "clip": clip_in}}
        prompt[f"neg_{tag}"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": clip_in}}
        prompt[f"latent_{tag}"] = {"class_type": "EmptyLatentImage", "inputs": {"width": side, "height": side,
                                                                               "batch_size": 1}}
        prompt[f"ksampler_{tag}"] = {"class_type": "KSampler", "inputs": {
            "model": model_in, "seed": 7, "steps": sampler_steps, "cfg": cfg, "sampler_name": "euler",
            "scheduler": "normal", "positive": [f"pos_{tag}", 0], "negative": [f"neg_{tag}", 0],
            "latent_image": [f"latent_{tag}", 0], "denoise": 1.0}}
        prompt[f"decode_{tag}"] = {"class_type": "VAEDecode", "inputs": {"samples": [f"ksampler_{tag}", 0],
                                                                         "vae": vae_link}}
        prompt[f"image_{tag}"] = ({"class_type": "SaveImage", "inputs": {
            "images": [f"decode_{tag}", 0], "filename_prefix": f"matrix/{run_tag}_{tag}"}} if save else
            {"class_type": "PreviewImage", "inputs": {"images": [f"decode_{tag}", 0]}})

    if job.kind == "sample" or job.sample_base:
        sample("base", model_link, clip_link, save=True)
    if job.kind == "lora_load":  # the trained file as users load it; the base through the same loader at strength
        # 0 (ComfyUI returns the MODEL untouched, and the new node keeps its cached base image from being reused)
        for tag, strength in (("base", 0.0), ("lora", 1.0)):
            prompt[f"load_{tag}"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
                "model": model_link, "lora_name": f"{job.load_lora}.safetensors", "strength_model": strength}}
            sample(tag, [f"load_{tag}", 0], clip_link, save=True)
    if job.kind == "peer":  # as ComfyUI's own training workflow: a folder of images -> VAEEncode (one LATENT per
        # image: 0.3.75's node fails on a single LATENT) -> TrainLoraNode (positive: CLIPTextEncode) -> SaveLoRA
        prompt["peer_image"] = {"class_type": "LoadImageDataSetFromFolder", "inputs": {"folder": PEER_FOLDER}}
        prompt["peer_latent"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["peer_image", 0], "vae": vae_link}}
        prompt["peer_positive"] = {"class_type": "CLIPTextEncode", "inputs": {
            "text": "a red circle on a blue background", "clip": clip_link}}
        prompt["peer_train"] = {"class_type": "TrainLoraNode", "inputs": {
            **memory_inputs, "model": model_link, "latents": ["peer_latent", 0], "positive": ["peer_positive", 0],
            "steps": job.steps}}
        prompt["peer_save"] = {"class_type": "SaveLoRA", "inputs": {"lora": ["peer_train", peer_lora_output],
                                                                    "prefix": f"loras/matrix_{run_tag}"}}
    if job.kind == "train":
        prompt["dataset"] = {"class_type": "LeanLoRADataset", "inputs": {
            "folder": files["dataset"], "resolution": side, "repeats": 1, "trigger_word": "", "framing": job.framing}}
        prompt["memory"] = {"class_type": "LeanLoRAMemorySettings", "inputs": memory_inputs}
        prompt["lora_config"] = {"class_type": "LeanLoRALoraConfig", "inputs": {
            "rank": 16, "alpha": 16.0, "dropout": job.lora_dropout, "targets": "attention", **job.lora_config}}
        prompt["train"] = {"class_type": "LeanLoRATrain", "inputs": {
            "model": model_link, "clip": clip_link, "vae": vae_link, "dataset": ["dataset", 0],
            "memory": ["memory", 0], "lora_config": ["lora_config", 0], "steps": job.steps, "learning_rate": 1e-4,
            "lr_schedule": "constant", "warmup_steps": 0, "seed": 0,
            "output_name": job.output_name or f"matrix_{run_tag}", **job.train_extra}}
        prompt["report"] = {"class_type": "PreviewAny", "inputs": {"source": ["train", 5]}}
        sample("trained", ["train", 0], ["train", 1], save=False)
    return prompt


def peer_inputs_for(requested: dict, object_info: dict) -> tuple[dict, list[str]]:
    """TrainLoraNode's widget inputs: its schema defaults, the bench's common choices and the row's own; the
    names this ComfyUI's node lacks (0.3.75 has no offloading) are an error, as a missing node is."""
    if "TrainLoraNode" not in object_info:
        return {}, ["TrainLoraNode"]
    spec = object_info["TrainLoraNode"].get("input", {})
    known = {**spec.get("required", {}), **spec.get("optional", {})}
    if "LORA_MODEL" not in object_info["TrainLoraNode"].get("output", []):
        return {}, ["LORA_MODEL output"]
    defaults = {name: entry[1]["default"] for name, entry in known.items()
                if len(entry) > 1 and isinstance(entry[1], dict) and "default" in entry[1]}
    defaults.pop("steps", None)  # the row's own (build_prompt)
    chosen = {**PEER_TRAIN_INPUTS, **requested}
    return {**defaults, **{k: v for k, v in chosen.items() if k in known}}, sorted(k for k in chosen if k not in known)


def stage_peer_images(dataset: Path, folder: Path) -> None:
    """The dataset's square images (one shape: a single batch, as our square framing trains) for the peer's
    LoadImageDataSetFromFolder, whose folder choices ComfyUI lists from the input folder."""
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    for image in sorted(dataset.glob("*.png")):
        with Image.open(image) as im:
            square = im.width == im.height
        if square and not (folder / image.name).exists():
            shutil.copyfile(image, folder / image.name)


def memory_inputs_for(requested: dict, object_info: dict) -> tuple[dict, list[str]]:
    """The requested Memory Settings inputs that this pack's node has, and the names it lacks (an error: the
    row would silently test something else)."""
    spec = object_info.get("LeanLoRAMemorySettings", {}).get("input", {})
    known = {**spec.get("required", {}), **spec.get("optional", {})}
    return {k: v for k, v in requested.items() if k in known}, sorted(k for k in requested if k not in known)


# --- measurement ---------------------------------------------------------------------------------------------

class NvmlSampler:
    """Device-level used memory every `period` s in a thread (NVML only: this process never creates a CUDA
    context, which would count in what it measures). `window()` -> peak since the last `start_window()`."""

    def __init__(self, index: int = 0, period: float = 0.02, enabled: bool = True, reason: str = ""):
        self.available, self.reason, self.name, self.total = False, reason, "", 0
        if not enabled:
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._handle)
            self.name = name.decode() if isinstance(name, bytes) else name
            self.total = pynvml.nvmlDeviceGetMemoryInfo(self._handle).total
            self.available = True
        except Exception as error:  # no driver / no GPU / no pynvml: recorded, never fatal
            self.reason = f"NVML unavailable: {type(error).__name__}: {error}"
            return
        self.period = period
        self._lock = threading.Lock()
        self._peak = self._process_peak = self._phase_peak = 0
        self._pid: int | None = None
        self.samples = 0
        threading.Thread(target=self._run, daemon=True, name="nvml-sampler").start()

    def used(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def _process_used(self) -> int | None:
        if self._pid is None:
            return None
        try:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if proc.pid == self._pid and proc.usedGpuMemory is not None:
                    return proc.usedGpuMemory
        except Exception:
            pass
        return None

    def _run(self) -> None:
        tick = 0
        while True:
            try:
                used = self.used()
                # the process list is slower to read; every 5th sample (100 ms) is enough for a per-process view
                proc = self._process_used() if tick % 5 == 0 else None
            except Exception:
                time.sleep(self.period)
                continue
            with self._lock:
                self._peak = max(self._peak, used)
                self._phase_peak = max(self._phase_peak, used)
                if proc is not None:
                    self._process_peak = max(self._process_peak, proc)
                self.samples += 1
            tick += 1
            time.sleep(self.period)

    def start_window(self, pid: int | None) -> None:
        if self.available:
            with self._lock:
                self._pid, self._peak, self._process_peak, self.samples = pid, self.used(), 0, 0

    def start_phase(self) -> None:
        """A second peak inside the window (the Train node alone, without the samplers around it)."""
        if self.available:
            with self._lock:
                self._phase_peak = self.used()

    def phase_peak(self) -> int | None:
        if not self.available:
            return None
        with self._lock:
            return self._phase_peak

    def split_phase(self) -> int | None:
        """The phase's peak so far, and a new phase from now (the Train node's caching, then its training)."""
        if not self.available:
            return None
        with self._lock:
            peak, self._phase_peak = self._phase_peak, self.used()
            return peak

    def window(self) -> tuple[int, int | None, int]:
        with self._lock:
            return self._peak, (self._process_peak or None), self.samples


class Events:
    """The server's websocket messages (JSON only; binary previews dropped), each with this process's clock."""

    def __init__(self, url: str, client_id: str):
        self.queue: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.connected = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, args=(url, client_id), daemon=True, name="ws")
        self._thread.start()
        self.connected.wait(15)

    def _run(self, url: str, client_id: str) -> None:
        try:
            import aiohttp  # ComfyUI's server itself runs on aiohttp: present wherever ComfyUI runs
        except ImportError as error:
            self.error = f"no websocket client ({error})"
            self.connected.set()
            return

        async def listen():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"{url}/ws?clientId={client_id}", heartbeat=20, max_msg_size=0) as ws:
                    self.connected.set()
                    async for msg in ws:
                        if self._stop:
                            break
                        if msg.type == aiohttp.WSMsgType.TEXT:
                            try:
                                self.queue.put((time.monotonic(), json.loads(msg.data)))
                            except ValueError:
                                pass
                        elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                            break
        try:
            asyncio.run(listen())
        except Exception as error:
            self.error = f"websocket: {type(error).__name__}: {error}"
        finally:
            self.connected.set()

    def drain(self) -> list:
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._stop = True


def steady_step_time(steps: list[tuple[int, float]]) -> tuple[float | None, int]:
    """(s/step, steps measured) from the trainer's (step, seconds) reports: the first burst (the steps one device
    sync reports together: warm-up and graph capture) is left out; its last step is where the clock starts."""
    if len(steps) < 2:
        return None, 0
    first_burst_end = 0
    while first_burst_end + 1 < len(steps) and steps[first_burst_end + 1][1] == steps[0][1]:
        first_burst_end += 1
    ref_step, ref_s = steps[first_burst_end]
    last_step, last_s = steps[-1]
    if last_step <= ref_step:
        return None, 0
    return (last_s - ref_s) / (last_step - ref_step), last_step - ref_step


PEAK_LINE = re.compile(r"peak VRAM: ([\d.]+) GiB allocated, ([\d.]+) GiB reserved")


def parse_report(report: str) -> dict:
    out = {"peak_lines": [line.strip() for line in report.splitlines() if "peak" in line.lower()]}
    match = PEAK_LINE.search(report)
    if match:
        out["torch_peak_allocated_gib"], out["torch_peak_reserved_gib"] = float(match[1]), float(match[2])
    trained = re.search(r"trained (\d+)/(\d+) steps in ([\d.]+) s \(([\d.]+) s/step\)", report)
    if trained:
        out["report_s_per_step_incl_warmup"] = float(trained[4])
    out["fast_path_lines"] = [line.strip() for line in report.splitlines() if "fast path" in line or "eager" in line]
    out["auto_fit_lines"] = [line.strip() for line in report.splitlines() if "auto-fit" in line.lower()]
    return out


# --- the server ----------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


class MatrixServer:
    """One ComfyUI process for a Server spec. Stdlib HTTP (the GPU machine has no `requests`)."""

    def __init__(self, spec: Server, comfyui: Path, base: Path, assets_dir: Path, web_root: Path, cpu: bool,
                 nvml: NvmlSampler, restarts: int = 0):
        """restarts > 0: the server after a lost one, in fresh folders (whatever broke stays behind); a deliberate
        kill (Job.kill_after) restarts without counting, on the same folders."""
        self.spec, self.comfyui, self.cpu, self.nvml = spec, comfyui, cpu, nvml
        self.base = base / (spec.name if restarts == 0 else f"{spec.name}_restart{restarts}")
        self.log_path = self.base / "comfyui.log"
        self.client_id = uuid.uuid4().hex
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        for sub in ("models/loras", "input", "output", "temp", "user", "custom_nodes"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        for folder in ASSET_FOLDERS:  # the shared random weights, read-only for every server
            link = self.base / "models" / folder
            if not link.exists():
                (assets_dir / "models" / folder).mkdir(parents=True, exist_ok=True)
                link.symlink_to((assets_dir / "models" / folder).resolve(), target_is_directory=True)
        pack = self.base / "custom_nodes" / PACK_NAME
        if not pack.exists():
            pack.symlink_to(REPO, target_is_directory=True)
        self.web_root = web_root
        self.proc: subprocess.Popen | None = None
        self.events: Events | None = None
        self.command: list[str] = []
        self.start_s = 0.0
        self.nvml_baseline = 0  # device-level used memory before this server started
        self.object_info: dict = {}
        self.after_start: dict | None = None
        # the card's emulation (prepare_card): "holder", "fraction", or None (uncapped, CPU)
        self.emulation: str | None = None
        self.holder: CardHolder | None = None
        self.holder_info: dict | None = None
        self.holder_error: str | None = None
        self.nvml_idle: int | None = None          # NVML used before the holder started
        self.holder_device_bytes: int | None = None  # NVML used with the holder up, less idle

    def prepare_card(self, emulation: str = DEFAULT_EMULATION) -> None:
        """Before the NVML baseline: the card's emulation, and with "holder" the holder process up and holding
        (its bytes are then part of the baseline: peaks over it are used - holder - idle). A holder that cannot
        start leaves the fraction cap alone, recorded (holder_error)."""
        if self.cpu or self.spec.card_gib is None:
            return
        self.emulation = self.spec.emulation or emulation
        if self.emulation not in EMULATIONS:
            raise ValueError(f"card emulation {self.emulation!r}: one of {EMULATIONS}")
        if self.emulation != "holder":
            return
        if not self.nvml.available:
            self.emulation, self.holder_error = "fraction", "no NVML to measure the holder: " + self.nvml.reason
            return
        self.nvml_idle = self.nvml.used()
        holder = CardHolder(self.spec.card_gib)
        try:
            self.holder_info = holder.start()
        except Exception as error:  # noqa: BLE001 - recorded; the row still runs, capped the old way
            self.emulation, self.holder_error = "fraction", f"{type(error).__name__}: {error}"
            print(f"[matrix] {self.spec.name}: the card holder failed, fraction cap only: {self.holder_error}",
                  flush=True)
            return
        self.holder = holder
        time.sleep(0.5)  # NVML's used memory settles after the allocations
        self.holder_device_bytes = self.nvml.used() - self.nvml_idle
        info = self.holder_info.get("gib", {})
        print(f"[matrix] {self.spec.name}: holder pid {self.holder_info.get('pid')} holds {info.get('held')} GiB "
              f"({self.holder_device_bytes / GIB:.3f} GiB device-level with its context); device free "
              f"{info.get('free_after')} GiB, a fresh process sees {info.get('fresh_process_free')} GiB free",
              flush=True)

    def card_record(self) -> dict:
        """What each row records about its card's emulation."""
        if self.emulation is None:
            return {"card_emulation": None}
        out = {"card_emulation": self.emulation}
        if self.holder_error:
            out["holder_error"] = self.holder_error
        if self.holder_info:
            keys = ("held", "free_before", "free_after", "fresh_process_free", "fresh_process_context", "total")
            out["holder"] = {**{f"{k}_gib": self.holder_info.get("gib", {}).get(k) for k in keys},
                             "held_bytes": self.holder_info.get("held"), "chunks": self.holder_info.get("chunks"),
                             "api": self.holder_info.get("api"),
                             "device_gib": round(self.holder_device_bytes / GIB, 3)
                             if self.holder_device_bytes is not None else None,
                             "alive": self.holder.alive() if self.holder else False}
            out["nvml_idle_gib"] = round(self.nvml_idle / GIB, 3)
        return out

    def start(self, timeout: float = 180) -> None:
        args = ["--listen", "127.0.0.1", "--port", str(self.port), "--base-directory", str(self.base),
                "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_NAME,
                "--database-url", "sqlite:///:memory:", "--front-end-root", str(self.web_root), "--disable-api-nodes"]
        launcher = [sys.executable, str(REPO / "bench" / "comfy_launcher.py")]
        if self.cpu:
            args.append("--cpu")
        elif self.spec.card_gib is not None:
            total_gib = self.nvml.total / GIB if self.nvml.available else None
            if total_gib is None:
                raise RuntimeError("a card size needs the device's total memory from NVML: " + self.nvml.reason)
            launcher += ["--card-gib", f"{self.spec.card_gib:g}"]
            if self.emulation == "holder":  # the device's free memory is the card's: nothing to reserve
                launcher += ["--emulation", "holder"]
            else:
                args += ["--reserve-vram", f"{max(0.0, total_gib - self.spec.card_gib):.3f}"]
                if self.spec.aimdo_headroom:
                    args += ["--vram-headroom", f"{max(0.0, total_gib - self.spec.card_gib):.3f}"]
        if self.spec.families:
            launcher += ["--families", self.spec.families]
        if self.spec.native_allocator:
            args.append("--disable-cuda-malloc")
        self.command = launcher + args + list(self.spec.extra_args)
        started = time.monotonic()
        LIVE_SERVERS.append(self)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, cwd=self.comfyui, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive_process():
                raise RuntimeError(f"ComfyUI exited while starting (code {self.proc.returncode})")
            try:
                http(f"{self.url}/system_stats", timeout=2)
                break
            except (urllib.error.URLError, OSError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ComfyUI did not answer within {timeout:g} s")
                time.sleep(0.25)
        if any("(IMPORT FAILED)" in line and line.rstrip().endswith(f"/custom_nodes/{PACK_NAME}")
               for line in self.log_text().splitlines()):
            raise RuntimeError(f"ComfyUI could not import {PACK_NAME}")
        self.events = Events(self.url, self.client_id)
        self.start_s = time.monotonic() - started
        self.object_info = http(f"{self.url}/object_info", timeout=60)
        self.after_start = self.held(settle_s=1.0) if self.spec.held_memory else None

    def alive_process(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def alive(self) -> bool:
        if not self.alive_process():
            return False
        try:
            http(f"{self.url}/system_stats", timeout=10)
            return True
        except Exception:
            return False

    def system_stats(self) -> dict | None:
        try:
            return http(f"{self.url}/system_stats", timeout=10)
        except Exception:
            return None

    def rss(self) -> int | None:
        """The server process's resident host memory (ComfyUI runs inside the launcher's process)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, AttributeError, ValueError):
            pass
        return None

    def held(self, settle_s: float = 2.0) -> dict:
        """What the idle server holds: device memory over the baseline (NVML) and host RSS, after a settle."""
        time.sleep(settle_s)
        held = {"rss_gib": round(self.rss() / GIB, 3) if self.rss() else None}
        if self.nvml.available:
            held["device_over_baseline_gib"] = round((self.nvml.used() - self.nvml_baseline) / GIB, 3)
        stats = self.system_stats()
        if stats and stats.get("devices"):
            device = stats["devices"][0]
            held["comfy_torch_reserved_gib"] = round(((device.get("torch_vram_total") or 0)) / GIB, 3)
        return held

    def free_and_measure(self) -> dict:
        """ComfyUI's own cached models unloaded (POST /free, as its menu's "Unload models" does), then what is
        held: against the idle server right after it started, what every job together left behind."""
        try:
            http(f"{self.url}/free", {"unload_models": True, "free_memory": True}, timeout=30)
        except Exception as error:  # noqa: BLE001 - recorded
            return {"error": f"POST /free: {type(error).__name__}: {error}"}
        return {**self.held(settle_s=5.0), "after_start": self.after_start}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def abort_lines(self) -> list[str]:
        return [line for line in self.log_text().splitlines() if ABORT_PATTERN.search(line)][-12:]

    def device_line(self) -> str:
        """ComfyUI's own start-up line naming the device and allocator (e.g. '... : cudaMallocAsync')."""
        plain = re.sub(r"\x1b\[[0-9;]*m", "", self.log_text())  # 0.33 colours its log levels
        return next((line[line.index("Device:"):].strip() for line in plain.splitlines() if "Device:" in line), "")

    def stop(self) -> None:
        if self in LIVE_SERVERS:
            LIVE_SERVERS.remove(self)
        if self.events:
            self.events.close()
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.holder is not None:  # after the server: the card stays the card until the server is gone
            self.holder.stop()
            self.holder = None


# --- running a job -------------------------------------------------------------------------------------------

def _execution_error(entry: dict) -> dict | None:
    for event, data in entry.get("status", {}).get("messages", []):
        if event == "execution_error":
            return data
    return None


def _interrupted(entry: dict) -> bool:
    return any(event == "execution_interrupted" for event, _ in entry.get("status", {}).get("messages", []))


def _image_pixels(server: MatrixServer, outputs: dict, node: str) -> bytes | None:
    from PIL import Image
    for image in outputs.get(node, {}).get("images", []):
        folder = server.base / ("output" if image.get("type") == "output" else "temp") / image.get("subfolder", "")
        with Image.open(folder / image["filename"]) as im:
            return im.tobytes()
    return None


def run_job(server: MatrixServer, job: Job, assets: dict, run_tag: str, timeout_s: float, sampler_steps: int,
            cfg: float) -> dict:
    spec = server.spec
    form = job.form or spec.form
    row: dict = {"job": job.name, "kind": job.kind, "form": form, "steps": job.steps if job.kind != "sample" else 0,
                 "settings": job.memory, "framing": job.framing, "expected": "cancel" if job.cancel_after else "complete"}
    memory, missing = ({}, [])
    if job.kind == "train":
        memory, missing = memory_inputs_for(job.memory, server.object_info)
    elif job.kind == "peer":
        memory, missing = peer_inputs_for(job.peer_inputs, server.object_info)
        row["settings"] = memory
    if missing:
        node = ("LeanLoRA Memory Settings" if job.kind == "train" else
                "this ComfyUI" if "TrainLoraNode" not in server.object_info else "TrainLoraNode")
        return {**row, "status": "error", "passed": False, "server_alive_after": server.alive(),
                "error": f"{node} has no {', '.join(missing)}: this row cannot run as planned"}
    train_node = "peer_train" if job.kind == "peer" else "train"
    peer_steps: list[tuple[int, float]] = []  # (step, this process's clock) from ComfyUI's progress events
    peer_lora_output = (server.object_info["TrainLoraNode"]["output"].index("LORA_MODEL") if job.kind == "peer"
                        else 0)  # 0.3.75's node puts its MODEL first, 0.33's its LoRA
    prompt = build_prompt(job, spec.model, form, assets, memory, run_tag, sampler_steps, cfg, peer_lora_output)
    server.events.drain()
    log_offset = server.log_path.stat().st_size if server.log_path.exists() else 0
    server.nvml.start_window(server.proc.pid if server.proc else None)
    started = time.monotonic()
    try:
        answer = http(f"{server.url}/prompt", {"prompt": prompt, "client_id": server.client_id}, timeout=60)
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")
        return {**row, "status": "rejected", "passed": False, "server_alive_after": server.alive(),
                "error": f"POST /prompt {error.code}: {body[:1500]}"}
    if answer.get("node_errors"):
        return {**row, "status": "rejected", "passed": False, "server_alive_after": server.alive(),
                "error": json.dumps(answer["node_errors"])[:1500]}
    prompt_id = answer["prompt_id"]
    steps: list[tuple[int, float]] = []
    phases: list[tuple[float, str]] = []
    first_step_at = interrupt_at = train_started = killed_at = None
    trace: list[dict] = []
    train_peak = caching_peak = None
    entry = None
    status = None
    deadline = started + timeout_s

    def took_step(stamp: float, message: dict) -> bool:
        """Records a step event (ours: the trainer's clock; the peer's: this process's), if the message is one."""
        kind, data = message.get("type"), message.get("data") or {}
        if kind == "leanlora.progress" and data.get("kind") == "step":
            steps.append((int(data["step"]), float(data["seconds"])))
        elif kind == "progress" and data.get("node") == "peer_train":
            peer_steps.append((int(data["value"]), stamp))
        else:
            return False
        return True

    while entry is None:
        for stamp, message in server.events.drain():
            kind, data = message.get("type"), message.get("data") or {}
            if took_step(stamp, message):
                first_step_at = first_step_at or stamp
            elif kind == "leanlora.progress" and data.get("kind") == "phase":
                phases.append((round(stamp - started, 2), str(data.get("text", ""))[:200]))
                # ComfyUI's encoders run before this phase (caching), the training copy after it: on 0.33 the
                # encoders load through DynamicVRAM, outside the emulated card's cap
                if data.get("text") == "preparing the training copy" and train_started is not None:
                    caching_peak = server.nvml.split_phase()
            elif kind == "executing":  # ComfyUI names each node as it starts: the Train node's own NVML peak
                node = data.get("node")
                if node == train_node and train_started is None:
                    train_started = stamp
                    server.nvml.start_phase()
                elif train_started is not None and train_peak is None and node != train_node:
                    train_peak = server.nvml.phase_peak()
        while job.trace_every and steps and steps[-1][0] >= (len(trace) + 1) * job.trace_every:
            rss = server.rss()
            trace.append({"step": steps[-1][0], "trainer_s": round(steps[-1][1], 2),
                          "device_used_over_baseline_gib": round((server.nvml.used() - server.nvml_baseline) / GIB, 3)
                          if server.nvml.available else None, "rss_gib": round(rss / GIB, 3) if rss else None})
        if job.kill_after and killed_at is None and steps and steps[-1][0] >= job.kill_after:
            killed_at = steps[-1][0]
            os.kill(server.proc.pid, signal.SIGKILL)  # a crash: no handler, no cleanup, no final save
            server.proc.wait()
            status = "killed"
            break
        if job.cancel_after and interrupt_at is None and steps and steps[-1][0] >= job.cancel_after:
            try:
                http(f"{server.url}/interrupt", {}, timeout=10)
            except Exception as error:  # a dead server is found just below
                row["interrupt_error"] = f"{type(error).__name__}: {error}"
            interrupt_at = time.monotonic()
        try:
            entry = http(f"{server.url}/history/{prompt_id}", timeout=10).get(prompt_id)
        except Exception:
            entry = None
        if entry is not None:
            break
        if not server.alive_process():
            status = "server died"
            break
        if time.monotonic() > deadline:
            status = "timeout" if timeout_s >= job.timeout_s else "out of budget"
            break
        time.sleep(0.1)
    finished = time.monotonic()
    for stamp, message in server.events.drain():  # the last burst may come with the history entry
        took_step(stamp, message)
    row["wall_s"] = round(finished - started, 2)
    if status in ("timeout", "out of budget"):  # interrupt, then give up on the server: nothing may stall the matrix
        try:
            http(f"{server.url}/interrupt", {}, timeout=10)
        except Exception:
            pass
        row["error"] = (f"no result after {timeout_s:.0f} s (interrupted; server restarted for the next job)"
                        if status == "timeout" else f"the time budget ended the job after {timeout_s:.0f} s")
    elif status == "killed":
        states = sorted(p.name for p in (server.base / "models" / "loras").glob(
            f"{job.output_name or 'matrix_' + run_tag}_step*.leanlora-state"))
        row.update(killed_at_step=killed_at, states_left=states)
    elif status == "server died":
        row["error"] = f"the ComfyUI process exited (code {server.proc.returncode}) during the job"
    else:
        error = _execution_error(entry)
        if error:
            status = "error"
            row["error"] = f"{error.get('node_type')}: {error.get('exception_type')}: {error.get('exception_message')}"[:2000]
            row["traceback_tail"] = "".join(error.get("traceback") or [])[-1500:]
        elif _interrupted(entry):
            status = "cancelled"
        else:
            status = "ok"
        outputs = entry.get("outputs", {})
        report = "".join(outputs.get("report", {}).get("text", []) or [])
        if report:
            row["report"] = report[-6000:]
            row.update(parse_report(report))
        row["base_pixels"] = _image_pixels(server, outputs, "image_base")
        if job.kind == "lora_load":  # ComfyUI's loader names every key of the file it could not place
            with open(server.log_path, "rb") as log:
                log.seek(log_offset)
                text = log.read().decode(errors="replace")
            missed = [line.split("lora key not loaded:", 1)[1].strip() for line in text.splitlines()
                      if "lora key not loaded:" in line]
            lora_pixels = _image_pixels(server, outputs, "image_lora")
            row["lora_load"] = {"file": f"{job.load_lora}.safetensors", "keys_not_loaded": len(missed),
                                "keys_not_loaded_first": missed[:5], "image": lora_pixels is not None,
                                "image_differs_from_base": (None if lora_pixels is None or row["base_pixels"] is None
                                                            else lora_pixels != row["base_pixels"])}
    peak, process_peak, samples = server.nvml.window() if server.nvml.available else (None, None, 0)
    if train_started is not None and train_peak is None:  # the Train node was the last to run (or died)
        train_peak = server.nvml.phase_peak()
    if server.nvml.available:
        row["nvml_peak_gib"] = round(peak / GIB, 3)
        if train_peak is not None:
            # after a split, train_peak is the training part alone and the Train node's peak the larger of both
            node_peak = max(train_peak, caching_peak or 0)
            row["nvml_train_peak_gib"] = round(node_peak / GIB, 3)
            row["nvml_train_peak_over_baseline_gib"] = round((node_peak - server.nvml_baseline) / GIB, 3)
            if caching_peak is not None:
                row["nvml_caching_peak_over_baseline_gib"] = round((caching_peak - server.nvml_baseline) / GIB, 3)
                row["nvml_training_peak_over_baseline_gib"] = round((train_peak - server.nvml_baseline) / GIB, 3)
        row["nvml_peak_over_baseline_gib"] = round((peak - server.nvml_baseline) / GIB, 3)
        row["nvml_process_peak_gib"] = round(process_peak / GIB, 3) if process_peak else None
        row["nvml_samples"] = samples
    else:
        row["nvml"] = server.nvml.reason
    per_step, measured = steady_step_time(steps)
    if job.kind == "peer":  # its progress bar moves once per step, after the step's loss.item() (a device sync)
        steady = [(step, stamp) for step, stamp in peer_steps if step >= PEER_WARMUP_STEPS]
        if len(steady) > 1 and steady[-1][0] > steady[0][0]:
            per_step = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
            measured = steady[-1][0] - steady[0][0]
        steps = [(step, stamp - started) for step, stamp in peer_steps]
        row["s_per_step_source"] = (f"ComfyUI progress events' arrival (this process's clock), the first "
                                    f"{PEER_WARMUP_STEPS} steps left out")
    row.update(steps_done=steps[-1][0] if steps else 0, s_per_step=round(per_step, 4) if per_step else None,
               steady_steps=measured, first_step_after_s=round(first_step_at - started, 2) if first_step_at else None,
               phases=phases[:20])
    if job.cancel_after:
        partial = (server.base / "models" / "loras").glob(f"matrix_{run_tag}_partial_step*")
        row["cancel"] = {"after_step": job.cancel_after,
                         "latency_s": round(finished - interrupt_at, 2) if interrupt_at else None,
                         "partial_loras": sorted(p.name for p in partial)}
    if trace:
        row["trace"] = trace
    row["status"] = status
    alive = server.alive()
    row["server_alive_after"] = alive
    stats = server.system_stats() if alive else None
    if stats:
        row["system_stats_after"] = [{k: d.get(k) for k in ("name", "vram_total", "vram_free", "torch_vram_total",
                                                            "torch_vram_free")} for d in stats.get("devices", [])]
    if job.kill_after:  # passed: killed as planned with a state on disk to resume from
        row["passed"] = bool(status == "killed" and row.get("states_left"))
    else:
        expected_ok = (status == "cancelled" and row["cancel"]["partial_loras"]) if job.cancel_after else status == "ok"
        if job.kind == "lora_load":
            expected_ok = expected_ok and row.get("lora_load", {}).get("keys_not_loaded") == 0 \
                and row["lora_load"]["image"]
        row["passed"] = bool(expected_ok and alive)
    if alive and server.spec.held_memory:
        row["held_after"] = server.held()
    if not row["passed"]:
        row["log_tail"] = server.log_tail()
        row["abort_lines"] = server.abort_lines()
    return row


# --- the matrix ----------------------------------------------------------------------------------------------

def job_estimate(job: Job) -> float:
    steps = min(job.steps, job.cancel_after or job.steps) if job.kind != "sample" else 0
    return job.est_setup_s + steps * job.est_step_s + 8  # + sampling


def select(servers: list[Server], only: list[str], cards: list[float] | None) -> list[Server]:
    out = []
    for spec in servers:
        if cards is not None and (spec.card_gib or 0) not in cards:
            continue
        jobs = [j for j in spec.jobs if not only or spec.name in only or f"{spec.name}/{j.name}" in only or j.name in only]
        if jobs:
            out.append(replace(spec, jobs=jobs))
    if only:  # servers in the order --only names them (the budget skips the tail)
        def position(spec: Server) -> int:
            return min((i for i, o in enumerate(only) if o == spec.name or o.startswith(spec.name + "/")
                        or any(o == j.name for j in spec.jobs)), default=len(only))
        out.sort(key=position)
    return out


def markdown(result: dict) -> str:
    rows = result["rows"]
    fast = {}
    for row in rows:
        if row.get("job") == "fast" and row.get("s_per_step") and (row.get("card_gib") or 99) >= 24:
            fast.setdefault(row["model"], row["s_per_step"])
    lines = [f"ComfyUI {result['comfyui_version']} ({result['comfyui']}), plan {result['plan']}, {result['device']}; "
             f"NVML baseline before each server in the JSON. s/step: trainer clock, first burst (warm-up, capture) left "
             f"out; ratio vs the uncapped fast row of this run, else the issue's reference ({REFERENCE_FAST_S}).", "",
             "| server | job | model/form | card | allocator | status | alive | NVML device peak, job; Train node (over baseline) GiB | "
             "torch peak alloc/res GiB | s/step (steps) | × fast | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("status") == "skipped":
            lines.append(f"| {row['server']} | {row['job']} | {row['model']}/{row.get('form', '')} | {row.get('card_gib') or '-'} "
                         f"| {row.get('allocator', '')} | skipped ({row.get('error', '')}) | | | | | | |")
            continue
        nvml = (f"{row['nvml_peak_gib']:.2f} ({row['nvml_peak_over_baseline_gib']:.2f})"
                if row.get("nvml_peak_gib") is not None else "n/a")
        if row.get("nvml_train_peak_gib") is not None:
            nvml += f"; Train {row['nvml_train_peak_gib']:.2f} ({row['nvml_train_peak_over_baseline_gib']:.2f})"
        if row.get("nvml_caching_peak_over_baseline_gib") is not None:
            nvml += (f" = caching {row['nvml_caching_peak_over_baseline_gib']:.2f}, "
                     f"training {row['nvml_training_peak_over_baseline_gib']:.2f}")
        torch_peak = (f"{row['torch_peak_allocated_gib']:.2f} / {row['torch_peak_reserved_gib']:.2f}"
                      if row.get("torch_peak_allocated_gib") is not None else "n/a")
        per_step = f"{row['s_per_step']:.4f} ({row['steady_steps']})" if row.get("s_per_step") else "n/a"
        ref = fast.get(row["model"]) or REFERENCE_FAST_S.get(row["model"])
        ratio = f"{row['s_per_step'] / ref:.2f}" if row.get("s_per_step") and ref else ""
        status = row["status"] + ("" if row.get("passed") else " ✗")
        if row.get("error") and not row.get("passed"):
            status += ": " + row["error"].replace("|", "/").replace("\n", " ")[:120]
        card = f"{row['card_gib']:g}" + (f" ({row['card_emulation']})" if row.get("card_emulation") else "") \
            if row.get("card_gib") else "-"
        lines.append(f"| {row['server']} | {row['job']} | {row['model']}/{row.get('form', '')} | {card} | "
                     f"{row.get('allocator', '')} | {status} | {'yes' if row.get('server_alive_after') else 'NO'} | {nvml} | "
                     f"{torch_peak} | {per_step} | {ratio} | {row.get('wall_s', '')} |")
    summary = result["summary"]
    lines += ["", f"jobs: {summary['jobs']}, passed {summary['passed']}, failed {summary['failed']}, skipped "
              f"{summary['skipped']}; servers died/hung: {summary['servers_lost']}; base images identical: "
              f"{summary['base_identity']}"]
    return "\n".join(lines)


def comfyui_version(path: Path) -> str:
    match = re.search(r'__version__\s*=\s*"([^"]+)"', (path / "comfyui_version.py").read_text()) \
        if (path / "comfyui_version.py").exists() else None
    return match[1] if match else "unknown"


def build_assets(out: Path, servers: list[Server], tiny: bool, comfyui: Path) -> dict:
    """In a child process: building on the GPU creates a CUDA context, which must not sit in the NVML baseline."""
    models = sorted({s.model for s in servers})
    forms = sorted({j.form or s.form for s in servers for j in s.jobs})
    cmd = [sys.executable, "-m", "bench.full_size_assets", "--out", str(out), "--models", ",".join(models),
           "--forms", ",".join(forms)] + (["--tiny", "--images", "3"] if tiny else [])
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "COMFYUI_PATH": str(comfyui)})
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode != 0:
        raise SystemExit(f"matrix: building assets failed ({shlex.join(cmd)}):\n{done.stderr[-3000:]}")
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("[assets]")), flush=True)
    return json.loads((out / "assets.json").read_text())


def run_matrix(args) -> dict:
    begun = time.monotonic()
    comfyui = Path(args.comfyui).resolve()
    if not (comfyui / "main.py").is_file():
        raise SystemExit(f"matrix: no ComfyUI at {comfyui} (main.py missing)")
    servers = select(PLANS[args.plan](), [o for o in args.only.split(",") if o],
                     [float(c) for c in args.cards.split(",")] if args.cards else None)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    web_root = out / "web"
    web_root.mkdir(exist_ok=True)
    (web_root / "index.html").write_text("<!doctype html><title>LeanLoRA matrix (API only)</title>\n")
    nvml = NvmlSampler(enabled=not args.tiny, reason="NVML not used in CPU smoke mode (--tiny)")
    assets_dir = Path(args.assets or out / "assets").resolve()
    assets_started = time.monotonic()
    # the files do not depend on the ComfyUI version: built with the pinned one where it is unpacked
    pinned = REPO / ".cache" / "comfyui"
    assets = build_assets(assets_dir, servers, args.tiny, pinned if (pinned / "main.py").is_file() else comfyui)
    result = {"plan": args.plan, "command": shlex.join(sys.argv), "comfyui": str(comfyui),
              "comfyui_version": comfyui_version(comfyui), "device": nvml.name if nvml.available else "CPU (no NVML)",
              "device_total_gib": round(nvml.total / GIB, 3) if nvml.available else None,
              "nvml": "available" if nvml.available else nvml.reason, "assets_s": round(time.monotonic() - assets_started, 1),
              "s_per_step_source": "trainer clock: leanlora.progress step events' `seconds` (since the loop started, "
                                   "read after each burst's device sync); first burst left out",
              "rows": []}
    results_path = out / "results.json"

    def save():
        rows = result["rows"]
        result["summary"] = {
            "jobs": len(rows), "passed": sum(1 for r in rows if r.get("passed")),
            "failed": sum(1 for r in rows if r.get("status") not in ("skipped", "out of budget") and not r.get("passed")),
            "skipped": sum(1 for r in rows if r.get("status") in ("skipped", "out of budget")),
            "servers_lost": sum(1 for r in rows if r.get("status") in ("server died", "timeout")
                                or r.get("server_alive_after") is False),
            "base_identity": [r.get("base_identical") for r in rows if "base_identical" in r],
            "wall_s": round(time.monotonic() - begun, 1)}
        results_path.write_text(json.dumps(result, indent=1, default=str))

    for spec in servers:
        allocator = "cpu" if args.tiny else ("native (--disable-cuda-malloc)" if spec.native_allocator else "ComfyUI default")
        common = {"server": spec.name, "model": spec.model, "card_gib": spec.card_gib, "allocator": allocator}
        server = None
        restarts = 0
        base_pixels = None
        start_failures = 0
        for index, job in enumerate(spec.jobs):
            left = args.budget_s - (time.monotonic() - begun)
            if start_failures >= 2:  # a server that cannot start twice will not start for the next job either
                result["rows"].append({**common, "job": job.name, "status": "skipped", "passed": False,
                                       "error": "this server failed to start twice"})
                save()
                continue
            need = job_estimate(job) + (spec.est_start_s if server is None else 0)
            if need > left:
                result["rows"].append({**common, "job": job.name, "status": "skipped", "passed": False,
                                       "error": f"time budget: ~{need:.0f} s needed, {left:.0f} s left"})
                save()
                continue
            if server is None:
                server = MatrixServer(spec, comfyui, out / "servers", assets_dir, web_root, args.tiny, nvml, restarts)
                if any(j.kind == "peer" for j in spec.jobs):
                    stage_peer_images(Path(assets[spec.model]["dataset"]), server.base / "input" / PEER_FOLDER)
                if nvml.available:
                    time.sleep(0.5)  # a server stopped just before may still be handing its memory back
                server.prepare_card(args.emulation)  # a holder is up before the baseline: part of it
                if nvml.available:
                    server.nvml_baseline = nvml.used()
                try:
                    server.start(timeout=min(180, max(30, left - 10)))
                except Exception as error:
                    result["rows"].append({**common, **server.card_record(), "job": job.name,
                                           "status": "server failed to start", "passed": False,
                                           "error": f"{type(error).__name__}: {error}", "log_tail": server.log_tail(),
                                           "abort_lines": server.abort_lines(), "command": shlex.join(server.command)})
                    server.stop()
                    server, restarts, start_failures = None, restarts + 1, start_failures + 1
                    save()
                    continue
                print(f"[matrix] {spec.name}: ComfyUI up in {server.start_s:.1f} s ({server.device_line() or 'cpu'})",
                      flush=True)
            timeout = min(job.timeout_s, max(20.0, args.budget_s - (time.monotonic() - begun) - 5))
            row = {**common, **run_job(server, job, assets, f"{spec.name}_{index}_{job.name}", timeout,
                                       args.sampler_steps, 1.0 if args.tiny else 5.0)}
            row.update(server_start_s=round(server.start_s, 1), server_command=shlex.join(server.command),
                       device_line=server.device_line(), check=job.check,
                       nvml_baseline_gib=round(server.nvml_baseline / GIB, 3) if nvml.available else None,
                       **server.card_record())
            if spec.card_gib and row.get("nvml_peak_over_baseline_gib") is not None:  # the job against its card
                row["job_peak_within_card"] = row["nvml_peak_over_baseline_gib"] <= spec.card_gib
                if row.get("nvml_train_peak_over_baseline_gib") is not None:
                    row["train_peak_within_card"] = row["nvml_train_peak_over_baseline_gib"] <= spec.card_gib
            if server.events and server.events.error:
                row["websocket"] = server.events.error
            pixels = row.pop("base_pixels", None)
            if spec.base_identity and pixels is not None:
                if base_pixels is None:
                    base_pixels = pixels
                else:
                    row["base_identical"] = pixels == base_pixels
                    row["passed"] = row["passed"] and row["base_identical"]
            if spec.lora_identity and job.name == spec.lora_identity[1]:
                first = next(j for j in spec.jobs if j.name == spec.lora_identity[0])
                loras = server.base / "models" / "loras"
                try:
                    row["lora_identity"] = lora_difference(loras / f"{first.output_name}.safetensors",
                                                           loras / f"{job.output_name}.safetensors")
                except Exception as error:  # noqa: BLE001 - a missing file is this row's failure
                    row["lora_identity"] = {"identical": False, "error": f"{type(error).__name__}: {error}"}
                print(f"[matrix] {spec.name}: LoRA {first.name} vs {job.name}: {row['lora_identity']}", flush=True)
            result["rows"].append(row)
            print(f"[matrix] {spec.name}/{job.name}: {row['status']}{'' if row['passed'] else ' (FAILED)'}, "
                  f"s/step {row.get('s_per_step')}, NVML peak {row.get('nvml_peak_gib')}, wall {row.get('wall_s')} s"
                  + (f" — {row['error'][:300]}" if row.get("error") else ""), flush=True)
            save()
            if row["status"] == "killed":  # deliberate: the next server starts on the same folders
                server.stop()
                server = None
            elif not row["server_alive_after"] or row["status"] in ("timeout", "out of budget"):
                server.stop()
                server, restarts = None, restarts + 1
        if server is not None:
            if spec.held_memory:
                result.setdefault("held_after_free", {})[spec.name] = server.free_and_measure()
                save()
            server.stop()
    save()
    return result


LIVE_SERVERS: list[MatrixServer] = []


def _stop_on_signal(signum, _frame) -> None:
    """`timeout` (or the device tool) ending this process must not leave a ComfyUI holding the GPU."""
    for server in list(LIVE_SERVERS):
        server.stop()
    raise SystemExit(128 + signum)


def main(argv=None) -> None:
    import signal
    signal.signal(signal.SIGTERM, _stop_on_signal)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="core")
    parser.add_argument("--out", default="out/server_matrix")
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH") or str(REPO / ".cache" / "comfyui"),
                        help="the ComfyUI folder to run (default: .cache/comfyui, the pinned 0.3.75)")
    parser.add_argument("--assets", default="", help="folder for the random weights and datasets (default OUT/assets)")
    parser.add_argument("--budget-s", type=float, default=520, help="skip jobs that would end after this many seconds")
    parser.add_argument("--only", default="", help="comma list of server names, job names or server/job")
    parser.add_argument("--cards", default="", help="comma list of card sizes in GiB to keep (e.g. 2,3,4,6,8,12,24)")
    parser.add_argument("--sampler-steps", type=int, default=None, help="KSampler steps after each job (4; 1 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke mode: tiny SD1.5 assets, --cpu, no caps, no NVML")
    parser.add_argument("--emulation", choices=EMULATIONS, default=DEFAULT_EMULATION,
                        help="a card of N GiB: a holder process keeps the rest of the device (default; env "
                             "BENCH_CARD_EMULATION), or the per-process fraction cap + --reserve-vram alone")
    parser.add_argument("--list", action="store_true", help="print the plan with time estimates and exit")
    args = parser.parse_args(argv)
    if args.sampler_steps is None:
        args.sampler_steps = 1 if args.tiny else 4
    if args.list:
        servers = select(PLANS[args.plan](), [o for o in args.only.split(",") if o],
                         [float(c) for c in args.cards.split(",")] if args.cards else None)
        total = 0.0
        for spec in servers:
            est = spec.est_start_s + sum(job_estimate(j) for j in spec.jobs)
            total += est
            print(f"{spec.name:30} {spec.model} {spec.form:10} card {spec.card_gib or '-'} "
                  f"{'native' if spec.native_allocator else 'default'}  ~{est:.0f} s: " +
                  ", ".join(f"{j.name}({j.steps if j.kind != 'sample' else 'sample'})" for j in spec.jobs))
        print(f"total ~{total:.0f} s + assets")
        return
    result = run_matrix(args)
    table = markdown(result)
    (Path(args.out) / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
