"""tests/test_family_cost_model.py's checks for DiT families only ComfyUI 0.33 loads:
FLUX.2 klein (no per-block modulation, bias-free layers) and HunyuanImage 2.1 (FLUX.1's blocks with their
modulations, 1x1 patches), and Anima (Cosmos-Predict2's blocks: cross-attention over the text, adaLN-LoRA
modulations). Skipped on 0.3.75; scripts/test.sh's 0.33 pass runs them."""
from __future__ import annotations

import comfyui_version
import pytest

from test_family_cost_model import (check_checkpoint_order, check_ranked_streaming_is_cheaper, check_rows,
                                    check_stream_order, loaded)  # noqa: F401  (loaded: the module's fixture)

pytestmark = [pytest.mark.comfy033, pytest.mark.skipif(
    tuple(int(part) for part in comfyui_version.__version__.split(".")[:2]) < (0, 33),
    reason="FLUX.2 klein and HunyuanImage 2.1's tiny sets load on ComfyUI 0.33 (scripts/test.sh runs this file on it)")]
FAMILIES = ("flux2_klein", "hunyuan_image", "anima", "krea2")


@pytest.mark.parametrize("family_name", FAMILIES)
def test_the_cost_model_counts_the_rows_comfyuis_forward_multiplies_in_every_block_linear(loaded, family_name):
    check_rows(loaded(family_name), family_name)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_checkpoint_units_free_the_most_activation_per_recomputed_multiply_add_first(loaded, family_name):
    check_checkpoint_order(loaded(family_name))


@pytest.mark.parametrize("family_name", FAMILIES)
def test_the_streamed_layers_are_the_most_multiply_adds_per_weight_byte_first(loaded, family_name):
    check_stream_order(loaded(family_name))


def test_the_planner_streams_a_cheaper_set_than_the_largest_layers_on_hunyuan_image(loaded):
    check_ranked_streaming_is_cheaper(loaded("hunyuan_image"))
