"""HunyuanImage 2.1: what is particular to the family beside the conformance checks (tests/test_families_033.py). The tiny HunyuanImage 2.1, its 4-layer Qwen2.5-VL-7B and 1-block byT5 glyph encoder
(DualCLIPLoader hunyuan_image) and its 6-level VAE (scripts/tiny_dit_assets.py, narrow files via
tests/tiny_dit_configs) load through 0.33's stock loader functions: 64-channel latents at 1/32 of the image, the
byT5 glyph features of quoted text, ComfyUI's fixed shift 5; the refiner and the distilled model are refused naming
the base files; HunyuanVideo, the same network class, is not taken for it; sd-scripts' names continue. ComfyUI 0.3.75
loads HunyuanImage 2.1 too (its model_base.HunyuanImage21 is 0.33's), so these run on both versions (marker
comfy033: scripts/test.sh's 0.33 pass runs them again)."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import comfy.model_base

import tiny_dit_assets
from trainer.settings import LoraSettings, LoraTargets, MemorySettings, TrainSettings
from trainer.train_lora import train_lora

pytestmark = [pytest.mark.comfy033,
              pytest.mark.skipif(not hasattr(comfy.model_base, "HunyuanImage21"),
                                 reason="this ComfyUI has no HunyuanImage 2.1 (comfy.model_base.HunyuanImage21)")]

FP32_CHECKPOINTED = MemorySettings("no", True)  # CPU, every number reproducible
LORA = LoraSettings(rank=4, alpha=4.0, targets="attention+feed-forward")
PROMPT = "lnlr, a red circle on a blue background"
GLYPH_PROMPT = 'lnlr, a sign that says "HELLO"'
UNET_FILE = "leanlora_tiny_hunyuan_image_2.1.safetensors"


def _adapter(objects):
    from bridge.comfy_adapter import ComfyAdapter
    return ComfyAdapter(*objects)


def _train(objects, dataset, folder, steps, name, continue_from=None):
    lora = dataclasses.replace(LORA, continue_from=continue_from)
    return train_lora(_adapter(objects), dataset, FP32_CHECKPOINTED, lora, TrainSettings(steps, 1e-3, 0, name),
                      folder, lambda **event: None, lambda: False)


@pytest.fixture(scope="module")
def hunyuan(comfy_base):
    """MODEL, CLIP and VAE of the tiny set, loaded as UNETLoader / DualCLIPLoader hunyuan_image / VAELoader do."""
    files = tiny_dit_assets.build_family(comfy_base, "hunyuan_image")
    return tiny_dit_assets.load_family(files, "hunyuan_image")


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    import tiny_assets
    from trainer.dataset import scan_folder
    return scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("hunyuan_ds"), n=2), 64)


def _unet_state(comfy_base) -> dict:
    return load_file(str(comfy_base / "models" / "diffusion_models" / UNET_FILE))


def _load_state(state):
    import comfy.sd
    with torch.inference_mode():
        return comfy.sd.load_diffusion_model_state_dict(state)


def test_the_tiny_set_loads_as_comfyui_builds_hunyuan_image_2_1(hunyuan):
    import comfy.model_sampling
    model, clip, vae = hunyuan
    base = model.model
    assert type(base) is comfy.model_base.HunyuanImage21 and type(base.model_config).__name__ == "HunyuanImage21"
    unet = base.diffusion_model
    config = tiny_dit_assets.HUNYUAN_IMAGE
    assert (len(unet.double_blocks), len(unet.single_blocks), unet.hidden_size, unet.patch_size) == (
        config["depth"], config["depth_single_blocks"], config["hidden_size"], [1, 1])
    assert unet.byt5_in is not None and unet.time_r_in is None and unet.vector_in is None
    assert isinstance(base.model_sampling, comfy.model_sampling.ModelSamplingDiscreteFlow)
    assert base.model_sampling.shift == pytest.approx(5.0)
    assert (base.latent_format.latent_channels, base.latent_format.latent_dimensions) == (64, 2)
    # both text encoders of DualCLIPLoader hunyuan_image, the byT5 one at tiny_dit_assets' depth
    encoder = clip.cond_stage_model
    assert encoder.byt5_small is not None
    assert encoder.byt5_small.transformer.num_layers == tiny_dit_assets.BYT5_SMALL_GLYPH["num_layers"]
    assert vae.first_stage_model.encoder.block_out_channels == tiny_dit_assets.HUNYUAN_IMAGE_VAE["block_out_channels"]


def test_hunyuan_image_is_trained_by_its_family_with_its_conditioning(hunyuan):
    adapter = _adapter(hunyuan)
    assert type(adapter.family).__name__ == "HunyuanImage"
    identity = adapter.identity()
    assert (identity.name, identity.base_model_version, identity.architecture, identity.prediction) == (
        "HunyuanImage 2.1", "hunyuan_image_2.1", "hunyuan-image-2.1", "flow")
    assert identity.recognises("hunyuan-image-2.1") and identity.recognises("HunyuanImage") and \
        not identity.recognises("hunyuan_video")
    description = adapter.describe()
    assert "HunyuanImage 2.1 (2 double + 2 single blocks" in description and "shift 5" in description
    plain = adapter.encode_text(PROMPT, 64, 64)
    assert set(plain) == {"c_crossattn", "guidance"}  # ComfyUI's default guidance, ignored without an embedding
    assert plain["c_crossattn"].shape[-1] == tiny_dit_assets.QWEN25_7B_HUNYUAN["hidden_size"]
    # quoted text goes to byT5 too (HunyuanImageTokenizer), 1472 wide as the diffusion model's byT5 mapper takes it
    glyph = adapter.encode_text(GLYPH_PROMPT, 64, 64)
    assert set(glyph) == {"c_crossattn", "txt_byt5", "guidance"} and glyph["txt_byt5"].shape[-1] == 1472
    latent = adapter.encode_image(torch.rand(1, 64, 64, 3))
    assert latent.shape == (1, 64, 2, 2)  # 64 channels at 1/32 of the image
    assert adapter.resolution_shift((64, 64)) == 1.0  # ComfyUI samples every size at the fixed shift 5
    defaults = adapter.family.sample_defaults
    assert (defaults.sampler, defaults.scheduler, defaults.size_multiple) == ("euler", "simple", 32)


def test_the_glyph_features_reach_the_blocks(hunyuan):
    """The byT5 features of a quoted caption change what the model predicts (they join the text tokens), so a
    LoRA trained on such captions learns from them; a caption without quotes has none."""
    adapter = _adapter(hunyuan)
    unet = adapter.training_unet()
    glyph = adapter.encode_text(GLYPH_PROMPT, 64, 64)
    x = torch.randn(1, 64, 2, 2, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        with_glyph = adapter.predict(unet, x, timestep, glyph)
        without = adapter.predict(unet, x, timestep, {k: v for k, v in glyph.items() if k != "txt_byt5"})
    assert with_glyph.shape == x.shape and torch.isfinite(with_glyph).all()
    assert not torch.allclose(with_glyph, without)


def test_units_are_the_double_and_single_blocks_and_targets_are_fluxs(hunyuan):
    adapter = _adapter(hunyuan)
    unet = adapter.training_unet()
    units = adapter.checkpoint_blocks(unet)
    assert [id(u) for u in units] == [id(b) for b in [*unet.double_blocks, *unet.single_blocks]]
    ordered = adapter.checkpoint_blocks(unet, latent_size=(8, 8))
    assert {id(u) for u in ordered} == {id(u) for u in units}
    every = adapter.lora_targets(unet, LoraTargets.ATTENTION_FEED_FORWARD)
    linears = {path for path, m in unet.named_modules() if isinstance(m, torch.nn.Linear)}
    hit = {path for path in linears for suffix in every if path.endswith(f".{suffix}")}
    # every block Linear but the modulations; nothing of the token refiner, byT5 mapper or final layer
    assert hit == {path for path in linears if path.startswith(("double_blocks.", "single_blocks."))
                   and ".img_mod." not in path and ".txt_mod." not in path and ".modulation." not in path}
    assert "img_attn.qkv" in adapter.lora_targets(unet, LoraTargets.ATTENTION)


@pytest.mark.parametrize("variant, refusal", [
    ("refiner", r"the HunyuanImage 2\.1 refiner \(hunyuanimage2\.1_refiner_\*\) is not supported: .* Load Diffusion "
                r"Model with hunyuanimage2\.1_bf16\.safetensors .* DualCLIPLoader type hunyuan_image .* "
                r"hunyuan_image_2\.1_vae_fp16\.safetensors"),
    ("distilled", r"the distilled HunyuanImage 2\.1 model \(hunyuanimage2\.1_distilled_\*: a meanflow model .* train "
                  r"on the base model \(Load Diffusion Model with hunyuanimage2\.1_bf16\.safetensors"),
], ids=["refiner", "distilled"])
def test_the_refiner_and_the_distilled_model_are_refused_naming_the_base_files(hunyuan, comfy_base, variant,
                                                                              refusal):
    """The tiny file changed the way the real refiner (3-D 1x1x1 patches, the base image's latent as 64 more input
    channels) and distilled model (meanflow's time_r_in, a guidance embedding) differ, loaded as ComfyUI loads them."""
    from trainer.errors import LeanLoRAError
    state = _unet_state(comfy_base)
    embed = state["img_in.proj.weight"]
    if variant == "refiner":
        state["img_in.proj.weight"] = torch.zeros(embed.shape[0], 2 * embed.shape[1], 1, 1, 1, dtype=embed.dtype)
        expected = comfy.model_base.HunyuanImage21Refiner
    else:
        hidden = embed.shape[0]
        for part in ("time_r_in", "guidance_in"):
            state[f"{part}.in_layer.weight"] = torch.zeros(hidden, 256, dtype=embed.dtype)
            state[f"{part}.in_layer.bias"] = torch.zeros(hidden, dtype=embed.dtype)
            state[f"{part}.out_layer.weight"] = torch.zeros(hidden, hidden, dtype=embed.dtype)
            state[f"{part}.out_layer.bias"] = torch.zeros(hidden, dtype=embed.dtype)
        expected = comfy.model_base.HunyuanImage21
    model = _load_state(state)
    assert type(model.model) is expected
    with pytest.raises(LeanLoRAError, match=rf"LeanLoRA Train: {refusal}"):
        _adapter((model, *hunyuan[1:]))


def test_hunyuan_video_builds_the_same_network_and_is_not_taken_for_hunyuan_image(comfy_base):
    """HunyuanVideo (1.0: a CLIP-L pooled vector, 3-D 1x2x2 patches, 16 latent channels) is ComfyUI's
    model_base.HunyuanVideo over the same comfy.ldm.hunyuan_video network: the HunyuanImage family leaves it."""
    from bridge.families import family_for
    from bridge.families.hunyuan_image import HunyuanImage
    state = _unet_state(comfy_base)
    hidden = state["img_in.proj.weight"].shape[0]
    dtype = state["img_in.proj.weight"].dtype
    state["img_in.proj.weight"] = torch.zeros(hidden, 16, 1, 2, 2, dtype=dtype)
    state["final_layer.linear.weight"] = torch.zeros(16 * 4, hidden, dtype=dtype)
    state["final_layer.linear.bias"] = torch.zeros(16 * 4, dtype=dtype)
    state["vector_in.in_layer.weight"] = torch.zeros(hidden, 768, dtype=dtype)
    state["vector_in.in_layer.bias"] = torch.zeros(hidden, dtype=dtype)
    state["vector_in.out_layer.weight"] = torch.zeros(hidden, hidden, dtype=dtype)
    state["vector_in.out_layer.bias"] = torch.zeros(hidden, dtype=dtype)
    model = _load_state(state)
    assert type(model.model) is comfy.model_base.HunyuanVideo
    assert type(model.model.diffusion_model).__name__ == "HunyuanVideo"  # the network class HunyuanImage 2.1 uses
    assert not HunyuanImage().matches(model.model)
    assert type(family_for(model.model)).__name__ != "HunyuanImage"


def test_an_sd_scripts_named_lora_continues(hunyuan, two_images, tmp_path, caplog):
    """A LoRA with sd-scripts' HunyuanImage names (lora_unet_double_blocks_0_img_mlp_fc1, ..._img_attn_qkv,
    single blocks' linear1): `continue_from` reads it as the ComfyUI-named file it was renamed from. The saved file
    keeps ComfyUI's names, which ComfyUI's LoRA loader applies key for key."""
    import comfy.lora
    import comfy.sd
    model = hunyuan[0]
    trained = _train(hunyuan, two_images, tmp_path / "first", 2, "hunyuan_first")
    saved = load_file(str(trained.lora_path))
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, saved, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    assert len(patched.patches) == len(modules)
    names = _adapter(hunyuan).diffusers_module_names()
    assert names["double_blocks.0.img_mlp.0"] == "double_blocks.0.img_mlp.fc1"
    assert names["double_blocks.1.txt_attn.qkv"] == "double_blocks.1.txt_attn_qkv"
    assert names["single_blocks.0.modulation.lin"] == "single_blocks.0.modulation.linear"
    assert names["single_blocks.1.linear2"] == "single_blocks.1.linear2"
    renamed = {}
    for key, value in saved.items():
        module, part = key.split(".", 1)
        path = next((p for p in names if f"lora_unet_{p.replace('.', '_')}" == module), None)
        renamed[f"lora_unet_{names[path].replace('.', '_')}.{part}" if path else key] = value
    assert "lora_unet_double_blocks_0_img_mlp_fc1.lora_down.weight" in renamed
    file = tmp_path / "sd_scripts_named.safetensors"
    save_file(renamed, str(file))
    continued = _train(hunyuan, two_images, tmp_path / "continued", 2, "hunyuan_more", continue_from=str(file))
    assert f"{len(modules)} modules loaded" in continued.report and all(np.isfinite(continued.losses))
    assert len(comfy.lora.load_lora(saved, comfy.lora.model_lora_keys_unet(model.model, {}))) == len(modules)


def test_captions_with_and_without_quoted_text_train_in_separate_batches(hunyuan, tmp_path):
    """A quoted caption carries byT5 features a plain one lacks: the two never share a batch (their conditioning
    differs in kind, cache.stack_shape), and a batch of 2 over them trains."""
    import tiny_assets
    from trainer.dataset import scan_folder
    folder = tiny_assets.build_tiny_dataset(tmp_path / "ds", n=2)
    first = sorted(folder.glob("*.txt"))[0]
    first.write_text('a sign that says "HELLO"\n')
    dataset = scan_folder(folder, 64)
    memory = dataclasses.replace(FP32_CHECKPOINTED, batch_size=2)
    outcome = train_lora(_adapter(hunyuan), dataset, memory, LORA, TrainSettings(2, 1e-3, 0, "hunyuan_glyph"),
                         tmp_path / "out", lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses)) and outcome.lora_path.is_file()
