"""How the frozen base weights are stored during training.

fp8 (e4m3fn) storage halves the frozen weights' memory against fp16/bf16 (a quarter against fp32). Compute
stays in the compute dtype: layers that can cast per call (ComfyUI's ops: `comfy_cast_weights`) upcast each
weight only while that layer runs. With gradient checkpointing the upcast copies live for one block at a
time; without it autograd keeps them for backward, so fp8 pays off together with checkpointing.

ComfyUI's generic cast (`cast_bias_weight`) copies the fp8 weight, casts it to the *input's* dtype and then
applies weight functions: under autocast a conv after GroupNorm gets an fp32 input, so SDXL's largest convs
briefly held ~0.3 GiB of fp32 copies. fp8 Linear/Conv2d layers of the training copy therefore get their own
forward: one cast to the autocast dtype, the scale applied in place."""
from __future__ import annotations

import torch

from .allocator import compiled_kernels_blocked
from .errors import is_compile_error, is_out_of_memory, one_line
from .layer_patch import mix_into
from .layout import is_channels_last
from .settings import BaseWeights

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_SCALE = "leanlora_fp8_scale"  # the per-layer scale's buffer: fp32 whatever the compute dtype


class _Rescale:
    """Per-tensor scale applied after ComfyUI's per-call upcast (a `weight_function` of ComfyUI's ops); used
    for castable layer types without a dedicated fp8 forward."""

    def __init__(self, scale: float):
        self.scale = scale

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


def _compute_dtype(input: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(input.device.type):
        return torch.get_autocast_dtype(input.device.type)
    return input.dtype


class _Fp8Compute:
    """Mixin for fp8 Linear/Conv2d layers: replaces ComfyUI's `forward_comfy_cast_weights` with weight (and bias)
    to the input's device if streamed, one dequantizing upcast to the compute dtype, and the layer's op."""

    def forward_comfy_cast_weights(self, input: torch.Tensor) -> torch.Tensor:
        weight = dequantize(self.weight.to(input.device, non_blocking=True), getattr(self, FP8_SCALE),
                            _compute_dtype(input))
        bias = self.bias
        if bias is not None:
            bias = bias.to(input.device, weight.dtype, non_blocking=True)
        if isinstance(self, torch.nn.Conv2d):
            return self._conv_forward(input, weight, bias)
        return torch.nn.functional.linear(input, weight, bias)


def _dequantize_eager(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype).mul_(scale)  # PyTorch rounds the 0-dim fp32 scale to `dtype` first (≤ 2^-8 relative)


def _dequantize_fused(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * scale).to(dtype)


FUSED_DEVICES = ("cuda",)  # on CPU the eager form is as good
_fused_dequantize = None  # torch.compile'd on first use; False once it failed here
_fused_verified = False  # the compiled kernel ran once: later errors other than compiling are the step's own
fused_dequantize_failure: str | None = None  # why the compiled kernel is unavailable here, for the report


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 weight * its scale, in `dtype`. Eager PyTorch takes two passes with slow kernels (an unvectorized
    fp8 cast, a mixed-dtype multiply): 40 ms of an SDXL step with checkpointing on an H200, a third of the step.
    On CUDA one compiled elementwise kernel does both (one for every shape: flat, dynamic size). Inside a
    compiled block inductor fuses it into the block. Where compiling fails (no Triton, e.g. many Windows
    installs) the upcasts stay eager and the report says so."""
    global _fused_dequantize, _fused_verified, fused_dequantize_failure
    if torch.compiler.is_compiling():
        return _dequantize_fused(weight, scale, dtype)  # inductor fuses it into the compiled block
    if weight.device.type not in FUSED_DEVICES or _fused_dequantize is False or compiled_kernels_blocked():
        return _dequantize_eager(weight, scale, dtype)
    if _fused_dequantize is None:
        _fused_dequantize = torch.compile(_dequantize_fused, dynamic=True, fullgraph=True)
    flat, shape_like_weight = _memory_order_view(weight)
    try:
        fused = shape_like_weight(_fused_dequantize(flat, scale, dtype))
    except Exception as error:
        if is_out_of_memory(error) or (_fused_verified and not is_compile_error(error)):
            raise
        # the first call compiles: whatever fails there (dynamo, inductor, Triton missing) means "not here";
        # so does a compile error later (a new dtype or device recompiles)
        _fused_dequantize = False
        fused_dequantize_failure = one_line(error)
        return _dequantize_eager(weight, scale, dtype)
    _fused_verified = True
    return fused


def _memory_order_view(weight: torch.Tensor):
    """The weight as a flat view in memory order, and how to give a flat result the weight's shape and layout
    (a channels-last conv weight stays channels-last: reshaping it would copy, and cuDNN convert it back)."""
    if is_channels_last(weight):
        n, c, h, w = weight.shape
        return weight.permute(0, 2, 3, 1).reshape(-1), lambda flat: flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return weight.reshape(-1), lambda flat: flat.view(weight.shape)


def _castable_layers(module: torch.nn.Module, min_dim: int = 2):
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if hasattr(layer, "comfy_cast_weights") and isinstance(weight, torch.Tensor) and weight.dim() >= min_dim \
                and not weight.requires_grad:
            yield layer


def store_weights_fp8(module: torch.nn.Module) -> int:
    """Converts every frozen matmul/conv weight of a castable layer to fp8 in place. Returns bytes saved.

    Each tensor is scaled so its largest magnitude maps to fp8's largest: SD weights are mostly ~1e-2, where
    unscaled e4m3 is subnormal and keeps almost no precision."""
    saved = 0
    for layer in _castable_layers(module):
        weight = layer.weight
        if weight.dtype == FP8:
            continue
        scale = max(weight.detach().abs().max().item(), 1e-12) / FP8_MAX
        saved += weight.numel() * (weight.element_size() - 1)
        layer.weight = torch.nn.Parameter((weight.data.float() / scale).to(FP8), requires_grad=False)
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) and not layer.weight_function:
            layer.register_buffer(FP8_SCALE, torch.tensor(scale, device=weight.device), persistent=False)
            saved -= 4
            mix_into(layer, _Fp8Compute)
        else:
            layer.weight_function = [*layer.weight_function, _Rescale(scale)]  # per instance: the class list is shared
        layer.comfy_cast_weights = True  # upcast on every call
    return saved


def cast_frozen_weights(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Stores frozen floating weights (fp8 ones excepted) in the compute dtype. Autocast would otherwise make a
    cast copy of every fp16 weight in a bf16 run and keep it for backward: a second model's worth of memory."""
    frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    for name, tensor in [*frozen, *module.named_buffers()]:
        if name.endswith(FP8_SCALE):
            continue
        if tensor.is_floating_point() and tensor.dtype not in (FP8, dtype) and tensor.element_size() > 1:
            tensor.data = tensor.data.to(dtype)


def frozen_weight_bytes(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Bytes of frozen parameters and buffers (resident for the whole run), only those on `device` if given."""
    tensors = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if device is None or t.device == torch.device(device))


def stream_weights_from_cpu(module: torch.nn.Module) -> int:
    """Moves the frozen weights and biases of castable layers to pinned CPU memory; ComfyUI's ops then copy
    each layer's weights to the compute device just before it runs, on a side stream so the copy of the next
    layer overlaps the current one's compute. With gradient checkpointing only the block being recomputed
    holds device copies. Returns the bytes kept off the device."""
    moved = 0
    pin = torch.cuda.is_available()  # pinned pages let the copies run asynchronously on the side stream
    for layer in _castable_layers(module, min_dim=1):
        for name in ("weight", "bias"):
            tensor = getattr(layer, name, None)
            if tensor is None or tensor.requires_grad:
                continue
            moved += tensor.numel() * tensor.element_size()
            if tensor.device.type == "cpu" and (tensor.is_pinned() or not pin):
                continue
            host = tensor.data.to("cpu")
            setattr(layer, name, torch.nn.Parameter(host.pin_memory() if pin else host, requires_grad=False))
        layer.comfy_cast_weights = True
        layer.leanlora_streamed = True  # placement keeps this layer's weight and bias in CPU memory
    return moved


def device_bound(module: torch.nn.Module):
    """Every parameter and buffer that belongs on the compute device: all but streamed layers' frozen weights."""
    for layer in module.modules():
        streamed = getattr(layer, "leanlora_streamed", False)
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            if not (streamed and name in ("weight", "bias") and not tensor.requires_grad):
                yield tensor


def place_on_device(module: torch.nn.Module, device: torch.device) -> None:
    """Moves what belongs on `device` there in place (optimizers keep their references to the parameters).
    Trainable tensors go first, side by side: an optimizer that flattens them (FlatParameters) frees them all
    at once, and whole allocator segments are given back instead of holes between frozen biases (on SDXL those
    holes kept ~0.1 GiB reserved, enough to break a 3 GiB cap)."""
    tensors = sorted(device_bound(module), key=lambda t: not t.requires_grad)  # stable: module order otherwise
    for tensor in tensors:
        if tensor.device != torch.device(device):
            tensor.data = tensor.data.to(device)


def projected_weight_bytes(module: torch.nn.Module, compute_dtype: torch.dtype, base_weights: BaseWeights) -> int:
    """Device bytes the frozen weights will take under `base_weights`, before any conversion is made."""
    streamed, fp8 = base_weights.streamed, base_weights.fp8
    total = 0
    for layer in module.modules():
        castable = hasattr(layer, "comfy_cast_weights")
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            if getattr(tensor, "requires_grad", False) or not tensor.is_floating_point():
                continue
            if castable and streamed and name in ("weight", "bias"):
                continue
            size = 1 if (castable and fp8 and name == "weight" and tensor.dim() >= 2) else \
                torch.empty((), dtype=compute_dtype).element_size()
            total += tensor.numel() * size
    return total

