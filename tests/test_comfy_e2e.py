"""The vertical slice on a real ComfyUI server: train inside ComfyUI, use the LoRA in the same graph, and
everything a user relies on around it (stock loader compatibility, untouched base model, cancel, bad input)."""
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image
from safetensors import safe_open

from comfy_headless import execution_error

pytestmark = pytest.mark.comfy
REPO = Path(__file__).resolve().parents[1]
API_WORKFLOW = REPO / "workflows" / "api" / "train_then_generate.json"
NODES = ["LeanLoRADataset", "LeanLoRAMemorySettings", "LeanLoRALoraConfig", "LeanLoRATrain",
         "LeanLoRAVRAMMonitor", "LeanLoRAApplyLoRA"]
PROMPT = "lnlr, a red circle on a blue background"


def sampling_prompt(prefix, lora_name=None, seed=7):
    """Checkpoint (+ optional stock LoraLoader) -> KSampler -> SaveImage."""
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "leanlora_tiny_sd15.safetensors"}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "5": {"class_type": "KSampler", "inputs": {"seed": seed, "steps": 6, "cfg": 5.0, "sampler_name": "euler",
                                                   "scheduler": "normal", "denoise": 1.0, "model": ["1", 0],
                                                   "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0]}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
        "7": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["6", 0]}},
    }
    if lora_name:
        prompt["8"] = {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": lora_name,
                                                             "strength_model": 1.0, "strength_clip": 1.0}}
        prompt["2"]["inputs"]["clip"] = ["8", 1]
        prompt["5"]["inputs"]["model"] = ["8", 0]
    return prompt


def training_prompt(folder="tiny_dataset", steps=30, output_name="leanlora_test"):
    """The workflow's training half only: checkpoint -> LeanLoRA nodes -> Train -> report."""
    api = json.loads(API_WORKFLOW.read_text())
    prompt = {k: api[k] for k in ("1", "2", "3", "4", "5")}
    prompt["2"]["inputs"]["folder"] = folder
    prompt["5"]["inputs"].update(steps=steps, output_name=output_name)
    prompt["17"] = {"class_type": "PreviewAny", "inputs": {"source": ["5", 5]}}
    return prompt


def saved_image(server, entry, node_id) -> Path:
    image = entry["outputs"][node_id]["images"][0]
    return server.base_dir / image["type"] / image["subfolder"] / image["filename"]


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def cached_nodes(entry) -> set[str]:
    return {n for event, data in entry["status"]["messages"] if event == "execution_cached" for n in data["nodes"]}


@pytest.fixture(scope="module")
def trained(comfy_server):
    """Base image before training, the shipped workflow, base image after training: one server, one MODEL."""
    before = comfy_server.run(sampling_prompt("base_before"), timeout=300)
    assert before["status"]["status_str"] == "success", execution_error(before)
    workflow = comfy_server.run(json.loads(API_WORKFLOW.read_text()), timeout=900)
    after = comfy_server.run(sampling_prompt("base_after"), timeout=300)
    return {"before": before, "workflow": workflow, "after": after}


def test_object_info_lists_the_six_nodes_with_tooltips(comfy_server):
    info = comfy_server.object_info()
    for name in NODES:
        assert name in info, f"{name} missing from /object_info"
        assert info[name]["category"] == "LeanLoRA"
        for section in ("required", "optional"):
            for input_name, spec in info[name]["input"].get(section, {}).items():
                assert len(spec) > 1 and spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"


def test_workflow_trains_and_saves_a_kohya_lora(comfy_server, trained):
    entry = trained["workflow"]
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    lora = comfy_server.base_dir / "models" / "loras" / "leanlora_demo.safetensors"
    assert lora.is_file()
    with safe_open(str(lora), "pt") as f:
        keys = list(f.keys())
        assert f.metadata()["ss_network_dim"] == "8"
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    assert {k.rsplit(".", 1)[0].split(".")[-1] for k in keys} >= {"lora_down", "lora_up"}
    assert any(k.endswith(".alpha") for k in keys)
    # kohya's SD1.x naming is diffusers-style (ComfyUI's input_blocks.1.1 is diffusers' down_blocks.0.attentions.0)
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys


def test_loss_goes_down(trained):
    report = trained["workflow"]["outputs"]["17"]["text"][0]
    first, last = map(float, re.search(r"first 10 steps mean ([\d.]+), last 10 mean ([\d.]+)", report).groups())
    assert last < first, report


def test_lora_image_differs_from_base_image(comfy_server, trained):
    entry = trained["workflow"]
    with_lora, base = pixels(saved_image(comfy_server, entry, "11")), pixels(saved_image(comfy_server, entry, "15"))
    assert np.abs(with_lora - base).mean() > 1.0


def test_base_model_is_unchanged_by_training(comfy_server, trained):
    before, after = trained["before"], trained["after"]
    assert after["status"]["status_str"] == "success", execution_error(after)
    assert "5" not in cached_nodes(after), "the base KSampler was served from cache: nothing was re-sampled"
    assert "1" in cached_nodes(after), "the checkpoint was reloaded: the test must reuse the trained-on MODEL"
    first, second = saved_image(comfy_server, before, "7"), saved_image(comfy_server, after, "7")
    assert np.array_equal(pixels(first), pixels(second))
    assert Image.open(first).tobytes() == Image.open(second).tobytes()


def test_stock_lora_loader_loads_every_key(comfy_server, trained):
    log_start = len(comfy_server.log_text())
    entry = comfy_server.run(sampling_prompt("stock_loader", lora_name="leanlora_demo.safetensors"), timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    log = comfy_server.log_text()[log_start:]
    assert "lora key not loaded" not in log and "NOT LOADED" not in log
    base = pixels(saved_image(comfy_server, trained["before"], "7"))
    assert np.abs(pixels(saved_image(comfy_server, entry, "7")) - base).mean() > 1.0


def test_interrupt_stops_training_and_keeps_a_partial_lora(comfy_server, trained):
    log_start = len(comfy_server.log_text())
    prompt_id = comfy_server.queue(training_prompt(steps=100000, output_name="interrupt_me"))
    deadline = time.monotonic() + 300
    while "LeanLoRA step 10/100000" not in comfy_server.log_text()[log_start:]:
        assert time.monotonic() < deadline, "training never reached step 10"
        time.sleep(0.2)
    interrupted_at = time.monotonic()
    comfy_server.interrupt()
    entry = comfy_server.wait(prompt_id, timeout=60)
    assert time.monotonic() - interrupted_at < 5.0
    assert any(event == "execution_interrupted" for event, _ in entry["status"]["messages"]), entry["status"]
    partial = list((comfy_server.base_dir / "models" / "loras").glob("interrupt_me_partial_step*.safetensors"))
    assert len(partial) == 1
    with safe_open(str(partial[0]), "pt") as f:
        assert all(k.startswith("lora_unet_") for k in f.keys()) and f.metadata()["leanlora_partial"] == "True"
    assert requests.get(f"{comfy_server.url}/system_stats", timeout=10).ok
    again = comfy_server.run(sampling_prompt("after_interrupt", seed=8), timeout=300)
    assert again["status"]["status_str"] == "success", execution_error(again)


@pytest.mark.parametrize("case", ["empty", "not_images"])
def test_bad_dataset_folder_fails_the_node_with_path_and_fix(comfy_server, case):
    """A folder that is there but holds nothing to train on (a missing one fails validation before the run:
    tests/test_dataset_preview_server.py)."""
    folder = comfy_server.base_dir / "input" / f"bad_{case}"
    folder.mkdir(exist_ok=True)
    if case == "not_images":
        (folder / "readme.md").write_text("no images here")
        (folder / "photo.png").write_bytes(b"this is not a png")
    entry = comfy_server.run(training_prompt(folder=f"bad_{case}", output_name=f"bad_{case}"), timeout=300)
    error = execution_error(entry)
    assert entry["status"]["status_str"] == "error" and error is not None
    assert error["node_type"] == "LeanLoRADataset"
    message = error["exception_message"]
    assert str(folder) in message
    expected = {"empty": "is empty", "not_images": "no usable images"}[case]
    assert expected in message and ("put images" in message or "add images" in message or "input folder" in message)
    assert requests.get(f"{comfy_server.url}/system_stats", timeout=10).ok


def test_buckets_and_latent_cache_through_the_nodes(comfy_server, trained):
    """Aspect-ratio buckets train a mixed-shape set; a second run re-uses every latent from the RAM cache."""
    folder = comfy_server.base_dir / "input" / "bucket_dataset"
    folder.mkdir(exist_ok=True)
    for name, size, colour in [("wide", (192, 128), "red"), ("tall", (128, 192), "blue"), ("square", (128, 128), "green")]:
        Image.new("RGB", size, colour).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(f"a {colour} {name} picture")
    reports = []
    for seed in (1, 2):  # a new seed so ComfyUI does not serve the Train node from its own cache
        prompt = training_prompt(folder="bucket_dataset", steps=4, output_name=f"buckets_{seed}")
        prompt["2"]["inputs"].update(framing="aspect-ratio buckets", resolution=128)
        prompt["5"]["inputs"]["seed"] = seed
        entry = comfy_server.run(prompt, timeout=300)
        assert entry["status"]["status_str"] == "success", execution_error(entry)
        reports.append(entry["outputs"]["17"]["text"][0])
    assert "buckets: 64x128: 1, 128x64: 1, 128x128: 1" in reports[0], reports[0]
    assert "cache: latents 0 hits, 3 encoded" in reports[0]
    assert "cache: latents 3 hits, 0 encoded" in reports[1]


def test_memory_settings_inputs_are_exactly_the_settings_fields(comfy_server):
    """The node passes its inputs to MemorySettings by name: every field is an input and nothing else is."""
    import dataclasses
    import importlib
    from helpers import PACK, node_module
    labels = node_module("labels")  # and the trainer it maps to, from the same copy of the pack
    MemorySettings = importlib.import_module(f"{PACK}.trainer.settings").MemorySettings
    spec = comfy_server.object_info()["LeanLoRAMemorySettings"]["input"]
    names = {*spec["required"], *spec.get("optional", {})}
    # card is the node's own (it decides auto_fit: nodes/labels.memory_values); the rest are the fields, the levers
    # selective_recompute and prefetch_streamed included (advanced: with a card, auto-fit takes the prefetch where it
    # streams and gives selective recompute up first, as the GPU measured them; manual runs them as set)
    assert names == {field.name for field in dataclasses.fields(MemorySettings)} | {"card"}
    for name, (_, options) in spec.get("optional", {}).items():  # optional ones default like the dataclass
        if name in ("card", "gradient_checkpointing"):
            # a new node plans for its card from the fast settings (checkpointing off, turned on as far as the
            # card needs); an API prompt without them keeps what it meant before the card: manual, checkpointing on
            continue
        default = MemorySettings.__dataclass_fields__[name].default
        assert options["default"] == (labels.label_of(name, default) if name in labels.LABELS else default), name
