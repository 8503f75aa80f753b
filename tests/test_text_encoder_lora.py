"""Text-encoder LoRA (LoRA Config's text_encoder_lr, bridge/text_encoder.py) on real ComfyUI objects: the tiny SD1.5
checkpoint (its CLIP-L at full size) and a tiny SDXL (ComfyUI's SDXL model and SDXLClipModel, narrowed through
ComfyUI's own per-encoder config override). Each test fails when the option is ignored: the encoder's LoRA must
change and change the loss, ComfyUI's loader must apply every te key, the user's CLIP must encode as before, an exact
resume must equal the uninterrupted run, and a family without it must refuse naming the field."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from test_families import FP32_CHECKPOINTED, _adapter, dit_files, family_objects, two_images  # noqa: F401
from trainer.errors import LeanLoRAError
from trainer.settings import LoraSettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX

LORA = LoraSettings(rank=4, alpha=4.0, targets="attention")
TE = dataclasses.replace(LORA, text_encoder_lr=5e-4)
PROMPT = "lnlr, a red circle on a blue background"


def _run(objects, dataset, folder, name, lora, steps=3, **train):
    return train_lora(_adapter(objects), dataset, FP32_CHECKPOINTED, lora,
                      TrainSettings(steps, 1e-3, 0, name, "cosine", 1, **train), folder,
                      lambda **event: None, lambda: False)


def _encoded(clip, prompt=PROMPT) -> tuple[bytes, bytes]:
    """What the CLIP makes of a prompt, as CLIPTextEncode runs it: the context and the pooled output, as bytes."""
    with torch.inference_mode():
        cond, pooled = clip.encode_from_tokens(clip.tokenize(prompt), return_pooled=True)
    return cond.numpy().tobytes(), pooled.numpy().tobytes()


def _clip_keys_all_load(clip, state_dict, caplog) -> dict:
    """ComfyUI's own loader (comfy.sd.load_lora_for_models, what LoraLoader runs) on the CLIP: every te key maps."""
    import comfy.lora
    import comfy.sd
    te = {k: v for k, v in state_dict.items() if k.startswith("lora_te")}
    assert te
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        _, patched = comfy.sd.load_lora_for_models(None, clip, te, 0.0, 1.0)
        assert "lora key not loaded" not in caplog.text
    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    patches = comfy.lora.load_lora(te, key_map)
    assert len(patches) == len({k.split(".", 1)[0] for k in te})
    return patched


# --- SD1.5 -----------------------------------------------------------------------------------------------------

def test_sd15_trains_the_text_encoder_exports_kohya_keys_comfyui_applies_and_the_users_clip_is_unchanged(
        comfy_objects, two_images, tmp_path, caplog):  # noqa: F811
    objects = comfy_objects
    clip = objects[1]
    before = _encoded(clip)
    off = _run(objects, two_images, tmp_path / "off", "off", LORA)
    on = _run(objects, two_images, tmp_path / "on", "on", TE)
    assert _encoded(clip) == before  # the user's CLIP encodes byte for byte as before training

    saved = load_file(str(on.lora_path))
    te = {k for k in saved if k.startswith("lora_te_")}
    modules = {k.split(".", 1)[0] for k in te}
    assert len(modules) == 12 * 6  # CLIP-L: 12 layers x q/k/v/out_proj, fc1, fc2
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in modules
    assert "lora_te_text_model_encoder_layers_11_mlp_fc2" in modules
    assert not any(k.startswith("lora_te") for k in load_file(str(off.lora_path)))
    # it learned: lora_up starts at zero, and the encoder's LoRA moved the loss off the run without it
    assert any(saved[k].abs().max() > 0 for k in te if k.endswith("lora_up.weight"))
    assert on.losses[0] == off.losses[0]  # step 1 runs before any update: the same draws, the same weights
    assert on.losses[1:] != off.losses[1:]
    unet_keys = {k for k in saved if k.startswith("lora_unet_")}
    assert unet_keys == set(load_file(str(off.lora_path)))
    with safe_open(str(on.lora_path), "pt") as file:
        metadata = file.metadata()
    assert metadata["ss_text_encoder_lr"] == "0.0005" and metadata["ss_network_train_unet_only"] == "False"
    assert "text encoder trained too" in on.report and "learning rate 0.0005" in on.report

    patched = _clip_keys_all_load(clip, saved, caplog)
    assert _encoded(patched) != before  # the trained te LoRA changes what the CLIP encodes
    assert _encoded(clip) == before
