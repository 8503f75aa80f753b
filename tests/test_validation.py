"""Validation loss (issue 17 item 5): a held-out share of the images with fixed noise and timesteps, evaluated every
N steps, in process on the tiny SD1.5 checkpoint through ComfyUI's own objects (CPU, fp32: every number is
reproducible)."""
import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy
import pytest
import torch
from safetensors.torch import load_file

import tiny_assets as tiny_assets_lib
from comfy_headless import execution_error
from test_node_ux import train_only_prompt
from test_resume import _assert_same_lora_file
from trainer.cache import CachedSample, build_cache
from trainer.dataset import scan_folder
from trainer.errors import LeanLoRAError
from trainer.lora import inject_lora
from trainer.session import TrainingSession
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX, load_training_state
from trainer.validation import ValidationSet, held_out_count, split_validation
from helpers import sd_targets  # noqa: E402

FP32 = MemorySettings("no", False, batch_size=1, gradient_accumulation=1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def three_images(tmp_path_factory):
    """Three images at 64 px: one held out, two to train on (an epoch of two batches, so resumes land mid-epoch)."""
    return scan_folder(tiny_assets_lib.build_tiny_dataset(tmp_path_factory.mktemp("three"), n=3), 64)


def _train(adapter, dataset, folder: Path, steps: int, lora=LoraSettings(rank=4, alpha=4.0), events=None, **train):
    emit = (lambda **event: events.append(event)) if events is not None else (lambda **event: None)
    settings = TrainSettings(steps, 1e-3, 0, "validated", "cosine", 1, **train)
    return train_lora(adapter, dataset, FP32, lora, settings, folder, emit, lambda: False)


def _fake_cache(n: int) -> list[CachedSample]:
    return [CachedSample(torch.full((1, 4, 2, 2), float(i)), {"c_crossattn": torch.zeros(1, 77, 8)}, f"img_{i}.png")
            for i in range(n)]


def test_the_settings_name_the_field_and_what_to_do():
    for bad in (1.0, -0.1, 1.5, True):
        with pytest.raises(LeanLoRAError, match=r"validation_fraction: got .*use 0 \(off\) or a share below 1"):
            TrainSettings(validation_fraction=bad)
    with pytest.raises(LeanLoRAError, match=r"validation_every_n_steps: got -1; use 0 \(at the end only\)"):
        TrainSettings(validation_fraction=0.1, validation_every_steps=-1)
    assert TrainSettings().validation_fraction == 0 and TrainSettings().validation_every_steps == 50


def test_the_split_holds_out_at_least_one_leaves_one_and_is_fixed_by_the_seed():
    assert [held_out_count(f, 20) for f in (0, 0.01, 0.1, 0.5)] == [0, 1, 2, 10]
    for fraction, images in ((0.5, 1), (0.9, 2), (0.99, 20)):
        with pytest.raises(LeanLoRAError, match=f"validation_fraction: {fraction:g} of {images} usable image.*"
                                                "leaves none to train on"):
            held_out_count(fraction, images)
    cache = _fake_cache(20)
    torch_rng = torch.get_rng_state()
    kept, held = split_validation(cache, 0.1, seed=7)
    assert torch.equal(torch.get_rng_state(), torch_rng)  # its own generator: the process-wide one is untouched
    assert len(held) == 2 and len(kept) == 18 and held == sorted(held)
    assert kept == [sample for i, sample in enumerate(cache) if i not in held]  # training keeps its cache order
    assert split_validation(cache, 0.1, seed=7) == (kept, held)  # the same seed holds out the same images
    assert len({tuple(split_validation(cache, 0.1, seed)[1]) for seed in range(8)}) > 1  # the seed chooses
    assert split_validation(cache, 0, seed=7) == (cache, [])


def test_an_evaluation_is_repeatable_and_changes_nothing_training_uses(adapter, three_images):
    """Two evaluations at the same weights give the same value, with LoRA dropout on (eval mode), and leave the
    training generator, the process-wide RNG, the gradients and train mode as they were; the value is the
    training objective's loss on the fixed draws."""
    cache = build_cache(three_images, adapter.encode_image, adapter.encode_text)
    unet = adapter.training_unet()
    try:
        lora = LoraSettings(rank=4, alpha=4.0, dropout=0.5)
        params = inject_lora(unet, lora, 0, target_modules=sd_targets(lora))
        with torch.no_grad():  # lora_up starts at zero, where dropout would change nothing
            generator = torch.Generator().manual_seed(1)
            for param in params:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
        session = TrainingSession(adapter, unet, params, cache[1:], 1, TrainSettings(4, 1e-3, 0))
        session.configure(FP32)
        unet.train()
        validation = ValidationSet.build(cache[:1], 0, session.sampling_on_cpu, 0)
        sampler, process_wide = session.generator.get_state(), torch.get_rng_state()
        first = validation.evaluate(session.forward_loss, 3)
        second = validation.evaluate(session.forward_loss, 3)
        assert first == second and validation.losses == [(3, first), (3, first)]
        assert torch.equal(session.generator.get_state(), sampler)
        assert torch.equal(torch.get_rng_state(), process_wide)
        assert all(p.grad is None for p in params) and unet.training
        unet.eval()  # the same objective by hand, dropout off
        with torch.no_grad():
            by_hand = [session.compute_loss({"clean": cache[0].latent, **draw, "cond.c_crossattn":
                                             cache[0].cond["c_crossattn"]}).item() for draw in validation.draws[0]]
        assert len(by_hand) == 4 and first == pytest.approx(sum(by_hand) / 4, rel=1e-6)
        unet.train()
        with torch.no_grad():  # in train mode dropout draws: the same forward differs (what eval mode avoids)
            inputs = {"clean": cache[0].latent, **validation.draws[0][0], "cond.c_crossattn": cache[0].cond["c_crossattn"]}
            assert session.compute_loss(inputs).item() != session.compute_loss(inputs).item()
    finally:
        adapter.free(unet)


def test_validation_at_every_n_steps_and_the_end_leaves_the_training_losses_unchanged(adapter, three_images, tmp_path):
    """With validation on, training sees exactly the images left: the same losses and LoRA as a run without
    validation on a dataset of only those images (same seed; LoRA dropout on, so an evaluation that drew from
    the process-wide RNG would change the training losses too)."""
    lora = LoraSettings(rank=4, alpha=4.0, dropout=0.1)
    events = []
    torch.manual_seed(5)  # dropout draws from the process-wide RNG, which no run seeds: both runs start here
    validated = _train(adapter, three_images, tmp_path / "on", 7, lora, events, validation_fraction=0.3,
                       validation_every_steps=3)
    _, held = split_validation(list(range(3)), 0.3, 0)
    held_names = [three_images.samples[i].path.name for i in held]
    assert len(held_names) == 1
    assert f"validation: 1 of 3 images held out, 4 fixed noise and timestep draws each, evaluated every 3 steps " \
           f"and at the end: {held_names[0]}" in validated.report
    steps = [step for step, _ in validated.validation_losses]
    assert steps == [3, 6, 7]
    assert [(e["step"], e["loss"]) for e in events if e["kind"] == "validation"] == validated.validation_losses
    kinds = [(e["kind"], e["step"]) for e in events if e["kind"] in ("step", "validation")]
    assert kinds.index(("validation", 3)) == kinds.index(("step", 3)) + 1  # measured right after step 3
    assert all(value > 0 for _, value in validated.validation_losses)
    first, last = validated.validation_losses[0][1], validated.validation_losses[-1][1]
    assert f"validation loss: first {first:.4f} (step 3), last {last:.4f} (step 7), 3 evaluations" in validated.report

    remaining = replace(three_images, samples=tuple(s for s in three_images.samples if s.path.name not in held_names))
    torch.manual_seed(5)
    plain = _train(adapter, remaining, tmp_path / "off", 7, lora)
    assert plain.validation_losses == [] and "validation loss" not in plain.report
    assert validated.losses == plain.losses
    on, off = load_file(validated.lora_path), load_file(plain.lora_path)
    assert on.keys() == off.keys() and all(torch.equal(on[key], off[key]) for key in off)


def test_a_resumed_run_continues_the_same_validation_curve_bit_identically(adapter, three_images, tmp_path):
    options = dict(validation_fraction=0.3, validation_every_steps=2)
    straight = _train(adapter, three_images, tmp_path / "straight", 10, save_every_steps=3, **options)
    assert [step for step, _ in straight.validation_losses] == [2, 4, 6, 8, 10]
    folder = tmp_path / "straight"
    assert load_training_state(folder / f"validated_step3{STATE_SUFFIX}").validation_losses == \
        straight.validation_losses[:1]
    # evaluated before the save of the same step, so the state written there holds it
    assert load_training_state(folder / f"validated_step6{STATE_SUFFIX}").validation_losses == \
        straight.validation_losses[:3]
    resumed = _train(adapter, three_images, tmp_path / "resumed", 10,
                     resume_from=folder / f"validated_step3{STATE_SUFFIX}", **options)
    assert resumed.validation_losses == straight.validation_losses  # every value bit for bit
    assert resumed.losses == straight.losses
    _assert_same_lora_file(resumed.lora_path, straight.lora_path)
    with pytest.raises(LeanLoRAError, match="images held out for validation differ"):
        _train(adapter, three_images, tmp_path / "x", 10, resume_from=folder / f"validated_step3{STATE_SUFFIX}")


def test_a_validation_out_of_memory_is_skipped_and_said_and_training_goes_on(adapter, three_images, tmp_path):
    predict, calls = adapter.predict, {"evaluations": 0}

    def short_of_memory_at_the_first_evaluation(unet, x, t, cond):
        if not torch.is_grad_enabled():  # only validation's forwards run without gradients
            calls["evaluations"] += 1
            if calls["evaluations"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return predict(unet, x, t, cond)
    adapter.predict = short_of_memory_at_the_first_evaluation
    outcome = _train(adapter, three_images, tmp_path, 4, validation_fraction=0.3, validation_every_steps=2)
    assert not outcome.partial and len(outcome.losses) == 4
    assert "WARNING: the validation loss at step 2 ran out of GPU memory and was skipped" in outcome.report
    assert [step for step, _ in outcome.validation_losses] == [4]


def test_the_loss_plot_draws_the_validation_curve_beside_the_training_loss():
    spec = importlib.util.spec_from_file_location("leanlora_plot_under_test", REPO / "nodes" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    losses = [1.0 / (1 + i) for i in range(20)]
    green = lambda image: int((numpy.asarray(image) == plot.VALIDATION).all(axis=-1).sum())  # noqa: E731
    assert green(plot.loss_chart(losses)) == 0
    with_validation = plot.loss_chart(losses, validation=[(5, 0.9), (10, 0.8), (20, 0.85)])
    assert green(with_validation) > 30  # three dots and the line between them
    right_half = with_validation.crop((with_validation.width // 2, 0, with_validation.width, with_validation.height))
    assert green(right_half) > 0  # step 20 is drawn at the right end, on the training loss's step axis


@pytest.mark.comfy
def test_the_train_node_holds_out_validation_images_through_a_real_server(comfy_server):
    info = comfy_server.object_info()["LeanLoRATrain"]["input"]["optional"]
    names = list(info)  # the validation inputs, then the timesteps and loss knobs and the later options
    start = names.index("validation_fraction")
    assert names[start:start + 3] == ["validation_fraction", "validation_every_n_steps", "noise_offset"]
    log_start = len(comfy_server.log_text())
    prompt = train_only_prompt(steps=4, output_name="validated_node", validation_fraction=0.2,
                               validation_every_n_steps=2)
    entry = comfy_server.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    report = entry["outputs"]["5"]["text"][0]
    assert "validation: 1 of 6 images held out" in report and "evaluated every 2 steps and at the end" in report
    assert "validation loss: first" in report and "(step 2), last" in report and "(step 4), 2 evaluations" in report
    log = comfy_server.log_text()[log_start:]
    assert "LeanLoRA: step 2 validation loss" in log and "LeanLoRA: step 4 validation loss" in log
