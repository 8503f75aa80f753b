"""auto_fit means a card: the whole process, as the driver sees it, must fit. Device memory is simulated here
(the CPU has none) by standing in for the two CUDA queries the budget reads."""
import pytest
import torch

from helpers import TinyNet, sd_targets
from bridge.cast_weights import projected_weight_bytes
from trainer import session as session_module
from trainer.memory import fit
from trainer.step.micro_steps import graphs_incompatible
from trainer.errors import LeanLoRAError
from trainer.memory.estimate import GIB
from trainer.lora import inject_lora
from trainer.settings import AUTO_FIT_FREE_VRAM, AUTO_FIT_OFF, AutoFit, BaseWeights, LoraSettings, MemorySettings

CUDA = torch.device("cuda")


@pytest.fixture
def card(monkeypatch):
    """A simulated 141 GiB GPU: `state` holds what the process has reserved through PyTorch and what it holds
    outside it (CUDA context, library kernels, other programs)."""
    state = {"total": 141 * GIB, "torch_reserved": 0, "outside": int(0.6 * GIB)}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (
        state["total"] - state["torch_reserved"] - state["outside"], state["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["torch_reserved"])
    return state


MARGIN = fit.CardBudget.MARGIN


def test_a_requeue_counts_the_graph_memory_an_earlier_run_left_cached_as_free(card, monkeypatch):
    """Re-queue accounting: under cudaMallocAsync a finished run's CUDA graphs leave their memory cached in the
    driver's graph pool, which PyTorch does not count as its own (on the H200 1.4-5.5 GiB "outside PyTorch" after
    a job). The budget trims that pool before it measures, so a re-queue plans the card the first job planned;
    memory that is really held outside PyTorch (the CUDA context) still comes off."""
    from trainer.device import allocator
    card["graph_pool"] = int(1.4 * GIB)
    card["outside"] += card["graph_pool"]

    def driver_trim(index):  # cudaDeviceGraphMemTrim: the cached graph memory goes back to the driver
        card["outside"] -= card.pop("graph_pool", 0)
        return 0
    monkeypatch.setattr(allocator, "_graph_mem_trim", lambda: driver_trim)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fit.budget_bytes(AutoFit(card_gib=6), CUDA) == 6 * GIB - int(0.6 * GIB) - MARGIN
    assert fit.budget_bytes(AUTO_FIT_FREE_VRAM, CUDA) == 141 * GIB - int(0.6 * GIB) - MARGIN


def test_a_card_of_n_gib_leaves_training_what_the_cuda_context_does_not_hold(card):
    # and a margin: probes stopped at the cap peaked 0.07-0.1 GiB above 2-8 GiB cards (NVML, H200)
    assert int(0.1 * GIB) <= MARGIN <= int(0.25 * GIB)
    assert fit.budget_bytes(AutoFit(card_gib=4), CUDA) == 4 * GIB - int(0.6 * GIB) - MARGIN
    card["torch_reserved"] = 2 * GIB  # what PyTorch holds is the run's own to plan, not the context's
    assert fit.budget_bytes(AutoFit(card_gib=4), CUDA) == 4 * GIB - int(0.6 * GIB) - MARGIN


def test_the_budget_is_measured_again_as_libraries_load(card):
    budget = fit.card_budget(AutoFit(card_gib=6), CUDA)
    before = budget.usable()
    card["outside"] += int(0.3 * GIB)  # cuDNN/cuBLAS kernels loaded by the first probe step
    assert budget.usable() == before - int(0.3 * GIB)


def test_free_vram_is_the_card_less_comfyuis_reserve_and_what_is_held_outside_pytorch(card):
    reserve = 137 * GIB  # ComfyUI started with --reserve-vram 137 on a 141 GiB card: a 4 GiB card
    assert fit.budget_bytes(AUTO_FIT_FREE_VRAM, CUDA, comfy_reserve=reserve) == \
        4 * GIB - int(0.6 * GIB) - MARGIN
    assert fit.budget_bytes(AUTO_FIT_OFF, CUDA) is None
    assert fit.budget_bytes(AutoFit(card_gib=4), torch.device("cpu")) is None


def _weight_bytes(unet):
    """What the session hands plan_static: the adapter's projection (ComfyUI's, whose cast ops TinyNet mimics)."""
    return lambda dtype, base_weights, share: projected_weight_bytes(unet, dtype, base_weights, share)


def test_a_model_that_even_the_leanest_settings_cannot_fit_fails_before_training_naming_the_smallest_card(card):
    torch.manual_seed(0)
    unet = TinyNet(dim=512, depth=4)  # 12.6 MB of fp32 frozen weights stand in for a UNet
    params = inject_lora(unet, LoraSettings(rank=4, alpha=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))
    memory = MemorySettings(auto_fit=AutoFit(card_gib=2))
    card["outside"] = 2 * GIB - 4 * 2 ** 20  # a 2 GiB card whose context leaves 4 MiB: nothing fits
    budget = fit.card_budget(memory.auto_fit, CUDA)
    with pytest.raises(LeanLoRAError) as failure:
        fit.plan_static(memory, _weight_bytes(unet), params, budget.usable(), CUDA, budget.card)
    message = str(failure.value)
    assert "2.0 GiB card" in message and "smallest card it trains on is about" in message
    assert "raise auto_fit" in message


def test_a_model_that_fits_is_planned_without_an_error(card):
    torch.manual_seed(0)
    unet = TinyNet(dim=64, depth=2)
    params = inject_lora(unet, LoraSettings(rank=4, alpha=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))
    memory = MemorySettings(auto_fit=AutoFit(card_gib=4))
    budget = fit.card_budget(memory.auto_fit, CUDA)
    planned, lines = fit.plan_static(memory, _weight_bytes(unet), params, budget.usable(), CUDA, budget.card)
    assert planned == memory and lines == []


def test_static_planning_leaves_checkpointing_and_batch_splits_to_the_probes(card):
    """A card that needs smaller weights gets them without checkpointing every block or splitting the batch on the
    way (neither shrinks weights): the probes and the planner then add only as much of either as the activations
    need."""
    torch.manual_seed(0)
    unet = TinyNet(dim=512, depth=4)
    for layer in unet.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.comfy_cast_weights = False  # as ComfyUI's ops have it: such layers can hold fp8 weights
    params = inject_lora(unet, LoraSettings(rank=4, alpha=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))
    memory = MemorySettings(mixed_precision="bf16", gradient_checkpointing=False, auto_fit=AutoFit(card_gib=2),
                            batch_size=4)
    # bf16 weights 8 MiB + LoRA, gradients, AdamW 1 MiB > 75% of 10 MiB; fp8 weights (4 MiB) fit
    budget = 10 * 2 ** 20
    planned, lines = fit.plan_static(memory, _weight_bytes(unet), params, budget, CUDA)
    assert planned.base_weights is BaseWeights.FP8, lines
    assert not planned.gradient_checkpointing and planned.batch_size == 4, lines
    assert not any("checkpointing" in line or "batch" in line for line in lines), lines


def test_static_planning_streams_only_the_share_of_the_weights_the_card_needs(card):
    """A card too small for resident fp8 weights streams the largest layers, and only the hundredth of them the
    budget needs, not the ladder's next fifth and not every weight (each streamed byte costs PCIe time every
    step); activation offload, which moves no weight, is not taken on the way."""
    from trainer.optimizers import optimizer_state_bytes
    torch.manual_seed(0)
    unet = TinyNet(dim=512, depth=4)
    for layer in unet.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.comfy_cast_weights = False
    params = inject_lora(unet, LoraSettings(rank=4, alpha=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))
    memory = MemorySettings(mixed_precision="bf16", optimizer="AdamW8bit", base_weights="fp8",
                            auto_fit=AutoFit(card_gib=2))

    def static(share):
        return (projected_weight_bytes(unet, torch.bfloat16, BaseWeights.FP8_STREAMED, share)
                + 2 * sum(p.numel() * 4 for p in params) + optimizer_state_bytes("AdamW8bit", params))
    budget = int((static(0.2) + static(0.4)) / 2 / fit.STATIC_SHARE)  # 40% fits, 20% does not
    planned, lines = fit.plan_static(memory, _weight_bytes(unet), params, budget, CUDA)
    share = planned.stream_share
    assert planned.base_weights is BaseWeights.FP8_STREAMED and 0.2 < share <= 0.4, lines
    assert static(share) <= budget * fit.STATIC_SHARE < static(round(share - 0.01, 2)), "not the smallest hundredth"
    assert not planned.activation_offload and not any("CPU RAM (copied out" in line for line in lines), lines
    assert lines[-1].endswith(f"the layers cheapest to stream, {share:.0%} of the weights"), lines
    assert f"{share:.0%} of them" in planned.describe()


def test_the_streaming_share_is_bisected_to_the_hundredth():
    calls = []

    def fits(share):
        calls.append(share)
        return share >= 0.83
    assert fit.smallest_stream_share(fits, 0.6) == 0.83
    assert len(calls) <= 7, calls  # a bisection, not a walk through every hundredth
    assert fit.smallest_stream_share(lambda share: False, 0.0) == 1.0  # nothing fits: every weight
    assert fit.smallest_stream_share(lambda share: True, 1.0) == 1.0


def test_probes_are_capped_and_uncapped_where_pytorch_cannot_tell_the_cap(monkeypatch):
    # ComfyUI 0.33 (comfy-aimdo) makes the getter read 122888273.8 on an H200 whatever was set; setting that back
    # raised "Invalid fraction value" and failed every auto-fit run there.
    caps = []

    def set_fraction(fraction, device=None):
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        caps.append(fraction)

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 122888273.80573021)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {"total_memory": 141 * GIB}))
    with fit.probes_capped_at(4 * GIB, CUDA):
        assert caps == [pytest.approx(4 / 141)]
    assert caps[-1] == 1.0
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 8 / 141)
    with fit.probes_capped_at(4 * GIB, CUDA):
        pass
    assert caps[-2:] == [pytest.approx(4 / 141), pytest.approx(8 / 141)]  # a known cap is put back


def test_only_random_forwards_keep_steps_from_being_graphed():
    # Streamed weights are graphed under cudaMallocAsync too (SD1.5 2 GiB and SDXL 3 GiB in a ComfyUI server, H200,
    # 3 Dec 2026); LoRA dropout draws inside the step, which a replay would repeat.
    assert graphs_incompatible(False) is None
    assert "dropout" in graphs_incompatible(True)


def test_a_probe_that_ran_out_of_memory_gives_its_memory_back_before_the_next_rung_probes():
    """Auto-fit walks down the ladder after a probe that ran out of memory at the card's size. That probe's
    activations and autograd graph stay reachable from the error's traceback, past the except block wherever a
    frame in it refers back to the error (a cycle only the garbage collector frees): on a small card they are
    what the next rung's probe needs, and on CUDA the graph's gradient accumulators outlived the probe."""
    import gc
    import weakref
    from trainer.memory.estimate import MemoryEstimate

    held_by_failed_probe: list[weakref.ref] = []
    alive_at_next_probe: list[bool] = []

    class Session:
        unplaced = None  # the frozen weights are placed (TrainingSession.configure)
        adapter = type("Adapter", (), {"device": torch.device("cpu")})()
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        micro_step = type("Step", (), {"budget": None, "extra_memory": staticmethod(lambda estimate: 0)})()
        memory = MemorySettings(mixed_precision="bf16", gradient_checkpointing=False, auto_fit=AutoFit(card_gib=2))
        free_failed_step = session_module.TrainingSession.free_failed_step

        def configure(self, memory):
            self.memory = memory

        def estimate(self, raise_oom=False):
            alive_at_next_probe.extend(ref() is not None for ref in held_by_failed_probe)
            if held_by_failed_probe:
                return MemoryEstimate(frozen_weights=GIB // 2, lora_parameters=0, gradients=0, optimizer_state=0,
                                      activations=0, workspace=0)
            activations = torch.ones(1024)  # what the probe's frames hold when it runs out of memory
            held_by_failed_probe.append(weakref.ref(activations))
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except torch.OutOfMemoryError as error:
                kept = error  # this frame (in the traceback) now refers to the error: a cycle
                raise kept

    gc.disable()
    try:
        estimate, lines = fit.walk_ladder(Session(), 2 * GIB)
    finally:
        gc.enable()
    assert alive_at_next_probe == [False], "the failed probe's tensors were still alive when the next rung probed"
    assert any("the probe ran out of memory" in line for line in lines), lines
    assert estimate.frozen_weights == GIB // 2


class _GraphedStandIn:
    """What keep_graphs_within_limit reads of a graphed micro-step (a real one needs CUDA streams)."""
    graphed, disabled = True, None

    def __init__(self, budget, extra):
        self.budget, self.extra, self.notes = budget, extra, []

    def extra_memory(self, estimate):
        return self.extra

    def run_eagerly(self, note):
        self.disabled = "memory limit"
        self.notes.append(note)


@pytest.mark.parametrize("extra_gib, graphed", [(0.2, True), (0.9, False)])
def test_graphs_are_turned_off_before_step_one_only_where_their_extra_memory_would_not_fit(extra_gib, graphed):
    """The decision is the planner's (memory/fit.py), not the step executor's: an estimate of 3.5 GiB under a
    4 GiB budget leaves room for 0.2 GiB of graph memory (3.7 GiB, within 95% of the limit), not for 0.9."""
    from types import SimpleNamespace
    from trainer.memory.estimate import MemoryEstimate
    micro_step = _GraphedStandIn(budget=4 * GIB, extra=int(extra_gib * GIB))
    session = SimpleNamespace(micro_step=micro_step, adapter=SimpleNamespace(device=torch.device("cpu")))
    estimate = MemoryEstimate(frozen_weights=int(3.5 * GIB), lora_parameters=0, gradients=0, optimizer_state=0,
                              activations=0, workspace=0)
    fit.keep_graphs_within_limit(session, estimate)
    assert (micro_step.disabled is None) == graphed
    if not graphed:
        assert micro_step.notes == ["fast path: CUDA graphs off: with their extra memory (~4.40 GiB expected) the "
                                    "run would not fit the 4.00 GiB limit; steps run eagerly"]


def test_the_ladder_streams_the_hundredth_a_probe_says_is_missing(monkeypatch):
    """Before step 1, a probe that measured the step over the budget with part of the weights streamed streams
    just enough more of them to close the gap (from the weights' projection), not the ladder's next fifth: Qwen-Image
    at 8 GiB streamed every weight where 80% was 0.34 GiB over (H100, 6 Dec). The probe after it fits."""
    from trainer.device.card import SimulatedCard
    from trainer.memory.estimate import MemoryEstimate
    torch.manual_seed(0)
    unet = TinyNet(dim=512, depth=4).requires_grad_(False)  # frozen, as the base model is
    for layer in unet.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.comfy_cast_weights = False

    def weights(share):
        return projected_weight_bytes(unet, torch.bfloat16, BaseWeights.FP8_STREAMED, share)
    monkeypatch.setattr(fit, "STREAM_SLACK", 2 ** 12)  # the tiny model's weights are a few MiB
    activations = 2 * 2 ** 20
    budget = int((weights(0.5) + activations + fit.STREAM_SLACK + 2 ** 16) / fit.FIT_HEADROOM)  # 50%, not 40%
    probed = []

    class Session:
        unplaced = None
        adapter = type("Adapter", (), {"device": torch.device("cpu"), "projected_weight_bytes": staticmethod(
            lambda module, dtype, base, share: projected_weight_bytes(module, dtype, base, share))})()
        unet = None
        micro_step = type("Step", (), {"budget": None, "extra_memory": staticmethod(lambda estimate: 0)})()
        memory = MemorySettings(mixed_precision="bf16", base_weights="fp8_streamed", stream_share=0.2,
                                activation_offload=True, optimizer="AdamW8bit", auto_fit=AutoFit(card_gib=1))

        def configure(self, memory):
            self.memory = memory

        def estimate(self, raise_oom=False):
            probed.append(self.memory.stream_share)
            return MemoryEstimate(frozen_weights=weights(self.memory.stream_share), lora_parameters=0, gradients=0,
                                  optimizer_state=0, activations=activations, workspace=0)
    session = Session()
    session.unet = unet
    with SimulatedCard(1).installed():
        estimate, lines = fit.walk_ladder(session, budget)
    share = session.memory.stream_share
    assert probed == [0.2, share], lines  # one probe to size the share, one to confirm it
    assert 0.4 < share <= 0.5 and share not in (0.4, 0.6), lines
    assert weights(share) + activations <= budget * fit.FIT_HEADROOM < weights(round(share - 0.01, 2)) + activations \
        + fit.STREAM_SLACK, "not the smallest hundredth that closes the gap"
    assert any(line.endswith(f"streamed from CPU memory 20% -> {share:.0%}") for line in lines), lines
