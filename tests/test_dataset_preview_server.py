"""The Dataset node from the browser (issue 33 item 4), on the session's real ComfyUI server: the folder list of
input/ subfolders, the preview route the node calls when a folder is picked (counts and thumbnails, only for
folders the policy allows, never a path out of input/), and ComfyUI's validation failing a missing folder
before anything loads. The browser side is in tests/test_browser.py."""
import json
import shutil
from pathlib import Path

import pytest
import requests
from PIL import Image

from comfy_headless import PromptRejected, execution_error
from helpers import node_module
from test_comfy_e2e import training_prompt

pytestmark = pytest.mark.comfy
ROUTE = "/api/leanlora/dataset_preview"  # as the frontend's api.fetchApi calls it
TWIN = Path(__file__).resolve().parents[1] / "workflows" / "api" / "train_then_generate.json"


def preview(server, folder: str) -> requests.Response:
    return requests.get(f"{server.url}{ROUTE}", params={"folder": folder}, timeout=60)


def _picture(path, colour):
    Image.new("RGB", (64, 48), colour).save(path)


@pytest.fixture(scope="module")
def preview_folder(comfy_server):
    """input/preview_set: three images, two captioned, and a file named .png that is not one."""
    folder = comfy_server.base_dir / "input" / "preview_set"
    folder.mkdir(exist_ok=True)
    for i, colour in enumerate(("red", "green", "blue")):
        _picture(folder / f"p{i}.png", colour)
    (folder / "p0.txt").write_text("a red picture")
    (folder / "p1.txt").write_text("a green picture")
    (folder / "broken.png").write_bytes(b"not a png")
    (comfy_server.base_dir / "input" / "no_images_here").mkdir(exist_ok=True)
    (comfy_server.base_dir / "input" / "no_images_here" / "notes.txt").write_text("text only")
    return folder


def test_the_folder_list_is_input_subfolders_with_images(comfy_server, preview_folder):
    folders, options = comfy_server.object_info()["LeanLoRADataset"]["input"]["required"]["folder"]
    assert "preview_set" in folders and "tiny_dataset" in folders
    assert "no_images_here" not in folders  # nothing to train on
    assert "tooltip" in options


def test_the_preview_counts_images_and_captions_and_names_thumbnails_for_view(comfy_server, preview_folder):
    answer = preview(comfy_server, "preview_set")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["images"], body["captions"], body["skipped"]) == (3, 2, 1)
    assert "preview_set" in body["folders"]
    assert [t["filename"] for t in body["thumbnails"]] == ["p0.png", "p1.png", "p2.png"]
    for thumbnail in body["thumbnails"]:  # served by ComfyUI's own /view from input/
        image = requests.get(f"{comfy_server.url}/api/view", params=thumbnail, timeout=30)
        assert image.ok and image.headers["Content-Type"] == "image/png"
    # an absolute path inside input/ is the same folder
    same = preview(comfy_server, str(preview_folder)).json()
    assert (same["images"], same["captions"], len(same["thumbnails"])) == (3, 2, 3)


def test_the_preview_refuses_folders_outside_input_and_paths_out_of_it(comfy_server, preview_folder, tmp_path):
    outside = tmp_path / "private_photos"
    outside.mkdir()
    _picture(outside / "secret.png", "black")
    (comfy_server.base_dir / "input" / "link_out").symlink_to(outside, target_is_directory=True)
    # an absolute path outside input/, and a link inside input/ that leads out: refused, nothing listed
    for folder in (str(outside), "link_out"):
        answer = preview(comfy_server, folder)
        assert answer.status_code == 403, answer.text
        body = answer.json()
        assert "outside ComfyUI's input folder" in body["error"] and "LEANLORA_ALLOW_ANY_FOLDER=1" in body["error"]
        assert "secret.png" not in answer.text and "images" not in body and "thumbnails" not in body
    for folder in ("../private_photos", "preview_set/../../input", "..", "", "bad\x00folder"):
        answer = preview(comfy_server, folder)
        assert answer.status_code == 400, (folder, answer.text)
        assert "folder" in answer.json()["error"] and "images" not in answer.json()
    # a folder not there (yet: the templates name one) is an answer, not a failed request: no red console error
    missing = preview(comfy_server, "no_such_folder")
    assert missing.status_code == 200 and missing.json()["exists"] is False, missing.text
    assert "folder 'no_such_folder' does not exist" in missing.json()["error"]
    # ComfyUI's /view does not reach the folder either, whatever the route says
    assert not requests.get(f"{comfy_server.url}/api/view", timeout=30, params={
        "filename": "secret.png", "subfolder": str(outside), "type": "input"}).ok


def test_the_preview_refuses_a_folder_inside_input_holding_a_link_out_of_it(comfy_server, tmp_path):
    """A link planted among the images (here a caption) leading out of input/: 403 naming the file and the
    setting, no counts and no thumbnails, even on this loopback server (any page can call localhost)."""
    outside = tmp_path / "private_notes"
    outside.mkdir()
    (outside / "secret.txt").write_text("SECRET-TOKEN=hunter2")
    planted = comfy_server.base_dir / "input" / "planted_set"
    planted.mkdir()
    _picture(planted / "p0.png", "red")
    (planted / "p0.txt").symlink_to(outside / "secret.txt")
    answer = preview(comfy_server, "planted_set")
    assert answer.status_code == 403, answer.text
    body = answer.json()
    assert "p0.txt is a link to a file outside ComfyUI's input folder" in body["error"], body
    assert "LEANLORA_ALLOW_ANY_FOLDER=1" in body["error"] and "hunter2" not in answer.text
    assert "images" not in body and "thumbnails" not in body


def test_a_missing_folder_fails_validation_naming_the_field_and_the_fix(comfy_server):
    """Refused when queued: the checkpoint never loads and no job starts."""
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(training_prompt(folder="no_such_folder", output_name="never_trained"))
    errors = rejected.value.body["node_errors"]["2"]
    assert errors["class_type"] == "LeanLoRADataset"
    details = " ".join(e["details"] for e in errors["errors"])
    assert details.startswith("folder - folder 'no_such_folder' does not exist"), details
    assert "pick a folder from the list" in details and "absolute path" in details
    assert str(comfy_server.base_dir / "input") in details
    with pytest.raises(PromptRejected, match="is a file, not a folder"):
        comfy_server.queue(training_prompt(folder="preview_set/p0.png", output_name="never_trained"))


def test_a_missing_folder_refuses_the_whole_prompt_not_only_the_training(comfy_server):
    """The template's twin with its folder not there: ComfyUI would run the outputs that pass validation (the
    "base, no LoRA" sampler) and drop Train's; the pack's prompt hook makes it refuse the prompt whole, before
    the checkpoint loads."""
    prompt = json.loads(TWIN.read_text())
    prompt["2"]["inputs"]["folder"] = "no_such_folder"
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(prompt)
    assert "folder 'no_such_folder' does not exist" in json.dumps(rejected.value.body["node_errors"]["2"])


def test_the_prompt_hook_leaves_other_outputs_and_good_folders_alone(tiny_assets):
    """With the folder missing, the outputs that need the Dataset (Train and what uses its LoRA) become the
    prompt's only targets; run for the base branch only (the frontend's partial execution), or with a folder that
    is there, the prompt is left as it is."""
    hook = node_module("routes").outputs_needing_a_missing_folder
    output = lambda class_type: class_type in ("SaveImage", "LeanLoRATrain", "PreviewAny")  # noqa: E731
    prompt = json.loads(TWIN.read_text())
    prompt["2"]["inputs"]["folder"] = "no_such_folder"
    needing = hook({"prompt": prompt}, output)
    outputs = [key for key, node in prompt.items() if output(node["class_type"])]
    base = [key for key in outputs if key not in needing]
    assert "5" in needing and base and set(needing) < set(outputs), (needing, outputs)
    assert hook({"prompt": prompt, "partial_execution_targets": base}, output) is None
    prompt["2"]["inputs"]["folder"] = str(tiny_assets["dataset"])
    assert hook({"prompt": prompt}, output) is None


def test_a_folder_not_in_the_list_still_runs(comfy_server, tiny_assets, tmp_path):
    """The list is a suggestion: an absolute path (typed in the browser, an old workflow, an API prompt) passes
    validation and the node reads it (this server listens on loopback only, so any folder may be read)."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_assets["dataset"], elsewhere)
    prompt = {"1": {"class_type": "LeanLoRADataset", "inputs": {
                  "folder": str(elsewhere), "resolution": 64, "repeats": 1, "trigger_word": "",
                  "framing": "center crop (square)"}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    entry = comfy_server.run(prompt, timeout=300)
    assert execution_error(entry) is None, entry["status"]
    assert f"folder=PosixPath('{elsewhere}')" in entry["outputs"]["2"]["text"][0]
