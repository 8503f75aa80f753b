"""The test harness itself: a real ComfyUI server with this pack, and UI -> API workflow conversion."""
import copy

import pytest
from comfy_headless import PromptRejected, execution_error
from workflow_convert import ui_to_api

pytestmark = pytest.mark.comfy
TINY_CHECKPOINT = "leanlora_tiny_sd15.safetensors"  # conftest's tiny_assets fixture puts it in models/checkpoints


@pytest.fixture(scope="module")
def object_info(comfy_server):
    return comfy_server.object_info()


def test_server_lists_stock_nodes(object_info):
    assert "CheckpointLoaderSimple" in object_info
    assert TINY_CHECKPOINT in object_info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0]


def test_stock_prompt_writes_png(comfy_server, comfy_base):
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0xFF0000}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "harness_empty"}},
    }
    entry = comfy_server.run(prompt, timeout=60)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    assert execution_error(entry) is None
    [image] = entry["outputs"]["2"]["images"]
    assert (comfy_base / "output" / image["subfolder"] / image["filename"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invalid_prompt_is_rejected_with_node_errors(comfy_server):
    prompt = {"1": {"class_type": "SaveImage", "inputs": {"filename_prefix": "x"}}}  # required `images` missing
    with pytest.raises(PromptRejected) as err:
        comfy_server.queue(prompt)
    assert "1" in err.value.body["node_errors"]


def test_runtime_error_is_reported(comfy_server, comfy_base):
    # passes validation (the file exists) but fails when the node runs
    (comfy_base / "models/checkpoints/broken.safetensors").write_bytes(b"not a checkpoint")
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "broken.safetensors"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 2]}},
        "4": {"class_type": "PreviewImage", "inputs": {"images": ["3", 0]}},
    }
    entry = comfy_server.run(prompt, timeout=120)
    assert entry["status"]["status_str"] == "error"
    error = execution_error(entry)
    assert error["node_type"] == "CheckpointLoaderSimple" and error["exception_message"]


# --- UI -> API conversion ------------------------------------------------------------------------------------
def _inp(name, type_, link=None, widget=False):
    return {"name": name, "type": type_, "link": link, **({"widget": {"name": name}} if widget else {})}


def _node(id_, type_, inputs=(), widgets=None, mode=0):
    return {"id": id_, "type": type_, "mode": mode, "inputs": list(inputs), "outputs": [],
            "widgets_values": [] if widgets is None else widgets}


# link ids: 1 ckpt.MODEL->KSampler, 2 ckpt.VAE->VAEDecode, 3 ckpt.CLIP->pos, 4 ckpt.CLIP->Reroute,
# 5 Reroute->neg, 6 pos->KSampler, 7 neg->KSampler, 8 latent->KSampler, 9 KSampler->VAEDecode, 11 VAEDecode->Save
UI_WORKFLOW = {
    "last_node_id": 10, "last_link_id": 11, "version": 0.4,
    "nodes": [
        _node(1, "CheckpointLoaderSimple", widgets=[TINY_CHECKPOINT]),
        _node(2, "CLIPTextEncode", [_inp("clip", "CLIP", 3), _inp("text", "STRING", widget=True)], ["a red circle"]),
        _node(3, "CLIPTextEncode", [_inp("clip", "CLIP", 5), _inp("text", "STRING", widget=True)], ["blurry"]),
        _node(4, "EmptyLatentImage", [_inp("width", "INT", widget=True)], [64, 64, 1]),
        _node(5, "KSampler",
              [_inp("model", "MODEL", 1), _inp("positive", "CONDITIONING", 6), _inp("negative", "CONDITIONING", 7),
               _inp("latent_image", "LATENT", 8), _inp("seed", "INT", widget=True)],
              [42, "randomize", 1, 7.5, "euler", "normal", 1.0]),
        _node(6, "VAEDecode", [_inp("samples", "LATENT", 9), _inp("vae", "VAE", 2)]),
        _node(7, "SaveImage", [_inp("images", "IMAGE", 11), _inp("filename_prefix", "STRING", widget=True)],
              ["leanlora_ui"]),
        _node(8, "Note", widgets=["converted by scripts/workflow_convert.py"]),
        _node(10, "Reroute", [_inp("", "*", 4)]),
    ],
    "links": [
        [1, 1, 0, 5, 0, "MODEL"], [2, 1, 2, 6, 1, "VAE"], [3, 1, 1, 2, 0, "CLIP"], [4, 1, 1, 10, 0, "*"],
        [5, 10, 0, 3, 0, "CLIP"], [6, 2, 0, 5, 1, "CONDITIONING"], [7, 3, 0, 5, 2, "CONDITIONING"],
        [8, 4, 0, 5, 3, "LATENT"], [9, 5, 0, 6, 0, "LATENT"], [11, 6, 0, 7, 0, "IMAGE"],
    ],
}

EXPECTED_API = {
    "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": TINY_CHECKPOINT}},
    "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle", "clip": ["1", 1]}},
    "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
    "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
    "5": {"class_type": "KSampler", "inputs": {
        "seed": 42, "steps": 1, "cfg": 7.5, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
        "model": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0]}},
    "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}},
    "7": {"class_type": "SaveImage", "inputs": {"filename_prefix": "leanlora_ui", "images": ["6", 0]}},
}


def test_ui_to_api_stock_workflow(object_info):
    assert ui_to_api(UI_WORKFLOW, object_info) == EXPECTED_API


def test_converted_workflow_runs(comfy_server, comfy_base, object_info):
    entry = comfy_server.run(ui_to_api(UI_WORKFLOW, object_info), timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    [image] = entry["outputs"]["7"]["images"]
    assert image["filename"].startswith("leanlora_ui") and (comfy_base / "output" / image["filename"]).is_file()


def test_widget_converted_to_link_and_primitive(object_info):
    ui = copy.deepcopy(UI_WORKFLOW)
    ksampler = next(n for n in ui["nodes"] if n["id"] == 5)
    ksampler["inputs"].append(_inp("steps", "INT", 12, widget=True))
    ui["nodes"].append(_node(11, "PrimitiveNode", widgets=[3, "fixed"]))
    ui["links"].append([12, 11, 0, 5, 5, "INT"])
    api = ui_to_api(ui, object_info)
    assert api["5"]["inputs"]["steps"] == 3 and "11" not in api


def test_bypassed_node_is_rerouted_and_muted_node_dropped(object_info):
    ui = copy.deepcopy(UI_WORKFLOW)
    # ckpt -> LoraLoader (bypassed) -> KSampler.model and -> positive prompt's clip
    ui["nodes"].append(_node(12, "LoraLoader", [_inp("model", "MODEL", 13), _inp("clip", "CLIP", 14)],
                             ["missing.safetensors", 1.0, 1.0], mode=4))
    ui["links"] += [[13, 1, 0, 12, 0, "MODEL"], [14, 1, 1, 12, 1, "CLIP"], [15, 12, 0, 5, 0, "MODEL"],
                    [16, 12, 1, 2, 0, "CLIP"]]
    nodes = {n["id"]: n for n in ui["nodes"]}
    nodes[5]["inputs"][0]["link"] = 15
    nodes[2]["inputs"][0]["link"] = 16
    nodes[7]["mode"] = 2
    api = ui_to_api(ui, object_info)
    assert "12" not in api and "7" not in api
    assert api["5"]["inputs"]["model"] == ["1", 0] and api["2"]["inputs"]["clip"] == ["1", 1]


def test_unknown_node_and_extra_widgets_are_errors(object_info):
    ui = copy.deepcopy(UI_WORKFLOW)
    ui["nodes"].append(_node(13, "NoSuchNode"))
    with pytest.raises(ValueError, match="node 13 has type 'NoSuchNode'"):
        ui_to_api(ui, object_info)
    ui = copy.deepcopy(UI_WORKFLOW)
    next(n for n in ui["nodes"] if n["id"] == 4)["widgets_values"].append(2)
    with pytest.raises(ValueError, match=r"node 4 \(EmptyLatentImage\): 4 widget values"):
        ui_to_api(ui, object_info)
