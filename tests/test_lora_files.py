"""LoRA files as other tools read them (issue 15, items 8 and 9), offline.

Naming: kohya names SD1.x LoRA modules as in a diffusers UNet (networks/lora.py create_network walks the diffusers
UNet for its target class Transformer2DModel and wraps each Linear / 1x1 Conv2d in it as
`lora_unet_<path with _>`), SDXL modules as in the ldm UNet (sdxl_original_unet, where that class sits at
`input_blocks.4.1`...). The expected names below are derived the same way from the models, never from our code:
SD1.x by walking a diffusers UNet2DConditionModel built from the real SD1.5 block structure, SDXL by walking
ComfyUI's ldm UNet built from the real SDXL block structure (kohya's sdxl_original_unet has that layout; its
Transformer2DModel is where ComfyUI's SpatialTransformer is). Channel counts are tiny so CPU builds are quick;
block types, layers per block and transformer depths are SD1.5's and SDXL's, so the module names are the real ones.

Loading: the files go through ComfyUI's own LoRA loader (every key applied, none logged as not loaded), our Apply
LoRA node, and diffusers' `load_lora_weights` on real pipelines around those UNets."""
import copy
import functools
import json
import logging
import re
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import comfy.lora
import comfy.model_patcher
import comfy.supported_models

from bridge.comfy_adapter import ComfyAdapter, apply_lora
from bridge.families.sd_unet import SdUnet
from trainer.dataset import scan_folder
from trainer.lora import inject_lora, kohya_state_dict
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from helpers import sd_targets  # noqa: E402

diffusers = pytest.importorskip("diffusers")  # a test dependency only (requirements-dev.txt)
transformers = pytest.importorskip("transformers")

LORA = LoraSettings(rank=4, alpha=2.0, targets="attention+feed-forward")

# ComfyUI (ldm) UNet configs: SD1.5's and SDXL's real block structure, tiny widths.
SD15_LDM = dict(image_size=32, use_spatial_transformer=True, legacy=False, adm_in_channels=None, in_channels=4,
                out_channels=4, model_channels=32, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 2, 2],
                transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], transformer_depth_middle=1,
                use_linear_in_transformer=False, context_dim=32, use_temporal_resblock=False,
                use_temporal_attention=False)
SDXL_LDM = dict(image_size=32, use_spatial_transformer=True, legacy=False, adm_in_channels=2816, in_channels=4,
                out_channels=4, model_channels=64, num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4],
                transformer_depth=[0, 0, 2, 2, 10, 10], transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10],
                transformer_depth_middle=10, use_linear_in_transformer=True, context_dim=64,
                use_temporal_resblock=False, use_temporal_attention=False)
# The same structures as diffusers configs (SD1.5's and SDXL's unet/config.json with tiny widths).
SD15_DIFFUSERS = dict(sample_size=8, layers_per_block=2, block_out_channels=(32, 64, 64, 64),
                      down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                      up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                      cross_attention_dim=32, attention_head_dim=8)
SDXL_DIFFUSERS = dict(sample_size=8, layers_per_block=2, block_out_channels=(64, 128, 256),
                      down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                      up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                      transformer_layers_per_block=(1, 2, 10), attention_head_dim=(1, 2, 4), cross_attention_dim=64,
                      use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                      projection_class_embeddings_input_dim=2816)


@functools.lru_cache(maxsize=None)
def _comfy_model(family: str):
    """A real ComfyUI model (BaseModel / SDXL) of that structure, as its checkpoint loader would build it."""
    if family == "sd15":
        config = comfy.supported_models.SD15(dict(SD15_LDM))
    else:
        config = comfy.supported_models.SDXL(dict(SDXL_LDM))
        config.unet_config["num_head_channels"] = 64  # SDXL's head width; the tiny widths are multiples of it
    with torch.device("cpu"):
        return config.get_model({}, device="cpu")


def _kohya_unet_modules(model: torch.nn.Module, target_class: str) -> set[str]:
    """kohya's create_modules: every Linear / 1x1 Conv2d inside each module of the target class."""
    names = set()
    for name, module in model.named_modules():
        if type(module).__name__ != target_class:
            continue
        for child_name, child in module.named_modules():
            if isinstance(child, torch.nn.Linear) or (isinstance(child, torch.nn.Conv2d) and child.kernel_size == (1, 1)):
                names.add("lora_unet_" + f"{name}.{child_name}".replace(".", "_"))
    return names


def _modules_in(state_dict) -> set[str]:
    return {key.split(".", 1)[0] for key in state_dict}


@functools.lru_cache(maxsize=None)  # the SDXL structure takes seconds to build and export on a CPU; tests only read
def _trained_export(model, family: str, module_names="adapter", seed=0) -> tuple[dict, set[str]]:
    """A LoRA on a training copy of `model` with non-zero up weights (so applying it changes the weights),
    exported in kohya form; also returns the ldm paths of the LoRA'd modules."""
    unet = copy.deepcopy(model.diffusion_model).float()
    for p in unet.parameters():  # ComfyUI leaves weights uninitialised (its loader fills them)
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.zeros_(p)
    params = inject_lora(unet, LORA, seed, target_modules=sd_targets(LORA))
    generator = torch.Generator().manual_seed(seed)
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=generator) * 0.1
    assert params
    ldm_paths = {name.rsplit(".lora_A", 1)[0] for name, _ in unet.named_parameters() if ".lora_A." in name}
    names = SdUnet().kohya_module_names(model) if module_names == "adapter" else module_names
    return kohya_state_dict(unet, LORA, names), ldm_paths


def _comfy_loads_every_key(model, lora_sd, ldm_paths, caplog):
    """ComfyUI's own loader (what LoraLoader runs): every key maps to the weight it was trained on."""
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patches = comfy.lora.load_lora(lora_sd, key_map)
        assert "lora key not loaded" not in caplog.text
    assert set(patches) == {f"diffusion_model.{path}.weight" for path in ldm_paths}


def _diffusers_pipeline(family: str):
    from diffusers import (AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline,
                           UNet2DConditionModel)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    torch.manual_seed(0)
    text = CLIPTextConfig(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                          vocab_size=1000, projection_dim=32)
    vae = AutoencoderKL(block_out_channels=(32,), down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=32)
    if family == "sd15":
        return StableDiffusionPipeline(vae=vae, text_encoder=CLIPTextModel(text), tokenizer=None,
                                       unet=UNet2DConditionModel(**SD15_DIFFUSERS), scheduler=DDPMScheduler(),
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return StableDiffusionXLPipeline(vae=vae, text_encoder=CLIPTextModel(text),
                                     text_encoder_2=CLIPTextModelWithProjection(text), tokenizer=None,
                                     tokenizer_2=None, unet=UNet2DConditionModel(**SDXL_DIFFUSERS),
                                     scheduler=DDPMScheduler())


def _diffusers_lora_weights(unet) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict
    return get_peft_model_state_dict(unet, adapter_name="ours")


def _lora_layers(unet) -> set[str]:
    return {name for name, module in unet.named_modules() if hasattr(module, "lora_A") and len(module.lora_A)}


# --- (c) names: only modules kohya's networks create, in kohya's naming per family ---

def test_sd15_files_use_kohya_diffusers_style_names():
    from diffusers import UNet2DConditionModel
    expected = _kohya_unet_modules(UNet2DConditionModel(**SD15_DIFFUSERS), "Transformer2DModel")
    lora_sd, ldm_paths = _trained_export(_comfy_model("sd15"), "sd15")
    names = _modules_in(lora_sd)
    assert names <= expected, sorted(names - expected)[:5]
    # every module the targets name is there (to_q/k/v/out, feed-forward), in each of the 16 transformer blocks
    targeted = {n for n in expected if re.search(r"_(to_q|to_k|to_v|to_out_0|ff_net_0_proj|ff_net_2)$", n)}
    assert names == targeted and len(names) == len(ldm_paths) == 16 * 10  # SD1.5: 16 transformer blocks
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in names
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0" in names
    assert "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_ff_net_2" in names
    assert not any(n.startswith(("lora_unet_input_blocks", "lora_unet_output_blocks", "lora_unet_middle_block"))
                   for n in names)


def test_sdxl_files_keep_kohya_ldm_style_names():
    from diffusers import UNet2DConditionModel
    model = _comfy_model("sdxl")
    expected = _kohya_unet_modules(model.diffusion_model, "SpatialTransformer")
    # the ldm structure has exactly the transformer modules of the diffusers SDXL UNet (same count)
    assert len(expected) == len(_kohya_unet_modules(UNet2DConditionModel(**SDXL_DIFFUSERS), "Transformer2DModel"))
    lora_sd, ldm_paths = _trained_export(model, "sdxl")
    names = _modules_in(lora_sd)
    assert names <= expected and len(names) == len(ldm_paths)
    assert names == {"lora_unet_" + p.replace(".", "_") for p in ldm_paths}
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q" in names
    assert "lora_unet_middle_block_1_transformer_blocks_9_ff_net_2" in names
    assert "lora_unet_output_blocks_2_1_transformer_blocks_9_attn2_to_k" in names


# --- (a) ComfyUI's loader and our Apply LoRA node: every key applied, old ldm-style SD1.5 files too ---

@pytest.mark.parametrize("family,naming", [("sd15", "adapter"), ("sd15", None), ("sdxl", "adapter")],
                         ids=["sd15-kohya", "sd15-old-ldm-names", "sdxl"])
def test_comfyui_and_apply_lora_apply_every_key(family, naming, caplog):
    model = _comfy_model(family)
    lora_sd, ldm_paths = _trained_export(model, family, module_names=naming)
    _comfy_loads_every_key(model, lora_sd, ldm_paths, caplog)
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = apply_lora(patcher, None, lora_sd, 1.0, 0.0)
        assert "NOT LOADED" not in caplog.text and "lora key not loaded" not in caplog.text
    assert {k for k, v in patched.patches.items() if v} == {f"diffusion_model.{p}.weight" for p in ldm_paths}


# --- (b) diffusers' load_lora_weights on SD1.5 and SDXL pipelines ---

@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_diffusers_load_lora_weights_applies_every_module(family):
    lora_sd, ldm_paths = _trained_export(_comfy_model(family), family)
    pipe = _diffusers_pipeline(family)
    pipe.load_lora_weights(dict(lora_sd), adapter_name="ours")
    assert len(_lora_layers(pipe.unet)) == len(ldm_paths)
    if family == "sd15":
        # the modules diffusers put them on are the right ones: diffusers' own ldm -> diffusers conversion of the
        # same LoRA with ldm names gives the same weights on the same modules
        ldm_sd, _ = _trained_export(_comfy_model(family), family, module_names=None)
        reference = _diffusers_pipeline(family)
        ldm_state, alphas = reference.lora_state_dict(dict(ldm_sd), unet_config=reference.unet.config)
        reference.load_lora_into_unet(ldm_state, network_alphas=alphas, unet=reference.unet, adapter_name="ours")
        ours, theirs = _diffusers_lora_weights(pipe.unet), _diffusers_lora_weights(reference.unet)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        # and the check can fail: the ldm names the pack wrote for SD1.5 before match no diffusers module
        from peft.utils.error import NoMatchingPeftModuleError
        with pytest.raises(NoMatchingPeftModuleError):
            _diffusers_pipeline(family).load_lora_weights(dict(ldm_sd), adapter_name="old")
    lora_down = next(v for k, v in lora_sd.items() if k.endswith("lora_down.weight"))
    scaling = {m.scaling["ours"] for _, m in pipe.unet.named_modules() if hasattr(m, "scaling") and "ours" in m.scaling}
    assert scaling == {LORA.alpha / lora_down.shape[0]}  # alpha / rank, from the file's alpha


# --- the real product path: the Train node's train_lora on the tiny SD1.5 checkpoint, then the file ---

@pytest.fixture(scope="module")
def trained_file(tmp_path_factory, comfy_objects):
    import tiny_assets
    folder = tmp_path_factory.mktemp("tagged") / "10_my subject"
    tiny_assets.build_tiny_dataset(folder, n=2)
    captions = sorted(folder.glob("*.txt"))
    captions[0].write_text("Red Ball, studio, red ball")
    captions[1].write_text("studio,  blue sky , ")
    dataset = scan_folder(folder, 64, repeats=3, trigger_word="zxq")
    out = tmp_path_factory.mktemp("loras")
    outcome = train_lora(ComfyAdapter(*comfy_objects), dataset, MemorySettings("no", False), LORA,
                         TrainSettings(3, 1e-3, 7, "kohya file", warmup_steps=1), out, lambda **e: None, lambda: False)
    return outcome.lora_path, comfy_objects


def test_trained_sd15_file_loads_everywhere_with_every_key(trained_file, caplog):
    path, (model, clip, _vae) = trained_file
    lora_sd = load_file(str(path))
    assert all(k.startswith("lora_unet_down_blocks_") or k.startswith(("lora_unet_mid_block_", "lora_unet_up_blocks_"))
               for k in lora_sd)
    mapped = SdUnet().kohya_module_names(model.model)
    ldm_paths = {ldm for ldm, diffusers_path in mapped.items()
                 if "lora_unet_" + diffusers_path.replace(".", "_") in _modules_in(lora_sd)}
    assert len(ldm_paths) == len(_modules_in(lora_sd))
    _comfy_loads_every_key(model.model, lora_sd, ldm_paths, caplog)
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        apply_lora(model, clip, lora_sd, 1.0, 1.0)
        assert "NOT LOADED" not in caplog.text and "lora key not loaded" not in caplog.text


def _addnet_hashes(path) -> tuple[str, str]:
    """sd-webui additional-networks' hashes of a file (the payload after the header; 64 KiB at 1 MiB)."""
    data = path.read_bytes()
    import hashlib
    header_end = 8 + int.from_bytes(data[:8], "little")
    return hashlib.sha256(data[header_end:]).hexdigest(), hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]


def test_trained_file_metadata_is_kohyas(trained_file):
    path, _ = trained_file
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_v2"] == "False"
    assert meta["ss_network_module"] == "networks.lora"
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "2.0"  # the real alpha, not the rank
    assert json.loads(meta["ss_network_args"])["targets"] == "attention+feed-forward"
    assert meta["ss_resolution"] == "(64, 64)"
    assert meta["ss_output_name"] == "kohya file" == path.stem
    assert json.loads(meta["ss_tag_frequency"]) == {"10_my subject": {"zxq": 2, "red ball": 2, "studio": 2,
                                                                       "blue sky": 1}}
    assert meta["ss_steps"] == "3" and meta["ss_seed"] == "7" and meta["ss_lr_warmup_steps"] == "1"
    assert meta["modelspec.sai_model_spec"] == "1.0.0"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert meta["modelspec.implementation"] == "diffusers"
    assert meta["modelspec.title"] == "kohya file" and meta["modelspec.resolution"] == "64x64"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", meta["modelspec.date"])
    assert meta["modelspec.prediction_type"] == "epsilon"
    model_hash, _ = _addnet_hashes(path)
    assert meta["sshs_model_hash"] == model_hash  # what additional-networks computes from the file
    # kohya's legacy hash: over the file as serialized with the ss_ metadata only (smaller than 1 MiB: empty slice)
    assert meta["sshs_legacy_hash"] == "e3b0c442" and path.stat().st_size < 0x100000


def test_hash_covers_the_weights_and_legacy_hash_reads_1mib_in(tmp_path):
    from trainer.files import save_safetensors_atomic
    from trainer.lora import with_file_hashes
    big = {"lora_unet_x.lora_down.weight": torch.arange(400_000, dtype=torch.float32).reshape(4, -1)}
    meta = with_file_hashes(big, {"ss_network_dim": "4", "modelspec.title": "x"})
    path = save_safetensors_atomic(big, tmp_path / "big.safetensors", {"ss_network_dim": "4"})
    assert (meta["sshs_model_hash"], meta["sshs_legacy_hash"]) == _addnet_hashes(path)
    changed = with_file_hashes({k: v + 1 for k, v in big.items()}, {"ss_network_dim": "4"})
    assert changed["sshs_model_hash"] != meta["sshs_model_hash"]
    assert changed["sshs_legacy_hash"] != meta["sshs_legacy_hash"]


def test_sdxl_and_v_prediction_metadata():
    from trainer.lora import lora_metadata
    sdxl_model = _comfy_model("sdxl")
    kind = SdUnet().identity(sdxl_model, sdxl_model.model_sampling)
    assert (kind.name, kind.prediction, kind.v2) == ("SDXL", "epsilon", False)
    meta = lora_metadata(LORA, kind, target_modules=(), output_name="x", resolution=(1024, 1024), tags={}, extra={},
                         timestamp=0)
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0" and meta["ss_v2"] == "False"
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert meta["ss_resolution"] == "(1024, 1024)" and meta["modelspec.resolution"] == "1024x1024"
    import comfy.model_sampling
    sd15 = _comfy_model("sd15")

    class VPrediction(comfy.model_sampling.ModelSamplingDiscrete, comfy.model_sampling.V_PREDICTION):
        pass  # what ComfyUI's ModelSamplingDiscrete node patches onto a MODEL for sampling="v_prediction"
    v_kind = SdUnet().identity(sd15, VPrediction(sd15.model_config))
    assert (v_kind.name, v_kind.prediction) == ("SD1.x", "v")
    v_meta = lora_metadata(LORA, v_kind, target_modules=(), output_name="x", resolution=(512, 512), tags={},
                           extra={}, timestamp=0)
    assert v_meta["ss_base_model_version"] == "sd_v1_v" and v_meta["modelspec.prediction_type"] == "v"
    assert v_meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
