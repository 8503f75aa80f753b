"""Samples while training on a real ComfyUI server (issue 17, item 4): the images arrive on the websocket while
the Train node runs and land in output/leanlora_samples/<name>/, the base MODEL renders the same before and after,
and the shipped workflow example_workflows/leanlora_train_with_samples.json runs."""
import asyncio
import io
import json
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from comfy_headless import execution_error
from test_comfy_e2e import cached_nodes, pixels, sampling_prompt, saved_image, training_prompt
from workflow_convert import apply_overrides, ui_to_api

pytestmark = pytest.mark.comfy
REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "example_workflows" / "leanlora_train_with_samples.json"
PREVIEW_IMAGE, PNG = 1, 2  # ComfyUI's binary websocket message: event type, then image type (server.py)


class Messages:
    """The server's websocket messages for our client id, in arrival order: JSON ones as dicts, preview images
    as ("preview", PIL image)."""

    def __init__(self, server):
        import aiohttp  # ComfyUI's own dependency
        self.received: list = []
        connected = threading.Event()

        async def listen():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(f"ws://127.0.0.1:{server.port}/ws?clientId={server.client_id}",
                                              max_msg_size=0) as ws:
                    connected.set()
                    async for message in ws:
                        if message.type == aiohttp.WSMsgType.TEXT:
                            self.received.append(json.loads(message.data))
                        elif message.type == aiohttp.WSMsgType.BINARY:
                            event, kind = struct.unpack(">II", message.data[:8])
                            if event == PREVIEW_IMAGE and kind == PNG:
                                self.received.append(("preview", Image.open(io.BytesIO(message.data[8:]))))

        threading.Thread(target=lambda: asyncio.run(listen()), daemon=True).start()
        assert connected.wait(20), "no websocket connection to the server"

    def until_done(self, prompt_id: str, timeout: float = 60) -> list:
        """The messages once the prompt's execution_success has arrived (the websocket may trail /history)."""
        deadline = time.monotonic() + timeout
        while not any(isinstance(m, dict) and m.get("type") == "execution_success"
                      and m["data"].get("prompt_id") == prompt_id for m in list(self.received)):
            assert time.monotonic() < deadline, "no execution_success on the websocket"
            time.sleep(0.05)
        return list(self.received)


def _progress(message) -> dict | None:
    return message["data"] if isinstance(message, dict) and message.get("type") == "leanlora.progress" else None


SAMPLE_INPUTS = dict(sample_prompts="lnlr, a red circle\n\na blue square\n", sample_every_n_steps=2, sample_size=64,
                     sample_steps=3, sample_cfg=5.0, sample_seed=1)


def test_samples_arrive_during_training_and_the_base_model_renders_the_same(comfy_server):
    messages = Messages(comfy_server)
    before = comfy_server.run(sampling_prompt("samples_base_before", seed=21), timeout=300)
    assert before["status"]["status_str"] == "success", execution_error(before)
    prompt = training_prompt(steps=6, output_name="samples_e2e")
    prompt["5"]["inputs"].update(SAMPLE_INPUTS)
    prompt_id = comfy_server.queue(prompt)
    entry = comfy_server.wait(prompt_id, timeout=600)
    folder = comfy_server.base_dir / "output" / "leanlora_samples" / "samples_e2e"
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    after = comfy_server.run(sampling_prompt("samples_base_after", seed=21), timeout=300)

    # the sample events come while training, between its step events, each naming its step's files (one per prompt)
    received = messages.until_done(prompt_id)
    order = [(e["kind"], e["step"]) for e in map(_progress, received) if e and e["kind"] in ("step", "sample")]
    assert order == [("step", 1), ("step", 2), ("sample", 2), ("step", 3), ("step", 4), ("sample", 4),
                     ("step", 5), ("step", 6), ("sample", 6)], order
    samples = [e for e in map(_progress, received) if e and e["kind"] == "sample"]
    assert [e["paths"] for e in samples] == [[str(folder / f"step{s}_{i}.png") for i in (0, 1)] for s in (2, 4, 6)]
    assert sorted(p.name for p in folder.iterdir()) == [f"step{s}_{i}.png" for s in (2, 4, 6) for i in (0, 1)]
    for path in folder.iterdir():
        with Image.open(path) as image:
            assert image.size == (64, 64) and image.format == "PNG"
    # each step's samples, side by side, are the Train node's preview right after their event
    for event in samples:
        index = next(i for i, m in enumerate(received) if _progress(m) is event)
        preview = next(m[1] for m in received[index:] if isinstance(m, tuple))
        strip = np.hstack([np.asarray(Image.open(path).convert("RGB")) for path in event["paths"]])
        assert np.array_equal(np.asarray(preview.convert("RGB")), strip)
    executed = next(i for i, m in enumerate(received) if isinstance(m, dict) and m.get("type") == "executed"
                    and m["data"]["node"] == "5")
    assert executed > max(i for i, m in enumerate(received) if _progress(m) in samples)
    report = entry["outputs"]["17"]["text"][0]
    assert f"samples every 2 steps: 6 images rendered in {folder}" in report, report

    # the base MODEL (the same loaded checkpoint) renders byte for byte what it rendered before training
    assert after["status"]["status_str"] == "success", execution_error(after)
    assert "5" not in cached_nodes(after) and "1" in cached_nodes(after)
    first, second = saved_image(comfy_server, before, "7"), saved_image(comfy_server, after, "7")
    assert Image.open(first).tobytes() == Image.open(second).tobytes()
    assert np.array_equal(pixels(first), pixels(second))


def test_a_bad_sample_input_fails_the_train_node_naming_it(comfy_server):
    prompt = training_prompt(steps=2, output_name="samples_bad")
    prompt["5"]["inputs"].update({**SAMPLE_INPUTS, "sample_prompts": "  \n"})
    entry = comfy_server.run(prompt, timeout=300)
    error = execution_error(entry)
    assert error is not None and error["node_type"] == "LeanLoRATrain", entry["status"]
    assert error["exception_message"].startswith("sample_prompts: sample_every_n_steps is 2 but there is no prompt")
    assert not (comfy_server.base_dir / "models" / "loras" / "samples_bad.safetensors").exists()


FIXTURE = {"1": {"ckpt_name": "leanlora_tiny_sd15.safetensors"}, "2": {"folder": "tiny_dataset", "resolution": 64},
           "5": {"steps": 4, "learning_rate": 0.001, "warmup_steps": 0, "sample_every_n_steps": 2, "sample_size": 64,
                 "sample_steps": 3},
           "8": {"width": 64, "height": 64}, "9": {"steps": 4}, "13": {"steps": 4}}


def test_the_shipped_samples_workflow_names_the_users_files_and_samples_as_set():
    from test_template import notes_of_a_shipped_workflow
    ui = json.loads(WORKFLOW.read_text())
    notes = notes_of_a_shipped_workflow(ui)
    assert "sample_prompts" in notes and "ComfyUI/output/leanlora_samples" in notes and "ComfyUI/input" in notes


def test_the_shipped_samples_workflow_trains_with_samples(comfy_server):
    workflow = ui_to_api(json.loads(WORKFLOW.read_text()), comfy_server.object_info())
    train = workflow["5"]["inputs"]
    assert train["sample_every_n_steps"] == 100 and train["sample_size"] == 512 and train["steps"] == 1000
    assert [line for line in train["sample_prompts"].splitlines()] == [
        "lnlr, a photo, high quality", "lnlr, a close-up portrait, soft light"]
    entry = comfy_server.run(apply_overrides(workflow, FIXTURE), timeout=900)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    folder = comfy_server.base_dir / "output" / "leanlora_samples" / train["output_name"]
    assert sorted(p.name for p in folder.glob("step*.png")) == [f"step{s}_{i}.png" for s in (2, 4) for i in (0, 1)]
    assert "samples every 2 steps: 4 images rendered" in entry["outputs"]["17"]["text"][0]
    assert entry["outputs"]["11"]["images"] and entry["outputs"]["15"]["images"]  # its KSamplers ran too
