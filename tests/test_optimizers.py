"""The optimizer unit on the CPU: every choice trains a tiny LoRA, missing or broken backends fall back with a
note, and the state-size formulas equal what the real optimizers allocate."""
import sys
import warnings

import pytest
import torch

from trainer.errors import LeanLoRAError
from trainer.loop import StepParts, train_loop
from trainer.lora import inject_lora
from trainer.optimizers import (MIN_8BIT_SIZE, OPTIMIZERS, build_optimizer, optimizer_state_bytes,
                                optimizer_state_bytes_per_param)
from trainer.step.precision import Precision
from trainer.settings import LoraSettings

from helpers import TinyNet, optimizer_state_tensor_bytes, sd_targets

CPU = torch.device("cpu")
# Per-optimizer learning rates: Lion's sign updates want a few times less than AdamW's.
LEARNING_RATES = {"AdamW": 1e-2, "AdamW8bit": 1e-2, "PagedAdamW8bit": 1e-2, "Lion": 3e-3, "Lion8bit": 3e-3,
                  "Adafactor": 1e-2, "Prodigy": 0.25, "AdamWScheduleFree": 1e-2, "CAME": 3e-4}


def _net():
    """dim 256 at rank 16 gives LoRA tensors of 4096 elements: just enough for bitsandbytes to quantize them."""
    return TinyNet(dim=256, depth=2)


def _train(name: str, steps: int = 60, flat: bool = False):
    torch.manual_seed(0)
    net = _net()
    params = inject_lora(net, LoraSettings(rank=16, alpha=16.0), seed=0, target_modules=sd_targets(LoraSettings(rank=16, alpha=16.0)))
    x = torch.randn(64, 5, 256)
    with torch.no_grad():
        y = _net()(x)

    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            idx = torch.randint(0, 64, (8,), generator=g)
            yield x[idx], y[idx]
    optimizer, note = build_optimizer(name, params, LEARNING_RATES[name], device=CPU, flat=flat)
    result = train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]), b[1]), optimizer,
                                  Precision("no", CPU)), data(), steps)
    return result.losses, optimizer, note, params




@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tensors this small gain nothing from intra-op threads, which on a busy machine mostly wait on each other.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def adamw_losses():
    losses, optimizer, note, _ = _train("AdamW")
    assert note is None and type(optimizer) is torch.optim.AdamW and optimizer.defaults["foreach"]
    return losses


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "AdamW"])
def test_each_optimizer_trains_the_tiny_lora_like_adamw(name, adamw_losses):
    """Tolerance: after 60 steps the mean of the last 10 losses is at most 1.5x AdamW's and below 0.7x the
    optimizer's own first-10 mean (measured: 0.76-1.00x of AdamW's, 0.35-0.49x their own; Prodigy at lr 0.25 1.41x
    and 0.61x: at 1.0 its estimated step overshoots on this tiny problem; CAME at 3e-4 0.68x and 0.33x).
    Prodigy steps one flat tensor, as the trainer builds it (its start point p0 is a scalar for a tensor that is
    all zeros when first stepped, such as LoRA's B: flat, the state is exactly 16 bytes per weight)."""
    flat = name == "Prodigy"
    losses, optimizer, note, params = _train(name, flat=flat)
    stepped = [optimizer.leanlora_flat.param] if flat else params
    first, last, adamw_last = (sum(chunk) / 10 for chunk in (losses[:10], losses[-10:], adamw_losses[-10:]))
    assert last <= 1.5 * adamw_last, (name, last, adamw_last)
    assert last < 0.7 * first, (name, last, first)
    used = type(optimizer).__name__
    assert used == ("AdamW8bit" if name == "PagedAdamW8bit" else name) and (note is None) == (used == name)
    assert optimizer_state_tensor_bytes(optimizer) == optimizer_state_bytes(used, stepped)


def test_without_bitsandbytes_the_8bit_choices_fall_back_with_a_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    params = [torch.nn.Parameter(torch.zeros(4, 16))]
    for name in ("AdamW8bit", "PagedAdamW8bit", "Lion8bit", "Lion"):
        optimizer, note = build_optimizer(name, params, 1e-3, device=CPU)
        assert type(optimizer) is torch.optim.AdamW
        assert name in note and "using AdamW instead" in note and "pip install \"bitsandbytes>=0.45\"" in note
    assert "3-10x" in note  # Lion's learning rate is too low for AdamW, and the note says so


def test_paged_adamw8bit_on_cpu_uses_adamw8bit():
    # Paging needs CUDA unified memory; on the CPU bitsandbytes would only warn and keep unpaged state.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer, note = build_optimizer("PagedAdamW8bit", [torch.nn.Parameter(torch.zeros(8))], 1e-3, device=CPU)
    assert type(optimizer).__name__ == "AdamW8bit"
    assert "PagedAdamW8bit" in note and "CUDA" in note and "using AdamW8bit instead" in note


def test_bitsandbytes_without_kernels_for_the_device_is_caught_by_the_probe_step(monkeypatch):
    import bitsandbytes as bnb

    def no_kernel(self, closure=None):
        raise RuntimeError("no kernel image is available for execution on the device")
    monkeypatch.setattr(bnb.optim.Lion8bit, "step", no_kernel)  # constructs fine, fails on its first step
    optimizer, note = build_optimizer("Lion8bit", [torch.nn.Parameter(torch.zeros(8))], 1e-3, device=CPU)
    assert type(optimizer).__name__ == "Lion"  # the 32-bit Lion still works
    assert "Lion8bit" in note and "using Lion instead" in note and "no kernel image" in note


def test_without_transformers_adafactor_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.optimization", None)
    optimizer, note = build_optimizer("Adafactor", [torch.nn.Parameter(torch.zeros(8))], 1e-3, device=CPU)
    assert type(optimizer) is torch.optim.AdamW
    assert "Adafactor" in note and "transformers" in note and "using AdamW instead" in note


# LoRA down/up of a small and of an SD-sized layer, an odd size (5000 = 19.5 blocks of 256), a 1-D vector and a
# 1x1-conv LoRA (Adafactor factors 4-D tensors over the last dim only: more state than the tensor itself).
SHAPES = [(4, 16), (16, 4), (16,), (16, 320), (320, 16), (100, 50), (16, 320, 1, 1)]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_bytes_equal_the_real_optimizers_state(name):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer, note = build_optimizer(name, params, 1e-3, device=CPU)
    if name == "PagedAdamW8bit":  # the CPU fallback; measure the real class too (it warns that it won't page)
        import bitsandbytes as bnb
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = bnb.optim.PagedAdamW8bit(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer_state_tensor_bytes(optimizer) == optimizer_state_bytes(name, params)
    assert optimizer_state_bytes(name, [p.shape for p in params]) == optimizer_state_bytes(name, params)


def test_state_bytes_per_param_is_the_rate_on_large_tensors():
    expected = {"AdamW": 8, "AdamW8bit": 2 + 2 * 4 / 256, "PagedAdamW8bit": 2 + 2 * 4 / 256, "Lion": 4,
                "Lion8bit": 1 + 4 / 256}
    shape = (1280, 256)
    for name, rate in expected.items():
        assert optimizer_state_bytes_per_param(name) == rate
        quantile_maps = {"AdamW8bit": 2048, "PagedAdamW8bit": 2048, "Lion8bit": 1024}.get(name, 0)
        assert optimizer_state_bytes(name, [shape]) == rate * 1280 * 256 + quantile_maps
    with pytest.raises(ValueError, match="optimizer_state_bytes"):
        optimizer_state_bytes_per_param("Adafactor")
    assert optimizer_state_bytes("Adafactor", [shape, (7,)]) == 4 * (1280 + 256 + 7)


def test_unknown_optimizer_is_rejected_with_the_field_name():
    with pytest.raises(LeanLoRAError, match="optimizer: got 'SGD'.*AdamW8bit"):
        build_optimizer("SGD", [torch.nn.Parameter(torch.zeros(1))], 1e-3, device=CPU)
    with pytest.raises(LeanLoRAError, match="optimizer"):
        optimizer_state_bytes("adamw", [(4, 16)])


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit"])
def test_flat_bitsandbytes_steps_train_like_per_tensor_steps(name):
    """One flat tensor instead of 12. Each LoRA tensor here has 4096 elements, a whole number of bitsandbytes'
    256-element blocks, so every block holds the same values either way and the runs are identical (with other
    sizes blocks span tensor borders and tensors under 4096 elements get 8-bit state too: close, not equal)."""
    per_tensor, _, _, _ = _train(name)
    flat, optimizer, note, params = _train(name, flat=True)
    assert note is None and len(optimizer.param_groups[0]["params"]) == 1
    flat_param = optimizer.leanlora_flat.param
    for p in params:  # every LoRA tensor is a view of the stepped buffer, so the model sees each update
        assert p.untyped_storage().data_ptr() == flat_param.untyped_storage().data_ptr()
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat_param.grad.untyped_storage().data_ptr()
    assert flat == per_tensor
    assert optimizer_state_tensor_bytes(optimizer) == optimizer_state_bytes(name, [flat_param])


def test_the_chosen_optimizer_is_built_once_on_the_tensors_it_steps(monkeypatch):
    """Availability is settled by the probe step alone: the flat optimizer is the only one built on the LoRA
    tensors (it used to be built per tensor first, then again on the flat buffer)."""
    import bitsandbytes as bnb
    built = []
    original = bnb.optim.AdamW8bit.__init__

    def counting_init(self, params, *args, **kwargs):
        params = list(params)
        built.append([tuple(p.shape) for p in params])
        original(self, params, *args, **kwargs)
    monkeypatch.setattr(bnb.optim.AdamW8bit, "__init__", counting_init)
    params = [torch.nn.Parameter(torch.zeros(16, 320)), torch.nn.Parameter(torch.zeros(320, 16))]
    optimizer, note = build_optimizer("AdamW8bit", params, 1e-3, device=CPU, flat=True)
    assert note is None and type(optimizer).__name__ == "AdamW8bit"
    probes = [[(1,), (MIN_8BIT_SIZE,)]]
    assert built == probes + [[(2 * 16 * 320,)]]


def test_flat_gradients_are_zeroed_in_place_and_reattached():
    torch.manual_seed(0)
    net = _net()
    params = inject_lora(net, LoraSettings(rank=16, alpha=16.0), seed=0, target_modules=sd_targets(LoraSettings(rank=16, alpha=16.0)))
    optimizer, _ = build_optimizer("AdamW8bit", params, 1e-2, device=CPU, flat=True)
    flat = optimizer.leanlora_flat
    net(torch.randn(2, 5, 256)).square().mean().backward()
    assert flat.param.grad.abs().sum() > 0  # autograd added into the views
    params[0].grad = None  # something resets one gradient
    optimizer.zero_grad(set_to_none=True)
    assert flat.param.grad.abs().sum() == 0 and params[0].grad is flat.grads[0]


def test_stochastic_rounding_is_unbiased_where_round_to_nearest_stalls():
    from trainer.optimizers import stochastic_round_
    torch.manual_seed(0)
    weight_nearest = torch.ones(4096, dtype=torch.bfloat16)
    weight_stochastic = torch.ones(4096, dtype=torch.bfloat16)
    for _ in range(100):  # 100 updates of 1e-4: 1/78 of bf16's spacing at 1.0 each
        weight_nearest = (weight_nearest.float() + 1e-4).bfloat16()
        stochastic_round_(weight_stochastic, weight_stochastic.float() + 1e-4)
    assert torch.all(weight_nearest == 1.0)  # every update lost
    assert weight_stochastic.float().mean().item() == pytest.approx(1.01, abs=1e-3)  # they add up on average
    x = torch.full((100_000,), 1.0 + 2 ** -9)  # a quarter of the way between two bf16 neighbours (1 and 1+2^-7)
    rounded = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(rounded, x)
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert rounded.float().mean().item() == pytest.approx(x[0].item(), abs=2e-5)


@pytest.mark.parametrize("name,chunk", [("AdamW", None), ("AdamW8bit", None), ("AdamW", 5000), ("AdamW8bit", 5000)])
def test_bf16_lora_weights_halve_their_bytes_and_train_like_fp32(name, chunk, monkeypatch):
    """chunk=5000: the fp32 copies are made (and stepped) a few thousand elements at a time, as SDXL's 23M are in
    4M chunks; every chunk gets its own fp32 optimizer state and training is unchanged."""
    from trainer.optimizers import BF16Weights
    if chunk:
        monkeypatch.setattr(BF16Weights, "CHUNK", chunk)
    torch.manual_seed(0)

    def run(bf16_weights):
        torch.manual_seed(0)
        net = _net()
        params = inject_lora(net, LoraSettings(rank=16, alpha=16.0), seed=0, target_modules=sd_targets(LoraSettings(rank=16, alpha=16.0)))
        optimizer, _ = build_optimizer(name, params, 1e-2, device=CPU, bf16_weights=bf16_weights)
        x = torch.randn(64, 5, 256)
        with torch.no_grad():
            y = _net()(x)
        g = torch.Generator().manual_seed(0)
        data = ((x[i], y[i]) for i in iter(lambda: torch.randint(0, 64, (8,), generator=g), None))
        result = train_loop(StepParts(params, lambda b: torch.nn.functional.mse_loss(net(b[0]).float(), b[1]),
                                      optimizer, Precision("bf16", CPU)), data, 60)
        held = sum(2 * p.numel() * p.element_size() for p in params)  # weight + its gradient, same dtype
        return result.losses, held, params, optimizer

    fp32_losses, fp32_bytes, _, _ = run(False)
    bf16_losses, bf16_bytes, params, optimizer = run(True)
    assert bf16_bytes * 2 == fp32_bytes
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in params)
    assert sum(bf16_losses[-10:]) == pytest.approx(sum(fp32_losses[-10:]), rel=0.05)  # measured: within 2%
    assert sum(bf16_losses[-10:]) < 0.7 * sum(bf16_losses[:10])
    flat = optimizer.leanlora_flat
    total = flat.param.numel()
    assert len(flat.proxies) == (-(-total // chunk) if chunk else 1) and sum(n for (n,) in flat.state_shapes()) == total
    for proxy in flat.proxies:  # fp32 state for every chunk; the stand-ins hold no memory between steps
        state = optimizer.state[proxy]
        assert state and all(t.dtype != torch.bfloat16 for t in state.values() if isinstance(t, torch.Tensor))
        assert proxy.numel() == 0 and proxy.grad is None


def test_bf16_lora_weights_need_bf16_mixed_precision():
    from trainer.settings import MemorySettings
    with pytest.raises(LeanLoRAError, match="lora_weights.*mixed_precision bf16"):
        MemorySettings("fp16", lora_weights="bf16_stochastic_rounding")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory of the optimizer step needs CUDA")
def test_bf16_lora_weights_step_in_chunks_so_the_fp32_copies_stay_small(monkeypatch):
    """The step's fp32 copies of 32M bf16 weights: 256 MiB (weights + gradients) at once, 32 MiB in 4M chunks."""
    from trainer.optimizers import BF16Weights
    device = torch.device("cuda")
    peaks = {}
    for chunk in (1 << 30, 4 * 2 ** 20):
        monkeypatch.setattr(BF16Weights, "CHUNK", chunk)
        params = [torch.nn.Parameter(torch.randn(8 * 2 ** 20, device=device)) for _ in range(4)]
        optimizer, _ = build_optimizer("AdamW", params, 1e-3, device=device, bf16_weights=True)
        for p in params:
            p.grad.normal_()
        optimizer.step()  # the first step allocates the optimizer state
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - held
        del optimizer, params
    assert peaks[1 << 30] >= 256 * 2 ** 20
    assert peaks[4 * 2 ** 20] <= 40 * 2 ** 20  # 32 MiB: a chunk's weights + its gradient (or rounding noise)
