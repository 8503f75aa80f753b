"""LeanLoRA benchmark: our presets and two peers, same GPU, same process, same random models.

    python -m bench.run [--tiny] [--models sd15,sdxl] [--steps N] [--warmup N] [--out DIR] [--configs ...]

Models are ComfyUI's own UNet classes with random weights, built directly on the device the way ComfyUI loads a
checkpoint (model_detection config -> supported_models -> BaseModel). Latents and text are random tensors cached
once. Each row builds its model, resets the CUDA peak counters, runs warm-up + timed optimizer steps and frees
everything. Writes results.json after every row (a timeout still leaves results), then a PNG chart and a table.
--tiny: a one-level SD1.5-shaped UNet at 64 px (latent 8x8) that runs on the CPU in seconds (CI smoke test).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
PEAK_TFLOPS_DEFAULT = 790.0  # H200 bf16 dense peak; override with --peak-tflops for another GPU


def _put_comfyui_first() -> Path:
    """ComfyUI ($COMFYUI_PATH, else .cache/comfyui) goes first on sys.path: its top-level `nodes` module must win
    over this pack's nodes/ package. Without CUDA, ComfyUI needs --cpu before comfy.model_management loads."""
    path = Path(os.environ.get("COMFYUI_PATH") or REPO / ".cache" / "comfyui").resolve()
    if not (path / "comfy").is_dir():
        raise SystemExit(f"bench: no ComfyUI at {path}; set COMFYUI_PATH or run scripts/setup_env.sh")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    if str(REPO) not in sys.path:
        sys.path.append(str(REPO))
    import comfy.cli_args
    if "comfy.model_management" not in sys.modules and not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True
    return path


COMFYUI_PATH = _put_comfyui_first()

from bench.peers import (DIFFUSERS_SD15, DIFFUSERS_SDXL, DIFFUSERS_TINY, LORA_ALPHA, LORA_RANK,  # noqa: E402
                         PeerUnavailable, StepClock, Workload, random_init_, run_comfyui_peer,
                         run_diffusers_peer)
from trainer.errors import is_out_of_memory, one_line  # noqa: E402
from trainer.step import compiled_blocks  # noqa: E402
from trainer.step.compiled_blocks import compiled_graph_count, inductor_cache_counts  # noqa: E402


# --- models ---

@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str          # ComfyUI family the config is detected as
    resolution: int
    context_dim: int
    comfy_unet: dict     # what comfy.model_detection derives from a real checkpoint of this model
    diffusers_unet: dict


_COMFY_COMMON = dict(use_checkpoint=False, image_size=32, in_channels=4, out_channels=4, use_spatial_transformer=True,
                     legacy=False, model_channels=320, use_temporal_attention=False, use_temporal_resblock=False)
SPECS = {
    "sd15": ModelSpec("sd15", "sd15", 512, 768, dict(
        _COMFY_COMMON, adm_in_channels=None, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
        transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
        transformer_depth_middle=1, use_linear_in_transformer=False, context_dim=768, num_heads=8,
        num_head_channels=-1), DIFFUSERS_SD15),
    "sdxl": ModelSpec("sdxl", "sdxl", 1024, 2048, dict(
        _COMFY_COMMON, num_classes="sequential", adm_in_channels=2816, num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4],
        transformer_depth=[0, 0, 2, 2, 10, 10], transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10],
        transformer_depth_middle=10, use_linear_in_transformer=True, context_dim=2048, num_head_channels=64),
        DIFFUSERS_SDXL),
    # ComfyUI still detects this one-level UNet as SD1.5 (detection reads only channels/context/adm/linear);
    # SDXL has no tiny form because its supported_models config pins the transformer depths.
    "sd15-tiny": ModelSpec("sd15-tiny", "sd15", 64, 768, dict(
        _COMFY_COMMON, adm_in_channels=None, num_res_blocks=[1], channel_mult=[1], transformer_depth=[1],
        transformer_depth_output=[1, 1], transformer_depth_middle=1, use_linear_in_transformer=False,
        context_dim=768, num_heads=8, num_head_channels=-1), DIFFUSERS_TINY),
}


def build_comfy_model(spec: ModelSpec, weight_dtype: torch.dtype, device: torch.device):
    """ComfyUI's loader path minus the state dict: detect the supported model from the UNet config, set the
    weight dtype, get_model() builds BaseModel/SDXL (UNetModel with comfy.ops, model_sampling) on the device."""
    import comfy.model_detection

    model_config = comfy.model_detection.model_config_from_unet_config(dict(spec.comfy_unet, dtype=weight_dtype))
    if model_config is None:
        raise RuntimeError(f"ComfyUI does not detect the {spec.name} UNet config")
    model_config.set_inference_dtype(weight_dtype, None)
    with torch.device(device):
        base = model_config.get_model({}, "", device=device)
    torch.manual_seed(0)  # the same weights in every row: a preset and its -eager twin must train identically
    random_init_(base.diffusion_model)
    return base.to(device)  # model_sampling's schedule buffers follow the weights, as ModelPatcher.load does


def make_workload(spec: ModelSpec, batch: int, device: torch.device) -> Workload:
    g = torch.Generator().manual_seed(0)
    side = spec.resolution // 8
    return Workload(
        family=spec.family, resolution=spec.resolution, batch=batch, device=device,
        latents=torch.randn((batch, 4, side, side), generator=g),
        context=torch.randn((batch, 77, spec.context_dim), generator=g),
        pooled=torch.randn((batch, 1280), generator=g) if spec.family == "sdxl" else None,
        build_comfy_model=lambda dtype: build_comfy_model(spec, dtype, device),
        diffusers_config=spec.diffusers_unet, reset_peak=lambda: reset_peak(device))


# --- our presets: the real trainer code path ---

def presets() -> dict:
    """Our presets as the MemorySettings a user picks in LeanLoRA Memory Settings (batch comes from the row)."""
    from trainer.settings import MemorySettings as M
    base = {"fast": M("bf16", False, 1, 1, "AdamW"),
            "balanced": M("bf16", True, 1, 1, "AdamW"),
            "lean": M("bf16", True, 1, 1, "AdamW8bit", "fp8", activation_offload=True),
            "leanest": M("bf16", True, 1, 1, "AdamW8bit", "fp8_streamed", activation_offload=True)}
    # the lean preset's parts one at a time, to show what each costs
    parts = {"gc+fp8": M("bf16", True, 1, 1, "AdamW", "fp8"), "gc+8bit": M("bf16", True, 1, 1, "AdamW8bit"),
             "gc+fp8+8bit": M("bf16", True, 1, 1, "AdamW8bit", "fp8"),
             "gc+fp8+offload": M("bf16", True, 1, 1, "AdamW", "fp8", activation_offload=True),
             "fast+compile": replace(base["fast"], compile=True),
             # compile experiments (bench only, see COMPILE_VARIANTS): fast+compile-<variant>, lean+compile-<variant>
             **{f"{preset}+compile-{variant}": replace(base[preset], compile=True)
                for preset in ("fast", "lean") for variant in COMPILE_VARIANTS},
             "lean+bf16w": replace(base["lean"], lora_weights="bf16_stochastic_rounding"),
             "lean+compile": replace(base["lean"], compile=True),
             "balanced+compile": replace(base["balanced"], compile=True),
             # selective checkpointing (issue 32's lever): matmul/conv/attention outputs kept, the rest recomputed
             "balanced+sac": replace(base["balanced"], selective_recompute=True),
             "gc+fp8+8bit+sac": M("bf16", True, 1, 1, "AdamW8bit", "fp8", selective_recompute=True),
             # streamed weights copied a layer ahead on a copy stream (issue 32's lever): leanest with and without
             "leanest+prefetch": replace(base["leanest"], prefetch_streamed=True),
             "stream20": M("bf16", True, 1, 1, "AdamW8bit", "fp8_streamed", activation_offload=True, stream_share=0.2),
             "stream20+prefetch": M("bf16", True, 1, 1, "AdamW8bit", "fp8_streamed", activation_offload=True,
                                    stream_share=0.2, prefetch_streamed=True),
             # lean's parts compiled: what each costs at equal (compiled) settings
             "gc+fp8+compile": M("bf16", True, 1, 1, "AdamW", "fp8", compile=True),
             "gc+fp8+8bit+compile": M("bf16", True, 1, 1, "AdamW8bit", "fp8", compile=True),
             # experiment: convolution weights forced channels-last (see start_session); the product already
             # stores SD1.5's so on CUDA, so for SD1.5 these equal their base rows
             "fast+cl": base["fast"], "balanced+cl": base["balanced"], "lean+cl": base["lean"],
             # experiment: activation offload's overlap (bench only, see OFFLOAD_VARIANTS)
             **{name: base["lean"] for name in OFFLOAD_VARIANTS}}
    # <preset>-eager: the same settings without the fast path (CUDA graphs), to show what it buys
    return {**base, **parts, **{f"{name}-eager": replace(m, fast_path="off") for name, m in {**base, **parts}.items()}}


# compile experiments: variant -> what compiles instead of the product's units (ResBlocks + transformer layers)
COMPILE_VARIANTS = {"no-resblocks": "transformer layers only: fewer graphs, faster compile",
                    "modules": "ResBlocks + attention and feed-forward modules (campaign 6's units)",
                    "all-resblocks": "transformer layers + every ResBlock (the product's units before campaign 9)",
                    "pw1": "the product's units, inductor's pointwise kernels with one config each (no autotuning)",
                    "no-combo": "the product's units without inductor's combo kernels (the product before "
                                "campaign 10: a layer's small independent kernels launched one by one)"}
# compile experiments: inductor options over the product's (trainer.step.compiled_blocks.INDUCTOR_OPTIONS) for their row,
# handed to the session (TrainingSession's inductor_settings)
INDUCTOR_OPTIONS = {"pw1": {"triton.autotune_pointwise": False}, "no-combo": {"combo_kernels": False}}
# offload experiments: preset -> ActivationOffload keyword arguments for that row (TrainingSession's offload_settings)
OFFLOAD_VARIANTS = {"lean+inflight8": {"in_flight": 8}, "lean+ahead3": {"fetch_ahead": 3},
                    "lean+inflight8+ahead3": {"in_flight": 8, "fetch_ahead": 3}}


def start_session(work: Workload, memory, steps: int, cap_gib: float | None = None, start_on_cpu: bool = False,
                  compile_variant: str | None = None, channels_last: bool = False, offload_settings: dict | None = None):
    """The Train node's TrainingSession on a bench model, started (compile, auto-fit, estimate): (session,
    estimate, fit lines, seconds the start took). With a cap (or start_on_cpu) the checkpoint waits in CPU memory,
    as in ComfyUI, and the session places only what it decided to; the cap then counts everything training puts
    on the GPU."""
    import comfy.model_patcher

    from trainer.cache import CachedSample
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.lora import inject_lora
    from trainer.session import TrainingSession
    from trainer.settings import LoraSettings, TrainSettings

    device = work.device
    base = work.build_comfy_model(torch.bfloat16)  # frozen base weights as ComfyUI loads them on a bf16 GPU
    if cap_gib is not None or start_on_cpu:
        base.diffusion_model.to("cpu")
        free_device_memory(device)
    if cap_gib is not None:
        apply_cap(device, cap_gib)
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=device, offload_device=device)
    adapter = ComfyAdapter.for_cached_inputs(patcher)  # the bench brings cached latents and text embeddings
    adapter.set_attention(memory.attention, compiled=memory.compile)  # as the Train node does
    if compile_variant in ("no-resblocks", "all-resblocks"):
        from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock
        prepare = ComfyAdapter.prepare_compile_units

        def other_resblocks(unet):
            layers = [m for m in prepare(adapter, unet) if not isinstance(m, ResBlock)]
            every = [m for m in unet.modules() if isinstance(m, ResBlock)]
            return every + layers if compile_variant == "all-resblocks" else layers
        adapter.prepare_compile_units = other_resblocks
    elif compile_variant == "modules":
        adapter.prepare_compile_units = lambda unet: ComfyAdapter.prepare_compile_units(adapter, unet, scope="modules")
    elif compile_variant not in (None, *INDUCTOR_OPTIONS):
        raise ValueError(f"bench: unknown compile variant {compile_variant!r}")
    unet = base.diffusion_model
    unet.requires_grad_(False)
    if channels_last:  # experiment: convolution weights stored NHWC (cuDNN's bf16 kernels on Hopper are NHWC)
        for module in unet.modules():
            if isinstance(module, torch.nn.Conv2d):
                module.weight.data = module.weight.data.contiguous(memory_format=torch.channels_last)
    lora = LoraSettings(rank=LORA_RANK, alpha=LORA_ALPHA, targets="attention")
    params = inject_lora(unet, lora, seed=0, target_modules=adapter.lora_targets(unet, lora.targets))
    unet.train()
    cond = cached_conditioning(base, work)
    cache = [CachedSample(work.latents[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()}) for i in range(work.batch)]
    session = TrainingSession(adapter, unet, params, cache, 1, TrainSettings(steps, 1e-4, 0, "bench"),
                              inductor_settings=row_inductor_options(compile_variant), offload_settings=offload_settings)
    started = time.perf_counter()
    estimate, fit_lines = session.start(memory)
    return session, estimate, fit_lines, time.perf_counter() - started


def run_ours(work: Workload, preset: str, cap_gib: float | None, warmup: int, steps: int, count_flops: bool) -> dict:
    """TrainingSession is what the Train node runs: settings, auto-fit, estimate and steps are the product's."""
    return _run_ours(work, preset, cap_gib, warmup, steps, count_flops)


def row_inductor_options(compile_variant: str | None) -> dict:
    """The inductor options a row compiles with: the product's, with its compile experiment's over them."""
    return {**compiled_blocks.INDUCTOR_OPTIONS, **INDUCTOR_OPTIONS.get(compile_variant, {})}


def _run_ours(work: Workload, preset: str, cap_gib: float | None, warmup: int, steps: int, count_flops: bool) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.loop import StepParts, train_loop
    from trainer.session import RunEvents
    from trainer.settings import AutoFit
    from trainer.train_lora import LOSS_READ_EVERY

    device = work.device
    memory = replace(presets()["fast" if preset == "autofit" else preset], batch_size=work.batch)
    if preset == "autofit":
        memory = replace(memory, auto_fit=AutoFit(card_gib=cap_gib))
    _forget_graphs_compiled_otherwise(memory.compile, row_inductor_options(_compile_variant(preset)))
    session, estimate, fit_lines, start_s = start_session(
        work, memory, warmup + steps, cap_gib, compile_variant=_compile_variant(preset),
        channels_last=preset.removesuffix("-eager").endswith("+cl"),
        offload_settings=OFFLOAD_VARIANTS.get(preset.removesuffix("-eager")))
    params = session.params
    notes = [*fit_lines, *session.notes, estimate.format()]
    initial = _flat_lora(params)

    class Timed(RunEvents):  # the Train node's loss reads, each step's end marked on the clock
        sync_every = LOSS_READ_EVERY

        def after_step(self) -> None:
            clock.mark()

    clock = StepClock(device)
    work.reset_peak()
    retries = alloc_retries(device)
    clock.mark()
    # the Train node's run: loss read every N steps, out-of-memory recovery, step count kept by the session
    result = session.run(Timed())
    retries = alloc_retries(device) - retries
    if retries:  # each one frees the allocator's cache and synchronizes: a run at its cap's edge
        notes.append(f"allocator: {retries} allocations retried after freeing cached memory during the timed steps")
    if session.is_compiled:
        notes.append(_compile_note())
    final = _flat_lora(params)
    out = {"intervals": clock.intervals(), "losses": result.losses, "peak": read_peak(device), "start_s": start_s,
           "estimate_gib": estimate.total / GIB if estimate.total else None, "settings": session.memory.describe(),
           "lora_final": final, "lora_moved": float((final - initial).norm()),
           "changes_numbers": changes_numbers(session.memory)}
    if count_flops:  # one extra, untimed step after the peak was read
        # eager: dynamo would give up on compiled blocks under the counter's dispatch mode, for the whole process
        with torch.compiler.set_stance("force_eager"), FlopCounterMode(display=False) as counter:
            # one eager step (a replayed graph dispatches nothing to count)
            train_loop(StepParts(params, session.loss, session.optimizer, session.precision,
                                 session.memory.gradient_accumulation), session.data, 1)
        out["flops"] = counter.get_total_flops()
        out["flops_include_recompute"] = session.memory.gradient_checkpointing
    offload = session.micro_step.offload
    if offload:  # the latest recorded/captured pass (a replayed graph runs no hooks)
        notes.append(f"activation offload: {offload.offloaded_bytes / GIB:.2f} GiB per pass; "
                     f"{offload.fetched_ahead} tensors fetched back ahead, {offload.fetched_on_demand} on demand, "
                     f"{offload.fetched_unused} fetched but never used")
    session.close()
    out["notes"] = notes + [n for n in session.notes if n not in notes]
    return out


def changes_numbers(memory) -> bool:
    """Whether a plan computes with other numbers than the fast plan (fp8 base weights, 8-bit optimizer states,
    bf16 LoRA weights) rather than only keeping or moving memory elsewhere."""
    from trainer.memory.planner import FULL_PRECISION  # every 8-bit optimizer, with its full-precision twin
    from trainer.settings import LoraWeights
    return memory.base_weights.fp8 or memory.optimizer in FULL_PRECISION or memory.lora_weights is not LoraWeights.FP32


def _flat_lora(params) -> torch.Tensor:
    """The LoRA's weights as one fp32 vector on the host (what the LoRA comparison between rows reads)."""
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in params])


_compiled_with: dict | None = None  # the inductor options of this process's compiled graphs


def _forget_graphs_compiled_otherwise(compiles: bool, options: dict) -> None:
    """Dynamo hands a row the graphs an earlier row compiled (same code, guards pass), whatever inductor options
    the row compiles with: a compile row whose options differ from the last compile row's starts from a reset
    dynamo."""
    global _compiled_with
    if not compiles or options == _compiled_with:
        return
    if _compiled_with is not None:
        torch._dynamo.reset()
    _compiled_with = dict(options)


def _compile_variant(preset: str) -> str | None:
    variant = preset.removesuffix("-eager").partition("+compile-")[2]
    return variant if variant in COMPILE_VARIANTS else None


def _compile_note() -> str:
    """What dynamo and inductor did in this process so far: graphs compiled, how many of them inductor's on-disk
    caches served, and where compile time went (graphs compiled after step 1 are the product report's own note)."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    aot, (hits, misses) = counters["aot_autograd"], inductor_cache_counts()
    # nested phases: an outer one includes its inner ones
    phases = sorted(compilation_time_metrics.items(), key=lambda item: -sum(item[1]))[:10]
    return (f"torch.compile: {compiled_graph_count()} graphs in this process; inductor cache "
            f"{hits} hits / {misses} misses, autograd cache "
            f"{aot['autograd_cache_hit']} hits / {aot['autograd_cache_miss']} misses; phases (s): "
            + ", ".join(f"{name} {sum(times):.1f}" for name, times in phases))


def alloc_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def cached_conditioning(base, work: Workload) -> dict[str, torch.Tensor]:
    """What trainer's cache holds per image: ComfyAdapter.encode_text's base.extra_conds on the CPU (SDXL's `y`
    is built from the pooled embedding and the size, as ComfyUI does)."""
    conds = base.extra_conds(cross_attn=work.context, pooled_output=work.pooled, width=work.resolution,
                             height=work.resolution, device=torch.device("cpu"))
    return {name: c.cond for name, c in conds.items()}


# --- rows ---

@dataclass(frozen=True)
class RowConfig:
    name: str        # as given on the command line, e.g. "lean", "autofit@3", "fast:bs8"
    kind: str        # "ours", "diffusers", "comfyui"
    preset: str | None
    cap_gib: float | None
    batch: int
    autotune: bool = False  # cuDNN autotune for the row, as ComfyUI's `--fast autotune` sets it process-wide
    model: str | None = None  # `sdxl/fast:bs8`: this model only (its family in --tiny mode)

    def applies_to(self, spec: "ModelSpec") -> bool:
        return self.model is None or self.model in (spec.name, spec.family)


DEFAULT_CONFIGS = "fast,balanced,lean,leanest,diffusers,comfyui,autofit@2,autofit@3,autofit@4,autofit@6,autofit@8"
PEERS = ("diffusers", "comfyui")


def parse_config(token: str) -> RowConfig:
    """`[model/]name[:bsN][:autotune]`: a preset, `<preset>@N` (under an N GiB cap), `autofit@N` or a peer, for
    every model of --models or only `model` (sd15, sdxl)."""
    model, _, rest = token.strip().rpartition("/")
    if model and model not in ("sd15", "sdxl"):
        raise SystemExit(f"bench: bad config {token!r}; a model prefix is sd15/ or sdxl/")
    row = _parse_row(rest, token.strip())
    return replace(row, model=model) if model else row


def _parse_row(spec: str, token: str) -> RowConfig:
    name, *suffixes = spec.split(":")
    batch, autotune = 1, False
    for suffix in suffixes:
        if suffix == "autotune":
            autotune = True
        elif suffix.startswith("bs") and suffix[2:].isdigit() and int(suffix[2:]) >= 1:
            batch = int(suffix[2:])
        else:
            raise SystemExit(f"bench: bad config {token!r}; suffixes are :bsN (batch, e.g. fast:bs8) and :autotune")
    if name in presets():
        return RowConfig(token, "ours", name, None, batch, autotune)
    preset, _, cap = name.partition("@")
    if preset in presets() and cap.replace(".", "", 1).isdigit() and float(cap) > 0:
        return RowConfig(token, "ours", preset, float(cap), batch, autotune)  # a preset as is, under a cap
    if name in PEERS:
        return RowConfig(token, name, None, None, batch, autotune)
    if name == "comfyui-offload":  # ComfyUI 0.33's node with its offloading input on
        return RowConfig(token, "comfyui", "offloading", None, batch, autotune)
    if name.startswith("autofit@"):
        try:
            cap = float(name.split("@", 1)[1])
        except ValueError:
            cap = -1.0
        if cap > 0:  # the fast preset, auto-fitted by the trainer to the cap (which is also enforced)
            return RowConfig(token, "ours", "autofit", cap, batch, autotune)
    raise SystemExit(f"bench: unknown config {token!r}; use {DEFAULT_CONFIGS} (optionally with :bsN, :autotune)")


def reset_peak(device: torch.device) -> None:
    """Called once the row's model is built: build-time temporaries (e.g. the diffusers UNet's fp32 copy) are
    released from the allocator cache first, else they would count as this row's reserved memory."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def apply_cap(device: torch.device, cap_gib: float) -> None:
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), device)


def read_peak(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return {"alloc": torch.cuda.max_memory_allocated(device) / GIB,
            "reserved": torch.cuda.max_memory_reserved(device) / GIB}


def free_device_memory(device: torch.device) -> None:
    import comfy.model_management
    comfy.model_management.unload_all_models()
    gc.collect()  # checkpoint wrappers and peft layers form reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def who_holds_cuda_memory(top: int = 3, depth: int = 4, wanted=lambda t: t.is_cuda) -> str:
    """For leak hunting: the largest live CUDA tensors (`wanted`) and, for each, a chain of what refers to it
    (dicts shown with a few of their keys), up to `depth` levels."""
    import warnings
    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and wanted(o)]
    tensors.sort(key=lambda t: -t.numel() * t.element_size())
    ignore = {id(tensors)}

    def describe(obj) -> str:
        if isinstance(obj, dict):
            return "dict{" + ",".join(str(k)[:20] for k in list(obj)[:4]) + "}"
        return type(obj).__name__

    parts = []
    for t in tensors[:top]:
        chain, current = [], t
        for _ in range(depth):
            holders = [r for r in gc.get_referrers(current) if id(r) not in ignore and not isinstance(r, type(sys._getframe()))]
            if not holders:
                break
            # containers and objects first: closure cells and argument tuples say little about who keeps it
            holders.sort(key=lambda r: type(r).__name__ in ("cell", "tuple", "function", "method"))
            current = holders[0]
            chain.append(describe(current) + (f" (+{len(holders) - 1})" if len(holders) > 1 else ""))
        parts.append(f"{tuple(t.shape)} {t.dtype} <- {' <- '.join(chain) or '?'}")
    return f"{len(tensors)} tensors alive; largest: " + "; ".join(parts)


def _run_config(work: Workload, config: RowConfig, warmup: int, steps: int, count_flops: bool) -> dict:
    if config.kind == "ours":
        return run_ours(work, config.preset, config.cap_gib, warmup, steps, count_flops)
    if config.kind == "diffusers":
        return run_diffusers_peer(work, warmup, steps)
    return run_comfyui_peer(work, warmup, steps, offloading=config.preset == "offloading")


def run_row(spec: ModelSpec, config: RowConfig, args, device: torch.device, count_flops: bool) -> dict:
    row = {"model": spec.name, "resolution": spec.resolution, "config": config.name, "kind": config.kind,
           "preset": config.preset, "cap_gib": config.cap_gib, "batch": config.batch, "status": "ok", "reason": None,
           "notes": []}
    if config.cap_gib is not None and device.type != "cuda":
        return dict(row, status="skipped", reason="memory caps need CUDA")
    started = time.perf_counter()
    row["baseline_alloc_gib"] = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    if config.cap_gib is not None and config.kind != "ours":
        apply_cap(device, config.cap_gib)  # ours sets it itself once the checkpoint sits in CPU memory
    result = None
    autotune_before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = config.autotune or autotune_before
    try:
        result = _run_config(make_workload(spec, config.batch, device), config, args.warmup, args.steps, count_flops)
    except PeerUnavailable as error:
        row.update(status="unavailable", reason=str(error))
    except Exception as error:  # an OOM (or any failure) becomes a row; the run goes on
        if is_out_of_memory(error):
            row.update(status="OOM", reason=str(error).splitlines()[0][:300], where=_where(error))
        else:
            row.update(status="error", reason=one_line(error, 300))
    finally:
        torch.backends.cudnn.benchmark = autotune_before
        peak = read_peak(device)
        if config.cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    free_device_memory(device)  # after the except block, so a traceback no longer pins the row's tensors
    if result is not None:
        row.update(_measurements(result, args.warmup, config.batch))
        if "lora_final" in result:  # kept out of the JSON (tens of MB): _run moves it to its own table
            row["_lora"], row["lora_moved"] = result["lora_final"], result["lora_moved"]
            row["changes_numbers"] = result["changes_numbers"]
        peak = result.get("peak") or peak
    if peak:
        row["peak_alloc_gib"], row["peak_reserved_gib"] = peak["alloc"], peak["reserved"]
    row["row_wall_s"] = time.perf_counter() - started
    if device.type == "cuda":
        left = torch.cuda.memory_allocated(device) / GIB - (row["baseline_alloc_gib"] or 0.0)
        # What the row failed to give back would count in every later row's peak. Up to ~0.13 GiB stays by design:
        # the cuBLAS workspaces of the main and the fast path's stream, allocated once per process.
        if left > 0.2:
            row["notes"] = row["notes"] + [f"{left:.2f} GiB still allocated after the row"]
            print(f"[bench] warning: {left:.2f} GiB still allocated after {spec.name} {config.name}", flush=True)
            if left > 0.5:
                row["notes"].append("held by: " + who_holds_cuda_memory())
                print(f"[bench]   held by: {row['notes'][-1][len('held by: '):]}", flush=True)
    return row


def _where(error: BaseException) -> str:
    """The innermost frames of our code (trainer/, bench/) the error passed through: which phase ran out."""
    import traceback
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/trainer/" in f.filename or "/bench/" in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


def _measurements(result: dict, warmup: int, batch: int) -> dict:
    warmup = result.get("warmup", warmup)
    intervals, losses = result["intervals"], result["losses"]
    timed = intervals[warmup:]
    out = {"warmup_steps": warmup, "warmup_s": sum(intervals[:warmup]), "timed_steps": len(timed),
           "start_s": result.get("start_s"),
           "step_s": timed, "notes": result.get("notes", [])}
    if result.get("setup_in_first_step"):
        out["notes"] = out["notes"] + ["warm-up time includes the peer's own setup"]
    if timed:
        out["s_per_step"] = statistics.median(timed)
        out["images_per_s"] = batch / out["s_per_step"]
    if losses:
        out["losses"] = losses
        out["loss_first"], out["loss_last"] = losses[0], losses[-1]
        out["loss_finite"] = all(x == x and abs(x) != float("inf") for x in losses)
    for key in ("flops", "flops_include_recompute", "estimate_gib", "settings"):
        if key in result:
            out[key] = result[key]
    return out


# A plan that only keeps or moves memory elsewhere trains the fast plan's LoRA up to nondeterminism: within
# LORA_YARDSTICKS times what a second run of the fast plan differs, and at least LORA_FLOOR (README, "Memory and
# speed"); the server path's agreement groups judge by the same (bench/lora_agreement.py)
from bench.lora_agreement import LORA_FLOOR, LORA_YARDSTICKS  # noqa: E402


def lora_agreement(rows: list[dict], finals: dict[int, torch.Tensor]) -> None:
    """Each of our rows' LoRA after its steps against the fast preset's row of the same model and batch: the
    distance between the two, relative to how far the fast row's LoRA moved from its start (the same seeded start
    in every row). What a memory plan changes in what is learned; a second `fast` row is the yardstick (run-to-run
    nondeterminism of the same plan). Plans that only move memory get `lora_within` (the stated tolerance); plans
    that change the numbers (changes_numbers) are reported only."""
    fast_rows = lambda row: [r for r in rows if r["config"] == "fast" and r["model"] == row["model"]  # noqa: E731
                             and r["batch"] == row["batch"]]
    for row in rows:
        final = finals.get(id(row))
        reference = next((r for r in fast_rows(row) if r is not row and id(r) in finals), None)
        if final is not None and reference is not None and reference.get("lora_moved"):
            row["lora_vs_fast"] = float((final - finals[id(reference)]).norm()) / reference["lora_moved"]
    for row in rows:
        if "lora_vs_fast" not in row or row.get("changes_numbers"):
            continue
        yardstick = max((r["lora_vs_fast"] for r in fast_rows(row) if "lora_vs_fast" in r), default=0.0)
        row["lora_tolerance"] = max(LORA_YARDSTICKS * yardstick, LORA_FLOOR)
        row["lora_within"] = row["lora_vs_fast"] <= row["lora_tolerance"]


def derive(rows: list[dict], flops: dict, peak_tflops: float) -> None:
    """MFU (from the model's counted FLOPs per image) and ratios to each peer on the same model and batch."""
    for row in rows:
        s = row.get("s_per_step")
        per_image = flops.get(row["model"], {}).get("per_image")
        if s and per_image:
            row["tflop_per_step"] = per_image * row["batch"] / 1e12
            row["mfu"] = per_image * row["batch"] / s / (peak_tflops * 1e12)
        twin = next((r for r in rows if r["config"] == f"{row['config']}-eager" and r["model"] == row["model"]
                     and r.get("losses")), None)
        if twin is not None and row.get("losses"):  # the fast path must train like the eager path
            pairs = list(zip(row["losses"], twin["losses"]))
            row["loss_vs_eager_max_rel"] = max(abs(a - b) / max(abs(b), 1e-8) for a, b in pairs)
        row["ratio"] = {}
        for peer in PEERS:
            ref = next((r for r in rows if r["kind"] == peer and not r.get("preset") and r["model"] == row["model"] and
                        r["batch"] == row["batch"] and r.get("s_per_step")), None)
            if ref is None or not s:
                continue
            ratio = {"s_per_step": s / ref["s_per_step"]}
            if row.get("peak_alloc_gib") and ref.get("peak_alloc_gib"):
                ratio["peak_alloc"] = row["peak_alloc_gib"] / ref["peak_alloc_gib"]
            row["ratio"][peer] = ratio


# --- output ---

def environment(argv: list[str], device: torch.device, peak_tflops: float) -> dict:
    def version(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None
    comfy_version = None
    try:
        from comfyui_version import __version__ as comfy_version
    except ImportError:
        pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, "-m", "bench.run", *argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "device_memory_gib": torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else None,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        **{pkg: version(pkg) for pkg in ("diffusers", "peft", "bitsandbytes", "accelerate", "transformers")},
        "comfyui": comfy_version, "comfyui_path": str(COMFYUI_PATH), "peak_tflops": peak_tflops,
    }


def _fmt(value, spec=".2f", missing="-"):
    return missing if value is None else format(value, spec)


# start s: the session's start before step 1 (compile, memory estimate, auto-fit); warm-up s: the warm-up steps
# (the first step of a shape runs eagerly, then its CUDA graph is captured)
TABLE_COLUMNS = ("model", "config", "status", "peak alloc GiB", "peak resv GiB", "est GiB", "est err %", "s/step",
                 "start s", "warm-up s", "img/s",
                 "MFU %", "loss Δ eager %", "LoRA Δ fast %", "t/diffusers", "mem/diffusers", "t/comfyui", "mem/comfyui")


def _estimate_error(row: dict) -> float | None:
    """The trainer's pre-step-1 estimate against the measured peak allocated, in percent."""
    if row.get("estimate_gib") and row.get("peak_alloc_gib"):
        return 100 * (row["estimate_gib"] - row["peak_alloc_gib"]) / row["peak_alloc_gib"]
    return None


def format_table(rows: list[dict], cuda: bool) -> str:
    mem_missing = "-" if cuda else "n/a (cpu)"
    lines = []
    for r in rows:
        ratio = r.get("ratio", {})
        lines.append((
            f"{r['model']}@{r['resolution']}", r["config"], r["status"],
            _fmt(r.get("peak_alloc_gib"), missing=mem_missing), _fmt(r.get("peak_reserved_gib"), missing=mem_missing),
            _fmt(r.get("estimate_gib")), _fmt(_estimate_error(r), "+.1f"),
            _fmt(r.get("s_per_step"), ".4f"), _fmt(r.get("start_s"), ".1f"), _fmt(r.get("warmup_s"), ".2f"),
            _fmt(r.get("images_per_s"), ".2f"),
            _fmt(r["mfu"] * 100 if r.get("mfu") else None, ".2f"),
            _fmt(r["loss_vs_eager_max_rel"] * 100 if "loss_vs_eager_max_rel" in r else None, ".2f"),
            _fmt(r["lora_vs_fast"] * 100 if "lora_vs_fast" in r else None, ".2f"),
            *(_fmt(ratio.get(p, {}).get(k), ".2f") for p in PEERS for k in ("s_per_step", "peak_alloc"))))
    widths = [max(len(str(x)) for x in col) for col in zip(TABLE_COLUMNS, *lines)]
    render = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [render(TABLE_COLUMNS), render("-" * w for w in widths), *map(render, lines)]
    reasons = [f"  {r['model']} {r['config']}: {r['status']}: {r['reason']}" + (f" [at {r['where']}]" if r.get("where") else "")
               for r in rows if r.get("reason")]
    chosen = [f"  {r['model']} {r['config']}: {r['settings']}" for r in rows if r.get("settings") and r["cap_gib"]]
    outside = [f"  {r['model']} {r['config']}: {100 * r['lora_vs_fast']:.2f}% > {100 * r['lora_tolerance']:.2f}%"
               for r in rows if r.get("lora_within") is False]
    return "\n".join(out + (["reasons:"] + reasons if reasons else []) + (["auto-fit chose:"] + chosen if chosen else [])
                     + (["LoRA beyond the fast plan's tolerance (a plan that only moves memory):"] + outside
                        if outside else []))


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)  # atomic: a timeout never leaves half a file


def draw_chart(rows: list[dict], path: Path, title: str) -> None:
    """Two horizontal bar panels per row: median s/step and peak allocated GiB (Pillow only)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    label_w, panel_w, bar_h, top = 190, 330, 16, 40
    height = top + bar_h * (len(rows) + 1) + 20
    img = Image.new("RGB", (label_w + 2 * panel_w + 40, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((10, 8), title, fill="black", font=font)
    colors = {"ours": (52, 101, 164), "diffusers": (230, 145, 56), "comfyui": (120, 120, 120)}
    for p, (key, header) in enumerate((("s_per_step", "median s/step"), ("peak_alloc_gib", "peak alloc GiB"))):
        x0 = label_w + p * (panel_w + 20)
        draw.text((x0, top - 16), header, fill="black", font=font)
        top_value = max((r.get(key) or 0 for r in rows), default=0) or 1
        for i, r in enumerate(rows):
            y = top + i * bar_h
            value = r.get(key)
            if value:
                draw.rectangle([x0, y + 2, x0 + int((panel_w - 60) * value / top_value), y + bar_h - 2],
                               fill=colors[r["kind"]])
            text = _fmt(value, ".3f" if key == "s_per_step" else ".2f", missing=r["status"] if r["status"] != "ok" else "n/a")
            draw.text((x0 + int((panel_w - 60) * (value or 0) / top_value) + 4, y + 2), text, fill="black", font=font)
    for i, r in enumerate(rows):
        draw.text((10, top + i * bar_h + 2), f"{r['model']} {r['config']}", fill="black", font=font)
    img.save(path)


# --- main ---

def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny SD1.5-shaped UNet at 64 px; runs on the CPU (CI)")
    p.add_argument("--models", default="sd15,sdxl", help="comma list of sd15, sdxl")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma list: presets (fast, balanced, lean, leanest, gc+fp8, ...; <preset>-eager = without CUDA "
                        "graphs; <preset>@GiB = under a per-process cap), diffusers, comfyui, comfyui-offload (0.33's "
                        "offloading), autofit@GiB; optional "
                        ":bsN batch")
    p.add_argument("--steps", type=int, default=12, help="timed optimizer steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per row (reported separately)")
    p.add_argument("--out", default="out/bench", help="folder for results.json, table.txt, bench.png")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="wall-clock budget: rows that would start past it are reported as skipped")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: 1 with --tiny on a CPU, where tiny ops gain nothing from "
                        "threads and shared CI cores make OpenMP fan-out 10x slower; else torch's default)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS_DEFAULT, help="GPU peak for MFU (bf16 dense)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def model_specs(args) -> tuple[list[ModelSpec], list[str]]:
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in ("sd15", "sdxl")]
    if unknown:
        raise SystemExit(f"bench: unknown model(s) {unknown}; use sd15, sdxl")
    if not args.tiny:
        return [SPECS[m] for m in names], []
    notes = ["sdxl has no tiny form (ComfyUI's SDXL config pins its depths); --tiny runs sd15-tiny"] \
        if "sdxl" in names else []
    return [SPECS["sd15-tiny"]], notes


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    import comfy.model_management
    device = comfy.model_management.get_torch_device()
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if args.tiny and device.type == "cpu" else None)
    try:
        if threads:
            torch.set_num_threads(threads)
        return _run(args, argv, device, started)
    finally:
        torch.set_num_threads(threads_before)


def _run(args, argv: list[str], device: torch.device, started: float) -> dict:
    specs, notes = model_specs(args)
    configs = [parse_config(t) for t in args.configs.split(",") if t.strip()]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": dict(environment(argv, device, args.peak_tflops), torch_threads=torch.get_num_threads()),
               "notes": notes,
               "settings": {"steps": args.steps, "warmup": args.warmup, "budget_s": args.budget_s,
                            "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": "to_q,to_k,to_v,to_out.0"}},
               "flops": {}, "rows": [], "complete": False}
    rows, flops = payload["rows"], payload["flops"]
    finals: dict[int, torch.Tensor] = {}  # id(row) -> its LoRA after the run (lora_agreement)
    row_seconds: dict[str, float] = {}  # slowest finished row per model: the estimate for the next one
    for spec, config in ((s, c) for s in specs for c in configs if c.applies_to(s)):
        elapsed = time.perf_counter() - started
        # A model's first row is estimated from the slowest row so far (SDXL rows follow the cheaper SD1.5 ones).
        estimate = row_seconds.get(spec.name, max(row_seconds.values(), default=0.0))
        if elapsed + estimate > args.budget_s:
            rows.append({"model": spec.name, "resolution": spec.resolution, "config": config.name,
                         "kind": config.kind, "batch": config.batch, "status": "skipped",
                         "reason": f"--budget-s {args.budget_s:.0f}: {elapsed:.0f} s used, row needs ~{estimate:.0f} s",
                         "notes": []})
        else:
            count = config.kind == "ours" and config.cap_gib is None and spec.name not in flops
            row = run_row(spec, config, args, device, count)
            if "_lora" in row:
                finals[id(row)] = row.pop("_lora")
            if row.get("flops"):
                flops[spec.name] = {"per_image": row["flops"] / config.batch, "counted_on": config.name,
                                    "includes_recompute": row.get("flops_include_recompute", False)}
            row_seconds[spec.name] = max(row_seconds.get(spec.name, 0.0), row.get("row_wall_s", 0.0))
            rows.append(row)
            speed = f", {row['s_per_step']:.4f} s/step" if row.get("s_per_step") else ""
            print(f"[bench] {spec.name} {config.name}: {row['status']}{speed} "
                  f"({time.perf_counter() - started:.0f} s elapsed)", flush=True)
        derive(rows, flops, args.peak_tflops)
        lora_agreement(rows, finals)
        write_json(out_dir / "results.json", payload)
    payload["complete"] = True
    payload["total_s"] = time.perf_counter() - started
    table = format_table(rows, device.type == "cuda")
    payload["table"] = table
    write_json(out_dir / "results.json", payload)
    (out_dir / "table.txt").write_text(table + "\n")
    env = payload["environment"]
    draw_chart(rows, out_dir / "bench.png", f"LeanLoRA bench, {env['device']}, torch {env['torch']}, {env['date']}")
    print(f"\nLeanLoRA bench on {env['device']} (torch {env['torch']}, diffusers {env['diffusers']}, peft "
          f"{env['peft']}, bitsandbytes {env['bitsandbytes']}, ComfyUI {env['comfyui']}), {env['date']}\n"
          f"{env['command']}\nresults: {out_dir / 'results.json'}, chart: {out_dir / 'bench.png'}\n")
    print(table, flush=True)
    return payload


if __name__ == "__main__":
    main()
