"""Memory Settings' gpus from the Train node (issue 43 item 3), on the CPU: a real ComfyUI server started with
LEANLORA_CPU_WORKERS=2 (this machine counts as two devices that are CPU processes, gloo) trains with gpus 'all 2
GPUs' as rank 0 with one worker process (the headless runner with the workflow's config). The LoRA is the one of a
single process with the doubled batch; progress and samples reach the node; Cancel stops both ranks with a partial
LoRA; a worker killed mid-run fails the job with its log's tail and the server goes on. Without the setting (one
device) the choice is 'this GPU' alone, and a workflow saved without gpus still runs."""
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

import tiny_assets as tiny_assets_lib
# the prompt bench/node_gpus.py queues on GPUs; as tests/test_distributed.py: 3 images, 1 per rank, accumulation 2
# (an uneven last batch: rank 1 trains none)
from bench.node_gpus import CHECKPOINT, DATASET, IMAGES, PER_RANK, STEPS, training_prompt as prompt
from comfy_headless import ComfyServer, PromptRejected, execution_error
from helpers import node_module
from test_distributed import _assert_close_loras

REPO = Path(__file__).resolve().parents[1]
CPU_WORKERS_ENV = "LEANLORA_CPU_WORKERS"
WORKER = re.compile(r"worker rank 1 \(CPU process 1, pid (\d+)\) started")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of its own: started with LEANLORA_CPU_WORKERS=2 (read by Memory Settings and Train)."""
    base = tmp_path_factory.mktemp("gpus_base")
    tiny_assets_lib.build_tiny_sd15_checkpoint(base / "models" / "checkpoints" / CHECKPOINT)
    tiny_assets_lib.build_tiny_dataset(base / "input" / DATASET, n=IMAGES)
    os.environ[CPU_WORKERS_ENV] = "2"
    try:
        started = ComfyServer(base)
        started.start()
    finally:
        del os.environ[CPU_WORKERS_ENV]
    yield started
    started.stop()


def _worker_pid(server, after: int) -> int:
    found = WORKER.findall(server.log_text()[after:])
    assert len(found) == 1, server.log_tail()
    return int(found[0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _when_in_log(server, text: str, after: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log_text()[after:]:
        assert time.monotonic() < deadline, server.log_tail()
        server._check_alive()
        time.sleep(0.2)


@pytest.mark.comfy
def test_all_gpus_trains_the_lora_of_one_process_with_the_doubled_batch(server):
    start = len(server.log_text())
    two = server.run(prompt("two", "all 2 GPUs", PER_RANK, samples=True), timeout=1200)
    assert two["status"]["status_str"] == "success", execution_error(two)
    log = server.log_text()[start:]
    pid = _worker_pid(server, start)
    assert _gone(pid)  # the worker ended with the run
    assert "data-parallel: rank 0 of 2 processes (gloo)" in log
    # progress and samples reach the node from rank 0, in this server, as for one GPU
    assert f"LeanLoRA step 1/{STEPS}" in log and "LeanLoRA: samples at step 2" in log
    samples = server.base_dir / "output" / "leanlora_samples" / "two"
    assert sorted(p.name for p in samples.iterdir()) == ["step2_0.png", "step4_0.png"]
    one = server.run(prompt("one", "this GPU", 2 * PER_RANK, samples=True), timeout=1200)
    assert one["status"]["status_str"] == "success", execution_error(one)
    assert "data-parallel" not in server.log_text()[start + len(log):]
    loras = server.base_dir / "models" / "loras"
    _assert_close_loras(loras / "two.safetensors", loras / "one.safetensors")
    assert sorted(p.name for p in loras.glob("two*")) == ["two.safetensors"]  # rank 0 alone saved


@pytest.mark.comfy
def test_a_workflow_saved_on_a_bigger_machine_is_refused_in_the_nodes_words(server):
    """gpus 'all 4 GPUs' queued on this machine of 2: the Memory Settings node's own message (what this machine has,
    what to choose) when queued, not ComfyUI's bare "Value not in list", and nothing runs."""
    with pytest.raises(PromptRejected) as refused:
        server.queue(prompt("four", "all 4 GPUs", PER_RANK))
    assert "gpus: 'all 4 GPUs', but this machine has 2 GPUs" in str(refused.value)
    assert "choose 'all 2 GPUs'" in str(refused.value) and "Value not in list" not in str(refused.value)


def _long_run_at_step_1(server, name: str) -> tuple[int, str, int]:
    """A 5000-step run on both processes, once it trained step 1: (log offset, prompt id, the worker's pid)."""
    start = len(server.log_text())
    prompt_id = server.queue(prompt(name, "all 2 GPUs", PER_RANK, steps=5000))
    _when_in_log(server, "LeanLoRA step 1/5000", start)
    return start, prompt_id, _worker_pid(server, start)


@pytest.mark.comfy
def test_cancel_stops_both_processes_and_keeps_a_partial_lora(server):
    start, prompt_id, pid = _long_run_at_step_1(server, "cancelled")
    server.interrupt()
    entry = server.wait(prompt_id, timeout=600)
    log = server.log_text()[start:]
    assert "stopped; partial saved to" in log, server.log_tail()
    partial = sorted((server.base_dir / "models" / "loras").glob("cancelled_partial_step*.safetensors"))
    assert len(partial) == 1 and partial[0].with_suffix(".leanlora-state").is_file()
    steps = int(partial[0].stem.rsplit("step", 1)[1])
    assert 1 <= steps < 5000
    assert entry["status"]["status_str"] in ("success", "error")  # ComfyUI ends an interrupted graph either way
    assert _gone(pid)


@pytest.mark.comfy
def test_a_dead_worker_fails_the_job_with_its_log_and_the_server_goes_on(server):
    _, prompt_id, pid = _long_run_at_step_1(server, "killed")
    os.kill(pid, signal.SIGKILL)
    entry = server.wait(prompt_id, timeout=600)
    assert entry["status"]["status_str"] == "error"
    message = json.dumps(execution_error(entry))
    assert f"worker rank 1 (CPU process 1, pid {pid}) ended with exit code -9" in message, message
    logs = re.search(r"its log \((/[^)]+)/rank1\.log\) ends:", message)
    assert logs and Path(logs[1], "rank1.log").is_file()  # kept for the user; the test's copy goes
    shutil.rmtree(logs[1])
    # rank 0's side: its gloo collective failed at once (connection closed or reset), no waiting for a timeout
    assert re.search(r"rank 0 \(this server\): training failed: RuntimeError: \[[^]]*gloo[^]]*\] .*peer", message)
    # rank 0 kept what was learned before the worker died
    assert list((server.base_dir / "models" / "loras").glob("killed_partial_step*.safetensors"))
    # the server goes on: the next run on both processes trains (the failed run's process group is gone)
    again = server.run(prompt("after_kill", "all 2 GPUs", PER_RANK, steps=2), timeout=1200)
    assert again["status"]["status_str"] == "success", json.dumps(execution_error(again))[-3000:]
    assert (server.base_dir / "models" / "loras" / "after_kill.safetensors").is_file()


# --- without a server -------------------------------------------------------------------------------------------------

def test_one_device_offers_this_gpu_alone_and_old_workflows_run(monkeypatch):
    monkeypatch.delenv(CPU_WORKERS_ENV, raising=False)
    settings, workers = node_module("settings"), node_module("workers")
    assert settings.LeanLoRAMemorySettings.INPUT_TYPES()["optional"]["gpus"][0] == ["this GPU"]
    memory, = settings.LeanLoRAMemorySettings().execute(card="manual", batch_size=2)  # saved before gpus
    assert memory.gpus == "this GPU" and workers.chosen_devices(memory.gpus) is None
    with pytest.raises(Exception, match=r"gpus: 'all 2 GPUs', but this machine has 0 device\(s\) to train on "
                                        r"\(no CUDA GPU ComfyUI trains on\); set gpus to 'this GPU'"):
        settings.LeanLoRAMemorySettings().execute(gpus="all 2 GPUs")
    # a workflow saved on a machine of several GPUs: queued here, the node's words (ComfyUI skips its list check)
    assert settings.LeanLoRAMemorySettings.VALIDATE_INPUTS(gpus="this GPU") is True
    assert settings.LeanLoRAMemorySettings.VALIDATE_INPUTS(gpus="all 4 GPUs").startswith(
        "gpus: 'all 4 GPUs', but this machine has 0 device(s) to train on")


def test_the_choices_and_their_refusals_on_three_devices(monkeypatch):
    monkeypatch.setenv(CPU_WORKERS_ENV, "3")
    workers = node_module("workers")
    assert workers.gpu_choices() == ["this GPU", "all 3 GPUs", "0,1", "0,2"]
    assert workers.chosen_devices("all 3 GPUs") == workers.chosen_devices("all") == [0, 1, 2]
    assert workers.chosen_devices("2,0") == [0, 2] and workers.chosen_devices("0") is None
    have = "it has 0: CPU process 0, 1: CPU process 1, 2: CPU process 2"
    for choice, message in (("0,5", f"gpus: GPU 5 is not on this machine; {have}"),
                            ("1,2", "gpus: '1,2' leaves out this server's GPU (0: CPU process 0), which trains as "
                                    "rank 0 with the node's model: add 0 to the list"),
                            ("0,0", "gpus: '0,0' names a GPU twice"),
                            ("all 2 GPUs", "gpus: 'all 2 GPUs', but this machine has 3 GPUs"),
                            ("two", "gpus: 'two' is not 'this GPU', 'all N GPUs' or a list of CUDA indices")):
        with pytest.raises(Exception, match=re.escape(message)):
            workers.chosen_devices(choice)
    monkeypatch.setenv(CPU_WORKERS_ENV, "6")  # above 4: pairs with this GPU and leading runs, not every subset
    assert workers.gpu_choices() == ["this GPU", "all 6 GPUs", "0,1", "0,2", "0,3", "0,4", "0,5", "0,1,2",
                                     "0,1,2,3", "0,1,2,3,4"]


def test_a_model_the_workers_cannot_load_is_refused_before_any_work(monkeypatch):
    monkeypatch.setenv(CPU_WORKERS_ENV, "2")
    workers = node_module("workers")
    graph = prompt("merged", "all 2 GPUs", PER_RANK)
    graph["8"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": "x",
                                                        "strength_model": 1.0, "strength_clip": 1.0}}
    graph["5"]["inputs"]["model"] = ["8", 0]
    with pytest.raises(Exception, match=r"gpus: the worker processes load the model from files, with ComfyUI's "
                                        r"loaders .* Train node 5's model comes from node 8 \(LoraLoader\), which "
                                        r"they cannot load\. Connect Train's model, clip and vae to those loaders"):
        workers._worker_config(graph, "5")
    values = workers._worker_config(prompt("plain", "all 2 GPUs", PER_RANK), "5")
    assert values["checkpoint"] == CHECKPOINT and values["gpus"] == "this GPU" and values["batch_size"] == PER_RANK


def test_a_worker_gets_the_servers_comfyui_arguments_without_its_gpu_or_a_wrappers_flags(monkeypatch):
    import comfy.cli_args  # noqa: F401  (ComfyUI's parser, which the server's arguments passed)
    workers = node_module("workers")
    monkeypatch.setattr("sys.argv", ["launcher.py", "--card-gib", "8", "--listen", "127.0.0.1", "--cuda-device", "1",
                                     "--base-directory", "/srv/comfy", "--fp16-unet", "--cuda-device=2"])
    assert workers._forwarded_arguments(cpu=False) == ["--listen", "127.0.0.1", "--base-directory", "/srv/comfy",
                                                       "--fp16-unet"]
    assert workers._forwarded_arguments(cpu=True)[-1] == "--cpu"
