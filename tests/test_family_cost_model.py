"""The DiT families' own cost model (issue 44 item 3): which tokens each block Linear multiplies (a double block's
image and text streams apart, the single blocks' joined sequence, the modulations' one row per image, Z-Image's
refiners on one stream each, Wan's cross-attention keys over the text). It ranks the checkpoint units (memory
freed per recomputed multiply-add) and the streamed layers (multiply-adds per weight byte: with the prefetch ring a
copy runs beside its layer's compute), and the planner's streaming model costs the streamed set from it.

Each check runs the family's tiny model through ComfyUI's own forward and counts the rows every block Linear
really multiplies; the expected orders are derived from those counts and the layers' shapes."""
from __future__ import annotations

import copy

import pytest
import torch

import tiny_dit_assets
from family_checks import PROMPT, adapter as make_adapter
from bridge.cast_weights import stream_costs, streamed_layers
from bridge.families.common import empty_latent
from trainer.memory.planner import HIDING_MACS_PER_BYTE, STREAM_COMPUTE_PASSES, STREAM_COPIES, streaming_time

DIT = ("flux_dev", "chroma", "qwen_image", "z_image", "wan")
LATENT = (16, 16)  # 64 image tokens at 2x2 patches: a multiple of Z-Image's 32-token padding


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    base, cache = tmp_path_factory.mktemp("cost_model_models"), {}

    def load(family: str):
        if family not in cache:
            objects = tiny_dit_assets.load_family(tiny_dit_assets.build_family(base, family), family)
            cache[family] = objects
        return make_adapter(cache[family])
    return load


def measured_rows(adapter, unet) -> tuple[dict[str, int], int]:
    """The rows (tokens per image) each Linear multiplies in one ComfyUI forward at LATENT, and the text tokens the
    blocks see (the caption's, padded as the model pads them)."""
    cond = adapter.encode_text(PROMPT, 8 * LATENT[1], 8 * LATENT[0])
    x = empty_latent(adapter.base.latent_format, *LATENT).normal_(generator=torch.Generator().manual_seed(0))
    rows, hooks = {}, []
    for path, layer in unet.named_modules():
        if isinstance(layer, torch.nn.Linear):
            hooks.append(layer.register_forward_hook(
                lambda module, inputs, output, path=path: rows.__setitem__(path, inputs[0].numel() //
                                                                          inputs[0].shape[-1] // x.shape[0])))
    with torch.no_grad():
        adapter.predict(unet, x, torch.tensor([500.0]), cond)
    for hook in hooks:
        hook.remove()
    pad = getattr(unet, "pad_tokens_multiple", None) or 1
    return rows, -(-cond["c_crossattn"].shape[1] // pad) * pad


def family_at(adapter, text_tokens: int):
    """The adapter's family with the caption's real token count (families hold a nominal one)."""
    family = copy.copy(adapter.family)
    family.text_tokens = text_tokens
    adapter.family = family
    return family


def block_linears(family, unet) -> list[tuple[torch.nn.Module, list[tuple[str, torch.nn.Linear]]]]:
    paths = {id(module): path for path, module in unet.named_modules()}
    return [(unit, [(f"{paths[id(unit)]}.{name}", layer) for name, layer in unit.named_modules()
                    if isinstance(layer, torch.nn.Linear)]) for unit in family.blocks(unet)]


@pytest.mark.parametrize("family_name", DIT)
def test_the_cost_model_counts_the_rows_comfyuis_forward_multiplies_in_every_block_linear(loaded, family_name):
    check_rows(loaded(family_name), family_name)


def check_rows(adapter, family_name: str) -> None:
    unet = adapter.training_unet()
    rows, text = measured_rows(adapter, unet)
    family = family_at(adapter, text)
    modelled = {id(layer): count for layer, count in family.stream_rows(unet, LATENT)}
    for _, linears in block_linears(family, unet):
        for path, layer in linears:
            assert modelled[id(layer)] == rows[path], f"{family_name} {path}"


@pytest.mark.parametrize("family_name", DIT)
def test_checkpoint_units_free_the_most_activation_per_recomputed_multiply_add_first(loaded, family_name):
    check_checkpoint_order(loaded(family_name))


def check_checkpoint_order(adapter) -> None:
    """The order and each unit's (activations freed, multiply-adds recomputed), from the rows measured above and
    the layers' shapes: a FLUX.1 double block's text stream counts its own tokens, a Z-Image context refiner its
    caption's only."""
    unet = adapter.training_unet()
    rows, text = measured_rows(adapter, unet)
    family = family_at(adapter, text)
    costs = {id(unit): (sum(rows[path] * layer.out_features for path, layer in linears),
                        sum(rows[path] * layer.weight.numel() for path, layer in linears))
             for unit, linears in block_linears(family, unet)}
    units = family.blocks(unet)
    expected = sorted(units, key=lambda unit: -costs[id(unit)][0] / max(costs[id(unit)][1], 1))  # stable
    ranked = family.checkpoint_units(unet, latent_size=LATENT)
    assert [id(unit) for unit in ranked] == [id(unit) for unit in expected]
    assert ranked.costs == [costs[id(unit)] for unit in expected]


@pytest.mark.parametrize("family_name", DIT)
def test_the_streamed_layers_are_the_most_multiply_adds_per_weight_byte_first(loaded, family_name):
    check_stream_order(loaded(family_name))


def check_stream_order(adapter) -> None:
    """After the family ranks them, a share streams block Linears in falling rows (multiply-adds per weight
    element), the largest first among equals; layers the family does not rank (embedders, final layer) last."""
    unet = adapter.training_unet()
    rows, text = measured_rows(adapter, unet)
    family_at(adapter, text)
    adapter.rank_streaming(unet, LATENT)
    paths = {id(layer): path for path, layer in unet.named_modules()}
    in_blocks = {path for _, linears in block_linears(adapter.family, unet) for path, _ in linears}
    order = [layer for layer in streamed_layers(unet, 1.0) if isinstance(layer, torch.nn.Linear)]
    keys = [(paths[id(layer)] not in in_blocks, -rows[paths[id(layer)]] if paths[id(layer)] in in_blocks else 0,
             -layer.weight.numel()) for layer in order]
    assert keys == sorted(keys)
    assert {paths[id(layer)] for layer in order} >= in_blocks
    assert [id(layer) for layer in streamed_layers(unet, 0.4)] == [id(layer) for layer in order[:len(
        streamed_layers(unet, 0.4))]]  # a larger share streams a superset, in the same order


@pytest.mark.parametrize("family_name", ("flux_dev", "qwen_image", "z_image"))
def test_the_planner_streams_a_cheaper_set_than_the_largest_layers_at_the_same_share(loaded, family_name):
    check_ranked_streaming_is_cheaper(loaded(family_name))


def check_ranked_streaming_is_cheaper(adapter) -> None:
    """At 1024² (the family's own text tokens), half the weights: the largest-first set takes the modulations (the
    largest Linears of these blocks, one row each: nothing to hide their copy behind), the ranked set the layers
    on the most tokens. The streaming model costs the ranked set less, and a layer whose three passes of compute
    outlast its two copies nearly nothing."""
    unet = adapter.training_unet()
    latent = (128, 128)
    largest_first = streamed_layers(unet, 0.5)  # no ranking yet: the flat order
    adapter.rank_streaming(unet, latent)
    ranked_costs, step_macs = stream_costs(unet, 0.5)
    ranked = streamed_layers(unet, 0.5)
    flat_costs = [(layer.weight.numel(), getattr(layer, "leanlora_stream_rows", 0) * layer.weight.numel())
                  for layer in largest_first]
    assert {id(layer) for layer in ranked} != {id(layer) for layer in largest_first}
    every = sum(size for size, _ in stream_costs(unet, 1.0)[0])
    for chosen in (ranked_costs, flat_costs):  # the same share of the weights either way
        assert 0.5 * every <= sum(size for size, _ in chosen) < every
    ranked_time, flat_time = streaming_time(ranked_costs, step_macs), streaming_time(flat_costs, step_macs)
    assert 0 <= ranked_time < flat_time
    hidden = [(size, macs) for size, macs in ranked_costs
              if STREAM_COMPUTE_PASSES * macs / HIDING_MACS_PER_BYTE >= STREAM_COPIES * size]
    assert hidden and streaming_time(hidden, step_macs) == 0
    assert streaming_time(hidden, step_macs, prefetched=False) > 0  # without the prefetch every copy waits
