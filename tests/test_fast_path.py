"""The fast path (CUDA graphs) trains like the eager path. CUDA-only checks are skipped in CI (no GPU) and run
on the GPU machine: `python -m pytest -q tests/test_fast_path.py` (see docs/BENCHMARKS.md)."""
import pytest
import torch

from helpers import TinyNet, sd_targets
from trainer.step.micro_steps import BatchStep, EagerMicroStep, GraphedMicroStep, build_micro_step
from trainer.loop import StepParts, train_loop
from trainer.lora import inject_lora
from trainer.optimizers import build_optimizer
from trainer.step.precision import Precision
from trainer.settings import FastPath, LoraSettings

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU")


def _setup(device, seed=0):
    torch.manual_seed(seed)
    net = TinyNet(dim=32).to(device)
    params = inject_lora(net, LoraSettings(rank=4, alpha=4), seed=seed, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))
    for p in params:  # lora_B starts at zero; give the test something to move
        p.data.normal_(0, 0.05)
    return net, params


def _data(device, shapes=((4, 8), (2, 12)), count=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(count):
        b, n = shapes[i % len(shapes)]  # alternating shapes, as aspect-ratio buckets do
        x = torch.randn(b, n, 32, generator=g)
        batches.append({"x": x.to(device), "y": torch.tanh(x).to(device)})
    return iter(batches)


def _train(device, graphed: bool, precision_mode="no", optimizer_name="AdamW", accumulation=2, steps=8, flat=False,
           bf16_weights=False):
    net, params = _setup(device)
    precision = Precision(precision_mode, device)
    loss_of = lambda inputs: torch.nn.functional.mse_loss(net(inputs["x"]).float(), inputs["y"])  # noqa: E731
    micro = GraphedMicroStep(loss_of, precision, params) if graphed else EagerMicroStep(loss_of, precision)
    optimizer, _ = build_optimizer(optimizer_name, params, 1e-2, device=device, flat=flat, bf16_weights=bf16_weights)
    result = train_loop(StepParts(params, BatchStep(lambda batch: batch, micro), optimizer, precision, accumulation),
                        _data(device), steps)
    return result.losses, [p.detach().float().cpu().clone() for p in params], micro


def test_cpu_falls_back_to_the_eager_step():
    micro, note = build_micro_step(FastPath.CUDA_GRAPHS, lambda inputs: inputs, Precision("no", torch.device("cpu")), [],
                                   torch.device("cpu"))
    assert type(micro) is EagerMicroStep and "need an NVIDIA GPU" in note


def test_incompatible_settings_say_why():
    micro, note = build_micro_step(FastPath.CUDA_GRAPHS, lambda inputs: inputs, Precision("no", torch.device("cpu")), [],
                                   torch.device("cuda"), incompatible="LoRA dropout draws random numbers")
    assert type(micro) is EagerMicroStep and "LoRA dropout" in note


@cuda
@pytest.mark.parametrize("precision_mode,optimizer_name,flat,bf16_weights,tolerance", [
    ("no", "AdamW", False, False, 1e-5), ("bf16", "AdamW", False, False, 2e-2), ("fp16", "AdamW", False, False, 2e-2),
    ("bf16", "AdamW8bit", False, False, 2e-2), ("bf16", "AdamW8bit", True, False, 2e-2),
    ("bf16", "AdamW", False, True, 5e-2)])
def test_graphed_steps_train_like_eager_steps(precision_mode, optimizer_name, flat, bf16_weights, tolerance):
    device = torch.device("cuda")
    eager_losses, eager_params, _ = _train(device, False, precision_mode, optimizer_name, flat=flat,
                                           bf16_weights=bf16_weights)
    graph_losses, graph_params, micro = _train(device, True, precision_mode, optimizer_name, flat=flat,
                                               bf16_weights=bf16_weights)
    assert micro.disabled is None, micro.notes
    assert len(micro.graphs) == 2  # one graph per batch shape
    assert graph_losses == pytest.approx(eager_losses, rel=tolerance)
    for a, b in zip(graph_params, eager_params):
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance * 0.1)
    assert eager_losses[-1] < eager_losses[0]


@cuda
def test_gradients_reset_elsewhere_are_reattached():
    """Something outside the fast path may set .grad to None (a probe step, an eager step); the graph keeps
    writing into its own tensors, which get re-attached zeroed before the next replay."""
    device = torch.device("cuda")
    net, params = _setup(device)
    precision = Precision("no", device)
    micro = GraphedMicroStep(lambda inputs: ((net(inputs["x"]) - inputs["y"]) ** 2).mean(), precision, params)
    inputs = next(_data(device, shapes=((2, 8),)))
    micro(inputs, 1)  # eager warm-up + capture
    for p in params:
        p.grad = None
    micro(inputs, 1)  # replay into re-attached, zeroed gradients
    replayed = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    loss = ((net(inputs["x"]) - inputs["y"]) ** 2).mean()
    loss.backward()
    for a, p in zip(replayed, params):
        assert torch.allclose(a, p.grad, rtol=1e-5, atol=1e-7)


def _deep_net(device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(8)])
    return net.to(device)


@cuda
def test_activation_offload_keeps_saved_tensors_off_the_gpu_with_equal_gradients():
    from trainer.step.activation_offload import ActivationOffload
    device = torch.device("cuda")
    net = _deep_net(device)
    x = torch.randn(2048, 256, device=device)  # 2 MiB activations per layer

    def after_forward(offload):
        net.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        with offload.saving() if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = net(x).square().mean()
        held = torch.cuda.memory_allocated() - start
        loss.backward()
        if offload:
            offload.finish()
        return held, [p.grad.clone() for p in net.parameters()]

    held_plain, grads_plain = after_forward(None)
    offload = ActivationOffload()
    held_offloaded, grads_offloaded = after_forward(offload)
    assert offload.offloaded_bytes >= 8 * 2048 * 256 * 4
    assert held_offloaded < held_plain / 4
    # backward unpacks in reverse order: all but the first come back on the copy stream ahead of their turn
    packs = offload.offloaded_bytes // (2048 * 256 * 4)  # Linear and GELU inputs, the loss's square input
    assert packs >= 16 and (offload.fetched_on_demand, offload.fetched_ahead) == (1, packs - 1)
    for a, b in zip(grads_plain, grads_offloaded):
        assert torch.equal(a, b)


class _SavesTwo(torch.autograd.Function):
    """Saves two tensors in one node, as checkpoint's input saver does (a block's input and its context): backward
    unpacks them in forward order, while nodes come in reverse."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, grad * x


class _Recorder:
    """Stands in for a CUDA stream or event on CPU: the offload's bookkeeping (what is held, fetched, in which
    order, which waits come first) runs unchanged; that the copies really overlap is the CUDA tests' and the
    GPU bench's job. Waits of the compute stream go to `log`."""

    device = torch.device("cpu")

    def __init__(self, log=None, name="event"):
        self.log, self.name, self.recorded = log, name, False

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        assert event.recorded, "waited for an event that was never recorded"
        if self.name == "compute":
            self.log.append(("compute waited", id(event)))

    def record(self, stream=None):
        self.recorded = True


@pytest.fixture
def stand_in_streams(monkeypatch):
    import contextlib
    from trainer.step.activation_offload import ActivationOffload
    log = []
    compute, copy = _Recorder(log, "compute"), _Recorder(log, "copy")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: copy)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Recorder)
    monkeypatch.setattr(ActivationOffload, "_wants", lambda self, t: not isinstance(t, torch.nn.Parameter)
                        and t.numel() * t.element_size() >= self.min_bytes)
    return log


def test_offload_waits_for_each_copy_before_its_memory_is_reused_or_its_tensor_used(stand_in_streams, monkeypatch):
    """The compute stream must wait for a copy to the host before the saved tensor's memory can serve it again,
    and for a copy back before backward gets the tensor: without those waits the GPU races silently."""
    import weakref
    from trainer.step.activation_offload import ActivationOffload, _Saved
    log = stand_in_streams
    pack, unpack = ActivationOffload.pack, ActivationOffload.unpack

    def logged_pack(self, tensor):
        packed = pack(self, tensor)
        if isinstance(packed, _Saved):
            done, source = self._to_host[-1]
            weakref.finalize(source, log.append, ("memory freed", id(done)))
        return packed

    def logged_unpack(self, packed):
        fetched = getattr(packed, "fetched", None)
        tensor = unpack(self, packed)
        if fetched is not None:
            log.append(("handed to backward", id(fetched[0])))
        return tensor
    monkeypatch.setattr(ActivationOffload, "pack", logged_pack)
    monkeypatch.setattr(ActivationOffload, "unpack", logged_unpack)
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    offload = ActivationOffload(min_bytes=1)
    for _ in range(2):
        with offload.saving():
            h = x
            for _ in range(8):
                h = torch.nn.functional.gelu(h * 1.0)
            loss = h.square().mean()
        del h
        loss.backward()
        offload.finish()
    events = [entry for entry in log if entry[0] != "compute waited"]
    assert sum(e[0] == "memory freed" for e in events) >= 8 and sum(e[0] == "handed to backward" for e in events) >= 8
    for position, (what, event) in enumerate(log):
        if what != "compute waited":
            assert ("compute waited", event) in log[:position], f"{what} before the compute stream waited"


@pytest.fixture
def prefetch_with_stand_in_streams(stand_in_streams, monkeypatch):
    """A WeightPrefetch that takes the CUDA path (copy stream, events, waits) on CPU tensors, and three layers
    called as a checkpointed step calls its streamed layers: forward, then the recompute in backward."""
    from trainer.step.weight_prefetch import WeightPrefetch
    monkeypatch.setattr(WeightPrefetch, "_uses_streams", staticmethod(lambda device: True))
    log = stand_in_streams
    compute = torch.cuda.current_stream()
    monkeypatch.setattr(compute, "wait_stream", lambda other: log.append(("compute joined", id(other))))
    torch.manual_seed(0)
    a, b, c = (torch.nn.Linear(8, 8) for _ in range(3))
    return WeightPrefetch(), log, (a, b, c)


def _pass(prefetch, log, layers, fail_after=None):
    """One pass through fetch_streamed: each layer gets its own weight and bias, and a weight copied ahead only
    after the compute stream waited for its copy."""
    from trainer.step.weight_prefetch import fetch_streamed
    with prefetch.active():
        for count, layer in enumerate(layers):
            ahead, waits = prefetch.fetched_ahead, len(log)
            weight, bias = fetch_streamed(layer, torch.device("cpu"))
            assert torch.equal(weight, layer.weight) and torch.equal(bias, layer.bias)
            if prefetch.fetched_ahead > ahead:
                assert log[waits:] and log[-1][0] == "compute waited", "a copy handed out before it was waited for"
            if count == fail_after:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_streamed_weights_come_ahead_in_the_order_the_previous_pass_used_them(prefetch_with_stand_in_streams):
    prefetch, log, (a, b, c) = prefetch_with_stand_in_streams
    step = [a, b, c, c, b, a]  # forward, then backward recomputes the blocks in reverse
    _pass(prefetch, log, step)
    assert (prefetch.fetched_ahead, prefetch.fetched_on_demand) == (0, 6)  # the first pass copies on demand
    assert prefetch.order == step
    for _ in range(2):
        _pass(prefetch, log, step)
        assert (prefetch.fetched_ahead, prefetch.fetched_on_demand) == (6, 0)  # the first one as the pass starts
    assert log[-1][0] == "compute joined"  # the pass ends with the copy stream joined (capture needs it)


def test_a_pass_out_of_the_learned_order_still_hands_each_layer_its_own_weight(prefetch_with_stand_in_streams):
    prefetch, log, (a, b, c) = prefetch_with_stand_in_streams
    _pass(prefetch, log, [a, b, c, c, b, a])
    _pass(prefetch, log, [a, c, b, b, c, a])  # another order: what was fetched for b is dropped, never handed out
    assert prefetch.fetched_on_demand >= 2 and prefetch.order == [a, c, b, b, c, a]
    _pass(prefetch, log, [a, c, b, b, c, a])  # learned again
    assert (prefetch.fetched_ahead, prefetch.fetched_on_demand) == (6, 0)


def test_a_pass_that_fails_joins_the_copy_stream_and_keeps_the_order_it_had(prefetch_with_stand_in_streams):
    from trainer.step import weight_prefetch
    prefetch, log, (a, b, c) = prefetch_with_stand_in_streams
    step = [a, b, c, c, b, a]
    _pass(prefetch, log, step)
    joined = len([entry for entry in log if entry[0] == "compute joined"])
    with pytest.raises(torch.OutOfMemoryError):
        _pass(prefetch, log, step, fail_after=2)
    assert len([entry for entry in log if entry[0] == "compute joined"]) == joined + 1
    assert prefetch.order == step and not prefetch._fetched and not weight_prefetch._ACTIVE


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated, mid-backward)")


def test_a_backward_that_fails_still_joins_the_copy_stream_and_drops_fetched_tensors(stand_in_streams):
    """Graph capture needs the copy stream joined even when backward raises (else CUDA's "unjoined" error hides
    the OOM or Cancel), and OOM recovery needs the tensors fetched back released."""
    from trainer.step.activation_offload import ActivationOffload
    x = torch.randn(64, 64, requires_grad=True)
    offload = ActivationOffload(min_bytes=1)

    def loss_of(inputs):
        h = _FailsInBackward.apply(x)  # runs last in backward: every other saved tensor was fetched by then
        for _ in range(4):
            h = torch.nn.functional.gelu(h * 1.0)
        return h.square().mean()
    micro = EagerMicroStep(loss_of, Precision("no", torch.device("cpu")), offload)
    with pytest.raises(torch.OutOfMemoryError):
        micro({}, 1)
    assert offload.fetched_ahead > 0  # prefetches were under way when backward failed
    assert not offload._fetching and not offload._saved and not offload._to_host


@pytest.mark.parametrize("fetch_ahead", [1, 3])
@pytest.mark.parametrize("saves_per_node", [1, 2])
def test_offload_fetches_each_saved_tensor_back_once_and_mostly_ahead(stand_in_streams, saves_per_node, fetch_ahead,
                                                                      monkeypatch):
    from trainer.step.activation_offload import ActivationOffload
    fetch, in_flight = ActivationOffload._fetch, []

    def counted_fetch(self, saved, compute):
        fetch(self, saved, compute)
        in_flight.append(len(self._fetching))
    monkeypatch.setattr(ActivationOffload, "_fetch", counted_fetch)
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    factors = [torch.randn(64, 64, requires_grad=True) for _ in range(6)]

    def loss_of():
        h = x
        for factor in factors:
            h = _SavesTwo.apply(h, factor) if saves_per_node == 2 else torch.nn.functional.gelu(h * 1.0)
        return h.square().mean()

    loss_of().backward()
    expected = [t.grad.clone() for t in (x, *factors) if t.grad is not None]
    for t in (x, *factors):
        t.grad = None
    offload = ActivationOffload(min_bytes=1, fetch_ahead=fetch_ahead)
    for attempt in ("first pass: guesses reverse pack order", "second pass: the order backward asked in before"):
        for t in (x, *factors):
            t.grad = None
        with offload.saving():
            loss = loss_of()
            assert len(offload._to_host) <= offload.in_flight  # device memory held for copies in flight
        assert not offload._to_host  # released once the pass is over
        packs = offload.offloaded_bytes // (64 * 64 * 4)
        loss.backward()
        offload.finish()
        grads = [t.grad for t in (x, *factors) if t.grad is not None]
        assert len(grads) == len(expected) and all(torch.equal(a, b) for a, b in zip(grads, expected))
        # every saved tensor came back exactly once; none was fetched for nothing (a tensor backward already had)
        assert offload.fetched_ahead + offload.fetched_on_demand == packs and offload.fetched_unused == 0, attempt
        if saves_per_node == 1 or attempt.startswith("second"):
            assert max(in_flight) == fetch_ahead, attempt  # copies back under way at once
        else:  # a wrong guess stays fetched until backward asks for it, next to the next fetches
            assert max(in_flight) >= fetch_ahead, attempt
        in_flight.clear()
        if saves_per_node == 1 or attempt.startswith("second"):
            assert offload.fetched_on_demand == 1, attempt  # only the very first one backward needs
        else:
            assert offload.fetched_ahead >= packs // 2 - 1, attempt  # each node's second tensor was on its way
    # a pass whose backward comes only after a later pass ended (an interrupted step): correct, no confusion
    with offload.saving():
        stale = loss_of()
    with offload.saving():
        loss = loss_of()
    loss.backward()
    offload.finish()
    assert offload.fetched_on_demand == 1 and offload.fetched_unused == 0
    for t in (x, *factors):
        t.grad = None
    stale.backward()
    grads = [t.grad for t in (x, *factors) if t.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


@cuda
def test_graphed_steps_with_activation_offload_train_like_eager_steps():
    from trainer.step.activation_offload import ActivationOffload
    device = torch.device("cuda")

    def run(graphed):
        net, params = _setup(device)
        precision = Precision("bf16", device)
        loss_of = lambda inputs: torch.nn.functional.mse_loss(net(inputs["x"]).float(), inputs["y"])  # noqa: E731
        offload = ActivationOffload(min_bytes=0)  # the tiny net's activations are small
        micro = GraphedMicroStep(loss_of, precision, params, offload=offload) if graphed else \
            EagerMicroStep(loss_of, precision, offload)
        optimizer, _ = build_optimizer("AdamW", params, 1e-2, device=device)
        result = train_loop(StepParts(params, BatchStep(lambda batch: batch, micro), optimizer, precision, 2),
                            _data(device), 8)
        return result.losses, micro, offload

    eager_losses, _, offload = run(False)
    graph_losses, micro, _ = run(True)
    assert offload.offloaded_bytes > 0
    assert micro.disabled is None, micro.notes
    assert all(entry[3] for entry in micro.graphs.values())  # the graphs own their host buffers
    assert graph_losses == pytest.approx(eager_losses, rel=2e-2)


def test_compile_fallback_keeps_checkpointing_wrapped_around_blocks():
    """compile_before_first_step falls back after checkpointing has wrapped the compiled blocks: the blocks must run eagerly and
    stay checkpointed (each block saves its input for backward, not its activations)."""
    from trainer.step.checkpointing import checkpoint_blocks
    from trainer.step.compiled_blocks import CompiledBlocks

    def saved_count(model, x):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            model(x).sum().backward()
        return len(saved)

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(),  # noqa: E731
                                                             torch.nn.Linear(32, 32)) for _ in range(3)])
    plain, blocks = make(), make()
    blocks.load_state_dict(plain.state_dict())
    compiled = CompiledBlocks(list(blocks))
    checkpoint_blocks(list(blocks), preserve_rng_state=False)
    compiled.fall_back(RuntimeError("no C++ compiler"))
    x = torch.randn(4, 32, requires_grad=True)
    assert saved_count(blocks, x) < saved_count(plain, x)
    torch.testing.assert_close(blocks(x), plain(x))
    assert "torch.compile failed here (RuntimeError: no C++ compiler)" in compiled.notes[0]


def test_the_graph_pool_is_planned_next_to_what_stays_allocated_not_the_warm_ups_cache():
    """Campaign 7, SDXL auto-fit under 4 GiB: about 2.7 GiB stay allocated between steps, yet the warm-up's cached
    activations raised reserved memory to about 3.98 GiB, and counting those next to the graph's own pool
    (0.65 GiB) ran the whole run eagerly. The pool replaces the cached blocks, which are released before capture."""
    from trainer.step.micro_steps import graph_pool_fits
    gib = 2 ** 30
    held, transient = int(2.71 * gib), int(0.65 * gib)
    assert graph_pool_fits(held, transient, 4 * gib)
    assert not graph_pool_fits(held, transient, int(3.4 * gib))  # a pool that really does not fit
    assert graph_pool_fits(held, transient, None)  # no cap, no budget


def test_paused_compiled_blocks_run_eagerly_without_compiling():
    """Auto-fit's probes run uncompiled: a new shape inside `uncompiled()` compiles nothing, outside it compiles."""
    from trainer.step.compiled_blocks import CompiledBlocks, compiled_graph_count
    torch._dynamo.reset()
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    compiled = CompiledBlocks([block])
    before = compiled_graph_count()
    x = torch.randn(3, 8)
    with compiled.uncompiled():
        torch.testing.assert_close(block(x), block[1](block[0](x)))
    assert compiled_graph_count() == before and not compiled.paused
    block(x)
    assert compiled_graph_count() == before + 1
    torch._dynamo.reset()


def test_compiled_blocks_compile_with_the_inductor_options_this_torch_knows(monkeypatch):
    """Combo kernels are on for the compiled blocks (campaign 10: lean with compile 7% faster); a setting this
    torch's inductor lacks is dropped instead of failing the compile, which would leave the whole model eager."""
    from trainer.step import compiled_blocks
    wanted = {**compiled_blocks.INDUCTOR_OPTIONS, "no_such_inductor_setting": 1}
    assert compiled_blocks.inductor_options(wanted) == {"combo_kernels": True}
    torch._dynamo.reset()
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    compiled = compiled_blocks.CompiledBlocks([block], wanted)
    assert compiled.options == {"combo_kernels": True}
    x = torch.randn(3, 8)
    torch.testing.assert_close(block(x), block[1](block[0](x)))
    assert compiled.failed is None and compiled_blocks.compiled_graph_count() >= 1
    torch._dynamo.reset()


def test_blocks_compile_without_the_extra_inductor_options_where_those_fail(monkeypatch):
    """Combo kernels are newer than the rest of inductor: where compiling with an extra option fails, the blocks
    compile without it (and the report says so) instead of the whole model running eagerly."""
    from trainer.step import compiled_blocks
    # known to inductor, and fails while compiling a Linear: no GEMM backend to choose from
    failing = {"max_autotune": True, "max_autotune_gemm_backends": "NONE"}
    torch._dynamo.reset()
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(2)]
    compiled = compiled_blocks.CompiledBlocks(blocks, failing)
    before = compiled_blocks.compiled_graph_count()
    x = torch.randn(3, 8)
    for block in blocks:
        torch.testing.assert_close(block(x), block[1](block[0](x)))
    assert compiled.failed is None and compiled.options == {}
    assert compiled_blocks.compiled_graph_count() > before  # compiled, not eager
    assert len(compiled.notes) == 1
    assert "compiled without inductor's max_autotune, max_autotune_gemm_backends, which failed here" in compiled.notes[0]
    torch._dynamo.reset()


def test_offload_keeps_channels_last_activations_channels_last(stand_in_streams):
    """Conv activations are NHWC once conv weights are (SD1.5 on CUDA): an NCHW host buffer would transpose each
    copy, and the tensor would come back in the layout its convolution must convert again."""
    from trainer.step.activation_offload import ActivationOffload
    layouts_in_backward = []

    class _SavesInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, grad):
            (t,) = ctx.saved_tensors
            layouts_in_backward.append(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous())
            return grad * 2

    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last).requires_grad_()
    offload = ActivationOffload(min_bytes=1)
    with offload.saving(record=True):
        y = _SavesInput.apply(_SavesInput.apply(x * 1.0))
        assert [s.host.is_contiguous(memory_format=torch.channels_last) for s in offload._saved] == [True, True]
    y.sum().backward()
    offload.finish()
    assert offload.fetched_ahead == 1  # the first saved tensor came back through a copy made ahead of its turn
    assert layouts_in_backward == [True, True]
    assert [layout for _shape, _dtype, layout in offload.recorded] == [torch.channels_last] * 2  # capture's buffers
    torch.testing.assert_close(x.grad, torch.full_like(x, 4.0))


# --- every adapter type (trainer/lora: LoHa, LoKr, DoRA, OFT) in graphs ---

def _typed_run(kind: str, graphed: bool, precision_mode: str, dropout: float):
    """_train's regression with `kind` adapters (and step-seeded dropout fed per micro step, as the session does),
    eager or CUDA-graphed micro steps."""
    from trainer.lora import seed_lora_dropout
    device = torch.device("cuda")
    torch.manual_seed(0)
    net = TinyNet(dim=32).to(device)
    lora = LoraSettings(rank=4, alpha=2.0, dropout=dropout, type=kind)
    params = inject_lora(net, lora, 0, sd_targets(lora))
    seed = seed_lora_dropout(net)
    generator = torch.Generator().manual_seed(1)
    batches = []
    for i in range(16):
        b, n = ((4, 8), (2, 12))[i % 2]  # two shapes: two graphs
        x = torch.randn(b, n, 32, generator=generator)
        batches.append({"x": x.to(device), "y": torch.tanh(x).to(device), "seed": torch.tensor(i, device=device)})
    precision = Precision(precision_mode, device)

    def loss_of(inputs):
        if seed is not None:
            seed.feed(inputs["seed"])
        return torch.nn.functional.mse_loss(net(inputs["x"]).float(), inputs["y"])
    micro = GraphedMicroStep(loss_of, precision, params) if graphed else EagerMicroStep(loss_of, precision)
    optimizer, _ = build_optimizer("AdamW", params, 1e-2, device=device)
    result = train_loop(StepParts(params, BatchStep(lambda batch: batch, micro), optimizer, precision, 2),
                        iter(batches), 8)
    return result.losses, [p.detach().float().cpu() for p in params], micro


@cuda
@pytest.mark.parametrize("kind", ["loha", "lokr", "dora", "oft"])
@pytest.mark.parametrize("precision_mode, dropout, tolerance", [("no", 0.0, 1e-5), ("bf16", 0.1, 2e-2)])
def test_each_type_trains_in_cuda_graphs_like_eager_steps(kind, precision_mode, dropout, tolerance):
    eager_losses, eager_params, _ = _typed_run(kind, False, precision_mode, dropout)
    graph_losses, graph_params, micro = _typed_run(kind, True, precision_mode, dropout)
    assert micro.disabled is None, micro.notes
    assert len(micro.graphs) == 2
    assert graph_losses == pytest.approx(eager_losses, rel=tolerance)
    for a, b in zip(graph_params, eager_params):
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance * 0.1)
    assert eager_losses[-1] < eager_losses[0]
