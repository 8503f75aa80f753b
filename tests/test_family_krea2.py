"""Krea 2 (ComfyUI 0.33 only): what is particular to the family, beside the conformance checks that
tests/test_families_033.py runs on it. The tiny Krea 2 and its tiny Qwen3-VL-4B (scripts/tiny_dit_assets.py, widths
via tests/tiny_dit_configs) load through 0.33's stock loader functions: conditioning of 12 stacked hidden states, the
Wan 2.1 VAE's 5-D latents, ComfyUI's fixed shift 1.15; the family's units, LoRA targets and diffusers names are
ComfyUI's own (a quantized file trains: tests/test_families_033.py's scaled-fp8 check). Skipped on 0.3.75, which
has no Krea 2."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import comfy.model_base

import tiny_dit_assets
from family_checks import PROMPT
from family_checks import adapter as _adapter
from family_checks import train as _train
from trainer.settings import LoraTargets

pytestmark = [pytest.mark.comfy033,
              pytest.mark.skipif(not hasattr(comfy.model_base, "Krea2"), reason="ComfyUI 0.3.75 has no Krea 2 "
                                 "(comfy.model_base.Krea2 is ComfyUI 0.33's)")]


@pytest.fixture(scope="module")
def krea2(comfy_base):
    """MODEL, CLIP and VAE of the tiny Krea 2 set, loaded as UNETLoader / CLIPLoader krea2 / VAELoader load them."""
    files = tiny_dit_assets.build_family(comfy_base, "krea2")
    return tiny_dit_assets.load_family(files, "krea2")


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    import tiny_assets
    from trainer.dataset import scan_folder
    return scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("krea2_ds"), n=2), 64)


def test_the_tiny_krea2_loads_as_comfyui_builds_krea_2(krea2):
    import comfy.model_sampling
    model, clip, _ = krea2
    base = model.model
    assert type(base).__name__ == "Krea2" and type(base.model_config).__name__ == "Krea2"
    unet = base.diffusion_model
    config = tiny_dit_assets.KREA2
    assert (len(unet.blocks), unet.heads, unet.txtlayers, unet.txtdim) == (
        config["layers"], config["heads"], config["txtlayers"], config["txtdim"])
    # the text fusion keeps the real model's 128-wide heads (tiny_dit_configs derives its pinned head count)
    assert unet.txtfusion.refiner_blocks[0].attn.headdim == 128
    assert type(clip.cond_stage_model).__name__.startswith("Krea2TEModel")
    assert isinstance(base.model_sampling, comfy.model_sampling.ModelSamplingFlux)
    assert base.model_sampling.shift == pytest.approx(1.15)
    assert base.latent_format.latent_dimensions == 3  # Wan 2.1's: (batch, 16, frames, height, width)


def test_krea2_is_trained_by_its_family_with_its_conditioning(krea2):
    adapter = _adapter(krea2)
    assert type(adapter.family).__name__ == "Krea2"
    identity = adapter.identity()
    assert (identity.name, identity.base_model_version, identity.architecture, identity.prediction) == (
        "Krea 2", "krea2", "krea-2", "flow")
    assert identity.recognises("krea2") and identity.recognises("Krea-2") and not identity.recognises("flux1")
    description = adapter.describe()
    assert "Krea 2 (2 blocks + 4 text fusion blocks" in description and "shift 1.15" in description
    cond = adapter.encode_text(PROMPT, 64, 64)
    # the 12 tapped Qwen3-VL layers side by side per token, as CLIPTextEncode gives them to the sampler
    assert set(cond) == {"c_crossattn"} and cond["c_crossattn"].shape[-1] == 12 * tiny_dit_assets.KREA2["txtdim"]
    latent = adapter.encode_image(torch.rand(1, 64, 64, 3))
    assert latent.shape == (1, 16, 1, 8, 8)
    assert adapter.resolution_shift((64, 64)) == 1.0  # ComfyUI samples every size at the fixed shift 1.15
    assert adapter.family.sample_defaults.sampler == "euler" and adapter.family.sample_limits.family == "Krea 2"


def test_units_are_the_text_fusion_and_main_blocks_and_targets_are_their_linears(krea2):
    adapter = _adapter(krea2)
    unet = adapter.training_unet()
    units = adapter.checkpoint_blocks(unet)
    fusion = [*unet.txtfusion.layerwise_blocks, *unet.txtfusion.refiner_blocks]
    assert [id(u) for u in units] == [id(b) for b in [*fusion, *unet.blocks]]
    ordered = adapter.checkpoint_blocks(unet, latent_size=(8, 8))
    assert {id(u) for u in ordered} == {id(u) for u in units}
    linears = {path for path, m in unet.named_modules() if isinstance(m, torch.nn.Linear)}
    in_units = {path for path in linears if path.startswith(("blocks.", "txtfusion.layerwise_blocks.",
                                                              "txtfusion.refiner_blocks."))}
    every = adapter.lora_targets(unet, LoraTargets.ATTENTION_FEED_FORWARD)
    hit = {path for path in in_units for suffix in every if path.endswith(f".{suffix}")}
    assert hit == in_units  # every Linear in a block: q, k, v, gate, output and the SwiGLU's three
    attention = adapter.lora_targets(unet, LoraTargets.ATTENTION)
    assert all(suffix.startswith("attn.") for suffix in attention) and len(attention) == 5


def test_the_diffusers_names_are_comfyuis_map_and_a_diffusers_named_lora_continues(krea2, two_images, tmp_path,
                                                                                    caplog):
    """A LoRA renamed to the diffusers convention ComfyUI reads for Krea 2 (transformer.transformer_blocks.0.attn.to_q,
    text_fusion.refiner_blocks.0.ff.up, ...): ComfyUI applies every key, and `continue_from` reads it back."""
    import comfy.lora
    import comfy.sd
    model = krea2[0]
    trained = _train(krea2, two_images, tmp_path / "first", 2, "krea2_first")
    saved = load_file(str(trained.lora_path))
    names = _adapter(krea2).diffusers_module_names()
    assert names["blocks.0.attn.wo"] == "transformer_blocks.0.attn.to_out.0"
    assert names["txtfusion.layerwise_blocks.1.mlp.up"] == "text_fusion.layerwise_blocks.1.ff.up"
    renamed = {}
    for key, value in saved.items():
        module, part = key.split(".", 1)
        path = next(p for p in names if f"lora_unet_{p.replace('.', '_')}" == module)
        renamed[f"transformer.{names[path]}.{part}"] = value
    file = tmp_path / "diffusers_named.safetensors"
    save_file(renamed, str(file))
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, renamed, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    assert len(patched.patches) == len(modules)
    assert len(comfy.lora.load_lora(renamed, comfy.lora.model_lora_keys_unet(model.model, {}))) == len(modules)
    continued = _train(krea2, two_images, tmp_path / "continued", 2, "krea2_more", continue_from=str(file))
    assert f"{len(modules)} modules loaded" in continued.report and all(np.isfinite(continued.losses))


def test_a_conditioned_variant_with_extra_input_channels_is_refused(krea2, comfy_base):
    """A Krea 2 file whose patch embedding takes more than the 16 latent channels: Train says what it cannot build."""
    import comfy.sd
    from trainer.errors import LeanLoRAError
    state = load_file(str(comfy_base / "models" / "diffusion_models" / "leanlora_tiny_krea2.safetensors"))
    first = state["first.weight"]
    state["first.weight"] = torch.zeros(first.shape[0], 2 * first.shape[1], dtype=first.dtype)
    state["last.linear.weight"] = torch.zeros(2 * state["last.linear.weight"].shape[0], first.shape[0],
                                              dtype=first.dtype)
    state["last.linear.bias"] = torch.zeros(2 * state["last.linear.bias"].shape[0], dtype=first.dtype)
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model_state_dict(state)
    with pytest.raises(LeanLoRAError, match=r"this Krea 2 model takes 32 input channels and Krea 2's latents have 16"):
        _adapter((model, *krea2[1:]))
