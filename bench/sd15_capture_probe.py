"""Why a captured streamed SD1.5 step aborts a ComfyUI server under cudaMallocAsync (issue 14), on the real model:
the full-size SD1.5 checkpoint through ComfyUI's own loader, `train_lora` as the Train node runs it, graphs forced
on for streamed weights (session.graphs_incompatible bypassed), one child process per variant and allocator (an
abort kills only its child). A capture that fails is caught under the native allocator: its traceback is printed,
naming the first op that broke the capture. GPU machine, after bench/server_gpu.sh's install step:

    PYTHONPATH=/tmp/site python3 -m bench.sd15_capture_probe [VARIANT ...]     # default: all
    ALLOCATORS=cudaMallocAsync ...                                             # one allocator only

Variants (all: bf16, per-layer checkpointing, AdamW8bit, fp8 weights, CUDA graphs, 512², batch 1):
  streamed          + activation offload + weights streamed (what auto-fit 2 GiB picks)
  streamed_nhwc_off the same with conv weights left NCHW (SD1.5's channels-last layout off)
  streamed_no_offload   streamed weights, activations stay on the device
  resident_offload  fp8 weights resident + activation offload
  streamed_cap2     `streamed` inside a 2 GiB per-process cap (the emulated card's), set once the cache is filled
  autofit2          auto-fit to 2 GiB from the fast preset under that cap (the server row that aborted)
  autofit2_thread   the same in a training thread of its own, as the Train node runs it
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMFY = os.environ.get("COMFYUI_PATH", str(REPO / ".cache" / "comfyui"))
ALLOCATORS = {"native": "backend:native", "cudaMallocAsync": "backend:cudaMallocAsync"}
VARIANTS = ["streamed", "streamed_nhwc_off", "streamed_no_offload", "resident_offload", "streamed_cap2", "autofit2",
            "autofit2_thread"]
STEPS = 12


def _memory(variant: str):
    from trainer.settings import AutoFit, BaseWeights, MemorySettings
    if variant.startswith("autofit2"):
        return MemorySettings("bf16", False, 1, 1, auto_fit=AutoFit(card_gib=2))
    streamed = variant.startswith("streamed")
    return MemorySettings("bf16", True, 1, 1, "AdamW8bit",
                          BaseWeights.FP8_STREAMED if streamed else BaseWeights.FP8,
                          activation_offload=variant != "streamed_no_offload")


def child(variant: str, checkpoint: str, data: str) -> None:
    sys.path[:0] = [COMFY, str(REPO), str(REPO / "scripts")]
    import torch
    import comfy.sd
    from bridge.comfy_adapter import ComfyAdapter
    from trainer import micro_steps, session
    from trainer.dataset import scan_folder
    from trainer.settings import LoraSettings, TrainSettings
    from trainer.train_lora import train_lora

    session.graphs_incompatible = lambda random_forward, streamed, allocator: None  # graphs forced on
    original_one_line = micro_steps.one_line

    def one_line_with_traceback(error, limit=300):  # called in the capture's except block: the traceback is there
        print("CAPTURE-TRACEBACK", "".join(traceback.format_exc())[-4000:], file=sys.stderr, flush=True)
        return original_one_line(error, limit)
    micro_steps.one_line = one_line_with_traceback
    if variant == "streamed_nhwc_off":
        ComfyAdapter.set_conv_layout = lambda self, unet, device, dtype: None
    capped = "cap2" in variant or variant.startswith("autofit2")
    with torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=True, output_clip=True,
                                                                      embedding_directory=None)
    adapter = ComfyAdapter(model, clip, vae)
    dataset = scan_folder(Path(data), 512)
    stamps = []

    def emit(**event):
        if event["kind"] == "step":
            stamps.append((event["step"], time.perf_counter()))
        if capped and event.get("text") == "preparing the training copy":  # the encoders ran uncapped
            torch.cuda.set_per_process_memory_fraction(2 * 2 ** 30 / torch.cuda.get_device_properties(0).total_memory)
        if event["kind"] == "phase":
            print("PHASE", event["text"][:300], flush=True)

    def train():
        return train_lora(adapter, dataset, _memory(variant), LoraSettings(16, 16.0),
                          TrainSettings(STEPS, 1e-4, 0, f"probe_{variant}"), Path(tempfile.mkdtemp()), emit,
                          lambda: False)
    if variant.endswith("_thread"):
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            outcome = pool.submit(train).result()
    else:
        outcome = train()
    fast = [line[:400] for line in outcome.report.splitlines() if "fast path" in line or "graph" in line or "auto-fit" in line]
    per_step = (stamps[-1][1] - stamps[0][1]) / (stamps[-1][0] - stamps[0][0]) if len(stamps) > 1 else None
    print("RESULT " + json.dumps({"losses": [round(x, 5) for x in outcome.losses[-3:]], "s_per_step_rough": per_step,
                                  "fast_path": fast[-5:]}), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["child"]:
        child(*sys.argv[2:5])
        return
    # The weights are built in a process of its own: this one must hold no device memory, as auto-fit measures
    # what the whole device has in use outside the training process's allocator.
    work = Path(tempfile.mkdtemp(prefix="sd15-capture-"))
    subprocess.run([sys.executable, "-m", "bench.full_size_assets", "--out", str(work), "--models", "sd15",
                    "--forms", "checkpoint", "--images", "4"], check=True, cwd=str(REPO), stdout=subprocess.DEVNULL)
    assets = json.loads((work / "assets.json").read_text())["sd15"]
    checkpoint, data = str(work / "models" / "checkpoints" / assets["checkpoint"]), assets["dataset"]
    for variant in sys.argv[1:] or VARIANTS:
        for allocator, conf in ALLOCATORS.items():
            if allocator not in os.environ.get("ALLOCATORS", ",".join(ALLOCATORS)).split(","):
                continue
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf, "PYTHONUNBUFFERED": "1"}
            started = time.perf_counter()
            try:
                run = subprocess.run([sys.executable, "-m", "bench.sd15_capture_probe", "child", variant, checkpoint,
                                      data], env=env, capture_output=True, text=True, timeout=240, cwd=str(REPO))
                code, out, err = run.returncode, run.stdout, run.stderr
            except subprocess.TimeoutExpired as timeout:
                code, out, err = "timeout", str(timeout.stdout or ""), str(timeout.stderr or "")
            result = [line for line in out.splitlines() if line.startswith("RESULT ")]
            print(f"== {variant} allocator={allocator} exit={code} {time.perf_counter() - started:.0f}s "
                  f"{result[-1] if result else ''}", flush=True)
            if "CAPTURE-TRACEBACK" in err:
                print(err[err.index("CAPTURE-TRACEBACK"):][:4000], flush=True)
            if code != 0:
                print("   " + "\n   ".join(line for line in out.splitlines() if line.startswith("PHASE"))[-1500:])
                tail = [line for line in err.splitlines()
                        if "rror" in line or "terminate" in line or "what()" in line or "Warning" in line]
                print("   " + "\n   ".join(tail[-12:])[:3000], flush=True)


if __name__ == "__main__":
    main()
