"""What each model family promises, checked against what the model actually gets (issue 41, item 6):

- the conditioning a training step hands the model is what the family says it trains at (FLUX.1-dev's guidance);
- a variant of a family that takes extra input channels (FLUX.1 Fill/Depth/Canny, a Chroma or Qwen-Image file with
  a wider patch embedding) is refused before training, saying so, instead of failing inside the first step;
- the target presets are complete: every attention projection of every stream (image and text), and for
  attention+feed-forward every Linear of the blocks but their modulation, derived from the model's own module
  names, so a projection dropped from a family's list fails here (a check that each listed target exists does not).

The tiny models are test_families' (scripts/tiny_dit_assets.py)."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from test_families import (DIT, FAMILIES, _adapter, dit_files, family_objects, two_images)  # noqa: F401
from trainer.settings import LoraSettings, LoraTargets, MemorySettings, TrainSettings
from trainer.train_lora import train_lora

# --- 1. what a training step sends to the model -------------------------------------------------------------------


@pytest.mark.parametrize("family, module, guidance", [
    ("flux_dev", "comfy.ldm.flux.model", 1.0),  # Flux.text_conditioning: kohya's and ai-toolkit's 1.0, not 3.5
    ("chroma", "comfy.ldm.chroma.model", 0.0),  # ComfyUI's own Chroma conditioning (model_base.Chroma: 0)
])
def test_each_training_step_gives_the_model_the_guidance_the_family_trains_at(
        family_objects, two_images, tmp_path, monkeypatch, family, module, guidance):  # noqa: F811
    """A spy on the diffusion model's own forward (the class ComfyUI built, which the training copy keeps): every
    call of every step gets the family's declared guidance, one value per sample of the batch. (Caught: encode_text
    without the family's text_conditioning, which gives FLUX.1-dev ComfyUI's sampling default 3.5.)"""
    import importlib
    adapter = _adapter(family_objects[family])
    declared = adapter.family.text_conditioning.get("guidance", 0.0)
    assert declared == guidance  # what the family file says (and the docs: FLUX.1-dev trains at 1.0)
    cls = type(family_objects[family][0].model.diffusion_model)
    assert cls.__module__ == module
    seen = []
    original = cls.forward

    def spy(self, *args, **kwargs):
        value = kwargs.get("guidance", args[3] if len(args) > 3 else None)
        seen.append(None if value is None else (len(args[0]), value.detach().float().cpu().clone()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", spy)
    outcome = train_lora(adapter, two_images, MemorySettings("no", False, batch_size=2),
                         LoraSettings(rank=2, alpha=2.0, targets="attention"), TrainSettings(2, 1e-3, 0, f"g_{family}"),
                         tmp_path, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2
    assert len(seen) >= 2 and all(value is not None for value in seen), seen
    for batch, value in seen:  # Chroma's captions of other lengths never share a batch: batches of 1 there
        assert torch.equal(value, torch.full((batch,), guidance)), seen


# --- 2. variants with extra input channels ------------------------------------------------------------------------

def _widened(state: dict, key: str, width: int) -> dict:
    """`state` with the input side of `key` (the patch embedding) `width` wide, as an inpainting/control file has."""
    weight = state[key]
    state = dict(state)
    state[key] = torch.zeros(weight.shape[0], width, dtype=weight.dtype)
    return state


@pytest.mark.parametrize("family, channels, refusal", [
    ("flux_dev", 96, r"FLUX.1 Fill/Depth/Canny models \(extra input channels\) are not supported"),  # Fill: 16+16+64
    ("flux_dev", 32, r"FLUX.1 Fill/Depth/Canny models \(extra input channels\) are not supported"),  # Depth, Canny
    ("qwen_image", 32, r"this Qwen-Image model takes 32 input channels and Qwen-Image's latents have 16: a variant "
                       r"with extra input channels \(16: inpainting"),
], ids=["flux-fill", "flux-depth-canny", "qwen-image-wider"])
def test_a_variant_that_takes_extra_input_channels_is_refused_before_training(
        dit_files, family_objects, family, channels, refusal):  # noqa: F811
    """The tiny file with its patch embedding widened to `channels` latent channels (x 2x2 patches), loaded as
    ComfyUI loads such a file: Train names what it cannot build instead of failing in the first step (the latents
    it encodes have the VAE's 16 channels). Wan's image-to-video and TI2V files: test_families. (ComfyUI itself
    does not load a Chroma file with a wider img_in: its width is fixed at 64.) Z-Image's loader fixes 16."""
    import comfy.sd
    from trainer.errors import LeanLoRAError
    state = load_file(str(dit_files[family]["unet_name"]))
    state = _widened(state, "img_in.weight", channels * 4)
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model_state_dict(state)
    assert type(model.model).__name__ == {"flux_dev": "Flux", "qwen_image": "QwenImage"}[family]
    _, clip, vae = family_objects[family]
    with pytest.raises(LeanLoRAError, match=rf"LeanLoRA Train: .*{refusal}"):
        _adapter((model, clip, vae))


# --- 3. complete target presets -----------------------------------------------------------------------------------

_ATTENTION_NAME = re.compile(r"(^|\.)[a-z_]*(attn\d?|attention)(\.|$)")  # img_attn, attn1, self_attn, attention...
_MODULATION = re.compile(r"(^|\.)([a-z]+_mod|modulation|adaLN_modulation)(\.|$)")  # shift/scale/gate, not content


def _block_linears(family: str, adapter, unet) -> dict[str, str]:
    """Every Linear of the blocks LoRA can go on, by full path -> its path inside its block."""
    if family == "sd15":  # the UNet's transformer layers
        return {path: path for path, m in unet.named_modules()
                if isinstance(m, torch.nn.Linear) and ".transformer_blocks." in path}
    paths = {id(m): path for path, m in unet.named_modules()}
    found = {}
    for block in adapter.family.blocks(unet):
        for inner, m in block.named_modules():
            if isinstance(m, torch.nn.Linear):
                found[f"{paths[id(block)]}.{inner}"] = inner
    return found


def _expected(family: str, linears: dict[str, str], targets: LoraTargets) -> set[str]:
    """From the module names: attention = every projection of an attention module of every stream (q, k, v and
    the output, fused or not: FLUX.1's single blocks hold q, k, v and the output in linear1 / linear2, fused with
    their MLP). attention+feed-forward = every Linear of the blocks but the modulation (and, in SD's UNet, the
    transformer layers' attention and feed-forward)."""
    attention = {path for path, inner in linears.items()
                 if _ATTENTION_NAME.search(inner)
                 or (family in ("flux_dev", "chroma") and ".single_blocks." in f".{path}"
                     and inner in ("linear1", "linear2"))}
    if targets is LoraTargets.ATTENTION:
        return attention
    if family == "sd15":
        return attention | {path for path, inner in linears.items() if re.search(r"(^|\.)ff\.", inner)}
    return {path for path, inner in linears.items() if not _MODULATION.search(inner)}


def _wrapped(unet, suffixes) -> set[str]:
    """The Linear layers a preset puts LoRA on (trainer/lora/base.wrap_targets' matching, peft's)."""
    return {path for path, m in unet.named_modules() if isinstance(m, torch.nn.Linear)
            and any(path == s or path.endswith(f".{s}") for s in suffixes)}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_target_preset_covers_every_projection_of_every_stream(family_objects, family):  # noqa: F811
    adapter = _adapter(family_objects[family])
    unet = adapter.training_unet()
    linears = _block_linears(family, adapter, unet)
    streams = {"flux_dev": ("img_attn", "txt_attn"), "chroma": ("img_attn", "txt_attn"),
               "qwen_image": ("to_q", "add_q_proj"), "wan": ("self_attn", "cross_attn"),
               "z_image": ("attention",), "sd15": ("attn1", "attn2")}[family]
    for targets in LoraTargets:
        expected = _expected(family, linears, targets)
        # the rule sees each stream's projections (a rule that found nothing would pass anything)
        assert all(any(stream in path for path in expected) for stream in streams), (family, targets)
        got = _wrapped(unet, adapter.lora_targets(unet, targets))
        missing, extra = sorted(expected - got), sorted(got - expected)
        assert not missing, f"{family} {targets.value}: no LoRA on {missing[:6]} ({len(missing)} in all)"
        assert not extra, f"{family} {targets.value}: LoRA on {extra[:6]}, which are not {targets.value} layers"
    attention = _expected(family, linears, LoraTargets.ATTENTION)
    assert attention < _expected(family, linears, LoraTargets.ATTENTION_FEED_FORWARD)
