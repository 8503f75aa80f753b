"""train_lora with the real ComfyUI objects in this process (no server): OOM recovery and fp8 storage."""

import re
from dataclasses import replace

import pytest
import torch

from trainer.dataset import scan_folder
from trainer.errors import LeanLoRAError
from bridge.cast_weights import store_weights_fp8
from trainer.step.frozen_weights import FP8, frozen_weight_bytes
from trainer.settings import Attention, BaseWeights, CheckpointDepth, LoraSettings, LoraWeights, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from helpers import sd_targets  # noqa: E402


def test_the_comfy_adapter_implements_the_model_adapter_protocol(adapter):
    from test_pure_torch_training import protocol_members
    from trainer.model import ModelAdapter
    assert not protocol_members(ModelAdapter) - set(dir(adapter))


def _oom_when(adapter, condition):
    """Makes the adapter's forward raise CUDA's OOM error whenever condition(x, unet) holds."""
    predict = adapter.predict
    calls = {"n": 0, "raised": 0}

    def flaky(unet, x, t, cond):
        calls["n"] += 1
        if condition(calls, x, unet):
            calls["raised"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return predict(unet, x, t, cond)
    adapter.predict = flaky
    return calls


def _run(adapter, dataset, memory, tmp_path, steps=8, name="run", emit=lambda **event: None):
    return train_lora(adapter, dataset, memory, LoraSettings(rank=4, alpha=4.0), TrainSettings(steps, 1e-3, 0, name),
                      tmp_path, emit, lambda: False)


def test_oom_on_step_k_recovers_and_finishes(adapter, dataset, tmp_path):
    # Out of memory on the 4th forward while the batch is 2, then again while checkpointing is off.
    calls = _oom_when(adapter, lambda c, x, unet: (c["n"] == 4 and x.shape[0] == 2) or (c["n"] == 9 and c["raised"] == 1))
    outcome = _run(adapter, dataset, MemorySettings("no", False, batch_size=2, gradient_accumulation=1), tmp_path)
    assert calls["raised"] == 2
    assert len(outcome.losses) == 8 and not outcome.partial
    assert outcome.lora_path.name == "run.safetensors"
    assert outcome.recoveries[0].startswith("step 4: out of memory -> batch 2 -> 1 with gradient accumulation 2")
    assert "mixed precision off" in outcome.recoveries[1]
    assert "memory recoveries (2)" in outcome.report and "effective batch 2" in outcome.report


def test_cublas_failing_to_allocate_is_recovered_like_out_of_memory(adapter, dataset, tmp_path):
    predict, calls = adapter.predict, {"n": 0}

    def flaky(unet, x, t, cond):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return predict(unet, x, t, cond)
    adapter.predict = flaky
    outcome = _run(adapter, dataset, MemorySettings("no", False, batch_size=2, gradient_accumulation=1), tmp_path,
                   steps=4, name="cublas")
    assert len(outcome.losses) == 4 and not outcome.partial
    assert outcome.recoveries[0].startswith("step 3: out of memory -> batch 2 -> 1")


def test_oom_with_no_rung_left_keeps_a_partial_lora(adapter, dataset, tmp_path):
    _oom_when(adapter, lambda c, x, unet: c["n"] > 3)
    lean = MemorySettings("bf16", True, 1, 1, optimizer="AdamW8bit", base_weights="fp8")
    with pytest.raises(LeanLoRAError, match=r"out of GPU memory.*saved as .*oom_partial_step3\.safetensors"):
        _run(adapter, dataset, lean, tmp_path, name="oom")
    assert (tmp_path / "oom_partial_step3.safetensors").is_file()


def test_fp8_storage_quarters_fp32_weights_and_stays_close(adapter):
    unet = adapter.training_unet()
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([500.0])
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1)) * 0.1}
    with torch.no_grad():
        reference = adapter.predict(unet, x, t, cond)
    before = frozen_weight_bytes(unet)
    saved = store_weights_fp8(unet)
    after = frozen_weight_bytes(unet)
    assert saved == before - after and after < 0.35 * before
    assert unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q.weight.dtype == FP8
    with torch.no_grad():
        out = adapter.predict(unet, x, t, cond)
    relative = (out - reference).norm() / reference.norm()
    # e4m3 keeps 3 mantissa bits (~3.6% rms rounding per weight); through ~20 random layers that is ~9%.
    assert relative < 0.15, relative


def test_fp8_run_trains(adapter, dataset, tmp_path, monkeypatch):
    """Also where the fused upcast cannot be compiled (a GPU box without Triton): driven on CPU here."""
    from trainer.step import frozen_weights
    upcast = frozen_weights.FusedUpcast(devices=("cpu",))  # the CUDA-only path, driven on CPU
    monkeypatch.setattr(frozen_weights, "_FUSED_UPCAST", upcast)

    def no_triton(*args):
        raise RuntimeError("Cannot find a working triton installation")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: no_triton)
    outcome = _run(adapter, dataset, MemorySettings("bf16", True, 2, 1, base_weights="fp8"), tmp_path, steps=20, name="fp8")
    assert "frozen weights stored as fp8" in outcome.report
    assert upcast.kernel is False
    assert "fused upcast kernel could not be compiled here (RuntimeError: Cannot find a working triton" in outcome.report
    assert sum(outcome.losses[-10:]) < sum(outcome.losses[:10])


def _saved_bytes_in_forward(adapter, unet):
    """Bytes autograd keeps for backward outside checkpointed regions, over one forward of the real UNet."""
    total = []

    def pack(tensor):
        total.append(tensor.numel() * tensor.element_size())
        return tensor
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = adapter.predict(unet, x, torch.tensor([300.0]), cond)
    out.float().pow(2).mean().backward()
    return sum(total)


def test_gradient_checkpointing_really_wraps_comfyui_unet_layers(adapter):
    from trainer.step.checkpointing import checkpoint_blocks
    from trainer.lora import inject_lora
    plain, checkpointed = adapter.training_unet(), adapter.training_unet()
    for unet in (plain, checkpointed):
        inject_lora(unet, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
    units = adapter.checkpoint_blocks(checkpointed)
    assert checkpoint_blocks(units) == len(units) >= 4  # ResBlocks and transformer layers
    saved_plain, saved_checkpointed = _saved_bytes_in_forward(adapter, plain), _saved_bytes_in_forward(adapter, checkpointed)
    assert saved_checkpointed < 0.5 * saved_plain, (saved_checkpointed, saved_plain)


def test_checkpoint_depth_per_block_saves_less_and_computes_the_same(adapter):
    """Per block: the whole SpatialTransformer (norm, projections and layers) is one recomputed unit, so fewer
    tensors stay saved than per layer; gradients are the same."""
    from trainer.step.checkpointing import checkpoint_blocks
    from trainer.lora import inject_lora
    unets = {depth: adapter.training_unet() for depth in CheckpointDepth}
    grads = {}
    for depth, unet in unets.items():
        params = inject_lora(unet, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
        for p in params:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
        units = adapter.checkpoint_blocks(unet, depth)
        checkpoint_blocks(units)
        grads[depth] = (_saved_bytes_in_forward(adapter, unet), [p.grad.clone() for p in params], len(units))
    (layer_bytes, layer_grads, layer_units), (block_bytes, block_grads, block_units) = grads.values()
    assert block_units <= layer_units and block_bytes < layer_bytes, (block_bytes, layer_bytes)
    for a, b in zip(layer_grads, block_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_streamed_weights_stay_in_cpu_memory_and_compute_the_same(adapter, monkeypatch):
    import comfy.ops
    from bridge.cast_weights import projected_weight_bytes, store_weights_fp8, stream_weights_from_cpu
    from trainer.step.frozen_weights import device_bound
    from trainer.lora import inject_lora
    unet = adapter.training_unet()
    params = inject_lora(unet, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    as_loaded = projected_weight_bytes(unet, torch.float32, BaseWeights.AS_LOADED)
    assert as_loaded == frozen_weight_bytes(unet)
    fp8_projection = projected_weight_bytes(unet, torch.float32, BaseWeights.FP8)
    assert fp8_projection < 0.3 * as_loaded
    streamed_projection = projected_weight_bytes(unet, torch.float32, BaseWeights.FP8_STREAMED)
    store_weights_fp8(unet)
    assert frozen_weight_bytes(unet) == fp8_projection  # the 4-byte scale of each layer included
    with torch.no_grad():
        reference = adapter.predict(unet, x, torch.tensor([500.0]), cond)
    kept_off = stream_weights_from_cpu(unet)
    assert streamed_projection < 0.02 * as_loaded and kept_off > 0.9 * fp8_projection
    # The streamed layers copy on the current stream, never through ComfyUI's generic cast and its offload
    # streams: under cudaMallocAsync that cast's frees broke CUDA-graph capture (a server abort, H200).
    generic_casts = []
    real_cast = comfy.ops.cast_bias_weight
    monkeypatch.setattr(comfy.ops, "cast_bias_weight", lambda s, *a, **k: generic_casts.append(s) or real_cast(s, *a, **k))
    with torch.no_grad():
        assert torch.equal(adapter.predict(unet, x, torch.tensor([500.0]), cond), reference)
    assert not any(getattr(layer, "leanlora_streamed", False) for layer in generic_casts)
    bound = {id(t) for t in device_bound(unet)}  # what place_on_device would move to the GPU
    to_q = unet.input_blocks[1][1].transformer_blocks[0].attn1.to_q.base_layer
    assert to_q.leanlora_streamed and id(to_q.weight) not in bound
    norm = unet.input_blocks[1][1].transformer_blocks[0].norm1
    assert not getattr(norm, "leanlora_streamed", False) and id(norm.weight) in bound  # norms stay: a few MB
    assert all(id(p) in bound for p in params)
    frozen_bound = [t for t in device_bound(unet) if not t.requires_grad]
    assert sum(t.numel() * t.element_size() for t in frozen_bound) == streamed_projection  # scales included


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_fp8_upcasts_grouped_per_block_compute_what_per_layer_upcasts_compute_in_forward_and_recompute(adapter,
                                                                                                       monkeypatch,
                                                                                                       autocast):
    """Bit for bit, fp32 and under bf16 autocast (where the CPU's _foreach_mul_ would have rounded each conv's scale
    to bf16 first)."""
    import contextlib
    import copy
    import bridge.cast_weights as cast_weights
    from trainer.step.checkpointing import checkpoint_blocks
    from trainer.lora import inject_lora
    unet = adapter.training_unet()
    params = inject_lora(unet, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
    with torch.no_grad():
        for p in params:  # LoRA up-weights start at zero: make the gradients of the down-weights non-zero too
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    store_weights_fp8(unet)
    per_layer = copy.deepcopy(unet)
    adapter.group_upcasts(unet)
    for model in (unet, per_layer):
        checkpoint_blocks(adapter.checkpoint_blocks(model), preserve_rng_state=False)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    grouped_calls, scaled_shapes, per_layer_calls = [], [], []
    real_foreach_copy, real_scale_copies, real_dequantize = torch._foreach_copy_, cast_weights._scale_copies, \
        cast_weights.dequantize
    monkeypatch.setattr(torch, "_foreach_copy_", lambda out, src: grouped_calls.append(len(out)) or real_foreach_copy(out, src))
    monkeypatch.setattr(cast_weights, "_scale_copies", lambda out, scales: scaled_shapes.extend(w.dim() for w in out)
                        or real_scale_copies(out, scales))
    monkeypatch.setattr(cast_weights, "dequantize", lambda *a: per_layer_calls.append(1) or real_dequantize(*a))
    real_scale_in_gemm = cast_weights._scale_in_gemm

    def linear_scaled_in_its_gemm(layer):  # a per-layer Linear's exact upcast (scale in the GEMM) counts too
        scaled = real_scale_in_gemm(layer)
        per_layer_calls.extend([1] if scaled and not cast_weights._ACTIVE_GROUPS else [])
        return scaled
    monkeypatch.setattr(cast_weights, "_scale_in_gemm", linear_scaled_in_its_gemm)

    def run(model):
        grouped_calls.clear(), scaled_shapes.clear(), per_layer_calls.clear()
        with torch.autocast("cpu", autocast) if autocast else contextlib.nullcontext():
            out = adapter.predict(model, x, torch.tensor([500.0]), cond)
        out.float().square().mean().backward()
        grads = [p.grad.clone() for n, p in model.named_parameters() if p.requires_grad]
        return out.detach(), grads, list(grouped_calls), len(per_layer_calls)

    reference, reference_grads, none, reference_single = run(per_layer)
    output, grads, grouped, single = run(unet)
    assert not none and reference_single > 0
    assert torch.equal(output, reference)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference_grads)) and len(grads) == len(reference_grads)
    assert scaled_shapes and set(scaled_shapes) == {4}  # Linear layers' copies stay unscaled (their GEMM's alpha)
    # every block upcast once in forward and once in its recompute (the first ResBlock, with no LoRA and no gradient
    # flowing into it, is never recomputed); only the layers outside blocks one by one
    groups = {id(m.leanlora_upcast_group): m.leanlora_upcast_group for m in unet.modules()
              if getattr(m, "leanlora_upcast_group", None) is not None}
    assert 2 * len(groups) - 1 <= len(grouped) <= 2 * len(groups) and max(grouped) > 1
    assert single < reference_single - sum(grouped) + len(grouped)
    assert not cast_weights._ACTIVE_GROUPS
    assert all(not group.ready for group in groups.values())


def test_an_fp8_linear_takes_its_scale_in_the_gemm_and_inside_compiled_code_the_fused_upcast(adapter, monkeypatch):
    """One kernel per Linear weight (the exact cast; the scale is the GEMM's alpha) in eager steps and graphs alike,
    so both train the same numbers. Inside compiled code inductor fuses the scale into the upcast instead."""
    import comfy.ops
    import bridge.cast_weights as cast_weights
    generator = torch.Generator().manual_seed(0)
    layer = comfy.ops.disable_weight_init.Linear(16, 8)
    layer.weight = torch.nn.Parameter(torch.randn(8, 16, generator=generator) * 0.02, requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(8, generator=generator), requires_grad=False)
    store_weights_fp8(layer)
    x = torch.randn(2, 3, 16, generator=generator)
    reference = torch.nn.functional.linear(x, layer.weight.float() * layer.leanlora_fp8_scale_value, layer.bias)
    gemm_scaled, dequantized = [], []
    real_scaled_linear, real_dequantize = cast_weights.scaled_linear, cast_weights.dequantize
    monkeypatch.setattr(cast_weights, "scaled_linear", lambda *a: gemm_scaled.append(1) or real_scaled_linear(*a))
    monkeypatch.setattr(cast_weights, "dequantize", lambda *a: dequantized.append(1) or real_dequantize(*a))
    eager = layer(x)
    torch.testing.assert_close(eager, reference)
    assert gemm_scaled == [1] and not dequantized
    # where the compiled upcast runs (a graph's capture under the native allocator) the Linear's numbers are the
    # eager step's, bit for bit: graphed steps train what eager steps train
    from trainer.step import frozen_weights
    fused = frozen_weights.FusedUpcast(devices=("cpu",))
    fused.kernel = frozen_weights._dequantize_fused
    monkeypatch.setattr(frozen_weights, "_FUSED_UPCAST", fused)
    assert torch.equal(layer(x), eager) and gemm_scaled == [1, 1] and not dequantized
    gemm_scaled.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as dynamo traces the layer
    torch.testing.assert_close(layer(x), reference)
    assert not gemm_scaled and dequantized == [1]


def test_a_block_that_fails_part_way_keeps_none_of_its_grouped_upcasts(adapter):
    import bridge.cast_weights as cast_weights
    unet = adapter.training_unet()
    store_weights_fp8(unet)
    adapter.group_upcasts(unet)
    block = next(m for m in unet.modules() if getattr(m.forward, "leanlora_upcast_group", None) is not None)
    group = block.forward.leanlora_upcast_group
    first = group.layers[0]
    real = first.forward_comfy_cast_weights

    def fails_after_upcasting(input):
        real(input)
        assert group.ready  # the other members' upcasts wait for them
        raise RuntimeError("out of memory (test)")
    first.forward_comfy_cast_weights = fails_after_upcasting
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    with pytest.raises(RuntimeError, match="test"), torch.no_grad():
        adapter.predict(unet, x, torch.tensor([500.0]), cond)
    assert not group.ready and not cast_weights._ACTIVE_GROUPS


def test_a_stream_share_streams_the_largest_layers_up_to_that_share_and_its_projection_holds(adapter):
    from bridge.cast_weights import projected_weight_bytes, store_weights_fp8, stream_weights_from_cpu, streamed_layers
    from trainer.step.frozen_weights import device_bound
    from trainer.lora import inject_lora
    unet = adapter.training_unet()
    inject_lora(unet, LoraSettings(rank=4), seed=0, target_modules=sd_targets(LoraSettings(rank=4)))
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    projections = {share: projected_weight_bytes(unet, torch.float32, BaseWeights.FP8_STREAMED, share)
                   for share in (0.2, 0.4, 0.6, 0.8, 1.0)}
    fp8 = projected_weight_bytes(unet, torch.float32, BaseWeights.FP8)
    assert fp8 > projections[0.2] > projections[0.4] > projections[0.6] > projections[0.8] > projections[1.0]
    chosen = {share: streamed_layers(unet, share) for share in (0.2, 0.4, 1.0)}
    everything = sum(layer.weight.numel() for layer in chosen[1.0])
    for share in (0.2, 0.4):  # at least the share, and no layer more than needed to reach it
        numels = [layer.weight.numel() for layer in chosen[share]]
        assert sum(numels) >= share * everything > sum(numels) - min(numels)
        assert min(numels) >= max(layer.weight.numel() for layer in chosen[1.0] if layer not in chosen[share])
    assert {id(layer) for layer in chosen[0.2]} <= {id(layer) for layer in chosen[0.4]}  # more streams a superset
    store_weights_fp8(unet)
    with torch.no_grad():
        reference = adapter.predict(unet, x, torch.tensor([500.0]), cond)
    assert [id(layer) for layer in streamed_layers(unet, 0.4)] == [id(layer) for layer in chosen[0.4]]  # after fp8 too
    stream_weights_from_cpu(unet, 0.2)
    kept_off = stream_weights_from_cpu(unet, 0.4)  # a later rung streams more
    streamed = [layer for layer in unet.modules() if getattr(layer, "leanlora_streamed", False)]
    assert {id(layer) for layer in streamed} == {id(layer) for layer in chosen[0.4]}
    frozen_bound = [t for t in device_bound(unet) if not t.requires_grad]
    assert sum(t.numel() * t.element_size() for t in frozen_bound) == projections[0.4]  # scales included
    assert kept_off == pytest.approx(fp8 - projections[0.4], rel=0.02)
    with torch.no_grad():
        assert torch.equal(adapter.predict(unet, x, torch.tensor([500.0]), cond), reference)


@pytest.mark.parametrize("backend", [Attention.SDPA, Attention.SUB_QUADRATIC])
def test_attention_backends_compute_the_same_and_are_really_used(adapter, backend, monkeypatch):
    import comfy.ldm.modules.attention as comfy_attention
    unet = adapter.training_unet()
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        reference = adapter.predict(unet, x, torch.tensor([400.0]), cond)
    kernel_name = {Attention.SDPA: "attention_pytorch", Attention.SUB_QUADRATIC: "attention_sub_quad"}[backend]
    calls = []
    kernel = getattr(comfy_attention, kernel_name)
    monkeypatch.setattr(comfy_attention, kernel_name, lambda *a, **k: calls.append(1) or kernel(*a, **k))
    adapter.set_attention(backend)
    with torch.no_grad():
        out = adapter.predict(unet, x, torch.tensor([400.0]), cond)
    assert calls, f"{backend} was not used"
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)


def test_unusable_xformers_fails_before_any_work_with_a_clear_message(adapter, dataset, tmp_path):
    with pytest.raises(LeanLoRAError, match="attention: xformers is not usable here"):
        _run(adapter, dataset, MemorySettings(attention="xformers"), tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("memory", [MemorySettings("bf16", True, 2, 1, "AdamW8bit", BaseWeights.FP8_STREAMED),
                                    MemorySettings("fp16", False, 1, 2, "Lion", "fp8"),
                                    MemorySettings("bf16", True, 1, 2, "Lion8bit", "fp8", activation_offload=True),
                                    MemorySettings("bf16", False, 1, 1, "AdamW", lora_weights=LoraWeights.BF16_STOCHASTIC_ROUNDING)])
def test_the_base_model_is_bit_identical_after_training(adapter, comfy_objects, dataset, tmp_path, memory):
    model = comfy_objects[0]
    before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}
    patches_before = dict(model.patches)
    classes_before = [type(m) for m in model.model.diffusion_model.modules()]  # mixins go on the training copy only
    _run(adapter, dataset, memory, tmp_path, steps=3)
    assert [type(m) for m in model.model.diffusion_model.modules()] == classes_before
    after = model.model.diffusion_model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert dict(model.patches) == patches_before
    assert not any(hasattr(m, "leanlora_streamed") for m in model.model.diffusion_model.modules())


def test_training_targets_follow_the_models_own_prediction_type(comfy_objects):
    """eps models learn the noise, v models learn v = (noise - sigma * x0) / sqrt(1 + sigma^2), and a
    v_prediction patch from ComfyUI's ModelSamplingDiscrete node is what training sees."""
    from comfy_extras.nodes_model_advanced import ModelSamplingDiscrete
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.objective import output_target
    model, clip, vae = comfy_objects
    patched = ModelSamplingDiscrete().patch(model, "v_prediction", False)[0]
    eps_sampling = ComfyAdapter(model, clip, vae).model_sampling
    v_sampling = ComfyAdapter(patched, clip, vae).model_sampling
    g = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    sigma = torch.tensor([0.5, 7.0])
    noisy = eps_sampling.noise_scaling(sigma, noise.clone(), clean)
    torch.testing.assert_close(output_target(eps_sampling, sigma, noisy, clean), noise, rtol=1e-4, atol=1e-4)
    expected_v = (noise - sigma.view(-1, 1, 1, 1) * clean) / (1 + sigma.view(-1, 1, 1, 1) ** 2).sqrt()
    torch.testing.assert_close(output_target(v_sampling, sigma, noisy, clean), expected_v, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_model_trains_like_the_eager_one(adapter, dataset, tmp_path, checkpointing):
    """torch.compile of the real ComfyUI UNet's blocks on the CPU (inductor's C++ backend), with and without
    gradient checkpointing around them: the compile step runs before step 1 and is reported, blocks of equal
    shapes share compiled graphs, and the losses stay within fp32 reordering tolerance of the eager run."""
    from torch._dynamo.utils import counters
    # SDPA as on a GPU: ComfyUI's CPU default (sub-quadratic attention) asks psutil for free memory mid-forward,
    # which dynamo cannot trace (a graph break per attention call).
    settings = MemorySettings("no", checkpointing, 1, 1, attention=Attention.SDPA)
    eager = _run(adapter, dataset, settings, tmp_path, steps=3, name="eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(adapter, dataset, replace(settings, compile=True), tmp_path, steps=3, name="compiled")
    blocks = len(adapter.prepare_compile_units(adapter.training_unet()))
    assert f"torch.compile: the diffusion model's {blocks} blocks compiled in" in compiled.report, compiled.report
    built, loaded = map(int, re.search(r"\((\d+) graphs built, (\d+) loaded from inductor's disk cache",
                                       compiled.report).groups())
    assert built + loaded >= counters["stats"]["unique_graphs"] > 0  # every graph was built or came from the cache
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-3)
    assert 0 < counters["stats"]["unique_graphs"] < blocks  # reused across blocks, not one graph per block
    # transformer layers at different places in the UNet share graphs: their position is not part of the trace
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from comfy.ldm.modules.attention import BasicTransformerBlock
    from bridge.families.sd_unet import _position_free_forward
    layers = sum(isinstance(m, BasicTransformerBlock) for m in adapter.training_unet().modules())
    layer_graphs = len(_debug_get_cache_entry_list(_position_free_forward.__code__))
    assert 0 < layer_graphs < layers, (layer_graphs, layers)
    torch._dynamo.reset()


@pytest.mark.parametrize("batch_size", [2, 4])
def test_the_compile_step_compiles_the_batch_shape_the_run_steps_with(adapter, dataset, tmp_path, monkeypatch,
                                                                      batch_size):
    """Compiled blocks are specialized to shapes: the compile step before step 1 must use the run's batch size,
    else step 1 compiles everything again (campaign 6, SDXL batch 8: 64 s compiling batch 1, then 77 s more).
    Where the bucket holds fewer images than the batch size (two images, batch 4), its batches hold them all."""
    from torch._dynamo.utils import counters
    from trainer import session as session_module
    graphs_after_compile_step = []
    compile_step = session_module.compile_before_first_step

    def counted(compiled, steps):
        lines, batch = compile_step(compiled, steps)
        graphs_after_compile_step.append(counters["stats"]["unique_graphs"])
        return lines, batch
    monkeypatch.setattr(session_module, "compile_before_first_step", counted)
    torch._dynamo.reset()
    counters.clear()
    # two images: every step is a batch of both, the compile step's shape
    outcome = _run(adapter, dataset, MemorySettings("no", False, batch_size, 1, attention=Attention.SDPA,
                                                    compile=True), tmp_path, steps=2, name="compiled_batch2")
    assert len(outcome.losses) == 2 and "blocks compiled in" in outcome.report
    assert graphs_after_compile_step[0] > 0
    assert counters["stats"]["unique_graphs"] == graphs_after_compile_step[0]  # no recompile at step 1
    assert "compiled after step 1" not in outcome.report
    torch._dynamo.reset()


def test_a_batch_shape_first_seen_during_training_is_reported(adapter, tmp_path_factory, tmp_path):
    """Three images at batch 2: the last batch of each epoch has one image, a shape the compile step did not
    compile, so training pauses to compile it; the report says so."""
    import tiny_assets
    dataset = scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("three"), n=3), 64)
    torch._dynamo.reset()
    phases = []
    outcome = _run(adapter, dataset, MemorySettings("no", False, 2, 1, attention=Attention.SDPA, compile=True),
                   tmp_path, steps=3, name="compiled_remainder",
                   emit=lambda **event: phases.append(event.get("text")) if event["kind"] == "phase" else None)
    assert len(outcome.losses) == 3
    assert any(text.startswith("compiling the diffusion model") for text in phases), phases  # the UI is not silent
    assert "more graphs compiled after step 1 began (a batch shape the compile step had not seen" in outcome.report
    torch._dynamo.reset()


def test_a_failing_compiler_falls_back_to_eager_with_the_reason(adapter, dataset, tmp_path):
    """A real compile failure: inductor's C++ backend pointed at a compiler that does not exist. (Through the
    config's own patch: monkeypatch's restore left `cpp.cxx` missing, failing every later compile in the process.)"""
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/leanlora-no-compiler",)}):
        outcome = _run(adapter, dataset, MemorySettings("no", False, 1, 1, compile=True), tmp_path, steps=2,
                       name="nocompiler")
    assert "torch.compile failed here" in outcome.report and "runs eagerly" in outcome.report
    assert "compiled without inductor's" not in outcome.report  # compiling without combo kernels failed too
    assert len(outcome.losses) == 2
    torch._dynamo.reset()


def test_a_backward_compile_failure_compiles_again_without_the_extra_inductor_options(adapter, dataset, tmp_path,
                                                                                       monkeypatch):
    """Inductor compiles backward graphs during the compile step's backward, outside the blocks' forwards: a
    failure there (injected once, as a combo-kernel bug would raise it) compiles the blocks again without the
    extra options instead of leaving the whole model eager."""
    from torch._dynamo.exc import TorchDynamoException
    from trainer.session import TrainingSession
    throwaway_step, failures = TrainingSession.throwaway_step, []

    def fails_once_with_options(session, batch):
        if session.compiled is not None and session.compiled.options and not failures:
            failures.append(dict(session.compiled.options))
            raise TorchDynamoException("backward compile failed: a combo kernel did not build")
        return throwaway_step(session, batch)
    monkeypatch.setattr(TrainingSession, "throwaway_step", fails_once_with_options)
    torch._dynamo.reset()
    outcome = _run(adapter, dataset, MemorySettings("no", False, 1, 1, attention=Attention.SDPA, compile=True),
                   tmp_path, steps=2, name="nocombo")
    assert failures == [{"combo_kernels": True}]
    assert "blocks compiled in" in outcome.report and "torch.compile failed here" not in outcome.report
    assert "compiled without inductor's combo_kernels, which failed here (TorchDynamoException: backward compile" \
        in outcome.report
    assert len(outcome.losses) == 2
    torch._dynamo.reset()


def test_sd15_conv_weights_go_channels_last_on_cuda_and_compute_the_same(adapter, monkeypatch):
    """cuDNN computes half-precision convolutions NHWC: the training copy's frozen conv weights are stored that
    way where it was measured faster (SD1.5-type UNets, NVIDIA from Ampere on), with the same outputs; other
    devices, dtypes and model families keep NCHW, and so does the user's model."""
    import comfy.model_base
    unet = adapter.training_unet()
    convs = [m for m in unet.modules() if isinstance(m, torch.nn.Conv2d)]
    spatial = [conv for conv in convs if conv.weight.shape[-1] > 1]  # 1x1 kernels are the same bytes either way
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = {"c_crossattn": torch.randn(1, 77, 768, generator=torch.Generator().manual_seed(1))}
    cuda, bf16 = torch.device("cuda"), torch.bfloat16  # the tensors stay where they are (CPU here)
    capability = {"value": (7, 5)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    assert adapter.set_conv_layout(unet, torch.device("cpu"), bf16) is None
    assert adapter.set_conv_layout(unet, cuda, bf16) is None  # Turing: not measured
    capability["value"] = (9, 0)
    assert adapter.set_conv_layout(unet, cuda, torch.float32) is None
    with monkeypatch.context() as other_family:
        other_family.setattr(comfy.model_base, "BaseModel", comfy.model_base.SDXL)
        assert adapter.set_conv_layout(unet, cuda, bf16) is None
    assert all(conv.weight.is_contiguous() for conv in convs)
    with torch.no_grad():
        before = adapter.predict(unet, x, torch.tensor([300.0]), cond)
        note = adapter.set_conv_layout(unet, cuda, bf16)
        after = adapter.predict(unet, x, torch.tensor([300.0]), cond)
    assert note and f"{len(spatial)} frozen conv weights stored channels-last" in note
    assert all(conv.weight.is_contiguous(memory_format=torch.channels_last) for conv in convs)
    assert not any(conv.weight.is_contiguous() for conv in spatial)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    base_convs = [m for m in adapter.base.diffusion_model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(conv.weight.is_contiguous() for conv in base_convs)


def test_attention_kernels_that_read_free_memory_run_outside_compiled_graphs(adapter, dataset, tmp_path, monkeypatch):
    """ComfyUI's CPU choice (sub-quadratic; split with --use-split-cross-attention) asks for free memory on every
    call: dynamo guards on that number, so a compiled run compiled again at every step. Compiled runs call those
    kernels outside the graphs (a graph break) and say so; the user's kernel choice stays."""
    import comfy.ldm.modules.attention as comfy_attention
    calls = []
    kernel = comfy_attention.attention_sub_quad
    counting = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    monkeypatch.setattr(comfy_attention, "attention_sub_quad", counting)
    monkeypatch.setattr(comfy_attention, "optimized_attention", counting)
    assert adapter.set_attention(Attention.AUTO) is None and adapter.transformer_options == {}
    assert "outside the compiled graphs" in adapter.set_attention(Attention.SUB_QUADRATIC, compiled=True)
    assert "outside the compiled graphs" in adapter.set_attention(Attention.AUTO, compiled=True)
    assert adapter.set_attention(Attention.SDPA, compiled=True) is None
    torch._dynamo.reset()
    outcome = _run(adapter, dataset, MemorySettings("no", False, 1, 1, compile=True), tmp_path, steps=4, name="auto")
    assert "runs outside the compiled graphs" in outcome.report
    assert "compiled after step 1" not in outcome.report, outcome.report  # each step compiled again before
    assert calls  # still the user's kernel
    torch._dynamo.reset()


def test_compiled_code_never_reads_an_fp8_layers_python_float_scale(adapter, monkeypatch):
    """What dynamo traces of an fp8 layer reads its scale from the buffer, never the Python float (not even through
    hasattr): torch 2.11's dynamo guards such a float's value, so every block, each with its own scales, compiled
    anew (the GPU test below; SDXL lean + compile was still compiling after 230 s). Eager steps do read it."""
    import comfy.ops
    from trainer.step.frozen_weights import FP8_SCALE_VALUE
    layers = [comfy.ops.disable_weight_init.Linear(16, 8), comfy.ops.disable_weight_init.Conv2d(4, 8, 3)]
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight) * 0.02, requires_grad=False)
        layer.bias = None
        store_weights_fp8(layer)
    reads = []

    class Watched:
        def __getattribute__(self, name):
            if name == FP8_SCALE_VALUE:
                reads.append(name)
            return super().__getattribute__(name)
    inputs = [torch.randn(2, 16), torch.randn(1, 4, 6, 6)]
    for layer in layers:
        layer.__class__ = type("Watched" + type(layer).__name__, (Watched, type(layer)), {})
    for layer, x in zip(layers, inputs):
        layer(x)
    assert reads  # eager steps do: the GEMM's alpha, the conv weight's multiplier
    reads.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as dynamo traces the layers
    for layer, x in zip(layers, inputs):
        layer(x)
    assert reads == []


def test_fp8_blocks_with_different_scales_share_one_compiled_graph(adapter):
    """Each fp8 layer's scale differs, and the blocks still share one compiled graph. Fails without the fix on the
    GPU machine's torch 2.11 (docs/results/compile_fp8_scale_test_2026-12-04.txt); this machine's 2.14 does not
    guard an unused float, so here the test above is the one that fails without it."""
    import comfy.ops
    from trainer.step.compiled_blocks import CompiledBlocks, compiled_graph_count
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU machine runs it with Triton
    generator = torch.Generator().manual_seed(0)
    blocks = []
    for magnitude in (0.02, 0.05, 0.11):
        layer = comfy.ops.disable_weight_init.Linear(16, 16)
        layer.weight = torch.nn.Parameter(torch.randn(16, 16, generator=generator) * magnitude, requires_grad=False)
        layer.bias = torch.nn.Parameter(torch.zeros(16), requires_grad=False)
        store_weights_fp8(layer)
        blocks.append(torch.nn.Sequential(layer, torch.nn.GELU()).to(device))
    assert len({block[0].leanlora_fp8_scale_value for block in blocks}) == 3
    x = torch.randn(2, 16, generator=generator).to(device)
    references = [block(x) for block in blocks]  # eager: the scale as the GEMM's alpha
    torch._dynamo.reset()
    compiled = CompiledBlocks(blocks)
    before = compiled_graph_count()
    for block, reference in zip(blocks, references):
        torch.testing.assert_close(block(x), reference)
    assert compiled.failed is None and compiled_graph_count() == before + 1
    torch._dynamo.reset()
