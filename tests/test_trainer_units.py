"""Library units on small torch modules (no ComfyUI server)."""
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from trainer.cache import batches, collate, CachedSample
from trainer.step.checkpointing import checkpoint_blocks
from trainer.errors import LeanLoRAError
from trainer.files import sanitize_name, save_safetensors_atomic, unused_path
from helpers import node_module, sd_targets
from trainer.lora import inject_lora, kohya_state_dict
from trainer.loop import StepParts, train_loop
from trainer.step.precision import Precision
from trainer.settings import BaseWeights, LoraSettings, MemorySettings, TrainSettings

from helpers import TinyNet, loop_events, regression_problem


def test_sanitize_name_blocks_traversal_and_junk():
    assert sanitize_name("../../etc/passwd") == "passwd"
    assert sanitize_name("..\\..\\win.safetensors") == "win"
    assert sanitize_name("my lora:v1*?") == "my lora_v1_"
    assert sanitize_name("...") == "leanlora"
    assert sanitize_name("") == "leanlora"
    assert len(sanitize_name("x" * 500)) == 100


def test_atomic_save_never_overwrites(tmp_path):
    first = save_safetensors_atomic({"a": torch.ones(2)}, unused_path(tmp_path, "lora"), {"k": "v"})
    second = save_safetensors_atomic({"a": torch.zeros(2)}, unused_path(tmp_path, "lora"), {})
    assert (first.name, second.name) == ("lora.safetensors", "lora_2.safetensors")
    assert load_file(first)["a"].sum() == 2
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_lora_injection_trains_only_lora_and_exports_kohya_keys():
    torch.manual_seed(0)
    net = TinyNet()
    frozen = {k: v.clone() for k, v in net.state_dict().items()}
    params = inject_lora(net, LoraSettings(rank=4, alpha=2.0, targets="attention"), seed=1, target_modules=sd_targets(LoraSettings(rank=4, alpha=2.0, targets="attention")))
    assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
    assert all(not p.requires_grad for n, p in net.named_parameters() if "lora_" not in n)
    sd = kohya_state_dict(net, LoraSettings(rank=4, alpha=2.0))
    assert "lora_unet_input_blocks_0_attn1_to_q.lora_down.weight" in sd
    assert "lora_unet_input_blocks_2_attn1_to_out_0.lora_up.weight" in sd
    assert sd["lora_unet_input_blocks_0_attn1_to_q.lora_down.weight"].shape == (4, 16)
    assert sd["lora_unet_input_blocks_0_attn1_to_q.alpha"].item() == 2.0  # lora_alpha, not the rank
    assert len(sd) == 3 * 4 * 3  # 3 blocks x 4 projections x (down, up, alpha)
    base = {k.replace("base_layer.", ""): v for k, v in net.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base[k], v) for k, v in frozen.items())


def test_lora_layers_under_autocast_keep_their_input_in_the_compute_dtype():
    """peft would cast each LoRA layer's input to fp32 (its weights' dtype) for autocast to cast it straight back:
    same numbers, but activation-sized copies and a second saved copy of every LoRA layer's input."""
    from trainer.step.frozen_weights import cast_frozen_weights
    torch.manual_seed(0)
    net = TinyNet(dim=32)
    inject_lora(net, LoraSettings(rank=4), seed=1, target_modules=sd_targets(LoraSettings(rank=4)))
    cast_frozen_weights(net, torch.bfloat16)
    x = torch.randn(2, 64, 32, dtype=torch.bfloat16)

    def forward():
        saved = []
        def pack(tensor):
            saved.append(tensor)
            return tensor
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = net(x)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return out, sum(storages.values())

    out, saved_bytes = forward()
    for layer in net.modules():
        if hasattr(layer, "cast_input_dtype_enabled"):
            layer.cast_input_dtype_enabled = True  # peft's default
    peft_out, peft_saved_bytes = forward()
    assert torch.equal(out, peft_out)
    # peft's round trip saves extra copies of LoRA layers' inputs: at least one input-sized copy per block
    assert peft_saved_bytes - saved_bytes >= 3 * x.numel() * x.element_size()


def test_fp8_dequantize_falls_back_to_eager_when_compiling_fails_but_not_on_later_errors(monkeypatch):
    from trainer.step import frozen_weights
    weight = (torch.randn(8, 4) * 100).to(frozen_weights.FP8)
    scale = torch.tensor(0.01)
    eager = frozen_weights._dequantize_eager(weight, scale, torch.bfloat16)
    upcast = frozen_weights.FusedUpcast(devices=("cpu",))  # the CUDA-only path, driven on CPU
    monkeypatch.setattr(frozen_weights, "_FUSED_UPCAST", upcast)

    def no_triton(*args):
        raise RuntimeError("Cannot find a working triton installation")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: no_triton)
    assert torch.equal(frozen_weights.dequantize(weight, scale, torch.bfloat16), eager)
    assert upcast.kernel is False and "triton" in upcast.failure

    from torch._dynamo.exc import TorchRuntimeError
    later_errors = [torch.OutOfMemoryError("CUDA out of memory"), TorchRuntimeError("recompiling for fp16 failed")]
    def compiled(*args):  # compiles and runs fine once, then the later errors
        if upcast.verified:
            raise later_errors.pop(0)
        return frozen_weights._dequantize_fused(*args)
    monkeypatch.setattr(upcast, "kernel", None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled)
    assert torch.allclose(frozen_weights.dequantize(weight, scale, torch.bfloat16), eager, rtol=2 ** -7, atol=0)
    with pytest.raises(torch.OutOfMemoryError):  # OOM recovery needs it, not a silent switch to eager
        frozen_weights.dequantize(weight, scale, torch.bfloat16)
    assert upcast.kernel is compiled
    # a compile error after it once ran (a new dtype or device recompiles): eager from now on, not a crash
    assert torch.equal(frozen_weights.dequantize(weight, scale, torch.bfloat16), eager)
    assert upcast.kernel is False and "recompiling" in upcast.failure


def test_fused_fp8_dequantize_keeps_a_channels_last_conv_weight_channels_last(monkeypatch):
    """The fused kernel sees each weight flat: in memory order, so a channels-last (NHWC) conv weight is neither
    copied to flatten it nor handed back NCHW for cuDNN to transpose again."""
    from trainer.step import frozen_weights
    weight = (torch.randn(8, 4, 3, 3) * 100).to(frozen_weights.FP8).contiguous(memory_format=torch.channels_last)
    scale = torch.tensor(0.01)
    fused = frozen_weights.FusedUpcast(devices=("cpu",))
    monkeypatch.setattr(frozen_weights, "_FUSED_UPCAST", fused)
    flats = []  # the fused kernel's input; the math runs uncompiled
    fused.kernel = lambda flat, *args: flats.append(flat) or frozen_weights._dequantize_fused(flat, *args)
    upcast = frozen_weights.dequantize(weight, scale, torch.bfloat16)
    assert flats[0].data_ptr() == weight.data_ptr()  # a view, not a copy
    assert upcast.is_contiguous(memory_format=torch.channels_last) and not upcast.is_contiguous()
    torch.testing.assert_close(upcast, frozen_weights._dequantize_eager(weight.contiguous(), scale, torch.bfloat16),
                               rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("with_bias", [True, False])
def test_scaled_linear_is_linear_with_the_scaled_weight_in_value_and_input_gradient(with_bias):
    """Grouped fp8 Linear layers take their scale as the GEMM's alpha (cast_weights.scaled_linear); the bias, if
    any, trains only where it requires grad. float64 keeps the comparison exact up to rounding."""
    from bridge.cast_weights import scaled_linear
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(6, 8, dtype=torch.float64, generator=generator)
    bias = torch.randn(6, dtype=torch.float64, generator=generator, requires_grad=True) if with_bias else None
    scale = 0.37
    out = scaled_linear(x, weight, bias, scale)
    reference = torch.nn.functional.linear(x, weight * scale, bias)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    inputs = (x, bias) if with_bias else (x,)
    assert torch.autograd.gradcheck(lambda x, *b: scaled_linear(x, weight, b[0] if b else None, scale), inputs)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    frozen_bias = bias.detach() if with_bias else None
    (x_grad,) = torch.autograd.grad(scaled_linear(x, weight, frozen_bias, scale), x, grad)
    torch.testing.assert_close(x_grad, grad @ (weight * scale), rtol=1e-12, atol=1e-12)


def test_scaled_linear_keeps_the_fp8_weight_for_backward_not_its_upcast_copy():
    """Without checkpointing autograd keeps what a layer saved until backward: an fp8 Linear keeps its 1-byte
    weight and upcasts again in backward (exact: e4m3 -> bf16 is), so its gradient is the one the upcast copy
    gives and fp8 saves memory at any checkpoint share."""
    from bridge.cast_weights import scaled_linear
    from trainer.step.frozen_weights import FP8
    generator = torch.Generator().manual_seed(0)
    stored = (torch.randn(64, 32, generator=generator) * 8).to(FP8)
    upcast = stored.to(torch.bfloat16)
    x = torch.randn(3, 32, generator=generator).to(torch.bfloat16).requires_grad_()
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = scaled_linear(x, upcast, None, 0.25, stored)
    assert [t.dtype for t in saved] == [FP8] and saved[0] is stored
    grad = torch.randn(out.shape, generator=generator).to(torch.bfloat16)
    (kept_fp8,) = torch.autograd.grad(out, x, grad)
    (kept_copy,) = torch.autograd.grad(scaled_linear(x, upcast, None, 0.25), x, grad)
    assert torch.equal(kept_fp8, kept_copy)
    torch.testing.assert_close(out, scaled_linear(x, upcast, None, 0.25), rtol=0, atol=0)


def test_an_fp8_linear_keeps_fp8_outside_recomputed_blocks_and_its_upcast_copy_inside():
    """Inside a recomputed block what the recompute saves lives only through that block's backward: the layer
    keeps the upcast copy there (no second upcast, the step as fast as before); outside it keeps the fp8 weight."""
    from bridge.cast_weights import store_weights_fp8
    from comfy import ops
    from trainer.step.checkpointing import checkpoint_blocks, uncheckpoint_blocks
    from trainer.step.frozen_weights import FP8
    generator = torch.Generator().manual_seed(0)
    block = torch.nn.Sequential(ops.manual_cast.Linear(16, 8, bias=False))
    block[0].weight = torch.nn.Parameter(torch.randn(8, 16, generator=generator), requires_grad=False)
    store_weights_fp8(block)
    x = torch.randn(2, 16, generator=generator).to(torch.bfloat16).requires_grad_()

    def saved_dtypes():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
            block[0](x)
        return saved
    assert FP8 in saved_dtypes()
    checkpoint_blocks([block])
    assert FP8 not in saved_dtypes()  # the layer called directly, as the recompute calls it
    uncheckpoint_blocks([block])
    assert FP8 in saved_dtypes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel is CUDA-only")
def test_fused_fp8_dequantize_equals_the_eager_form_on_cuda():
    from trainer.step import frozen_weights
    weight = (torch.randn(300, 77, device="cuda") * 100).to(frozen_weights.FP8)
    scale = torch.tensor(0.0123, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        fused = frozen_weights.dequantize(weight, scale, dtype)
        assert frozen_weights._FUSED_UPCAST.kernel not in (None, False), "the compiled kernel did not run"
        assert fused.shape == weight.shape and fused.dtype == dtype
        assert torch.equal(fused, frozen_weights._dequantize_fused(weight, scale, dtype))  # the same math, eager
        # eager PyTorch rounds a 0-dim fp32 scale to the weight's dtype first: within one rounding of that
        assert torch.allclose(fused, frozen_weights._dequantize_eager(weight, scale, dtype), rtol=2 ** -7, atol=0)


def test_an_eager_micro_step_launches_its_fp8_upcasts_from_the_host_and_a_failed_one_resets_that():
    """Eager CUDA steps are host-bound: their fp8 upcasts skip the compiled kernel's call overhead
    (frozen_weights.host_launched_upcasts). The flag covers the whole forward + backward and is gone after it,
    also when the step fails; a graph's warm-up (forward_backward called directly) keeps the compiled kernel."""
    from trainer.step import frozen_weights
    from trainer.step.micro_steps import EagerMicroStep
    from trainer.step.precision import Precision
    weight = torch.nn.Parameter(torch.ones(3))
    seen = []

    def loss_of(inputs):
        seen.append(frozen_weights._host_launched_steps)
        if inputs.get("fail") is not None:
            raise RuntimeError("out of memory in the forward")
        return (weight * inputs["x"]).sum()
    step = EagerMicroStep(loss_of, Precision("no", torch.device("cpu")))
    step({"x": torch.ones(3)}, 1)
    assert seen == [1] and frozen_weights._host_launched_steps == 0 and weight.grad is not None
    with pytest.raises(RuntimeError, match="out of memory"):
        step({"x": torch.ones(3), "fail": torch.ones(1)}, 1)
    assert frozen_weights._host_launched_steps == 0
    step.forward_backward({"x": torch.ones(3)}, 1)  # how a graph's warm-up runs: compiled upcasts
    assert seen[-1] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernel is CUDA-only")
def test_host_launched_fp8_upcasts_skip_the_compiled_kernel_with_the_same_numbers(monkeypatch):
    from trainer.step import frozen_weights
    weight = (torch.randn(300, 77, device="cuda") * 100).to(frozen_weights.FP8)
    scale = torch.tensor(0.0123, device="cuda")
    calls = []
    fused = frozen_weights.FusedUpcast()
    monkeypatch.setattr(frozen_weights, "_FUSED_UPCAST", fused)
    fused.kernel = lambda *args: calls.append(1) or frozen_weights._dequantize_fused(*args)
    compiled = frozen_weights.dequantize(weight, scale, torch.bfloat16, float(scale))
    with frozen_weights.host_launched_upcasts():
        eager = frozen_weights.dequantize(weight, scale, torch.bfloat16, float(scale))
    assert len(calls) == 1 and torch.equal(compiled, eager)


def test_lora_dropout_masks_follow_the_steps_seed_so_recompute_needs_no_generator_state():
    """LoRA dropout is StepSeededDropout: the same seed gives the same mask (checkpointing's recompute), another
    seed another one, eval mode none; nothing in the model draws from a generator, so steps stay capturable."""
    from trainer.step.checkpointing import uses_randomness
    from trainer.lora import StepSeededDropout, seed_lora_dropout
    torch.manual_seed(0)
    net = TinyNet(dim=64)
    inject_lora(net, LoraSettings(rank=4, alpha=4.0, dropout=0.3), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4.0, dropout=0.3)))
    dropouts = [m for m in net.modules() if isinstance(m, StepSeededDropout)]
    assert dropouts and len({d.salt for d in dropouts}) == len(dropouts)  # each layer its own masks
    assert not uses_randomness(net) and seed_lora_dropout(net) is not None
    assert seed_lora_dropout(TinyNet()) is None
    x = torch.ones(8, 32, 64)
    seed = seed_lora_dropout(net)
    seed.feed(torch.tensor(11))
    first, again = dropouts[0](x), dropouts[0](x)
    assert torch.equal(first, again) and not torch.equal(first, dropouts[1](x))
    dropped = (first == 0).float().mean().item()
    assert 0.28 < dropped < 0.32 and torch.allclose(first[first != 0], torch.tensor(1 / 0.7))
    seed.feed(torch.tensor(12))
    assert not torch.equal(dropouts[0](x), first)
    net.eval()
    assert torch.equal(dropouts[0](x), x)


def test_lora_dropout_layers_read_one_step_mask_that_equals_hashing_each_input(monkeypatch):
    """Each layer reads a window of the micro-step's one mask; the windows equal the masks hashed on the spot (what
    a capture does when an input outgrows the mask), a larger input grows the mask without changing the smaller
    ones, the next seed refills it in place, and layers sharing an input get different masks."""
    from trainer.lora import dropout as lora  # the module whose _capturing the keep path reads
    masks = lora.DropoutSeed(0.25)
    masks.feed(torch.tensor(3))
    small = masks.keep(5, 1000, torch.device("cpu")).clone()
    large = masks.keep(6, 3 * lora.DropoutSeed.GROWTH, torch.device("cpu")).clone()  # grows the mask
    assert torch.equal(masks.keep(5, 1000, torch.device("cpu")), small)
    assert not torch.equal(masks.keep(6, 1000, torch.device("cpu")), small)
    assert 0.24 < 1 - large.float().mean().item() < 0.26
    monkeypatch.setattr(lora, "_capturing", lambda device: True)
    hashed = lora.DropoutSeed(0.25)  # no mask yet and "capturing": every window hashed on the spot
    hashed.feed(torch.tensor(3))
    assert torch.equal(hashed.keep(5, 1000, torch.device("cpu")), small)
    assert torch.equal(hashed.keep(6, 3 * lora.DropoutSeed.GROWTH, torch.device("cpu")), large)
    assert hashed._mask is None
    mask = masks._mask
    masks.feed(torch.tensor(4))
    assert masks._mask is mask and not torch.equal(masks.keep(5, 1000, torch.device("cpu")), small)
    hashed.feed(torch.tensor(4))
    assert torch.equal(masks.keep(5, 1000, torch.device("cpu")), hashed.keep(5, 1000, torch.device("cpu")))


def test_checkpointed_blocks_with_lora_dropout_recompute_the_forwards_masks():
    """preserve_rng_state=False (what CUDA graphs need) with LoRA dropout: the recompute draws nothing, so the
    gradients are those of the same step without checkpointing."""
    from trainer.lora import seed_lora_dropout
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        net = TinyNet(dim=32)
        params = inject_lora(net, LoraSettings(rank=4, alpha=4.0, dropout=0.5), seed=0, target_modules=sd_targets(LoraSettings(rank=4, alpha=4.0, dropout=0.5)))
        with torch.no_grad():
            for p in params:  # lora_up starts at zero, where dropout changes no gradient of lora_down
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        if checkpointed:
            checkpoint_blocks(net.input_blocks, preserve_rng_state=False)
        seed_lora_dropout(net).feed(torch.tensor(5))
        torch.manual_seed(1 + checkpointed)  # the process's generator differs: nothing may depend on it
        net(torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(2))).square().mean().backward()
        grads.append([p.grad.clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_same_seed_same_lora_init():
    a, b = TinyNet(), TinyNet()
    b.load_state_dict(a.state_dict())
    inject_lora(a, LoraSettings(rank=4), seed=7, target_modules=sd_targets(LoraSettings(rank=4)))
    inject_lora(b, LoraSettings(rank=4), seed=7, target_modules=sd_targets(LoraSettings(rank=4)))
    sa, sb = kohya_state_dict(a, LoraSettings(rank=4)), kohya_state_dict(b, LoraSettings(rank=4))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_gradient_checkpointing_gives_the_same_gradients_fp32():
    torch.manual_seed(0)
    plain = TinyNet()
    checkpointed = TinyNet()
    checkpointed.load_state_dict(plain.state_dict())
    grads = []
    for net, use_checkpointing in ((plain, False), (checkpointed, True)):
        params = inject_lora(net, LoraSettings(rank=4), seed=3, target_modules=sd_targets(LoraSettings(rank=4)))
        with torch.no_grad():
            for p in params:
                p.add_(0.1)  # lora_B starts at zero: make every LoRA weight carry gradient
        if use_checkpointing:
            assert checkpoint_blocks(net.input_blocks) == 3
        net(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in params])
    for g_plain, g_ckpt in zip(*grads):
        torch.testing.assert_close(g_ckpt, g_plain, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["no", "bf16", "fp16"])
def test_loop_reduces_loss_in_every_precision(mode):
    net, params, data, _ = regression_problem()
    precision = Precision(mode, torch.device("cpu"))
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    result = train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]).float(), b[1]), optimizer,
                                  precision, 2), data, 60)
    assert result.steps_done == 60 and len(result.losses) == 60
    assert sum(result.losses[-10:]) < 0.8 * sum(result.losses[:10])


def test_fp16_loss_scaling_skips_and_counts_overflowed_steps():
    net, params, data, _ = regression_problem()
    precision = Precision("fp16", torch.device("cpu"), initial_scale=2.0 ** 40)  # overflows fp16 at first
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    before = [p.clone() for p in params]
    result = train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]).float(), b[1]), optimizer,
                                  precision), data, 40)
    assert precision.skipped_steps >= 1
    assert precision.scaler.get_scale() < 2.0 ** 40
    assert result.steps_done == 40
    assert any(not torch.equal(a, b) for a, b in zip(before, params))  # later steps did apply


def test_loop_stops_when_asked():
    net, params, data, _ = regression_problem()
    calls = []
    result = train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]), b[1]),
                                  torch.optim.AdamW(params), Precision("no", torch.device("cpu"))), data, 100,
                        loop_events(should_stop=lambda: len(calls) >= 5, on_step=calls.append))
    assert result.cancelled and result.steps_done == 5


def test_batches_cover_every_sample_each_epoch_and_pad_long_captions():
    cache = [CachedSample(torch.full((1, 4, 2, 2), float(i)), {"c_crossattn": torch.zeros(1, 77 * (1 + i % 2), 8)})
             for i in range(4)]
    stream = batches(cache, batch_size=2, repeats=2, generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(4):  # one epoch = 4 samples x 2 repeats = 8 items = 4 batches
        latents, cond = next(stream)
        assert latents.shape == (2, 4, 2, 2) and cond["c_crossattn"].shape[0] == 2
        assert cond["c_crossattn"].shape[1] in (77, 154)
        seen += latents[:, 0, 0, 0].tolist()
    assert sorted(seen) == [0, 0, 1, 1, 2, 2, 3, 3]
    latents, cond = collate([cache[0], cache[1]], sequence_keys=("c_crossattn",))
    assert cond["c_crossattn"].shape == (2, 154, 8)


def test_settings_reject_bad_values_with_field_names():
    with pytest.raises(LeanLoRAError, match="batch_size"):
        MemorySettings(batch_size=0)
    with pytest.raises(LeanLoRAError, match="mixed_precision"):
        MemorySettings(mixed_precision="fp8")
    with pytest.raises(LeanLoRAError, match="rank"):
        LoraSettings(rank=0)
    assert MemorySettings(batch_size=2, gradient_accumulation=3).effective_batch == 6


def test_job_manager_runs_one_job_and_hands_errors_back():
    manager = node_module("jobs").JobManager()
    release = threading.Event()
    job = manager.start(lambda j: release.wait(5) and "done")
    with pytest.raises(Exception, match="still running") as refused:
        manager.start(lambda j: None)
    assert type(refused.value).__name__ == "LeanLoRAError"  # the pack's own copy of the class
    release.set()
    assert job.done.wait(5) and job.result == "done"
    failing = manager.start(lambda j: 1 / 0)
    assert failing.done.wait(5) and isinstance(failing.error, ZeroDivisionError)


def test_job_cancel_is_seen_by_the_job():
    manager = node_module("jobs").JobManager()

    def work(job):
        steps = 0
        while not job.cancelled and steps < 1000:
            job.emit(kind="step", step=steps)
            steps += 1
            time.sleep(0.01)
        return steps
    job = manager.start(work)
    time.sleep(0.1)
    job.cancel()
    assert job.done.wait(2) and job.result < 1000
    assert job.drain()


def test_cancel_raised_inside_a_step_ends_the_run_like_a_cancel():
    from trainer.errors import TrainingCancelled
    net, params, data, _ = regression_problem()
    calls = []

    def loss_fn(batch):
        if len(calls) == 3:
            raise TrainingCancelled()
        return torch.nn.functional.mse_loss(net(batch[0]), batch[1])
    result = train_loop(StepParts(params, loss_fn, torch.optim.AdamW(params), Precision("no", torch.device("cpu"))),
                        data, 100, loop_events(on_step=calls.append))
    assert result.cancelled and result.steps_done == 3
    assert all(p.grad is None for p in params)


def test_memory_ladder_order_keeps_effective_batch():
    from trainer.memory.ladder import next_rung
    memory = MemorySettings("no", False, batch_size=4, gradient_accumulation=2, optimizer="AdamW")
    steps = []
    while (rung := next_rung(memory, torch.device("cpu"))) is not None:
        memory, description = rung
        steps.append(description.split(" ")[0:2])
        assert memory.effective_batch == 8
    assert [s[0] for s in steps] == ["batch", "mixed", *["gradient"] * 5, "optimizer", "frozen"]
    assert (memory.batch_size, memory.mixed_precision, memory.gradient_checkpointing, memory.optimizer,
            memory.base_weights) == (1, "bf16", True, "AdamW8bit", BaseWeights.FP8)


def test_memory_ladder_on_cuda_ends_with_offload_then_streaming_a_fifth_of_the_weights_at_a_time():
    from trainer.memory.ladder import next_rung
    memory = MemorySettings("bf16", True, optimizer="AdamW8bit", base_weights="fp8")
    memory, first = next_rung(memory, torch.device("cuda"))
    assert memory.activation_offload and first.startswith("activations")
    shares = []
    while (rung := next_rung(memory, torch.device("cuda"))) is not None:
        memory, description = rung
        assert memory.base_weights is BaseWeights.FP8_STREAMED and "streamed" in description
        shares.append(memory.stream_share)
    assert shares == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert "20% of them" in MemorySettings(base_weights="fp8_streamed", stream_share=0.2).describe()
    assert "% of them" not in MemorySettings(base_weights="fp8_streamed").describe()


def test_estimate_static_terms_are_exact_counts():
    from trainer.memory.estimate import fit_line, static_terms
    from trainer.optimizers import build_optimizer
    net = TinyNet()
    params = inject_lora(net, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
    estimate = static_terms(net, params, "AdamW")
    frozen = [p for p in net.parameters() if not p.requires_grad]
    assert estimate.frozen_weights == sum(p.numel() * 4 for p in frozen)
    assert estimate.lora_parameters == estimate.gradients == sum(p.numel() * 4 for p in params)
    optimizer, _ = build_optimizer("AdamW", params, 1e-3, device=torch.device("cpu"))
    net(torch.randn(2, 5, 16)).pow(2).mean().backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    assert estimate.optimizer_state == state
    assert estimate.total is None and "n/a (not measured)" in estimate.format()  # activations are probed on CUDA only
    assert fit_line([(1, 3), (3, 7)]) == (1.0, 2.0)


def test_bucketed_batches_are_never_padded_and_cover_every_sample():
    shapes = [(4, 8, 4), (4, 4, 8), (4, 8, 4), (4, 6, 6), (4, 8, 4)]  # three buckets, one of three samples
    cache = [CachedSample(torch.full((1, *shape), float(i)), {"c_crossattn": torch.zeros(1, 77, 8)})
             for i, shape in enumerate(shapes)]
    stream = batches(cache, batch_size=2, repeats=1, generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(4):  # one epoch: bucket (8,4) -> batches of 2 + 1, the others -> 1 each
        latents, cond = next(stream)
        assert latents.shape[1:] in {(4, 8, 4), (4, 4, 8), (4, 6, 6)}  # one bucket per batch, no padding
        assert cond["c_crossattn"].shape[0] == latents.shape[0]
        seen += [int(v) for v in latents[:, 0, 0, 0]]
        assert all(shapes[i] == tuple(latents.shape[1:]) for i in latents[:, 0, 0, 0].int().tolist())
    assert sorted(seen) == [0, 1, 2, 3, 4]


def test_reading_losses_every_n_steps_changes_nothing_but_the_syncs():
    runs = []
    for sync_every in (1, 4):
        net, params, data, _ = regression_problem()
        seen = []
        result = train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]), b[1]),
                                      torch.optim.AdamW(params, lr=1e-2), Precision("no", torch.device("cpu")), 2),
                            data, 10, loop_events(on_step=seen.append, sync_every=sync_every))
        assert [info.step for info in seen] == list(range(1, 11)) and result.steps_done == 10
        runs.append((result.losses, [p.detach().clone() for p in params]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_an_error_mid_run_still_reports_every_applied_step():
    net, params, data, _ = regression_problem()
    seen, calls = [], []

    def loss_fn(batch):
        calls.append(1)
        if len(calls) == 7:
            raise torch.OutOfMemoryError("simulated")
        return torch.nn.functional.mse_loss(net(batch[0]), batch[1])
    with pytest.raises(torch.OutOfMemoryError):
        train_loop(StepParts(params, loss_fn, torch.optim.AdamW(params), Precision("no", torch.device("cpu"))), data,
                   20, loop_events(on_step=seen.append, sync_every=5))
    assert [info.step for info in seen] == [1, 2, 3, 4, 5, 6]  # step 7 failed; 6 was applied and is reported


def test_lr_schedule_follows_diffusers_and_survives_an_optimizer_rebuild():
    from trainer.optimizers import build_lr_schedule
    net, params, data, _ = regression_problem()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    schedule = build_lr_schedule(optimizer, "cosine", warmup_steps=2, total_steps=10)
    seen = []
    train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]), b[1]), optimizer,
                         Precision("no", torch.device("cpu")), lr_schedule=schedule), data, 10,
               loop_events(on_step=seen.append))
    rates = [info.lr for info in seen]
    assert rates[0] == 0.0 and rates[1] == pytest.approx(5e-3) and rates[2] == pytest.approx(1e-2)  # warm-up
    assert rates[3] > rates[6] > rates[9] > 0  # cosine decay
    rebuilt = torch.optim.AdamW(params, lr=1e-2)  # e.g. OOM recovery switched optimizers after step 6
    build_lr_schedule(rebuilt, "cosine", warmup_steps=2, total_steps=10, done_steps=6)
    assert rebuilt.param_groups[0]["lr"] == pytest.approx(rates[6])
    assert TrainSettings(10, 1e-3, lr_schedule="constant", warmup_steps=0).lr_schedule == "constant"
    with pytest.raises(LeanLoRAError, match="warmup_steps"):
        TrainSettings(10, 1e-3, warmup_steps=10)


def test_allocators_without_peak_statistics_skip_measurements_instead_of_failing(monkeypatch):
    """ComfyUI runs PyTorch on cudaMallocAsync by default; a build without its peak stats must not break runs."""
    from trainer.memory.estimate import MemoryEstimate, probe_activations
    from trainer.device.vram import device_memory_gib

    def unsupported(*args, **kwargs):
        raise RuntimeError("not supported by the cudaMallocAsync allocator")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, unsupported)
    estimate = MemoryEstimate(1, 2, 2, 4)
    probe = probe_activations(estimate, lambda batch: pytest.fail("probed"), (None, None), 1, torch.device("cuda"))
    assert probe.activations is None and "n/a" in probe.format()
    assert device_memory_gib(torch.device("cuda")) is None


def _simulate_cuda_allocator(monkeypatch, ledger: dict) -> None:
    """torch.cuda's memory statistics read from `ledger` ("alloc", "peak"), which the test's step updates."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: ledger["alloc"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: ledger["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: ledger.update(peak=ledger["alloc"]))


def test_estimate_probes_separate_activations_workspace_and_memory_held_outside_training(monkeypatch):
    """The probe arithmetic against a simulated allocator: the first step allocates a library workspace that
    stays (cuBLAS does), each step's transient memory is gradients + fixed workspace + a per-pixel activation
    rate. The estimate must recover each term exactly, with gradients allocated in backward or kept (flat)."""
    from trainer.memory.estimate import MemoryEstimate, probe_activations
    mib = 2 ** 20
    weights, lora, grads, state, library, fixed, per_pixel = 900 * mib, 20 * mib, 20 * mib, 0, 64 * mib, 30 * mib, 5000
    for kept in (0, grads):
        ledger = {"alloc": weights + lora + kept + 7 * mib, "peak": 0, "steps": 0}  # 7 MiB held by others
        _simulate_cuda_allocator(monkeypatch, ledger)

        def step(batch):
            if ledger["steps"] == 0:
                ledger["alloc"] += library  # allocated on first use, never freed
            ledger["steps"] += 1
            area = batch[0].shape[-2] * batch[0].shape[-1]
            ledger["peak"] = max(ledger["peak"], ledger["alloc"] + (grads - kept) + fixed + per_pixel * area)

        latent = torch.zeros(1, 4, 64, 48)
        estimate = probe_activations(MemoryEstimate(weights, lora, grads, state), step, (latent, {}), 2,
                                     torch.device("cuda"), gradients_kept=kept)
        assert estimate.activations == per_pixel * 64 * 48 * 2  # batch 2
        assert estimate.workspace == fixed
        assert estimate.other == library + 7 * mib
        assert estimate.total == weights + lora + grads + state + per_pixel * 64 * 48 * 2 + fixed + library + 7 * mib


def test_a_compiled_run_is_probed_once_at_its_own_batch_shape(monkeypatch):
    """Compiled blocks are specialized to shapes: the estimate probes only the run's batch at full size (a smaller
    probe would cost a second full compile) and gets the same total as the two-probe line, with activations and
    workspace measured together."""
    from trainer.memory.estimate import MemoryEstimate, probe_activations
    mib = 2 ** 20
    weights, lora, grads, fixed, per_pixel = 900 * mib, 20 * mib, 20 * mib, 30 * mib, 5000
    ledger = {"alloc": weights + lora, "peak": 0}
    _simulate_cuda_allocator(monkeypatch, ledger)
    shapes = []

    def step(batch):
        shapes.append(tuple(batch[0].shape))
        batch_size, area = batch[0].shape[0], batch[0].shape[-2] * batch[0].shape[-1]
        ledger["peak"] = max(ledger["peak"], ledger["alloc"] + grads + fixed + per_pixel * area * batch_size)

    line = probe_activations(MemoryEstimate(weights, lora, grads, 0), step, (torch.zeros(1, 4, 64, 48), {}), 3,
                             torch.device("cuda"))
    assert shapes == [(1, 4, 32, 24), (1, 4, 64, 48)]
    shapes.clear()
    once = probe_activations(MemoryEstimate(weights, lora, grads, 0), step, (torch.zeros(3, 4, 64, 48), {}), 3,
                             torch.device("cuda"), at_run_shape=True)
    assert shapes == [(3, 4, 64, 48)]
    assert once.activations == fixed + per_pixel * 64 * 48 * 3 and once.workspace == 0
    assert once.total == line.total
    assert "activations + workspace" in once.format() and "activations + workspace" not in line.format()


def test_norms_stay_in_the_compute_dtype_under_autocast():
    from trainer.step.precision import norms_in_compute_dtype
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.GroupNorm(4, 16), torch.nn.SiLU(), torch.nn.Conv2d(16, 8, 1))
    x = torch.randn(2, 16, 8, 8)
    with torch.no_grad():
        reference = net(x)  # fp32, no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = net[0](x)
    assert plain.dtype == torch.float32  # what autocast does by itself: an fp32 copy per norm
    assert norms_in_compute_dtype(net) == 1 and norms_in_compute_dtype(net) == 0  # installed once
    with torch.autocast("cpu", dtype=torch.bfloat16):
        halved = net[0](x)
        out = net(x)
    assert halved.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, atol=5e-2, rtol=5e-2)
    assert torch.equal(net(x), reference) or torch.allclose(net(x), reference)  # outside autocast: unchanged


def test_out_of_memory_is_recognized_in_each_form_a_training_step_meets():
    from trainer.errors import is_out_of_memory
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("Error: out of memory (bitsandbytes paged optimizer)"))
    # cuBLAS creating a handle or workspace on a full card: freeing memory and retrying works
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(ValueError("mat1 and mat2 shapes cannot be multiplied"))


def test_split_geglu_computes_comfyuis_geglu_and_leaves_per_call_cast_projections_alone(monkeypatch):
    """The compiled layers' GEGLU projects value and gate with two matmuls on slices of the same frozen weight
    (backward then needs no concatenation): same output and input gradient as ComfyUI's GEGLU; a projection whose
    weight is computed per call (fp8, LoRA patches) keeps ComfyUI's forward."""
    from comfy.ldm.modules.attention import GEGLU
    from bridge.families.sd_unet import _split_geglu_forward
    g = torch.Generator().manual_seed(0)
    geglu = GEGLU(16, 24)
    geglu.proj.weight.data = torch.randn(48, 16, generator=g) / 4
    geglu.proj.bias.data = torch.randn(48, generator=g)
    geglu.requires_grad_(False)
    x = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    expected = GEGLU.forward(geglu, x)
    expected_grad, = torch.autograd.grad(expected.square().sum(), x)
    calls = []
    original = GEGLU.forward
    monkeypatch.setattr(GEGLU, "forward", lambda self, x: calls.append(1) or original(self, x))
    split = _split_geglu_forward(geglu, x)
    split_grad, = torch.autograd.grad(split.square().sum(), x)
    assert not calls
    torch.testing.assert_close(split, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_grad, expected_grad, rtol=1e-5, atol=1e-5)
    geglu.proj.comfy_cast_weights = True  # e.g. fp8 storage: the weight is made per call
    torch.testing.assert_close(_split_geglu_forward(geglu, x), expected)
    geglu.proj.comfy_cast_weights = False
    geglu.proj.weight_function = [lambda weight: weight * 2]  # e.g. a LoRA patch applied per call
    _split_geglu_forward(geglu, x)
    del geglu.proj.weight_function
    assert calls == [1, 1]
    holder = torch.nn.Module()  # a LoRA on the projection (targets "attention+feed-forward"): peft wraps it
    holder.ff = torch.nn.Module()
    holder.ff.net = torch.nn.Sequential(geglu)
    inject_lora(holder, LoraSettings(rank=2, targets="attention+feed-forward"), seed=0, target_modules=sd_targets(LoraSettings(rank=2, targets="attention+feed-forward")))
    assert not isinstance(geglu.proj, torch.nn.Linear)
    _split_geglu_forward(geglu, x)
    assert calls == [1, 1, 1]


def test_compile_leaves_the_resblocks_of_the_widest_level_eager(comfy_objects):
    """Every ResBlock shape costs a cold compile of its own; at the UNet's widest channel count (its smallest images)
    compiling gains least (campaign 9, SDXL: 28 s of compiling for 1% of a batch-8 step). prepare_compile_units
    leaves those ResBlocks out, keeps the others and every transformer layer, and keeps all ResBlocks of a
    one-width UNet (the tiny checkpoint's)."""
    import comfy.ops
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock, UNetModel
    from bridge.comfy_adapter import ComfyAdapter
    adapter = ComfyAdapter(*comfy_objects)
    two_widths = UNetModel(image_size=8, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[1, 1],
                           channel_mult=[1, 2], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
                           transformer_depth_middle=1, context_dim=16, num_head_channels=16,
                           use_spatial_transformer=True, use_linear_in_transformer=True, adm_in_channels=None,
                           operations=comfy.ops.disable_weight_init, device="cpu")
    units = adapter.prepare_compile_units(two_widths)
    resblocks = [m for m in two_widths.modules() if isinstance(m, ResBlock)]
    assert {m.out_channels for m in resblocks} == {32, 64}
    assert [m for m in units if isinstance(m, ResBlock)] == [m for m in resblocks if m.out_channels == 32]
    layers = [m for m in two_widths.modules() if isinstance(m, BasicTransformerBlock)]
    assert [m for m in units if isinstance(m, BasicTransformerBlock)] == layers and layers
    one_width = adapter.training_unet()
    assert {m for m in adapter.prepare_compile_units(one_width) if isinstance(m, ResBlock)} \
        == {m for m in one_width.modules() if isinstance(m, ResBlock)} != set()


def test_compile_preparation_splits_geglus_only_for_whole_layers(comfy_objects):
    """prepare_compile_units installs the split GEGLU with whole transformer layers, not with the older
    "modules" scope (whose feed-forward modules compile as they are)."""
    from comfy.ldm.modules.attention import GEGLU
    from bridge.comfy_adapter import ComfyAdapter
    from bridge.families.sd_unet import _split_geglu_forward
    adapter = ComfyAdapter(*comfy_objects)
    for scope, split in (("modules", False), ("layers", True)):
        unet = adapter.training_unet()
        adapter.prepare_compile_units(unet, scope=scope)
        geglus = [m for m in unet.modules() if isinstance(m, GEGLU)]
        assert geglus and all((getattr(m.forward, "__func__", None) is _split_geglu_forward) == split for m in geglus)
    assert not any(getattr(m.forward, "__func__", None) is _split_geglu_forward
                   for m in adapter.base.diffusion_model.modules() if isinstance(m, GEGLU))  # the user's model


class _FailedCapture:
    """What torch.cuda.CUDAGraph's pool() does after a capture: raises unless the capture ended well."""

    def __init__(self, ended_well: bool):
        self.ended_well = ended_well

    def pool(self):
        if not self.ended_well:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return (0, 7)


@pytest.mark.parametrize("ended_well,has_instantiate,released", [
    (False, True, True),    # CUDA ended the capture with an error: the pool is ours to give back
    (True, True, False),    # ended well: the graph's destructor releases it; a second release aborts the process
    (False, False, False),  # an older PyTorch whose destructor may release it after a failed instantiate: keep it
])
def test_a_failed_captures_pool_is_given_back_only_where_the_graph_will_not_release_it(
        monkeypatch, ended_well, has_instantiate, released):
    from trainer.step import micro_steps
    calls = []
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        monkeypatch.setattr(torch._C, name, lambda index, pool, name=name: calls.append((name, index, pool)),
                            raising=False)
    # PyTorch >= the keep_graph era has CUDAGraph.instantiate; an older one is stood in by a class without it
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("CUDAGraph", (), {"instantiate": lambda self: None}
                                                      if has_instantiate else {}))
    micro_steps._give_back_failed_capture_pool(torch.device("cuda", 0), _FailedCapture(ended_well), (0, 7))
    expected = [("_cuda_endAllocateToPool", 0, (0, 7)), ("_cuda_releasePool", 0, (0, 7))] if released else []
    assert calls == expected


@pytest.mark.parametrize("draw_error, capture_error, expected", [
    (None, None, True),  # the capture failed in Python: torch.cuda.graph ended the generator's capture itself
    ("Offset increment outside graph capture encountered unexpectedly.", None, True),  # ended by a small capture
    ("Offset increment outside graph capture encountered unexpectedly.",
     "Only one capture at a time is allowed in a process.", False),  # refused: the report says so
])
def test_a_failed_capture_leaves_the_gpus_random_generator_usable_or_says_it_cannot(
        monkeypatch, draw_error, capture_error, expected):
    """After a capture CUDA ended with an error PyTorch leaves the GPU's generator in capture mode and every GPU
    random draw in the process fails (ComfyUI's GPU noise): a small capture that ends well ends it (on the GPU:
    tests/cuda_allocator_cases.py, capture_broken_by_cuda_gives_its_pool_back)."""
    import contextlib
    from trainer.step import micro_steps
    captured = []

    class Draw:
        def uniform_(self):
            if draw_error:
                raise RuntimeError(draw_error)

    @contextlib.contextmanager
    def graph(g, stream=None):
        if capture_error:
            raise RuntimeError(capture_error)
        captured.append(stream)
        yield

    monkeypatch.setattr(torch, "empty", lambda *a, **k: Draw())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    assert micro_steps._end_random_generator_capture(torch.device("cpu"), "side") is expected
    assert captured == (["side"] if draw_error and not capture_error else [])


def test_a_failed_random_draw_for_another_reason_is_not_hidden(monkeypatch):
    from trainer.step import micro_steps

    class Draw:
        def uniform_(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "empty", lambda *a, **k: Draw())
    with pytest.raises(RuntimeError, match="illegal memory access"):
        micro_steps._end_random_generator_capture(torch.device("cpu"), "side")
