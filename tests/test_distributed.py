"""Data-parallel training (issue 43 item 2) on the CPU: two gloo processes, each launched as torchrun would (RANK,
WORLD_SIZE, MASTER_ADDR/PORT), train the tiny SD1.5 checkpoint through the real trainer and give the LoRA of one
process with the doubled batch; a rank killed mid-run resumes to the same LoRA; a resume by another number of
processes is refused; a Cancel on one rank stops both at the same step with a partial LoRA; torchrun runs the
headless command on two ranks."""
import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tiny_assets as tiny_assets_lib
from comfy_headless import comfyui_path
from distributed_worker import run_ranks
from leanlora import cli
from trainer.dataset import scan_folder
from trainer.distributed import Distributed, World, world_from_environment
from trainer.errors import LeanLoRAError
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX, Resume, load_training_state

REPO = Path(__file__).resolve().parents[1]
STEPS, ACCUMULATION = 6, 2
# 3 images, 2 a batch: every other micro-batch holds one image, so rank 1 then trains none (the uneven split)
IMAGES, PER_RANK = 3, 1


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {"dataset": tiny_assets_lib.build_tiny_dataset(tmp_path_factory.mktemp("ddp_ds"), n=IMAGES),
            "root": tmp_path_factory.mktemp("ddp")}


def _job(tiny_assets, folders, name: str, **extra) -> dict:
    return {"checkpoint": str(tiny_assets["checkpoint"]), "dataset": str(folders["dataset"]),
            "out": str(folders["root"] / name / "results"), "loras": str(folders["root"] / name / "loras"),
            "steps": STEPS, "batch_size": PER_RANK, "accumulation": ACCUMULATION, **extra}


def _outcome(result: dict | None) -> dict:
    assert result is not None, "the rank left no outcome"
    assert "error" not in result, result.get("traceback", result)
    return result


@pytest.fixture(scope="module")
def two_ranks(tiny_assets, folders):
    """The uninterrupted run of two ranks, saving (and writing a state) every 2 steps."""
    return [_outcome(r) for r in run_ranks(_job(tiny_assets, folders, "straight", save_every=2), world=2)]


def _single_process(adapter, folders, loras: Path, **train) -> object:
    memory = MemorySettings("no", False, batch_size=2 * PER_RANK, gradient_accumulation=ACCUMULATION)
    settings = TrainSettings(STEPS, 1e-3, 0, "ddp", "cosine", 2, **train)
    return train_lora(adapter, scan_folder(folders["dataset"], 64), memory, LoraSettings(rank=4, alpha=4.0), settings,
                      loras, lambda **event: None, lambda: False)


def _assert_close_loras(a: Path, b: Path) -> None:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys() and ta
    trained = [key for key in ta if "lora_up" in key]
    assert trained and all(ta[key].abs().max() > 0 for key in trained)  # the up weights start at zero
    for key in ta:
        assert torch.allclose(ta[key].float(), tb[key].float(), rtol=2e-3, atol=2e-5), \
            (key, (ta[key].float() - tb[key].float()).abs().max())


def test_two_gloo_ranks_train_the_lora_of_one_process_with_the_doubled_batch(adapter, folders, two_ranks, tmp_path):
    main, other = two_ranks
    single = _single_process(adapter, folders, tmp_path)
    # each step's loss is the whole batch's (the ranks' shares summed), as the single process computed it
    assert len(main["losses"]) == len(other["losses"]) == STEPS
    assert main["losses"] == pytest.approx(single.losses, rel=1e-5)
    assert other["losses"] == main["losses"]
    _assert_close_loras(Path(main["path"]), single.lora_path)
    # rank 0 alone wrote: the final file, the saves every 2 steps and their states; rank 1 knows rank 0's file
    loras = Path(main["path"]).parent
    assert other["path"] == main["path"] == str(loras / "ddp.safetensors")
    assert sorted(p.name for p in loras.iterdir()) == sorted(
        [f"ddp{suffix}" for suffix in (".safetensors", STATE_SUFFIX)]
        + [f"ddp_step{step}{suffix}" for step in (2, 4) for suffix in (".safetensors", STATE_SUFFIX)])
    assert load_training_state(loras / f"ddp_step2{STATE_SUFFIX}").settings["world_size"] == "2"
    assert "data-parallel: rank 0 of 2 processes (gloo)" in main["report"]


def test_a_killed_rank_resumes_to_the_uninterrupted_lora(tiny_assets, folders, two_ranks):
    # rank 1 dies (SIGKILL) once step 3 is done; rank 0 saved step 2 with its state
    killed = run_ranks(_job(tiny_assets, folders, "killed", save_every=2, kill={"1": 3}), world=2)
    assert killed[1] is None
    state = folders["root"] / "killed" / "loras" / f"ddp_step2{STATE_SUFFIX}"
    assert state.is_file() and load_training_state(state).step == 2
    resumed = [_outcome(r) for r in run_ranks(_job(tiny_assets, folders, "killed", resume_from=str(state),
                                                   out=str(folders["root"] / "killed" / "resumed")), world=2)]
    assert resumed[0]["losses"] == two_ranks[0]["losses"]  # all 6: the state's 2, then 4 more, bit for bit
    assert "resumed from ddp_step2.leanlora-state: step 2 of 6" in resumed[0]["report"]
    straight, again = load_file(two_ranks[0]["path"]), load_file(resumed[0]["path"])
    assert straight.keys() == again.keys() and all(torch.equal(again[key], straight[key]) for key in straight)


def test_a_resume_by_another_number_of_processes_is_refused(adapter, folders, two_ranks, tmp_path):
    state = Path(two_ranks[0]["path"]).parent / f"ddp_step2{STATE_SUFFIX}"
    with pytest.raises(LeanLoRAError, match=r"cannot resume from ddp_step2\.leanlora-state: it was trained by 2 "
                                            r"processes \(world size 2\) and this run has 1; a resume is exact only "
                                            r"with the same world size: launch it with `torchrun --nproc_per_node 2"):
        _single_process(adapter, folders, tmp_path, resume_from=state)
    assert not list(tmp_path.iterdir())  # refused before any work
    one_process = Path(_single_process(adapter, folders, tmp_path / "one", save_every_steps=STEPS).lora_path)
    with pytest.raises(LeanLoRAError, match=r"trained by 1 process \(world size 1\) and this run has 4.*one process"):
        Resume.of(one_process.with_name(one_process.stem + STATE_SUFFIX), "", IMAGES, STEPS + 1, world_size=4)


def test_cancel_on_one_rank_stops_both_at_the_same_step_with_a_partial_lora(tiny_assets, folders):
    main, other = [_outcome(r) for r in run_ranks(_job(tiny_assets, folders, "cancel", stop={"1": 2}), world=2)]
    assert main["partial"] and other["partial"]
    assert main["steps_seen"] == other["steps_seen"] == [1, 2]
    loras = folders["root"] / "cancel" / "loras"
    assert main["path"] == other["path"] == str(loras / "ddp_partial_step2.safetensors")
    assert sorted(p.name for p in loras.iterdir()) == ["ddp_partial_step2.leanlora-state",
                                                      "ddp_partial_step2.safetensors"]
    assert "CANCELLED after step 2" in main["report"]


def test_the_launchers_environment_and_the_split_of_a_batch():
    assert world_from_environment({}) is None and world_from_environment({"WORLD_SIZE": "1"}) is None
    assert world_from_environment({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                                   "MASTER_PORT": "1"}) == World(2, 4, 0)
    with pytest.raises(LeanLoRAError, match=r"WORLD_SIZE is 2 but MASTER_ADDR, MASTER_PORT is not set; launch with "
                                            r"`torchrun --nproc_per_node N -m leanlora train CONFIG`"):
        world_from_environment({"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(LeanLoRAError, match="RANK is 3, outside 0..1"):
        world_from_environment({"WORLD_SIZE": "2", "RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    # the union of the ranks' shares is the batch, in order; uneven batches give the first ranks one more
    for count, world in ((8, 2), (5, 2), (1, 2), (7, 3), (2, 4)):
        shares = [Distributed(World(rank, world, rank), torch.device("cpu")).share(count) for rank in range(world)]
        assert shares[0][0] == 0 and shares[-1][1] == count
        assert all(end == start for (_, end), (start, _) in zip(shares, shares[1:]))
        sizes = [end - start for start, end in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _config(tiny_assets, folders, batch_size: int, loras: Path) -> str:
    return "\n".join([f'checkpoint = "{tiny_assets["checkpoint"]}"', f'output_dir = "{loras}"',
                      f'folder = "{folders["dataset"]}"', "resolution = 64", 'card = "manual"',
                      'mixed_precision = "no"', f"batch_size = {batch_size}", f"gradient_accumulation = {ACCUMULATION}",
                      "rank = 4", "alpha = 4.0", "steps = 4", "learning_rate = 1e-3", 'output_name = "cli_ddp"']) + "\n"


def test_torchrun_runs_the_headless_command_on_two_ranks(tiny_assets, folders, tmp_path):
    import folder_paths
    two, one = tmp_path / "two.toml", tmp_path / "one.toml"
    two.write_text(_config(tiny_assets, folders, PER_RANK, tmp_path / "two"))
    one.write_text(_config(tiny_assets, folders, 2 * PER_RANK, tmp_path / "one"))
    launched = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "leanlora", "train", str(two)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "COMFYUI_PATH": str(comfyui_path()), "OMP_NUM_THREADS": "1"})
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    saved = tmp_path / "two" / "cli_ddp.safetensors"
    assert launched.stdout.count("LeanLoRA: saved ") == 1 and f"LeanLoRA: saved {saved}" in launched.stdout
    assert "data-parallel: rank 0 of 2 processes (gloo)" in launched.stdout  # rank 0's report; rank 1 prints none
    assert "rank 1 of 2" not in launched.stdout + launched.stderr
    tables = copy.deepcopy(folder_paths.folder_names_and_paths)
    try:
        assert cli.main(["train", str(one)]) == 0
    finally:
        folder_paths.folder_names_and_paths.clear()
        folder_paths.folder_names_and_paths.update(tables)
    _assert_close_loras(saved, tmp_path / "one" / "cli_ddp.safetensors")


def test_ctrl_c_under_torchrun_stops_every_rank_and_keeps_a_partial_lora(tiny_assets, folders, tmp_path):
    """The terminal's Ctrl-C reaches torchrun and its ranks (one process group); torchrun passes it on once more.
    Every rank stops before the next step and rank 0 keeps the partial LoRA with its state."""
    config = tmp_path / "long.toml"
    config.write_text(_config(tiny_assets, folders, PER_RANK, tmp_path / "out").replace("steps = 4", "steps = 5000"))
    launched = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "leanlora", "train", str(config)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "COMFYUI_PATH": str(comfyui_path()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    lines = []
    try:
        for line in launched.stdout:
            lines.append(line)
            if "LeanLoRA step 1/5000" in line:
                os.killpg(launched.pid, signal.SIGINT)  # as a terminal's Ctrl-C
                break
        lines += launched.stdout.readlines()
        launched.wait(timeout=300)
    finally:
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
    output = "".join(lines)
    partial = sorted((tmp_path / "out").glob("cli_ddp_partial_step*.safetensors"))
    assert len(partial) == 1, output[-4000:]
    steps = int(partial[0].stem.rsplit("step", 1)[1])
    assert 1 <= steps < 5000 and load_training_state(partial[0].with_suffix(STATE_SUFFIX)).step == steps
    assert "stopped; partial saved to" in output and "KeyboardInterrupt" not in output, output[-4000:]
