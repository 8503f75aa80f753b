"""CUDA-graph scenarios run in a child process, one per call, under the allocator the parent chose through
PYTORCH_CUDA_ALLOC_CONF (ComfyUI's default is `backend:cudaMallocAsync`). Under that backend a wrong free of
graph memory aborts the process from a C++ destructor, so only a child's exit code can show it.

    python tests/cuda_allocator_cases.py SCENARIO...   # exit 0 and "ok SCENARIO" for each on success
"""
import gc
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[1] / "scripts")]

import torch  # noqa: E402

from comfy_headless import comfyui_path  # noqa: E402  (a path; ComfyUI itself is imported only where needed)
from helpers import TinyNet, sd_targets  # noqa: E402
from trainer.step.activation_offload import ActivationOffload  # noqa: E402
from trainer.step.compiled_blocks import compile_blocks  # noqa: E402
from trainer.step.micro_steps import BatchStep, EagerMicroStep, allocator_backend, build_micro_step  # noqa: E402
from trainer.loop import StepParts, train_loop  # noqa: E402
from trainer.step.checkpointing import checkpoint_blocks, uses_randomness  # noqa: E402
from trainer.lora import inject_lora, seed_lora_dropout  # noqa: E402
from trainer.optimizers import build_optimizer  # noqa: E402
from trainer.step.precision import Precision  # noqa: E402
from trainer.step.micro_steps import graphs_incompatible  # noqa: E402
from trainer.step.weight_prefetch import WeightPrefetch  # noqa: E402
from trainer.settings import FastPath, LoraSettings  # noqa: E402

DEVICE = torch.device("cuda")


def _net(compiled_part: str | None = None):
    torch.manual_seed(0)
    net = TinyNet(dim=64).to(DEVICE)
    params = inject_lora(net, LoraSettings(rank=4, alpha=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))
    for p in params:
        p.data.normal_(0, 0.05)
    block = net.input_blocks[1]["attn1"]
    if compiled_part == "blocks":  # the trainer's compiled blocks (the fp8 upcast is guarded the same way)
        compile_blocks([block])
    elif compiled_part == "raw":  # a plain torch.compile'd function inside the step
        block.forward = torch.compile(block.forward, dynamic=False)
    return net, params


def _comfy_ops_net(streamed_norms_through_comfyui: bool = False, stream: bool | float = True, checkpoint: bool = True,
                   empty_cache_while_capturing: bool = False, grouped: bool = True):
    """Blocks of ComfyUI's own layers (LayerNorm -> Linear -> GELU -> Linear, checkpointed), fp8 and streamed from
    CPU as the trainer does it (bridge.cast_weights), LoRA on the first Linear. streamed_norms_through_comfyui: the
    norms' weights go to pinned CPU memory too, so ComfyUI's generic cast copies them on its offload streams (what
    LeanLoRA streamed until 2 Dec 2026). stream / checkpoint off: the probe's variants without them; stream a fraction:
    that share of the weights streamed (largest first). grouped: each block's fp8 upcasts run together
    (cast_weights.group_upcasts), as the trainer does."""
    sys.path.insert(0, str(comfyui_path()))
    import comfy.ops
    from bridge.cast_weights import group_upcasts, store_weights_fp8, stream_weights_from_cpu
    from trainer.step.frozen_weights import place_on_device
    ops = comfy.ops.disable_weight_init

    class Block(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm, self.to_q, self.out = ops.LayerNorm(dim), ops.Linear(dim, dim), ops.Linear(dim, dim)

        def forward(self, x):
            if empty_cache_while_capturing and torch.cuda.is_current_stream_capturing():
                torch.cuda.empty_cache()  # what an out-of-memory handler does (ComfyUI's split attention)
            return x + self.out(torch.nn.functional.gelu(self.to_q(self.norm(x))))

    class Net(torch.nn.Module):
        def __init__(self, dim=64, depth=3):
            super().__init__()
            self.input_blocks = torch.nn.ModuleList(Block(dim) for _ in range(depth))

        def forward(self, x):
            for block in self.input_blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpoint else block(x)
            return x

    torch.manual_seed(0)
    net = Net()
    for module in net.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)):
            torch.nn.init.normal_(module.weight, 1.0 if isinstance(module, torch.nn.LayerNorm) else 0.0, 0.1)
            torch.nn.init.normal_(module.bias, 0, 0.01)
    params = inject_lora(net, LoraSettings(rank=4, alpha=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4)))  # as the trainer: LoRA, then fp8, streaming
    if grouped:
        group_upcasts(net.input_blocks)
    for p in params:
        p.data.normal_(0, 0.05)
    store_weights_fp8(net)
    if stream:
        stream_weights_from_cpu(net, 1.0 if stream is True else stream)
    if streamed_norms_through_comfyui:
        for block in net.input_blocks:
            block.norm.weight = torch.nn.Parameter(block.norm.weight.data.pin_memory(), requires_grad=False)
            block.norm.bias = torch.nn.Parameter(block.norm.bias.data.pin_memory(), requires_grad=False)
            block.norm.comfy_cast_weights = block.norm.leanlora_streamed = True
    place_on_device(net, DEVICE)
    return net, params


def _batches(shapes, count, seed=1, dropout_seeds=False):
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        b, n = shapes[i % len(shapes)]
        x = torch.randn(b, n, 64, generator=g)
        batch = {"x": x.to(DEVICE), "y": torch.tanh(x).to(DEVICE)}
        if dropout_seeds:  # as TrainingSession.inputs draws them: one per micro-step, an input like the data
            batch["dropout_seed"] = torch.randint(0, 2 ** 31, (), generator=g).to(DEVICE)
        yield batch


def _train(graphed, shapes=((2, 8),), steps=4, offload=False, compiled_part=None, precision_mode="bf16",
           optimizer_name="AdamW", fail_capture=False, build=None, graph_kept_alive=False, budget=None,
           prefetch=False):
    net, params = build() if build else _net(compiled_part)
    dropout_seed = seed_lora_dropout(net)
    precision = Precision(precision_mode, DEVICE)
    captures = {"n": 0}
    kept = []  # graph_kept_alive: an output of the first eager step, with its autograd graph

    def loss_of(inputs):
        if fail_capture and torch.cuda.is_current_stream_capturing():
            captures["n"] += 1
            torch.empty(1 << 20, device=DEVICE)  # allocated during the failing capture, never launched
            raise RuntimeError("injected capture failure")
        if "dropout_seed" in inputs:  # as TrainingSession.compute_loss feeds it
            dropout_seed.feed(inputs["dropout_seed"])
        out = net(inputs["x"])
        if graph_kept_alive and not kept:
            kept.append(out)
        return torch.nn.functional.mse_loss(out.float(), inputs["y"])

    saver = ActivationOffload(min_bytes=0) if offload else None
    fetcher = WeightPrefetch() if prefetch else None
    if graphed:  # as the trainer decides it (session.graphs_incompatible)
        micro, _ = build_micro_step(FastPath.CUDA_GRAPHS, loss_of, precision, params, DEVICE, offload=saver,
                                    incompatible=graphs_incompatible(False), prefetch=fetcher)
        micro.budget = budget  # auto-fit's (TrainingSession.configure sets it)
    else:
        micro = EagerMicroStep(loss_of, precision, saver, fetcher)
    if graph_kept_alive:  # an eager step on the default stream (as a probe ran), its graph held past its backward
        micro.forward_backward(next(_batches(shapes, 1, seed=7)), 1)
        for p in params:
            p.grad = None
    optimizer, _ = build_optimizer(optimizer_name, params, 1e-2, device=DEVICE)
    batches = _batches(shapes, steps * 4, dropout_seeds=dropout_seed is not None)
    result = train_loop(StepParts(params, BatchStep(lambda batch: batch, micro), optimizer, precision), batches,
                        steps)
    weights = [p.detach().float().cpu().clone() for p in params]
    return result.losses, weights, micro


def _same_as_eager(graphs_fail: str | None = None, **kwargs):
    """graphs_fail: the reason expected where capture cannot work (steps then run eagerly, named)."""
    eager_losses, eager_weights, _ = _train(False, **kwargs)
    losses, weights, micro = _train(True, **kwargs)
    disabled = getattr(micro, "disabled", None)
    if graphs_fail:
        assert disabled and graphs_fail in disabled, micro.notes
    else:
        assert disabled is None, micro.notes
    for a, b in zip(losses, eager_losses):
        assert abs(a - b) <= 2e-2 * abs(b) + 1e-6, (losses, eager_losses)
    for a, b in zip(weights, eager_weights):
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-3)
    return micro


def raw_free_before_launch():
    """The mechanism itself, without LeanLoRA: a tensor allocated during capture, freed before any replay."""
    graph, x = torch.cuda.CUDAGraph(), torch.ones(1024, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (x * 2).sum()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        kept = x * 2  # survives the capture: the graph's memory, never launched
    del kept
    torch.cuda.synchronize()


def shape_captured_last_never_replayed():
    """The last step brings a new batch shape: captured, then the run ends (graphs released)."""
    micro = _same_as_eager(shapes=((2, 8),) * 3 + ((1, 12),), steps=4)
    assert len(micro.graphs) == 2
    del micro


def rebuilt_mid_run():
    """OOM recovery and auto-fit rebuild the micro-step: the old graphs go while training goes on."""
    for _ in range(3):
        _, _, micro = _train(True, shapes=((2, 8), (1, 12)), steps=3)
        assert micro.disabled is None, micro.notes
        del micro
        gc.collect()


def with_offload():
    micro = _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, offload=True)
    assert all(entry[3] for entry in micro.graphs.values())


def with_compiled_code():
    """The trainer's compiled blocks capture their eager forms under cudaMallocAsync: graphs stay on."""
    _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, compiled_part="blocks")


def with_raw_compiled_code():
    """Triton kernels cannot be captured under cudaMallocAsync (CUDA driver error: invalid argument, H200, torch
    2.11): a compiled function the trainer does not guard makes the capture fail, and the steps run eagerly."""
    async_allocator = allocator_backend() == "cudaMallocAsync"
    _same_as_eager(graphs_fail="invalid argument" if async_allocator else None,
                   shapes=((2, 8), (1, 12)), steps=6, compiled_part="raw")


def with_8bit_optimizer():
    _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, optimizer_name="AdamW8bit")


def fp16_loss_scaling():
    _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, precision_mode="fp16")


def failed_capture():
    """A capture that fails part-way: steps go on eagerly and nothing the capture allocated is freed wrongly."""
    losses, _, micro = _train(True, steps=4, fail_capture=True)
    assert micro.disabled and "injected capture failure" in micro.disabled, micro.notes
    assert len(losses) == 4


def capture_broken_by_cuda_gives_its_pool_back():
    """A capture CUDA itself invalidates (a synchronizing call inside it, as the native allocator's cudaFree at a
    memory cap was in a ComfyUI server): steps go on eagerly, random draws on the GPU still work after it (the
    failed capture left the generator in capture mode), and under the native allocator the failed capture's
    private pool is given back (it kept 1.36 GiB reserved on a 2 GiB card, and ComfyUI's VAE decode failed).
    Native allocator only: under cudaMallocAsync a failed capture's memory is kept on purpose (_never_free)."""
    if allocator_backend() != "native":
        return
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(DEVICE)

    def build():
        net, params = _net()

        class Breaks(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, x):
                if torch.cuda.is_current_stream_capturing():
                    torch.empty(1 << 26, device=DEVICE)  # 256 MiB of the graph's pool
                    torch.cuda.synchronize()  # illegal in a capture: CUDA invalidates it
                return self.net(x)
        return Breaks(), params
    losses, _, micro = _train(True, steps=4, build=build)
    assert micro.disabled and len(losses) == 4, micro.notes
    torch.randn(4, device=DEVICE)  # the GPU's random generator works after it (ComfyUI's GPU noise needs it)
    del micro
    gc.collect()
    torch.cuda.empty_cache()
    kept = torch.cuda.memory_reserved(DEVICE) - before
    assert kept < 64 * 2 ** 20, f"{kept / 2 ** 20:.0f} MiB still reserved after a failed capture"


def earlier_graph_kept_alive():
    """An eager step's autograd graph on the default stream still alive when the graph is captured (an auto-fit
    probe's out-of-memory traceback held one in a ComfyUI server): autograd reuses the parameters' gradient
    accumulators that graph holds, and one on the default stream made CUDA invalidate the capture
    (cudaErrorStreamCaptureImplicit). The step makes them on its own stream first: the capture holds."""
    losses, _, micro = _train(True, shapes=((2, 8), (1, 12)), steps=6, graph_kept_alive=True)
    assert micro.disabled is None and micro.graphs, micro.notes
    assert len(losses) == 6


def fp8_weights():
    """fp8 weights on the device through ComfyUI's layers: graphed under both allocators, and under cudaMallocAsync
    (where the graphs run the eager upcast) with the eager steps' numbers."""
    micro = _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, offload=True,
                           build=lambda: _comfy_ops_net(stream=False))
    assert micro.graphs


def partly_streamed_fp8_weights():
    """Half the fp8 weights streamed (the largest layers), the rest resident and upcast a block at a time: graphed
    under both allocators, the same training as eager steps."""
    micro = _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, offload=True,
                           build=lambda: _comfy_ops_net(stream=0.5))
    assert micro.graphs, micro.notes


def streamed_fp8_weights():
    """fp8 weights streamed from pinned CPU memory through ComfyUI's layers, as the trainer streams them (copies on
    the current stream, norms resident), with activation offload: graphed under both allocators, the same training
    as eager steps."""
    micro = _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, offload=True, build=_comfy_ops_net)
    assert micro.graphs, micro.notes


def prefetched_streamed_fp8_weights():
    """Streamed fp8 weights fetched a layer ahead on a copy stream (trainer/step/weight_prefetch.py): graphed
    under both allocators with the eager steps' training; eager steps with and without the prefetch train bit for
    bit alike, and after the first pass every streamed weight comes ahead."""
    kwargs = dict(shapes=((2, 8), (1, 12)), steps=6, offload=True, build=_comfy_ops_net)
    micro = _same_as_eager(prefetch=True, **kwargs)
    assert micro.graphs and micro.prefetch.order, micro.notes
    plain_losses, plain_weights, _ = _train(False, **kwargs)
    losses, weights, eager = _train(False, prefetch=True, **kwargs)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    calls = len(eager.prefetch.order)  # 3 blocks x 2 streamed layers, forward and recompute
    assert calls == 12 and (eager.prefetch.fetched_ahead, eager.prefetch.fetched_on_demand) == (calls, 0)
    # a capture that fails with the first layer's copy already under way (fetched as the pass starts): eager steps
    # go on, and the copy made inside the failed capture is dropped without aborting the process
    losses, _, failed = _train(True, steps=4, fail_capture=True, prefetch=True, build=_comfy_ops_net)
    assert failed.disabled and "injected capture failure" in failed.disabled and len(losses) == 4, failed.notes


PROBES = {  # bench/streamed_capture_probe.py: which ingredient of a streamed step breaks capture, per allocator
    "streamed": dict(offload=True),
    "streamed_no_offload": dict(offload=False),
    "streamed_no_checkpoint": dict(offload=True, net=dict(checkpoint=False)),
    "resident_fp8": dict(offload=True, net=dict(stream=False)),
    "norms_through_comfyui": dict(offload=True, net=dict(streamed_norms_through_comfyui=True)),
    "empty_cache_while_capturing": dict(offload=True, net=dict(empty_cache_while_capturing=True)),
}


def probe(name: str) -> None:
    """Graphs forced on (the trainer's guard bypassed); prints whether capture held and how far training went
    from the eager steps."""
    spec = PROBES[name]
    kwargs = dict(shapes=((2, 8), (1, 12)), steps=6, offload=spec["offload"],
                  build=lambda: _comfy_ops_net(**spec.get("net", {})))
    eager_losses, eager_weights, _ = _train(False, **kwargs)
    losses, weights, micro = _train(True, **kwargs)
    dloss = max(abs(a - b) / (abs(b) + 1e-6) for a, b in zip(losses, eager_losses))
    dweight = max((a - b).abs().max().item() for a, b in zip(weights, eager_weights))
    print(f"probe {name} allocator={allocator_backend()} graphs={len(getattr(micro, 'graphs', {}))} "
          f"capture={'failed: ' + micro.disabled if micro.disabled else 'ok'} max_rel_dloss={dloss:.2e} "
          f"max_dweight={dweight:.2e}", flush=True)


def lora_dropout():
    """LoRA dropout in checkpointed blocks (lora.StepSeededDropout: masks from the step's seed, recomputed without
    the random generator's state): graphed under both allocators, the same training as eager steps."""
    def build():
        torch.manual_seed(0)
        net = TinyNet(dim=64).to(DEVICE)
        params = inject_lora(net, LoraSettings(rank=4, alpha=4, dropout=0.3), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4, dropout=0.3)))
        for p in params:
            p.data.normal_(0, 0.05)
        assert not uses_randomness(net)  # what lets the trainer capture (session.graphs_incompatible)
        checkpoint_blocks(net.input_blocks, preserve_rng_state=False)
        return net, params
    micro = _same_as_eager(shapes=((2, 8), (1, 12)), steps=6, build=build)
    assert micro.graphs, micro.notes


def graph_over_budget_raises_before_capture():
    """Auto-fit's budget leaves no room for the first graph's pool (measured by the eager warm-up): the micro-step
    raises GraphDoesNotFit, which the session recovers with the next rung, before anything is captured; graphs
    then work as before in the same process (under cudaMallocAsync no captured memory was left to free)."""
    from trainer.step.micro_steps import GraphDoesNotFit
    try:
        _train(True, budget=1)
    except GraphDoesNotFit as error:
        assert "does not fit" in str(error), error
    else:
        raise AssertionError("a graph was captured past auto-fit's budget")
    gc.collect()
    _same_as_eager(shapes=((2, 8),), steps=3)


SCENARIOS = {f.__name__: f for f in (raw_free_before_launch, shape_captured_last_never_replayed, rebuilt_mid_run,
                                     with_offload, with_compiled_code, with_raw_compiled_code, with_8bit_optimizer,
                                     fp16_loss_scaling, failed_capture, capture_broken_by_cuda_gives_its_pool_back,
                                     earlier_graph_kept_alive, fp8_weights, partly_streamed_fp8_weights,
                                     streamed_fp8_weights, prefetched_streamed_fp8_weights, lora_dropout,
                                     graph_over_budget_raises_before_capture)}

if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe(sys.argv[2])
        sys.exit(0)
    names = list(SCENARIOS) if sys.argv[1] == "all" else sys.argv[1:]
    for name in names:
        SCENARIOS[name]()
        gc.collect()
        torch.cuda.synchronize()
        print(f"ok {name} allocator={allocator_backend()}", flush=True)
