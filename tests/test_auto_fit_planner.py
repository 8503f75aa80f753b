"""Auto-fit picks the fastest plan that fits (trainer/memory/planner.py, fit.py), on a simulated card: the session
below measures memory as the real probes do (two probe steps, a quarter of the area and the full size, an
out-of-memory error past the card), from a model with exact static terms and activations that fall linearly with
the units recomputed, per image (the probes step one image, as the real ones do). What is asserted is the plan chosen and what the report says, not
the model."""
from dataclasses import replace

import pytest
import torch

from trainer.memory import fit, planner
from trainer.memory.estimate import GIB, MemoryEstimate
from trainer.optimizers import optimizer_state_bytes
from trainer.settings import AutoFit, BaseWeights, MemorySettings, TrainSettings
from trainer.step.checkpointing import RankedUnits, units_for_share

AREA = 64 * 64  # the latent's area; the probes run at 32 x 32 and 64 x 64
UNITS = 10


class SimulatedCard:
    def __init__(self, gib: float):
        self.card = int(gib * GIB)

    def usable(self) -> int:
        return self.card


class SimulatedSession:
    """What fit_to_card drives: configure, estimate (probes) and the session's measures. Weights take
    `weights_gib` as loaded (half in fp8), activations `none_gib` with no unit recomputed and `full_gib` with every
    one, `workspace_gib` per step. `actual_extra_gib`: what the real step needs beyond that model at partial shares
    (the planner's prediction is then low and the probe must catch it)."""

    def __init__(self, weights_gib=6.0, none_gib=10.0, full_gib=1.0, workspace_gib=0.25, actual_extra_gib=0.0,
                 images=64):
        self.weights, self.none, self.full = weights_gib * GIB, none_gib * GIB, full_gib * GIB
        self.workspace, self.actual_extra = int(workspace_gib * GIB), actual_extra_gib * GIB
        self.images = images  # in the largest bucket: a batch holds at most this many
        self.adapter = type("Adapter", (), {"device": torch.device("cpu"),
                                            "projected_weight_bytes": self._weight_bytes})()
        self.unet = None
        self.params = [torch.nn.Parameter(torch.zeros(1024, 1024))]  # 4 MiB of LoRA
        self.optimizer = torch.optim.SGD(self.params, lr=0.1)
        self.micro_step = type("Step", (), {"budget": None, "extra_memory": staticmethod(lambda estimate: 0)})()
        self.units = RankedUnits([torch.nn.Identity() for _ in range(UNITS)], [(1, 1)] * UNITS)
        self.memory, self.configured, self.cap = None, [], None
        self.unplaced = None  # the frozen weights are placed (TrainingSession.configure)
        self.free_failed_step = lambda error: None
        self.train, self.ema = TrainSettings(), None  # no EMA of the LoRA weights (fit counts it when on)
        self.text_encoder = None  # text_encoder_lr off (fit counts the trained encoder's weights when on)

    def _weight_bytes(self, unet, dtype, base_weights, share):
        return int(self.weights / 2) if base_weights.fp8 else int(self.weights)

    def configure(self, memory):
        self.memory = memory
        self.configured.append(memory)

    def checkpoint_units(self, depth):
        return self.units

    def largest_batch(self, batch_size=1):
        return torch.zeros(batch_size, 4, 64, 64), {}

    def run_batch_size(self, batch_size=None):
        return min(batch_size or self.memory.batch_size, self.images)

    def static(self) -> int:
        lora = sum(p.numel() * 4 for p in self.params)
        return self._weight_bytes(None, None, self.memory.base_weights, 1.0) + 2 * lora + \
            optimizer_state_bytes(self.memory.optimizer, self.params)

    def activations(self) -> float:
        memory = self.memory
        count = units_for_share(UNITS, memory.checkpoint_share) if memory.gradient_checkpointing else 0
        partial = 0 < count < UNITS
        return self.none - (self.none - self.full) * count / UNITS + (self.actual_extra if partial else 0)

    def estimate(self, raise_oom=False, measured=None, sides=(0.5, 1.0)):
        static = self.static()
        for area in [int(AREA * side * side) for side in sides]:
            transient = int(self.activations() * area / AREA) + self.workspace
            if static + transient > self.card_bytes:
                if not raise_oom:  # as TrainingSession.estimate: the report says the probe ran out of memory
                    return MemoryEstimate(static, 0, 0, 0)
                raise torch.OutOfMemoryError("CUDA out of memory (simulated card)")
            if measured is not None:
                measured.append((area, transient))
        if len(sides) < 2:
            return MemoryEstimate(static, 0, 0, 0)  # as probe_activations: no line through one point
        lora = sum(p.numel() * 4 for p in self.params)
        return MemoryEstimate(frozen_weights=static - 2 * lora - optimizer_state_bytes(self.memory.optimizer,
                                                                                        self.params),
                              lora_parameters=lora, gradients=lora,
                              optimizer_state=optimizer_state_bytes(self.memory.optimizer, self.params),
                              activations=int(self.activations() * self.run_batch_size()), workspace=self.workspace)


def _fit(session, card_gib, memory=None):
    card = SimulatedCard(card_gib)
    session.card_bytes = card.card
    memory = memory or MemorySettings(auto_fit=AutoFit(card_gib=card_gib), gradient_checkpointing=False)
    estimate, lines = fit.fit_to_card(session, memory, card)
    return session.memory, estimate, lines


def test_auto_fit_takes_off_the_users_savers_and_a_large_card_gets_the_fastest_plan():
    """The shipped settings hold savers (checkpointing, an 8-bit optimizer, fp8, offload): with a card that has
    room, auto-fit runs without any of them and says what it took off. Precision and batch stay."""
    held = MemorySettings(mixed_precision="fp16", gradient_checkpointing=True, checkpoint_share=1.0, batch_size=2,
                          gradient_accumulation=3, optimizer="AdamW8bit", base_weights=BaseWeights.FP8,
                          activation_offload=True, auto_fit=AutoFit(card_gib=40))
    session = SimulatedSession()
    memory, estimate, lines = _fit(session, 40, held)
    assert (memory.gradient_checkpointing, memory.optimizer, memory.base_weights, memory.activation_offload) == \
        (False, "AdamW", BaseWeights.AS_LOADED, False)
    assert (memory.mixed_precision, memory.batch_size, memory.gradient_accumulation) == ("fp16", 2, 3)
    assert len(session.configured) == 1  # probed once: no saver was tried
    assert lines[0].startswith("auto-fit: started from the fastest settings (gradient checkpointing, "
                               "AdamW8bit -> AdamW, fp8/streamed base weights, activation offload taken off")
    assert "with no recompute" in lines[-1]
    assert estimate.total == session.static() + 2 * session.none + session.workspace  # activations per image


def test_the_users_optimizer_family_stays():
    relaxed, _ = planner.relaxed(MemorySettings(optimizer="Lion8bit"))
    assert relaxed.optimizer == "Lion"
    relaxed, notes = planner.relaxed(MemorySettings(optimizer="Adafactor", gradient_checkpointing=False))
    assert relaxed.optimizer == "Adafactor" and notes == []


@pytest.mark.parametrize("card_gib", [12.0, 14.0, 15.0])
def test_a_budget_between_rungs_gets_the_smallest_partial_share_that_fits(card_gib):
    """No recompute takes 16.25 GiB (weights 6, activations 10, workspace 0.25), every unit recomputed 7.25:
    a card in between recomputes just enough units (a tenth each frees 0.9 GiB), not the ladder's next fifth."""
    session = SimulatedSession()
    memory, estimate, lines = _fit(session, card_gib)
    budget = card_gib * GIB * fit.FIT_HEADROOM
    fixed = session.weights + 8 * 2 ** 20 + optimizer_state_bytes("AdamW", session.params) + session.workspace
    smallest = next(count for count in range(UNITS + 1) if fixed + session.none - 0.9 * GIB * count <= budget)
    assert memory.gradient_checkpointing and memory.checkpoint_share == pytest.approx(smallest / UNITS)
    assert 0 < smallest < UNITS and memory.base_weights is BaseWeights.AS_LOADED and memory.optimizer == "AdamW"
    assert estimate.total <= budget
    chose = next(line for line in lines if "the planner chose" in line)
    assert "runner-up" in chose and f"{smallest} " not in chose.split("runner-up")[1][:5]
    assert lines[-1].startswith("auto-fit: probed") and "fits the" in lines[-1]


def test_fp8_weights_are_taken_where_they_buy_back_more_recompute_than_they_cost():
    """Weights as loaded fit with 6 of 10 units recomputed; fp8 (half the weights) and the 8-bit optimizer leave
    room for all but one unit's activations: the faster plan, with the slower one reported as the runner-up."""
    session = SimulatedSession(weights_gib=6.0, none_gib=6.0, full_gib=0.5)
    memory, _, lines = _fit(session, 10.0)
    assert memory.base_weights is BaseWeights.FP8 and memory.optimizer == "AdamW8bit"
    assert memory.gradient_checkpointing and memory.checkpoint_share == pytest.approx(0.1)
    chose = next(line for line in lines if "the planner chose" in line)
    runner_up = chose.split("runner-up")[1]
    assert "base weights as loaded" in runner_up and "60% of the blocks" in runner_up


def test_where_even_the_quarter_size_step_runs_out_of_memory_a_smaller_one_gives_the_model():
    """A small card (SD1.5 on 3 GiB): with no recompute even the quarter-area probe does not fit. A step at a
    sixteenth of the area still measures how activations grow, so the planner still picks a partial share instead
    of recomputing every block."""
    session = SimulatedSession(weights_gib=1.0, none_gib=8.0, full_gib=0.2, workspace_gib=0.1)
    memory, _, lines = _fit(session, 2.6)
    assert any("the planner chose" in line for line in lines), lines
    assert memory.gradient_checkpointing and 0 < memory.checkpoint_share < 1


def test_a_probe_above_the_planners_prediction_raises_the_share_until_the_probe_fits():
    """The models only choose: the chosen plan is probed, and where the real step needs more than predicted the
    share grows a tenth at a time until the probe fits."""
    session = SimulatedSession(actual_extra_gib=1.0)
    memory, estimate, lines = _fit(session, 12.0)
    raised = [line for line in lines if "the planner's choice probed" in line]
    assert raised, lines
    assert estimate.total <= 12.0 * GIB * fit.FIT_HEADROOM and memory.checkpoint_share < 1


def test_where_full_recompute_does_not_fit_the_plan_is_the_ladders():
    """Every unit recomputed with fp8 weights and the 8-bit optimizer does not fit: the ladder walk takes over (on
    a GPU it goes on to offload and streaming; this simulated device has nothing further)."""
    session = SimulatedSession(weights_gib=6.0, none_gib=10.0, full_gib=1.0)
    memory, _, lines = _fit(session, 4.0)
    assert memory.base_weights.fp8 and memory.optimizer == "AdamW8bit"
    assert memory.gradient_checkpointing and memory.checkpoint_share == 1
    assert not any("the planner chose" in line for line in lines)
    assert lines[-1] == "auto-fit: nothing left to trade for memory; training starts and OOM recovery stays on"


def test_choose_reports_nothing_when_no_plan_fits():
    units = RankedUnits([torch.nn.Identity()] * 4, [(1, 1)] * 4)
    model = planner.ActivationModel(none=1000.0, full=100.0, workspace=0)
    best, runner_up = planner.choose(MemorySettings(gradient_checkpointing=False), lambda plan: 10 ** 9, model,
                                     units, 1000, 0, lambda transient: 0, 10 ** 6, 0.35)
    assert best is None and runner_up is None
    best, _ = planner.choose(MemorySettings(gradient_checkpointing=False), lambda plan: 0, model, units, 1000, 0,
                             lambda transient: 0, 10 ** 7, 0.35)
    assert best.memory == replace(MemorySettings(gradient_checkpointing=False)) and best.time == 1.0


def _batch_of_four(card_gib):
    """Weights 2 GiB, activations per image 4 GiB with no unit recomputed and 1 GiB with every one; batch 4."""
    session = SimulatedSession(weights_gib=2.0, none_gib=4.0, full_gib=1.0, workspace_gib=0.25)
    memory = MemorySettings(auto_fit=AutoFit(card_gib=card_gib), gradient_checkpointing=False, batch_size=4)
    return _fit(session, card_gib, memory)


def test_a_batch_that_no_storage_saver_fits_is_split_only_as_far_as_the_card_needs():
    """Batch 4 does not fit a 5 GiB card even with every unit recomputed, fp8 weights and the 8-bit optimizer. The
    ladder's split goes to batch 1 x 4; the planner weighs the splits and takes batch 2 x 2 with full recompute
    (~1.65x: two images per step run more efficiently than one) over batch 1 with 60% (~1.81x). The effective
    batch, the user's result, stays 4."""
    memory, estimate, lines = _batch_of_four(5.0)
    assert (memory.batch_size, memory.gradient_accumulation, memory.effective_batch) == (2, 2, 4)
    assert memory.gradient_checkpointing and memory.checkpoint_share == 1
    assert estimate.total <= 5.0 * GIB * fit.FIT_HEADROOM
    chose = next(line for line in lines if "the planner chose" in line)
    assert "batch 2 x accumulation 2 = effective batch 4" in chose.split("runner-up")[0]


def test_a_split_is_taken_where_it_costs_less_than_the_recompute_the_whole_batch_needs():
    """On 12 GiB batch 4 needs 70% of the units recomputed (~1.25x); batch 2 x 2 fits with none (2^0.29 = ~1.22x):
    the split wins, and the runner-up is the whole batch with its share. On 16 GiB batch 4 needs only 30% (~1.1x)
    and stays whole."""
    memory, _, lines = _batch_of_four(12.0)
    assert (memory.batch_size, memory.gradient_accumulation, memory.gradient_checkpointing) == (2, 2, False)
    runner_up = next(line for line in lines if "the planner chose" in line).split("runner-up")[1]
    assert "batch 4 x accumulation 1" in runner_up and "70% of the blocks" in runner_up
    memory, _, _ = _batch_of_four(16.0)
    assert (memory.batch_size, memory.gradient_accumulation) == (4, 1)
    assert memory.gradient_checkpointing and memory.checkpoint_share == pytest.approx(0.3)


def test_splits_keep_the_effective_batch_and_a_bucket_smaller_than_the_batch_costs_no_split():
    start = MemorySettings(batch_size=4, gradient_accumulation=3)
    assert [(m.batch_size, m.gradient_accumulation) for m in planner.splits(start)] == [(4, 3), (2, 6), (1, 12)]
    units = RankedUnits([torch.nn.Identity()] * 4, [(1, 1)] * 4)
    model = planner.ActivationModel(none=1000.0, full=100.0, workspace=0)
    # the largest bucket holds 2 images: batch 4's batches hold 2, like batch 2's, so both cost the same and the
    # user's batch (the first) is kept; batch 1 would cost 2^0.29 more
    best, runner_up = planner.choose(MemorySettings(batch_size=4, gradient_checkpointing=False), lambda plan: 0,
                                     model, units, 2 * 1000, 0, lambda transient: 0, 10 ** 7, 0.35,
                                     images=lambda batch: min(batch, 2))
    assert best.memory.batch_size == 4 and best.time == 1.0 and runner_up.time == 1.0
