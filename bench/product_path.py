"""The whole product path on a GPU at full SD1.5 size: a random full-size SD1.5 checkpoint -> ComfyUI's own
loader -> `train_lora` (exactly what the LeanLoRA Train node runs) under several memory settings.

Prints per setting: s/step, peak allocated/reserved, the memory estimate made before step 1 and its error,
OOM recoveries; then an OOM forced mid-run (the cap lowered during training) and a check that the base MODEL
is bit-identical afterwards. `python -m bench.product_path --out DIR [--steps N] [--only NAME,...]`."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [os.environ.get("COMFYUI_PATH", str(REPO / ".cache" / "comfyui")), str(REPO), str(REPO / "scripts")]

GIB = 2 ** 30


def settings_table():
    from trainer.settings import MemorySettings as M
    return {
        "fast: bf16, no GC": M("bf16", False, 1, 1),
        "balanced: bf16 + GC": M("bf16", True, 1, 1),
        "fp16 + loss scaling + GC": M("fp16", True, 1, 1),
        "bf16 + GC + AdamW8bit": M("bf16", True, 1, 1, "AdamW8bit"),
        "bf16 + GC + fp8 base": M("bf16", True, 1, 1, "AdamW", "fp8"),
        "GC + AdamW8bit + fp8": M("bf16", True, 1, 1, "AdamW8bit", "fp8"),
        "lean: GC + 8bit + fp8 + offload": M("bf16", True, 1, 1, "AdamW8bit", "fp8", activation_offload=True),
        "leanest: + fp8 streamed": M("bf16", True, 1, 1, "AdamW8bit", "fp8_streamed",
                                     activation_offload=True),
        "lean, eager steps": M("bf16", True, 1, 1, "AdamW8bit", "fp8", activation_offload=True, fast_path="off"),
        "bs4 + GC": M("bf16", True, 4, 1),
        "bs2 no GC + Lion": M("bf16", False, 2, 1, "Lion"),
        "Adafactor + GC": M("bf16", True, 1, 1, "Adafactor"),
    }


def model_digest(patcher) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(patcher.model.diffusion_model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_one(adapter, dataset, memory, steps, loras, name, cap_at_step=None):
    from trainer.settings import LoraSettings, TrainSettings
    from trainer.train_lora import train_lora
    stamps, events = [], {}

    def emit(**event):
        if event["kind"] == "step":
            torch.cuda.synchronize()
            stamps.append((event["step"], time.perf_counter()))
            if cap_at_step and event["step"] == cap_at_step[0]:
                torch.cuda.set_per_process_memory_fraction(cap_at_step[1] * GIB / torch.cuda.get_device_properties(0).total_memory)
                torch.cuda.empty_cache()  # cached blocks would keep serving the old sizes; the cap binds new ones
        if event["kind"] == "estimate":
            events["estimate"] = event.get("total")
    torch.cuda.empty_cache()
    started = time.perf_counter()
    outcome = train_lora(adapter, dataset, memory, LoraSettings(16, 16.0), TrainSettings(steps, 1e-4, 0, name),
                         loras, emit, lambda: False)
    wall = time.perf_counter() - started
    # Steps are reported in bursts (the loss is read every LOSS_READ_EVERY steps): time between the first and the
    # last burst's reads, per step, leaves out the first burst (warm-up, graph capture).
    first = next(((step, t) for step, t in stamps if step >= 8), None)
    last = stamps[-1] if stamps else None
    per_step = (last[1] - first[1]) / (last[0] - first[0]) if first and last and last[0] > first[0] else None
    peak = torch.cuda.max_memory_allocated()
    estimate = events.get("estimate")
    return {"name": name, "s_per_step": per_step, "wall_s": wall,
            "peak_alloc_gib": peak / GIB, "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
            "estimate_gib": estimate / GIB if estimate else None,
            "estimate_error_pct": 100 * (estimate - peak) / peak if estimate else None,
            "recoveries": outcome.recoveries, "loss_first": outcome.losses[0], "loss_last": outcome.losses[-1],
            "report": outcome.report}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="out/product_path")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--only", default="", help="comma-separated setting names (prefix match)")
    parser.add_argument("--budget-s", type=float, default=400)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    begun = time.perf_counter()

    import comfy.sd
    import tiny_assets
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.dataset import scan_folder
    from trainer.settings import MemorySettings

    work = Path(tempfile.mkdtemp(prefix="leanlora-pp-"))
    checkpoint = tiny_assets.build_tiny_sd15_checkpoint(work / "sd15_full.safetensors", unet_size="sd15")
    dataset = scan_folder(tiny_assets.build_tiny_dataset(work / "data", n=4, size=args.resolution), args.resolution)
    with torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(str(checkpoint), output_vae=True,
                                                                      output_clip=True, embedding_directory=None)
    before = model_digest(model)
    adapter = ComfyAdapter(model, clip, vae)
    rows = []
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    for name, memory in settings_table().items():
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        if time.perf_counter() - begun > args.budget_s:
            rows.append({"name": name, "skipped": "time budget"})
            continue
        try:
            rows.append(run_one(adapter, dataset, memory, args.steps, work / "loras", name))
        except Exception as error:  # a row that fails is reported, the campaign goes on
            rows.append({"name": name, "error": f"{type(error).__name__}: {error}"[:400]})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "report"}), flush=True)

    # OOM forced mid-run: no GC + batch 2 runs until step 5, then the cap drops below what it needs. Eager steps:
    # a replayed CUDA graph allocates nothing new, so a cap lowered under it never binds.
    if time.perf_counter() - begun < args.budget_s:
        try:
            row = run_one(adapter, dataset, MemorySettings("bf16", False, 2, 1, fast_path="off"), args.steps, work / "loras",
                          "forced OOM: cap lowered to 2.5 GiB at step 5", cap_at_step=(5, 2.5))
            rows.append(row)
        except Exception as error:
            rows.append({"name": "forced OOM", "error": f"{type(error).__name__}: {error}"[:400]})
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "report"}), flush=True)

    after = model_digest(model)
    summary = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps,
               "resolution": args.resolution, "base_model_unchanged": before == after, "rows": rows,
               "command": " ".join(sys.argv)}
    (out / "product_path.json").write_text(json.dumps(summary, indent=1))
    print(f"\nfull-size SD1.5 {args.resolution}px, rank 16, batch as named, {args.steps} steps, "
          f"{summary['gpu']}, torch {summary['torch']}; base MODEL unchanged: {summary['base_model_unchanged']}")
    print(f"{'setting':34} {'s/step':>7} {'peak alloc':>10} {'reserved':>9} {'estimate':>9} {'err%':>6}  recoveries")
    for row in rows:
        if "s_per_step" not in row:
            print(f"{row['name']:34} {row.get('error') or row.get('skipped')}")
            continue
        fmt = lambda v, spec: format(v, spec) if v is not None else "n/a"  # noqa: E731
        print(f"{row['name']:34} {fmt(row['s_per_step'], '7.3f')} {row['peak_alloc_gib']:10.2f} "
              f"{row['peak_reserved_gib']:9.2f} {fmt(row['estimate_gib'], '9.2f')} {fmt(row['estimate_error_pct'], '6.1f')}"
              f"  {'; '.join(row['recoveries']) or '-'}")


if __name__ == "__main__":
    main()
