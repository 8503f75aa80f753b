"""The adapter types' arithmetic on small layers, in seconds (issue 41, item 6):

- the hand-written backward passes (LoHa's _HadaWeight, the bridge's _ScaledLinear fp8 GEMM) against autograd's
  numerical gradients (torch.autograd.gradcheck, float64);
- every form a type's file can hold (LoKr's full w2 and its low-rank w2_a/w2_b, with and without a factor; LoHa;
  OFT; DoRA; LoRA), at a rank where each form occurs, applied by ComfyUI's own loader (comfy.lora.load_lora +
  calculate_weight, what LoraLoader runs) gives the weight the trained layer computes with, number for number;
  and the type's own reading (continue_from's `load`) gives back the same layer.

Every adapter parameter is set to random values first: a freshly initialised adapter has a zero factor, so its
difference is zero whatever the formula."""
from __future__ import annotations

import logging

import pytest
import torch

from trainer.lora import adapter_type, inject_lora, kohya_state_dict
from trainer.lora.lokr import factorization
from trainer.settings import LoraSettings

# --- 4. hand-written backward passes against autograd ---------------------------------------------------------------


def test_lohas_hand_written_backward_is_autograds_gradient():
    """_HadaWeight: (w1_a w1_b) * (w2_a w2_b) * scale, its backward written by hand (it recomputes the products)."""
    from trainer.lora.loha import _HadaWeight
    generator = torch.Generator().manual_seed(0)
    factors = [torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
               for shape in [(5, 3), (3, 4), (5, 3), (3, 4)]]
    assert torch.autograd.gradcheck(lambda *f: _HadaWeight.apply(*f, 0.7), factors)
    # the forward is the formula (gradcheck alone would pass a function and its consistent wrong gradient)
    w1a, w1b, w2a, w2b = factors
    torch.testing.assert_close(_HadaWeight.apply(*factors, 0.7), (w1a @ w1b) * (w2a @ w2b) * 0.7)


def test_a_loha_layers_gradients_are_autograds_through_the_whole_layer():
    """The LoHa layer as training runs it (input through the base layer and the adapter), float64: the gradient of
    every factor and of the input."""
    from trainer.lora.loha import LohaLinear
    torch.manual_seed(0)
    layer = LohaLinear(torch.nn.Linear(6, 4).double(), torch.nn.Identity(), rank=2, alpha=3.0).double()
    for part in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"):
        getattr(layer, part).data.normal_()
    layer.base_layer.requires_grad_(False)
    params = [layer.hada_w1_a, layer.hada_w1_b, layer.hada_w2_a, layer.hada_w2_b]
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    factors = [p.detach().clone().requires_grad_(True) for p in params]
    # gradcheck perturbs its own inputs: the factors go in as inputs, the layer's formula computes with them
    assert torch.autograd.gradcheck(lambda x, *f: _through(layer, x, f), (x, *factors))
    torch.testing.assert_close(_through(layer, x, factors), layer(x))  # _through is what the layer computes


def _through(layer, x, factors):
    """layer(x) with its LoHa factors replaced by `factors` (tensors gradcheck perturbs)."""
    from trainer.lora.loha import _HadaWeight
    delta = _HadaWeight.apply(*factors, layer.scale)
    return layer.base_layer(x) + torch.nn.functional.linear(x, delta)


@pytest.mark.parametrize("with_stored", [False, True], ids=["upcast-weight", "fp8-stored"])
def test_the_scaled_fp8_gemms_hand_written_backward_is_autograds_gradient(with_stored):
    """bridge/cast_weights._ScaledLinear: input @ weight.T * scale + bias with a hand-written backward (the weight
    frozen). With `stored`, backward upcasts the fp8 tensor again: the same gradient."""
    from bridge.cast_weights import _ScaledLinear
    generator = torch.Generator().manual_seed(1)
    stored = (torch.randn(4, 5, generator=generator) * 8).to(torch.float8_e4m3fn)
    weight = stored.to(torch.float64)  # exact
    x = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, generator=generator, dtype=torch.float64, requires_grad=True)
    keep = stored if with_stored else None
    assert torch.autograd.gradcheck(lambda x, b: _ScaledLinear.apply(x, weight, b, 0.37, keep), (x, bias))
    assert torch.autograd.gradcheck(lambda x: _ScaledLinear.apply(x, weight, None, 0.37, keep), (x,))
    torch.testing.assert_close(_ScaledLinear.apply(x, weight, bias, 0.37, keep),
                               torch.nn.functional.linear(x, weight * 0.37, bias))


# --- 5. every file form against ComfyUI's loader --------------------------------------------------------------------

class _Net(torch.nn.Module):
    """Layers whose sides give each form: LoKr splits 64 x 48 into (8, 8) x (6, 8) (w2 8 x 8: low-rank below rank
    4) and 16 x 16 into (4, 4) x (4, 4) (w2 4 x 4: low-rank below rank 2), so rank 3 writes both forms."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(48, 64)
        self.narrow = torch.nn.Linear(16, 16)
        self.no_bias = torch.nn.Linear(16, 48, bias=False)


def _randomised(net: torch.nn.Module, kind, generator) -> None:
    with torch.no_grad():
        for p in kind.trainable(net):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)


def _computed(layer) -> torch.Tensor:
    """The weight an adapted layer computes with: its outputs on the identity, less its output on zero (the bias)."""
    with torch.no_grad():
        eye = torch.eye(layer.in_features)
        return (layer(eye) - layer(torch.zeros(1, layer.in_features))).T


FORMS = {  # id: (LoRA Config, the file parts each layer must hold: at least one layer of each listed form)
    "lora": (dict(type="lora"), [{"lora_down.weight", "lora_up.weight", "alpha"}]),
    "dora": (dict(type="dora"), [{"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"}]),
    "loha": (dict(type="loha"), [{"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}]),
    "lokr-both-forms": (dict(type="lokr"), [{"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
                                            {"lokr_w1", "lokr_w2", "alpha"}]),
    "lokr-factor-4": (dict(type="lokr", factor=4), [{"lokr_w1", "lokr_w2_a", "lokr_w2_b", "alpha"},
                                                    {"lokr_w1", "lokr_w2", "alpha"}]),
    "oft": (dict(type="oft"), [{"oft_blocks", "alpha"}]),
}


def _expected_lokr_form(layer, rank: int, factor: int) -> set[str]:
    """LyCORIS' rule, from the layer's own sides: w2 low-rank where rank < max(its sides) / 2."""
    (_, out_k), (_, in_n) = factorization(layer.out_features, factor), factorization(layer.in_features, factor)
    return {"lokr_w1", "alpha", *(("lokr_w2_a", "lokr_w2_b") if rank < max(out_k, in_n) / 2 else ("lokr_w2",))}


@pytest.mark.parametrize("form", FORMS)
def test_every_file_form_applied_by_comfyuis_loader_is_the_weight_the_layer_computes(form, caplog):
    import comfy.lora
    changes, forms = FORMS[form]
    settings = LoraSettings(rank=3, alpha=2.0, targets="attention", **changes)  # alpha != rank: the scale shows
    kind = adapter_type(settings)
    torch.manual_seed(0)
    net = _Net()
    base = {path: layer.weight.detach().clone() for path, layer in net.named_modules()
            if isinstance(layer, torch.nn.Linear)}
    inject_lora(net, settings, 0, ("wide", "narrow", "no_bias"))
    _randomised(net, kind, torch.Generator().manual_seed(1))
    layers = kind.layers(net)
    assert set(layers) == set(base)
    saved = kohya_state_dict(net, settings, dtype=torch.float32)
    parts = {path: {key.split(".", 1)[1] for key in saved if key.startswith(f"lora_unet_{path}.")} for path in layers}
    assert all(p in forms for p in parts.values()), parts
    assert all(any(p == f for p in parts.values()) for f in forms), f"a form never written at rank 3: {parts}"
    if settings.type.value == "lokr":
        for path, layer in layers.items():
            assert parts[path] == _expected_lokr_form(layer, settings.rank, settings.factor), path

    key_map = {f"lora_unet_{path}": f"diffusion_model.{path}.weight" for path in layers}
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patches = comfy.lora.load_lora(saved, key_map)
        assert "not loaded" not in caplog.text
    assert len(patches) == len(layers)
    for path, layer in layers.items():
        key = f"diffusion_model.{path}.weight"
        applied = comfy.lora.calculate_weight([(1.0, patches[key], 1.0, None, None)], base[path].clone(), key)
        assert not torch.allclose(applied, base[path], atol=1e-3), path  # a difference of some size
        torch.testing.assert_close(applied, _computed(layer), rtol=1e-4, atol=1e-5, msg=f"{form} {path}")

    # continue_from's reading of the same parts (the type's `load`) rebuilds the same layers in a fresh copy
    torch.manual_seed(0)
    fresh = _Net()  # the same base weights
    inject_lora(fresh, settings, 7, ("wide", "narrow", "no_bias"))  # other initial factors
    for path, layer in kind.layers(fresh).items():
        prefix = f"lora_unet_{path}."
        part_values = {key[len(prefix):]: value for key, value in saved.items() if key.startswith(prefix)}
        part_values = {_PART_NAMES.get(k, k): v for k, v in part_values.items()}
        with torch.no_grad():
            kind.load(layer, part_values, f"file: {path}")
        torch.testing.assert_close(_computed(layer), _computed(layers[path]), rtol=1e-5, atol=1e-6)


_PART_NAMES = {"lora_down.weight": "down", "lora_up.weight": "up"}  # continue_from's names for plain LoRA parts
