"""keep_last_saves (Train's keep-last-K of the save_every_n_steps files) in seconds, beside the slow
tests/test_resume.py::test_saves_every_n_steps_keep_the_last_k (tiny SD1.5, ~150 s loaded): the pruning lives inside
train_lora's on_save, so this drives train_lora on test_pure_torch_training's pure-torch model (no ComfyUI)."""
from __future__ import annotations

import pytest

from test_pure_torch_training import EAGER, TinyAdapter
from trainer.settings import LoraSettings, TrainSettings
from trainer.training_state import STATE_SUFFIX
from trainer.train_lora import train_lora


@pytest.mark.parametrize("keep, kept", [(2, [6, 9]), (1, [9]), (0, [3, 6, 9]), (5, [3, 6, 9])])
def test_keep_last_k_deletes_older_step_files_and_their_states_only(dataset, tmp_path, keep, kept):
    (tmp_path / "other_step3.safetensors").write_bytes(b"a file of another run")  # never touched
    events = []
    outcome = train_lora(TinyAdapter(), dataset, EAGER, LoraSettings(rank=2, alpha=2.0),
                         TrainSettings(10, 1e-3, 0, "prune", save_every_steps=3, keep_last_saves=keep), tmp_path,
                         lambda **event: events.append(event), lambda: False)
    assert [e["step"] for e in events if e["kind"] == "saved"] == [3, 6, 9]  # step 10 is the final file's
    assert outcome.lora_path == tmp_path / "prune.safetensors"
    assert sorted(p.name for p in tmp_path.glob("prune*.safetensors")) == sorted(
        ["prune.safetensors", *(f"prune_step{step}.safetensors" for step in kept)])
    assert sorted(p.name for p in tmp_path.glob(f"*{STATE_SUFFIX}")) == sorted(
        [f"prune{STATE_SUFFIX}", *(f"prune_step{step}{STATE_SUFFIX}" for step in kept)])
    assert (tmp_path / "other_step3.safetensors").read_bytes() == b"a file of another run"
