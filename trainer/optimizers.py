"""Optimizers as one unit: build the one asked for, or the nearest one that works on this device with a note
saying why, and the exact bytes of state each keeps (the memory estimate's optimizer term).

`type(optimizer).__name__` of what `build_optimizer` returns is always the OPTIMIZERS name actually in use
(torch AdamW, bitsandbytes AdamW8bit / PagedAdamW8bit / Lion / Lion8bit, transformers Adafactor, and from their own
optional packages, imported only when chosen: prodigyopt's Prodigy, schedulefree's AdamWScheduleFree,
came-pytorch's CAME)."""
from __future__ import annotations

import contextlib
import io
import math
import types
from typing import Iterable

import torch

from .errors import LeanLoRAError

OPTIMIZERS = ("AdamW", "AdamW8bit", "PagedAdamW8bit", "Lion", "Lion8bit", "Adafactor", "Prodigy",
              "AdamWScheduleFree", "CAME")

# What to try, in order: each falls back to the nearest optimizer with the same behaviour, AdamW last.
_CHAINS = {
    "AdamW": ("AdamW",),
    "AdamW8bit": ("AdamW8bit", "AdamW"),
    "PagedAdamW8bit": ("PagedAdamW8bit", "AdamW8bit", "AdamW"),
    "Lion": ("Lion", "AdamW"),
    "Lion8bit": ("Lion8bit", "Lion", "AdamW"),
    "Adafactor": ("Adafactor", "AdamW"),
    # No fallback: each behaves too differently from AdamW (Prodigy's learning rate is ~1, schedule-free's weights
    # are an average) for a silent swap; a missing package is an error naming its pip command.
    "Prodigy": ("Prodigy",),
    "AdamWScheduleFree": ("AdamWScheduleFree",),
    "CAME": ("CAME",),
}
# name -> (module, class, pip package): optional packages, imported only when chosen
OPTIONAL = {"Prodigy": ("prodigyopt", "Prodigy", "prodigyopt"),
            "AdamWScheduleFree": ("schedulefree", "AdamWScheduleFree", "schedulefree"),
            "CAME": ("came_pytorch.CAME", "CAME", "came-pytorch")}
# Optimizers whose learning rate is a multiplier of a step size they estimate themselves (1.0 is usual)
ADAPTIVE_LR = ("Prodigy",)
# Optimizers that step one flat tensor as well as many (FlatParameters): bitsandbytes' launches kernels per tensor,
# Prodigy syncs with the host (.item()) once per tensor and step. CAME factors each matrix: never flattened.
_FLAT = ("AdamW8bit", "PagedAdamW8bit", "Lion", "Lion8bit", "Prodigy")
_INSTALL_BNB = "To use it, pip install \"bitsandbytes>=0.45\" into ComfyUI's Python (an NVIDIA GPU works best)"

# bitsandbytes' 8-bit optimizers (its defaults, which we keep): tensors with fewer than MIN_8BIT_SIZE elements
# keep fp32 moments; larger ones store one byte per element per moment plus one fp32 absmax per block of
# BNB_BLOCK elements, and the optimizer holds one 256-entry fp32 quantile map per moment, shared by all tensors.
MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
QUANTILE_MAP_BYTES = 256 * 4


class _Unavailable(Exception):
    def __init__(self, why: str, todo: str):
        super().__init__(why)
        self.why, self.todo = why, todo


def _check_name(name: str) -> None:
    if name not in OPTIMIZERS:
        raise LeanLoRAError(f"optimizer: got {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


def _torch_adamw(params, lr, weight_decay, device):
    # The fused kernel is the fastest and needs every tensor on CUDA and floating point.
    tensors = [p for item in params for p in (item["params"] if isinstance(item, dict) else [item])]  # or groups
    fused = device.type == "cuda" and all(p.is_cuda and p.is_floating_point() for p in tensors)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                             **({"fused": True} if fused else {"foreach": True}))


def _bitsandbytes(name, device):
    """The bitsandbytes optimizer class's builder, once a probe step showed that it runs on `device`."""
    if name == "PagedAdamW8bit" and device.type != "cuda":
        # bitsandbytes pages through CUDA unified memory; elsewhere it warns and silently keeps plain 8-bit state.
        raise _Unavailable(f"paging needs a CUDA device, this is {device.type}", "")
    try:
        import bitsandbytes as bnb
    except Exception as error:  # not installed, or a build whose native library fails to load
        raise _Unavailable(f"bitsandbytes could not be imported ({_short(error)})", f"{_INSTALL_BNB}.") from error
    cls = getattr(bnb.optim, name)
    try:
        _probe(cls, device)
    except Exception as error:
        raise _Unavailable(f"bitsandbytes {bnb.__version__} cannot run {name} on {device} ({_short(error)})",
                           f"{_INSTALL_BNB}; a build for this device may not exist yet.") from error
    return lambda params, lr, weight_decay: cls(params, lr=lr, weight_decay=weight_decay)


def _probe(cls, device: torch.device) -> None:
    """bitsandbytes can import yet lack kernels for a device, which only a step reveals. One tiny tensor takes
    its fp32 path and one of MIN_8BIT_SIZE elements its 8-bit blockwise kernels."""
    probe = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in (1, MIN_8BIT_SIZE)]
    optimizer = cls(probe, lr=1e-3)
    for p in probe:
        p.grad = torch.ones_like(p)
    optimizer.step()
    if not all(torch.isfinite(p).all() and (p != 0).all() for p in probe):
        raise RuntimeError("a probe step left the weights unchanged or not finite")


def optional_class(name: str):
    """The class of an optimizer from its own package, or a LeanLoRAError naming the pip command."""
    module, cls, package = OPTIONAL[name]
    try:
        return getattr(__import__(module, fromlist=[cls]), cls)
    except Exception as error:  # not installed, or broken
        raise LeanLoRAError(f"optimizer: {name} needs the package {package}, which could not be imported "
                            f"({_short(error)}). Install it into ComfyUI's Python with: python -m pip install "
                            f"{package} (or choose another optimizer in Memory Settings)") from error


def check_learning_rate(name: str, lr: float) -> None:
    """Prodigy's rate multiplies the step it estimates (1.0 is usual); the others take a rate such as 1e-4. Either
    mistaken for the other trains ~10,000x too fast or too slow: refused before any work."""
    _check_name(name)
    if name in ADAPTIVE_LR and not 0.1 <= lr <= 10:
        raise LeanLoRAError(f"learning_rate: got {lr:g} with optimizer {name}, whose learning rate multiplies the "
                            "step size it finds by itself: set learning_rate to 1.0 (0.1 to 10)")
    if name not in ADAPTIVE_LR and lr >= 1:
        raise LeanLoRAError(f"learning_rate: got {lr:g} with optimizer {name}; rates of about 1 are for Prodigy. "
                            "Use a small positive value such as 1e-4")


def _optional(name):
    cls = optional_class(name)
    if name == "Prodigy":
        def make(params, lr, weight_decay):
            with contextlib.redirect_stdout(io.StringIO()):  # it prints "Using decoupled weight decay"
                return cls(params, lr=lr, weight_decay=weight_decay)
        return make
    if name == "AdamWScheduleFree":
        def make(params, lr, weight_decay):
            optimizer = cls(params, lr=lr, weight_decay=weight_decay)
            optimizer.train()  # it refuses to step in eval mode; see evaluation_weights for the other way
            return optimizer
        return make
    return lambda params, lr, weight_decay: cls(params, lr=lr, weight_decay=weight_decay)


def adapted_step(optimizer) -> float | None:
    """Prodigy's d, the step size it has estimated (its learning rate multiplies it); None for the others."""
    if type(optimizer).__name__ != "Prodigy":
        return None
    return float(optimizer.param_groups[0]["d"])


@contextlib.contextmanager
def evaluation_weights(optimizer):
    """Schedule-free AdamW trains at one point and evaluates at another (its average): inside this block the
    weights are the average, what samples, validation and the saved LoRA use; training goes on after it. Other
    optimizers: nothing to do."""
    switch = type(optimizer).__name__ == "AdamWScheduleFree"  # by name: a future torch may give every optimizer eval()
    if switch:
        optimizer.eval()
    try:
        yield
    finally:
        if switch:
            optimizer.train()


def _adafactor():
    try:
        from transformers.optimization import Adafactor
    except Exception as error:
        raise _Unavailable(f"transformers could not be imported ({_short(error)})",
                           "To use it, pip install transformers into ComfyUI's Python (ComfyUI itself needs it).") from error
    # kohya's settings for a fixed, user-chosen learning rate (no relative step, no parameter-scale factor).
    return lambda params, lr, weight_decay: Adafactor(params, lr=lr, scale_parameter=False, relative_step=False,
                                                      warmup_init=False, weight_decay=weight_decay)


class FlatParameters:
    """The LoRA tensors as views of one flat buffer, and their gradients as views of one flat gradient, so an
    optimizer that launches its kernels tensor by tensor (bitsandbytes) makes one call per step instead of one
    per tensor: SDXL at rank 16 has 1,120 LoRA tensors, and stepping them one by one cost ~0.07 s per step on
    an H200. Gradients are zeroed in place, never set to None (autograd adds into the views). `dtype`: the
    buffer's (and so the LoRA weights') dtype, e.g. bf16 for BF16Weights."""

    def __init__(self, params: list[torch.nn.Parameter], dtype: torch.dtype | None = None):
        first = params[0]
        self.param = torch.nn.Parameter(torch.empty(sum(p.numel() for p in params), device=first.device,
                                                    dtype=dtype or first.dtype))
        self.param.grad = torch.zeros_like(self.param)
        self.params, self.grads, offset = params, [], 0
        for p in params:
            n = p.numel()
            self.param.data[offset:offset + n].copy_(p.data.reshape(-1))
            p.data = self.param.data[offset:offset + n].view_as(p)
            grad = self.param.grad[offset:offset + n].view_as(p)
            if p.grad is not None:
                grad.copy_(p.grad)
            p.grad = grad
            self.grads.append(grad)
            offset += n

    def state_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of what the optimizer keeps state for (the memory estimate's optimizer term)."""
        return [tuple(self.param.shape)]

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - the views must stay
        self.param.grad.zero_()
        for p, grad in zip(self.params, self.grads):  # every step: an identity check, not 1,120 assignments
            if p.grad is not grad:
                p.grad = grad  # re-attached: something replaced it


def stochastic_round_(target: torch.Tensor, source: torch.Tensor) -> None:
    """Writes fp32 `source` into bf16 `target`, rounding up or down at random in proportion to the distance to
    each neighbour: unbiased, so updates far below bf16's resolution (a learning rate of 1e-4 times a gradient
    on a weight of ~1e-2) add up over steps instead of vanishing as round-to-nearest makes them."""
    bits = source.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    noise.add_(bits).bitwise_and_(-65536)  # in place: one temporary the size of `source`
    target.copy_(noise.view(torch.float32))  # low 16 bits zero: the bf16 cast is exact


class BF16Weights(FlatParameters):
    """LoRA weights and gradients in bf16 (half of fp32's bytes). The optimizer keeps fp32 state and steps fp32
    copies of the weights and gradients made for the step only, one chunk of the flat buffer at a time, then
    rounds each result back stochastically. Chunks keep the copies small: whole-buffer copies moved SDXL's peak
    to the optimizer step (H200, fp8 + offload: 3.09 GiB against 2.92 with fp32 weights)."""

    CHUNK = 4 * 2 ** 20  # elements per fp32 copy: 16 MiB of weights + 16 MiB of gradients at a time

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__(params, torch.bfloat16)
        n = self.param.numel()
        self.slices = [slice(start, min(start + self.CHUNK, n)) for start in range(0, n, self.CHUNK)]
        # What the optimizer steps: one fp32 stand-in per chunk, empty between steps.
        self.proxies = [torch.nn.Parameter(torch.empty(0, device=self.param.device)) for _ in self.slices]

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(part.stop - part.start,) for part in self.slices]

    def wrap_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces this optimizer instance's step (as a bound method: LR schedulers wrap it again). Each chunk is
        stepped on its own: optimizers skip parameters without a gradient."""
        inner = optimizer.step

        def bf16_step(_optimizer, *args, **kwargs):
            result = None
            for part, proxy in zip(self.slices, self.proxies):
                proxy.data = self.param.detach()[part].float()
                proxy.grad = self.param.grad[part].float()
                try:
                    result = inner(*args, **kwargs)
                finally:
                    proxy.grad = None  # before rounding: at most weights + one temporary of a chunk at a time
                    stochastic_round_(self.param.data[part], proxy.data)
                    proxy.data = torch.empty(0, device=self.param.device)
            return result
        optimizer.step = types.MethodType(bf16_step, optimizer)


def _maker(name, device):
    """How to build optimizer `name` on given tensors, or _Unavailable. Checked before any tensor is touched, so
    the LoRA tensors are flattened (or made bf16) once, for the optimizer that will step them."""
    if name == "AdamW":
        return lambda params, lr, weight_decay: _torch_adamw(params, lr, weight_decay, device)
    if name == "Adafactor":
        return _adafactor()
    if name in OPTIONAL:
        return _optional(name)
    return _bitsandbytes(name, device)


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 1e-2, *,
                    device: torch.device, flat: bool = False, bf16_weights: bool = False,
                    extra_groups: tuple[tuple[list[torch.nn.Parameter], float], ...] = ()
                    ) -> tuple[torch.optim.Optimizer, str | None]:
    """The optimizer, and a note for the report when another one had to be used instead (None otherwise).
    flat=True: a bitsandbytes optimizer or Prodigy steps all tensors as one (FlatParameters, kept as
    `.leanlora_flat`; its zero_grad zeroes in place). bf16_weights=True: the LoRA weights become bf16 (BF16Weights,
    any optimizer). `extra_groups`: (tensors, learning rate) stepped as param groups of their own after `params`
    (the text encoder's LoRA at text_encoder_lr; the LR schedule scales every group alike); tensors then stay
    unflattened, and bf16 weights are refused before this (train_lora)."""
    _check_name(name)
    params, device = list(params), torch.device(device)
    if extra_groups:
        if bf16_weights:
            raise LeanLoRAError("lora_weights: bf16 + stochastic rounding steps one group of LoRA weights; with "
                                "text_encoder_lr set, set lora_weights to fp32")
        flat = False
    whys: dict[str, list[str]] = {}  # reason -> the candidates it ruled out
    todos = []
    for candidate in _CHAINS[name]:  # every chain ends with torch AdamW, which always builds
        try:
            make = _maker(candidate, device)
            break
        except _Unavailable as missing:
            whys.setdefault(missing.why, []).append(candidate)
            if missing.todo and missing.todo not in todos:
                todos.append(missing.todo)
    flat_params = None
    if bf16_weights and params:
        flat_params = BF16Weights(params)
        optimizer = make(flat_params.proxies, lr, weight_decay)
        flat_params.wrap_step(optimizer)  # this instance only
    elif flat and candidate in _FLAT and params:
        flat_params = FlatParameters(params)
        optimizer = make([flat_params.param], lr, weight_decay)
    elif extra_groups:
        optimizer = make([{"params": params}, *({"params": list(group), "lr": group_lr}
                                                 for group, group_lr in extra_groups)], lr, weight_decay)
    else:
        optimizer = make(params, lr, weight_decay)
    if flat_params is not None:
        optimizer.leanlora_flat = flat_params
        optimizer.zero_grad = flat_params.zero_grad  # this instance only: gradients stay views of the flat one
    if candidate == name:
        return optimizer, None
    if name.startswith("Lion") and candidate == "AdamW":
        todos.append("The learning rate was chosen for Lion; AdamW usually wants 3-10x more.")
    reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in whys.items())
    return optimizer, " ".join([f"optimizer {name} is not available ({reasons}): using {candidate} instead.", *todos])


def _shape(tensor_or_shape) -> tuple[int, ...]:
    return tuple(tensor_or_shape.shape if isinstance(tensor_or_shape, torch.Tensor) else tensor_or_shape)


def optimizer_state_bytes(name: str, params_or_shapes: Iterable) -> int:
    """Exact bytes of optimizer state once every tensor has stepped, for fp32 trainable tensors (given as
    tensors or shapes). Shared tensors count once (bitsandbytes' quantile maps); 0-dim scalars are left out
    (step counters and Adafactor's RMS: 4 bytes per tensor, and torch keeps AdamW's on the CPU unless fused)."""
    _check_name(name)
    shapes = [_shape(p) for p in params_or_shapes]
    if name in ("Prodigy", "AdamWScheduleFree"):
        # Prodigy (slice_p 1, beta1 > 0): exp_avg, exp_avg_sq, s and the start point p0, each a full fp32 copy;
        # schedule-free AdamW: z (its other point) and exp_avg_sq
        return 4 * (4 if name == "Prodigy" else 2) * sum(math.prod(s) for s in shapes)
    if name == "CAME":
        # exp_avg full; tensors of 2+ dims keep factored second moments and factored "residuals" (instability),
        # rows shape[:-1] and columns shape[:-2] + shape[-1:] each; 1-D tensors a full second moment
        return 4 * sum(math.prod(s) + (2 * (math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1]) if len(s) >= 2
                                       else math.prod(s)) for s in shapes)
    if name == "Adafactor":
        # beta1=None: no first moment. Tensors of 2+ dims keep factored second moments of shape[:-1] (rows) and
        # shape[:-2] + shape[-1:] (columns); 1-D tensors keep a full one. All fp32 (it upcasts half gradients).
        return 4 * sum(math.prod(s[:-1]) + math.prod(s[:-2]) * s[-1] if len(s) >= 2 else math.prod(s)
                       for s in shapes)
    moments = 1 if name.startswith("Lion") else 2
    numels = [math.prod(s) for s in shapes]
    if name in ("AdamW", "Lion"):
        return 4 * moments * sum(numels)
    small = sum(n for n in numels if n < MIN_8BIT_SIZE)
    large = [n for n in numels if n >= MIN_8BIT_SIZE]
    quantized = sum(n + 4 * math.ceil(n / BNB_BLOCK) for n in large)
    return moments * (4 * small + quantized + (QUANTILE_MAP_BYTES if large else 0))


def optimizer_state_bytes_per_param(name: str) -> float:
    """State bytes per fp32 parameter in tensors of MIN_8BIT_SIZE elements or more whose size is a multiple of
    BNB_BLOCK (the rate the 8-bit optimizers reach on large tensors). Adafactor's state depends on the shapes:
    use optimizer_state_bytes."""
    _check_name(name)
    if name in ("Adafactor", "CAME"):
        raise ValueError(f"{name}'s state depends on tensor shapes; use optimizer_state_bytes")
    if name in ("Prodigy", "AdamWScheduleFree"):
        return 16.0 if name == "Prodigy" else 8.0
    moments = 1 if name.startswith("Lion") else 2
    return moments * (4.0 if name in ("AdamW", "Lion") else 1 + 4 / BNB_BLOCK)


POLYNOMIAL_END_LR = 1e-7  # diffusers' default end of the polynomial schedule


def build_lr_schedule(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int,
                      done_steps: int = 0) -> torch.optim.lr_scheduler.LRScheduler:
    """The schedules of diffusers' get_scheduler (same names, shapes and defaults: a linear warm-up from 0, then
    constant / cosine half-wave / linear to 0 / one cosine restart cycle / linear polynomial to 1e-7), written on
    torch's LambdaLR so the pack needs no diffusers. Positioned at `done_steps` so an optimizer rebuilt mid-run
    (OOM recovery) continues the same curve."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])  # what a scheduler resumed at last_epoch >= 0 starts from
    decay_steps = max(1, total_steps - warmup_steps)
    initial_lr = optimizer.defaults["lr"]
    end_lr = min(POLYNOMIAL_END_LR, initial_lr)

    def after_warmup(progress: float) -> float:  # progress: 0 at the end of warm-up, 1 at total_steps
        if name == "constant":
            return 1.0
        if name == "linear":
            return max(0.0, 1.0 - progress)
        if name == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        if name == "cosine_with_restarts":
            return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))
        if name == "polynomial":
            return (end_lr + (initial_lr - end_lr) * max(0.0, 1.0 - progress)) / initial_lr
        raise ValueError(f"unknown learning-rate schedule {name!r}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return after_warmup((step - warmup_steps) / decay_steps)

    after_warmup(0.0)  # an unknown name fails here, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=done_steps - 1)
