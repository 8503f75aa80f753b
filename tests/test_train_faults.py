"""Faults in training and saving, and the behaviours small plausible bugs would break (issue 15): divergence,
unwritable folders, names, loss scaling, accumulation, atomic saves, the seed, warm-up, v-prediction, alpha.

Library-level tests first (small torch modules), then train_lora on the tiny ComfyUI checkpoint in this process."""
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import trainer.files as files
from trainer.errors import LeanLoRAError
from trainer.files import non_finite_tensors, sanitize_name, save_safetensors_atomic, save_with_fallback
from trainer.loop import StepParts, train_loop
from trainer.lora import inject_lora
from trainer.optimizers import build_lr_schedule
from trainer.step.precision import Precision
from trainer.settings import LoraSettings, MemorySettings, TrainSettings

from helpers import loop_events, regression_problem

CPU = torch.device("cpu")


def _mse(net):
    return lambda batch: torch.nn.functional.mse_loss(net(batch[0]).float(), batch[1])


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward, inf backward: a finite loss whose gradient overflows (what bf16 backward can do)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


# --- divergence (item 1) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sync_every, kept", [(1, 5), (4, 4)])
def test_a_nan_loss_stops_the_run_at_that_step_with_the_last_finite_weights(sync_every, kept):
    net, params, data, _ = regression_problem()
    after_step, calls = {}, []
    plain = _mse(net)

    def loss_fn(batch):
        calls.append(1)
        loss = plain(batch)
        return loss * float("nan") if len(calls) == 6 else loss

    def on_step(info):  # with sync_every 4, steps 1-4 are reported together, right after step 4
        after_step[info.step] = [p.detach().clone() for p in params]
    result = train_loop(StepParts(params, loss_fn, torch.optim.AdamW(params, lr=1e-2), Precision("no", CPU)), data,
                        20, loop_events(on_step=on_step, sync_every=sync_every))
    assert result.diverged_at == 6 and len(calls) <= 8  # stopped at the first read after the NaN
    assert result.steps_done == kept  # the last step whose weights were checked (and copied) finite
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.equal(p, q) for p, q in zip(params, after_step[kept]))
    assert len(result.losses) == 5 and all(math.isfinite(v) for v in result.losses)


def test_a_finite_loss_with_an_infinite_gradient_is_divergence_outside_fp16():
    net, params, data, _ = regression_problem()
    calls = []

    def loss_fn(batch):
        calls.append(1)
        out = net(batch[0])
        return torch.nn.functional.mse_loss(_InfiniteGradient.apply(out) if len(calls) == 3 else out, batch[1])
    result = train_loop(StepParts(params, loss_fn, torch.optim.AdamW(params, lr=1e-2), Precision("no", CPU)), data,
                        10)
    assert result.diverged_at == 3 and result.steps_done == 2
    assert all(torch.isfinite(p).all() for p in params)


def test_fp16_overflowed_steps_are_skipped_unchanged_and_are_not_divergence():
    net, params, data, _ = regression_problem()
    precision = Precision("fp16", CPU, initial_scale=2.0 ** 40)  # the first steps overflow fp16 gradients
    optimizer = torch.optim.AdamW(params, lr=1e-2)  # weight decay would move the weights on an applied step
    before = [p.detach().clone() for p in params]
    first = train_loop(StepParts(params, _mse(net), optimizer, precision), data, 1)
    assert precision.skipped_steps == 1 and first.diverged_at is None
    assert all(torch.equal(a, b) for a, b in zip(before, params))  # a skipped step leaves the weights alone
    result = train_loop(StepParts(params, _mse(net), optimizer, precision), data, 40, first_step=1)
    assert precision.skipped_steps > 1 and result.diverged_at is None and result.steps_done == 40
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(a, b) for a, b in zip(before, params))  # later steps did apply


def test_the_loss_is_divided_by_the_accumulation_count():
    """Two accumulated half-batches give the gradient (and reported loss) of the whole batch, not twice it."""
    grads, losses = [], []
    for accumulation in (1, 2):
        net, params, _, (x, y) = regression_problem()
        batch = 8 // accumulation
        data = iter([(x[i:i + batch], y[i:i + batch]) for i in range(0, 8, batch)])

        class Recording(torch.optim.SGD):
            def step(self, closure=None):
                grads.append([p.grad.clone() for p in params])
                return super().step(closure)
        result = train_loop(StepParts(params, _mse(net), Recording(params, lr=0.0), Precision("no", CPU),
                                      accumulation, max_grad_norm=None), data, 1)
        losses.append(result.losses[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for whole, accumulated in zip(*grads):
        torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-7)


def test_constant_schedule_warms_up():
    net, params, data, _ = regression_problem()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    seen = []
    train_loop(StepParts(params, _mse(net), optimizer, Precision("no", CPU),
                         lr_schedule=build_lr_schedule(optimizer, "constant", warmup_steps=4, total_steps=8)),
               data, 8, loop_events(on_step=seen.append))
    assert [info.lr for info in seen] == pytest.approx([0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2, 1e-2, 1e-2])


# --- files (items 2 and 7) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, stem", [
    ("日本語のLoRA", "日本語のLoRA"), ("Ünïcödé façade", "Ünïcödé façade"), ("हिन्दी", "हिन्दी"),
    ("ελληνικά.safetensors", "ελληνικά"), ("../../évil/..\\x", "x"), ("a<b>c:d\"e|f?g*h", "a_b_c_d_e_f_g_h"),
    ("tab\there\x00nul\x1b", "tab_here_nul_"), ("CON", "_CON"), ("aux.v1", "_aux.v1"), ("lpt9", "_lpt9"),
    ("..", "leanlora"), ("  . ", "leanlora"), ("e\u0301", "\u00e9"),
])
def test_sanitize_name_keeps_letters_of_every_script_and_blocks_the_rest(name, stem):
    assert sanitize_name(name) == stem


def test_sanitized_names_fit_file_system_limits_with_room_for_suffixes():
    stem = sanitize_name("名" * 300)
    assert len(stem.encode()) <= 150 and stem == "名" * 50


def test_a_third_save_with_the_same_name_gets_its_own_file(tmp_path):
    paths = [save_with_fallback({"w": torch.full((2,), float(i))}, tmp_path, "lora", {}, None)[0] for i in range(3)]
    assert [p.name for p in paths] == ["lora.safetensors", "lora_2.safetensors", "lora_3.safetensors"]
    assert [load_file(p)["w"][0].item() for p in paths] == [0.0, 1.0, 2.0]


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "entry.safetensors"
    save_safetensors_atomic({"w": torch.ones(4)}, path, {"v": "old"})
    old = path.read_bytes()
    real_save = files.write_safetensors

    def failing_save(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # half the bytes are on disk when the disk fills up
            f.truncate(os.path.getsize(filename) // 2)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files, "write_safetensors", failing_save)
    with pytest.raises(OSError):
        save_safetensors_atomic({"w": torch.zeros(400)}, path, {"v": "new"})
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["entry.safetensors"]


def _fill_the_disk_of(folder: Path, monkeypatch) -> None:
    """Saves into `folder` fail as on a full disk (safetensors' own error); saves elsewhere go through."""
    real_save = files.write_safetensors

    def full_disk(tensors, filename, metadata=None):
        if Path(filename).parent == folder:
            raise OSError(28, "No space left on device")
        return real_save(tensors, filename, metadata=metadata)
    monkeypatch.setattr(files, "write_safetensors", full_disk)


def test_a_failing_loras_folder_saves_to_the_fallback_and_says_where(tmp_path, monkeypatch):
    loras, fallback = tmp_path / "loras", tmp_path / "output" / "fallback"
    loras.mkdir()
    _fill_the_disk_of(loras, monkeypatch)
    path, note = save_with_fallback({"w": torch.ones(2)}, loras, "mine", {"k": "v"}, fallback)
    assert path == fallback / "mine.safetensors" and load_file(path)["w"].sum() == 2
    assert str(loras / "mine.safetensors") in note and str(path) in note and "No space left" in note
    assert not list(loras.iterdir())
    with pytest.raises(LeanLoRAError, match=r"could not save the LoRA to .*loras.*nor to the fallback"):
        save_with_fallback({"w": torch.ones(2)}, loras, "mine", {}, loras)


def test_non_finite_weights_are_found():
    assert non_finite_tensors({"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")]),
                               "c": torch.tensor([float("inf")], dtype=torch.float16), "n": torch.ones(2, dtype=torch.long)}) == ["b", "c"]


def test_v_prediction_models_train_on_v_in_the_loss_itself(comfy_objects):
    """denoising_loss (what every training step computes) is ~0 for the model's own target and not for the other."""
    from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.objective import denoising_loss
    model, clip, vae = comfy_objects
    g = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.5, 7.0])
    s = sigma.view(-1, 1, 1, 1)
    v = (noise - s * clean) / (1 + s ** 2).sqrt()
    for prediction, right, wrong in (("eps", noise, v), ("v_prediction", v, noise)):
        patched = ModelSamplingDiscrete().patch(model, prediction, False)[0]
        sampling = ComfyAdapter(patched, clip, vae).model_sampling
        loss = lambda out: denoising_loss(sampling, lambda x, t, c: out, clean, {}, noise, sigma,  # noqa: E731
                                          sampling.timestep(sigma)).item()
        assert loss(right) < 1e-8 and loss(wrong) > 0.1, prediction


# --- train_lora on the tiny checkpoint ----------------------------------------------------------------------

FP32 = MemorySettings("no", False, 1, 1, latent_cache="off")


def _train(adapter, dataset, folder, steps=3, name="run", lora=LoraSettings(rank=4, alpha=4.0), lr=1e-3, seed=0,
           memory=FP32, emit=lambda **event: None, **kwargs):
    from trainer.train_lora import train_lora
    return train_lora(adapter, dataset, memory, lora, TrainSettings(steps, lr, seed, name), folder, emit,
                      lambda: False, **kwargs)


def _immutable(folder: Path) -> bool:
    """Makes `folder` refuse new files, as a read-only mount does (root ignores permission bits: chattr +i)."""
    folder.chmod(0o555)
    probe = folder / ".probe"
    try:
        probe.touch()
    except OSError:
        return True
    probe.unlink()
    folder.chmod(0o755)
    return subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0


def _writable_again(folder: Path) -> None:
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def test_a_diverging_run_stops_and_keeps_only_finite_weights(adapter, dataset, tmp_path):
    """The issue's case: alpha 1e18 (through a link), rank 1, lr 0.05."""
    with pytest.raises(LeanLoRAError) as failure:
        _train(adapter, dataset, tmp_path, steps=8, name="boom", lora=LoraSettings(rank=1, alpha=1e18), lr=0.05)
    message = str(failure.value)
    step = int(message.split("diverged: at step ")[1].split()[0])
    assert "diverged" in message and "learning rate" in message and "alpha" in message and "precision" in message
    saved = sorted(tmp_path.glob("*.safetensors"))
    if step == 1:
        assert not saved and "nothing was saved" in message
    else:
        assert [p.name for p in saved] == [f"boom_partial_step{step - 1}.safetensors"] and str(saved[0]) in message
        assert not non_finite_tensors(load_file(saved[0]))


def test_a_hostile_name_is_sanitized_on_the_real_save_path(adapter, dataset, tmp_path):
    loras = tmp_path / "models" / "loras"
    outcome = _train(adapter, dataset, loras, steps=1, name="../../évil/..\\日本:語<>.safetensors")
    assert outcome.lora_path == loras / "日本_語_.safetensors" and outcome.lora_path.is_file()
    assert sorted(p.name for p in tmp_path.rglob("*.safetensors")) == ["日本_語_.safetensors"]


def test_alpha_other_than_rank_reaches_the_file(adapter, dataset, tmp_path):
    outcome = _train(adapter, dataset, tmp_path, steps=1, lora=LoraSettings(rank=4, alpha=2.0))
    with safe_open(str(outcome.lora_path), "pt") as f:
        assert float(f.metadata()["ss_network_alpha"]) == 2.0 and int(f.metadata()["ss_network_dim"]) == 4
        alphas = [f.get_tensor(k).item() for k in f.keys() if k.endswith(".alpha")]
    assert alphas and set(alphas) == {2.0}


def test_the_report_states_the_batch_actually_used(adapter, dataset, tmp_path):
    outcome = _train(adapter, dataset, tmp_path, steps=1, memory=MemorySettings("no", False, 64, 2, latent_cache="off"))
    assert "batch used: 2 images per step, not the 64 requested: an epoch holds 2 images x 1 repeats" in outcome.report
    assert "(effective batch 4)" in outcome.report


def test_the_seed_reaches_noise_and_shuffling(adapter, dataset, tmp_path, monkeypatch):
    """Same seed: the same LoRA. Another seed with the LoRA's initial weights held fixed: another LoRA, so the
    seed reaches the noise, timestep and shuffle draws and not only the initialisation."""
    import trainer.train_lora as train_module
    monkeypatch.setattr(train_module, "inject_lora", lambda unet, lora, seed, targets: inject_lora(unet, lora, 0, targets))
    runs = {}
    for label, seed in (("a", 1), ("b", 1), ("c", 2)):
        outcome = _train(adapter, dataset, tmp_path, steps=3, name=label, seed=seed, lr=1e-2)
        runs[label] = outcome.lora_state_dict
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert any(not torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"] if not k.endswith(".alpha"))


def test_a_lora_already_on_the_input_model_is_baked_into_the_training_copy(comfy_objects):
    import comfy.sd
    from bridge.comfy_adapter import ComfyAdapter
    model, clip, vae = comfy_objects
    module = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    base = model.model.diffusion_model.get_submodule(module).weight.detach().float().clone()
    g = torch.Generator().manual_seed(0)
    down, up = torch.randn(2, base.shape[1], generator=g), torch.randn(base.shape[0], 2, generator=g)
    key = "lora_unet_" + module.replace(".", "_")
    lora = {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up, f"{key}.alpha": torch.tensor(1.0)}
    patched, _ = comfy.sd.load_lora_for_models(model, clip, lora, 1.0, 0.0)
    adapter = ComfyAdapter(patched, clip, vae)
    unet = adapter.training_unet()
    try:
        trained_on = unet.get_submodule(module).weight.float()
        torch.testing.assert_close(trained_on, base + 0.5 * up @ down, rtol=1e-3, atol=1e-3)  # scale alpha/rank
    finally:
        adapter.free(unet)


def test_an_unwritable_loras_folder_fails_before_any_work_and_names_it(adapter, dataset, tmp_path):
    loras = tmp_path / "loras"
    loras.mkdir()
    if not _immutable(loras):
        pytest.skip("cannot make a folder read-only here (no chmod effect and no chattr)")
    encoded = []
    encode = adapter.encode_image
    adapter.encode_image = lambda pixels: encoded.append(1) or encode(pixels)
    try:
        with pytest.raises(LeanLoRAError, match=rf"cannot write to the loras folder {loras} .*make it writable"):
            _train(adapter, dataset, loras)
    finally:
        _writable_again(loras)
    assert not encoded  # nothing was encoded or trained


def test_a_loras_folder_that_fails_at_save_time_keeps_the_lora_in_the_fallback(adapter, dataset, tmp_path):
    loras, fallback = tmp_path / "loras", tmp_path / "output" / "leanlora_unsaved_loras"
    loras.mkdir()
    made_read_only = []

    def emit(**event):  # the folder turns read-only while training (after the check before step 1)
        if event.get("kind") == "step" and not made_read_only:
            made_read_only.append(_immutable(loras))
    try:
        outcome = _train(adapter, dataset, loras, steps=2, name="kept", emit=emit, fallback_dir=fallback)
    finally:
        _writable_again(loras)
    if not made_read_only[0]:
        pytest.skip("cannot make a folder read-only here (no chmod effect and no chattr)")
    assert outcome.lora_path == fallback / "kept.safetensors" and outcome.lora_path.is_file()
    assert f"the LoRA was saved to {outcome.lora_path} instead" in outcome.report and str(loras) in outcome.report
    assert not non_finite_tensors(load_file(outcome.lora_path))


def test_a_full_disk_at_save_time_keeps_the_lora_in_the_fallback(adapter, dataset, tmp_path, monkeypatch):
    loras, fallback = tmp_path / "loras", tmp_path / "output" / "leanlora_unsaved_loras"
    _fill_the_disk_of(loras, monkeypatch)
    outcome = _train(adapter, dataset, loras, steps=1, name="full", fallback_dir=fallback)
    assert outcome.lora_path == fallback / "full.safetensors" and outcome.lora_path.is_file()
    assert "No space left on device" in outcome.report and str(outcome.lora_path) in outcome.report


def test_an_unwritable_disk_cache_warns_and_trains_in_ram(adapter, dataset, tmp_path):
    from trainer.cache_store import LatentTextStore, RamCache
    cache = tmp_path / "leanlora_cache"
    cache.mkdir()
    if not _immutable(cache):
        pytest.skip("cannot make a folder read-only here (no chmod effect and no chattr)")
    try:
        outcome = _train(adapter, dataset, tmp_path / "loras", steps=1,
                         store=LatentTextStore(cache, ram=RamCache(2 ** 20)))
    finally:
        _writable_again(cache)
    assert outcome.lora_path.is_file() and not outcome.partial
    assert f"WARNING: latent cache on disk off for this run: cannot write to the latent cache folder {cache}" in \
        outcome.report
    assert not list(cache.iterdir())


def test_a_disk_cache_that_fills_up_while_caching_warns_and_trains_in_ram(adapter, dataset, tmp_path, monkeypatch):
    from trainer.cache_store import LatentTextStore, RamCache
    cache = tmp_path / "leanlora_cache"
    _fill_the_disk_of(cache, monkeypatch)
    outcome = _train(adapter, dataset, tmp_path / "loras", steps=1, store=LatentTextStore(cache, ram=RamCache(2 ** 20)))
    assert outcome.lora_path.is_file()
    assert "latent cache on disk off for this run: latent cache folder" in outcome.report
    assert "cannot be written" in outcome.report and "No space left" in outcome.report
