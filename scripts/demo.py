"""End-to-end demo: train a LoRA on a tiny generated dataset and generate with it, in a real headless ComfyUI.

Builds a tiny random SD1.5 checkpoint and a captioned dataset in the base directory, starts ComfyUI with this
pack, runs workflows/api/train_then_generate.json (the shipped template example_workflows/leanlora_train_then_generate.json
with the tiny fixture's names, see its .overrides.json) and prints what came out. Run through scripts/demo.sh.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import tiny_assets
from comfy_headless import REPO, ComfyServer, execution_error

CHECKPOINT = "leanlora_tiny_sd15.safetensors"  # the names the workflow refers to
DATASET = "tiny_dataset"


def build_assets(base: Path) -> None:
    # Rebuilt only when missing: the checkpoint takes a few seconds and ~300 MB.
    checkpoint = base / "models" / "checkpoints" / CHECKPOINT
    if not checkpoint.exists():
        print(f"[demo] building tiny checkpoint {checkpoint}")
        tiny_assets.build_tiny_sd15_checkpoint(checkpoint)
    dataset = base / "input" / DATASET
    if not dataset.exists():
        print(f"[demo] building tiny dataset {dataset}")
        tiny_assets.build_tiny_dataset(dataset)


def files_written_since(folder: Path, since: float) -> list[Path]:
    # by mtime, not by name: a rerun may overwrite the previous run's file
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.stat().st_mtime >= since)


def output_files(base: Path, history_entry: dict) -> list[Path]:
    """Files the run's nodes reported in their UI outputs (SaveImage -> output/, PreviewImage -> temp/)."""
    return [base / item["type"] / item["subfolder"] / item["filename"]
            for node_outputs in history_entry["outputs"].values()
            for key in ("images", "gifs", "audio")
            for item in node_outputs.get(key, [])]


def describe_error(entry: dict) -> str:
    error = execution_error(entry)
    if error is None:
        return f"status {entry['status']['status_str']}: {entry['status']['messages']}"
    trace = "".join(error.get("traceback", [])[-6:])
    return (f"node {error.get('node_id')} ({error.get('node_type')}) raised {error.get('exception_type')}: "
            f"{error.get('exception_message')}\n{trace}")


def run_demo(base: Path, workflow: Path, timeout: float) -> int:
    if not workflow.is_file():
        print(f"[demo] FAILED: no workflow at {workflow}", file=sys.stderr)
        return 1
    prompt = json.loads(workflow.read_text())
    build_assets(base)
    started = time.time()
    server = ComfyServer(base)
    print(f"[demo] starting ComfyUI (base directory {base}, log {server.log_path})")
    try:
        with server:
            print(f"[demo] running {workflow} on {server.url}")
            entry = server.run(prompt, timeout=timeout)
    except (RuntimeError, TimeoutError) as e:  # rejected prompt, ComfyUI died or could not load the pack, timeout
        print(f"[demo] FAILED: {e}", file=sys.stderr)
        return 1
    status = entry["status"]["status_str"]
    print(f"[demo] status: {status}")
    if status != "success":
        print(f"[demo] FAILED: {describe_error(entry)}\n[demo] ComfyUI log: {server.log_path}", file=sys.stderr)
        return 1
    loras = files_written_since(base / "models" / "loras", started)
    print("[demo] LoRA files written:" + "".join(f"\n  {p}" for p in loras))
    print("[demo] images:" + "".join(f"\n  {p}" for p in output_files(base, entry)))
    print("[demo] the images are noise by design: the tiny checkpoint's weights are random, so this shows the path "
          "(train, save, load, sample in one ComfyUI run), not picture quality")
    shown: list[str] = []
    for node_output in entry.get("outputs", {}).values():  # the training report and VRAM monitor text
        for text in node_output.get("text", []):
            for earlier in shown:  # the VRAM monitor repeats the latest training's report: print it once
                text = text.replace(earlier, "")
            if text.strip():
                shown.append(text.strip())
                print("[demo] " + text.strip().replace("\n", "\n       "))
    print(f"[demo] ComfyUI log: {server.log_path}")
    if not loras:
        print("[demo] FAILED: the workflow succeeded but wrote no LoRA file", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-dir", type=Path, default=REPO / "out" / "demo", help="ComfyUI base directory")
    p.add_argument("--workflow", type=Path, default=REPO / "workflows" / "api" / "train_then_generate.json",
                   help="API-format workflow to run")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the workflow")
    args = p.parse_args(argv)
    return run_demo(args.base_dir.resolve(), args.workflow.resolve(), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
