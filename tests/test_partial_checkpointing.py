"""Partial gradient checkpointing: which units a checkpoint share recomputes, in which order, through
TrainingSession.configure on a small two-level ComfyUI UNet (the tiny checkpoint's UNet has one resolution only)."""
import copy
import math
from dataclasses import replace

import pytest
import torch

from trainer.cache import CachedSample
from trainer.errors import LeanLoRAError
from trainer.memory.ladder import next_rung
from trainer.settings import Attention, BaseWeights, CheckpointDepth, LoraSettings, MemorySettings, TrainSettings
from helpers import sd_targets  # noqa: E402

LATENT = (8, 8)  # level 0 runs at 8x8 = 64 positions, level 1 at 4x4 = 16
CONTEXT_DIM = 96


@pytest.fixture(scope="module")
def two_level_unet():
    """ComfyUI's own UNetModel, two levels (32 channels at 8², 64 at 4²), one ResBlock and one transformer layer
    per block, random weights scaled so activations stay O(1)."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    import comfy.ops
    unet = UNetModel(use_checkpoint=False, image_size=32, use_spatial_transformer=True, legacy=False,
                     adm_in_channels=None, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                     channel_mult=[1, 2], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                     transformer_depth_middle=1, use_linear_in_transformer=True, context_dim=CONTEXT_DIM,
                     num_heads=-1, num_head_channels=16, dtype=torch.float32, device="cpu",
                     operations=comfy.ops.manual_cast)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ComfyUI's ops leave parameters uninitialized
        for name, param in unet.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # norms
                param.fill_(1.0)
            else:
                param.normal_(0, param[0].numel() ** -0.5, generator=generator)
    return unet.requires_grad_(False)


@pytest.fixture()
def adapter(comfy_objects):
    from bridge.comfy_adapter import ComfyAdapter
    adapter = ComfyAdapter(*comfy_objects)
    adapter.set_attention(Attention.SDPA)  # CPU's default, sub-quadratic attention, is several times slower
    return adapter


def _levels(unet):
    """The checkpoint units of the two-level UNet, by kind and resolution (UNet order)."""
    layer = lambda block: block[1].transformer_blocks[0]  # noqa: E731
    inputs, outputs = unet.input_blocks, unet.output_blocks
    return {"layers 8²": [layer(inputs[1]), layer(outputs[2]), layer(outputs[3])],
            "layers 4²": [layer(inputs[3]), unet.middle_block[1].transformer_blocks[0], layer(outputs[0]),
                          layer(outputs[1])],
            "resblocks 8²": [inputs[1][0], outputs[2][0], outputs[3][0]],
            "resblocks 4²": [inputs[3][0], unet.middle_block[0], unet.middle_block[2], outputs[0][0], outputs[1][0]]}


def _session(adapter, unet, seed=0):
    """A TrainingSession over a LoRA'd copy of `unet` with one cached 8x8 latent (CPU, fp32, eager steps)."""
    from trainer.lora import inject_lora
    from trainer.session import TrainingSession
    unet = copy.deepcopy(unet)
    params = inject_lora(unet, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
    for p in params:  # LoRA's B starts at zero, which would leave A without gradient
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    generator = torch.Generator().manual_seed(seed)
    sample = CachedSample(torch.randn(1, 4, *LATENT, generator=generator),
                          {"c_crossattn": torch.randn(1, 77, CONTEXT_DIM, generator=generator)})
    return TrainingSession(adapter, unet, params, [sample], 1, TrainSettings(steps=4))


def _wrapped(session):
    units = session.adapter.checkpoint_blocks(session.unet)
    return {id(u) for u in units if getattr(u.forward, "leanlora_checkpointed", False)}


def _memory(share=1.0, checkpointing=True, **fields):
    return MemorySettings("no", checkpointing, 1, 1, fast_path="off", checkpoint_share=share, **fields)


def test_order_puts_high_resolution_units_first_transformer_layers_before_resblocks(adapter, two_level_unet):
    levels = _levels(two_level_unet)
    order = [id(u) for u in adapter.checkpoint_blocks(two_level_unet, CheckpointDepth.LAYER, latent_size=LATENT)]
    assert len(order) == 15 and len(set(order)) == 15
    sizes = [len(units) for units in levels.values()]
    groups = [set(order[sum(sizes[:i]):sum(sizes[:i + 1])]) for i in range(len(sizes))]
    assert groups == [{id(u) for u in units} for units in levels.values()]  # in the order of `levels`
    # without a latent size: the UNet's own order, as before
    plain = adapter.checkpoint_blocks(two_level_unet, CheckpointDepth.LAYER)
    assert plain[0] is levels["resblocks 8²"][0] and plain[1] is levels["layers 8²"][0]


def test_model_matches_what_autograd_saves_and_the_flop_counter(adapter, two_level_unet, monkeypatch):
    """The documented model (bridge/families/sd_unet.py) against one forward of each kind of unit with LoRA on
    attention: the elements autograd keeps inside it (weights and the unit's inputs excluded, shared tensors
    once) and torch's count of its linear/conv multiply-adds (the counter does not see attention on CPU)."""
    import comfy.ldm.modules.attention as comfy_attention
    from torch.utils.flop_counter import FlopCounterMode
    from bridge.families.sd_unet import CONTEXT_TOKENS, recompute_cost
    monkeypatch.setattr(comfy_attention, "optimized_attention", comfy_attention.attention_pytorch)
    unet = _session(adapter, two_level_unet).unet
    levels = _levels(unet)
    resblock, layer = levels["resblocks 8²"][1], levels["layers 8²"][0]  # a ResBlock with C_in != C_out
    calls = {}
    hooks = [unit.register_forward_hook(lambda m, args, kwargs, out: calls.setdefault(m, (args, kwargs)) and None,
                                        with_kwargs=True) for unit in (resblock, layer)]
    x = torch.randn(1, 4, *LATENT, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unet(x, torch.tensor([500.0]), context=torch.randn(1, CONTEXT_TOKENS, CONTEXT_DIM))
    for hook in hooks:
        hook.remove()
    for unit in (resblock, layer):
        args, kwargs = calls[unit]
        args = [a.clone().requires_grad_(True) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
        weights = {p.untyped_storage().data_ptr() for p in unit.parameters()}
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *kwargs.values()] if torch.is_tensor(a)}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights | inputs:
                saved[t.untyped_storage().data_ptr(), t.storage_offset()] = t.numel()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            unit(*args, **kwargs)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            unit(*args, **kwargs)
        tokens = LATENT[0] * LATENT[1]
        model_saved, model_macs = recompute_cost(unit, tokens)
        attention = 2 * tokens * (tokens + CONTEXT_TOKENS) * unit.attn1.to_q.out_features if unit is layer else 0
        assert abs(sum(saved.values()) / model_saved - 1) < 0.1, (type(unit).__name__, sum(saved.values()), model_saved)
        assert abs((model_macs - attention) / (counter.get_total_flops() / 2) - 1) < 0.01


@pytest.mark.parametrize("share, expected", [(0.2, 3), (0.4, 6), (0.5, 8), (1.0, 15), (0.01, 1)])
def test_share_wraps_the_first_units_of_the_order(adapter, two_level_unet, share, expected):
    session = _session(adapter, two_level_unet)
    session.configure(_memory(share))
    order = adapter.checkpoint_blocks(session.unet, CheckpointDepth.LAYER, latent_size=LATENT)
    assert _wrapped(session) == {id(u) for u in order[:expected]}
    assert (f"gradient checkpointing: {expected} of 15 blocks recomputed" in " ".join(session.notes)) == (share < 1)


def test_larger_share_wraps_more_units_and_none_twice(adapter, two_level_unet, monkeypatch):
    """Counts checkpoint calls in one forward: a unit wrapped twice would be checkpointed twice (the outer
    recompute runs the inner wrapper with grad enabled)."""
    from trainer.step import checkpointing
    calls = []
    real = checkpointing.checkpoint
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    session = _session(adapter, two_level_unet)
    seen = set()
    for share, expected in ((0.4, 6), (0.4, 6), (0.8, 12), (1.0, 15)):
        session.configure(_memory(share))
        wrapped = _wrapped(session)
        assert len(wrapped) == expected and wrapped >= seen
        seen = wrapped
        calls.clear()
        session.loss(session.largest_batch()).backward()
        session.optimizer.zero_grad(set_to_none=True)
        assert len(calls) == expected, (share, len(calls))
    assert not [n for n in session.notes if n.startswith("gradient checkpointing: ")]  # full: no partial note


def test_a_smaller_share_unwraps_the_last_units_and_off_restores_every_forward(adapter, two_level_unet,
                                                                              monkeypatch):
    """Auto-fit gives budget back as less recompute: a smaller share unwraps the units past it (checkpoint
    calls in one forward fall with it), off unwraps all, and every unit's forward is again its own (the class's,
    or the one an earlier preparation installed), not a wrapper around it."""
    from trainer.step import checkpointing
    calls = []
    real = checkpointing.checkpoint
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    session = _session(adapter, two_level_unet)
    session.configure(_memory(checkpointing=False))  # installs the per-block upcast forwards (fp8 rungs use them)
    units = adapter.checkpoint_blocks(session.unet, CheckpointDepth.LAYER, latent_size=LATENT)
    del units[0].forward  # this one runs its class's forward: unwrapping must delete, not set, the wrapper
    own = [unit.__dict__.get("forward") for unit in units]
    assert own[0] is None and all(own[1:])
    for share, expected in ((1.0, 15), (0.4, 6), (0.8, 12), (0.2, 3)):
        session.configure(_memory(share))
        assert _wrapped(session) == {id(u) for u in units[:expected]}
        # what fp8 layers read to keep their fp8 weight (outside recomputed blocks) or its upcast copy (inside)
        assert [all(m.leanlora_recomputed for m in u.modules()) for u in units] == [True] * expected + \
            [False] * (15 - expected)
        calls.clear()
        session.loss(session.largest_batch()).backward()
        session.optimizer.zero_grad(set_to_none=True)
        assert len(calls) == expected, (share, len(calls))
    session.configure(_memory(checkpointing=False))
    assert _wrapped(session) == set()
    assert [unit.__dict__.get("forward") for unit in units] == own
    calls.clear()
    session.loss(session.largest_batch()).backward()
    assert calls == []


def test_gradients_equal_the_unwrapped_models(adapter, two_level_unet):
    def lora_gradients(memory, inputs=None):
        session = _session(adapter, two_level_unet)
        session.configure(memory)
        inputs = inputs or session.inputs(session.largest_batch())
        session.compute_loss(inputs).backward()
        return [p.grad.clone() for p in session.params], inputs, len(_wrapped(session))
    plain, inputs, wrapped = lora_gradients(_memory(checkpointing=False))  # its noise and timestep for all
    assert wrapped == 0 and all(g.abs().max() > 0 for g in plain)
    for share, expected in ((0.2, 3), (0.6, 9), (1.0, 15)):
        checkpointed, _, wrapped = lora_gradients(_memory(share), inputs)
        assert wrapped == expected
        for a, b in zip(plain, checkpointed):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (share, (a - b).abs().max())


def test_ladder_visits_partial_shares_in_order_then_todays_next_rung(adapter, two_level_unet):
    """Walked through TrainingSession.configure, as auto-fit's probes and OOM recovery walk it."""
    cpu = torch.device("cpu")
    session = _session(adapter, two_level_unet)
    memory = MemorySettings("bf16", False, fast_path="off")
    session.configure(memory)
    shares, wrapped, descriptions = [], [], []
    while memory.optimizer == "AdamW":
        memory, description = next_rung(memory, cpu)
        session.configure(memory)
        shares.append(memory.checkpoint_share if memory.gradient_checkpointing else None)
        wrapped.append(len(_wrapped(session)))
        if len(shares) == 1:  # the first rung: the three transformer layers at the highest resolution
            assert _wrapped(session) == {id(u) for u in _levels(session.unet)["layers 8²"]}
        descriptions.append(description)
    assert shares == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0]
    assert wrapped == [3, 6, 9, 12, 15, 15]
    assert descriptions[:2] == ["gradient checkpointing on for 20% of the blocks",
                                "gradient checkpointing 20% -> 40% of the blocks"]
    assert descriptions[4] == "gradient checkpointing on for every block"
    assert descriptions[5].startswith("optimizer AdamW -> AdamW8bit")
    # from full checkpointing, chosen by hand, the next rung is the same as before partial checkpointing existed
    full = next_rung(MemorySettings("bf16", True), cpu)[0]
    assert full == MemorySettings("bf16", True, optimizer="AdamW8bit")
    assert next_rung(MemorySettings(checkpoint_share=0.45), cpu)[0].checkpoint_share == 0.6


def test_streamed_weights_checkpoint_every_block(adapter, two_level_unet):
    session = _session(adapter, two_level_unet)
    session.configure(_memory(0.4, base_weights=BaseWeights.FP8_STREAMED))
    assert session.memory.checkpoint_share == 1.0 and len(_wrapped(session)) == 15
    assert "streaming needs every block checkpointed: turned full gradient checkpointing on" in session.notes


def test_a_rung_that_streams_more_adds_the_next_largest_layers_and_keeps_the_rest_resident(adapter, two_level_unet):
    from bridge.cast_weights import streamed_layers
    session = _session(adapter, two_level_unet)
    session.configure(_memory(1.0, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.2))
    streamed = lambda: {id(m) for m in session.unet.modules() if getattr(m, "leanlora_streamed", False)}  # noqa: E731
    first = streamed()
    assert first == {id(m) for m in streamed_layers(session.unet, 0.2)} and first
    note = next(n for n in session.notes if n.startswith("frozen weights streamed from CPU: "))
    assert "the layers cheapest to stream, 20% of the weights; the rest stays on the GPU" in note
    session.configure(replace(session.memory, stream_share=0.4))  # what OOM recovery's next rung does
    assert first < streamed() == {id(m) for m in streamed_layers(session.unet, 0.4)}
    assert sum(n.startswith("frozen weights streamed from CPU: ") for n in session.notes) == 1
    assert "40% of the weights" in next(n for n in session.notes if n.startswith("frozen weights streamed"))
    fp8_layers = [m for m in session.unet.modules() if getattr(m, "leanlora_fp8_scale_value", None) is not None]
    assert len(streamed()) < len(fp8_layers)  # the rest stays resident


def test_prefetched_streamed_weights_give_the_same_gradients_and_come_ahead_after_the_first_pass(adapter,
                                                                                                   two_level_unet):
    """prefetch_streamed (issue 32's lever, trainer/step/weight_prefetch.py) through ComfyUI's own UNet layers:
    every streamed layer takes its weight from the prefetcher, in the forward and in backward's recompute; from the
    second pass on every one comes ahead, and the gradients are bit for bit those without it. Off the
    GPU the copies are synchronous: that they overlap compute is the CUDA test's and the GPU bench's."""
    streamed = _memory(1.0, base_weights=BaseWeights.FP8_STREAMED, stream_share=0.5)
    gradients = []
    for prefetch in (False, True):
        session = _session(adapter, two_level_unet)
        session.configure(replace(streamed, prefetch_streamed=prefetch))
        inputs = session.inputs(session.largest_batch())
        for _ in range(2):
            session.optimizer.zero_grad(set_to_none=True)
            session.micro_step(inputs, 1)
        gradients.append([p.grad.clone() for p in session.params])
    fetcher = session.micro_step.prefetch
    layers = [m for m in session.unet.modules() if getattr(m, "leanlora_streamed", False)]
    assert layers and {id(m) for m in fetcher.order} == {id(m) for m in layers}
    assert len(fetcher.order) > len(layers)  # the recompute fetches again
    assert (fetcher.fetched_ahead, fetcher.fetched_on_demand) == (len(fetcher.order), 0)
    assert all(torch.equal(a, b) for a, b in zip(*gradients))
    assert "fetched a layer ahead" in session.memory.describe()
    from trainer.report import run_notes
    assert f"streamed weights: {len(fetcher.order)} of {len(fetcher.order)} copies of the latest step fetched " \
           "a layer ahead on a copy stream" in run_notes(session)


@pytest.mark.parametrize("share", [0, -0.5, 1.5, math.nan, "half", True, None])
def test_settings_reject_bad_stream_shares_with_a_clear_message(share):
    with pytest.raises(LeanLoRAError, match=r"stream_share: got .*; use a fraction above 0 up to 1"):
        MemorySettings(stream_share=share)


@pytest.mark.parametrize("share", [0, -0.5, 1.5, math.nan, "half", True, None])
def test_settings_reject_bad_shares_with_a_clear_message(share):
    with pytest.raises(LeanLoRAError, match=r"checkpoint_share: got .*; use a fraction above 0 up to 1"):
        MemorySettings(checkpoint_share=share)


def test_describe_names_the_share():
    assert "gradient checkpointing on (per layer, 40% of the blocks)" in MemorySettings(checkpoint_share=0.4).describe()
    assert "gradient checkpointing on (per layer)," in MemorySettings().describe()
    assert "gradient checkpointing off" in MemorySettings(gradient_checkpointing=False, checkpoint_share=0.4).describe()
    assert replace(MemorySettings(), checkpoint_share=1).checkpoint_share == 1  # an int share is fine


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops that run (what selective checkpointing serves from its cache never runs)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


EXPENSIVE = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu")


def _backward_ops(adapter, unet, memory, inputs=None):
    session = _session(adapter, unet)
    session.configure(memory)
    inputs = inputs or session.inputs(session.largest_batch())
    loss = session.compute_loss(inputs)
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts, [p.grad.clone() for p in session.params], inputs, session


def test_selective_recompute_repeats_only_the_cheap_ops_and_gives_the_same_gradients(adapter, two_level_unet):
    """Full checkpointing runs every unit's forward again in backward; selective checkpointing keeps the matmul,
    convolution and attention outputs, so backward runs exactly the expensive ops an unwrapped model's does, and
    only the cheap ones (norms, activations) again. The gradients are the unwrapped model's."""
    plain, plain_grads, inputs, _ = _backward_ops(adapter, two_level_unet, _memory(checkpointing=False))
    full, _, _, _ = _backward_ops(adapter, two_level_unet, _memory(), inputs)
    selective, selective_grads, _, session = _backward_ops(adapter, two_level_unet,
                                                           _memory(selective_recompute=True), inputs)
    expensive = lambda counts: sum(counts.get(op, 0) for op in EXPENSIVE)  # noqa: E731
    assert expensive(full) > expensive(plain) > 0
    assert expensive(selective) == expensive(plain)
    norms = lambda counts: counts.get("native_layer_norm", 0) + counts.get("native_group_norm", 0)  # noqa: E731
    assert norms(plain) == 0 and norms(selective) == norms(full) > 0  # recomputed in backward
    for a, b in zip(plain_grads, selective_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()
    assert "selective: matmul/attention outputs kept" in session.memory.describe()


def test_switching_between_selective_and_full_rewraps_every_unit_once(adapter, two_level_unet):
    session = _session(adapter, two_level_unet)
    session.configure(_memory(0.6, selective_recompute=True))
    units = session.adapter.checkpoint_blocks(session.unet)
    wrapped = [u for u in units if getattr(u.forward, "leanlora_checkpointed", False)]
    assert len(wrapped) == 9 and all(u.forward.leanlora_selective for u in wrapped)
    session.configure(_memory(1.0))
    wrapped = [u for u in units if getattr(u.forward, "leanlora_checkpointed", False)]
    assert len(wrapped) == 15 and not any(u.forward.leanlora_selective for u in wrapped)
    assert all(not getattr(u.forward.leanlora_unwrapped, "leanlora_checkpointed", False) for u in wrapped)
    session.configure(_memory(checkpointing=False))
    assert _wrapped(session) == set()


def test_selective_recompute_with_fp8_weights_gives_the_unwrapped_gradients(adapter, two_level_unet):
    """fp8 layers inside a recomputed unit upcast again in backward; their matmul output is kept all the same."""
    fp8 = dict(base_weights=BaseWeights.FP8)
    plain, plain_grads, inputs, _ = _backward_ops(adapter, two_level_unet, _memory(checkpointing=False, **fp8))
    selective, selective_grads, _, _ = _backward_ops(adapter, two_level_unet,
                                                     _memory(selective_recompute=True, **fp8), inputs)
    assert sum(selective.get(op, 0) for op in EXPENSIVE) == sum(plain.get(op, 0) for op in EXPENSIVE)
    for a, b in zip(plain_grads, selective_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), (a - b).abs().max()
