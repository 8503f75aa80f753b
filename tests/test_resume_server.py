"""Exact resume in a real ComfyUI server: a run killed with SIGKILL mid-training, a restarted server and a queue
with resume = latest end with the LoRA an uninterrupted run trains (every tensor bit for bit)."""
import time

import pytest
import torch
from safetensors.torch import load_file

from comfy_headless import ComfyServer, execution_error
from test_comfy_e2e import training_prompt

pytestmark = pytest.mark.comfy
STEPS, EVERY = 24, 6


def _prompt(output_name: str, resume: str = "off") -> dict:
    prompt = training_prompt(steps=STEPS, output_name=output_name)
    prompt["5"]["inputs"].update(save_every_n_steps=EVERY, keep_last_saves=0, resume=resume)
    return prompt


def test_a_killed_server_resumes_to_the_uninterrupted_lora(comfy_server, comfy_base):
    loras = comfy_base / "models" / "loras"
    straight = comfy_server.run(_prompt("resume_straight"), timeout=600)
    assert straight["status"]["status_str"] == "success", execution_error(straight)

    with ComfyServer(comfy_base) as doomed:
        doomed.queue(_prompt("resume_killed"))
        first_state = loras / f"resume_killed_step{EVERY}.leanlora-state"
        deadline = time.monotonic() + 300
        while not first_state.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first_state.exists(), doomed.log_tail()
        doomed._proc.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
        doomed._proc.wait()
        assert not (loras / "resume_killed.safetensors").exists()
        doomed.start()  # a fresh process on the same folders
        resumed = doomed.run(_prompt("resume_killed", resume="latest state of this output name"), timeout=600)
        assert resumed["status"]["status_str"] == "success", execution_error(resumed)
        log = doomed.log_text()
        assert "resumed from resume_killed_step" in log
        assert f"of {STEPS}) in" in log and f"trained {STEPS}/{STEPS}" not in log  # only the steps left

    expected, got = load_file(loras / "resume_straight.safetensors"), load_file(loras / "resume_killed.safetensors")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


def test_resume_latest_without_any_state_is_a_clear_error(comfy_server):
    entry = comfy_server.run(_prompt("never_trained_before", resume="latest state of this output name"), timeout=120)
    error = execution_error(entry)
    assert error and "no training state for output_name 'never_trained_before'" in error["exception_message"]
