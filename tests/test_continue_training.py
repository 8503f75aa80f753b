"""Continue training from a LoRA file on the tiny SD1.5 ComfyUI model (issue 17, item 1): in this process, and the
shipped example workflow on a real server."""
import importlib
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import comfy.lora
import comfy.sd

from bridge.comfy_adapter import ComfyAdapter
from comfy_headless import execution_error
from trainer.errors import LeanLoRAError
from trainer.lora import inject_lora
from trainer.lora.continue_from import check_file, continue_from_file
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from workflow_convert import apply_overrides, ui_to_api
from helpers import sd_targets  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "example_workflows" / "leanlora_continue_training.json"
MEMORY = MemorySettings("no", False)


def _train(comfy_objects, dataset, folder, lora, steps, name):
    return train_lora(ComfyAdapter(*comfy_objects), dataset, MEMORY, lora, TrainSettings(steps, 1e-3, 0, name), folder,
                      lambda **event: None, lambda: False)


def test_training_continues_from_its_own_file_and_the_stock_loader_loads_every_key(comfy_objects, dataset, tmp_path,
                                                                                  caplog):
    first = _train(comfy_objects, dataset, tmp_path, LoraSettings(rank=4, alpha=2.0), 4, "first")
    first_sd = load_file(str(first.lora_path))

    # the continued run starts from exactly the file's weights (the real model's kohya names, fp16 -> fp32)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=str(first.lora_path))
    adapter = ComfyAdapter(*comfy_objects)
    unet = adapter.training_unet()
    inject_lora(unet, settings, seed=11, target_modules=sd_targets(settings))
    loaded = continue_from_file(unet, settings, adapter.diffusers_module_names(), adapter.identity())
    names = adapter.kohya_module_names()
    layers = {p: m for p, m in unet.named_modules() if hasattr(m, "lora_A") and "leanlora" in m.lora_A}
    assert loaded.modules == len(layers) == len(first_sd) // 3 and loaded.steps == 4
    for path, layer in layers.items():
        key = "lora_unet_" + names[path].replace(".", "_")
        assert torch.equal(layer.lora_A["leanlora"].weight, first_sd[f"{key}.lora_down.weight"].float())
        assert torch.equal(layer.lora_B["leanlora"].weight, first_sd[f"{key}.lora_up.weight"].float())

    second = _train(comfy_objects, dataset, tmp_path, settings, 3, "second")
    assert "continued from first.safetensors (LeanLoRA" in second.report and "4 steps recorded" in second.report
    with safe_open(str(second.lora_path), "pt") as file:
        metadata = file.metadata()
    assert metadata["leanlora_continued_from"] == "first.safetensors" and metadata["ss_steps"] == "7"
    second_sd = load_file(str(second.lora_path))
    assert second_sd.keys() == first_sd.keys()
    assert any(not torch.equal(second_sd[k], first_sd[k]) for k in second_sd if k.endswith("lora_up.weight"))

    # what the stock LoraLoader runs on the file: every key applied, none "not loaded"
    model, clip, _ = comfy_objects
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, clip, second_sd, 1.0, 1.0)
        assert "lora key not loaded" not in caplog.text
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    assert len(comfy.lora.load_lora(second_sd, key_map)) == len(layers)
    assert len(patched.patches) == len(layers)


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_a_diffusers_peft_lora_continues_on_comfyuis_unet(family, tmp_path, caplog):
    """A LoRA that peft put on diffusers' own UNet (real diffusers module names and shapes, SD1.5's and SDXL's
    block structure) saved as diffusers does (`unet.` + peft's keys), continued on ComfyUI's ldm UNet of the same
    structure: every module lands where ComfyUI's own LoRA loader puts that diffusers module."""
    import copy
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from safetensors.torch import save_file
    from bridge.families.sd_unet import SdUnet
    from test_lora_files import SD15_DIFFUSERS, SDXL_DIFFUSERS, _comfy_model

    torch.manual_seed(0)
    diffusers_unet = UNet2DConditionModel(**(SD15_DIFFUSERS if family == "sd15" else SDXL_DIFFUSERS))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                       init_lora_weights=False), diffusers_unet)  # random A and B
    file_sd = {f"unet.{k}": v.half() for k, v in get_peft_model_state_dict(diffusers_unet).items()}
    file = tmp_path / "diffusers.safetensors"
    save_file(file_sd, str(file), {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 2})})

    model = _comfy_model(family)
    unet = copy.deepcopy(model.diffusion_model).float()
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=str(file))
    inject_lora(unet, settings, seed=0, target_modules=sd_targets(settings))
    loaded = continue_from_file(unet, settings, SdUnet().diffusers_module_names(model), SdUnet().identity(model, None))
    layers = {p: m for p, m in unet.named_modules() if hasattr(m, "lora_A") and "leanlora" in m.lora_A}
    assert loaded.format == "diffusers/peft" and loaded.modules == len(layers) == len(file_sd) // 2

    # ComfyUI's loader reads diffusers' processor spelling of the same modules: the reference mapping
    reference = {k.replace(".to_out.0.", ".to_out.").replace(".to_", ".processor.to_").replace(".lora_A.weight", "_lora.down.weight")
                 .replace(".lora_B.weight", "_lora.up.weight"): v for k, v in file_sd.items()}
    patches = comfy.lora.load_lora(reference, comfy.lora.model_lora_keys_unet(model, {}))
    assert len(patches) == len(layers)
    for weight_key, patch in patches.items():
        up, down = patch.weights[0], patch.weights[1]
        layer = layers[weight_key[len("diffusion_model."):-len(".weight")]]
        assert torch.equal(layer.lora_A["leanlora"].weight, down.float())
        assert torch.equal(layer.lora_B["leanlora"].weight, up.float())


def test_a_mismatched_lora_config_fails_before_training_and_saves_nothing(comfy_objects, dataset, tmp_path):
    first = _train(comfy_objects, dataset, tmp_path, LoraSettings(rank=4, alpha=2.0), 2, "base")
    settings = LoraSettings(rank=8, alpha=8.0, continue_from=str(first.lora_path))
    with pytest.raises(LeanLoRAError, match=r"continue_from 'base.safetensors' has rank 4, alpha 2; LoRA Config says "
                                            r"rank 8, alpha 8"):
        _train(comfy_objects, dataset, tmp_path, settings, 2, "never")
    assert not list(tmp_path.glob("never*"))


# --- the shipped example workflow on a real ComfyUI server ---

# "4": the LoRA the user picks (the template names it with " (pick yours)", which no loras folder has)
FIXTURE = {"1": {"ckpt_name": "leanlora_tiny_sd15.safetensors"}, "2": {"folder": "tiny_dataset", "resolution": 64},
           "4": {"continue_from": "my_lora.safetensors"},
           "5": {"learning_rate": 0.001, "warmup_steps": 0}, "8": {"width": 64, "height": 64}, "9": {"steps": 4}}


def test_the_shipped_continue_workflow_names_the_users_files_not_the_fixtures():
    from test_template import notes_of_a_shipped_workflow
    ui = json.loads(WORKFLOW.read_text())
    notes = notes_of_a_shipped_workflow(ui)
    assert "continue_from" in notes and "ComfyUI/models/loras" in notes and "ComfyUI/input" in notes
    [config] = [n for n in ui["nodes"] if n["type"] == "LeanLoRALoraConfig"]
    [train] = [n for n in ui["nodes"] if n["type"] == "LeanLoRATrain"]
    # the template's LoRA shape (rank 16, alpha 8, attention), so its my_lora continues as set
    assert config["widgets_values"] == [16, 8.0, 0.0, "attention", "my_lora.safetensors (pick yours)"]
    assert train["widgets_values"][-1] == "my_lora_continued"


@pytest.mark.comfy
def test_the_shipped_continue_workflow_continues_a_lora_from_the_loras_folder(comfy_server):
    from test_comfy_e2e import sampling_prompt  # the stock LoraLoader -> KSampler graph
    workflow = ui_to_api(json.loads(WORKFLOW.read_text()), comfy_server.object_info())
    assert workflow["4"]["inputs"]["continue_from"] == "my_lora.safetensors (pick yours)"  # train_then_generate's
    loras = comfy_server.base_dir / "models" / "loras"

    # the LoRA to continue: the workflow's own training half, starting fresh, saved under the name it picks
    training_half = {k: workflow[k] for k in ("1", "2", "3", "4", "5", "17")}
    seed = apply_overrides(training_half, {"1": FIXTURE["1"], "2": FIXTURE["2"], "4": {"continue_from": "none"},
                                           "5": {**FIXTURE["5"], "steps": 4, "output_name": "continue_seed"}})
    entry = comfy_server.run(seed, timeout=600)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    (loras / "continue_seed.safetensors").replace(loras / "my_lora.safetensors")

    entry = comfy_server.run(apply_overrides(workflow, {**FIXTURE, "5": {**FIXTURE["5"], "steps": 3}}), timeout=600)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    report = entry["outputs"]["17"]["text"][0]
    assert "continued from my_lora.safetensors (LeanLoRA" in report and "4 steps recorded" in report, report
    assert entry["outputs"]["11"]["images"]  # the KSampler ran with the continued LoRA
    continued = loras / "my_lora_continued.safetensors"
    with safe_open(str(continued), "pt") as file:
        metadata = file.metadata()
    assert metadata["leanlora_continued_from"] == "my_lora.safetensors" and metadata["ss_steps"] == "7"

    log_start = len(comfy_server.log_text())
    entry = comfy_server.run(sampling_prompt("continued_stock_loader", lora_name=continued.name), timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    log = comfy_server.log_text()[log_start:]
    assert "lora key not loaded" not in log and "NOT LOADED" not in log

    # a LoRA Config that does not match the file fails at that node, before the Train node encodes anything
    entry = comfy_server.run(apply_overrides(workflow, {**FIXTURE, "4": {**FIXTURE["4"], "rank": 8}}), timeout=300)
    error = execution_error(entry)
    assert error is not None and error["node_type"] == "LeanLoRALoraConfig", entry["status"]
    assert "continue_from 'my_lora.safetensors' has rank 16; LoRA Config says rank 8" in error["exception_message"]


def test_a_file_from_comfyuis_own_trainer_is_refused_naming_where_to_continue_it(comfy_objects, tiny_assets,
                                                                                  dataset, tmp_path):
    """ComfyUI's Train LoRA node puts LoRA on every layer and trains bias/norm differences (`.diff_b`, `.diff`),
    which no LoRA Config can continue without dropping them: the real file, made by that node here. (Two latents:
    0.3.75's node fails on a single latent batch, `multi_res` unset.)"""
    import comfy.model_management
    from safetensors.torch import save_file
    from comfy_extras.nodes_train import TrainLoraNode
    # its own copy of the checkpoint: the node patches the MODEL it trains (weight wrappers, requires_grad)
    with torch.inference_mode():
        model, clip, _, _ = comfy.sd.load_checkpoint_guess_config(str(tiny_assets["checkpoint"]), output_vae=False,
                                                                  embedding_directory=None)
    positive = clip.encode_from_tokens_scheduled(clip.tokenize("a red circle"))
    latents = [{"samples": torch.zeros(1, 4, 8, 8)}, {"samples": torch.ones(1, 4, 8, 8)}]
    try:
        output = TrainLoraNode.execute([model], latents, [positive, positive], [1], [2], [1], [0.0005], [4],
                                       ["AdamW"], ["MSE"], [0], ["fp32"], ["fp32"], ["LoRA"], [False], ["[None]"])
    finally:
        comfy.model_management.unload_all_models()
    lora_sd = output.result[1]
    assert any(k.endswith(".lora_up.weight") for k in lora_sd) and any(k.endswith(".diff_b") for k in lora_sd)
    file = tmp_path / "ComfyUI_trained_lora_2_steps_00001_.safetensors"
    save_file({k: v.contiguous() for k, v in lora_sd.items()}, str(file))  # what its SaveLoRA node writes

    settings = LoraSettings(rank=4, alpha=1.0, continue_from=str(file))
    for check in (lambda: check_file(settings), lambda: _train(comfy_objects, dataset, tmp_path, settings, 1, "never")):
        with pytest.raises(LeanLoRAError, match=r"continue_from 'ComfyUI_trained_lora_2_steps_00001_.safetensors' "
                                                r"holds .*which LeanLoRA does not train.*ComfyUI's Train LoRA node"):
            check()


def test_the_lora_config_node_lists_the_loras_folder_and_names_a_vanished_file(tmp_path, monkeypatch):
    import folder_paths
    from helpers import node_module
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras", ([str(tmp_path)], {".safetensors", ".pt"}))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    module = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    from safetensors.torch import save_file
    save_file({f"{module}.lora_down.weight": torch.ones(4, 8), f"{module}.lora_up.weight": torch.ones(8, 4),
               f"{module}.alpha": torch.tensor(4.0)}, str(tmp_path / "mine.safetensors"))
    torch.save({}, tmp_path / "old.pt")
    node = node_module("settings").LeanLoRALoraConfig
    options, spec = node.INPUT_TYPES()["optional"]["continue_from"]
    assert options == ["none", "mine.safetensors"] and spec["default"] == "none"  # pickles are not offered
    settings, = node().execute(4, 4.0, 0.0, "attention", "mine.safetensors")
    assert settings.continue_from == str(tmp_path / "mine.safetensors")
    assert node().execute(4, 4.0, 0.0, "attention")[0].continue_from is None
    (tmp_path / "mine.safetensors").unlink()
    errors = importlib.import_module("leanlora_nodes_under_test.trainer.errors")
    with pytest.raises(errors.LeanLoRAError, match=r"continue_from: 'mine.safetensors' is not in the loras folder any "
                                                   r"more; pick another LoRA"):
        node().execute(4, 4.0, 0.0, "attention", "mine.safetensors")
