"""The family conformance checks (tests/family_checks.py, which tests/test_families.py runs on ComfyUI 0.3.75's
families) over the families only ComfyUI 0.33 loads: each family's tiny model, loaded by the functions 0.33's stock
loaders call (in process) and by the stock loader nodes themselves (a real 0.33 server), trains a LoRA whose units
cover the model's blocks, whose targets exist, whose exact resume equals the uninterrupted run, whose file ComfyUI
applies key for key and `continue_from` reads back, which leaves the base model as it was; fp8 files, samples and
the memory techniques train too, and the family's template trains then samples.

Adding a 0.33 family: its tiny set in scripts/tiny_dit_assets.py (WORKFLOW and builders) and an entry here in
FAMILIES_033. Skipped on ComfyUI 0.3.75 (its loaders know none of these models); scripts/test.sh's 0.33 pass runs
it (marker comfy033)."""
from __future__ import annotations

import pytest
import torch

import comfy.model_base
import comfyui_version
import tiny_assets
import tiny_dit_assets
from family_checks import (adapter, check_a_memory_technique_runs,
                           check_a_quantized_scaled_fp8_file_trains_and_leaves_the_model,
                           check_fp8_weights_as_loaded_train_without_a_16_bit_copy,
                           check_samples_render_with_the_familys_sampler, check_the_template_trains_then_samples,
                           check_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model,
                           check_trains_through_the_stock_loaders_in_a_real_server,
                           check_units_cover_the_blocks_and_every_target_exists)
from trainer.dataset import scan_folder
from trainer.settings import BaseWeights, MemorySettings

pytestmark = pytest.mark.comfy033

# tiny set (scripts/tiny_dit_assets.py WORKFLOW) -> its family: the family class (bridge/families), the ComfyUI 0.33
# model class it trains (comfy.model_base), the empty-latent node ComfyUI's own templates sample it with, and its
# template in scripts/family_templates.py (None until it has one)
FAMILIES_033 = {
    "flux2_klein": {"family": "Flux2", "model": "Flux2", "latent_node": "EmptyFlux2LatentImage",
                    "template": "flux2_klein"},
    "anima": {"family": "Anima", "model": "Anima", "latent_node": "EmptyLatentImage", "template": "anima"},
    "krea2": {"family": "Krea2", "model": "Krea2", "latent_node": "EmptyLatentImage", "template": "krea2"},
    "hunyuan_image": {"family": "HunyuanImage", "model": "HunyuanImage21",
                      "latent_node": "EmptyHunyuanImageLatent", "template": "hunyuan_image"},
}
COMFYUI_033 = tuple(int(part) for part in comfyui_version.__version__.split(".")[:2]) >= (0, 33)
if not COMFYUI_033:
    pytest.skip(f"ComfyUI {comfyui_version.__version__} loads none of these models; they need ComfyUI 0.33 "
                "(scripts/test.sh runs this file on it)", allow_module_level=True)

_OFFLOADED = MemorySettings("bf16", True, base_weights=BaseWeights.FP8, checkpoint_share=0.5, activation_offload=True)
_STREAMED = MemorySettings("bf16", True, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.5, batch_size=2,
                           optimizer="AdamW8bit")


@pytest.fixture(scope="session")
def files_033(comfy_base) -> dict:
    """The tiny sets in the session's ComfyUI folders (models/diffusion_models, text_encoders, vae)."""
    return {tiny_set: tiny_dit_assets.build_family(comfy_base, tiny_set) for tiny_set in FAMILIES_033}


@pytest.fixture(scope="session")
def objects_033(files_033) -> dict:
    """MODEL, CLIP and VAE per tiny set, loaded the way the stock loader nodes load them."""
    return {tiny_set: tiny_dit_assets.load_family(files, tiny_set) for tiny_set, files in files_033.items()}


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    return scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("family_ds"), n=2), 64)


@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_each_model_is_trained_by_its_family_from_the_family_list(objects_033, tiny_set):
    from bridge.families import FAMILIES
    entry = FAMILIES_033[tiny_set]
    model = objects_033[tiny_set][0]
    assert type(model.model) is getattr(comfy.model_base, entry["model"])  # what 0.33's loader built
    names = [type(family).__name__ for family in FAMILIES]
    assert entry["family"] in names and names[-1] == "Generic"
    trainer = adapter(objects_033[tiny_set])
    assert type(trainer.family).__name__ == entry["family"]
    identity = trainer.identity()
    assert identity.prediction == "flow"
    assert identity.recognises(identity.base_model_version) and identity.recognises(identity.architecture)


@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_units_cover_the_blocks_and_every_target_exists(objects_033, tiny_set):
    check_units_cover_the_blocks_and_every_target_exists(objects_033[tiny_set], tiny_set)


@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_a_family_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model(
        objects_033, two_images, tiny_set, tmp_path, caplog):
    check_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model(objects_033[tiny_set], two_images,
                                                                                 tiny_set, tmp_path, caplog)


@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_fp8_weights_as_loaded_train_without_a_16_bit_copy(files_033, objects_033, two_images, tiny_set, tmp_path):
    check_fp8_weights_as_loaded_train_without_a_16_bit_copy(files_033[tiny_set]["unet_name"], objects_033[tiny_set],
                                                            two_images, tiny_set, tmp_path)


@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_a_scaled_fp8_file_loaded_as_quantized_layers_trains_and_leaves_the_model(files_033, objects_033, two_images,
                                                                                  tiny_set, tmp_path, caplog):
    """The fp8 files users download (scaled fp8, each matrix with its scale), which 0.33 loads as comfy_kitchen
    QuantizedTensor layers: training takes their dequantized weights, ComfyUI applies the LoRA key for key, and the
    MODEL stays bit for bit as loaded (0.3.75's scale_weight layers: check_a_scaled_fp8_file_trains_...)."""
    check_a_quantized_scaled_fp8_file_trains_and_leaves_the_model(
        files_033[tiny_set]["unet_name"], objects_033[tiny_set], two_images, tiny_set, tmp_path, caplog)


@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_samples_during_training_render_with_the_familys_sampler(objects_033, tiny_set, tmp_path):
    check_samples_render_with_the_familys_sampler(objects_033[tiny_set], tmp_path)


@pytest.mark.parametrize("memory", [_OFFLOADED, _STREAMED],
                         ids=["fp8-half-checkpointed-offloaded", "streamed-batch2-8bit"])
@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_every_memory_technique_runs_on_each_family(objects_033, two_images, tiny_set, memory, tmp_path):
    check_a_memory_technique_runs(objects_033[tiny_set], two_images, memory, tiny_set, tmp_path)


# --- the same through a real 0.33 server, with the stock loader nodes ----------------------------------------------

@pytest.mark.comfy
@pytest.mark.parametrize("tiny_set", FAMILIES_033)
def test_a_family_trains_through_the_stock_loaders_in_a_real_server(comfy_server, files_033, tiny_set):
    check_trains_through_the_stock_loaders_in_a_real_server(comfy_server, tiny_set,
                                                            FAMILIES_033[tiny_set]["latent_node"])


@pytest.mark.comfy
@pytest.mark.parametrize("tiny_set", [name for name, entry in FAMILIES_033.items() if entry["template"]])
def test_each_familys_template_is_current_and_trains_then_samples_on_its_models(comfy_server, files_033, tiny_set):
    check_the_template_trains_then_samples(comfy_server, tiny_set, FAMILIES_033[tiny_set]["template"],
                                           pinned_version="0.33.0")
