"""Where an EAGER step's time goes on full-size SD1.5 (issue 14: eager lean steps ran ~10-30x their graphed form),
through the product path: a random full-size checkpoint -> ComfyUI's loader -> `train_lora` as the Train node
runs it, the fast path off (or on, for the graphed reference). One child process per variant and allocator; the
profiler (host operators and CUDA runtime calls beside the kernels) covers steps PROFILE_FROM..PROFILE_FROM+3.
GPU machine, after bench/server_gpu.sh's install step:

    PYTHONPATH=/tmp/site python3 -m bench.eager_step_profile [VARIANT ...]     # default: all
    ALLOCATORS=cudaMallocAsync ...                                             # one allocator only
    ... streamed@native fp8@cudaMallocAsync                                    # a variant under one allocator
    PROFILE_STEPS=0 ...    # no profiler: s/step only
    PYSPY_DIR=DIR ...      # each child also sampled by py-spy (host stacks of all threads, raw format, in DIR)
    MODEL=sdxl ...         # full-size SDXL at 1024² instead of SD1.5 at 512²

Variants (bf16, per-layer checkpointing, AdamW8bit, 512² (SDXL: 1024²), batch 1):
  streamed       fp8 weights streamed from the CPU + activation offload, eager (auto-fit 2 GiB's choice)
  lean           fp8 weights resident + activation offload, eager (the lean preset with fast path off;
                 lean_graphs: its graphed reference)
  streamed_cap2  the same inside a 2 GiB per-process cap set once the cache is filled (the emulated card's)
  fp8            fp8 weights resident, eager
  bf16           bf16 weights, eager (AdamW8bit, checkpointing: the eager step without fp8)
  fp8_graphs     fp8 weights resident, CUDA graphs (the graphed reference)
Per child: s/step over the steps after the profiled ones, the operators with the most host time per step, the CUDA
runtime calls (synchronizations, mallocs, host allocations) per step, GPU busy time per kernel family."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMFY = os.environ.get("COMFYUI_PATH", str(REPO / ".cache" / "comfyui"))
ALLOCATORS = {"native": "backend:native", "cudaMallocAsync": "backend:cudaMallocAsync"}
VARIANTS = ["streamed", "streamed_cap2", "lean", "fp8", "bf16", "fp8_graphs"]
MODEL = os.environ.get("MODEL", "sd15")
STEPS = 40
PROFILE_FROM, PROFILED = 12, int(os.environ.get("PROFILE_STEPS", "3"))  # 0: s/step only
GIB = 2 ** 30


def _memory(variant: str):
    from trainer.settings import BaseWeights, FastPath, MemorySettings
    weights = {"streamed": BaseWeights.FP8_STREAMED, "bf16": BaseWeights.AS_LOADED}.get(
        variant.split("_")[0], BaseWeights.FP8)
    return MemorySettings("bf16", True, 1, 1, "AdamW8bit", weights,
                          activation_offload=variant.startswith(("streamed", "lean")),
                          fast_path=FastPath.CUDA_GRAPHS if variant.endswith("graphs") else FastPath.OFF)


def child(variant: str, checkpoint: str, data: str, resolution: str) -> None:
    sys.path[:0] = [COMFY, str(REPO), str(REPO / "scripts")]
    import torch
    from torch.profiler import ProfilerActivity, profile

    import comfy.sd
    from bench.profile_step import summarize
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.dataset import scan_folder
    from trainer.settings import LoraSettings, TrainSettings
    from trainer.train_lora import train_lora

    with torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=True, output_clip=True,
                                                                      embedding_directory=None)
    adapter = ComfyAdapter(model, clip, vae)
    dataset = scan_folder(Path(data), int(resolution))
    stamps: list[tuple[int, float]] = []
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    window: dict[str, float] = {}

    def emit(**event):
        if event.get("text") == "preparing the training copy" and variant.endswith("cap2"):
            torch.cuda.set_per_process_memory_fraction(2 * GIB / torch.cuda.get_device_properties(0).total_memory)
        if event["kind"] == "phase":
            print("PHASE", event["text"][:300], flush=True)
        if event["kind"] != "step":
            return
        step = event["step"]
        stamps.append((step, time.perf_counter()))
        # steps are reported in bursts (several at once): the window is the steps between two reports
        if not PROFILED and "last" not in window and step >= PROFILE_FROM:
            window.update(last=step)  # s/step only: timed from here
        elif PROFILED and "start" not in window and step >= PROFILE_FROM:
            torch.cuda.synchronize()
            profiler.start()
            window.update(start=time.perf_counter(), first=step)
        elif "stop" not in window and "start" in window and step >= window["first"] + PROFILED \
                and time.perf_counter() - window["start"] > 1.0:
            torch.cuda.synchronize()
            profiler.stop()
            window.update(stop=time.perf_counter(), last=step)

    outcome = train_lora(adapter, dataset, _memory(variant), LoraSettings(16, 16.0),
                         TrainSettings(STEPS, 1e-4, 0, f"profile_{variant}"), Path(tempfile.mkdtemp()), emit,
                         lambda: False)
    after = [(s, t) for s, t in stamps if "last" in window and s > window["last"]]
    per_step = (after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0]) if len(after) > 1 else None
    lines = [line[:300] for line in outcome.report.splitlines()
             if any(word in line for word in ("fast path", "graph", "eager", "allocator", "upcast"))]
    print("RESULT " + json.dumps({"s_per_step_unprofiled": per_step, "torch_peak_gib": torch.cuda.max_memory_allocated() / GIB,
                                  "report": lines[-6:]}), flush=True)
    if not PROFILED:
        return
    if "stop" not in window:
        print("PROFILE none (the run ended before the profiled steps)", flush=True)
        return
    steps = int(window["last"] - window["first"])
    wall = window["stop"] - window["start"]
    events = profiler.key_averages()
    print(f"PROFILE {steps} steps, {wall / steps:.4f} s/step wall while profiled", flush=True)
    runtime = [e for e in events if e.key.startswith(("cuda", "cu")) and e.self_cpu_time_total > 0]
    print("PROFILE CUDA runtime calls (count/step, host ms/step):", flush=True)
    for e in sorted(runtime, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"PROFILE   {e.key[:60]:60} {e.count / steps:8.1f} {e.self_cpu_time_total / 1e3 / steps:9.2f}", flush=True)
    operators = [e for e in events if not e.key.startswith(("cuda", "cu")) and e.self_cpu_time_total > 0]
    print("PROFILE operators by host self time (count/step, host ms/step, device ms/step):", flush=True)
    for e in sorted(operators, key=lambda e: -e.self_cpu_time_total)[:22]:
        print(f"PROFILE   {e.key[:60]:60} {e.count / steps:8.1f} {e.self_cpu_time_total / 1e3 / steps:9.2f} "
              f"{getattr(e, 'self_device_time_total', 0) / 1e3 / steps:9.2f}", flush=True)
    for line in summarize(events, wall, steps, top=8):
        print("PROFILE " + line, flush=True)


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        child(*sys.argv[2:6])
        return
    # weights built in a process of their own, so that no child shares the device with a parent holding memory
    work = Path(tempfile.mkdtemp(prefix="eager-profile-"))
    subprocess.run([sys.executable, "-m", "bench.full_size_assets", "--out", str(work), "--models", MODEL,
                    "--forms", "checkpoint", "--images", "4"], check=True, cwd=str(REPO), stdout=subprocess.DEVNULL)
    assets = json.loads((work / "assets.json").read_text())[MODEL]
    checkpoint, data = str(work / "models" / "checkpoints" / assets["checkpoint"]), assets["dataset"]
    chosen = os.environ.get("ALLOCATORS", ",".join(ALLOCATORS)).split(",")
    for argument in sys.argv[1:] or VARIANTS:
        variant, _, only = argument.partition("@")
        for allocator in [only] if only else chosen:
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ALLOCATORS[allocator], "PYTHONUNBUFFERED": "1"}
            started = time.perf_counter()
            command = [sys.executable, "-m", "bench.eager_step_profile", "child", variant, checkpoint, data,
                       str(assets["resolution"])]
            if os.environ.get("PYSPY_DIR"):  # host stacks of every thread (py-spy on PATH): where eager time goes
                command = ["py-spy", "record", "--nonblocking", "-d", "45", "--format", "raw", "-r", "50", "-o",
                           str(Path(os.environ["PYSPY_DIR"]) / f"{variant}_{allocator}.txt"), "--", *command]
            try:
                run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200, cwd=str(REPO))
                code, out, err = run.returncode, run.stdout, run.stderr
            except subprocess.TimeoutExpired as timeout:
                code, out, err = "timeout", str(timeout.stdout or ""), str(timeout.stderr or "")
            print(f"== {variant} allocator={allocator} exit={code} {time.perf_counter() - started:.0f}s", flush=True)
            for line in out.splitlines():
                if line.startswith(("RESULT", "PROFILE")):
                    print("   " + line, flush=True)
            if code != 0:
                print("   " + "\n   ".join(line for line in out.splitlines() if line.startswith("PHASE"))[-1200:])
                print("   " + "\n   ".join(err.splitlines()[-15:])[:2500], flush=True)


if __name__ == "__main__":
    main()
