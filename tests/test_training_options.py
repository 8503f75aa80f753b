"""Issue 35's optimizers (Prodigy, schedule-free AdamW, CAME), the EMA of the LoRA weights, and the caption, multires
noise and masked-loss options: seeded CPU runs on the pure-torch adapter (no ComfyUI), each failing when its option
is ignored. Exact resume is checked with each optimizer and with the EMA."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from test_pure_torch_training import EAGER, TinyAdapter
from trainer.dataset import scan_folder
from trainer.errors import LeanLoRAError
from trainer.lora import inject_lora, kohya_state_dict
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import load_training_state, state_path

LORA = LoraSettings(rank=4, alpha=4.0)
RATES = {"AdamW": 1e-3, "Prodigy": 1.0, "AdamWScheduleFree": 1e-3, "CAME": 1e-4}


def run(tmp_path: Path, name: str, optimizer: str = "AdamW", steps: int = 6, stop_after_steps: int | None = None,
        images: int = 4, dataset=None, events: list | None = None, **knobs):
    import tiny_assets
    if dataset is None:
        dataset = scan_folder(tiny_assets.build_tiny_dataset(tmp_path / "data", n=images), 64)
    events = [] if events is None else events
    reported = lambda: sum(event["kind"] == "step" for event in events)  # noqa: E731
    knobs.setdefault("learning_rate", RATES[optimizer])
    return train_lora(TinyAdapter(), dataset, replace(EAGER, optimizer=optimizer), LORA,
                      TrainSettings(steps=steps, seed=0, output_name=name, **knobs),
                      tmp_path / "out", lambda **event: events.append(event),
                      lambda: stop_after_steps is not None and reported() >= stop_after_steps)


def export(weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoRA file's tensors for LoRA weights in the trainer's order, as train_lora writes them."""
    adapter = TinyAdapter()
    unet = adapter.training_unet()
    params = inject_lora(unet, LORA, 0, adapter.lora_targets(unet, LORA.targets))
    with torch.no_grad():
        for param, weight in zip(params, weights):
            param.copy_(weight)
    return kohya_state_dict(unet, LORA, adapter.kohya_module_names())


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- optimizers -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,package", [("Prodigy", "prodigyopt"), ("AdamWScheduleFree", "schedulefree"),
                                          ("CAME", "came-pytorch")])
def test_a_missing_optimizer_package_is_an_error_naming_pip_before_any_encoding(tmp_path, monkeypatch, name,
                                                                                 package):
    module = {"Prodigy": "prodigyopt", "AdamWScheduleFree": "schedulefree", "CAME": "came_pytorch.CAME"}[name]
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` now raises ImportError
    monkeypatch.setattr(TinyAdapter, "encode_image", lambda self, pixels: pytest.fail("encoded before the error"))
    with pytest.raises(LeanLoRAError, match=rf"^optimizer: {name} needs the package {package}.*"
                                            rf"python -m pip install {package}"):
        run(tmp_path, "missing", name)


def test_the_learning_rate_must_suit_the_optimizer(tmp_path):
    with pytest.raises(LeanLoRAError, match=r"^learning_rate: got 0.0001 with optimizer Prodigy.*set learning_rate "
                                            r"to 1.0"):
        run(tmp_path, "prodigy_rate", "Prodigy", learning_rate=1e-4)
    with pytest.raises(LeanLoRAError, match=r"^learning_rate: got 1 with optimizer AdamW; rates of about 1 are for "
                                            r"Prodigy"):
        run(tmp_path, "adamw_rate", "AdamW", learning_rate=1.0)
    with pytest.raises(LeanLoRAError, match=r"^learning_rate: got 20"):
        TrainSettings(learning_rate=20.0)


def test_bf16_lora_weights_are_refused_for_whole_model_optimizers():
    for name in ("Prodigy", "AdamWScheduleFree"):
        with pytest.raises(LeanLoRAError, match=rf"^lora_weights: .*{name}.*set lora_weights to fp32"):
            MemorySettings("bf16", optimizer=name, lora_weights="bf16_stochastic_rounding")
    MemorySettings("bf16", optimizer="CAME", lora_weights="bf16_stochastic_rounding")  # per tensor: fine


def test_prodigys_step_size_is_in_every_progress_event_and_line(tmp_path):
    from helpers import node_module
    progress_line = node_module("train").progress_line  # the node's log line (the browser panel reads the same `d`)
    events = []
    outcome = run(tmp_path, "prodigy", "Prodigy", events=events)
    steps = [event for event in events if event["kind"] == "step"]
    assert len(steps) == 6 and all(isinstance(event["d"], float) for event in steps)
    assert steps[-1]["d"] > 1e-6  # it grew from d0: the value is read each step, not once
    assert f"Prodigy d {steps[-1]['d']:.3g}" in progress_line(steps[-1])
    adamw = []
    run(tmp_path, "adamw", "AdamW", events=adamw)
    assert all(event["d"] is None for event in adamw if event["kind"] == "step")
    assert "Prodigy" not in progress_line(next(e for e in adamw if e["kind"] == "step"))
    assert outcome.run.used.optimizer == "Prodigy"


def test_schedule_free_saves_its_average_not_the_point_it_trains_at(tmp_path):
    """The file holds x (schedulefree's eval mode), computed here from the state's y and z as its eval() does:
    x = y + (1 - 1/beta1) (z - y); the trained point y exported differs."""
    outcome = run(tmp_path, "sf", "AdamWScheduleFree", save_every_steps=6)
    state = load_training_state(state_path(outcome.lora_path))
    beta1 = state.optimizer["param_groups"][0]["betas"][0]
    assert state.optimizer["param_groups"][0]["train_mode"]  # the state is taken in train mode (y)
    trained = state.lora
    average = [y + (1 - 1 / beta1) * (state.optimizer["state"][i]["z"] - y) for i, y in enumerate(trained)]
    assert same(outcome.lora_state_dict, export(average))
    assert not same(outcome.lora_state_dict, export(trained))


@pytest.mark.parametrize("optimizer,knobs", [("Prodigy", {}), ("AdamWScheduleFree", {}), ("CAME", {}),
                                             ("AdamW", {"ema_decay": 0.9})], ids=["Prodigy", "schedule-free",
                                                                                  "CAME", "EMA"])
def test_exact_resume_with_each_optimizer_and_the_ema(tmp_path, optimizer, knobs):
    whole = run(tmp_path / "whole", "run", optimizer, steps=6, **knobs)
    stopped = run(tmp_path / "parts", "run", optimizer, steps=6, stop_after_steps=2, **knobs)
    assert stopped.partial and len(stopped.losses) == 2
    state = load_training_state(state_path(stopped.lora_path))
    assert state.optimizer_name == optimizer and state.optimizer["state"]
    assert (state.ema is not None) == bool(knobs)
    resumed = run(tmp_path / "parts", "run", optimizer, steps=6, resume_from=state_path(stopped.lora_path), **knobs)
    assert resumed.losses == whole.losses
    assert same(resumed.lora_state_dict, whole.lora_state_dict)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU")
@pytest.mark.parametrize("name", ["Prodigy", "AdamWScheduleFree", "CAME"])
def test_graphed_steps_with_each_optimizer_train_like_eager_steps(name):
    """On the GPU machine: the fast path's replayed steps with each optimizer (Prodigy flat, as the trainer builds
    it) give the eager steps' losses and weights (tolerance as test_fast_path's fp32 AdamW)."""
    from test_fast_path import _train
    device = torch.device("cuda")
    eager_losses, eager_weights, _ = _train(device, graphed=False, optimizer_name=name, flat=name == "Prodigy")
    graphed_losses, graphed_weights, micro = _train(device, graphed=True, optimizer_name=name, flat=name == "Prodigy")
    assert micro.graphs
    assert graphed_losses == pytest.approx(eager_losses, rel=1e-4)
    for eager, graphed in zip(eager_weights, graphed_weights):
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-5)


# --- EMA ----------------------------------------------------------------------------------------------------------

def test_the_ema_is_the_saved_lora_and_follows_its_formula(tmp_path):
    """ema_decay 0.9 over 6 steps, a state saved after each: the file is the average of the weights after each step
    (read from those states), with diffusers' warm-up min(decay, (1 + t) / (10 + t)), from the initial weights;
    the raw weights exported differ."""
    outcome = run(tmp_path, "ema", "AdamW", save_every_steps=1, ema_decay=0.9)
    folder = outcome.lora_path.parent
    states = [load_training_state(state_path(folder / f"ema_step{step}.safetensors")) for step in range(1, 6)]
    states.append(load_training_state(state_path(outcome.lora_path)))
    adapter = TinyAdapter()
    unet = adapter.training_unet()
    average = torch.cat([p.detach().reshape(-1) for p in inject_lora(unet, LORA, 0, adapter.lora_targets(unet, None))])
    for t, state in enumerate(states):
        assert state.step == t + 1
        rate = min(0.9, (1 + t) / (10 + t))
        average = rate * average + (1 - rate) * torch.cat([w.reshape(-1) for w in state.lora])
        torch.testing.assert_close(state.ema["average"], average)
    final = states[-1]
    assert final.ema["updates"] == 6
    sizes = [p.numel() for p in final.lora]
    assert same(outcome.lora_state_dict, export([part.view_as(p) for part, p in
                                                 zip(final.ema["average"].split(sizes), final.lora)]))
    assert not same(outcome.lora_state_dict, export(final.lora))
    assert "training options: ema_decay 0.9" in outcome.report
    # the average is one more fp32 copy of the LoRA in the memory estimate and in auto-fit's static plan
    plain = run(tmp_path / "plain", "plain", "AdamW")
    lora_bytes = 4 * sum(sizes)
    assert outcome.run.estimate.lora_parameters == plain.run.estimate.lora_parameters + lora_bytes
    from trainer.memory.fit import static_bytes
    no_weights = lambda dtype, base, share: 0  # noqa: E731
    assert static_bytes(EAGER, no_weights, final.lora, ema=True) == \
        static_bytes(EAGER, no_weights, final.lora) + lora_bytes


def test_ema_with_schedule_free_and_bad_decays_are_refused(tmp_path):
    with pytest.raises(LeanLoRAError, match=r"^ema_decay: got 0.9 with optimizer AdamWScheduleFree"):
        run(tmp_path, "both", "AdamWScheduleFree", ema_decay=0.9)
    for decay in (-0.1, 0.2, 1.0, float("nan")):
        with pytest.raises(LeanLoRAError, match=r"^ema_decay: got "):
            TrainSettings(ema_decay=decay)


# --- captions -----------------------------------------------------------------------------------------------------

TAGS = ["red circle", "blue background", "soft light", "flat colours", "centred"]


def tagged_dataset(folder: Path, trigger: str = "ohwx"):
    """The tiny dataset with comma-separated tag captions (each image's tags in its own order) and a trigger word."""
    import tiny_assets
    folder = tiny_assets.build_tiny_dataset(folder, n=4)
    for i, path in enumerate(sorted(folder.glob("*.txt"))):
        path.write_text(", ".join(TAGS[i:] + TAGS[:i]) + "\n")
    return scan_folder(folder, 64, trigger_word=trigger)


class CaptionRecorder(TinyAdapter):
    """The tiny adapter, noting the captions it encodes and, per training forward, the caption it was given."""

    def __init__(self):
        super().__init__()
        self.encoded: dict[str, torch.Tensor] = {}
        self.used: list[str] = []

    def encode_text(self, caption, width, height):
        cond = super().encode_text(caption, width, height)
        self.encoded[caption] = cond["context"]
        return cond

    def predict(self, unet, x, timestep, cond):
        if torch.is_grad_enabled():
            self.used += [next(text for text, context in self.encoded.items() if context.shape == row.shape
                               and torch.equal(context, row)) for row in cond["context"].split(1)]
        return super().predict(unet, x, timestep, cond)


def caption_run(tmp_path: Path, steps: int = 60, stop_after_steps=None, resume_from=None, **knobs):
    adapter = CaptionRecorder()
    events = []
    dataset = tagged_dataset(tmp_path / "data")
    outcome = train_lora(adapter, dataset, EAGER, LORA, TrainSettings(steps=steps, learning_rate=1e-3, seed=0,
                                                                      output_name="captions", resume_from=resume_from,
                                                                      **knobs),
                         tmp_path / "out", lambda **event: events.append(event),
                         lambda: stop_after_steps is not None
                         and sum(e["kind"] == "step" for e in events) >= stop_after_steps)
    return outcome, adapter, dataset


def test_a_caption_variant_keeps_the_trigger_and_the_first_tags_and_varies_the_rest():
    from trainer.captions import CaptionOptions, caption_variant
    caption = "ohwx, " + ", ".join(TAGS)
    generator = torch.Generator().manual_seed(0)
    shuffled = [caption_variant(caption, "ohwx", CaptionOptions(shuffle_tags=True, keep_tokens=2), generator)
                for _ in range(50)]
    for variant in shuffled:
        tags = variant.split(", ")
        assert tags[:3] == ["ohwx", *TAGS[:2]] and sorted(tags[3:]) == sorted(TAGS[2:])
    assert len(set(shuffled)) == 6  # every order of the 3 free tags appears
    dropped = [caption_variant(caption, "ohwx", CaptionOptions(tag_dropout=0.3, keep_tokens=1), generator)
               for _ in range(2000)]
    kept = [len(variant.split(", ")) - 2 for variant in dropped]  # free tags left of 4
    assert all(variant.startswith(f"ohwx, {TAGS[0]}") for variant in dropped)
    assert sum(kept) / (4 * len(kept)) == pytest.approx(0.7, abs=0.03)
    assert caption_variant("ohwx", "ohwx", CaptionOptions(tag_dropout=0.9), generator) == "ohwx"


def test_a_seeded_run_trains_on_seeded_caption_variants_and_drops_captions_at_the_rate(tmp_path):
    knobs = {"shuffle_tags": True, "keep_tokens": 1, "tag_dropout": 0.2, "caption_dropout": 0.25,
             "caption_variants": 3}
    outcome, adapter, dataset = caption_run(tmp_path, **knobs)
    from trainer.captions import caption_variants
    settings = TrainSettings(**knobs)
    allowed = {text for i, sample in enumerate(dataset.samples)
               for text in caption_variants(sample.caption, "ohwx", settings.caption_options(), 0, i)}
    written = {sample.caption for sample in dataset.samples}
    assert set(adapter.encoded) == allowed | written | {"ohwx"}  # encoded once each, before training
    assert len(adapter.used) == 60 and set(adapter.used) <= allowed | {"ohwx"}
    dropped = adapter.used.count("ohwx") / 60
    assert 0.1 < dropped < 0.45  # 0.25 of 60 draws (binomial: 15 +- 3.4)
    varied = [text for text in adapter.used if text != "ohwx"]
    assert len(set(varied)) >= 6 and not set(varied) <= written  # the variants, not the captions as written
    first_tags = {sample.caption.split(", ")[1] for sample in dataset.samples}
    assert all(text.split(", ")[1] in first_tags for text in varied)  # keep_tokens 1: each image's first tag
    assert "captions: 3 variants per image + the dropped caption" in outcome.report
    from safetensors import safe_open
    with safe_open(str(outcome.lora_path), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_shuffle_caption"], meta["ss_keep_tokens"], meta["ss_caption_tag_dropout_rate"],
            meta["ss_caption_dropout_rate"]) == ("True", "1", "0.2", "0.25")
    again, adapter_again, _ = caption_run(tmp_path / "again", **knobs)
    assert adapter_again.used == adapter.used and again.losses == outcome.losses  # seeded
    plain, plain_adapter, _ = caption_run(tmp_path / "plain")
    assert set(plain_adapter.used) <= written and set(plain_adapter.encoded) == written  # off: as written, as before


def test_exact_resume_keeps_the_caption_draws(tmp_path):
    knobs = {"shuffle_tags": True, "tag_dropout": 0.2, "caption_dropout": 0.25}
    whole, whole_adapter, _ = caption_run(tmp_path / "whole", steps=8, **knobs)
    stopped, _, _ = caption_run(tmp_path / "parts", steps=8, stop_after_steps=3, **knobs)
    resumed, resumed_adapter, _ = caption_run(tmp_path / "parts", steps=8, resume_from=state_path(stopped.lora_path),
                                              **knobs)
    assert resumed_adapter.used == whole_adapter.used[3:]
    assert resumed.losses == whole.losses and same(resumed.lora_state_dict, whole.lora_state_dict)


def test_caption_settings_name_the_field():
    for knobs, field in (({"tag_dropout": 1.0}, "tag_dropout"), ({"caption_dropout": -0.1}, "caption_dropout"),
                         ({"keep_tokens": 2}, "keep_tokens"),
                         ({"keep_tokens": -1, "shuffle_tags": True}, "keep_tokens"),
                         ({"caption_variants": 0}, "caption_variants"), ({"shuffle_tags": "yes"}, "shuffle_tags")):
        with pytest.raises(LeanLoRAError, match=rf"^{field}: got "):
            TrainSettings(**knobs)


def test_batches_group_the_drawn_captions_by_their_encoded_length(tmp_path):
    """Tag dropout shortens captions, and the tiny text encoder gives a row per word: batches of 2 hold one length,
    so no context is padded or repeated (the repeat that makes CLIP contexts stackable is for 77-token multiples)."""
    from trainer.cache import Batches, CachedSample
    texts = [{"context": torch.zeros(1, n, 8)} for n in (3, 4, 5)]
    cache = [CachedSample(torch.full((1, 4, 2, 2), float(i)), texts[2], f"{i}.png", tuple(texts), texts[0])
             for i in range(6)]
    data = Batches(cache, 2, 2, torch.Generator().manual_seed(0), ("context",), caption_dropout=0.3)
    lengths = set()
    for _ in range(30):
        _, cond = next(data)
        lengths.add(cond["context"].shape[1])
    assert lengths <= {3, 4, 5} and len(lengths) == 3


# --- multires noise -----------------------------------------------------------------------------------------------

def _kohya_pyramid(noise, generator, iterations, discount):
    """kohya-ss/sd-scripts library/custom_train_functions.py pyramid_noise_like, its r drawn from `generator`."""
    b, c, w, h = noise.shape
    upsample = torch.nn.Upsample(size=(w, h), mode="bilinear")
    noise = noise.clone()
    for i in range(iterations):
        r = float(torch.rand((), generator=generator)) * 2 + 2
        wn, hn = max(1, int(w / (r ** i))), max(1, int(h / (r ** i)))
        noise += upsample(torch.randn(b, c, wn, hn, generator=generator)) * discount ** i
        if wn == 1 or hn == 1:
            break
    return noise / noise.std()


def test_multires_noise_is_kohyas_pyramid_after_the_same_noise_levels():
    from test_pure_torch_training import EpsSchedule
    from trainer.objective import draw_noise, sample_sigmas
    shape = torch.Size((2, 4, 32, 32))
    plain = draw_noise(EpsSchedule(), shape, torch.Generator().manual_seed(5))
    pyramid = draw_noise(EpsSchedule(), shape, torch.Generator().manual_seed(5), multires_iterations=6,
                         multires_discount=0.3)
    assert torch.equal(plain["sigma"], pyramid["sigma"])
    replay = torch.Generator().manual_seed(5)
    white = torch.randn(shape, generator=replay)
    sample_sigmas(EpsSchedule(), 2, replay)
    torch.testing.assert_close(pyramid["noise"], _kohya_pyramid(white, replay, 6, 0.3))
    # the coarse levels make neighbouring pixels alike (white noise: uncorrelated), more for a larger discount
    def neighbours(noise):
        return torch.corrcoef(torch.stack([noise[..., :-1].flatten(), noise[..., 1:].flatten()]))[0, 1].item()
    strong = draw_noise(EpsSchedule(), shape, torch.Generator().manual_seed(5), multires_iterations=6,
                        multires_discount=0.8)["noise"]
    assert abs(neighbours(plain["noise"])) < 0.03 and neighbours(pyramid["noise"]) > neighbours(plain["noise"])
    assert neighbours(strong) > 0.2
    assert pyramid["noise"].std().item() == pytest.approx(1.0, abs=1e-5)


def test_multires_noise_changes_the_seeded_run_and_is_recorded(tmp_path):
    from safetensors import safe_open
    plain = run(tmp_path / "plain", "plain")
    multires = run(tmp_path / "multires", "multires", multires_noise_iterations=6, multires_noise_discount=0.2)
    assert multires.losses != plain.losses
    assert "training options: multires_noise_iterations 6, multires_noise_discount 0.2" in multires.report
    with safe_open(str(multires.lora_path), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_multires_noise_iterations"], meta["ss_multires_noise_discount"]) == ("6", "0.2")
    for knobs, field in (({"multires_noise_iterations": -1}, "multires_noise_iterations"),
                         ({"multires_noise_discount": 0}, "multires_noise_discount")):
        with pytest.raises(LeanLoRAError, match=rf"^{field}: got "):
            TrainSettings(**knobs)


# --- masked loss --------------------------------------------------------------------------------------------------

def masked_dataset(folder: Path):
    """The tiny dataset: img_001 (80x64) with a mask file whose left quarter is white, img_002 (64x96) with an alpha
    channel whose top quarter is opaque, the others without a mask. Framed to 64x64 by center crops, the white
    ends at column 12 and the opaque at row 8 (a squashing resize would put both at 16)."""
    import tiny_assets
    from PIL import Image
    folder = tiny_assets.build_tiny_dataset(folder, n=4)
    images = sorted(p for p in folder.glob("*.png"))
    with Image.open(images[1]) as image:
        mask = Image.new("L", image.size, 0)
    mask.paste(255, (0, 0, mask.width // 4, mask.height))
    mask.save(images[1].with_name(images[1].stem + "_mask.png"))
    with Image.open(images[2]) as image:
        rgba = image.convert("RGBA")
    alpha = Image.new("L", rgba.size, 0)
    alpha.paste(255, (0, 0, rgba.width, rgba.height // 4))
    rgba.putalpha(alpha)
    rgba.save(images[2])
    return scan_folder(folder, 64)


def _black_masks(folder: Path, count: int):
    """The tiny dataset of 4 images, the first `count` with a mask file that is black all over."""
    import tiny_assets
    from PIL import Image
    folder = tiny_assets.build_tiny_dataset(folder, n=4)
    for image in sorted(folder.glob("*.png"))[:count]:
        Image.new("L", (64, 64), 0).save(image.with_name(image.stem + "_mask.png"))
    return scan_folder(folder, 64)


def test_masks_that_exclude_every_pixel_are_refused_before_training(tmp_path):
    """Issue 45: before, every mask black trained a loss of 0.0000 and saved a LoRA whose lora_up stayed zero."""
    events = []
    with pytest.raises(LeanLoRAError, match=r"masked_loss: the loss mask of every image excludes every pixel "
                                            r"\(img_000.png, img_001.png, img_002.png, img_003.png\).*set masked_loss off"):
        run(tmp_path / "all", "all_black", dataset=_black_masks(tmp_path / "data", 4), masked_loss=True, events=events)
    assert not any(event["kind"] == "step" for event in events) and not list((tmp_path / "all").rglob("*.safetensors"))
    some = run(tmp_path / "some", "some_black", dataset=_black_masks(tmp_path / "data2", 2), masked_loss=True, steps=2)
    assert "WARNING: the loss masks of 2 images exclude every pixel, so they teach nothing: img_000.png, " \
           "img_001.png" in some.report


def test_masks_come_from_the_mask_file_or_the_alpha_framed_like_the_image(tmp_path):
    from trainer.dataset import load_mask
    dataset = masked_dataset(tmp_path / "data")
    assert [s.path.name for s in dataset.samples] == [f"img_{i:03d}.png" for i in range(4)]  # the mask is no image
    mask, where = load_mask(dataset.samples[1].path, (64, 64))
    assert where == "mask file"
    columns = mask.mean(dim=0)
    assert torch.all(columns[:11] > 0.99) and torch.all(columns[13:] < 0.01)
    alpha, where = load_mask(dataset.samples[2].path, (64, 64))
    rows = alpha.mean(dim=1)
    assert where == "alpha channel" and torch.all(rows[:7] > 0.99) and torch.all(rows[9:] < 0.01)
    assert load_mask(dataset.samples[0].path, (64, 64)) == (None, "")


def test_the_masked_loss_is_the_mean_over_the_mask_and_ignores_what_is_outside():
    from trainer.objective import LossFunction, LossKind
    g = torch.Generator().manual_seed(0)
    output, target = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    mask = torch.zeros(2, 1, 8, 8)
    mask[0, :, :, :4] = 1.0
    mask[1, :, :2] = 0.5
    sigma = torch.ones(2)
    loss = LossFunction(LossKind.MSE)(output, target, sigma, mask)
    squared = (output - target) ** 2
    expected = torch.stack([squared[0, :, :, :4].mean(), squared[1, :, :2].mean()]).mean()
    torch.testing.assert_close(loss, expected)
    changed = output.clone()
    changed[0, :, :, 4:] += 10.0  # outside the mask: no effect
    assert torch.equal(LossFunction(LossKind.MSE)(changed, target, sigma, mask), loss)
    assert not torch.allclose(LossFunction(LossKind.MSE)(changed, target, sigma), LossFunction(LossKind.MSE)(
        output, target, sigma))


def test_a_masked_run_trains_on_the_masks_and_says_where_they_came_from(tmp_path):
    dataset = masked_dataset(tmp_path / "data")
    masked = run(tmp_path / "masked", "masked", dataset=dataset, masked_loss=True, steps=8)
    plain = run(tmp_path / "plain", "plain", dataset=dataset, steps=8)
    assert masked.losses != plain.losses
    assert ("masked loss: 1 images masked by <image>_mask.png, 1 by their alpha channel, 2 without a mask"
            in masked.report)
    # without any mask, masked_loss weighs every pixel alike: the plain loss, up to the order of the sums
    unmasked = tmp_path / "none"
    bare = run(unmasked / "a", "bare", steps=8)
    bare_masked = run(unmasked / "b", "bare_masked", masked_loss=True, steps=8)
    assert bare_masked.losses == pytest.approx(bare.losses, rel=1e-5)
    from safetensors import safe_open
    with safe_open(str(masked.lora_path), "pt") as f:
        assert f.metadata()["ss_masked_loss"] == "True"
    # a changed mask file is another dataset: its state does not resume on it
    from trainer.training_state import dataset_fingerprint
    before = dataset_fingerprint(dataset)
    from PIL import Image
    mask_file = dataset.samples[1].path.with_name("img_001_mask.png")
    Image.new("L", (80, 64), 255).save(mask_file)
    assert dataset_fingerprint(dataset) != before


# --- the Train node ---------------------------------------------------------------------------------------------

OPTIONS = {"ema_decay": 0.0, "shuffle_tags": False, "keep_tokens": 0, "tag_dropout": 0.0, "caption_dropout": 0.0,
           "caption_variants": 4, "multires_noise_iterations": 0, "multires_noise_discount": 0.3, "masked_loss": False}


@pytest.mark.comfy
def test_the_train_node_takes_the_options_last_and_advanced_and_records_them(comfy_server):
    from safetensors import safe_open
    from comfy_headless import execution_error
    from test_node_ux import train_only_prompt
    info = comfy_server.object_info()["LeanLoRATrain"]["input"]["optional"]
    names = list(info)
    assert names[-len(OPTIONS):] == list(OPTIONS) and names[-len(OPTIONS) - 1] == "huber_c"
    assert all(info[name][1].get("advanced") and info[name][1]["default"] == value for name, value in OPTIONS.items())
    prompt = train_only_prompt(steps=3, output_name="options_node", ema_decay=0.9, shuffle_tags=True,
                               tag_dropout=0.1, caption_dropout=0.2, caption_variants=2, multires_noise_iterations=4,
                               masked_loss=True)
    entry = comfy_server.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    report = entry["outputs"]["5"]["text"][0]
    assert ("training options: ema_decay 0.9, shuffle_tags true, tag_dropout 0.1, caption_dropout 0.2, "
            "caption_variants 2, multires_noise_iterations 4, masked_loss true") in report
    assert "captions: 2 variants per image + the dropped caption" in report and "masked loss: 0 images" in report
    with safe_open(str(comfy_server.base_dir / "models" / "loras" / "options_node.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["leanlora_ema_decay"], meta["ss_shuffle_caption"], meta["ss_caption_dropout_rate"],
            meta["ss_multires_noise_iterations"], meta["ss_masked_loss"]) == ("0.9", "True", "0.2", "4", "True")
