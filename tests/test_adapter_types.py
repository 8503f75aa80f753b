"""One conformance test over the adapter types (trainer/lora: ADAPTER_TYPES) x the model families with tiny models
here (the SD1.5 UNet, Z-Image, FLUX.1-dev, Qwen-Image, Wan): inject -> train (the loss on the same draws goes down) ->
export -> ComfyUI's own loader applies every key, to the weights the trained layers compute -> continue_from reads
the file back equal -> an exact resume equals the uninterrupted run -> the user's MODEL is unchanged. Then the
types on fp8 and streamed base weights (the bridge's cast path), and the refusals a user can meet."""
from __future__ import annotations

import dataclasses
import json
import logging
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from test_adapter_math import _expected_lokr_form
from test_families import (DIT, FP32_CHECKPOINTED, _adapter, _base_output, _fingerprint, dit_files,  # noqa: F401
                           family_objects, latent_shape, two_images)
from trainer.errors import LeanLoRAError
from trainer.lora import ADAPTER_TYPES, adapter_type, inject_lora, kohya_state_dict
from trainer.lora.continue_from import check_file, continue_from_file
from trainer.settings import AdapterKind, BaseWeights, LoraSettings, LoraTargets, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX

TYPES = [kind.value for kind in AdapterKind]
FAMILIES = ["sd15", *DIT]
# The keys each type's file holds per module, as LyCORIS writes them and ComfyUI's weight_adapter reads them.
# LoKr's w2 is low-rank where rank 4 is below half its larger side (LyCORIS' rule), else one full matrix: either form
# here, and the conformance test checks each module's form against its layer's sides (_expected_lokr_form).
PARTS = {"lora": [{"lora_down.weight", "lora_up.weight", "alpha"}],
         "dora": [{"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"}],
         "loha": [{"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}],
         "lokr": [{"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"}, {"lokr_w1", "lokr_w2", "alpha"}],
         "oft": [{"oft_blocks", "alpha"}]}
MODULE = {"lycoris.kohya": ("loha", "lokr", "oft"), "networks.lora": ("lora", "dora")}


def _settings(kind: str, **changes) -> LoraSettings:
    return LoraSettings(**{"rank": 4, "alpha": 2.0, "targets": "attention+feed-forward", "type": kind, **changes})


def _run(objects, dataset, folder, steps, name, lora, **train):
    return train_lora(_adapter(objects), dataset, FP32_CHECKPOINTED, lora,
                      TrainSettings(steps, 1e-3, 0, name, "cosine", min(1, steps - 1), **train), folder,
                      lambda **event: None, lambda: False)


def _output(model, family) -> bytes:
    """The base model's prediction on fixed inputs, as ComfyUI's sampler calls it."""
    if family != "sd15":
        return _base_output(model, latent_shape(family))
    state = model.model.diffusion_model.state_dict()
    width = next(v.shape[1] for k, v in state.items() if k.endswith("attn2.to_k.weight"))
    with torch.inference_mode():
        noise = torch.randn((1, 4, 8, 8), generator=torch.Generator().manual_seed(3))
        context = torch.randn(1, 8, width, generator=torch.Generator().manual_seed(4))
        return model.model.apply_model(noise, torch.tensor([0.6]), c_crossattn=context).numpy().tobytes()


def _computed_weights(layers: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """What each adapted layer computes with, read from the layer itself: x W'^T + b on the identity, less b."""
    weights = {}
    with torch.no_grad():
        for path, layer in layers.items():
            base = layer.base_layer
            eye = torch.eye(base.in_features, dtype=base.weight.dtype)
            out = layer(eye) - (base.bias if base.bias is not None else 0)
            weights[path] = out.T.float()
    return weights


def _read_back(objects, lora: LoraSettings):
    """A fresh training copy with `lora` injected and its continue_from file loaded (what Train does)."""
    adapter = _adapter(objects)
    unet = adapter.training_unet()
    presets = {targets: adapter.lora_targets(unet, targets) for targets in LoraTargets}
    inject_lora(unet, lora, 1, presets[lora.targets])  # another seed: only the file can make the weights equal
    continued = continue_from_file(unet, lora, adapter.diffusers_module_names(), adapter.identity(), presets)
    return unet, continued


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", TYPES)
def test_each_type_trains_exports_loads_in_comfyui_continues_and_resumes_exactly_in_each_family(
        family_objects, two_images, family, kind, tmp_path, caplog):  # noqa: F811
    import comfy.lora
    objects = family_objects[family]
    model = objects[0]
    weights_before, output_before = _fingerprint(model), _output(model, family)
    lora = _settings(kind)

    straight = _run(objects, two_images, tmp_path / "straight", 4, f"{family}_{kind}", lora, save_every_steps=2)
    assert len(straight.losses) == 4 and all(np.isfinite(straight.losses))
    assert f"{adapter_type(lora).label} rank 4, alpha 2.0" in straight.report
    state = tmp_path / "straight" / f"{family}_{kind}_step2{STATE_SUFFIX}"
    resumed = _run(objects, two_images, tmp_path / "resumed", 4, f"{family}_{kind}", lora, resume_from=state)
    assert resumed.losses == straight.losses
    assert resumed.lora_path.read_bytes() == straight.lora_path.read_bytes()

    saved = load_file(str(straight.lora_path))
    with safe_open(str(straight.lora_path), "pt") as file:
        metadata = file.metadata()
    modules = {key.split(".", 1)[0] for key in saved}
    assert modules and all(m.startswith("lora_unet_") for m in modules)
    parts = {module: {key.split(".", 1)[1] for key in saved if key.startswith(f"{module}.")} for module in modules}
    assert all(p in PARTS[kind] for p in parts.values()), parts
    assert kind in MODULE[metadata["ss_network_module"]]
    args = json.loads(metadata["ss_network_args"])
    assert args.get("algo") == {"loha": "loha", "lokr": "lokr", "oft": "diag-oft"}.get(kind)
    expected = {"lokr": ("-1", None, None), "dora": (None, "True", None), "oft": (None, None, "2.0")}
    assert (args.get("factor"), args.get("dora_wd"), args.get("constraint")) == expected.get(kind, (None,) * 3)

    # continue_from reads it back equal: a fresh copy (other initial weights) exports exactly the file's tensors
    unet, continued = _read_back(objects, dataclasses.replace(lora, continue_from=str(straight.lora_path)))
    assert continued.modules == len(modules) and continued.steps == 4
    adapter = _adapter(objects)
    if kind == "lokr":  # each module in the form LyCORIS' rule gives its layer's sides, not either form
        names = adapter.kohya_module_names()
        for path, layer in adapter_type(lora).layers(unet).items():
            module = "lora_unet_" + (names[path] if names is not None else path).replace(".", "_")
            assert parts[module] == _expected_lokr_form(layer, lora.rank, lora.factor), module
    again = kohya_state_dict(unet, lora, adapter.kohya_module_names())
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)

    # ComfyUI's loader (what LoraLoader runs) applies every key, to the weights the trained layers compute
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patches = comfy.lora.load_lora(saved, key_map)
        assert "lora key not loaded" not in caplog.text
    assert len(patches) == len(modules)
    trained = _computed_weights(adapter_type(lora).layers(unet))
    base = model.model.diffusion_model.state_dict()
    changed = 0
    for path, weight in trained.items():
        key = f"diffusion_model.{path}.weight"
        original = base[f"{path}.weight"].float()
        applied = comfy.lora.calculate_weight([(1.0, patches[key], 1.0, None, None)], original.clone(), key)
        changed += not torch.equal(applied, original)
        torch.testing.assert_close(applied, weight, rtol=1e-4, atol=1e-5, msg=f"{kind} {path}")
    assert changed > len(trained) // 2  # it learned (a last block's text stream reaches no output: not all)

    # the trained file lowers the loss on the very draws of the first step (same seed: same batch, noise, timesteps)
    continued_run = _run(objects, two_images, tmp_path / "more", 1, f"{family}_{kind}_more",
                         dataclasses.replace(lora, continue_from=str(straight.lora_path)))
    assert continued_run.losses[0] < straight.losses[0]

    assert _fingerprint(model) == weights_before
    assert _output(model, family) == output_before


def test_the_list_is_ordered_most_specific_first():
    assert [kind.kind.value for kind in ADAPTER_TYPES] == ["loha", "lokr", "oft", "dora", "lora"]  # DoRA: lora_down too


_FP8 = MemorySettings("bf16", True, base_weights=BaseWeights.FP8, checkpoint_share=0.5)
_STREAMED = MemorySettings("bf16", True, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.5)


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora", "oft"])
@pytest.mark.parametrize("memory", [_FP8, _STREAMED], ids=["fp8-half-checkpointed", "fp8-streamed"])
def test_each_type_trains_on_fp8_and_streamed_base_weights(family_objects, two_images, kind, memory,  # noqa: F811
                                                          tmp_path):
    lora = _settings(kind, dropout=0.1)  # step-seeded dropout through the recompute too
    outcome = train_lora(_adapter(family_objects["z_image"]), two_images, memory, lora,
                         TrainSettings(2, 1e-3, 0, f"fp8_{kind}"), tmp_path, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses)) and not outcome.run.recoveries
    assert "frozen weights stored as fp8" in outcome.report
    assert {key.split(".", 1)[1] for key in load_file(str(outcome.lora_path))} in PARTS[kind]


@pytest.mark.parametrize("stream", [False, True], ids=["fp8", "fp8-streamed"])
def test_dora_normalises_with_the_weight_as_computed_not_the_fp8_storage(family_objects, stream):  # noqa: F811
    """A fresh DoRA layer computes what its base layer computes (its magnitude is the weight's norm): also on fp8
    storage, whose numbers are the weight divided by its scale, and on a weight streamed in CPU RAM."""
    from bridge.cast_weights import store_weights_fp8, stream_weights_from_cpu
    adapter = _adapter(family_objects["z_image"])
    unet = adapter.training_unet()
    lora = _settings("dora")
    inject_lora(unet, lora, 0, adapter.lora_targets(unet, lora.targets))
    store_weights_fp8(unet)
    if stream:
        stream_weights_from_cpu(unet)
    layers = adapter_type(lora).layers(unet)
    assert layers and all(layer.base_layer.weight.dtype == torch.float8_e4m3fn for layer in layers.values())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for path, layer in layers.items():
            x = torch.randn(2, 3, layer.in_features, generator=generator)
            base, adapted = layer.base_layer(x), layer(x)
            # the magnitude is the norm of the weight before fp8: fp8's rounding moves the norm a little; the
            # stored numbers (the weight / its scale, ~448 / max) would shrink the output a hundredfold
            assert float((adapted - base).norm() / base.norm()) < 0.05, path


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora", "oft"])
def test_each_type_computes_with_bf16_lora_weights_under_autocast(kind):
    """LoRA weights 'bf16 + stochastic rounding' (optimizers.BF16Weights) makes the adapter's parameters bf16 views;
    each type's forward and backward take them under bf16 autocast (on a CPU without bf16 the trainer falls back
    to fp32, so this is checked here on its own)."""
    from helpers import TinyNet, sd_targets
    net = TinyNet()
    lora = _settings(kind, targets="attention")
    params = inject_lora(net, lora, 0, sd_targets(lora))
    for p in params:
        p.data = p.data.bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        out = net(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)))
    out.float().square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in params)


# --- what a user can get wrong ---

def _trained_file(tmp_path, kind: str) -> str:
    """A small file of `kind` as the trainer writes it, on the tiny SD-shaped nets of helpers.py."""
    from helpers import TinyNet, sd_targets
    net = TinyNet()
    lora = _settings(kind, targets="attention")
    inject_lora(net, lora, 0, sd_targets(lora))
    path = tmp_path / f"{kind}.safetensors"
    save_file(kohya_state_dict(net, lora), str(path))
    return str(path)


@pytest.mark.parametrize("file_kind, config_kind", [("loha", "lora"), ("lora", "dora"), ("dora", "lora"),
                                                    ("lokr", "loha"), ("oft", "lokr"), ("lora", "oft")])
def test_continue_from_refuses_another_type_naming_the_file_and_the_field(tmp_path, file_kind, config_kind):
    path = _trained_file(tmp_path, file_kind)
    label = {"lora": "LoRA", "loha": "LoHa", "lokr": "LoKr", "dora": "DoRA", "oft": "OFT"}[file_kind]
    with pytest.raises(LeanLoRAError, match=rf"continue_from '{file_kind}.safetensors' is a {label} file .*LoRA "
                                            rf"Config's type says {config_kind}: set type to {file_kind}"):
        check_file(_settings(config_kind, targets="attention", continue_from=path))


def test_a_lokr_file_of_another_factor_is_refused_naming_the_factor(tmp_path):
    from helpers import TinyNet, sd_targets
    path = _trained_file(tmp_path, "lokr")
    net = TinyNet()
    lora = _settings("lokr", targets="attention", factor=2, continue_from=path)
    inject_lora(net, lora, 0, sd_targets(lora))
    with pytest.raises(LeanLoRAError, match=r"does not fit this model: its lokr_w1 has shape \(4, 4\), and this layer "
                                            r"needs \(2, 2\)\. .*set LoRA Config's factor and rank as the file was "
                                            r"trained"):
        continue_from_file(net, lora, None, _identity())


def test_a_dora_file_with_its_magnitude_per_output_is_refused_saying_why(tmp_path):
    from helpers import TinyNet, sd_targets
    path = _trained_file(tmp_path, "dora")
    tensors = load_file(path)
    tensors = {k: (v.reshape(-1, 1) if k.endswith("dora_scale") else v) for k, v in tensors.items()}  # (16, 1)
    save_file(tensors, path)
    net = TinyNet()
    lora = _settings("dora", targets="attention", continue_from=path)
    inject_lora(net, lora, 0, sd_targets(lora))
    with pytest.raises(LeanLoRAError, match=r"DoRA magnitude on the output axis \(LyCORIS' wd_on_out"):
        continue_from_file(net, lora, None, _identity())


@pytest.mark.parametrize("rank, blocks", [(4, (6, 4, 4)), (3, (8, 3, 3)), (5, (6, 4, 4)), (16, (6, 4, 4))])
def test_oft_computes_what_comfyuis_loader_applies_with_its_constraint_and_bias(rank, blocks):
    """Blocks far from zero, so the constraint (alpha: the largest norm of Q, as ComfyUI applies it) scales Q down,
    on a Linear with a bias: the layer's weight (its output less the bias) is ComfyUI's W + (R^T - I) W, and a
    fresh layer is the base layer. `rank` splits the output width (24) as LyCORIS' factorisation does: blocks of
    rank rows where rank divides it and rank^2 does not exceed it, else of a divisor at most rank and sqrt(24)."""
    from comfy.weight_adapter.oft import OFTAdapter
    from trainer.lora.oft import OftLinear
    base = torch.nn.Linear(12, 24)
    layer = OftLinear(base, torch.nn.Identity(), rank, alpha=0.5)
    assert tuple(layer.oft_blocks.shape) == blocks
    eye = torch.eye(12)
    with torch.no_grad():
        torch.testing.assert_close(layer(eye), base(eye))  # zero blocks: R = I
        layer.oft_blocks.copy_(torch.randn(blocks, generator=torch.Generator().manual_seed(0)))
        q = layer.oft_blocks - layer.oft_blocks.transpose(1, 2)
        assert float(q.norm()) > 4 * layer.constraint  # the constraint acts
        trained = (layer(eye) - base.bias).T
    adapter = OFTAdapter.load("x", {"x.oft_blocks": layer.oft_blocks.detach().clone()}, 0.5, None)
    applied = adapter.calculate_weight(base.weight.detach().clone(), "x", 1.0, 1.0, None, lambda w: w)
    torch.testing.assert_close(trained, applied, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(applied, base.weight)


def test_oft_dropout_drops_the_rotations_input_and_leaves_the_base_output(tmp_path):
    """With dropout the rotation's input (the base output less its bias) is dropped, never the base path: at
    evaluation (no dropout) the same layer computes the exported weight."""
    from trainer.lora.dropout import step_seeded_dropouts
    from trainer.lora.oft import OftLinear
    base = torch.nn.Linear(8, 16)
    layer = OftLinear(base, step_seeded_dropouts(0.5, 1)[0], 4, alpha=4.0)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        layer.oft_blocks.normal_(generator=torch.Generator().manual_seed(2))
        layer.eval()
        clean = layer(x)
        layer.train()
        dropped = layer(x)
    assert not torch.allclose(clean, dropped)
    zero = OftLinear(base, step_seeded_dropouts(0.5, 1)[0], 4, alpha=4.0)
    with torch.no_grad():
        torch.testing.assert_close(zero(x), base(x))  # R = I: nothing to drop


def test_oft_refuses_blocks_of_one_naming_the_rank():
    from helpers import TinyNet, sd_targets
    lora = _settings("oft", targets="attention", rank=1)
    with pytest.raises(LeanLoRAError, match=r"LoRA Config's rank 1: OFT splits .* gets blocks of 1, which cannot "
                                            r"rotate: set rank to 2 or more"):
        inject_lora(TinyNet(), lora, 0, sd_targets(lora))


def test_an_oft_file_of_another_alpha_or_with_rescale_is_refused_naming_it(tmp_path):
    from helpers import TinyNet, sd_targets
    path = _trained_file(tmp_path, "oft")
    net = TinyNet()
    lora = _settings("oft", targets="attention", alpha=3.0, continue_from=path)
    inject_lora(net, lora, 0, sd_targets(lora))
    with pytest.raises(LeanLoRAError, match=r"has alpha 2 \(OFT's constraint\); LoRA Config says alpha 3: set alpha "
                                            r"to 2"):
        continue_from_file(net, lora, None, _identity())
    tensors = load_file(path)
    module = next(k for k in tensors if k.endswith(".oft_blocks")).rsplit(".", 1)[0]
    save_file({**tensors, f"{module}.rescale": torch.ones(16, 1)}, path)
    with pytest.raises(LeanLoRAError, match=r"holds OFT rescale \(LyCORIS' rescaled\) weights"):
        check_file(_settings("oft", targets="attention", continue_from=path))


def _identity():
    from trainer.model import FamilyIdentity
    return FamilyIdentity("SD1.x", "sd_v1", "stable-diffusion-v1", "diffusers")


def test_lora_config_refuses_a_bad_factor_and_an_unknown_type():
    with pytest.raises(LeanLoRAError, match=r"factor: got 0; use -1"):
        _settings("lokr", factor=0)
    with pytest.raises(LeanLoRAError, match=r"type: got 'boft'; choose one of lora, loha, lokr, dora, oft"):
        _settings("boft")


def test_a_resume_with_another_type_is_refused_naming_both(family_objects, two_images, tmp_path):  # noqa: F811
    objects = family_objects["z_image"]
    _run(objects, two_images, tmp_path, 2, "typed", _settings("loha"), save_every_steps=1)
    state = tmp_path / f"typed_step1{STATE_SUFFIX}"
    with pytest.raises(LeanLoRAError, match=re.escape(f"cannot resume from typed_step1{STATE_SUFFIX}")
                       + r": it trained a loha adapter, and LoRA Config's type says lokr: set type to loha"):
        _run(objects, two_images, tmp_path / "other", 2, "typed", _settings("lokr"), resume_from=state)

