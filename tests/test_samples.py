"""Sample images while training (issue 17, item 4): the sample settings' checks, and train_lora with ComfyUI's
own sampling on the tiny SD1.5 checkpoint in this process, from a training thread like the Train node's job."""
import hashlib
import re
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import comfy.model_management
import comfy.sample

from bridge.comfy_adapter import ComfyAdapter
from bridge.samples import SampleRenderer
from trainer.errors import LeanLoRAError
from trainer.settings import LoraSettings, MemorySettings, SampleSettings, TrainSettings
from trainer.train_lora import train_lora
from helpers import in_a_training_thread

MEMORY = MemorySettings("no", False)
LORA = LoraSettings(rank=4, alpha=4.0, dropout=0.1)  # dropout draws from torch's global generator, as sampling does
SAMPLES = SampleSettings(("lnlr, a red circle", "a blue square"), every_steps=2, size=64, steps=3, cfg=5.0, seed=3)


@pytest.mark.parametrize("values, field, says", [
    (dict(every_steps=-1), "sample_every_n_steps", "use 0 (off) or more"),
    (dict(prompts=(), every_steps=5), "sample_prompts", "no prompt"),
    (dict(size=100), "sample_size", "multiple of 64"),
    (dict(size=0), "sample_size", "multiple of 64"),
    (dict(steps=0), "sample_steps", "1 to 1000"),
    (dict(cfg=-1.0), "sample_cfg", "0 to 100"),
    (dict(cfg=float("nan")), "sample_cfg", "0 to 100"),
    (dict(seed=-3), "sample_seed", "0 or a positive integer"),
])
def test_bad_sample_values_fail_naming_the_field(values, field, says):
    with pytest.raises(LeanLoRAError, match=rf"^{field}: .*{re.escape(says)}"):
        SampleSettings(**{"prompts": ("a prompt",), "every_steps": 2, **values})


def test_prompts_are_one_per_line_and_no_prompts_is_off():
    settings = SampleSettings.from_text("  lnlr, a cat \n\n a dog\n", every_steps=4)
    assert settings.prompts == ("lnlr, a cat", "a dog") and settings.on
    assert not SampleSettings.from_text("a prompt", every_steps=0).on
    assert not SampleSettings.from_text("").on


def test_the_train_node_checks_the_sample_inputs_before_anything_runs():
    """Bad sample inputs fail the node first: here with no model connected, which would fail next."""
    from helpers import node_module
    node = node_module("train").LeanLoRATrain
    optional = node.INPUT_TYPES()["optional"]
    names = list(optional)  # after resume, in this order (saved workflows keep their widget positions)
    start = names.index("sample_prompts")
    assert names[start - 1] == "resume" and names[start:start + 6] == [
        "sample_prompts", "sample_every_n_steps", "sample_size", "sample_steps", "sample_cfg", "sample_seed"]
    assert optional["sample_seed"][1]["control_after_generate"] is False
    assert optional["sample_prompts"][1]["multiline"] is True
    errors = __import__("leanlora_nodes_under_test.trainer.errors", fromlist=["LeanLoRAError"])
    with pytest.raises(errors.LeanLoRAError, match=r"^sample_size: got 100"):
        node().execute(None, None, None, None, MEMORY, LORA, 6, 1e-3, "constant", 0, 0, "x",
                       sample_prompts="a cat", sample_every_n_steps=2, sample_size=100)
    with pytest.raises(errors.LeanLoRAError, match=r"the model input is empty"):  # sampling off: the next check
        node().execute(None, None, None, None, MEMORY, LORA, 6, 1e-3, "constant", 0, 0, "x",
                       sample_prompts="a cat", sample_every_n_steps=0, sample_size=64)




def _base_weights_digest(model) -> str:
    digest = hashlib.sha256()
    with torch.inference_mode():
        for name, tensor in model.model.state_dict().items():
            digest.update(name.encode() + tensor.float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _train(comfy_objects, dataset, folder, name, renderer=None, events=None, steps=6):
    events = [] if events is None else events

    def work():
        torch.manual_seed(0)  # LoRA dropout draws from the global generator, which train_lora does not seed
        return train_lora(ComfyAdapter(*comfy_objects), dataset, MEMORY, LORA, TrainSettings(steps, 1e-3, 0, name),
                          folder, lambda **event: events.append(event), lambda: False,
                          sample_every=SAMPLES.every_steps, on_sample=renderer)
    return in_a_training_thread(work)


def test_samples_render_every_n_steps_between_steps_and_leave_the_run_and_the_model_as_they_were(
        comfy_objects, dataset, tmp_path, monkeypatch):
    model, clip, vae = comfy_objects
    before = _base_weights_digest(model)
    plain = _train(comfy_objects, dataset, tmp_path / "loras", "plain")

    calls, inference = [], []
    for name in ("unload_all_models", "soft_empty_cache", "load_models_gpu"):
        real = getattr(comfy.model_management, name)

        def recorder(*args, _real=real, _name=name, **kwargs):
            inference.append((_name, torch.is_inference_mode_enabled()))
            return _real(*args, **kwargs)
        monkeypatch.setattr(comfy.model_management, name, recorder)
    renderer = SampleRenderer(model, clip, vae, SAMPLES, tmp_path / "samples")
    recording = lambda step, state_dict, allowed: calls.append((step, state_dict)) or renderer(step, state_dict, allowed)  # noqa: E731
    events = []
    outcome = _train(comfy_objects, dataset, tmp_path / "loras", "sampled", recording, events)

    # rendered at steps 2 and 4 between optimizer steps, and at 6 from the saved file's tensors
    assert [step for step, _ in calls] == [2, 4, 6]
    order = [(e["kind"], e["step"]) for e in events if e["kind"] in ("step", "sample")]
    assert order == [("step", 1), ("step", 2), ("sample", 2), ("step", 3), ("step", 4), ("sample", 4),
                     ("step", 5), ("step", 6), ("sample", 6)]
    final = load_file(str(outcome.lora_path))
    assert calls[-1][1].keys() == final.keys() and all(torch.equal(calls[-1][1][k], final[k]) for k in final)
    assert not all(torch.equal(calls[0][1][k], final[k]) for k in final)  # step 2's LoRA, not the final one
    files = sorted(p.name for p in (tmp_path / "samples").iterdir())
    assert files == [f"step{s}_{i}.png" for s in (2, 4, 6) for i in (0, 1)]
    assert [e["paths"] for e in events if e["kind"] == "sample"][0] == [str(tmp_path / "samples" / f"step2_{i}.png")
                                                                       for i in (0, 1)]
    with Image.open(tmp_path / "samples" / "step6_1.png") as image:
        assert image.size == (64, 64) and "a blue square" in image.text["parameters"]
    step2, step6 = (np.asarray(Image.open(tmp_path / "samples" / f"step{s}_0.png"), np.int16) for s in (2, 6))
    assert np.abs(step2 - step6).mean() > 0.5  # the LoRA at its current weights, not one fixed image
    assert "samples every 2 steps: 6 images rendered in " + str(tmp_path / "samples") in outcome.report

    # sampling left training as it was (ComfyUI reseeds torch's global generator), and the user's MODEL too
    assert outcome.losses == plain.losses
    assert torch.equal(load_file(str(plain.lora_path))[next(iter(final))], final[next(iter(final))])
    assert _base_weights_digest(model) == before
    assert {"load_models_gpu", "unload_all_models"} <= {n for n, _ in inference}
    assert all(on for _, on in inference), inference
    assert not comfy.model_management.current_loaded_models  # what sampling loaded is unloaded again


def test_a_sampling_failure_is_reported_and_training_goes_on(comfy_objects, dataset, tmp_path, monkeypatch):
    real, attempts = comfy.sample.sample, []

    def out_of_memory_at_first(*args, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(*args, **kwargs)
    monkeypatch.setattr(comfy.sample, "sample", out_of_memory_at_first)
    model, clip, vae = comfy_objects
    renderer = SampleRenderer(model, clip, vae, SAMPLES, tmp_path / "samples")
    outcome = _train(comfy_objects, dataset, tmp_path / "loras", "failing", renderer)
    assert not outcome.partial and len(outcome.losses) == 6 and outcome.lora_path.is_file()
    assert "WARNING: the samples at step 2 failed (OutOfMemoryError: CUDA out of memory" in outcome.report
    assert "training went on" in outcome.report and "; failed at steps 2" in outcome.report
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == [f"step{s}_{i}.png" for s in (4, 6)
                                                                          for i in (0, 1)]
    assert not comfy.model_management.current_loaded_models  # unloaded after the failure too


def test_cancel_while_sampling_stops_the_run_and_keeps_a_partial_lora(comfy_objects, dataset, tmp_path):
    def cancelled(step, state_dict, _allowed):
        raise comfy.model_management.InterruptProcessingException()
    outcome = _train(comfy_objects, dataset, tmp_path / "loras", "cancel_sampling", cancelled)
    assert outcome.partial and len(outcome.losses) == 2
    assert outcome.lora_path.name == "cancel_sampling_partial_step2.safetensors"


# --- issue 34: bounded and cancellable sampling, a folder per run ---

NO_LORA = {"lora_unet_unused.alpha": torch.tensor(1.0)}  # a LORA_MODEL that patches nothing: the base model's image


def test_sample_size_and_steps_beyond_the_familys_range_fail_before_training(comfy_objects):
    from trainer.settings import SD_SAMPLE_LIMITS, SampleLimits
    too_large = SampleSettings(("a cat",), every_steps=2, size=4096)
    with pytest.raises(LeanLoRAError, match=r"^sample_size: got 4096; SD1.x/SDXL samples are at most 2048 px .*lower "
                                            r"sample_size"):
        too_large.check_within(SD_SAMPLE_LIMITS)
    with pytest.raises(LeanLoRAError, match=r"^sample_steps: got 1000; .* at most 150 sampler steps .*lower sample_steps"):
        SampleSettings(("a cat",), every_steps=2, steps=1000).check_within()
    SampleSettings(("a cat",), every_steps=2, size=2048, steps=150).check_within()
    SampleSettings(("a cat",), every_steps=0, size=4096).check_within()  # sampling off: nothing to bound
    with pytest.raises(LeanLoRAError, match=r"^sample_size: got 1024; tiny samples are at most 512 px"):
        SampleSettings(("a cat",), every_steps=2, size=1024).check_within(SampleLimits("tiny", 512, 10, "256"))
    from helpers import node_module
    node = node_module("train").LeanLoRATrain
    errors = __import__("leanlora_nodes_under_test.trainer.errors", fromlist=["LeanLoRAError"])
    with pytest.raises(errors.LeanLoRAError, match=r"^sample_size: got 4096; SD1.x/SDXL samples"):
        # the node, with the MODEL's family known and before any model work (no dataset: that would fail next)
        node().execute(*comfy_objects, None, MEMORY, LORA, 6, 1e-3, "constant", 0, 0, "x",
                       sample_prompts="a cat", sample_every_n_steps=2, sample_size=4096)


def test_cancel_stops_a_sample_within_one_sampler_step(comfy_objects, tmp_path, monkeypatch):
    real, steps_run = comfy.sample.sample, []

    def counting(*args, callback=None, **kwargs):
        def each_step(step, *rest):
            steps_run.append(step)
            if callback is not None:
                callback(step, *rest)
        return real(*args, callback=each_step, **kwargs)
    monkeypatch.setattr(comfy.sample, "sample", counting)
    settings = SampleSettings(("a cat",), every_steps=1, size=64, steps=150, seed=1)
    renderer = SampleRenderer(*comfy_objects, settings, tmp_path / "samples", should_stop=lambda: len(steps_run) >= 2)
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        in_a_training_thread(lambda: renderer(1, NO_LORA))
    assert len(steps_run) == 2, f"the sampler went on for {len(steps_run)} of 150 steps after Cancel"
    assert not (tmp_path / "samples").exists()  # no image, no folder
    assert not comfy.model_management.current_loaded_models


@pytest.mark.parametrize("part", ["diffusion model", "VAE"])
def test_cancel_stops_a_sampler_step_or_a_decode_part_way(comfy_objects, tmp_path, part):
    """Issue 45: one sampler step (or the decode) at 2048 px takes minutes on a CPU, and /interrupt waited for it.
    Cancel pressed as the first block of a forward starts: none of its later blocks runs."""
    model, clip, vae = comfy_objects
    decoder = getattr(vae.first_stage_model, "taesd_decoder", None) or getattr(vae.first_stage_model, "decoder", None)
    root = model.model.diffusion_model if part == "diffusion model" else decoder
    blocks = [block for module in root.modules() if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
              for block in module.children()]
    cancelled, last_ran = [], []
    first = blocks[0].register_forward_pre_hook(lambda *_: cancelled.append(True))  # Cancel, mid-forward
    last = blocks[-1].register_forward_hook(lambda *_: last_ran.append(True))
    settings = SampleSettings(("a cat",), every_steps=1, size=64, steps=2, seed=1)
    renderer = SampleRenderer(model, clip, vae, settings, tmp_path / "samples", should_stop=lambda: bool(cancelled))
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            in_a_training_thread(lambda: renderer(1, NO_LORA))
    finally:
        first.remove()
        last.remove()
    assert cancelled and not last_ran, f"the {part}'s forward ran to its end after Cancel"
    assert not (tmp_path / "samples").exists()


def test_a_sample_slower_than_ten_training_steps_a_step_is_skipped_with_a_note(comfy_objects, dataset, tmp_path,
                                                                               monkeypatch):
    """Issue 45: a sampler step is estimated from the measured training step before a sample starts, and timed on
    its second step (the first loads the model); past 10 training steps' time the sample is not started or stops
    there, this and later samples are skipped with a note, and training goes on."""
    import trainer.train_lora as train_lora_module
    from trainer.train_lora import StepPace
    model, clip, vae = comfy_objects
    real = comfy.sample.sample

    def slow(*args, callback=None, **kwargs):  # each sampler step 50 ms slower
        def each_step(*rest):
            time.sleep(0.05)
            callback(*rest)
        return real(*args, callback=each_step, **kwargs)
    monkeypatch.setattr(comfy.sample, "sample", slow)
    monkeypatch.setattr(train_lora_module, "SAMPLE_STEP_BOUND", 1e-4)  # the bound, scaled down to this tiny model
    monkeypatch.setattr(train_lora_module, "MIN_SAMPLE_STEP_BOUND", 0.0)
    renderer = SampleRenderer(model, clip, vae, SAMPLES, tmp_path / "samples")
    events = []
    outcome = _train(comfy_objects, dataset, tmp_path / "loras", "too_slow", renderer, events)
    assert not outcome.partial and len(outcome.losses) == 6
    notes = [e["text"] for e in events if e["kind"] == "phase" and "samples skipped" in e["text"]]
    assert len(notes) == 1 and re.search(r"samples skipped from step 2 on: one sampler step at 64 px takes about "
                                         r"[\d.]+ s \(estimated from the training step's [\d.]+ s\), so 3 steps x 2 "
                                         r"images would take about [\d.]+ min", notes[0]), notes
    assert notes[0] in outcome.report and not any(e["kind"] == "sample" for e in events)
    assert not (tmp_path / "samples").exists()
    # estimated within the bound, measured past it: stopped at the second sampler step
    with pytest.raises(TimeoutError, match=r"takes about [\d.]+ s \(measured\)"):
        in_a_training_thread(lambda: renderer(1, NO_LORA, StepPace(0.001, 10 ** 9)))
    assert not (tmp_path / "samples").exists()
    assert len(in_a_training_thread(lambda: renderer(1, NO_LORA, None))) == 2  # no step measured yet: rendered


def test_two_runs_with_one_name_get_their_own_sample_folders(comfy_objects, tmp_path):
    settings = SampleSettings(("a cat",), every_steps=1, size=64, steps=2, seed=1)
    first = in_a_training_thread(lambda: SampleRenderer(*comfy_objects, settings, tmp_path / "my_lora")(1, NO_LORA))
    before = {path: path.read_bytes() for path in first}
    second_renderer = SampleRenderer(*comfy_objects, settings, tmp_path / "my_lora")
    second = in_a_training_thread(lambda: second_renderer(1, NO_LORA))
    later = in_a_training_thread(lambda: second_renderer(2, NO_LORA))  # a run keeps its folder
    assert first == [tmp_path / "my_lora" / "step1_0.png"]
    assert second == [tmp_path / "my_lora_2" / "step1_0.png"] and later == [tmp_path / "my_lora_2" / "step2_0.png"]
    assert {path: path.read_bytes() for path in first} == before


def test_the_job_manager_says_whether_the_running_job_was_cancelled():
    """What the Train node hands its sample renderer as should_stop."""
    from helpers import node_module
    import threading
    manager, release = node_module("jobs").JobManager(), threading.Event()
    assert not manager.cancelled()  # no job yet
    job = manager.start(lambda job: release.wait(30))
    assert not manager.cancelled()
    job.cancel()
    assert manager.cancelled()
    release.set()
    job.done.wait(30)
