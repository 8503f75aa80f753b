"""Text-encoder LoRA (LoRA Config's text_encoder_lr, bridge/text_encoder.py) on real ComfyUI objects: the tiny SD1.5
checkpoint (its CLIP-L at full size) and a tiny SDXL (ComfyUI's SDXL model and SDXLClipModel, narrowed through
ComfyUI's own per-encoder config override). Each test fails when the option is ignored: the encoder's LoRA must
change and change the loss, ComfyUI's loader must apply every te key, the user's CLIP must encode as before, an exact
resume must equal the uninterrupted run, and a family without it must refuse naming the field."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from test_families import FP32_CHECKPOINTED, _adapter, dit_files, family_objects, two_images  # noqa: F401
from trainer.errors import LeanLoRAError
from trainer.settings import LoraSettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX

LORA = LoraSettings(rank=4, alpha=4.0, targets="attention")
TE = dataclasses.replace(LORA, text_encoder_lr=5e-4)
PROMPT = "lnlr, a red circle on a blue background"


def _run(objects, dataset, folder, name, lora, steps=3, **train):
    return train_lora(_adapter(objects), dataset, FP32_CHECKPOINTED, lora,
                      TrainSettings(steps, 1e-3, 0, name, "cosine", min(1, steps - 1), **train), folder,
                      lambda **event: None, lambda: False)


def _encoded(clip, prompt=PROMPT) -> tuple[bytes, bytes]:
    """What the CLIP makes of a prompt, as CLIPTextEncode runs it: the context and the pooled output, as bytes."""
    with torch.inference_mode():
        cond, pooled = clip.encode_from_tokens(clip.tokenize(prompt), return_pooled=True)
    return cond.numpy().tobytes(), pooled.numpy().tobytes()


def _clip_keys_all_load(clip, state_dict, caplog) -> dict:
    """ComfyUI's own loader (comfy.sd.load_lora_for_models, what LoraLoader runs) on the CLIP: every te key maps."""
    import comfy.lora
    import comfy.sd
    te = {k: v for k, v in state_dict.items() if k.startswith("lora_te")}
    assert te
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        _, patched = comfy.sd.load_lora_for_models(None, clip, te, 0.0, 1.0)
        assert "lora key not loaded" not in caplog.text
    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    patches = comfy.lora.load_lora(te, key_map)
    assert len(patches) == len({k.split(".", 1)[0] for k in te})
    return patched


# --- SD1.5 -----------------------------------------------------------------------------------------------------

def test_sd15_trains_the_text_encoder_exports_kohya_keys_comfyui_applies_and_the_users_clip_is_unchanged(
        comfy_objects, two_images, tmp_path, caplog):  # noqa: F811
    objects = comfy_objects
    clip = objects[1]
    before = _encoded(clip)
    off = _run(objects, two_images, tmp_path / "off", "off", LORA)
    on = _run(objects, two_images, tmp_path / "on", "on", TE)
    assert _encoded(clip) == before  # the user's CLIP encodes byte for byte as before training

    saved = load_file(str(on.lora_path))
    te = {k for k in saved if k.startswith("lora_te_")}
    modules = {k.split(".", 1)[0] for k in te}
    assert len(modules) == 12 * 6  # CLIP-L: 12 layers x q/k/v/out_proj, fc1, fc2
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in modules
    assert "lora_te_text_model_encoder_layers_11_mlp_fc2" in modules
    assert not any(k.startswith("lora_te") for k in load_file(str(off.lora_path)))
    # it learned: lora_up starts at zero, and the encoder's LoRA moved the loss off the run without it
    assert any(saved[k].abs().max() > 0 for k in te if k.endswith("lora_up.weight"))
    assert on.losses[0] == off.losses[0]  # step 1 runs before any update: the same draws, the same weights
    assert on.losses[1:] != off.losses[1:]
    unet_keys = {k for k in saved if k.startswith("lora_unet_")}
    assert unet_keys == set(load_file(str(off.lora_path)))
    with safe_open(str(on.lora_path), "pt") as file:
        metadata = file.metadata()
    assert metadata["ss_text_encoder_lr"] == "0.0005" and metadata["ss_network_train_unet_only"] == "False"
    assert "text encoder trained too" in on.report and "learning rate 0.0005" in on.report

    patched = _clip_keys_all_load(clip, saved, caplog)
    assert _encoded(patched) != before  # the trained te LoRA changes what the CLIP encodes
    assert _encoded(clip) == before


# --- SDXL: ComfyUI's SDXL model and SDXLClipModel (clip_l + clip_g), narrowed ------------------------------------

# ComfyUI reads `<encoder>_model_config` from the CLIP's model options over its built-in CLIP-L / bigG configs
# (comfy/sd1_clip.py SDClipModel): the same classes, tokenizers and layer options (clip_l's and clip_g's penultimate
# layer), at test widths. The UNet takes their widths: context 32 + 48, y = clip_g's pooled 48 (ComfyUI projects
# to its width) + the size embedding. 64 channels: with GroupNorm's 32 groups of one channel each, the ResBlocks' norm
# would remove the embedding's per-channel shift, and with it every gradient through `y`.
_CLIP_L = {"hidden_size": 32, "intermediate_size": 40, "num_attention_heads": 4, "num_hidden_layers": 3,
           "projection_dim": 32}
_CLIP_G = {"hidden_size": 48, "intermediate_size": 56, "num_attention_heads": 4, "num_hidden_layers": 3,
           "projection_dim": 24}
_SDXL_UNET = dict(image_size=32, use_spatial_transformer=True, legacy=False, adm_in_channels=48 + 6 * 256,
                  num_classes="sequential",
                  in_channels=4, out_channels=4, model_channels=64, num_res_blocks=[1], channel_mult=[1],
                  transformer_depth=[1], transformer_depth_output=[1, 1], transformer_depth_middle=1,
                  use_linear_in_transformer=True, context_dim=32 + 48, use_temporal_resblock=False,
                  use_temporal_attention=False)


def _seeded(module: torch.nn.Module, seed: int) -> None:
    """ComfyUI builds layers uninitialised (its loaders fill them): seeded values scaled by fan-in (so every path,
    SDXL's pooled output through `y` included, carries signal as in a trained model), norm scales at one, biases
    at zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) / p[0].numel() ** 0.5)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)


@pytest.fixture(scope="module")
def sdxl_objects(comfy_objects):
    import comfy.model_patcher
    import comfy.sd
    import comfy.sdxl_clip
    import comfy.supported_models

    config = comfy.supported_models.SDXL(dict(_SDXL_UNET))
    config.unet_config["num_head_channels"] = 16  # SDXL's is 64; these widths are multiples of 16
    model = config.get_model({}, device="cpu")
    _seeded(model.diffusion_model, 1)
    patcher = comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))

    class Target:
        clip, tokenizer, params = comfy.sdxl_clip.SDXLClipModel, comfy.sdxl_clip.SDXLTokenizer, {}
    clip = comfy.sd.CLIP(Target(), model_options={"clip_l_model_config": _CLIP_L, "clip_g_model_config": _CLIP_G})
    _seeded(clip.cond_stage_model, 2)
    return patcher, clip, comfy_objects[2]


def _te_modules(state_dict, prefix: str) -> set[str]:
    return {k.split(".", 1)[0] for k in state_dict if k.startswith(prefix)}


def test_sdxl_trains_both_encoders_with_clip_gs_pooled_output_and_comfyui_applies_every_key(
        sdxl_objects, two_images, tmp_path, caplog):  # noqa: F811
    clip = sdxl_objects[1]
    before = _encoded(clip)
    on = _run(sdxl_objects, two_images, tmp_path, "sdxl_te", TE)
    assert _encoded(clip) == before
    saved = load_file(str(on.lora_path))
    te1, te2 = _te_modules(saved, "lora_te1_"), _te_modules(saved, "lora_te2_")
    assert len(te1) == len(te2) == 3 * 6 and not _te_modules(saved, "lora_te_")
    assert "lora_te2_text_model_encoder_layers_2_mlp_fc2" in te2
    # SDXL's context is clip_l's and clip_g's penultimate layer: clip_g's last layer reaches the UNet only through
    # its pooled output (in `y`), so its LoRA learns only if the pooled output flows with gradients
    last_g = [k for k in saved if k.startswith("lora_te2_text_model_encoder_layers_2_") and "lora_up" in k]
    assert last_g and all(saved[k].abs().max() > 0 for k in last_g)
    # clip_l's pooled output is not used by SDXL (kohya the same): its last layer's LoRA stays at its start
    last_l = [k for k in saved if k.startswith("lora_te1_text_model_encoder_layers_2_") and "lora_up" in k]
    assert last_l and all(saved[k].abs().max() == 0 for k in last_l)
    assert any(saved[k].abs().max() > 0 for k in saved if k.startswith("lora_te1_") and "lora_up" in k)

    patched = _clip_keys_all_load(clip, saved, caplog)
    assert _encoded(patched)[1] != before[1]  # the pooled output moves with the trained LoRA
    assert _encoded(clip) == before


def test_exact_resume_with_the_text_encoder_equals_the_uninterrupted_run_and_on_off_must_match(
        sdxl_objects, two_images, tmp_path):  # noqa: F811
    straight = _run(sdxl_objects, two_images, tmp_path / "straight", "te", TE, steps=4, save_every_steps=2)
    state = tmp_path / "straight" / f"te_step2{STATE_SUFFIX}"
    resumed = _run(sdxl_objects, two_images, tmp_path / "resumed", "te", TE, steps=4, resume_from=state)
    assert resumed.losses == straight.losses
    assert resumed.lora_path.read_bytes() == straight.lora_path.read_bytes()
    with pytest.raises(LeanLoRAError, match=r"it trained the text encoder too \(text_encoder_lr 0.0005\), and LoRA "
                                            r"Config's text_encoder_lr is 0: set it above 0"):
        _run(sdxl_objects, two_images, tmp_path / "off", "te", LORA, steps=4, resume_from=state)
    _run(sdxl_objects, two_images, tmp_path / "unet_only", "unet", LORA, steps=3, save_every_steps=1)
    with pytest.raises(LeanLoRAError, match=r"it trained the diffusion model alone \(text_encoder_lr 0\), and LoRA "
                                            r"Config's text_encoder_lr is set: set it to 0"):
        _run(sdxl_objects, two_images, tmp_path / "on", "unet", TE, steps=3,
             resume_from=tmp_path / "unet_only" / f"unet_step1{STATE_SUFFIX}")


def test_continue_from_reads_the_text_encoder_back_and_skips_it_with_a_note_when_off(sdxl_objects, two_images,
                                                                                    tmp_path):  # noqa: F811
    from trainer.lora import inject_lora
    from trainer.lora.continue_from import continue_from_file
    from trainer.settings import LoraTargets
    first = _run(sdxl_objects, two_images, tmp_path, "first", TE, steps=2)
    saved = load_file(str(first.lora_path))
    adapter = _adapter(sdxl_objects)
    unet = adapter.training_unet()
    presets = {targets: adapter.lora_targets(unet, targets) for targets in LoraTargets}
    lora = dataclasses.replace(TE, continue_from=str(first.lora_path))
    inject_lora(unet, lora, 1, presets[lora.targets])
    encoder = adapter.training_text_encoder(lora, 7)  # another seed: only the file can make its weights equal
    continued = continue_from_file(unet, lora, adapter.diffusers_module_names(), adapter.identity(), presets,
                                   encoder)
    again = encoder.state_dict()
    assert again.keys() == {k for k in saved if k.startswith("lora_te")}
    assert all(torch.equal(again[k], saved[k]) for k in again)
    assert continued.text_encoder_modules == 36 and "36 text-encoder modules loaded" in continued.describe()
    # text_encoder_lr 0: the UNet part continues, the te keys are skipped and the report says how to train them on
    off = _run(sdxl_objects, two_images, tmp_path / "off", "off", dataclasses.replace(LORA, continue_from=str(
        first.lora_path)), steps=1)
    assert "text-encoder keys skipped (text_encoder_lr is 0" in off.report
    assert not any(k.startswith("lora_te") for k in load_file(str(off.lora_path)))
    # and on, the continued run's first loss is the trained one's, lower than the fresh run's first
    on = _run(sdxl_objects, two_images, tmp_path / "on", "on", lora, steps=1)
    assert on.losses[0] < first.losses[0]


def test_text_encoder_lr_0_touches_nothing_of_the_text_encoder(sdxl_objects, two_images, tmp_path,
                                                              monkeypatch):  # noqa: F811
    """Off (the default), a run is the one it was before the option existed: no encoder copy, no tokens in the
    batches, no te keys or metadata. (Checked once across the change: a seeded SD1.5 run with caption options wrote
    the same tensors and metadata, timestamps aside, before and after it.)"""
    from bridge.comfy_adapter import ComfyAdapter
    for name in ("check_text_encoder", "text_encoder_tokens", "training_text_encoder"):
        monkeypatch.setattr(ComfyAdapter, name, lambda *args, **kwargs: pytest.fail("text encoder touched"))
    off = _run(sdxl_objects, two_images, tmp_path, "off", LORA, steps=2)
    with safe_open(str(off.lora_path), "pt") as file:
        assert not any(k.startswith("lora_te") for k in file.keys())
        assert not any("text_encoder" in k or k == "ss_unet_lr" for k in file.metadata())
    assert "text encoder" not in off.report


def test_samples_while_training_encode_the_prompts_through_the_trained_text_encoder(sdxl_objects, two_images,
                                                                                    tmp_path):  # noqa: F811
    from bridge.samples import SampleRenderer
    from trainer.settings import SampleSettings
    trained = load_file(str(_run(sdxl_objects, two_images, tmp_path, "sampled", TE, steps=2).lora_path))
    settings = SampleSettings(("lnlr, a red circle",), every_steps=1, size=64, steps=2)
    images = []
    for name, state_dict in (("with", trained), ("without", {k: v for k, v in trained.items()
                                                               if not k.startswith("lora_te")})):
        renderer = SampleRenderer(*sdxl_objects, settings, tmp_path / name)
        with Image.open(renderer(2, state_dict)[0]) as image:
            images.append(np.asarray(image, np.int16))
    assert np.abs(images[0] - images[1]).max() > 0  # the te keys change what the prompt conditions on


def test_the_memory_estimate_holds_the_encoders_weights_lora_and_optimizer_state(sdxl_objects, two_images, tmp_path,
                                                                                 monkeypatch):  # noqa: F811
    from trainer.session import TrainingSession
    started = []
    real = TrainingSession.start

    def start(self, memory):
        estimate, lines = real(self, memory)
        encoder = self.text_encoder.params if self.text_encoder is not None else []
        started.append((estimate, sum(p.numel() * 4 for p in encoder),
                        [g["initial_lr"] for g in self.optimizer.param_groups]))
        return estimate, lines
    monkeypatch.setattr(TrainingSession, "start", start)
    _run(sdxl_objects, two_images, tmp_path / "off", "off", LORA, steps=1)
    on = _run(sdxl_objects, two_images, tmp_path / "on", "on", TE, steps=1)
    (off_estimate, _, off_groups), (estimate, encoder_params, groups) = started
    clip = sdxl_objects[1].cond_stage_model
    clip_weights = sum(t.numel() * t.element_size() for t in [*clip.parameters(), *clip.buffers()])
    assert encoder_params > 0 and clip_weights > 0
    assert estimate.frozen_weights == off_estimate.frozen_weights + clip_weights  # resident for the whole run
    assert estimate.lora_parameters == off_estimate.lora_parameters + encoder_params
    assert estimate.gradients == estimate.lora_parameters
    assert estimate.optimizer_state == off_estimate.optimizer_state + 2 * encoder_params  # AdamW's two moments
    # one optimizer, two groups: the encoder's LoRA at its own rate, the schedule over both
    assert off_groups == [1e-3] and groups == [1e-3, 5e-4]
    assert "learning rate 0.0005" in on.report


def test_validation_and_caption_options_run_through_the_trained_encoder(sdxl_objects, two_images,
                                                                        tmp_path):  # noqa: F811
    """Held-out images are scored with the trained encoder (their tokens stay on the host like the batches'), and
    caption variants and the dropped caption carry their own tokens (a batch without would be an error)."""
    options = dict(validation_fraction=0.5, validation_every_steps=1)
    plain = _run(sdxl_objects, two_images, tmp_path / "plain", "plain", TE, steps=3, **options)
    assert len(plain.validation_losses) == 3 and all(np.isfinite(v) for _, v in plain.validation_losses)
    varied = _run(sdxl_objects, two_images, tmp_path / "varied", "varied", TE, steps=3, shuffle_tags=True,
                  caption_dropout=0.5, **options)
    assert varied.losses != plain.losses


def test_weighted_captions_train_through_the_encoders_own_weighting(sdxl_objects, tmp_path):
    """A caption with ComfyUI's weight syntax, `(red:1.4)`, is encoded as CLIPTextEncode encodes it (each weighted
    token pushed away from the empty prompt's), with gradients: the run trains, and the weight changes the run."""
    import tiny_assets
    from trainer.dataset import scan_folder

    def dataset(name: str, caption: str):
        folder = tiny_assets.build_tiny_dataset(tmp_path / name, n=2)
        for text in folder.glob("*.txt"):
            text.write_text(caption)
        return scan_folder(folder, 64)

    weighted = _run(sdxl_objects, dataset("weighted", "(a red circle:1.4), on a blue background"), tmp_path / "w",
                    "weighted", TE)
    plain = _run(sdxl_objects, dataset("plain", "a red circle, on a blue background"), tmp_path / "p", "plain", TE)
    assert all(np.isfinite(weighted.losses)) and weighted.losses != plain.losses
    assert any(key.startswith("lora_te2_") for key in load_file(str(weighted.lora_path)))


# --- refusals, before any work ----------------------------------------------------------------------------------

def test_a_family_without_a_trainable_text_encoder_refuses_naming_the_field(family_objects, two_images, tmp_path,
                                                                            monkeypatch):  # noqa: F811
    from bridge.comfy_adapter import ComfyAdapter
    monkeypatch.setattr(ComfyAdapter, "encode_image", lambda self, pixels: pytest.fail("encoded before the error"))
    with pytest.raises(LeanLoRAError, match=r"^text_encoder_lr: got 0.0005, but this model is Lumina2 \(Z-Image\); "
                                            r"LeanLoRA trains the text encoder of SD1.5 and SDXL only: set LoRA "
                                            r"Config's text_encoder_lr to 0"):
        _run(family_objects["z_image"], two_images, tmp_path, "zimage", TE)


def test_other_adapter_types_and_bf16_lora_weights_refuse_the_text_encoder_naming_the_field(
        sdxl_objects, two_images, tmp_path):  # noqa: F811
    with pytest.raises(LeanLoRAError, match=r"^text_encoder_lr: got 0.0005 with type loha: the text encoder is "
                                            r"trained with plain LoRA only; set type to lora"):
        dataclasses.replace(TE, type="loha")
    from trainer.settings import MemorySettings
    with pytest.raises(LeanLoRAError, match=r"^text_encoder_lr: .*lora_weights bf16_stochastic_rounding.*set Memory "
                                            r"Settings' lora_weights to fp32"):
        train_lora(_adapter(sdxl_objects), two_images, MemorySettings("bf16", lora_weights="bf16_stochastic_rounding"),
                   TE, TrainSettings(1), tmp_path, lambda **event: None, lambda: False)
    with pytest.raises(LeanLoRAError, match=r"^text_encoder_lr: got 0.0005 with optimizer Prodigy.*set "
                                            r"text_encoder_lr to 1.0"):
        train_lora(_adapter(sdxl_objects), two_images, MemorySettings("no", optimizer="Prodigy"), TE,
                   TrainSettings(1, 1.0), tmp_path, lambda **event: None, lambda: False)


def test_lora_config_carries_text_encoder_lr_off_by_default_with_its_tooltip():
    from helpers import node_module
    node = node_module("settings").LeanLoRALoraConfig
    assert node().execute(8, 8.0, 0.0, "attention")[0].text_encoder_lr == 0.0  # workflows saved before it
    assert node().execute(8, 8.0, 0.0, "attention", text_encoder_lr=5e-5)[0].text_encoder_lr == 5e-5
    kind, options = node.INPUT_TYPES()["optional"]["text_encoder_lr"]
    assert kind == "FLOAT" and options["default"] == 0.0 and "half the learning rate" in options["tooltip"]
    with pytest.raises(LeanLoRAError, match=r"^text_encoder_lr: got -1"):
        LoraSettings(text_encoder_lr=-1.0)

