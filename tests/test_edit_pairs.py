"""Edit LoRAs from before/after pairs (issue 42 items 2 and 3): the folder layout of pairs, the control latents
cached beside the targets, the edit variants of Qwen-Image (Qwen-Image-Edit 2509/2511) and FLUX.1 (Kontext) trained
with the control latents as ComfyUI's own nodes give them to the model (checked number for number against
TextEncodeQwenImageEditPlus and FluxKontextImageScale + VAEEncode + ReferenceLatent), and the refusals of a model
and a folder that do not go together. Tiny models: scripts/tiny_dit_assets.py (qwen_image_edit: Qwen-Image's model,
a text encoder with a narrow vision tower; flux_dev for Kontext)."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import tiny_dit_assets
from trainer.cache import CONTROL_KEY, build_cache
from trainer.cache_store import LatentTextStore, RamCache
from trainer.dataset import folder_fingerprint, load_image, scan_folder
from trainer.errors import LeanLoRAError
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX

FP32_CHECKPOINTED = MemorySettings("no", True)
LORA = LoraSettings(rank=4, alpha=4.0, targets="attention+feed-forward")
EDIT_SETS = {"qwen_image_edit": "QwenImageEdit", "flux_dev": "FluxKontext"}


def _image(path: Path, size=(80, 64), seed=0) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def make_pairs(folder: Path, n: int = 2, controls: int = 1, subfolder: bool = False, size=(80, 64)) -> Path:
    """n targets with their instruction captions and `controls` control images each (beside them, or in control/)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        _image(folder / f"img{i}.png", size, seed=i)
        (folder / f"img{i}.txt").write_text(f"make the shapes red, step {i}")
        where = folder / "control" if subfolder else folder
        where.mkdir(exist_ok=True)
        names = [f"img{i}_control"] if controls == 1 and not subfolder else \
            [f"img{i}"] if controls == 1 else [f"img{i}_control{k + 1}" for k in range(controls)]
        for k, name in enumerate(names):
            _image(where / f"{name}.png", size, seed=100 + 10 * i + k)
    return folder


# --- the folder ---------------------------------------------------------------------------------------------------

def test_pairs_beside_in_a_subfolder_and_several_are_found_and_what_matches_nothing_is_listed(tmp_path):
    folder = make_pairs(tmp_path / "beside")
    _image(folder / "lonely.png")  # a target without its control
    _image(folder / "ghost_control.png")  # a control without its target
    dataset = scan_folder(folder, 64)
    assert dataset.pairs and [(s.path.name, [c.name for c in s.controls]) for s in dataset.samples] == [
        ("img0.png", ["img0_control.png"]), ("img1.png", ["img1_control.png"])]
    assert dataset.samples[0].caption == "make the shapes red, step 0"
    skipped = dict(dataset.skipped)
    assert "no control image (lonely_control.png beside it or control/lonely.png)" in skipped["lonely.png"]
    assert "a control image whose target ghost.<png/jpg/...> is not in the folder" in skipped["ghost_control.png"]
    assert dataset.summary().startswith("2 edit pairs (target + 1 control image) x 1 repeats")

    inside = scan_folder(make_pairs(tmp_path / "inside", subfolder=True), 64)
    assert [[c.relative_to(tmp_path).as_posix() for c in s.controls] for s in inside.samples] == [
        ["inside/control/img0.png"], ["inside/control/img1.png"]]
    several = scan_folder(make_pairs(tmp_path / "several", controls=2), 64)
    assert [[c.name for c in s.controls] for s in several.samples] == [
        ["img0_control1.png", "img0_control2.png"], ["img1_control1.png", "img1_control2.png"]]
    assert "target + 2 control images" in several.summary()


def test_a_plain_folder_is_as_before_and_a_control_of_no_target_there_is_an_ordinary_image(tmp_path):
    _image(tmp_path / "a.png")
    _image(tmp_path / "b_control.png")
    dataset = scan_folder(tmp_path, 64)
    assert not dataset.pairs and [s.path.name for s in dataset.samples] == ["a.png", "b_control.png"]
    assert all(s.controls == () for s in dataset.samples) and not dataset.skipped


def test_an_unreadable_control_skips_its_pair_and_the_control_folder_changes_the_fingerprint(tmp_path):
    folder = make_pairs(tmp_path / "d", n=3, subfolder=True)
    (folder / "control" / "img2.png").write_bytes(b"not a png")
    dataset = scan_folder(folder, 64)
    assert [s.path.name for s in dataset.samples] == ["img0.png", "img1.png"]
    assert "its control image control/img2.png is unusable: not a readable image" in dict(dataset.skipped)["img2.png"]
    before = folder_fingerprint(folder)
    _image(folder / "control" / "img1.png", seed=7)
    assert folder_fingerprint(folder) != before


# --- caching ------------------------------------------------------------------------------------------------------

class _Controls:
    """A ControlEncoder of plain torch: counts what it encodes."""
    name, preprocess, max_controls = "test edit model", "half size", 3

    def __init__(self, sees: bool):
        self.text_sees_controls, self.encoded, self.texts = sees, 0, 0

    def control_size(self, width, height):
        return width // 2, height // 2

    def encode_control(self, pixels):
        self.encoded += 1
        return pixels.movedim(-1, 1)[:, :, ::8, ::8].clone()

    def encode_text(self, caption, width, height, controls):
        self.texts += 1
        return {"c_crossattn": torch.full((1, 2, 4), float(sum(c.sum() for c in controls)))}


def test_control_latents_are_cached_by_content_beside_the_targets_in_the_same_buckets(tmp_path):
    folder = make_pairs(tmp_path / "pairs", n=2, controls=2, size=(128, 96))
    dataset = dataclasses.replace(scan_folder(folder, 64), buckets=True)
    store = LatentTextStore(tmp_path / "cache", ram=RamCache(1 << 30))
    encode_image = lambda pixels: pixels.movedim(-1, 1)[:, :, ::8, ::8].clone()  # noqa: E731
    controls = _Controls(sees=True)
    cache = build_cache(dataset, encode_image, lambda *a: {"c_crossattn": torch.zeros(1, 2, 4)}, store=store,
                        controls=controls)
    first = cache[0]
    assert sorted(first.cond) == ["c_crossattn", f"{CONTROL_KEY}0", f"{CONTROL_KEY}1"]
    width, height = dataset.target_size(dataset.samples[0])
    assert first.latent.shape[-2:] == (height // 8, width // 8)
    expected = load_image(dataset.samples[0].controls[1], (width // 2, height // 2))[None]
    assert torch.equal(first.cond[f"{CONTROL_KEY}1"], expected.movedim(-1, 1)[:, :, ::8, ::8])
    assert controls.encoded == 4 and controls.texts == 2
    again = _Controls(sees=True)  # a second run: every control latent and caption from the store
    build_cache(dataset, encode_image, lambda *a: {"c_crossattn": torch.zeros(1, 2, 4)}, store=store, controls=again)
    assert again.encoded == 0 and again.texts == 0
    _image(dataset.samples[0].controls[0], (128, 96), seed=99)  # a changed control: its latent and caption again
    changed = _Controls(sees=True)
    build_cache(dataset, encode_image, lambda *a: {"c_crossattn": torch.zeros(1, 2, 4)}, store=store, controls=changed)
    assert changed.encoded == 1 and changed.texts == 1


def test_a_pairs_folder_without_a_control_encoder_is_refused_before_any_encoding(tmp_path):
    dataset = scan_folder(make_pairs(tmp_path / "p"), 64)
    with pytest.raises(LeanLoRAError, match=r"is a folder of edit pairs \(2 targets with control images\), and this "
                                            r"model takes no control image"):
        build_cache(dataset, lambda p: pytest.fail("encoded"), lambda *a: pytest.fail("encoded"))


# --- the edit models, tiny ----------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def edit_objects(comfy_base):
    return {name: tiny_dit_assets.load_family(tiny_dit_assets.build_family(comfy_base, name), name)
            for name in EDIT_SETS}


def _adapter(objects):
    from bridge.comfy_adapter import ComfyAdapter
    return ComfyAdapter(*objects)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return scan_folder(make_pairs(tmp_path_factory.mktemp("edit_pairs"), n=2, size=(64, 64)), 64)


STORE = LatentTextStore(ram=RamCache(1 << 30))  # the runs of one test encode once


def _train(objects, dataset, folder, steps, name, **train):
    return train_lora(_adapter(objects), dataset, FP32_CHECKPOINTED, LORA,
                      TrainSettings(steps, 1e-3, 0, name, "cosine", 1, **train), folder,
                      lambda **event: None, lambda: False, store=STORE)


def _fingerprint(model) -> bytes:
    with torch.inference_mode():
        return b"".join(t.detach().float().contiguous().numpy().tobytes()
                        for t in model.model.diffusion_model.state_dict().values())


@pytest.mark.parametrize("name", EDIT_SETS)
def test_an_edit_model_trains_on_pairs_resumes_exactly_loads_in_comfyui_and_leaves_the_model(
        edit_objects, pairs, name, tmp_path, caplog, small_references):
    import comfy.sd
    model = edit_objects[name][0]
    before = _fingerprint(model)
    straight = _train(edit_objects[name], pairs, tmp_path / "straight", 4, name, save_every_steps=2)
    assert len(straight.losses) == 4 and all(np.isfinite(straight.losses))
    assert f"edit pairs for {'Qwen-Image-Edit' if name == 'qwen_image_edit' else 'FLUX.1 Kontext'}" in straight.report
    resumed = _train(edit_objects[name], pairs, tmp_path / "resumed", 4, name,
                     resume_from=tmp_path / "straight" / f"{name}_step2{STATE_SUFFIX}")
    assert resumed.losses == straight.losses
    assert resumed.lora_path.read_bytes() == straight.lora_path.read_bytes()
    saved = load_file(str(straight.lora_path))
    with safe_open(str(straight.lora_path), "pt") as file:
        metadata = file.metadata()
    architecture = {"qwen_image_edit": "qwen-image-edit", "flux_dev": "flux-1-kontext-dev"}[name]
    assert metadata["modelspec.architecture"] == f"{architecture}/lora"
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, saved, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    assert modules and len(patched.patches) == len(modules)
    assert _fingerprint(model) == before


def test_resume_refuses_a_changed_control_as_it_refuses_a_changed_target(edit_objects, tmp_path, small_references):
    """A control redrawn with the same file size (stored PNG: the size is the pixel count's) is another pair: the
    state is not resumed on it, as on a changed target."""
    folder = make_pairs(tmp_path / "pairs", n=2, size=(64, 64))
    control = folder / "img1_control.png"
    Image.open(control).save(control, compress_level=0)
    dataset = scan_folder(folder, 64)
    _train(edit_objects["qwen_image_edit"], dataset, tmp_path / "first", 2, "edit", save_every_steps=1)
    state = tmp_path / "first" / f"edit_step1{STATE_SUFFIX}"
    refused = (r"cannot resume from edit_step1.*: the dataset \(images, control images, captions, repeats, "
               r"resolution or framing\) differs")
    size, original = control.stat().st_size, control.read_bytes()
    pixels = np.asarray(Image.open(control)).copy()
    pixels[0, 0] ^= 255
    Image.fromarray(pixels).save(control, compress_level=0)
    assert control.stat().st_size == size
    with pytest.raises(LeanLoRAError, match=refused):
        _train(edit_objects["qwen_image_edit"], scan_folder(folder, 64), tmp_path / "x", 3, "edit", resume_from=state)
    control.write_bytes(original)
    _image(folder / "img0.png", (64, 48), seed=3)  # a changed target (its size on disk)
    with pytest.raises(LeanLoRAError, match=refused):
        _train(edit_objects["qwen_image_edit"], scan_folder(folder, 64), tmp_path / "x", 3, "edit", resume_from=state)


@pytest.fixture()
def small_references(monkeypatch):
    """The nodes' reference sizes made small (128 px) for the training tests: the rules are the nodes' (checked
    against them in test_the_control_reaches_the_model_as_comfyuis_own_nodes_give_it), the sizes only cost CPU time."""
    import bridge.edit_pairs as edit_pairs
    monkeypatch.setattr(edit_pairs, "QWEN_EDIT_REFERENCE_PIXELS", 128 * 128)
    monkeypatch.setattr(edit_pairs, "KONTEXT_RESOLUTIONS", ((128, 128), (144, 112), (112, 144)))


def _sampler_inputs(base, conditioning, noise):
    """What ComfyUI's sampler hands the diffusion model for a CONDITIONING (comfy.samplers.convert_cond and
    encode_model_conds, then BaseModel.extra_conds): {name: value}."""
    [[cross_attn, extra]] = conditioning
    conds = base.extra_conds(**{**extra, "cross_attn": cross_attn}, device=torch.device("cpu"), noise=noise,
                             width=noise.shape[-1] * 8, height=noise.shape[-2] * 8, prompt_type="positive")
    return {name: value.cond for name, value in conds.items()}


def _diffusion_output(base, inputs, noise, sigma):
    """The diffusion model's own output when ComfyUI's BaseModel.apply_model runs it with `inputs`."""
    seen = []
    handle = base.diffusion_model.register_forward_hook(lambda module, args, output: seen.append(output.clone()))
    try:
        with torch.inference_mode():
            base.apply_model(noise, sigma, **inputs)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("name", EDIT_SETS)
def test_the_control_reaches_the_model_as_comfyuis_own_nodes_give_it(edit_objects, pairs, name):
    """Number for number: the cached pair (control latents, the instruction's conditioning) handed to the model by the
    edit family equals what ComfyUI's own nodes make of the same control pixels at sampling: Qwen-Image-Edit's
    TextEncodeQwenImageEditPlus (with the VAE), FLUX.1 Kontext's FluxKontextImageScale + VAEEncode + CLIPTextEncode +
    ReferenceLatent (+ FluxGuidance at the training's 1.0); the same diffusion model output, bit for bit."""
    import comfy_extras.nodes_edit_model as nodes_edit_model
    import comfy_extras.nodes_flux as nodes_flux
    import comfy_extras.nodes_qwen as nodes_qwen
    import node_helpers
    model, clip, vae = edit_objects[name]
    adapter = _adapter(edit_objects[name])
    controls = adapter.control_encoder(pairs)
    assert type(adapter.family).__name__ == EDIT_SETS[name]
    one = dataclasses.replace(pairs, samples=pairs.samples[:1])
    [cached] = build_cache(one, adapter.encode_image, adapter.encode_text, controls=controls)
    sample = one.samples[0]
    pixels = load_image(sample.controls[0], controls.control_size(64, 64))[None]  # what the dataset reads
    with torch.inference_mode():
        if name == "qwen_image_edit":
            conditioning = nodes_qwen.TextEncodeQwenImageEditPlus.execute(clip, sample.caption, vae, pixels).result[0]
        else:
            scaled = nodes_flux.FluxKontextImageScale.execute(pixels).result[0]
            latent = vae.encode(scaled[:, :, :, :3])
            conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(sample.caption))
            conditioning = nodes_edit_model.ReferenceLatent.execute(conditioning, {"samples": latent}).result[0]
            conditioning = node_helpers.conditioning_set_values(conditioning, {"guidance": 1.0})
    noise = torch.randn(cached.latent.shape, generator=torch.Generator().manual_seed(5))
    theirs = _sampler_inputs(model.model, conditioning, noise)
    [reference] = theirs["ref_latents"]
    assert torch.equal(cached.cond[f"{CONTROL_KEY}0"], reference.float())
    assert set(theirs) == {*(k for k in cached.cond if not k.startswith(CONTROL_KEY)), "ref_latents"}
    for key, value in theirs.items():
        if key != "ref_latents":
            assert torch.equal(cached.cond[key].to(value.dtype), value), key
    sigma = torch.tensor([0.7])
    expected = _diffusion_output(model.model, theirs, noise, sigma)
    timestep = model.model.model_sampling.timestep(sigma).float()
    with torch.inference_mode():
        ours = adapter.family.predict(model.model.diffusion_model, noise, timestep, cached.cond, {})
    assert torch.equal(ours, expected)


# --- samples during training ------------------------------------------------------------------------------------

def test_samples_on_pairs_edit_the_first_control_as_comfyuis_node_does(edit_objects, pairs, tmp_path):
    """Trained on pairs, a sample is an edit of the first pair's control (framed to the sample's square at the node's
    size): its CONDITIONING is TextEncodeQwenImageEditPlus's own, reference latents included, bit for bit, the
    negative too (the empty instruction); the image renders with the edit variant's sampler and names the control."""
    import comfy_extras.nodes_qwen as nodes_qwen
    from bridge.samples import SampleRenderer
    from trainer.settings import SampleSettings
    model, clip, vae = edit_objects["qwen_image_edit"]
    settings = SampleSettings(("make the shapes red",), every_steps=0, size=64, steps=2, cfg=1.0, seed=1)
    renderer = SampleRenderer(model, clip, vae, settings, tmp_path / "samples", dataset=pairs)
    no_lora = {"lora_unet_unused.alpha": torch.tensor(1.0)}  # patches nothing: the base model's image
    [path] = renderer(2, no_lora)
    assert Image.open(path).size == (64, 64)
    assert "an edit of img0_control.png" in Image.open(path).text["parameters"]
    pixels = load_image(pairs.samples[0].controls[0], (1024, 1024))[None]  # the node's size of a square
    [[[[cross_attn, extra]]], [[negative, negative_extra]]] = renderer._conds
    with torch.inference_mode():
        [[their_cross_attn, their_extra]] = nodes_qwen.TextEncodeQwenImageEditPlus.execute(
            clip, "make the shapes red", vae, pixels).result[0]
        [[their_negative, _]] = nodes_qwen.TextEncodeQwenImageEditPlus.execute(clip, "", None, pixels).result[0]
    assert torch.equal(cross_attn, their_cross_attn) and sorted(extra) == sorted(their_extra)
    [reference], [their_reference] = extra["reference_latents"], their_extra["reference_latents"]
    assert reference.shape[-2:] == (1024 // 8, 1024 // 8) and torch.equal(reference, their_reference)
    assert torch.equal(negative, their_negative) and negative_extra["reference_latents"] == [reference]
    plain = SampleRenderer(model, clip, vae, settings, tmp_path / "plain")
    [plain_path] = plain(2, no_lora)
    assert plain.edit is None and Image.open(plain_path).tobytes() != Image.open(path).tobytes()


# --- refusals -----------------------------------------------------------------------------------------------------

def test_an_edit_only_model_given_plain_images_is_refused_naming_the_layout_of_pairs(edit_objects, tmp_path,
                                                                                       monkeypatch):
    """Qwen-Image-Edit-2511 (ComfyUI 0.33 builds it with default_ref_method index_timestep_zero) is an edit model
    whatever the folder; a folder without control images is refused before anything is encoded."""
    model = edit_objects["qwen_image_edit"][0]
    monkeypatch.setattr(model.model.diffusion_model, "default_ref_method", "index_timestep_zero", raising=False)
    _image(tmp_path / "a.png")
    plain = scan_folder(tmp_path, 64)
    with pytest.raises(LeanLoRAError, match=r"this model is an edit model .* learns from before/after pairs, and .* "
                                            r"holds plain images \(no control images\)\. Lay the folder out as each "
                                            r"target image <name>\.png with its control image beside it as "
                                            r"<name>_control\.png"):
        _train(edit_objects["qwen_image_edit"], plain, tmp_path / "out", 2, "refused")


def test_a_model_without_an_edit_variant_given_pairs_is_refused_naming_both_ways_out(edit_objects, pairs, tmp_path,
                                                                                      monkeypatch):
    """A plain family (here the generic path, as for SD, Z-Image, Chroma, Wan or FLUX.1 schnell) given a folder of
    pairs: training on the targets alone would ignore the controls the user prepared, so it is refused before any
    encoding, saying how to train an edit LoRA and how to train on the targets. Decided so: a LoRA silently trained
    without its controls costs the whole run."""
    import bridge.families as families
    monkeypatch.setattr(families, "FAMILIES", [families.Generic()])
    with pytest.raises(LeanLoRAError, match=r"is a folder of edit pairs \(2 targets with control images\), and this "
                                            r"model takes no control image: .*generic path.*Connect an edit model "
                                            r"\(Qwen-Image-Edit 2509/2511 or FLUX.1 Kontext\).*move the control images"):
        _train(edit_objects["qwen_image_edit"], pairs, tmp_path / "out", 2, "refused")


def test_more_controls_than_the_model_takes_are_refused(edit_objects, tmp_path):
    dataset = scan_folder(make_pairs(tmp_path / "four", n=1, controls=4), 64)
    with pytest.raises(LeanLoRAError, match=r"Qwen-Image-Edit 2509/2511 takes at most 3 control images per target"):
        _train(edit_objects["qwen_image_edit"], dataset, tmp_path / "out", 2, "refused")


def test_the_dataset_preview_counts_pairs_and_controls(tmp_path):
    from helpers import node_module
    make_pairs(tmp_path / "pairs", n=2, controls=2)
    status, answer = node_module("routes").folder_preview("pairs", tmp_path)
    assert status == 200 and (answer["images"], answer["pairs"], answer["controls"]) == (2, 2, 4)
    _image(tmp_path / "plain.png")
    (tmp_path / "plainset").mkdir()
    _image(tmp_path / "plainset" / "a.png")
    status, answer = node_module("routes").folder_preview("plainset", tmp_path)
    assert status == 200 and answer["images"] == 1 and "pairs" not in answer
