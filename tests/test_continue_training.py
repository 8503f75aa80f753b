"""Continue training from a LoRA file on the tiny SD1.5 ComfyUI model (issue 17, item 1): in this process, and the
shipped example workflow on a real server."""
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
from trainer.lora_import import continue_from_file
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from workflow_convert import apply_overrides, ui_to_api

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
    inject_lora(unet, settings, seed=11)
    loaded = continue_from_file(unet, settings, adapter.kohya_module_names(), adapter.base_model_kind())
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


def test_a_mismatched_lora_config_fails_before_training_and_saves_nothing(comfy_objects, dataset, tmp_path):
    first = _train(comfy_objects, dataset, tmp_path, LoraSettings(rank=4, alpha=2.0), 2, "base")
    settings = LoraSettings(rank=8, alpha=8.0, continue_from=str(first.lora_path))
    with pytest.raises(LeanLoRAError, match=r"continue_from 'base.safetensors' has rank 4, alpha 2; LoRA Config says "
                                            r"rank 8, alpha 8"):
        _train(comfy_objects, dataset, tmp_path, settings, 2, "never")
    assert not list(tmp_path.glob("never*"))
