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


# --- EMA ----------------------------------------------------------------------------------------------------------

def test_the_ema_is_the_saved_lora_and_follows_its_formula(tmp_path):
    """ema_decay 0.9 over 6 steps: the file is the average of the weights after each step, with diffusers' warm-up
    min(decay, (1 + t) / (10 + t)), from the initial weights; the raw weights exported differ."""
    traced = []
    from trainer import ema as ema_module
    original = ema_module.LoraEMA.update

    def tracing(self):  # records the weights each update sees (the real update still runs)
        traced.append([p.detach().clone() for p in self.params])
        original(self)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ema_module.LoraEMA, "update", tracing)
        outcome = run(tmp_path, "ema", "AdamW", save_every_steps=6, ema_decay=0.9)
    state = load_training_state(state_path(outcome.lora_path))
    adapter = TinyAdapter()
    unet = adapter.training_unet()
    average = torch.cat([p.detach().reshape(-1) for p in inject_lora(unet, LORA, 0, adapter.lora_targets(unet, None))])
    for t, weights in enumerate(traced):
        rate = min(0.9, (1 + t) / (10 + t))
        average = rate * average + (1 - rate) * torch.cat([w.reshape(-1) for w in weights])
    torch.testing.assert_close(state.ema["average"], average)
    assert state.ema["updates"] == 6 and len(traced) == 6
    sizes = [p.numel() for p in state.lora]
    assert same(outcome.lora_state_dict, export([part.view_as(p) for part, p in
                                                 zip(state.ema["average"].split(sizes), state.lora)]))
    assert not same(outcome.lora_state_dict, export(state.lora))
    assert "training options: ema_decay 0.9" in outcome.report


def test_ema_with_schedule_free_and_bad_decays_are_refused(tmp_path):
    with pytest.raises(LeanLoRAError, match=r"^ema_decay: got 0.9 with optimizer AdamWScheduleFree"):
        run(tmp_path, "both", "AdamWScheduleFree", ema_decay=0.9)
    for decay in (-0.1, 0.2, 1.0, float("nan")):
        with pytest.raises(LeanLoRAError, match=r"^ema_decay: got "):
            TrainSettings(ema_decay=decay)
