"""Long runs: saves every N steps and exact resume from a training state, in process on the tiny SD1.5 checkpoint
through ComfyUI's own objects (CPU, fp32: every number is reproducible)."""
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.errors import LeanLoRAError
from trainer.settings import LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import (STATE_SUFFIX, find_latest_state, load_training_state, save_training_state,
                                    state_path)

FP32 = MemorySettings("no", False, batch_size=1, gradient_accumulation=3)  # 2 images: epochs end mid-step
LORA = LoraSettings(rank=4, alpha=4.0)


def _train(adapter, dataset, folder: Path, steps=20, memory=FP32, should_stop=lambda: False, events=None, **train):
    emit = (lambda **event: events.append(event)) if events is not None else (lambda **event: None)
    settings = TrainSettings(steps, 1e-3, 0, "resume_me", "cosine", 2, **train)
    return train_lora(adapter, dataset, memory, LORA, settings, folder, emit, should_stop)


def _assert_same_lora_file(a: Path, b: Path) -> None:
    """Every tensor bit for bit and the same metadata (safetensors writes its metadata map in no fixed order, so
    two saves of the same content differ in the header's byte order)."""
    with safe_open(str(a), framework="pt") as fa, safe_open(str(b), framework="pt") as fb:
        assert fa.metadata() == fb.metadata()
        assert sorted(fa.keys()) == sorted(fb.keys())
        for key in fa.keys():
            ta, tb = fa.get_tensor(key), fb.get_tensor(key)
            assert ta.dtype == tb.dtype and torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)), key


def test_seven_steps_then_a_resumed_thirteen_equal_twenty_straight(adapter, dataset, tmp_path):
    straight = _train(adapter, dataset, tmp_path / "straight", save_every_steps=7)
    state = tmp_path / "straight" / f"resume_me_step7{STATE_SUFFIX}"
    assert state.is_file() and (tmp_path / "straight" / "resume_me_step14.safetensors").is_file()
    resumed = _train(adapter, dataset, tmp_path / "resumed", resume_from=state)
    # every loss bit for bit: the batches (step 7 ends mid-epoch: 21 micro-batches of 2 images), noise,
    # timesteps, optimizer moments and the cosine schedule's position all continue where step 7 left them
    assert resumed.losses == straight.losses and len(resumed.losses) == 20
    assert resumed.lora_path.name == straight.lora_path.name == "resume_me.safetensors"
    _assert_same_lora_file(resumed.lora_path, straight.lora_path)
    assert resumed.lora_path.read_bytes() == straight.lora_path.read_bytes()  # the file, byte for byte
    assert "resumed from resume_me_step7.leanlora-state: step 7 of 20" in resumed.report
    assert "(steps 8-20 of 20)" in resumed.report
    # saving every N steps changes nothing about the training itself
    unsaved = _train(adapter, dataset, tmp_path / "unsaved")
    assert unsaved.losses == straight.losses
    assert not list((tmp_path / "unsaved").glob(f"*{STATE_SUFFIX}"))  # no state without save points or a stop


def test_a_cancelled_run_resumes_to_the_uninterrupted_result(adapter, dataset, tmp_path):
    straight = _train(adapter, dataset, tmp_path / "straight", steps=12)
    events = []
    stop_after = lambda: sum(e["kind"] == "step" for e in events) >= 5  # noqa: E731 - Cancel after step 5
    cancelled = _train(adapter, dataset, tmp_path / "cancelled", steps=12, should_stop=stop_after, events=events)
    assert cancelled.partial and cancelled.lora_path.name == "resume_me_partial_step5.safetensors"
    state = state_path(cancelled.lora_path)
    assert state.is_file() and load_training_state(state).step == 5
    assert find_latest_state([tmp_path / "cancelled"], "resume_me") == state
    resumed = _train(adapter, dataset, tmp_path / "cancelled", steps=12, resume_from=state)
    assert resumed.losses == straight.losses
    resumed_tensors, straight_tensors = load_file(resumed.lora_path), load_file(straight.lora_path)
    assert resumed_tensors.keys() == straight_tensors.keys()
    assert all(torch.equal(resumed_tensors[key], value) for key, value in straight_tensors.items())


def test_saves_every_n_steps_keep_the_last_k(adapter, dataset, tmp_path):
    events = []
    outcome = _train(adapter, dataset, tmp_path, steps=10, save_every_steps=3, keep_last_saves=2, events=events)
    saved = [e["step"] for e in events if e["kind"] == "saved"]
    assert saved == [3, 6, 9]  # the last step is the final file's
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == ["resume_me.safetensors", "resume_me_step6.safetensors", "resume_me_step9.safetensors"]
    assert sorted(p.name for p in tmp_path.glob(f"*{STATE_SUFFIX}")) == [
        "resume_me.leanlora-state", "resume_me_step6.leanlora-state", "resume_me_step9.leanlora-state"]
    for name in names:  # each a complete LoRA with its own step count
        with safe_open(str(tmp_path / name), framework="pt") as handle:
            steps = int(handle.metadata()["ss_steps"])
            assert len(list(handle.keys())) == len(outcome.lora_state_dict)
        assert steps == (10 if name == "resume_me.safetensors" else int(name.split("step")[1].split(".")[0]))
    assert find_latest_state([tmp_path], "resume_me") == tmp_path / "resume_me.leanlora-state"


def test_resume_with_other_memory_settings_is_allowed_and_said(adapter, dataset, tmp_path):
    _train(adapter, dataset, tmp_path, steps=6, save_every_steps=3)
    other = MemorySettings("no", True, batch_size=1, gradient_accumulation=2, optimizer="Lion")
    outcome = _train(adapter, dataset, tmp_path, steps=6, memory=other,
                     resume_from=tmp_path / f"resume_me_step3{STATE_SUFFIX}")
    assert len(outcome.losses) == 6
    assert "the optimizer moments restart" in outcome.report and "trained with AdamW" in outcome.report


def test_a_resume_trains_at_train_s_rates_not_those_stored_in_the_state(adapter, dataset, tmp_path):
    """Issue 45: the optimizer's stored rates and settings give way to this run's (its moments are kept), and the
    schedule is rebuilt from Train's values: the weights follow the learning rate Train says."""
    _train(adapter, dataset, tmp_path / "first", steps=6, save_every_steps=3)
    state = tmp_path / "first" / f"resume_me_step3{STATE_SUFFIX}"
    edited = load_training_state(state)  # the same moments, stored as if trained at 0.1 with other betas
    for group in edited.optimizer["param_groups"]:
        group.update(lr=0.05, initial_lr=0.1, betas=(0.5, 0.6), weight_decay=0.3)
    edited_state = save_training_state(tmp_path / f"edited{STATE_SUFFIX}", edited)

    def resume(name: str, lr: float, path: Path):
        settings = TrainSettings(6, lr, 0, "resume_me", "cosine", 2, resume_from=path)
        return train_lora(adapter, dataset, FP32, LORA, settings, tmp_path / name, lambda **e: None, lambda: False)

    fast, slow, fast_edited = resume("fast", 0.1, state), resume("slow", 1e-3, state), resume("e", 0.1, edited_state)
    weights = lambda outcome: torch.cat([t.float().reshape(-1) for t in outcome.lora_state_dict.values()])  # noqa: E731
    assert not torch.allclose(weights(fast), weights(slow))  # before the fix: bit for bit the same (1e-3)
    assert torch.equal(weights(fast), weights(fast_edited))  # what a state stored at 0.1 trains: the same
    assert "resume: changed since the state: learning_rate 0.001 -> 0.1" in fast.report
    assert "resume: the optimizer steps with this run's settings, not those stored in the state: learning_rate " \
           "0.001 -> 0.1" in fast.report
    assert "betas (0.5, 0.6) -> (0.9, 0.999), weight_decay 0.3 -> 0.01" in fast_edited.report
    assert "the optimizer steps with this run's settings" not in slow.report  # nothing replaced


def test_resume_refuses_another_dataset_lora_shape_or_no_steps_left(adapter, dataset, tmp_path, tmp_path_factory):
    import tiny_assets as tiny_assets_lib
    from trainer.dataset import scan_folder
    _train(adapter, dataset, tmp_path, steps=4, save_every_steps=2)
    state = tmp_path / f"resume_me{STATE_SUFFIX}"
    other_images = scan_folder(tiny_assets_lib.build_tiny_dataset(tmp_path_factory.mktemp("other"), n=3), 64)
    with pytest.raises(LeanLoRAError, match="dataset .* differs.*continue_from"):
        _train(adapter, other_images, tmp_path / "x", steps=8, resume_from=state)
    with pytest.raises(LeanLoRAError, match="LoRA shape"):
        settings = TrainSettings(8, 1e-3, 0, "resume_me", resume_from=state)
        train_lora(adapter, dataset, FP32, LoraSettings(rank=8, alpha=8.0), settings, tmp_path / "x",
                   lambda **e: None, lambda: False)
    with pytest.raises(LeanLoRAError, match="trained 4 steps already.*raise steps above 4"):
        _train(adapter, dataset, tmp_path / "x", steps=4, resume_from=state)
    assert not (tmp_path / "x").exists() or not list((tmp_path / "x").glob("*.safetensors"))


def test_damaged_or_foreign_state_files_are_clear_errors(adapter, dataset, tmp_path):
    damaged = tmp_path / f"broken{STATE_SUFFIX}"
    damaged.write_bytes(b"\x00" * 100)
    with pytest.raises(LeanLoRAError, match=f"training state {damaged} cannot be read"):
        _train(adapter, dataset, tmp_path, resume_from=damaged)
    lora = tmp_path / "a_lora.safetensors"
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(lora))
    with pytest.raises(LeanLoRAError, match="is not a LeanLoRA training state"):
        _train(adapter, dataset, tmp_path, resume_from=lora)


def test_a_state_round_trips_nested_optimizer_state_without_pickle(tmp_path):
    from trainer.training_state import TrainingState
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.99))
    sum((p ** 2).sum() for p in params).backward()
    optimizer.step()
    state = TrainingState(step=7, lora=[p.detach() for p in params], optimizer_name="AdamW",
                          optimizer=optimizer.state_dict(), scaler=None,
                          rng={"sampler": torch.Generator().manual_seed(3).get_state(), "python": (3, (1, 2), None)},
                          data={"order": [[0, 1], [2]], "position": 1, "batch_size": 2}, losses=[0.5, 0.25],
                          fingerprints={"dataset": "d"}, settings={"seed": "0"}, output_name="x")
    path = save_training_state(tmp_path / f"x{STATE_SUFFIX}", state)
    back = load_training_state(path)
    assert back.step == 7 and back.losses == [0.5, 0.25] and back.data == state.data
    assert back.rng["python"] == (3, (1, 2), None)
    fresh = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    fresh.load_state_dict(back.optimizer)
    assert fresh.param_groups[0]["betas"] == (0.8, 0.99)
    for a, b in zip(optimizer.state.values(), fresh.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    header = path.read_bytes()[:2000]
    assert b"pickle" not in header and b"leanlora-training-state/1" in header


def test_the_same_seed_gives_the_same_run_with_lora_dropout(adapter, dataset, tmp_path):
    # peft's dropout draws from torch's global generator, which other code in the process moves on
    dropout = LoraSettings(rank=4, alpha=4.0, dropout=0.3)
    runs = []
    for name in ("a", "b"):
        torch.rand(7)  # the process's generator is elsewhere each time
        runs.append(train_lora(adapter, dataset, FP32, dropout, TrainSettings(4, 1e-3, 0, name), tmp_path / name,
                               lambda **e: None, lambda: False))
    assert runs[0].losses == runs[1].losses
    assert all(torch.equal(runs[0].lora_state_dict[k], runs[1].lora_state_dict[k]) for k in runs[0].lora_state_dict)


def test_a_resume_cancelled_before_its_first_step_saves_nothing_and_says_so(adapter, dataset, tmp_path, monkeypatch):
    """Cancel while a resumed run is still measuring memory (before the state's step is restored): nothing was
    trained, so no file is written (not a `_partial_step0` LoRA of the untrained state) and the error says so."""
    from trainer.errors import TrainingCancelled
    from trainer.session import TrainingSession
    _train(adapter, dataset, tmp_path, steps=6, save_every_steps=3)
    state = tmp_path / f"resume_me_step3{STATE_SUFFIX}"
    before = sorted(p.name for p in tmp_path.iterdir())

    def cancelled_while_measuring(self, memory):  # as ComfyUI's interrupt raises in a probe step
        raise TrainingCancelled("cancelled")
    monkeypatch.setattr(TrainingSession, "start", cancelled_while_measuring)
    with pytest.raises(TrainingCancelled, match="cancelled before the first step"):
        _train(adapter, dataset, tmp_path, steps=6, resume_from=state)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
