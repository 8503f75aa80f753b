"""Issue 44's levers as auto-fit uses them after the GPU measured them (docs/BENCHMARKS.md "The whole card and its
levers"): the prefetch ring is on wherever auto-fit streams and is the ladder's last rung; selective recompute,
whose memory auto-fit's model does not know, is the first rung taken; a probe that ran out of memory with part of
the weights streamed streams a twentieth more, not a fifth."""
from __future__ import annotations

from dataclasses import replace

import torch

from trainer.memory import fit, ladder, planner
from trainer.settings import AutoFit, BaseWeights, MemorySettings

GPU = torch.device("cuda", 0)  # next_rung only asks whether a device is a GPU: nothing runs on it


def test_auto_fit_starts_with_streamed_weights_fetched_a_layer_ahead():
    user = MemorySettings(mixed_precision="bf16", auto_fit=AutoFit(card_gib=8))
    assert not user.prefetch_streamed
    fastest, _ = planner.relaxed(user)
    assert fastest.prefetch_streamed
    streamed = replace(fastest, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.65)
    assert "fetched a layer ahead" in streamed.describe()
    assert "fetched a layer ahead" not in fastest.describe()  # nothing streamed: nothing said


def test_the_prefetch_is_given_up_only_after_every_weight_is_streamed():
    memory = MemorySettings(mixed_precision="bf16", gradient_checkpointing=True, optimizer="AdamW8bit",
                            base_weights=BaseWeights.FP8_STREAMED, stream_share=0.8, activation_offload=True,
                            prefetch_streamed=True)
    walked, descriptions = memory, []
    while (rung := ladder.next_rung(walked, GPU)) is not None:
        walked, description = rung
        descriptions.append(description)
    assert descriptions == ["every frozen weight streamed from CPU memory",
                            "streamed weights no longer fetched a layer ahead"]
    assert walked.stream_share == 1.0 and not walked.prefetch_streamed


def test_selective_recompute_is_the_first_rung_once_blocks_are_recomputed():
    memory = MemorySettings(mixed_precision="bf16", gradient_checkpointing=True, checkpoint_share=0.6,
                            selective_recompute=True)
    walked, description = ladder.next_rung(memory, GPU)
    assert not walked.selective_recompute and "selective recompute off" in description
    assert walked.checkpoint_share == 0.6 and walked.optimizer == memory.optimizer  # nothing else given up
    # without checkpointing it changes nothing: the first rung stays checkpointing
    off = replace(memory, gradient_checkpointing=False)
    assert ladder.next_rung(off, GPU)[0].gradient_checkpointing


def test_a_probe_that_ran_out_of_memory_streams_a_twentieth_more_not_a_fifth():
    memory = MemorySettings(mixed_precision="bf16", gradient_checkpointing=True, optimizer="AdamW8bit",
                            base_weights=BaseWeights.FP8_STREAMED, stream_share=0.6, activation_offload=True)
    rung, _ = ladder.next_rung(memory, GPU)
    assert rung.stream_share == 0.8  # the mid-run ladder's fifth
    sized, description = fit.probe_oom_stream_rung(memory, rung)
    assert sized.stream_share == 0.65 and description.endswith("60% -> 65%")
    near_the_top = replace(memory, stream_share=0.97)
    top, _ = fit.probe_oom_stream_rung(near_the_top, ladder.next_rung(near_the_top, GPU)[0])
    assert top.stream_share == 1.0


def test_the_ladder_walk_before_step_one_takes_twentieths_after_a_probe_runs_out_of_memory(monkeypatch):
    """walk_ladder itself: a probe that cannot measure (out of memory) at 60% streamed probes 65% next."""
    from trainer.memory.estimate import MemoryEstimate
    probed = []

    class Session:
        unplaced = None
        adapter = type("Adapter", (), {"device": GPU})()
        micro_step = type("Step", (), {"budget": None, "extra_memory": staticmethod(lambda estimate: 0)})()
        memory = MemorySettings(mixed_precision="bf16", gradient_checkpointing=True, optimizer="AdamW8bit",
                                base_weights=BaseWeights.FP8_STREAMED, stream_share=0.6, activation_offload=True,
                                auto_fit=AutoFit(card_gib=8))

        def configure(self, memory):
            self.memory = memory

        def free_failed_step(self, error):
            pass

        def estimate(self, raise_oom=False):
            probed.append(self.memory.stream_share)
            if self.memory.stream_share < 0.7:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated probe)")
            return MemoryEstimate(frozen_weights=2 ** 30, lora_parameters=0, gradients=0, optimizer_state=0,
                                  activations=2 ** 30, workspace=0)
    monkeypatch.setattr(fit, "probes_capped_at", lambda budget, device: _nothing())
    monkeypatch.setattr(fit, "next_rung_for", lambda session, estimate=None: ladder.next_rung(session.memory, GPU))
    session = Session()
    _, lines = fit.walk_ladder(session, 8 * 2 ** 30)
    assert probed == [0.6, 0.65, 0.7], lines
    assert any(line.endswith("60% -> 65%") for line in lines), lines


def _nothing():
    import contextlib
    return contextlib.nullcontext()
