"""Frozen base weights in plain torch terms: fp8 numbers and their upcast, casts to the compute dtype, placement.

fp8 (e4m3fn) storage halves the frozen weights' memory against fp16/bf16 (a quarter against fp32); each weight is
upcast (`dequantize`) only while its layer runs. Which layers store fp8 or stream from CPU, and how their forward
upcasts, is the model's business: ComfyUI's cast ops in bridge/cast_weights.py. A streamed layer is marked
`leanlora_streamed` so placement here keeps its weights in CPU memory."""
from __future__ import annotations

import contextlib
import gc

import torch

from ..device.allocator import compiled_kernels_blocked
from ..device.card import card_of, device_memory
from ..errors import is_compile_error, is_out_of_memory, one_line
from ..layout import is_channels_last

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_SCALE = "leanlora_fp8_scale"  # the per-layer scale's buffer: fp32 whatever the compute dtype
FP8_SCALE_VALUE = "leanlora_fp8_scale_value"  # the same scale as a Python float (the eager upcast's multiplier)
# Elements of a weight converted to fp8 at a time (bridge/cast_weights.store_weights_fp8): its fp32 temporary is at
# most 16 MiB. Whole, FLUX.1's largest layer (66M elements) held two fp32 temporaries of 0.25 GiB each.
FP8_CONVERSION_CHUNK = 1 << 22


def _dequantize_eager(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      scale_value: float | None = None) -> torch.Tensor:
    """The fused kernel's numbers: fp8 -> `dtype` is exact, then one rounding of the fp32 product. A Python-float
    scale is applied in fp32 (one pass); a 0-dim CUDA tensor would be rounded to `dtype` first (up to 2^-8
    relative: CUDA-graphed fp8 steps under cudaMallocAsync, which run this form, trained measurably differently
    from their eager steps), so without the float the product is taken in fp32 (an fp32 transient)."""
    if scale_value is not None:
        return weight.to(dtype).mul_(scale_value)
    return (weight.float() * scale).to(dtype)


def _dequantize_fused(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * scale).to(dtype)


class FusedUpcast:
    """fp8 weight * its scale as one compiled elementwise kernel (one for every shape: flat, dynamic size), for
    this process: compiled on first use, given up for good where compiling fails here, with the reason kept for
    the report (`failure`). Eager PyTorch takes two passes with slow kernels (an unvectorized fp8 cast, a
    mixed-dtype multiply): 40 ms of an SDXL step with checkpointing on an H200, a third of the step."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        self.devices = devices  # on CPU the eager form is as good
        self.kernel = None  # torch.compile'd on first use; False once it failed here
        self.verified = False  # the compiled kernel ran once: later errors other than compiling are the step's own
        self.failure: str | None = None  # why the compiled kernel is unavailable here

    def __call__(self, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                 scale_value: float | None = None) -> torch.Tensor:
        if weight.device.type not in self.devices or self.kernel is False or compiled_kernels_blocked() \
                or _launched_from_host(weight):
            return _dequantize_eager(weight, scale, dtype, scale_value)
        if self.kernel is None:
            self.kernel = torch.compile(_dequantize_fused, dynamic=True, fullgraph=True)
        flat, shape_like_weight = _memory_order_view(weight)
        try:
            fused = shape_like_weight(self.kernel(flat, scale, dtype))
        except Exception as error:
            if is_out_of_memory(error) or (self.verified and not is_compile_error(error)):
                raise
            # the first call compiles: whatever fails there (dynamo, inductor, Triton missing) means "not here";
            # so does a compile error later (a new dtype or device recompiles)
            self.kernel, self.failure = False, one_line(error)
            return _dequantize_eager(weight, scale, dtype, scale_value)
        self.verified = True
        return fused


_host_launched_steps = 0  # eager micro-steps under way (any thread: checkpointed recompute runs in autograd's own)


@contextlib.contextmanager
def host_launched_upcasts():
    """Around an eager CUDA micro-step that no capture follows: its kernels are launched one by one from Python,
    and there the compiled upcast's call (TorchDynamo's guards and wrappers, ~830 calls per SD1.5 step) costs
    more host time than the two eager kernels cost GPU time (SD1.5 fp8 eager steps on an H200: GPU busy 0.10 s of
    a 0.39 s step, a fifth of the forward's host time inside the compiled call). A CUDA graph's warm-up keeps the
    compiled kernel: it compiles there, outside the capture, and the capture records the one fused kernel for
    every replay. The numbers are the same either way (fp8 -> dtype is exact, then one rounding of the fp32
    product). A counter, not a context variable: autograd's thread must see it too."""
    global _host_launched_steps
    _host_launched_steps += 1
    try:
        yield
    finally:
        _host_launched_steps -= 1


def _launched_from_host(weight: torch.Tensor) -> bool:
    return _host_launched_steps > 0 and weight.is_cuda and not torch.cuda.is_current_stream_capturing()


_FUSED_UPCAST = FusedUpcast()  # one per process, as its compiled kernel is


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               scale_value: float | None = None) -> torch.Tensor:
    """fp8 weight * its scale, in `dtype`: on CUDA the fused kernel (FusedUpcast). Inside a compiled block
    inductor fuses it into the block. Where compiling fails (no Triton, e.g. many Windows installs) the upcasts
    stay eager, with the same numbers, and the report says so (fused_upcast_failure). `scale_value`: the scale
    as a Python float (the eager form's one-pass multiply)."""
    if torch.compiler.is_compiling():
        return _dequantize_fused(weight, scale, dtype)  # inductor fuses it into the compiled block
    return _FUSED_UPCAST(weight, scale, dtype, scale_value)


def fused_upcast_failure() -> str | None:
    """Why this process upcasts fp8 weights eagerly (None: the fused kernel works, or was never needed)."""
    return _FUSED_UPCAST.failure


def _memory_order_view(weight: torch.Tensor):
    """The weight as a flat view in memory order, and how to give a flat result the weight's shape and layout
    (a channels-last conv weight stays channels-last: reshaping it would copy, and cuDNN convert it back)."""
    if is_channels_last(weight):
        n, c, h, w = weight.shape
        return weight.permute(0, 2, 3, 1).reshape(-1), lambda flat: flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return weight.reshape(-1), lambda flat: flat.view(weight.shape)


def cast_frozen_weights(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Stores frozen floating weights (fp8 ones excepted) in the compute dtype. Autocast would otherwise make a
    cast copy of every fp16 weight in a bf16 run and keep it for backward: a second model's worth of memory."""
    frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    for name, tensor in [*frozen, *module.named_buffers()]:
        if name.endswith(FP8_SCALE) or tensor.numel() <= 1:  # scales (ours, a scaled-fp8 file's): nothing to
            continue                                              # save, and their precision is the weights'
        if tensor.is_floating_point() and tensor.dtype not in (FP8, dtype) and tensor.element_size() > 1:
            tensor.data = tensor.data.to(dtype)


def frozen_weight_bytes(module: torch.nn.Module, device: torch.device | None = None) -> int:
    """Bytes of frozen parameters and buffers (resident for the whole run), only those on `device` if given."""
    tensors = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
    memory = device_memory(device)
    if memory is not None:  # on a CPU test's simulated card, host tensors are CPU tensors too: the card tells
        return sum(t.numel() * t.element_size() for t in tensors if memory.holds(t))
    return sum(t.numel() * t.element_size() for t in tensors if device is None or t.device == torch.device(device))


def device_bound(module: torch.nn.Module):
    """Every parameter and buffer that belongs on the compute device: all but streamed layers' frozen weights."""
    for layer in module.modules():
        streamed = getattr(layer, "leanlora_streamed", False)
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            if not (streamed and name in ("weight", "bias") and not tensor.requires_grad):
                yield tensor


# On the training copy: addresses of the host storages the host application keeps alive, which the copy shares
# (ComfyUI's model: bridge/comfy_adapter._host_aliases). A frozen tensor placed from one of them remembers it under
# HOST_ORIGIN, (the placed copy's address, the host tensor), and goes back to it when parked (park_frozen_on_cpu,
# move_to_host) instead of to a new host copy: every rung that streamed more used to leave the newly streamed layers
# of an fp8 file as copies beside ComfyUI's pages (Qwen-Image at 8 GiB, 75% -> 86% streamed: ~2 GiB), and every
# park held a second host copy of all placed weights meanwhile.
HOST_STORAGES = "leanlora_host_storages"
HOST_ORIGIN = "leanlora_host_origin"


def _back_on_host(tensor: torch.Tensor, memory) -> torch.Tensor:
    """`tensor`'s values in host RAM: the host tensor its placement copied, where the host application keeps that
    and the device data is still the placed copy (same address, dtype, shape and strides), else a new copy."""
    kept = getattr(tensor, HOST_ORIGIN, None)
    if kept is not None:
        delattr(tensor, HOST_ORIGIN)
        placed_at, origin = kept
        data = tensor.data
        if data.untyped_storage().data_ptr() == placed_at and data.dtype == origin.dtype \
                and data.shape == origin.shape and data.stride() == origin.stride():
            return origin
    return memory.to_host(tensor.data)


def park_frozen_on_cpu(module: torch.nn.Module) -> None:
    """Moves the frozen tensors on the GPU to the CPU and gives their memory back, before a rung converts or
    streams them; place_on_device then puts what stays back side by side. Converted in place on the GPU, each fp8
    copy landed between the freed fp16 blocks: under cudaMallocAsync ~0.6 GiB of the pool stayed reserved around
    SD1.5's scattered fp8 weights, too much for a CUDA graph's pool on a 3 GiB card (steps ran eagerly, 22x)."""
    memory = card_of(device_bound(module))
    if memory is None:
        return
    frozen = [t for t in device_bound(module) if not t.requires_grad and memory.holds(t)]
    if not frozen:
        return
    for tensor in frozen:
        tensor.data = _back_on_host(tensor, memory)
    gc.collect()
    memory.empty_cache()


def place_on_device(module: torch.nn.Module, device: torch.device) -> None:
    """Moves what belongs on `device` there in place (optimizers keep their references to the parameters).
    Trainable tensors go first, side by side: an optimizer that flattens them (FlatParameters) frees them all
    at once, and whole allocator segments are given back instead of holes between frozen biases (on SDXL those
    holes kept ~0.1 GiB reserved, enough to break a 3 GiB cap)."""
    tensors = sorted(device_bound(module), key=lambda t: not t.requires_grad)  # stable: module order otherwise
    memory = device_memory(device)
    kept_by_host = getattr(module, HOST_STORAGES, frozenset())
    for tensor in tensors:
        data = tensor.data
        # the card's own move (a simulated card copies and counts); what is there already stays as it is
        placed = memory.place(data) if memory is not None else data.to(device)
        if placed is data:
            continue
        if hasattr(tensor, HOST_ORIGIN):
            delattr(tensor, HOST_ORIGIN)  # only the latest placement's source holds the placed values
        if not tensor.requires_grad and data.device.type == "cpu" and data.untyped_storage().data_ptr() in kept_by_host:
            setattr(tensor, HOST_ORIGIN, (placed.untyped_storage().data_ptr(), data))
        tensor.data = placed


def move_to_host(module: torch.nn.Module) -> None:
    """Every parameter and buffer of `module` that is on a GPU goes to host RAM (the training copy after the run:
    its LoRA is saved from there)."""
    tensors = [*module.parameters(), *module.buffers()]
    memory = card_of(tensors)
    if memory is None:
        return
    for tensor in tensors:
        if memory.holds(tensor):
            tensor.data = _back_on_host(tensor, memory)
