"""The ranks of tests/test_distributed.py: each a fresh process (torch.multiprocessing's spawn) that joins the others
through the environment a launcher sets (RANK, WORLD_SIZE, MASTER_ADDR/PORT: gloo on the CPU) and trains the tiny
SD1.5 checkpoint through the real trainer (ComfyUI's loader, the bridge's adapter, train_lora). Its outcome (or
error) goes to a JSON file; a job may kill its own process after a step (SIGKILL: no clean-up of any kind)."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(job: dict, world: int, timeout: float = 600) -> list[dict | None]:
    """`job` trained by `world` processes; each rank's outcome (None for a rank that was killed)."""
    port, context = free_port(), mp.get_context("spawn")
    out = Path(job["out"])
    out.mkdir(parents=True, exist_ok=True)
    processes = [context.Process(target=rank_main, args=(rank, world, port, job)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout)
    for process in processes:
        if process.is_alive():  # a hung rank: the test fails below, the process goes
            process.kill()
            process.join()
    results = []
    for rank, process in enumerate(processes):
        path = out / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.is_file() else None)
        if process.exitcode != 0 and results[-1] is None and process.exitcode != -signal.SIGKILL:
            raise AssertionError(f"rank {rank} ended with exit code {process.exitcode} and no outcome")
    return results


def rank_main(rank: int, world: int, port: int, job: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    out = Path(job["out"]) / f"rank{rank}.json"
    try:
        result = train(rank, job)
    except Exception as error:  # noqa: BLE001 - the test reads the message
        result = {"error": str(error), "type": type(error).__name__, "traceback": traceback.format_exc()}
    out.write_text(json.dumps(result))


def train(rank: int, job: dict) -> dict:
    import torch
    torch.set_num_threads(1)  # two ranks on a shared CPU
    sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "scripts")]
    from comfy_headless import comfyui_path
    from leanlora.library import import_comfyui
    import_comfyui(comfyui_path(), "--cpu")
    import comfy.sd
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.dataset import scan_folder
    from trainer.settings import LoraSettings, MemorySettings, TrainSettings
    from trainer.train_lora import train_lora

    with torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(job["checkpoint"], output_vae=True,
                                                                    output_clip=True, embedding_directory=None)
    adapter = ComfyAdapter(model, clip, vae)
    dataset = scan_folder(job["dataset"], 64)
    steps_seen = []

    def emit(**event):
        if event["kind"] == "step":
            steps_seen.append(event["step"])
            if job.get("kill", {}).get(str(rank)) == event["step"]:
                os.kill(os.getpid(), signal.SIGKILL)

    stop_at = job.get("stop", {}).get(str(rank))
    memory = MemorySettings("no", False, batch_size=job["batch_size"], gradient_accumulation=job["accumulation"])
    train = TrainSettings(job["steps"], 1e-3, 0, "ddp", "cosine", 2, save_every_steps=job.get("save_every", 0),
                          resume_from=job.get("resume_from"))
    outcome = train_lora(adapter, dataset, memory, LoraSettings(rank=4, alpha=4.0), train, Path(job["loras"]), emit,
                         lambda: stop_at is not None and bool(steps_seen) and steps_seen[-1] >= stop_at)
    return {"losses": outcome.losses, "path": str(outcome.lora_path), "partial": outcome.partial,
            "report": outcome.report, "steps_seen": steps_seen}
