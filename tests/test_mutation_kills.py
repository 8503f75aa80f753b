"""Behaviour tests written for mutants that survived `bash scripts/mutation_test.sh` (docs/TESTING.md, "Mutation
testing"): each pins something a user or a saved file sees that no earlier test checked."""
from pathlib import Path

import torch

from trainer.settings import LoraWeights, MemorySettings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# --- memory_plan -----------------------------------------------------------------------------------------------

def test_a_gpu_without_bf16_gets_fp16_with_fp32_lora_weights_and_a_note(monkeypatch):
    """Pre-Ampere cards (T4, V100) have no bf16: the run falls back to fp16 loss scaling, says so, and the OOM
    ladder's 'mixed precision on' rung picks fp16 there too. CPU and bf16 cards keep the settings as asked."""
    from trainer.memory_plan import next_rung, resolve_for_device
    asked = MemorySettings("bf16", lora_weights=LoraWeights.BF16_STOCHASTIC_ROUNDING)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    resolved, notes = resolve_for_device(asked, CUDA)
    assert (resolved.mixed_precision, resolved.lora_weights) == ("fp16", LoraWeights.FP32)
    assert notes == ["this GPU has no bf16: using fp16 with loss scaling (and fp32 LoRA weights) instead"]
    assert resolve_for_device(asked, CPU) == (asked, [])
    memory, description = next_rung(MemorySettings("no", True), CUDA)
    assert (memory.mixed_precision, description) == ("fp16", "mixed precision off -> fp16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_for_device(asked, CUDA) == (asked, [])
    assert next_rung(MemorySettings("no", True), CUDA)[0].mixed_precision == "bf16"


def test_a_batch_of_two_is_the_first_thing_split_on_oom():
    from trainer.memory_plan import next_rung
    memory, description = next_rung(MemorySettings("bf16", True, batch_size=2, gradient_accumulation=3), CPU)
    assert (memory.batch_size, memory.gradient_accumulation) == (1, 6)
    assert description == "batch 2 -> 1 with gradient accumulation 6 (effective batch stays 6)"


def test_the_cuda_ladder_names_what_moves_to_cpu_memory():
    """The last two rungs are the slow ones; the report tells the user exactly what they cost."""
    from trainer.memory_plan import next_rung
    memory, offload = next_rung(MemorySettings("bf16", True, optimizer="AdamW8bit", base_weights="fp8"), CUDA)
    _, streamed = next_rung(memory, CUDA)
    assert offload == "activations saved for backward wait in CPU RAM (copied out after forward, back for backward)"
    assert streamed == "frozen base weights streamed from CPU memory, layer by layer"


# --- files -----------------------------------------------------------------------------------------------------

_OS_ERROR = "NotADirectoryError: [Errno 20] Not a directory"  # what a file in place of the folder gives


def _blocked_folder(tmp_path):
    """A folder path that cannot be created or written even by root: a plain file sits where its parent should."""
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path / "a_file" / "loras"


def test_check_writable_creates_the_folder_and_leaves_no_probe_behind(tmp_path):
    from trainer.files import check_writable
    folder = tmp_path / "models" / "loras"
    check_writable(folder, 1, "loras folder")
    assert folder.is_dir() and not list(folder.iterdir())


def test_check_writable_names_an_unwritable_folder_and_the_fix(tmp_path):
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.files import check_writable
    folder = _blocked_folder(tmp_path)
    with pytest.raises(LeanLoRAError) as failure:
        check_writable(folder, 0, "loras folder")
    message = str(failure.value)
    assert message.startswith(f"cannot write to the loras folder {folder} (")
    assert message.endswith("): make it writable for the user running ComfyUI (or free it from a read-only mount) "
                            "and queue again")
    assert "Not a directory" in message or "File exists" in message


def test_check_writable_wants_twice_the_file_size_free(tmp_path):
    import shutil
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.files import check_writable
    free = shutil.disk_usage(tmp_path).free
    check_writable(tmp_path, int(free * 0.4), "loras folder")  # room for two copies, not for three: fine
    with pytest.raises(LeanLoRAError) as failure:
        check_writable(tmp_path, free // 2 + 2 ** 20, "loras folder")
    message = str(failure.value)
    assert message.startswith(f"the loras folder {tmp_path} has ")
    assert f"MiB free; the LoRA needs about {(free // 2 + 2 ** 20) / 2 ** 20:.1f} MiB: free some space" in message
    said_free = float(message.split(" has ")[1].split(" MiB free")[0])
    assert abs(said_free - free / 2 ** 20) < 64  # the free space in MiB (other writers may change it a little)


def test_save_with_fallback_saves_in_the_folder_when_it_can(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    from trainer.files import save_with_fallback
    path, note = save_with_fallback({"w": torch.ones(2)}, tmp_path / "loras", "mine", {"k": "v"}, tmp_path / "spare")
    assert (path, note) == (tmp_path / "loras" / "mine.safetensors", None)
    assert torch.equal(load_file(path)["w"], torch.ones(2)) and not (tmp_path / "spare").exists()
    with safe_open(str(path), "pt") as saved:
        assert saved.metadata() == {"k": "v"}


def test_save_with_fallback_keeps_the_lora_in_the_fallback_and_says_where(tmp_path):
    from safetensors import safe_open
    from trainer.files import save_with_fallback
    folder, spare = _blocked_folder(tmp_path), tmp_path / "spare"
    (spare).mkdir()
    (spare / "mine.safetensors").write_bytes(b"an earlier LoRA")
    path, note = save_with_fallback({"w": torch.ones(2)}, folder, "mine", {"k": "v"}, spare)
    assert path == spare / "mine_2.safetensors"  # the fallback never overwrites either
    assert (spare / "mine.safetensors").read_bytes() == b"an earlier LoRA"
    with safe_open(str(path), "pt") as saved:
        assert saved.metadata() == {"k": "v"} and torch.equal(saved.get_tensor("w"), torch.ones(2))
    assert note.startswith(f"WARNING: could not save to {folder / 'mine.safetensors'} ({_OS_ERROR}")
    assert note.endswith(f"); the LoRA was saved to {path} instead: move it into your loras folder to use it in "
                         "Load LoRA")


def test_save_with_fallback_names_both_folders_when_both_fail(tmp_path):
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.files import save_with_fallback
    folder = _blocked_folder(tmp_path)
    with pytest.raises(LeanLoRAError) as failure:
        save_with_fallback({"w": torch.ones(2)}, folder, "mine", {}, None)
    assert str(failure.value).startswith(f"could not save the LoRA to {folder / 'mine.safetensors'} ({_OS_ERROR}")
    assert str(failure.value).endswith(")")
    with pytest.raises(LeanLoRAError) as failure:
        save_with_fallback({"w": torch.ones(2)}, folder, "mine", {}, folder)
    message = str(failure.value)
    assert message.startswith(f"could not save the LoRA to {folder / 'mine.safetensors'} ({_OS_ERROR}")
    assert f") nor to the fallback {folder / 'mine.safetensors'} ({_OS_ERROR}" in message
    assert message.endswith("): free space or fix the folders' permissions")


# --- lora: the metadata other tools read (tested end to end only by a training run the script leaves out) ----

def test_tag_frequency_counts_each_lower_cased_tag_once_per_caption():
    from trainer.lora import tag_frequency
    captions = ["Red ball, studio,, ", "red ball,blue sky", "", " STUDIO "]
    assert tag_frequency("10_subject", captions) == {"10_subject": {"red ball": 2, "studio": 2, "blue sky": 1}}


def test_lora_metadata_is_kohyas_set_plus_the_sai_model_spec():
    import datetime
    import json
    from trainer.lora import BaseModelKind, lora_metadata
    from trainer.settings import LoraSettings
    settings = LoraSettings(rank=8, alpha=4.0, dropout=0.1, targets="attention")
    tags = {"10_subject": {"red ball": 2}}
    started = 1_700_000_000.75
    meta = lora_metadata(settings, BaseModelKind(), output_name="my lora", resolution=(768, 512), tags=tags,
                         extra={"ss_steps": "40"}, timestamp=started)
    assert meta == {
        "ss_network_module": "networks.lora", "ss_network_dim": "8", "ss_network_alpha": "4.0",
        "ss_network_dropout": "0.1",
        "ss_network_args": json.dumps({"targets": "attention",
                                       "target_modules": ",".join(settings.target_modules)}),
        "ss_base_model_version": "sd_v1", "ss_v2": "False", "ss_output_name": "my lora",
        "ss_resolution": "(768, 512)", "ss_training_started_at": "1700000000.75",
        "ss_tag_frequency": '{"10_subject": {"red ball": 2}}', "leanlora_targets": "attention", "ss_steps": "40",
        "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": "stable-diffusion-v1/lora",
        "modelspec.implementation": "diffusers", "modelspec.title": "my lora", "modelspec.resolution": "768x512",
        "modelspec.date": datetime.datetime.fromtimestamp(1_700_000_000).isoformat(),  # whole seconds, local time
        "modelspec.prediction_type": "epsilon"}
    before = __import__("time").time()
    now = float(lora_metadata(settings, BaseModelKind(), output_name="x", resolution=(64, 64), tags={}, extra={})
                ["ss_training_started_at"])
    assert before <= now <= before + 60  # no timestamp given: the current time


def test_base_model_kind_names_sd2_families_as_kohya_does():
    from trainer.lora import BaseModelKind
    assert BaseModelKind(v2=True).base_model_version == "sd_v2"
    assert BaseModelKind(v2=True, v_prediction=True).base_model_version == "sd_v2_v"
    assert BaseModelKind(v2=True).architecture == "stable-diffusion-v2-512/lora"
    assert BaseModelKind(v2=True, v_prediction=True).architecture == "stable-diffusion-v2-768-v/lora"
    assert BaseModelKind(v2=True).implementation == "diffusers"


# --- objective, on ComfyUI's own model_sampling classes (the training-run tests of it take a minute) -----------

def _sampling(prediction: str):
    import comfy.model_sampling as ms
    kind = {"eps": ms.EPS, "v": ms.V_PREDICTION}[prediction]
    return type(f"Sampling_{prediction}", (ms.ModelSamplingDiscrete, kind), {})()


def test_sigmas_are_drawn_from_the_whole_schedule_by_the_given_generator():
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.objective import sample_sigmas
    sampling = _sampling("eps")
    drawn = sample_sigmas(sampling, 20_000, torch.Generator().manual_seed(1))
    assert drawn.shape == (20_000,) and drawn.device.type == "cpu"
    assert set(drawn.tolist()) <= set(sampling.sigmas.tolist())
    assert (drawn.min(), drawn.max()) == (sampling.sigmas[0], sampling.sigmas[-1])  # both ends of the schedule
    again = sample_sigmas(sampling, 20_000, torch.Generator().manual_seed(1))
    other = sample_sigmas(sampling, 20_000, torch.Generator().manual_seed(2))
    assert torch.equal(drawn, again) and not torch.equal(drawn, other)

    class FlowSchedule:  # a continuous schedule (flow models): no table of sigmas
        pass
    with pytest.raises(LeanLoRAError, match=r"this model's noise schedule \(FlowSchedule\) is not a discrete DDPM "
                                            r"schedule; LeanLoRA trains SD1.5/SDXL-style models"):
        sample_sigmas(FlowSchedule(), 2, torch.Generator())


def test_draw_noise_gives_the_seeded_noise_its_sigmas_and_the_models_timesteps():
    from trainer.objective import draw_noise, sample_sigmas
    sampling = _sampling("eps")
    drawn = draw_noise(sampling, torch.Size((3, 4, 8, 8)), torch.Generator().manual_seed(5))
    replay = torch.Generator().manual_seed(5)
    noise = torch.randn(3, 4, 8, 8, generator=replay)
    sigma = sample_sigmas(sampling, 3, replay)  # noise first, then the sigmas, from the one generator
    assert set(drawn) == {"noise", "sigma", "timestep"}
    assert torch.equal(drawn["noise"], noise) and torch.equal(drawn["sigma"], sigma)
    assert drawn["timestep"].dtype == torch.float32
    assert torch.equal(drawn["timestep"], sampling.timestep(sigma).float())


def test_the_loss_trains_eps_models_on_noise_and_v_models_on_v():
    from trainer.objective import denoising_loss, output_target
    g = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.5, 7.0])
    s = sigma.view(-1, 1, 1, 1)
    v = (noise - s * clean) / (1 + s ** 2).sqrt()
    cond = {"c_crossattn": torch.ones(2, 3, 8)}
    for prediction, right, wrong in (("eps", noise, v), ("v", v, noise)):
        sampling = _sampling(prediction)
        noisy = sampling.noise_scaling(sigma, noise, clean)
        torch.testing.assert_close(output_target(sampling, sigma, noisy, clean), right, rtol=1e-4, atol=1e-4)
        seen = {}

        def predict(x, t, c, answer):
            seen.update(x=x, t=t, c=c)
            return answer.half()  # a model under autocast answers in fp16; the loss is still fp32
        timestep = sampling.timestep(sigma)
        loss = denoising_loss(sampling, lambda x, t, c: predict(x, t, c, right), clean, cond, noise, sigma, timestep)
        assert loss.dtype == torch.float32 and loss.item() < 1e-5, prediction
        torch.testing.assert_close(seen["x"], sampling.calculate_input(sigma, noisy))
        assert seen["t"] is timestep and seen["c"] is cond
        off_by_one = denoising_loss(sampling, lambda x, t, c: right + 1, clean, cond, noise, sigma, timestep)
        assert abs(off_by_one.item() - 1.0) < 1e-4  # the mean of squared errors
        assert denoising_loss(sampling, lambda x, t, c: wrong, clean, cond, noise, sigma, timestep).item() > 0.1


# --- files: names, cache_store: the optional disk layer ------------------------------------------------------

def test_checkpoint_and_pickle_suffixes_are_dropped_from_names_in_any_case():
    from trainer.files import sanitize_name
    assert sanitize_name("my_model.ckpt") == "my_model" and sanitize_name("MY_MODEL.CKPT") == "MY_MODEL"
    assert sanitize_name("style.pt") == "style" and sanitize_name("style.PT") == "style"
    assert sanitize_name("both.SafeTensors") == "both"


def test_a_long_name_behind_dots_keeps_100_characters_of_its_own():
    from trainer.files import sanitize_name
    assert sanitize_name(" . ." + "a" * 120) == "a" * 100


def test_an_unwritable_cache_folder_is_said_once_and_the_entries_stay_in_ram(tmp_path):
    from trainer.cache_store import LatentTextStore, RamCache
    (tmp_path / "a_file").write_text("not a folder")
    folder = tmp_path / "a_file" / "cache"
    store = LatentTextStore(folder, ram=RamCache(1 << 20))
    store.put("k1", {"latent": torch.ones(2)})
    problem = store.disk_problem
    assert problem.startswith(f"latent cache folder {folder} cannot be written (")
    assert problem.endswith("); this run's encodings stay in RAM only")
    store.put("k2", {"latent": torch.zeros(2)})
    assert store.disk_problem is problem  # said once, not once per entry
    assert torch.equal(store.get("k1")["latent"], torch.ones(2)) and torch.equal(store.get("k2")["latent"],
                                                                                 torch.zeros(2))


def test_a_half_written_file_is_hidden_and_not_a_safetensors_name(tmp_path, monkeypatch):
    """ComfyUI lists every *.safetensors in models/loras: the temp file is a dot file ending in .tmp."""
    from trainer import files
    written = []
    real_save = files.save_file

    def recording_save(tensors, filename, metadata=None):
        written.append(Path(filename))
        return real_save(tensors, filename, metadata=metadata)
    monkeypatch.setattr(files, "save_file", recording_save)
    path = files.save_safetensors_atomic({"w": torch.ones(2)}, tmp_path / "mine.safetensors", {})
    (temp,) = written
    assert temp.parent == tmp_path and temp.name.startswith(".leanlora-") and temp.name.endswith(".tmp")
    assert path.is_file() and not temp.exists()


def test_names_are_trimmed_to_whole_characters_and_never_end_in_a_dot():
    from trainer.files import sanitize_name
    assert sanitize_name("é" * 75 + "a") == "é" * 75  # 151 UTF-8 bytes: one character goes, not two
    assert sanitize_name("a" * 99 + ".b") == "a" * 99  # cut at 100 characters, then the dot left at the end
    assert sanitize_name("Xavier.X") == "Xavier.X"


def test_ram_cache_counts_a_replaced_entry_once_and_stays_bounded():
    from trainer.cache_store import RamCache
    entry = lambda value: {"t": torch.full((4,), float(value))}  # noqa: E731  (16 bytes)
    ram = RamCache(max_bytes=48)
    ram.put("a", entry(0))
    ram.put("a", entry(1))  # a replaced entry frees its old bytes
    ram.put("b", entry(2))
    ram.put("c", entry(3))
    assert len(ram) == 3 and ram.get("a")["t"][0] == 1
    for key in "defg":
        ram.put(key, entry(0))
        assert len(ram) == 3  # every put past the bound evicts, not only the first
    assert [ram.get(k) is not None for k in "abcdefg"] == [False] * 4 + [True] * 3
    whole = RamCache(max_bytes=16)
    whole.put("exact", entry(0))  # an entry of exactly max_bytes fits
    assert whole.get("exact") is not None
    whole.put("too big", {"t": torch.zeros(5)})
    assert whole.get("too big") is None and whole.get("exact") is not None


def test_store_without_ram_reads_its_folder_and_disk_hits_go_to_ram(tmp_path):
    from trainer.cache_store import LatentTextStore, RamCache
    disk_only = LatentTextStore(tmp_path, ram=None)
    disk_only.put("k", {"latent": torch.ones(3)})
    assert torch.equal(disk_only.get("k")["latent"], torch.ones(3))
    entry_file = tmp_path / "k.safetensors"
    written = entry_file.stat().st_ino
    ram = RamCache(1 << 20)
    store = LatentTextStore(tmp_path, ram=ram)
    assert torch.equal(store.get("k")["latent"], torch.ones(3))  # from disk, now in RAM too
    assert store.get("k") is ram.get("k")
    assert entry_file.stat().st_ino == written  # an entry already on disk is not rewritten by a RAM hit
    entry_file.unlink()
    assert torch.equal(LatentTextStore(None, ram=ram).get("k")["latent"], torch.ones(3))


# --- precision -------------------------------------------------------------------------------------------------

def test_norms_in_the_compute_dtype_keep_their_learned_scale_and_shift():
    """Trained norms have weights other than 1 and biases other than 0 (the default init hides both), and some
    norms have none (elementwise_affine=False)."""
    from trainer.precision import norms_in_compute_dtype
    torch.manual_seed(0)
    norms = [torch.nn.GroupNorm(4, 16, eps=0.5), torch.nn.LayerNorm(16, eps=0.5),  # a model's own eps, not 1e-5
             torch.nn.GroupNorm(4, 16, affine=False), torch.nn.LayerNorm(16, elementwise_affine=False)]
    with torch.no_grad():
        for norm in norms:
            if norm.weight is not None:
                norm.weight.uniform_(0.5, 2.0)
                norm.bias.uniform_(-1.0, 1.0)
    inputs = [torch.randn(2, 16, 4, 4), torch.randn(2, 5, 16), torch.randn(2, 16, 4, 4), torch.randn(2, 5, 16)]
    with torch.no_grad():
        references = [norm(x) for norm, x in zip(norms, inputs)]  # fp32, as loaded
        assert norms_in_compute_dtype(torch.nn.ModuleList(norms)) == 4
        for norm, x, reference in zip(norms, inputs, references):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = norm(x)
            assert out.dtype == torch.bfloat16, norm
            torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)
            assert torch.equal(norm(x), reference)  # outside autocast: the layer as it was


def test_frozen_weights_are_stored_in_the_mixed_precision_dtype_or_fp32():
    """What TrainingSession casts the frozen base weights to: fp32 when mixed precision is off."""
    from trainer.precision import Precision
    assert Precision("no", CPU).compute_dtype == torch.float32
    assert Precision("bf16", CPU).compute_dtype == torch.bfloat16
    assert Precision("fp16", CPU).compute_dtype == torch.float16


def test_fp16_scales_the_loss_and_skips_only_overflowed_steps():
    """Dynamic loss scaling on one parameter, in milliseconds (the training-run test of it takes 40 s)."""
    from trainer.precision import Precision
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.5)
    fp16 = Precision("fp16", CPU, initial_scale=1024.0)
    fp16.backward((weight * torch.tensor([1.0, 2.0])).sum())
    assert torch.equal(weight.grad, torch.tensor([1024.0, 2048.0]))  # the scaled loss's gradient
    assert fp16.step(optimizer) is True and fp16.skipped_steps == 0
    assert torch.equal(weight.detach(), torch.tensor([0.5, 0.0]))  # the step used the unscaled gradient
    optimizer.zero_grad()
    fp16.backward((weight * torch.tensor([float("inf"), 1.0])).sum())
    assert fp16.step(optimizer) is False and fp16.skipped_steps == 1
    assert torch.equal(weight.detach(), torch.tensor([0.5, 0.0]))  # an overflowed step changes nothing
    assert fp16.scaler.get_scale() == 512.0
    optimizer.zero_grad()
    fp16.backward(weight.sum())
    assert fp16.step(optimizer) is True and fp16.skipped_steps == 1


def test_bf16_and_fp32_step_without_a_scaler_and_autocast_only_with_a_dtype():
    from trainer.precision import Precision
    with Precision("fp16", CPU).autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16  # fp16 asked: not the CPU's bf16 default
    for mode, dtype in (("bf16", torch.bfloat16), ("no", None)):
        weight = torch.nn.Parameter(torch.ones(2))
        optimizer = torch.optim.SGD([weight], lr=0.5)
        precision = Precision(mode, CPU)
        assert precision.scaler is None
        precision.backward((weight * torch.tensor([1.0, 2.0])).sum())
        assert torch.equal(weight.grad, torch.tensor([1.0, 2.0]))  # no scaling
        assert precision.step(optimizer) is True and precision.skipped_steps == 0
        assert torch.equal(weight.detach(), torch.tensor([0.5, 0.0]))
        with precision.autocast():
            product = torch.ones(2, 2) @ torch.ones(2, 2)
        assert product.dtype == (dtype or torch.float32), mode
        with precision.autocast(cache_enabled=False):
            assert torch.is_autocast_enabled("cpu") == (dtype is not None)


def test_check_writable_probes_the_folder_itself(tmp_path):
    """An existing folder that refuses new files (a read-only mount; for root, chattr +i) fails the check, although
    the system's temp folder is writable."""
    import subprocess
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.files import check_writable
    folder = tmp_path / "loras"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / ".probe").touch()
    except OSError:
        pass  # not root: the permission bits are enough
    else:
        (folder / ".probe").unlink()
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("cannot make a folder read-only here (no chmod effect and no chattr)")
    try:
        with pytest.raises(LeanLoRAError, match="cannot write to the loras folder"):
            check_writable(folder, 0, "loras folder")
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        folder.chmod(0o755)
    assert not list(folder.iterdir())


def test_a_saved_lora_is_readable_like_any_file_the_user_saves(tmp_path):
    """mkstemp makes 0600 files; the LoRA gets the user's usual mode (0666 less the umask), e.g. for a shared
    models folder."""
    import os
    import stat
    from trainer.files import save_safetensors_atomic
    old_umask = os.umask(0o022)
    os.umask(old_umask)
    path = save_safetensors_atomic({"w": torch.ones(2)}, tmp_path / "mine.safetensors", {})
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~old_umask
