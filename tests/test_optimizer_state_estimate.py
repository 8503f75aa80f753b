"""The memory estimate's optimizer term against the bytes the optimizer actually holds, through a real training run
(issue 41, item 6; missed twice): the session steps one flat tensor (FlatParameters) for bitsandbytes and Prodigy,
bf16 chunks (BF16Weights) with lora_weights bf16, and the tensors themselves otherwise. Whatever it builds, the
estimate the session makes before step 1 (TrainingSession.estimate -> memory/estimate.static_terms) must equal the
state tensors the optimizer has allocated after its steps: an 8-bit optimizer's quantized moments of the flat
tensor (not the fp32 moments of its small pieces), Prodigy's four full copies, Adafactor's factored moments.

The tiny pure-torch model of test_pure_torch_training (no ComfyUI), rank 32: its LoRA tensors are each below
bitsandbytes' 4096-element threshold for 8-bit state, their flat tensor above it (the two give different bytes)."""
from __future__ import annotations

import pytest
import torch

from helpers import optimizer_state_tensor_bytes
from test_pure_torch_training import EAGER, TinyAdapter
from trainer.optimizers import MIN_8BIT_SIZE, OPTIMIZERS
from trainer.settings import LoraSettings, LoraWeights, TrainSettings
from trainer.train_lora import train_lora


def _run(dataset, tmp_path, monkeypatch, memory, lora=LoraSettings(rank=32, alpha=32.0)):
    """Trains 2 steps; returns (the estimate's optimizer term before step 1, the state bytes after each step, the
    optimizer, its LoRA tensors)."""
    from trainer.session import TrainingSession
    seen = {"estimates": [], "after_steps": []}
    real = TrainingSession.start

    def start(self, memory):
        estimate, lines = real(self, memory)
        optimizer = self.optimizer
        seen["estimates"].append(estimate.optimizer_state)
        seen["optimizer"], seen["params"] = optimizer, list(self.params)
        inner = optimizer.step

        def measured_step(*args, **kwargs):
            result = inner(*args, **kwargs)
            seen["after_steps"].append(optimizer_state_tensor_bytes(optimizer))
            return result
        optimizer.step = measured_step
        return estimate, lines
    monkeypatch.setattr(TrainingSession, "start", start)
    outcome = train_lora(TinyAdapter(), dataset, memory, lora, TrainSettings(2, 1.0 if memory.optimizer == "Prodigy" else 1e-3, 0, "estimate"), tmp_path,
                         lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2
    return seen


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizer_term_of_the_estimate_is_what_the_optimizer_allocates(dataset, tmp_path, monkeypatch, name):
    import dataclasses
    memory = dataclasses.replace(EAGER, optimizer=name)
    seen = _run(dataset, tmp_path, monkeypatch, memory)
    optimizer, params = seen["optimizer"], seen["params"]
    used = type(optimizer).__name__
    if used != ("AdamW8bit" if name == "PagedAdamW8bit" else name):
        pytest.skip(f"{name} is not installed here: {used} was used")
    flat = getattr(optimizer, "leanlora_flat", None)
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    if name in ("AdamW8bit", "PagedAdamW8bit", "Lion8bit", "Prodigy", "Lion"):
        assert flat is not None and stepped == [flat.param]  # the session steps one flat tensor for these
    if flat is not None and name.endswith("8bit"):
        # the case that tells the flat tensor from its pieces: each piece would keep fp32 moments
        assert flat.param.numel() >= MIN_8BIT_SIZE and all(p.numel() < MIN_8BIT_SIZE for p in params)
    [estimate] = seen["estimates"]
    assert seen["after_steps"] and estimate > 0
    assert all(measured == estimate for measured in seen["after_steps"]), (name, estimate, seen["after_steps"])


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "Adafactor", "AdamW"])  # Prodigy: refused with bf16
def test_with_bf16_lora_weights_the_estimate_is_the_chunks_state(dataset, tmp_path, monkeypatch, name):
    """lora_weights bf16: the optimizer steps fp32 stand-ins of the flat bf16 buffer's chunks; its state is
    allocated for those (BF16Weights.state_shapes), and the estimate counts the same."""
    import dataclasses
    from trainer.optimizers import BF16Weights
    monkeypatch.setattr(BF16Weights, "CHUNK", 3000)  # several chunks, one of them below the 8-bit threshold
    memory = dataclasses.replace(EAGER, mixed_precision="bf16", optimizer=name,
                                 lora_weights=next(w for w in LoraWeights if w is not LoraWeights.FP32))
    seen = _run(dataset, tmp_path, monkeypatch, memory, LoraSettings(rank=32, alpha=32.0))
    optimizer = seen["optimizer"]
    if type(optimizer).__name__ != name:
        pytest.skip(f"{name} is not installed here")
    flat = getattr(optimizer, "leanlora_flat", None)
    if not isinstance(flat, BF16Weights):
        pytest.skip("bf16 LoRA weights fell back to fp32 on this CPU")
    assert len(flat.slices) >= 2
    [estimate] = seen["estimates"]
    assert seen["after_steps"] and all(measured == estimate for measured in seen["after_steps"]), \
        (name, estimate, seen["after_steps"])
