"""The shipped template (example_workflows/) is what a user's first Run needs, and the tests' twin
(workflows/api/) is that template with only the fixture names and sizes swapped in."""
import json
import re
import time
from pathlib import Path

import pytest
import requests
from PIL import Image

from comfy_headless import PromptRejected, execution_error
from workflow_convert import apply_overrides, ui_to_api

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "example_workflows" / "leanlora_train_then_generate.json"
TEMPLATES = sorted((REPO / "example_workflows").glob("*.json"))
THUMBNAIL = TEMPLATE.with_suffix(".jpg")
TWIN = REPO / "workflows" / "api" / "train_then_generate.json"
TWIN_OVERRIDES = REPO / "workflows" / "api" / "train_then_generate.overrides.json"
# What the tiny test fixture needs and a real user's run must not have (issue 15, item 12).
FIXTURE_VALUES = {"leanlora_tiny_sd15.safetensors", "tiny_dataset"}


def notes_of_a_shipped_workflow(ui: dict) -> str:
    """A shipped UI workflow names no test fixture (the user picks their own files); returns its notes' text."""
    for node in ui["nodes"]:
        values = node.get("widgets_values") or []
        assert not FIXTURE_VALUES & {v for v in values if isinstance(v, str)}, (node["id"], node["type"], values)
    return " ".join(n["widgets_values"][0] for n in ui["nodes"] if n["type"] in ("Note", "MarkdownNote"))
REGENERATE = ("regenerate the twin: scripts/workflow_convert.py example_workflows/leanlora_train_then_generate.json "
              "--object-info URL --overrides workflows/api/train_then_generate.overrides.json")


def memory_settings_widgets() -> list[str]:
    from helpers import node_module
    inputs = node_module("settings").LeanLoRAMemorySettings.INPUT_TYPES()
    return [*inputs["required"], *inputs["optional"]]


def template_prompt(object_info) -> dict:
    return ui_to_api(json.loads(TEMPLATE.read_text()), object_info)


def inputs_of(prompt: dict, class_type: str) -> list[dict]:
    return [node["inputs"] for node in prompt.values() if node["class_type"] == class_type]


def test_template_and_thumbnail_are_where_comfyui_looks():
    # ComfyUI lists <pack>/example_workflows/*.json (also workflows/*.json: none may stay there, or the template
    # would be listed twice); the frontend shows /api/workflow_templates/<pack>/<name>.jpg as its thumbnail.
    assert TEMPLATE.is_file() and THUMBNAIL.is_file()
    assert not list((REPO / "workflows").glob("*.json")), "a UI workflow in workflows/ is listed as a second template"
    names = [t.stem for t in TEMPLATES]
    assert {"leanlora_continue_training", "leanlora_train_then_generate", "leanlora_train_with_samples"} <= set(names)
    assert all(name.startswith("leanlora_") for name in names), names
    for template in TEMPLATES:  # each with its own thumbnail (a missing one is a 404 in the template browser)
        thumbnail = template.with_suffix(".jpg")
        with Image.open(thumbnail) as image:
            assert image.format == "JPEG" and image.width >= 256 and image.height >= 192, thumbnail
        assert thumbnail.stat().st_size < 100_000


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_each_template_says_what_it_is_where_the_user_reads_it(template):
    """ComfyUI 0.3.75's frontend (1.32.9) titles a pack's template by its file name and describes it by that name
    with '_' as spaces (it reads no other field for custom packs): leanlora_<what>, lower case. Opened, its
    "Start here" note's first line says in one sentence what it trains."""
    assert re.fullmatch(r"leanlora_[a-z0-9]+(_[a-z0-9]+)+", template.stem), template.stem
    ui = json.loads(template.read_text())
    [start] = [n for n in ui["nodes"] if n["type"] == "Note" and n.get("title") == "Start here"]
    first_line = start["widgets_values"][0].split("\n")[0]
    assert first_line.startswith("LeanLoRA: ") and first_line.endswith(".") and len(first_line) <= 160, first_line


TITLE_HEIGHT = 30  # the frontend draws a node's title above its pos


def _rect(node: dict) -> tuple[float, float, float, float]:
    x, y = node["pos"]
    width, height = node["size"]
    return x, y - TITLE_HEIGHT, x + width, y + height


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_templates_open_clean_with_the_card_on_auto(template):
    """No two nodes overlap at their saved sizes (the browser test checks the sizes the frontend gives them), and
    Memory Settings leads with card = auto: a user with any GPU leaves memory alone."""
    ui = json.loads(template.read_text())
    rects = {node["id"]: _rect(node) for node in ui["nodes"]}
    overlapping = [(a, b) for a in rects for b in rects if a < b
                   and rects[a][0] < rects[b][2] and rects[b][0] < rects[a][2]
                   and rects[a][1] < rects[b][3] and rects[b][1] < rects[a][3]]
    assert not overlapping, overlapping
    [memory] = [node for node in ui["nodes"] if node["type"] == "LeanLoRAMemorySettings"]
    # every widget the node has today, or (the hand-made templates) the 18 it had when they were saved: the
    # frontend gives the newer ones, appended after them, their defaults
    widgets = len(memory_settings_widgets())
    assert memory["widgets_values"][0] == "auto (this GPU)" and len(memory["widgets_values"]) in (18, widgets)


def test_template_has_no_fixture_value_and_tells_the_user_what_to_pick():
    ui = json.loads(TEMPLATE.read_text())
    notes = notes_of_a_shipped_workflow(ui)
    assert "checkpoint" in notes and "ComfyUI/input" in notes and "absolute path" in notes
    # where to get the checkpoint is in the note: a models list on the loader opens the frontend's "Missing Models"
    # dialog on every opening (frontend 1.32.9), before the user has picked their own checkpoint
    assert "v1-5-pruned-emaonly-fp16.safetensors from huggingface.co/" in notes


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.stem)
def test_no_template_asks_to_download_models(template):
    ui = json.loads(template.read_text())
    assert not [n["id"] for n in ui["nodes"] if "models" in (n.get("properties") or {})] and "models" not in ui


@pytest.mark.comfy
def test_template_widget_values_are_realistic_defaults(comfy_server):
    prompt = template_prompt(comfy_server.object_info())
    [dataset], [train], [lora] = (inputs_of(prompt, t) for t in ("LeanLoRADataset", "LeanLoRATrain", "LeanLoRALoraConfig"))
    assert dataset["folder"] not in FIXTURE_VALUES and dataset["folder"].strip()
    assert dataset["resolution"] in (512, 1024)
    for latent in inputs_of(prompt, "EmptyLatentImage"):  # generates at the size it trained at
        assert latent["width"] == latent["height"] == dataset["resolution"]
    assert 500 <= train["steps"] <= 1500 and train["learning_rate"] == pytest.approx(1e-4)
    assert lora["rank"] == 16 and lora["alpha"] != lora["rank"]  # alpha != rank: an alpha bug shows end to end
    for sampler in inputs_of(prompt, "KSampler"):
        assert sampler["steps"] >= 20
    [checkpoint] = inputs_of(prompt, "CheckpointLoaderSimple")
    assert checkpoint["ckpt_name"] not in FIXTURE_VALUES


@pytest.mark.comfy
def test_twin_is_the_template_with_only_fixture_overrides(comfy_server):
    overrides = json.loads(TWIN_OVERRIDES.read_text())
    assert apply_overrides(template_prompt(comfy_server.object_info()), overrides) == json.loads(TWIN.read_text()), \
        REGENERATE
    assert overrides["1"] == {"ckpt_name": "leanlora_tiny_sd15.safetensors"}
    assert overrides["2"]["folder"] == "tiny_dataset"


def test_overrides_fail_on_inputs_the_workflow_does_not_have():
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "a.safetensors"}},
              "2": {"class_type": "VAEDecode", "inputs": {"vae": ["1", 2]}}}
    assert apply_overrides(prompt, {"1": {"ckpt_name": "b"}})["1"]["inputs"]["ckpt_name"] == "b"
    assert prompt["1"]["inputs"]["ckpt_name"] == "a.safetensors"  # the original is left alone
    for bad in ({"3": {"x": 1}}, {"1": {"ckpt": "b"}}, {"2": {"vae": "b"}}):
        with pytest.raises(ValueError, match="override"):
            apply_overrides(prompt, bad)


@pytest.mark.comfy
def test_template_as_shipped_is_rejected_only_for_the_two_things_the_user_must_pick(comfy_server):
    """The checkpoint and the image folder, both before anything loads (the folder by the Dataset node's own
    validation, saying what to do)."""
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(template_prompt(comfy_server.object_info()))
    node_errors = rejected.value.body["node_errors"]
    assert set(node_errors) == {"1", "2"}, node_errors
    [error] = node_errors["1"]["errors"]
    assert error["type"] == "value_not_in_list" and error["extra_info"]["input_name"] == "ckpt_name"
    [error] = node_errors["2"]["errors"]
    assert error["type"] == "custom_validation_failed" and error["extra_info"]["input_name"] == "folder"
    assert "folder 'my_dataset' does not exist" in error["details"] and "pick a folder" in error["details"]


@pytest.mark.comfy
def test_template_runs_once_the_user_picks_a_checkpoint_and_a_folder(comfy_server, tiny_assets):
    """Only the two choices the notes ask for are made (an absolute folder path, as a user may type); the real
    server accepts the template and starts training; it is interrupted after its first steps to stay fast (the
    twin's full run is in test_comfy_e2e)."""
    prompt = apply_overrides(template_prompt(comfy_server.object_info()), {
        "1": {"ckpt_name": tiny_assets["checkpoint"].name}, "2": {"folder": str(tiny_assets["dataset"])}})
    log_start = len(comfy_server.log_text())
    prompt_id = comfy_server.queue(prompt)
    deadline = time.monotonic() + 300
    while "LeanLoRA step 1/1000" not in comfy_server.log_text()[log_start:]:
        entry = comfy_server._get(f"/history/{prompt_id}").get(prompt_id)
        assert entry is None, f"the template ended before training: {execution_error(entry)}"
        assert time.monotonic() < deadline, "the template never reached training step 1"
        time.sleep(0.2)
    comfy_server.interrupt()
    entry = comfy_server.wait(prompt_id, timeout=120)
    assert any(event == "execution_interrupted" for event, _ in entry["status"]["messages"]), entry["status"]
    assert execution_error(entry) is None


@pytest.mark.comfy
def test_template_is_served_to_the_template_browser(comfy_server):
    templates = requests.get(f"{comfy_server.url}/workflow_templates", timeout=10).json()
    assert sorted(templates.get("LeanLoRA", [])) == [t.stem for t in TEMPLATES]
    base = f"{comfy_server.url}/api/workflow_templates/LeanLoRA/leanlora_train_then_generate"
    served = requests.get(base + ".json", timeout=10)
    assert served.ok and served.json() == json.loads(TEMPLATE.read_text())
    thumbnail = requests.get(base + ".jpg", timeout=10)
    assert thumbnail.ok and thumbnail.headers["Content-Type"] == "image/jpeg"
    assert thumbnail.content == THUMBNAIL.read_bytes()
