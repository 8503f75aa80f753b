"""Memory Settings' gpus on a machine of several GPUs (issue 43 item 3): a real ComfyUI server on its GPUs trains the
tiny SD1.5 checkpoint with gpus 'all N GPUs' (the server rank 0, N-1 worker processes, NCCL), then with 'this GPU'
and N times the batch, and compares the two LoRAs; then a Cancel after step 1 (a partial LoRA, the workers gone) and
a worker killed mid-run (the job fails with its log, the server trains the next run). One JSON line per check, and
exit status 1 where one failed.

    python -m bench.node_gpus --out DIR                      # every GPU this machine has (2 or more)
    python -m bench.node_gpus --out DIR --cpu-workers 2      # the same on the CPU (LEANLORA_CPU_WORKERS, gloo)

The tiny model's random weights show the mechanics (NCCL, each worker on its GPU, the agreed stop), not speed."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "scripts", REPO):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from comfy_headless import ComfyServer, execution_error  # noqa: E402
import tiny_assets  # noqa: E402

CHECKPOINT, DATASET = "leanlora_tiny_sd15.safetensors", "gpus_dataset"
IMAGES, PER_RANK, ACCUMULATION, STEPS = 3, 1, 2, 4
WORKER = re.compile(r"worker rank 1 \((?:CPU process|cuda:)\s?\d+, pid (\d+)\) started")
RTOL, ATOL = 2e-3, 2e-5  # tests/test_distributed.py's: float rounding of a sum taken in another order


def training_prompt(name: str, gpus: str, batch_size: int, steps: int = STEPS, samples: bool = False) -> dict:
    """The tiny checkpoint -> Dataset / Memory Settings (fp32, manual) / LoRA Config -> Train, as tests/
    test_node_gpus.py queues it: `batch_size` per process, gradient accumulation 2."""
    return {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT}},
        "2": {"class_type": "LeanLoRADataset", "inputs": {"folder": DATASET, "resolution": 64, "repeats": 1,
                                                           "trigger_word": "lnlr", "framing": "center crop (square)"}},
        "3": {"class_type": "LeanLoRAMemorySettings", "inputs": {
            "card": "manual", "mixed_precision": "no", "gradient_checkpointing": False, "batch_size": batch_size,
            "gradient_accumulation": ACCUMULATION, "latent_cache": "RAM", "gpus": gpus}},
        "4": {"class_type": "LeanLoRALoraConfig", "inputs": {"rank": 4, "alpha": 4.0, "dropout": 0.0,
                                                             "targets": "attention"}},
        "5": {"class_type": "LeanLoRATrain", "inputs": {
            "steps": steps, "learning_rate": 1e-3, "lr_schedule": "cosine", "warmup_steps": min(2, steps - 1),
            "seed": 0, "output_name": name, "model": ["1", 0], "clip": ["1", 1], "vae": ["1", 2],
            "dataset": ["2", 0], "memory": ["3", 0], "lora_config": ["4", 0],
            **({"sample_prompts": "lnlr, a red circle", "sample_every_n_steps": 2, "sample_size": 64,
                "sample_steps": 2} if samples else {})}},
    }


def worker_pid(log: str) -> int | None:
    found = WORKER.findall(log)
    return int(found[0]) if found else None


def lora_difference(a: Path, b: Path) -> dict:
    """The largest difference of two LoRA files' tensors, and whether every one is within RTOL/ATOL."""
    import torch
    from safetensors.torch import load_file
    ta, tb = load_file(a), load_file(b)
    if ta.keys() != tb.keys() or not ta:
        return {"same_keys": False}
    worst = max((ta[k].float() - tb[k].float()).abs().max().item() for k in ta)
    close = all(torch.allclose(ta[k].float(), tb[k].float(), rtol=RTOL, atol=ATOL) for k in ta)
    return {"same_keys": True, "max_abs_difference": worst, "within_tolerance": close}


def _when_in_log(server, text: str, after: int, timeout: float = 900) -> bool:
    deadline = time.monotonic() + timeout
    while text not in server.log_text()[after:]:
        if time.monotonic() > deadline:
            return False
        server._check_alive()
        time.sleep(0.2)
    return True


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.is_file() and stat.read_text().split()[2] == "Z"


def check_equal_to_one_process(server, count: int) -> dict:
    start = len(server.log_text())
    began = time.monotonic()
    many = server.run(training_prompt("gpus_many", f"all {count} GPUs", PER_RANK, samples=True), timeout=1800)
    many_s = time.monotonic() - began
    log = server.log_text()[start:]
    began = time.monotonic()
    one = server.run(training_prompt("gpus_one", "this GPU", count * PER_RANK, samples=True), timeout=1800)
    one_s = time.monotonic() - began
    result = {"check": "equal_to_one_process", "processes": count, "status": many["status"]["status_str"],
              "single_status": one["status"]["status_str"], "seconds": round(many_s, 1),
              "single_seconds": round(one_s, 1),
              "report_line": next((line for line in log.splitlines() if "data-parallel: rank 0" in line), None),
              "samples": sorted(p.name for p in (server.base_dir / "output" / "leanlora_samples" / "gpus_many")
                                .glob("*.png")) if many["status"]["status_str"] == "success" else None}
    if result["status"] != "success" or result["single_status"] != "success":
        result["error"] = execution_error(many) or execution_error(one)
        result["ok"] = False
        return result
    loras = server.base_dir / "models" / "loras"
    result.update(lora_difference(loras / "gpus_many.safetensors", loras / "gpus_one.safetensors"))
    pid = worker_pid(log)
    result["worker_gone"] = pid is not None and _gone(pid)
    result["ok"] = bool(result.get("within_tolerance") and result["worker_gone"] and result["report_line"])
    return result


def _long_run_at_step_1(server, name: str, count: int) -> tuple[str, int | None] | None:
    """A 100000-step run on `count` processes, once it trained step 1: (prompt id, the worker's pid); None if it
    never got there."""
    start = len(server.log_text())
    prompt_id = server.queue(training_prompt(name, f"all {count} GPUs", PER_RANK, steps=100000))
    if not _when_in_log(server, "LeanLoRA step 1/100000", start):
        return None
    return prompt_id, worker_pid(server.log_text()[start:])


def check_cancel(server, count: int) -> dict:
    running = _long_run_at_step_1(server, "gpus_cancel", count)
    if running is None:
        return {"check": "cancel", "ok": False, "error": "no step 1", "log": server.log_tail()}
    prompt_id, pid = running
    server.interrupt()
    server.wait(prompt_id, timeout=900)
    partial = sorted((server.base_dir / "models" / "loras").glob("gpus_cancel_partial_step*.safetensors"))
    gone = pid is not None and _gone(pid)
    return {"check": "cancel", "partial": [p.name for p in partial], "worker_gone": gone,
            "ok": len(partial) == 1 and gone}


def check_dead_worker(server, count: int) -> dict:
    running = _long_run_at_step_1(server, "gpus_killed", count)
    if running is None:
        return {"check": "dead_worker", "ok": False, "error": "no step 1", "log": server.log_tail()}
    prompt_id, pid = running
    began = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    entry = server.wait(prompt_id, timeout=900)
    failed_in = time.monotonic() - began
    message = json.dumps(execution_error(entry) or {})
    again = server.run(training_prompt("gpus_after_kill", f"all {count} GPUs", PER_RANK, steps=3), timeout=1800)
    named = "worker rank 1" in message and "ended with exit code -9" in message
    return {"check": "dead_worker", "status": entry["status"]["status_str"], "failed_in_s": round(failed_in, 1),
            "names_the_worker": named, "next_run": again["status"]["status_str"],
            "ok": entry["status"]["status_str"] == "error" and named and again["status"]["status_str"] == "success"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="a folder for the server's base directory and results.json")
    parser.add_argument("--cpu-workers", type=int, default=0,
                        help="a dry run on the CPU: this many CPU processes (LEANLORA_CPU_WORKERS), gloo")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    base = out / "comfy_base"
    tiny_assets.build_tiny_sd15_checkpoint(base / "models" / "checkpoints" / CHECKPOINT)
    tiny_assets.build_tiny_dataset(base / "input" / DATASET, n=IMAGES)
    if args.cpu_workers:
        os.environ["LEANLORA_CPU_WORKERS"] = str(args.cpu_workers)
        count = args.cpu_workers
    else:
        import torch
        count = torch.cuda.device_count()
        if count < 2:
            print(json.dumps({"error": f"this machine has {count} GPU(s); gpus needs 2 or more"}))
            return 1
    results = []
    with ComfyServer(base, cpu=bool(args.cpu_workers)) as server:
        for check in (check_equal_to_one_process, check_cancel, check_dead_worker):
            result = check(server, count)
            results.append(result)
            print(json.dumps(result), flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
