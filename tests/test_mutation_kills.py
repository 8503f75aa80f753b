"""Behaviour tests written for mutants that survived `bash scripts/mutation_test.sh` (docs/TESTING.md, "Mutation
testing"): each pins something a user or a saved file sees that no earlier test checked."""
from pathlib import Path

import pytest
import torch

from trainer.settings import LoraWeights, MemorySettings
from helpers import sd_targets  # noqa: E402

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


# --- memory_plan -----------------------------------------------------------------------------------------------

def test_a_gpu_without_bf16_gets_fp16_with_fp32_lora_weights_and_a_note(monkeypatch):
    """Pre-Ampere cards (T4, V100) have no bf16: the run falls back to fp16 loss scaling, says so, and the OOM
    ladder's 'mixed precision on' rung picks fp16 there too. CPU and bf16 cards keep the settings as asked."""
    from trainer.memory import ladder as memory_plan
    from trainer.memory.ladder import next_rung, resolve_for_device
    asked = MemorySettings("bf16", lora_weights=LoraWeights.BF16_STOCHASTIC_ROUNDING)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    monkeypatch.setattr(memory_plan, "cpu_computes_natively", lambda mode: True)  # an AVX512-BF16 / AMX CPU
    resolved, notes = resolve_for_device(asked, CUDA)
    assert (resolved.mixed_precision, resolved.lora_weights) == ("fp16", LoraWeights.FP32)
    assert notes == ["this GPU has no bf16: using fp16 with loss scaling (and fp32 LoRA weights) instead"]
    assert resolve_for_device(asked, CPU) == (asked, [])
    memory, description = next_rung(MemorySettings("no", True), CUDA)
    assert (memory.mixed_precision, description) == ("fp16", "mixed precision off -> fp16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert resolve_for_device(asked, CUDA) == (asked, [])
    assert next_rung(MemorySettings("no", True), CUDA)[0].mixed_precision == "bf16"


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_a_cpu_without_16_bit_instructions_trains_in_fp32_and_says_so(monkeypatch, mode):
    """An AVX2-only CPU emulates bf16/fp16 convolutions (~175x slower than fp32 there: the shipped template's
    first step took over 400 s on a 2-core EPYC); the run computes in fp32, as ComfyUI does on a CPU, and the
    report names why. A GPU keeps its precision whatever the host CPU has."""
    from trainer.memory import ladder as memory_plan
    monkeypatch.setattr(memory_plan, "cpu_computes_natively", lambda asked: False)
    lora_weights = LoraWeights.BF16_STOCHASTIC_ROUNDING if mode == "bf16" else LoraWeights.FP32
    asked = MemorySettings(mode, True, lora_weights=lora_weights)
    resolved, notes = memory_plan.resolve_for_device(asked, CPU)
    assert (resolved.mixed_precision, resolved.lora_weights, resolved.gradient_checkpointing) == \
        ("no", LoraWeights.FP32, True)
    assert notes == [f"this CPU has no {mode} instructions (PyTorch would emulate them, ~100x slower): training in "
                     "fp32 instead, as ComfyUI computes on a CPU"]
    assert memory_plan.resolve_for_device(MemorySettings("no"), CPU) == (MemorySettings("no"), [])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert memory_plan.resolve_for_device(asked, CUDA) == (asked, [])


def test_the_cpu_check_reads_pytorchs_own_answer():
    from trainer.memory.ladder import cpu_computes_natively
    assert cpu_computes_natively("bf16") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu_computes_natively("fp16") is bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def test_a_batch_of_two_is_the_first_thing_split_on_oom():
    from trainer.memory.ladder import next_rung
    memory, description = next_rung(MemorySettings("bf16", True, batch_size=2, gradient_accumulation=3), CPU)
    assert (memory.batch_size, memory.gradient_accumulation) == (1, 6)
    assert description == "batch 2 -> 1 with gradient accumulation 6 (effective batch stays 6)"


def test_the_cuda_ladder_names_what_moves_to_cpu_memory():
    """The last two rungs are the slow ones; the report tells the user exactly what they cost."""
    from trainer.memory.ladder import next_rung
    memory, offload = next_rung(MemorySettings("bf16", True, optimizer="AdamW8bit", base_weights="fp8"), CUDA)
    memory, streamed = next_rung(memory, CUDA)
    assert offload == "activations saved for backward wait in CPU RAM (copied out after forward, back for backward)"
    assert streamed == ("frozen base weights streamed from CPU memory, layer by layer: the layers cheapest to stream, "
                        "20% of the weights")
    memory, more = next_rung(memory, CUDA)
    assert more == "frozen weights streamed from CPU memory 20% -> 40%"
    for _ in range(2):
        memory, _ = next_rung(memory, CUDA)
    assert next_rung(memory, CUDA)[1] == "every frozen weight streamed from CPU memory"


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
    from trainer.lora import lora_metadata
    from trainer.model import FamilyIdentity
    from trainer.settings import LoraSettings
    settings = LoraSettings(rank=8, alpha=4.0, dropout=0.1, targets="attention")
    sd1 = FamilyIdentity("SD1.x", "sd_v1", "stable-diffusion-v1", "diffusers")
    tags = {"10_subject": {"red ball": 2}}
    started = 1_700_000_000.75
    meta = lora_metadata(settings, sd1, target_modules=sd_targets(settings), output_name="my lora",
                         resolution=(768, 512), tags=tags, extra={"ss_steps": "40"}, timestamp=started)
    assert meta == {
        "ss_network_module": "networks.lora", "ss_network_dim": "8", "ss_network_alpha": "4.0",
        "ss_network_dropout": "0.1",
        "ss_network_args": json.dumps({"targets": "attention",
                                       "target_modules": ",".join(sd_targets(settings))}),
        "ss_base_model_version": "sd_v1", "ss_v2": "False", "ss_output_name": "my lora",
        "ss_resolution": "(768, 512)", "ss_training_started_at": "1700000000.75",
        "ss_tag_frequency": '{"10_subject": {"red ball": 2}}', "leanlora_targets": "attention", "ss_steps": "40",
        "modelspec.sai_model_spec": "1.0.0", "modelspec.architecture": "stable-diffusion-v1/lora",
        "modelspec.implementation": "diffusers", "modelspec.title": "my lora", "modelspec.resolution": "768x512",
        "modelspec.date": datetime.datetime.fromtimestamp(1_700_000_000).isoformat(),  # whole seconds, local time
        "modelspec.prediction_type": "epsilon"}
    before = __import__("time").time()
    now = float(lora_metadata(settings, sd1, target_modules=(), output_name="x", resolution=(64, 64), tags={},
                              extra={})["ss_training_started_at"])
    assert before <= now <= before + 60  # no timestamp given: the current time


def test_family_identity_recognises_how_other_tools_record_its_family():
    from trainer.model import FamilyIdentity
    flux = FamilyIdentity("FLUX.1-dev", "flux1", "flux-1-dev", "x", "flow", recorded_as=("flux1", "flux-1"))
    assert flux.recognises("flux1") and flux.recognises("Flux.1-dev/lora") and flux.recognises("flux-1-schnell")
    assert not flux.recognises("sdxl_base_v1-0") and not flux.recognises("stable-diffusion-v1/lora")
    # FLUX.2's names begin with FLUX.1's plain "flux": a FLUX.2 LoRA is not continued on FLUX.1
    from bridge.families.flux import FLUX1_RECORDED_AS, FLUX2_RECORDED_AS
    flux1 = FamilyIdentity("FLUX.1-dev", "flux1", "flux-1-dev", "x", "flow", recorded_as=FLUX1_RECORDED_AS,
                           not_recorded_as=FLUX2_RECORDED_AS)
    assert flux1.recognises("flux") and flux1.recognises("FLUX.1-dev") and not flux1.recognises("flux2") \
        and not flux1.recognises("FLUX.2-klein-4b") and not flux1.recognises("flux-2-dev")


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

    class ContinuousSchedule:  # a schedule without a table of sigmas
        pass
    with pytest.raises(LeanLoRAError, match=r"this model's noise schedule \(ContinuousSchedule\) has no table of "
                                            r"noise levels"):
        sample_sigmas(ContinuousSchedule(), 2, torch.Generator())


def test_logit_normal_sampling_favours_the_middle_of_the_schedule_and_reaches_both_halves():
    from trainer.objective import TimestepSampling, sample_sigmas
    sampling = _sampling("eps")
    sigmas = sampling.sigmas
    drawn = sample_sigmas(sampling, 20_000, torch.Generator().manual_seed(1), TimestepSampling.LOGIT_NORMAL)
    assert set(drawn.tolist()) <= set(sigmas.tolist())
    index = torch.searchsorted(sigmas, drawn).float() / (len(sigmas) - 1)
    middle = ((index > 0.25) & (index < 0.75)).float().mean()
    assert 0.6 < middle < 0.8  # sigmoid(N(0,1)): P(|z| < logit(0.75) = 1.0986) = 0.73; uniform would give 0.5
    assert index.min() < 0.1 and index.max() > 0.9
    again = sample_sigmas(sampling, 20_000, torch.Generator().manual_seed(1), TimestepSampling.LOGIT_NORMAL)
    assert torch.equal(drawn, again)


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
    real_save = files.write_safetensors

    def recording_save(tensors, filename, metadata=None):
        written.append(Path(filename))
        return real_save(tensors, filename, metadata=metadata)
    monkeypatch.setattr(files, "write_safetensors", recording_save)
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
    from trainer.step.precision import norms_in_compute_dtype
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
    from trainer.step.precision import Precision
    assert Precision("no", CPU).compute_dtype == torch.float32
    assert Precision("bf16", CPU).compute_dtype == torch.bfloat16
    assert Precision("fp16", CPU).compute_dtype == torch.float16


def test_fp16_scales_the_loss_and_skips_only_overflowed_steps():
    """Dynamic loss scaling on one parameter, in milliseconds (the training-run test of it takes 40 s)."""
    from trainer.step.precision import Precision
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
    from trainer.step.precision import Precision
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


# --- dataset ---------------------------------------------------------------------------------------------------

def _png(path, size=(16, 16), mode="RGB", color=(10, 20, 30), **save):
    from PIL import Image
    Image.new(mode, size, color).save(path, **save)
    return path


def test_resolution_and_repeats_accept_their_limits_and_name_the_fix():
    import pytest
    from trainer.dataset import MAX_REPEATS, MAX_RESOLUTION, check_numbers
    from trainer.errors import LeanLoRAError
    check_numbers(MAX_RESOLUTION, MAX_REPEATS)  # the widgets' maxima are valid values
    with pytest.raises(LeanLoRAError) as error:
        check_numbers(100, 1)
    assert str(error.value) == "resolution: got 100; use a multiple of 64 up to 4096 (512 for SD1.5, 1024 for SDXL)"
    with pytest.raises(LeanLoRAError) as error:
        check_numbers(512, 0)
    assert str(error.value) == ("repeats: got 0; use 1 to 1000 (repeats only decide how often an image comes up per "
                                "epoch; train longer with more steps)")


def test_the_folder_field_errors_say_what_to_type_instead(tmp_path):
    import pytest
    from trainer.dataset import resolve_folder
    from trainer.errors import LeanLoRAError
    messages = {}
    for text in ("  ", ".", "../elsewhere", "~no_such_user_leanlora/x"):
        with pytest.raises(LeanLoRAError) as error:
            resolve_folder(text, tmp_path)
        messages[text] = str(error.value)
    assert messages["  "] == (f"folder is empty; give a folder name inside ComfyUI's input folder ({tmp_path}) "
                              "or an absolute path")
    assert messages["."] == (f"folder '.' is ComfyUI's input folder itself ({tmp_path}); a relative folder must "
                             "name a folder inside it (give an absolute path for a folder elsewhere)")
    assert messages["../elsewhere"].startswith("folder '../elsewhere' leads out of ComfyUI's input folder")
    assert messages["~no_such_user_leanlora/x"].startswith("folder '~no_such_user_leanlora/x': ")
    assert messages["~no_such_user_leanlora/x"].endswith(
        f"; give an absolute path or a folder name inside ComfyUI's input folder ({tmp_path})")


def test_the_summary_lists_buckets_skips_and_grouped_notes_exactly():
    from trainer.dataset import Dataset, Sample
    samples = (Sample(Path("a.png"), "", (128, 64)), Sample(Path("b.png"), "", (128, 64)),
               Sample(Path("c.png"), "", (64, 64)))
    nine = tuple((f"n{i}.png", "transparent pixels composited onto white") for i in range(9))
    eight = tuple((f"e{i}.txt", "read as Latin-1") for i in range(8))
    dataset = Dataset(Path("/data"), samples, 128, 2, (("x.gif", "extension .gif"),), True, nine + eight)
    assert dataset.summary() == "\n".join([
        "3 images x 2 repeats from /data, aspect-ratio buckets up to 128px",
        "  buckets: 64x64: 1, 128x64: 2",
        "  skipped x.gif: extension .gif",
        "  notes:",
        "    n0.png, n1.png, n2.png, n3.png, n4.png, n5.png, n6.png, n7.png and 1 more: transparent pixels "
        "composited onto white",
        "    e0.txt, e1.txt, e2.txt, e3.txt, e4.txt, e5.txt, e6.txt, e7.txt: read as Latin-1"])
    square = Dataset(Path("/data"), samples[:1], 64)
    assert square.summary() == "1 images x 1 repeats from /data, square crops of 64px"


def test_buckets_snap_sides_down_to_whole_multiples_of_64():
    from trainer.dataset import bucket_size
    assert bucket_size(1000, 700, 1024) == (960, 640)  # 1000x700 is under 1024²: each side rounds down


def test_caption_text_that_is_not_utf8_nor_cp1252_is_read_as_latin1():
    from trainer.dataset import _decode_text
    assert _decode_text(b"\xef\xbb\xbfcat") == ("cat", None)  # the BOM is dropped
    text, note = _decode_text(b"ok\n\x81x")  # 0x81 is undefined in Windows-1252
    assert text == "ok\n\x81x"
    assert note == ("not UTF-8 (byte 0x81 on line 2), read as Latin-1; save it as UTF-8 if accented letters "
                    "look wrong")
    assert _decode_text(b"caf\xe9")[1].endswith("read as Windows-1252; save it as UTF-8 if accented letters "
                                                "look wrong")


def _csv_notes(tmp_path, content: bytes):
    from trainer.dataset import _read_caption_csv
    (tmp_path / "metadata.csv").write_bytes(content)
    notes = []
    return _read_caption_csv(tmp_path, notes), notes


def test_every_unusable_caption_row_is_noted_and_the_rows_after_it_still_read(tmp_path):
    captions, notes = _csv_notes(tmp_path, b"text,file_name\r\n"
                                           b"a,b,c\r\n"
                                           b",\r\n"
                                           b"x,  \r\n"
                                           b"one,a.png\r\n"
                                           b"two,a.png\r\n"
                                           b"\r\n"
                                           b"three\r\n"
                                           b"four,c.png\r\n")
    assert {name: (c.text, c.line) for name, c in captions.items()} == {"a.png": ("two", 6), "c.png": ("four", 9)}
    assert notes == [("metadata.csv line 2", "3 fields for 2 columns; row ignored (put captions with commas in "
                                             "double quotes)"),
                     ("metadata.csv line 4", "no file_name; row ignored"),
                     ("metadata.csv line 6", "a.png is listed again (first on line 5); this later caption is used"),
                     ("metadata.csv line 8", "no file_name; row ignored")]
    captions, notes = _csv_notes(tmp_path, b"file_name,text\nb.png\n")
    assert captions["b.png"].text == ""  # a row without its text column: no caption
    assert _csv_notes(tmp_path, b"") == ({}, [("metadata.csv", "empty; not used")])


def test_a_multi_line_quoted_caption_keeps_its_line_breaks(tmp_path):
    captions, notes = _csv_notes(tmp_path, b'file_name,text\r\na.png,"first\r\nsecond"\r\nb.png,x\r\n')
    assert captions["a.png"].text == "first\r\nsecond" and captions["b.png"].line == 4 and notes == []


def test_broken_quotes_are_told_apart_from_an_unclosed_one(tmp_path):
    import pytest
    from trainer.errors import LeanLoRAError
    fix = "; a caption in quotes must end with a quote and write a quote inside it as \"\" (or use no quotes at all)"
    with pytest.raises(LeanLoRAError) as error:
        _csv_notes(tmp_path, b'file_name,text\na.png,"never closed\n')
    assert str(error.value) == f"{tmp_path / 'metadata.csv'} line 2: a quote opened in this row is never closed{fix}"
    with pytest.raises(LeanLoRAError) as error:
        _csv_notes(tmp_path, b'file_name,text\na.png,"closed" then text\n')
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'metadata.csv'} line 2: broken quotes (") and message.endswith(fix)
    with pytest.raises(LeanLoRAError) as error:
        _csv_notes(tmp_path, b"name,caption\n")
    assert str(error.value).endswith("(found ['name', 'caption']); fix the header or delete the file and use "
                                     "<image>.txt captions")


def test_a_swallowed_row_is_found_by_its_first_field_only(tmp_path):
    from trainer.dataset import _CsvCaption, _swallowed_row
    names = {"b.png", "c.png"}
    assert _swallowed_row(_CsvCaption("x\nB.png, a cat, b.png", 2), names) == "B.png"
    assert _swallowed_row(_CsvCaption("x\nb.png and c.png", 2), names) is None  # no comma: prose, not a row
    assert _swallowed_row(_CsvCaption("x\na cat, c.png", 2), names) is None
    assert _swallowed_row(_CsvCaption("x\nb.png,c.png,d", 2), names) == "b.png"


def test_sixteen_bit_grey_is_scaled_and_rounded_and_alpha_composites_onto_white():
    import numpy as np
    from PIL import Image
    from trainer.dataset import _to_rgb
    grey = Image.fromarray(np.array([[0, 200, 386, 32896, 65278, 65535]], dtype=np.uint16))
    assert np.array(_to_rgb(grey))[0, :, 0].tolist() == [0, 1, 2, 128, 254, 255]  # value / 257, to the nearest
    half = Image.new("RGBA", (1, 1), (0, 0, 0, 128))
    assert np.array(_to_rgb(half))[0, 0].tolist() == [127, 127, 127]


def test_an_image_of_exactly_the_pixel_limit_is_used_and_the_message_states_the_limit(monkeypatch):
    import trainer.dataset as dataset
    assert dataset._too_large((15000, 10000)) is None
    assert dataset._too_large((15001, 10000)) == (
        "too large (15001x10000 = 150 megapixels; the limit is 150, a guard against decompression bombs); "
        "downscale it")
    assert dataset._too_large((30000, 10000)).startswith("too large (30000x10000 = 300 megapixels;")


def test_rotated_and_tiny_images_report_their_upright_size(tmp_path):
    from PIL import Image
    from trainer.dataset import _check_image
    for orientation, expected in ((1, (40, 20)), (5, (20, 40)), (6, (20, 40)), (7, (20, 40)), (8, (20, 40)),
                                  (3, (40, 20))):
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = tmp_path / f"o{orientation}.jpg"
        Image.new("RGB", (40, 20)).save(path, exif=exif)
        assert _check_image(path) == (None, expected, [])
    _png(tmp_path / "plain.png", (40, 20))
    assert _check_image(tmp_path / "plain.png") == (None, (40, 20), [])
    _png(tmp_path / "thin.png", (8, 30))
    assert _check_image(tmp_path / "thin.png")[0] is None
    _png(tmp_path / "tiny.png", (7, 30))
    assert _check_image(tmp_path / "tiny.png") == ("too small (7x30)", (7, 30), [])


def test_a_jpeg_smaller_than_8_pixels_still_gets_its_truncation_check(tmp_path):
    from PIL import Image
    from trainer.dataset import _check_image
    path = tmp_path / "small.jpg"
    Image.new("RGB", (12, 9), (200, 10, 10)).save(path)
    assert _check_image(path) == (None, (12, 9), [])
    path.write_bytes(path.read_bytes()[:-40])
    reason, size, notes = _check_image(path)
    assert reason.startswith("not a readable image (OSError: ") and size == (0, 0)


def test_files_that_cannot_be_read_are_skipped_with_a_zero_size_and_an_exact_reason(tmp_path):
    from trainer.dataset import _check_image
    (tmp_path / "empty.png").write_bytes(b"")
    reason, size, notes = _check_image(tmp_path / "empty.png")
    assert reason.startswith("not a readable image (UnidentifiedImageError: ") and (size, notes) == ((0, 0), [])
    assert _check_image(tmp_path / "gone.png") == (
        "no longer exists (deleted or moved after the folder was scanned)", (0, 0), [])
    import trainer.dataset as dataset
    assert dataset._os_reason(PermissionError(13, "Permission denied")) == "cannot be read (Permission denied)"
    assert dataset._os_reason(OSError("odd")) == "cannot be read (odd)"


def test_a_decompression_bomb_is_skipped_with_a_zero_size(tmp_path, monkeypatch):
    from PIL import Image
    from trainer.dataset import _check_image, load_image, UnusableImage
    import pytest
    _png(tmp_path / "bomb.png", (64, 64))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 is over twice that: PIL raises its bomb error
    reason, size, notes = _check_image(tmp_path / "bomb.png")
    assert reason.startswith("too large (") and reason.endswith("); downscale it") and size == (0, 0)
    with pytest.raises(UnusableImage) as error:
        load_image(tmp_path / "bomb.png", 64)
    assert error.value.path == tmp_path / "bomb.png" and error.value.reason.startswith("too large (")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3000)  # over the limit, under twice it: only a warning
    with warnings_as_errors():
        assert _check_image(tmp_path / "bomb.png")[0] is None
        assert load_image(tmp_path / "bomb.png", 64).shape == (64, 64, 3)


def warnings_as_errors():
    import warnings
    manager = warnings.catch_warnings()
    manager.__enter__()
    warnings.simplefilter("error")

    class _Undo:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            manager.__exit__(*exc)
    return _Undo()


def test_load_image_covers_and_center_crops_wide_and_tall_images(tmp_path):
    import numpy as np
    from PIL import Image
    from trainer.dataset import load_image
    wide = np.zeros((10, 30, 3), dtype=np.uint8)
    wide[:, 10:20] = 255  # a white middle third
    Image.fromarray(wide).save(tmp_path / "wide.png")
    out = load_image(tmp_path / "wide.png", (10, 10))
    assert out.shape == (10, 10, 3) and out.min() > 0.9  # only the middle third remains, not scaled down
    tall = np.zeros((30, 10, 3), dtype=np.uint8)
    tall[10:20] = 255
    Image.fromarray(tall).save(tmp_path / "tall.png")
    out = load_image(tmp_path / "tall.png", (10, 10))
    assert out.shape == (10, 10, 3) and out.min() > 0.9
    big = np.zeros((40, 40, 3), dtype=np.uint8)
    big[10:30, 10:30] = 255
    Image.fromarray(big).save(tmp_path / "big.png")
    out = load_image(tmp_path / "big.png", (21, 21))  # odd crop offsets: (21 - 21) // 2 after a cover of 21
    assert out.shape == (21, 21, 3)
    lanczos = torch.tensor(np.array(Image.fromarray(big).resize((21, 21), Image.Resampling.LANCZOS)),
                           dtype=torch.float32) / 255
    assert torch.equal(out, lanczos)
    odd = np.zeros((13, 31, 3), dtype=np.uint8)
    odd[:, 15] = 255
    Image.fromarray(odd).save(tmp_path / "odd.png")
    out = load_image(tmp_path / "odd.png", (12, 12))  # cover 29x12... crop from left (29-12)//2=8
    covered = Image.fromarray(odd).resize((max(12, round(31 * 12 / 13)), 12), Image.Resampling.LANCZOS)
    left = (covered.width - 12) // 2
    expected = torch.tensor(np.array(covered.crop((left, 0, left + 12, 12))), dtype=torch.float32) / 255
    assert torch.equal(out, expected)
    odd_tall = np.ascontiguousarray(odd.transpose(1, 0, 2))
    Image.fromarray(odd_tall).save(tmp_path / "odd_tall.png")
    out = load_image(tmp_path / "odd_tall.png", (12, 12))
    covered = Image.fromarray(odd_tall).resize((12, max(12, round(31 * 12 / 13))), Image.Resampling.LANCZOS)
    top = (covered.height - 12) // 2
    expected = torch.tensor(np.array(covered.crop((0, top, 12, top + 12))), dtype=torch.float32) / 255
    assert torch.equal(out, expected)



def test_a_crop_with_an_odd_margin_starts_at_the_lower_whole_pixel(tmp_path):
    import numpy as np
    from PIL import Image
    from trainer.dataset import load_image
    pixels = np.arange(31 * 12 * 3, dtype=np.uint8).reshape(12, 31, 3)  # 19 columns too many: 9 left, 10 right
    Image.fromarray(pixels).save(tmp_path / "wide.png")
    assert torch.equal(load_image(tmp_path / "wide.png", (12, 12)), torch.tensor(pixels[:, 9:21]).float() / 255)
    tall = np.ascontiguousarray(pixels.transpose(1, 0, 2))
    Image.fromarray(tall).save(tmp_path / "tall.png")
    assert torch.equal(load_image(tmp_path / "tall.png", (12, 12)), torch.tensor(tall[9:21]).float() / 255)


def test_megapixels_in_the_too_large_message_are_rounded_from_the_exact_count():
    from trainer.dataset import _too_large
    assert _too_large((150_500_001, 1)).startswith("too large (150500001x1 = 151 megapixels;")


def test_an_error_without_a_message_is_named_by_its_type(tmp_path, monkeypatch):
    from PIL import Image
    from trainer.dataset import _check_image

    def fails(*args, **kwargs):
        raise ValueError()
    monkeypatch.setattr(Image, "open", fails)
    assert _check_image(tmp_path / "x.png") == ("not a readable image (ValueError)", (0, 0), [])


def test_an_unreadable_metadata_csv_is_named_with_the_fix(tmp_path, monkeypatch):
    import pytest
    from pathlib import Path as _Path
    from trainer.dataset import _read_caption_csv
    from trainer.errors import LeanLoRAError
    (tmp_path / "metadata.csv").write_text("file_name,text\n")

    def read_bytes(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(_Path, "read_bytes", read_bytes)
    with pytest.raises(LeanLoRAError) as error:
        _read_caption_csv(tmp_path, [])
    assert str(error.value) == (f"{tmp_path / 'metadata.csv'}: cannot be read (Permission denied); fix its "
                                "permissions or delete it and use <image>.txt captions")

# --- loop: train_loop on one parameter, with SGD so every weight is known --------------------------------------

def _one_weight(value=1.0):
    return torch.nn.Parameter(torch.tensor([value]))


def _loop(w, loss_fn, steps, **kwargs):
    from helpers import loop_events
    from trainer.loop import StepParts, train_loop
    from trainer.step.precision import Precision
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD([w], lr=kwargs.pop("lr", 0.1))
    parts = StepParts([w], loss_fn, optimizer, Precision("no", CPU), kwargs.pop("accumulation", 1),
                      kwargs.pop("max_grad_norm", 1.0))
    first_step = kwargs.pop("first_step", 0)
    return train_loop(parts, kwargs.pop("batches", iter(range(1, 1000))), steps, loop_events(**kwargs), first_step)


def test_each_step_is_reported_once_in_order_with_the_mean_micro_batch_loss_and_its_rate():
    w, seen, after = _one_weight(), [], []
    result = _loop(w, lambda b: w.sum() * b, 5, accumulation=2, sync_every=3, on_step=seen.append,
                   after_step=lambda: after.append(w.item()), max_grad_norm=None)
    # micro-batches 1,2 / 3,4 / ...: each step's loss is the mean of w*b over its two; its gradient is mean(b)
    expected_w, expected_losses = [1.0], []
    for step in range(5):
        b1, b2 = 2 * step + 1, 2 * step + 2
        expected_losses.append(expected_w[-1] * (b1 + b2) / 2)
        expected_w.append(expected_w[-1] - 0.1 * (b1 + b2) / 2)
    assert result.losses == pytest_approx(expected_losses) and after == pytest_approx(expected_w[1:])
    assert [(info.step, info.total, info.lr) for info in seen] == [(s, 5, 0.1) for s in range(1, 6)]
    assert [info.loss for info in seen] == result.losses
    assert all(0 < a.seconds <= b.seconds < 60 for a, b in zip(seen, seen[1:]))  # seconds since the run began
    assert (result.steps_done, result.cancelled, result.diverged_at) == (5, False, None)


def pytest_approx(values):
    import pytest
    return pytest.approx(values, rel=1e-5)


def test_a_continued_run_counts_from_its_first_step():
    w, seen = _one_weight(), []
    result = _loop(w, lambda b: w.sum(), 5, first_step=3, on_step=seen.append)
    assert [info.step for info in seen] == [4, 5] and result.steps_done == 5
    stopped = _loop(_one_weight(), lambda b: w.sum(), 5, first_step=3, should_stop=lambda: True)
    assert (stopped.steps_done, stopped.cancelled, stopped.losses) == (3, True, [])


def test_gradients_are_clipped_to_max_grad_norm_and_zero_means_no_clipping():
    w = _one_weight(0.0)
    from trainer.loop import StepParts, train_loop
    from trainer.step.precision import Precision
    train_loop(StepParts([w], lambda b: 10 * w.sum(), torch.optim.SGD([w], lr=1.0), Precision("no", CPU)),
               iter(range(9)), 1)  # the default clips at 1
    assert w.item() == pytest_approx(-1.0)
    for max_norm, moved in ((1.0, 1.0), (None, 10.0), (0.0, 10.0), (20.0, 10.0)):
        w = _one_weight(0.0)
        _loop(w, lambda b: 10 * w.sum(), 1, lr=1.0, max_grad_norm=max_norm)
        assert w.item() == pytest_approx(-moved), max_norm


def test_a_nan_loss_stops_the_run_and_puts_back_the_last_weights_checked_finite():
    w, seen = _one_weight(), []
    losses = {1: 1.0, 2: 1.0, 3: 1.0, 4: float("nan"), 5: 1.0}
    result = _loop(w, lambda b: w.sum() * 0 + losses[b] + w.sum(), 5, lr=1.0, sync_every=2, on_step=seen.append)
    # steps 1 and 2 were read together and kept (w = -1); step 3 was fine but read with the NaN of step 4
    assert result.diverged_at == 4 and result.steps_done == 2 and w.item() == pytest_approx(-1.0)
    assert [info.step for info in seen] == [1, 2, 3] and len(result.losses) == 3


def test_a_nan_gradient_under_a_finite_loss_is_divergence_too():
    w = _one_weight()
    calls = []

    def loss_fn(b):
        calls.append(b)
        return torch.sqrt(w - w).sum() + w.sum() if b == 3 else w.sum()  # sqrt'(0) * 0: a NaN gradient
    result = _loop(w, loss_fn, 6, lr=1.0, sync_every=2)  # steps 3 and 4 are read together
    assert result.diverged_at == 3 and result.steps_done == 2 and w.item() == pytest_approx(-1.0)
    assert len(calls) == 4  # step 4 ran before the read of steps 3 and 4


def test_weights_that_overflow_under_finite_losses_end_the_run_at_the_windows_first_step():
    w = _one_weight()
    result = _loop(w, lambda b: w.sum() * (1e38 if b == 3 else 0.0), 6, lr=10.0, max_grad_norm=None)
    # step 3's loss (w * 1e38) is finite, its update sends w to -inf: no loss or norm saw it, the weights check did
    assert result.diverged_at == 3 and result.steps_done == 2 and w.item() == 1.0
    assert result.losses == pytest_approx([0.0, 0.0, 1e38])


def test_a_cancel_inside_an_accumulated_step_drops_only_that_step():
    w, seen = _one_weight(), []

    def loss_fn(b):
        if b == 4:  # the second micro-batch of step 2
            raise KeyError("cancelled by the user")
        return w.sum()
    result = _loop(w, loss_fn, 5, accumulation=2, cancel_errors=(KeyError,), on_step=seen.append)
    assert result.cancelled and result.steps_done == 1 and w.grad is None and [i.step for i in seen] == [1]
    assert w.item() == pytest_approx(0.9)



def test_the_fingerprint_names_the_folder_and_reads_captions_up_to_1_mib(tmp_path):
    import os
    from trainer.dataset import folder_fingerprint
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "x.txt").write_text("cat")
        os.utime(folder / "x.txt", ns=(10**18, 10**18))
    assert folder_fingerprint(a) != folder_fingerprint(b)  # same files, another folder

    def rewritten_keeping_size_and_time(path, data):
        before = folder_fingerprint(path.parent)
        path.write_bytes(data)
        os.utime(path, ns=(10**18, 10**18))
        return before != folder_fingerprint(path.parent)
    csv = a / "metadata.csv"
    csv.write_bytes(b"file_name,text\nx.png,a\n")
    os.utime(csv, ns=(10**18, 10**18))
    assert rewritten_keeping_size_and_time(csv, b"file_name,text\nx.png,b\n")
    mib = a / "long.txt"
    mib.write_bytes(b"a" * (1 << 20))
    os.utime(mib, ns=(10**18, 10**18))
    assert rewritten_keeping_size_and_time(mib, b"b" * (1 << 20))
    mib.write_bytes(b"a" * ((1 << 20) + 1))  # over 1 MiB: only its size and time count
    os.utime(mib, ns=(10**18, 10**18))
    assert not rewritten_keeping_size_and_time(mib, b"b" * ((1 << 20) + 1))


def test_scan_folder_errors_name_the_folder_and_the_fix(tmp_path, monkeypatch):
    import pytest
    from trainer.dataset import scan_folder
    from trainer.errors import LeanLoRAError
    with pytest.raises(LeanLoRAError) as error:
        scan_folder(tmp_path / "missing", 64)
    assert str(error.value) == (f"dataset folder {tmp_path / 'missing'} does not exist or is not a folder; give an "
                                "absolute path or a folder name inside ComfyUI's input folder")
    with pytest.raises(LeanLoRAError) as error:
        scan_folder("~no_such_user_leanlora/x", 64)
    assert str(error.value).startswith("dataset folder ~no_such_user_leanlora/x: ")
    assert str(error.value).endswith("; give an absolute path")
    with pytest.raises(LeanLoRAError) as error:
        scan_folder(tmp_path, 64)
    assert str(error.value) == (f"dataset folder {tmp_path} is empty; put images (.png, .jpg, .jpeg, .webp, .bmp) "
                                "with <image>.txt captions or a metadata.csv into it")
    for i in range(6):
        (tmp_path / f"f{i}.gif").write_bytes(b"x")
    (tmp_path / "README").write_bytes(b"x")
    (tmp_path / "gone.png").symlink_to(tmp_path / "nothing.png")
    with pytest.raises(LeanLoRAError) as error:
        scan_folder(tmp_path, 64)
    assert str(error.value) == (
        f"dataset folder {tmp_path} has no usable images (8 files skipped: gone.png: a link to a file that does not "
        "exist; README: extension (none) is not one of .png, .jpg, .jpeg, .webp, .bmp; f0.gif: extension .gif is "
        "not one of .png, .jpg, .jpeg, .webp, .bmp; f1.gif: extension .gif is not one of .png, .jpg, .jpeg, .webp, "
        ".bmp; f2.gif: extension .gif is not one of .png, .jpg, .jpeg, .webp, .bmp); add images (.png, .jpg, .jpeg, "
        ".webp, .bmp)")
    from pathlib import Path as _Path

    def unlistable(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(_Path, "iterdir", unlistable)
    with pytest.raises(LeanLoRAError) as error:
        scan_folder(tmp_path, 64)
    assert str(error.value) == f"dataset folder {tmp_path} cannot be listed (Permission denied); fix its permissions"


def test_a_scan_keeps_going_after_an_unreadable_caption(tmp_path, monkeypatch):
    from pathlib import Path as _Path
    from trainer.dataset import scan_folder
    for name in ("a", "b", "c"):
        _png(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text(name)
    real_read = _Path.read_bytes

    def read_bytes(self):
        if self.name == "a.txt":
            raise PermissionError(13, "Permission denied")
        return real_read(self)
    monkeypatch.setattr(_Path, "read_bytes", read_bytes)
    data = scan_folder(tmp_path, 64)
    assert [(s.path.name, s.caption) for s in data.samples] == [("b.png", "b"), ("c.png", "c")]
    assert data.skipped == (("a.png", "its caption a.txt cannot be read (Permission denied)"),)
    assert data.notes == () and data.buckets is False and data.repeats == 1


def test_a_swallowed_row_error_says_how_to_close_the_quote(tmp_path):
    import pytest
    from trainer.dataset import scan_folder
    from trainer.errors import LeanLoRAError
    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png")
    (tmp_path / "metadata.csv").write_text('file_name,text\na.png,"a cat\nb.png,a dog"\n')
    with pytest.raises(LeanLoRAError) as error:
        scan_folder(tmp_path, 64)
    assert str(error.value) == (f"{tmp_path / 'metadata.csv'} line 2: the caption of a.png runs over into the row "
                                "of b.png (a quote opened on line 2 closes later); close it on its own line, and "
                                "write a quote inside a caption as \"\"")


# --- lora --------------------------------------------------------------------------------------------------------

def _tiny_lora(**settings):
    from helpers import TinyNet
    from trainer.lora import inject_lora
    from trainer.settings import LoraSettings
    torch.manual_seed(0)
    net = TinyNet()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        before = net(x)
    params = inject_lora(net, LoraSettings(**settings), seed=0, target_modules=sd_targets(LoraSettings(**settings)))
    return net, params, x, before


def test_a_fresh_lora_changes_nothing_and_then_adds_alpha_over_rank_times_up_down():
    from trainer.lora import ADAPTER
    net, params, x, before = _tiny_lora(rank=4, alpha=2.0)
    with torch.no_grad():
        assert torch.equal(net(x), before)  # lora_up starts at zero: training starts from the base model
        layer = net.input_blocks[0]["attn1"].to_q
        layer.lora_B[ADAPTER].weight.fill_(0.1)
        inputs = torch.randn(3, 16)
        expected = layer.base_layer(inputs) + 0.5 * inputs @ layer.lora_A[ADAPTER].weight.T @ layer.lora_B[ADAPTER].weight.T
        assert torch.allclose(layer(inputs), expected, atol=1e-6)


def test_lora_dropout_is_applied_in_training_mode():
    from trainer.lora import ADAPTER
    net, params, x, before = _tiny_lora(rank=4, alpha=4.0, dropout=0.5)
    layer = net.input_blocks[0]["attn1"].to_q
    with torch.no_grad():
        layer.lora_B[ADAPTER].weight.fill_(1.0)
        inputs = torch.ones(64, 16)
        layer.train()
        assert not torch.equal(layer(inputs), layer(inputs))  # dropout draws differ per call
        layer.eval()
        assert torch.equal(layer(inputs), layer(inputs))


def test_no_matching_layer_names_the_target_preset():
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.lora import inject_lora
    from trainer.settings import LoraSettings
    with pytest.raises(LeanLoRAError) as error:
        inject_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraSettings(), seed=0, target_modules=sd_targets(LoraSettings()))
    message = str(error.value)
    assert message.startswith("LoRA targets 'attention' matched no layer of this model (")
    assert message.endswith("); pick another target preset")


def test_export_errors_say_what_to_pick_and_weights_are_saved_in_the_asked_dtype():
    import pytest
    from trainer.errors import LeanLoRAError
    from trainer.lora import kohya_state_dict
    from trainer.settings import LoraSettings
    net, params, x, before = _tiny_lora(rank=4, alpha=4.0)
    with pytest.raises(LeanLoRAError) as error:
        kohya_state_dict(net, LoraSettings(rank=4, alpha=4.0), module_names={})
    assert str(error.value) == ("cannot export the LoRA on 'input_blocks.0.attn1.to_q': kohya's naming for this "
                                "model has no name for that module; pick the attention targets")
    assert {v.dtype for k, v in kohya_state_dict(net, LoraSettings()).items() if k.endswith(".weight")} == {torch.float16}
    bf16 = kohya_state_dict(net, LoraSettings(), dtype=torch.bfloat16)
    assert {v.dtype for k, v in bf16.items() if k.endswith(".weight")} == {torch.bfloat16}


def test_a_nan_first_step_puts_back_the_weights_the_run_started_from():
    w = _one_weight()
    result = _loop(w, lambda b: w.sum() * float("nan"), 9, first_step=3, lr=1.0)
    assert (result.diverged_at, result.steps_done, result.losses) == (4, 3, []) and w.item() == 1.0


def test_a_micro_step_object_is_called_with_the_accumulation_and_zeroes_its_own_grads():
    w = _one_weight()
    calls = []

    class Step:  # the shape of micro_steps.BatchStep: forward + backward in one call, its own zero_grad
        def __call__(self, batch, accumulation):
            calls.append((batch, accumulation))
            (w.sum() / accumulation).backward()
            return w.detach().sum() / accumulation

        def zero_grad(self, optimizer):
            calls.append("zero")
            optimizer.zero_grad()
    result = _loop(w, Step(), 2, accumulation=2, lr=1.0, max_grad_norm=None)
    assert calls == [(1, 2), (2, 2), "zero", (3, 2), (4, 2), "zero"] and result.losses == [1.0, 0.0]


def test_fp16_clips_the_unscaled_gradient_and_leaves_overflowed_steps_to_the_scaler():
    from trainer.loop import StepParts, train_loop
    from trainer.step.precision import Precision
    w = _one_weight(0.0)
    fp16 = Precision("fp16", CPU, initial_scale=1024.0)
    grads = {1: 10.0, 2: None, 3: 10.0}

    def loss_fn(b):
        return torch.sqrt(w - w).sum() if grads[b] is None else grads[b] * w.sum()  # step 2: a NaN gradient
    result = train_loop(StepParts([w], loss_fn, torch.optim.SGD([w], lr=1.0), fp16), iter([1, 2, 3]), 3)
    assert result.diverged_at is None and result.steps_done == 3 and fp16.skipped_steps == 1
    assert w.item() == pytest_approx(-2.0)  # steps 1 and 3 moved by the clipped 1.0; step 2 was skipped


def test_exporting_a_module_without_a_lora_is_a_clear_error():
    """A plain module (no LoRA injected) names the problem instead of peft's AttributeError."""
    from helpers import TinyNet
    from trainer.errors import LeanLoRAError
    from trainer.lora import kohya_state_dict
    from trainer.settings import LoraSettings
    with pytest.raises(LeanLoRAError, match="holds no LoRA weights"):
        kohya_state_dict(TinyNet(), LoraSettings(rank=4, alpha=4.0))
