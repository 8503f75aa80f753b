"""One conformance test over the model families (bridge/families/FAMILIES): each family's tiny model, loaded by the
functions ComfyUI's stock loaders call (in process) and by the stock loader nodes themselves (a real server), trains a
LoRA whose units cover the model's blocks, whose targets exist, whose file ComfyUI applies key for key and
`continue_from` reads back, whose exact resume equals the uninterrupted run, and which leaves the base model as it
was. The tiny DiT files come from scripts/tiny_dit_assets.py (their widths need tests/tiny_dit_configs)."""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import tiny_assets
import tiny_dit_assets
from comfy_headless import execution_error
from family_checks import (FP32_CHECKPOINTED, LORA, PROMPT, check_a_memory_technique_runs,
                           check_a_scaled_fp8_file_trains_with_its_scales_as_stored,
                           check_fp8_weights_as_loaded_train_without_a_16_bit_copy,
                           check_samples_render_with_the_familys_sampler, check_the_template_trains_then_samples,
                           check_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model,
                           check_trains_through_the_stock_loaders_in_a_real_server,
                           check_units_cover_the_blocks_and_every_target_exists, loaders, training)
from family_checks import adapter as _adapter, base_output as _base_output, fingerprint as _fingerprint  # noqa: F401
from family_checks import train as _train  # noqa: F401  (other test files import these names from here)
from trainer.dataset import scan_folder
from trainer.settings import BaseWeights, LoraSettings, LoraTargets, MemorySettings, TrainSettings
from trainer.train_lora import train_lora

DIT = {"z_image": "ZImage", "flux_dev": "Flux", "chroma": "Chroma", "qwen_image": "QwenImage",
       "wan": "Wan"}  # tiny set -> family class
VIDEO_LATENTS = ("qwen_image", "wan")  # the Wan 2.1 VAE's 5-D latents (batch, 16, frames, height/8, width/8)

FAMILIES = {"sd15": "SdUnet", **DIT}


@pytest.fixture(scope="session")
def dit_files(comfy_base) -> dict[str, dict[str, Path]]:
    """The tiny DiT sets in the session's ComfyUI folders (models/diffusion_models, text_encoders, vae)."""
    return {family: tiny_dit_assets.build_family(comfy_base, family) for family in DIT}


@pytest.fixture(scope="session")
def family_objects(dit_files, comfy_objects):
    """MODEL, CLIP and VAE per family, loaded the way the stock loader nodes load them."""
    loaded = {"sd15": comfy_objects}
    for family, files in dit_files.items():
        loaded[family] = tiny_dit_assets.load_family(files, family)
    return loaded


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    return scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("family_ds"), n=2), 64)


def test_the_family_list_is_ordered_with_the_generic_path_last():
    from bridge.families import FAMILIES as LIST
    assert [type(f).__name__ for f in LIST] == ["SdUnet", "ZImage", "Flux", "Chroma", "Flux2", "QwenImage", "Wan",
                                                "HunyuanImage", "Krea2", "Anima", "Generic"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_model_is_trained_by_its_family(family_objects, family):
    adapter = _adapter(family_objects[family])
    assert type(adapter.family).__name__ == FAMILIES[family]
    identity = adapter.identity()
    assert identity.prediction == ("epsilon" if family == "sd15" else "flow")
    assert identity.recognises(identity.base_model_version) and identity.recognises(identity.architecture)


def test_a_model_no_family_knows_is_refused_naming_it_and_the_families():
    from bridge.families import family_for
    from trainer.errors import LeanLoRAError

    class Pixels(torch.nn.Module):  # no repeated blocks of Linear layers
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3)

    class AudioModel:
        diffusion_model = Pixels()
    with pytest.raises(LeanLoRAError, match=r"cannot train this MODEL \(AudioModel, diffusion model Pixels\).*"
                                            r"SD1.x/SD2.x/SDXL UNet.*Z-Image.*FLUX.1.*Qwen-Image.*Wan 2.1/2.2 T2V.*generic"):
        family_for(AudioModel())


def test_the_generic_path_trains_any_repeated_linear_blocks_and_says_it_cannot_graph():
    from bridge.families.generic import Generic

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Module()
            self.attn.qkv, self.attn.proj = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    class Base:
        diffusion_model = Net()
    generic, net = Generic(), Base.diffusion_model
    assert generic.matches(Base()) and generic.graph_blocker
    assert generic.checkpoint_units(net) == list(net.blocks)
    assert generic.lora_targets(net, LoraTargets.ATTENTION) == tuple(
        f"blocks.{i}.attn.{name}" for i in range(3) for name in ("qkv", "proj"))
    assert len(generic.lora_targets(net, LoraTargets.ATTENTION_FEED_FORWARD)) == 12  # not the embedding
    assert set(generic.checkpoint_units(net, latent_size=(8, 8))) == set(net.blocks)


@pytest.mark.parametrize("variant, channels, refusal", [
    ("i2v", (36, 16), r"this Wan model \(WAN21_T2V\) is an image-to-video or control model: it takes 20 extra input "
                      r"channels"),
    ("ti2v_5b", (48, 48), r"Wan 2\.2 TI2V-5B \(48-channel latents of the Wan 2\.2 VAE\) is not supported"),
    ("i2v_generic", (36, 16), r"WAN21 takes extra input channels \(inpainting/edit/video conditioning\), which the "
                              r"generic path does not build"),
], ids=["i2v", "ti2v_5b", "i2v_generic"])
def test_wan_models_that_need_conditioning_it_does_not_build_are_refused_before_training(
        dit_files, family_objects, variant, channels, refusal, monkeypatch):
    """The tiny Wan T2V file with the input (and output) channels of an image-to-video or control model, or of Wan
    2.2 TI2V-5B, loaded as ComfyUI loads such files: Train says what it cannot build, naming the model. Without the
    Wan family the generic path refuses the image-to-video model too (its concat_cond adds channels)."""
    import comfy.sd
    import bridge.families as families
    from trainer.errors import LeanLoRAError
    if variant.endswith("generic"):
        monkeypatch.setattr(families, "FAMILIES", [families.Generic()])
    state = load_file(str(dit_files["wan"]["unet_name"]))
    inputs, outputs = channels
    embed = state["patch_embedding.weight"]
    state["patch_embedding.weight"] = torch.zeros(embed.shape[0], inputs, *embed.shape[2:], dtype=embed.dtype)
    patch = 4  # (1, 2, 2)
    state["head.head.weight"] = torch.zeros(outputs * patch, state["head.head.weight"].shape[1], dtype=embed.dtype)
    state["head.head.bias"] = torch.zeros(outputs * patch, dtype=embed.dtype)
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model_state_dict(state)
    assert type(model.model).__name__ == ("WAN22" if variant == "ti2v_5b" else "WAN21")
    _, clip, vae = family_objects["wan"]
    with pytest.raises(LeanLoRAError, match=rf"LeanLoRA Train: {refusal}"):
        _adapter((model, clip, vae))


def test_a_machine_without_the_ram_for_the_private_copy_gets_the_numbers_before_training(family_objects, monkeypatch):
    import bridge.comfy_adapter as comfy_adapter
    from trainer.errors import LeanLoRAError
    adapter = _adapter(family_objects["flux_dev"])
    monkeypatch.setattr(comfy_adapter, "available_ram_bytes", lambda: 1024 ** 2)  # 1 MiB free
    assert adapter.training_unet() is not None  # host weights are shared with ComfyUI's copy: nothing to copy
    # weights it cannot share (on a GPU, or 0.33's quantized subclasses) are copied: that copy needs the RAM
    monkeypatch.setattr(comfy_adapter, "_shareable", lambda tensor: False)
    with pytest.raises(LeanLoRAError, match=r"private copy of the diffusion model \(Flux\) needs 0\.0\d GiB of free "
                                            r"RAM, and this machine has 0\.00 GiB available\. Load the model with "
                                            r"weight_dtype fp8_e4m3fn"):
        adapter.training_unet()
    monkeypatch.setattr(comfy_adapter, "available_ram_bytes", lambda: None)  # unknown: no check
    assert adapter.training_unet() is not None


@pytest.mark.parametrize("family, config", [("qwen_image", "QwenImage"), ("wan", "WAN21_T2V")])
def test_the_generic_path_trains_a_real_comfyui_dit_and_says_so(family_objects, two_images, tmp_path, monkeypatch,
                                                                 caplog, family, config):
    """Qwen-Image and Wan as if no family knew them: ComfyUI core's approach (LoRA on the Linear layers of the
    repeated blocks, the loss through model_sampling) trains them, and ComfyUI applies every key of the file. The
    conditioning is built for a latent of the model's own format: Wan's extra_conds adds zero image channels (an
    image-to-video input) for any channels a latent lacks."""
    import comfy.sd
    import bridge.families as families
    monkeypatch.setattr(families, "FAMILIES", [families.Generic()])
    model = family_objects[family][0]
    adapter = _adapter(family_objects[family])
    assert type(adapter.family).__name__ == "Generic" and "via the generic path" in adapter.describe()
    assert adapter.graph_blocker and adapter.identity().name == f"{config} (generic)"
    assert set(adapter.encode_text(PROMPT, 64, 64)) == {"c_crossattn"}
    outcome = train_lora(adapter, two_images, FP32_CHECKPOINTED, LORA, TrainSettings(2, 1e-3, 0, f"generic_{family}"),
                         tmp_path, lambda **event: None, lambda: False)
    assert "via the generic path" in outcome.report and all(np.isfinite(outcome.losses))
    assert re.search(r"host RAM: this process's peak since it started \d+\.\d\d GiB", outcome.report)
    saved = load_file(str(outcome.lora_path))
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, saved, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    assert len(patched.patches) == len({k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")})


@pytest.mark.parametrize("family", FAMILIES)
def test_units_cover_the_blocks_and_every_target_exists(family_objects, family):
    check_units_cover_the_blocks_and_every_target_exists(family_objects[family], family, dit=family in DIT)


@pytest.mark.parametrize("family", ["flux_dev", "chroma"])
def test_fluxs_out_of_place_blocks_compute_exactly_what_comfyuis_blocks_compute(family_objects, family):
    """Flux.prepare swaps the training copy's block forwards for out-of-place ones: every block's output, bit for
    bit, is what ComfyUI's own forward gives on the same inputs (Chroma's blocks, FLUX.1's without their own
    modulation, take the approximator's)."""
    adapter = _adapter(family_objects[family])
    unet = adapter.training_unet()
    calls = {}
    hooks = [block.register_forward_hook(lambda m, args, kwargs, out: calls.setdefault(m, (args, kwargs, out)) and None,
                                         with_kwargs=True) for block in adapter.family.blocks(unet)]
    generator = torch.Generator().manual_seed(0)
    config = tiny_dit_assets.FLUX_DEV if family == "flux_dev" else tiny_dit_assets.CHROMA
    pooled = {"y": torch.randn(1, config["vec_in_dim"], generator=generator)} if family == "flux_dev" else {}
    with torch.no_grad():
        unet(torch.randn(1, 16, 8, 8, generator=generator), torch.tensor([0.5]),
             context=torch.randn(1, 256, config["context_in_dim"], generator=generator),
             guidance=torch.tensor([1.0]), **pooled)
    for hook in hooks:
        hook.remove()
    assert len(calls) == len(adapter.family.blocks(unet)) == 4
    copy = lambda value: value.clone() if torch.is_tensor(value) else value  # noqa: E731 - theirs add in place
    for block, (args, kwargs, ours) in calls.items():
        with torch.no_grad():
            theirs = type(block).forward(block, *map(copy, args), **{k: copy(v) for k, v in kwargs.items()})
        for mine, original in zip(ours if isinstance(ours, tuple) else (ours,),
                                  theirs if isinstance(theirs, tuple) else (theirs,)):
            assert torch.equal(mine, original), type(block).__name__


def latent_shape(family: str) -> tuple[int, ...]:
    """A 64-pixel square latent of the family's VAE."""
    return (1, 16, 1, 8, 8) if family in VIDEO_LATENTS else (1, 4, 8, 8) if family == "sd15" else (1, 16, 8, 8)


@pytest.mark.parametrize("family", DIT)
def test_a_family_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model(
        family_objects, two_images, family, tmp_path, caplog):
    check_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model(family_objects[family], two_images,
                                                                                 family, tmp_path, caplog)


@pytest.mark.parametrize("family", DIT)
def test_fp8_weights_as_loaded_train_without_a_16_bit_copy(dit_files, family_objects, two_images, family, tmp_path):
    check_fp8_weights_as_loaded_train_without_a_16_bit_copy(dit_files[family]["unet_name"], family_objects[family],
                                                            two_images, family, tmp_path)


@pytest.mark.parametrize("family", DIT)
def test_a_scaled_fp8_file_trains_with_its_scales_as_stored(dit_files, family_objects, two_images, family, tmp_path):
    check_a_scaled_fp8_file_trains_with_its_scales_as_stored(dit_files[family]["unet_name"], family_objects[family],
                                                             two_images, family, tmp_path)


@pytest.mark.parametrize("family", DIT)
def test_samples_during_training_render_with_the_familys_sampler(family_objects, family, tmp_path):
    assert _adapter(family_objects[family]).family.sample_defaults.scheduler == "simple"  # the flow DiTs' schedule
    check_samples_render_with_the_familys_sampler(family_objects[family], tmp_path)


_OFFLOADED = MemorySettings("bf16", True, base_weights=BaseWeights.FP8, checkpoint_share=0.5, activation_offload=True)
_STREAMED = MemorySettings("bf16", True, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.5, batch_size=2,
                           optimizer="AdamW8bit")


@pytest.mark.parametrize("family, memory", [("flux_dev", _OFFLOADED), ("z_image", _STREAMED), ("qwen_image", _OFFLOADED),
                                            ("flux_dev", _STREAMED), ("chroma", _OFFLOADED), ("wan", _STREAMED)],
                         ids=["flux-fp8-half-checkpointed-offloaded", "z_image-streamed-batch2-8bit",
                              "qwen_image-fp8-half-checkpointed-offloaded", "flux-streamed-batch2-8bit",
                              "chroma-fp8-half-checkpointed-offloaded", "wan-streamed-batch2-8bit"])
def test_every_memory_technique_runs_on_each_family(family_objects, two_images, family, memory, tmp_path):
    report = check_a_memory_technique_runs(family_objects[family], two_images, memory, family, tmp_path)
    # FLUX.1-dev's small training images train at the shift ComfyUI samples them with; the others' schedules are fixed
    assert ("noise levels: shifted per image size" in report) == (family == "flux_dev")


def test_qwen_image_loras_load_in_diffusers_and_diffusers_files_continue(family_objects, two_images, tmp_path):
    """diffusers' QwenImagePipeline reads the file (its lora_unet_ names are diffusers' own paths) onto every
    module, and the diffusers-format file it makes (transformer.<path>.lora_A/B) continues in LeanLoRA."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import save_file
    first = _train(family_objects["qwen_image"], two_images, tmp_path / "first", 2, "qwen_first")
    saved = load_file(str(first.lora_path))
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    config = tiny_dit_assets.QWEN_IMAGE
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=config["in_channels"], out_channels=config["out_channels"],
        num_layers=config["num_layers"], attention_head_dim=config["attention_head_dim"],
        num_attention_heads=config["num_attention_heads"], joint_attention_dim=config["joint_attention_dim"],
        axes_dims_rope=(16, 56, 56))
    converted = QwenImagePipeline.lora_state_dict(saved)
    converted = converted[0] if isinstance(converted, tuple) else converted
    every = _diffusers_block_linears(transformer, "transformer_blocks.")  # the diffusers model's own modules
    transformer.load_lora_adapter(converted, prefix="transformer", adapter_name="leanlora")
    assert {path for path, m in transformer.named_modules() if isinstance(m, LoraLayer)} == every
    assert len(every) == len(modules)

    file = tmp_path / "diffusers_format.safetensors"  # alpha folded into the weights by the conversion: scale 1
    save_file({k: v.contiguous() for k, v in converted.items()}, str(file))
    continued = train_lora(_adapter(family_objects["qwen_image"]), two_images, FP32_CHECKPOINTED,
                           LoraSettings(rank=4, alpha=4.0, targets="attention+feed-forward", continue_from=str(file)),
                           TrainSettings(2, 1e-3, 0, "qwen_more"), tmp_path / "more", lambda **event: None,
                           lambda: False)
    assert f"{len(modules)} modules loaded" in continued.report and "diffusers/peft" in continued.report


def _diffusers_block_linears(model: torch.nn.Module, *blocks: str) -> set[str]:
    """Every module of a diffusers transformer's blocks that a LoRA of attention+feed-forward goes on, from the
    model itself: each Linear under `blocks` but the modulation (img_mod/txt_mod, adaLN_modulation, norm.linear)."""
    return {path for path, m in model.named_modules() if isinstance(m, torch.nn.Linear) and path.startswith(blocks)
            and not re.search(r"(^|\.)([a-z]+_mod|adaLN_modulation|norm\d?(_context)?)\.", path)}


def _peft_deltas(model: torch.nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """Each peft LoRA layer's weight difference (B A x scaling), by module path."""
    from peft.tuners.lora import LoraLayer
    return {path: (layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight).float() * layer.scaling[adapter]
            for path, layer in model.named_modules() if isinstance(layer, LoraLayer)}


def _file_deltas(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each kohya module's weight difference (up down x alpha / rank), by module name without `lora_unet_`."""
    deltas = {}
    for key in saved:
        if key.endswith(".lora_down.weight"):
            module = key[:-len(".lora_down.weight")]
            down, up = saved[key].float(), saved[f"{module}.lora_up.weight"].float()
            deltas[module.removeprefix("lora_unet_")] = up @ down * (saved[f"{module}.alpha"].item() / down.shape[0])
    return deltas


def test_z_image_loras_load_in_diffusers_with_each_fused_projection_split_exactly(family_objects, two_images,
                                                                                  tmp_path):
    """diffusers' ZImagePipeline reads the file onto every module of its ZImageTransformer2DModel: our LoRA on
    ComfyUI's fused attention.qkv becomes three LoRAs on diffusers' to_q, to_k and to_v, whose differences are
    exactly the thirds of ours; attention.out lands on to_out.0, the SwiGLU on feed_forward.w1/w2/w3."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    trained = _train(family_objects["z_image"], two_images, tmp_path, 2, "z_image_for_diffusers")
    saved = load_file(str(trained.lora_path))
    config = tiny_dit_assets.Z_IMAGE
    transformer = ZImageTransformer2DModel(dim=config["dim"], n_layers=config["n_layers"],
                                           n_refiner_layers=config["n_refiner_layers"], n_heads=config["n_heads"],
                                           n_kv_heads=config["n_kv_heads"], cap_feat_dim=config["cap_feat_dim"])
    # The full model's SwiGLU is 10240 wide in both (8/3 x 3840); at this tiny width ComfyUI rounds 682 up to a
    # multiple of 256 and diffusers does not, so diffusers' layers are given ComfyUI's width
    hidden = family_objects["z_image"][0].model.diffusion_model.layers[0].feed_forward.w1.out_features
    for block in [*transformer.layers, *transformer.noise_refiner, *transformer.context_refiner]:
        ff = block.feed_forward
        ff.w1, ff.w3 = (torch.nn.Linear(config["dim"], hidden, bias=False) for _ in range(2))
        ff.w2 = torch.nn.Linear(hidden, config["dim"], bias=False)
    converted = ZImagePipeline.lora_state_dict(saved)
    converted = converted[0] if isinstance(converted, tuple) else converted
    every = _diffusers_block_linears(transformer, "layers.", "noise_refiner.", "context_refiner.")
    transformer.load_lora_adapter(converted, prefix="transformer", adapter_name="leanlora")
    theirs, ours = _peft_deltas(transformer, "leanlora"), _file_deltas(saved)
    assert set(theirs) == every  # every module of diffusers' own blocks
    assert len(theirs) == len(ours) + 2 * sum(name.endswith("attention_qkv") for name in ours)
    for name, delta in ours.items():
        block = re.sub(r"_(\d+)$", r".\1", name.split("_attention_")[0].split("_feed_forward_")[0])
        if name.endswith("attention_qkv"):
            parts = torch.cat([theirs[f"{block}.attention.to_{p}"] for p in "qkv"])
        elif name.endswith("attention_out"):
            parts = theirs[f"{block}.attention.to_out.0"]
        else:
            parts = theirs[f"{block}.feed_forward.{name.rsplit('_', 1)[1]}"]
        torch.testing.assert_close(parts, delta, rtol=1e-3, atol=1e-6, msg=name)


def test_wan_loras_load_in_diffusers_onto_every_module_with_the_same_differences(family_objects, two_images,
                                                                                 tmp_path):
    """diffusers' WanPipeline reads our Wan file (musubi-tuner's `lora_unet_blocks_N_self_attn_q` names) onto its
    WanTransformer3DModel: every module gets a LoRA whose weight difference equals ours (attention q/k/v/o become
    to_q/to_k/to_v/to_out.0 of attn1 / attn2, the feed-forward ffn.0 / ffn.2 its net.0.proj / net.2)."""
    from diffusers import WanPipeline, WanTransformer3DModel
    trained = _train(family_objects["wan"], two_images, tmp_path, 2, "wan_for_diffusers")
    saved = load_file(str(trained.lora_path))
    config = tiny_dit_assets.WAN21_T2V
    transformer = WanTransformer3DModel(
        patch_size=config["patch_size"], num_attention_heads=config["num_heads"],
        attention_head_dim=config["dim"] // config["num_heads"], in_channels=config["in_dim"],
        out_channels=config["out_dim"], text_dim=config["text_dim"], freq_dim=config["freq_dim"],
        ffn_dim=config["ffn_dim"], num_layers=config["num_layers"], cross_attn_norm=config["cross_attn_norm"],
        eps=config["eps"])
    converted = WanPipeline.lora_state_dict(saved)
    converted = converted[0] if isinstance(converted, tuple) else converted
    every = _diffusers_block_linears(transformer, "blocks.")  # the diffusers model's own modules
    transformer.load_lora_adapter(converted, prefix="transformer", adapter_name="leanlora")
    theirs, ours = _peft_deltas(transformer, "leanlora"), _file_deltas(saved)
    assert set(theirs) == every and len(ours) == len(every)  # every module of diffusers' blocks, none split
    attention = {"self_attn": "attn1", "cross_attn": "attn2"}
    projection = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0"}
    for name, delta in ours.items():
        block, rest = re.fullmatch(r"blocks_(\d+)_(.+)", name).groups()
        if rest.startswith("ffn_"):
            path = f"blocks.{block}.ffn." + {"0": "net.0.proj", "2": "net.2"}[rest[len("ffn_"):]]
        else:
            kind, part = rest.rsplit("_", 1)
            path = f"blocks.{block}.{attention[kind]}.{projection[part]}"
        torch.testing.assert_close(theirs[path], delta, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["flux_dev", "chroma"])
def test_flux_lora_names_are_the_kohya_names_diffusers_converts_for_flux_transformer(family_objects, two_images,
                                                                                    tmp_path, family):
    """diffusers reads FLUX.1 and Chroma LoRAs in kohya's naming (our file's) with FluxPipeline's converter (its
    ChromaPipeline's too), which splits the fused qkv and linear1 at FLUX.1's own widths (3072 x 3 + 12288, written
    into it): so our tiny file's keys, with tensors of the full model's shapes, must all be converted (none left
    over) onto modules of a full-width FluxTransformer2DModel / ChromaTransformer2DModel (built on the meta device)
    whose shapes they fit."""
    from diffusers import ChromaTransformer2DModel, FluxPipeline, FluxTransformer2DModel
    trained = _train(family_objects[family], two_images, tmp_path, 2, f"{family}_for_diffusers")
    saved = load_file(str(trained.lora_path))
    hidden, rank = 3072, 4
    out_in = {"img_attn_qkv": (3 * hidden, hidden), "txt_attn_qkv": (3 * hidden, hidden),
              "img_attn_proj": (hidden, hidden), "txt_attn_proj": (hidden, hidden),
              "img_mlp_0": (4 * hidden, hidden), "txt_mlp_0": (4 * hidden, hidden),
              "img_mlp_2": (hidden, 4 * hidden), "txt_mlp_2": (hidden, 4 * hidden),
              "linear1": (7 * hidden, hidden), "linear2": (hidden, 5 * hidden)}
    full = {}
    for key, value in saved.items():
        module, part = key.split(".", 1)
        out, inp = out_in[next(suffix for suffix in out_in if module.endswith(suffix))]
        full[key] = value if part == "alpha" else torch.randn((rank, inp) if "down" in part else (out, rank))
    converted = FluxPipeline.lora_state_dict(full)
    converted = converted[0] if isinstance(converted, tuple) else converted
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(num_layers=2, num_single_layers=2, guidance_embeds=True) \
            if family == "flux_dev" else ChromaTransformer2DModel(num_layers=2, num_single_layers=2)
    modules = dict(transformer.named_modules())
    targets = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted}
    # q, k, v (and the single blocks' MLP input) split out of each fused layer: 3 / 4 diffusers modules per module
    splits = sum(3 if m.endswith("attn_qkv") else 4 if m.endswith("linear1") else 1
                 for m in {k.split(".")[0] for k in saved})
    assert len(targets) == splits and all(t in modules for t in targets)
    for key, value in converted.items():
        layer = modules[key.removeprefix("transformer.").rsplit(".lora_", 1)[0]]
        wanted = (rank, layer.in_features) if ".lora_A." in key else (layer.out_features, rank)
        assert tuple(value.shape) == wanted, key


@pytest.mark.parametrize("family", ["flux_dev", "z_image"])
def test_a_split_qkv_lora_for_a_fused_qkv_model_is_refused_saying_why(family_objects, two_images, family, tmp_path):
    """ai-toolkit/diffusers FLUX.1 and Z-Image LoRAs put q, k and v on three layers; ComfyUI's models fuse them."""
    from safetensors.torch import save_file
    from trainer.errors import LeanLoRAError
    blocks = "transformer_blocks" if family == "flux_dev" else "layers"
    file = tmp_path / "ai_toolkit.safetensors"
    save_file({f"transformer.{blocks}.0.attn.{p}.lora_{ab}.weight": torch.zeros(4, 8) if ab == "A" else torch.zeros(8, 4)
               for p in ("to_q", "to_k", "to_v") for ab in "AB"}, str(file))
    lora = LoraSettings(rank=4, alpha=4.0, continue_from=str(file))
    with pytest.raises(LeanLoRAError, match=r"puts its LoRA on separate q, k and v projections \(diffusers/ai-toolkit "
                                            r"naming.*one fused layer.*cannot continue this file"):
        train_lora(_adapter(family_objects[family]), two_images, FP32_CHECKPOINTED, lora, TrainSettings(2, 1e-3, 0, "x"),
                   tmp_path, lambda **event: None, lambda: False)


# --- the same through a real server, with the stock loader nodes -------------------------------------------------

@pytest.mark.comfy
@pytest.mark.parametrize("family", DIT)
def test_a_family_trains_through_the_stock_loaders_in_a_real_server(comfy_server, dit_files, family):
    check_trains_through_the_stock_loaders_in_a_real_server(comfy_server, family)


@pytest.mark.comfy
def test_wan_trains_with_samples_of_one_frame_through_the_stock_loaders(comfy_server, dit_files):
    """Train's sample prompts on Wan in a real server: ComfyUI's sampler (the family's uni_pc / simple) renders a
    one-frame latent, the Wan VAE decodes it, and each sample is one 64x64 image."""
    info = comfy_server.object_info()
    prompt = {**loaders("wan"), **training(info, "wan")}
    prompt["7"]["inputs"].update(steps=2, output_name="server_wan_samples", sample_prompts=PROMPT,
                                 sample_every_n_steps=2, sample_size=64, sample_steps=2, sample_cfg=1.0)
    entry = comfy_server.run(prompt, timeout=900)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    report = entry["outputs"]["8"]["text"][0]
    assert "Wan T2V (2 blocks" in report and "each image trains as a one-frame video" in report
    assert "samples every 2 steps: 1 images rendered" in report, report
    [image] = (comfy_server.base_dir / "output" / "leanlora_samples" / "server_wan_samples").glob("step2_0.png")
    with Image.open(image) as png:
        assert png.size == (64, 64) and "uni_pc simple" in png.text["parameters"]


# --- the shipped per-family templates -------------------------------------------------------------------------

@pytest.mark.comfy
@pytest.mark.parametrize("family", DIT)
def test_each_familys_template_is_current_and_trains_then_samples_on_its_models(comfy_server, dit_files, family):
    check_the_template_trains_then_samples(comfy_server, family, family, pinned_version="0.3.75")


def test_flux_dev_trains_each_size_at_the_shift_comfyui_samples_it_with(family_objects):
    """FLUX.1-dev's own table is the 1024² schedule (shift 1.15); ComfyUI's ModelSamplingFlux node samples 512² at
    mu 0.63. The family moves a 512² latent's draws there (and leaves 1024², and a schedule the user set, alone)."""
    import math

    import comfy.model_sampling
    from trainer.objective import TimestepSampling, sample_sigmas
    adapter = _adapter(family_objects["flux_dev"])
    schedule = adapter.model_sampling
    assert isinstance(schedule, comfy.model_sampling.ModelSamplingFlux) and schedule.shift == pytest.approx(1.15)
    assert adapter.resolution_shift((128, 128)) == pytest.approx(1.0)  # 1024²: 4096 tokens
    mu_512 = 0.5 + (1.15 - 0.5) * (1024 - 256) / (4096 - 256)  # ComfyUI's node at 512x512 with its defaults
    assert adapter.resolution_shift((64, 64)) == pytest.approx(math.exp(mu_512 - 1.15))
    # the draws: the node's own schedule at 512² gives the same sigma at the same logit-normal position
    draws = sample_sigmas(schedule, 4096, torch.Generator().manual_seed(0), TimestepSampling.LOGIT_NORMAL,
                          resolution_shift=adapter.resolution_shift((64, 64)))
    position = torch.sigmoid(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
    node = comfy.model_sampling.ModelSamplingFlux()
    node.set_parameters(shift=mu_512)
    assert torch.allclose(draws, node.sigma(position), atol=1e-3)  # the table's 10,000 steps: up to ~3 apart
    unshifted = sample_sigmas(schedule, 4096, torch.Generator().manual_seed(0), TimestepSampling.LOGIT_NORMAL)
    assert draws.mean() < unshifted.mean() - 0.05  # a smaller image: less noise, as sampled
    # uniform: the same draws, moved the same way
    uniform = sample_sigmas(schedule, 4096, torch.Generator().manual_seed(1), TimestepSampling.UNIFORM,
                            resolution_shift=adapter.resolution_shift((64, 64)))
    index = torch.randint(0, len(schedule.sigmas), (4096,), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(uniform, node.sigma((index + 1) / len(schedule.sigmas)), atol=1e-3)
    # a schedule the user set (the node at another size; schnell's 1.0) is trained as it is
    patched = comfy.model_sampling.ModelSamplingFlux()
    patched.set_parameters(shift=0.9)
    assert adapter.family.resolution_shift(patched, (64, 64)) == 1.0
    for family in ("sd15", "z_image", "chroma", "qwen_image", "wan"):  # Chroma: sampled on its own table at every size
        assert _adapter(family_objects[family]).resolution_shift((64, 64)) == 1.0
