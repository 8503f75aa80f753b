"""fp8 storage and CPU streaming of the training copy's frozen weights, through ComfyUI's per-call cast ops.

Layers that can cast per call (ComfyUI's ops: `comfy_cast_weights`) upcast each weight only while that layer runs.
With gradient checkpointing the upcast copies live for one block at a time. In a block that is not recomputed, a
Linear layer keeps its fp8 weight for backward and upcasts again there (_ScaledLinear), so fp8 saves memory at any
checkpoint share; a conv's upcast copy stays for backward (autograd's conv keeps what it computed with).

ComfyUI's generic cast (`cast_bias_weight`) copies the fp8 weight, casts it to the *input's* dtype and then
applies weight functions: under autocast a conv after GroupNorm gets an fp32 input, so SDXL's largest convs
briefly held ~0.3 GiB of fp32 copies. fp8 Linear/Conv2d layers of the training copy therefore get their own
forward: one cast to the autocast dtype, the scale applied in place."""
from __future__ import annotations

import mmap

import torch

from .trainer_api import (FP8, FP8_CONVERSION_CHUNK, FP8_MAX, FP8_SCALE, FP8_SCALE_VALUE, PIN_IN_PLACE_MIN, BaseWeights,
                          dequantize, device_memory, fetch_streamed, mix_into, pin_in_place)


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


class UpcastGroup:
    """The fp8 layers of one block (a ResBlock, a transformer layer), upcast together: the first of them to run
    upcasts every member whose fp8 weight is on its device with one multi-tensor kernel (`_foreach_copy_` into
    the compute dtype, exact for e4m3), scales the conv members' copies with a second (`_foreach_mul_`), and each
    member takes its own as it runs. Linear members keep the unscaled copy: their scale is the GEMM's alpha
    (`scaled_linear`), which saves a read and a write of ~85% of SDXL's weights, twice per checkpointed step.
    One layer at a time it is two kernels per weight, ~1,700 upcasts per SDXL step with checkpointing, most of
    them small. In a ComfyUI server (H200, cudaMallocAsync, graphed steps) grouping took the 6 GiB card's SDXL
    step from 0.148 to 0.141 s, SD1.5's 3 GiB one from 0.039 to 0.036. A conv member's numbers are the per-layer
    upcast's (fp8 -> dtype exact, one fp32 multiply by the Python-float scale, one rounding).

    Active only while the block's forward runs (`_scoped`, installed inside checkpointing's wrapper, so the
    recompute in backward groups its upcasts too): what it upcast is the block's like any local tensor, gone when
    the forward returns or raises (nothing outlives a CUDA-graph capture)."""

    def __init__(self, layers: list[torch.nn.Module]):
        self.layers = layers
        self.ready: dict[int, torch.Tensor] = {}

    def weight_for(self, layer: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        weight = self.ready.pop(id(layer), None)
        if weight is not None and weight.dtype == dtype:
            return weight
        members = [m for m in self.layers if m.weight.dtype == FP8 and m.weight.device == device
                   and hasattr(m, FP8_SCALE_VALUE)]
        if not any(m is layer for m in members):
            return None
        upcast = [torch.empty_like(m.weight, dtype=dtype) for m in members]  # same strides: channels-last stays
        torch._foreach_copy_(upcast, [m.weight for m in members])
        scaled = [(w, getattr(m, FP8_SCALE_VALUE)) for m, w in zip(members, upcast) if not _scale_in_gemm(m)]
        if scaled:
            _scale_copies([w for w, _ in scaled], [scale for _, scale in scaled])
        self.ready = {id(m): w for m, w in zip(members, upcast) if m is not layer}
        return next(w for m, w in zip(members, upcast) if m is layer)


def _scale_copies(weights: list[torch.Tensor], scales: list[float]) -> None:
    """Multiplies each upcast copy by its Python-float scale in fp32, then rounds once (the per-layer upcast's
    numbers). On CUDA one multi-tensor kernel; the CPU's `_foreach_mul_` rounds each scale to the weights' dtype
    first (bf16: up to 2^-9 off), which a plain `mul_` does not."""
    if weights[0].is_cuda:
        torch._foreach_mul_(weights, scales)
        return
    for weight, scale in zip(weights, scales):
        weight.mul_(scale)


def _scale_in_gemm(layer: torch.nn.Module) -> bool:
    """Whether an fp8 layer can apply its scale in the GEMM (scaled_linear) instead of to a copy of the weight."""
    return isinstance(layer, torch.nn.Linear) and hasattr(layer, FP8_SCALE_VALUE)


class _ScaledLinear(torch.autograd.Function):
    """`input @ weight.T * scale + bias` with the scale as cuBLAS's alpha, applied in fp32 in the GEMM's epilogue
    (bias in its bias epilogue): no pass over the weight to scale it. Backward takes the input's gradient with
    the same alpha; the weight is frozen and has none. A Python-float scale: a CUDA graph records it as a
    constant. With `stored` (the fp8 tensor `weight` was upcast from, exactly) backward keeps that instead of the
    upcast copy and upcasts again: a layer whose block is not recomputed then holds 1 byte per weight until
    backward instead of 2 (what lets fp8 weights save memory without full checkpointing; one more upcast kernel)."""

    @staticmethod
    def forward(ctx, input, weight, bias, scale, stored=None):
        rows = input.reshape(-1, input.shape[-1])
        if bias is None:
            # beta=0: the first argument is never read (uninitialized is fine), only broadcast to the output's shape
            out = torch.addmm(rows.new_empty(()), rows, weight.t(), beta=0, alpha=scale)
        else:
            out = torch.addmm(bias, rows, weight.t(), alpha=scale)
        ctx.save_for_backward(weight if stored is None else stored)
        ctx.scale, ctx.dtype = scale, weight.dtype
        return out.view(*input.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        weight = weight.to(ctx.dtype)  # the fp8 values upcast again (exact), or already the upcast copy
        rows = grad.reshape(-1, grad.shape[-1])
        grad_input = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.addmm(rows.new_empty(()), rows, weight, beta=0, alpha=ctx.scale)
            grad_input = grad_input.view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_input, None, grad_bias, None, None


def scaled_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scale: float, stored: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight * scale, bias)` without the scaled copy of the weight (_ScaledLinear); `stored`:
    the fp8 tensor `weight` is the exact upcast of, kept for backward instead of it."""
    return _ScaledLinear.apply(input, weight, bias, scale, stored)


_ACTIVE_GROUPS: list[UpcastGroup] = []  # the blocks whose forward runs now (any thread: recompute runs in autograd's)


def _scoped(forward, group: UpcastGroup):
    def run(*args, **kwargs):
        _ACTIVE_GROUPS.append(group)
        try:
            return forward(*args, **kwargs)
        finally:
            _ACTIVE_GROUPS.pop()
            group.ready = {}
    run.leanlora_upcast_group = group
    return run


def group_upcasts(blocks) -> int:
    """Makes each block's castable Linear/Conv2d layers one UpcastGroup, active while the block's forward runs.
    Call before checkpointing wraps the blocks (the group is then active in the recompute too) and after compiling
    (inside compiled code the upcast is inductor's, fused into the block). Returns how many blocks were grouped."""
    count = 0
    for block in blocks:
        if getattr(block.forward, "leanlora_upcast_group", None) is not None:
            continue
        layers = [m for m in block.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
                  and hasattr(m, "comfy_cast_weights")]
        if not layers:
            continue
        group = UpcastGroup(layers)
        for layer in layers:
            layer.leanlora_upcast_group = group
        block.forward = _scoped(block.forward, group)
        count += 1
    return count


def _grouped_weight(layer: torch.nn.Module, input: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    if torch.compiler.is_compiling():
        return None
    group = getattr(layer, "leanlora_upcast_group", None)
    if group is None or not _ACTIVE_GROUPS or _ACTIVE_GROUPS[-1] is not group:
        return None
    return group.weight_for(layer, input.device, dtype)


class _Fp8Compute:
    """Mixin for fp8 Linear/Conv2d layers: replaces ComfyUI's `forward_comfy_cast_weights` with weight (and bias)
    to the input's device if streamed, one upcast to the compute dtype (its block's grouped upcast where there is
    one), and the layer's op. A Linear layer upcasts the fp8 values exactly (one cast kernel) and takes its scale
    as the GEMM's alpha (scaled_linear), so eager steps, graphs and every allocator compute the same numbers.
    Inside compiled blocks inductor fuses the scale into the upcast, and the layer computes with the scaled copy."""

    def forward_comfy_cast_weights(self, input: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(input)
        streamed = getattr(self, "leanlora_streamed", False)
        # a streamed layer's weight and bias come over from CPU RAM, fetched ahead while a step prefetches
        stored, bias = fetch_streamed(self, input.device) if streamed else (self.weight, self.bias)
        if bias is not None:
            bias = bias.to(input.device, dtype, non_blocking=True)
        # Compiled code never touches the Python-float scale, not even hasattr: dynamo (torch 2.11) guards the
        # float's value, and every layer's differs, so each block would compile anew (SDXL lean + compile was still
        # compiling after 230 s). It reads the scale from the layer's buffer instead.
        compiling = torch.compiler.is_compiling()
        scale_in_gemm = not compiling and _scale_in_gemm(self)
        weight = _grouped_weight(self, input, dtype)  # the group follows the same rule (never while compiling)
        if weight is None:
            stored = stored.to(input.device, non_blocking=True)
            weight = stored.to(dtype) if scale_in_gemm else dequantize(
                stored, getattr(self, FP8_SCALE), dtype, None if compiling else getattr(self, FP8_SCALE_VALUE, None))
        if isinstance(self, torch.nn.Conv2d):
            return self._conv_forward(input, weight, bias)
        if scale_in_gemm:  # the fp8 values exactly (e4m3 -> dtype is exact): the scale is the GEMM's alpha
            # Outside recomputed blocks backward comes long after: keep the fp8 weight, not the copy (2x the bytes).
            # Inside one the copy lives only through the block's own backward: keep it, no second upcast.
            keep = None if getattr(self, "leanlora_recomputed", False) else stored
            return scaled_linear(input.to(dtype), weight, bias, getattr(self, FP8_SCALE_VALUE), keep)
        return torch.nn.functional.linear(input, weight, bias)


def _castable_layers(module: torch.nn.Module, min_dim: int = 2):
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if hasattr(layer, "comfy_cast_weights") and isinstance(weight, torch.Tensor) and weight.dim() >= min_dim \
                and not weight.requires_grad:
            yield layer


def _fp8_computed(layer: torch.nn.Module) -> bool:
    """Whether store_weights_fp8 gives (or gave) this layer the fp8 forward of _Fp8Compute: the layers of an fp8
    file (UNETLoader's fp8_e4m3fn, a scaled-fp8 file with one scale per weight) as well as those it converts."""
    scale_weight = getattr(layer, "scale_weight", None)
    return isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)) and hasattr(layer, "comfy_cast_weights") \
        and not getattr(layer, "weight_function", ()) and layer.weight.dim() >= 2 and not layer.weight.requires_grad \
        and (not isinstance(scale_weight, torch.Tensor) or scale_weight.numel() == 1)


def _give_fp8_forward(layer: torch.nn.Module, scale: float) -> None:
    """The layer computes through _Fp8Compute with its fp8 weight times `scale` (its buffer and Python float)."""
    layer.register_buffer(FP8_SCALE, torch.tensor(scale, dtype=torch.float32, device=layer.weight.device),
                          persistent=False)
    setattr(layer, FP8_SCALE_VALUE, float(layer.get_buffer(FP8_SCALE)))  # the buffer's fp32 value
    mix_into(layer, _Fp8Compute)


def _adopt_file_fp8(layer: torch.nn.Module) -> None:
    """A layer that came from the file in fp8 gets the same forward as a converted one, so that streaming,
    grouped upcasts and the GEMM's scale treat both alike (the static plan counts such a layer as streamable: left
    on ComfyUI's own cast it stayed on the GPU, and Qwen-Image's fp8 file overflowed 8 and 12 GiB cards while
    being placed). A scaled-fp8 file's `scale_weight` becomes the layer's scale, and 1 in its own place, so that
    nothing applies it twice."""
    if not _fp8_computed(layer) or isinstance(layer, _Fp8Compute):
        return
    scale_weight = getattr(layer, "scale_weight", None)
    scale = 1.0
    if isinstance(scale_weight, torch.Tensor):
        scale = float(scale_weight.float())
        layer.scale_weight = torch.nn.Parameter(torch.ones_like(scale_weight), requires_grad=False)
    _give_fp8_forward(layer, scale)


def _fp8_tensor(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """An empty fp8 tensor. In host RAM from PIN_IN_PLACE_MIN bytes on, on pages of its own (an anonymous mapping):
    malloc puts tensors up to 32 MiB side by side in its heap once a process has freed one of that size (ComfyUI
    has), two of them then share a page, and the driver refuses to page-lock a range whose page another registered
    tensor holds (device.card.pin_in_place), so streaming pinned a copy instead, in PyTorch's pinned cache, rounded up
    to a power of two (FLUX.1's 9 MiB layers: 16 MiB). On pages of its own it is page-locked where it lies, and
    once placed on the GPU its host memory goes back to the system at once instead of staying in malloc's heap."""
    numel = shape.numel()
    if device.type != "cpu" or numel < PIN_IN_PLACE_MIN:
        return torch.empty(shape, dtype=FP8, device=device)
    pages = mmap.mmap(-1, numel)  # unmapped when the tensor's storage, which holds the mapping, is freed
    return torch.frombuffer(pages, dtype=torch.uint8, count=numel).view(FP8).view(shape)


def _to_fp8(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """`(weight.float() / scale).to(FP8)`, FP8_CONVERSION_CHUNK elements at a time: the same numbers (each element
    upcast, divided, rounded once), with one fp32 temporary of a chunk instead of two of the whole weight (the host
    RAM a bf16 file's conversion takes beside the fp8 copies; trainer/memory/host_ram.py counts it). A weight not
    contiguous (a channels-last conv) converts whole, keeping its layout."""
    if not weight.is_contiguous():
        return (weight.float() / scale).to(FP8)
    converted = _fp8_tensor(weight.shape, weight.device)
    flat, out = weight.reshape(-1), converted.view(-1)
    # one buffer for every chunk (a new one each time could miss the freed one's place in malloc's heap), and a copy
    # even of an fp32 weight (.float() would return the weight itself: divided in place, ComfyUI's own)
    buffer = torch.empty(min(flat.numel(), FP8_CONVERSION_CHUNK), dtype=torch.float32, device=weight.device)
    for start in range(0, flat.numel(), FP8_CONVERSION_CHUNK):
        source = flat[start:start + FP8_CONVERSION_CHUNK]
        piece = buffer[:source.numel()]
        piece.copy_(source)
        out[start:start + source.numel()].copy_(piece.div_(scale))
    return converted


def store_weights_fp8(module: torch.nn.Module) -> int:
    """Converts every frozen matmul/conv weight of a castable layer to fp8 in place. Returns bytes saved.

    Each tensor is scaled so its largest magnitude maps to fp8's largest: SD weights are mostly ~1e-2, where
    unscaled e4m3 is subnormal and keeps almost no precision. Weights already fp8 (the file's) keep their values."""
    saved = 0
    for layer in _castable_layers(module):
        weight = layer.weight
        if weight.dtype == FP8:
            _adopt_file_fp8(layer)
            continue
        low, high = torch.aminmax(weight.detach())  # the largest magnitude without an abs() copy of the weight
        scale = max(-low.item(), high.item(), 1e-12) / FP8_MAX
        saved += weight.numel() * (weight.element_size() - 1)
        layer.weight = torch.nn.Parameter(_to_fp8(weight.data, scale), requires_grad=False)
        if _fp8_computed(layer):
            _give_fp8_forward(layer, scale)
            saved -= 4
        else:
            layer.weight_function = [*layer.weight_function, _Rescale(scale)]  # per instance: the class list is shared
        layer.comfy_cast_weights = True  # upcast on every call
    return saved


def rank_streaming(layer_rows) -> None:
    """Gives each (layer, rows) its rows: the multiply-adds its forward does per weight element (the family's
    cost model: tokens it runs on, 1 for a modulation that reads the timestep's vector). streamed_layers streams
    the most first: with the prefetch ring a layer's copy runs beside compute, and one whose compute outlasts its
    copy streams nearly free. Set once per training copy, before anything streams (the order must not change
    under a share already streamed)."""
    for layer, rows in layer_rows:
        layer.leanlora_stream_rows = rows


def streamed_layers(module: torch.nn.Module, share: float = 1.0) -> list[torch.nn.Module]:
    """The fp8-computed layers that stream at `share`: the most multiply-adds per weight byte first
    (rank_streaming's rows; a layer no family ranked counts none), the largest weights first among equals, until
    they hold `share` of the elements. A larger share streams a superset (the order depends on shapes alone, the
    same before and after fp8), so a rung that streams more only adds layers. Largest first among equals keeps the
    copies few and long: each copy has its own launch."""
    layers = [layer for layer in module.modules() if _fp8_computed(layer)]  # before and after store_weights_fp8
    by_size = sorted(layers, key=lambda layer: (-getattr(layer, "leanlora_stream_rows", 0),
                                                -layer.weight.numel()))  # stable: module order among equals
    total, taken, chosen = sum(layer.weight.numel() for layer in layers), 0, []
    wanted = share * total
    for layer in by_size:
        if taken >= wanted - 1e-6 * total:  # float slack: share 1 takes every layer
            break
        chosen.append(layer)
        taken += layer.weight.numel()
    return chosen


def stream_costs(module: torch.nn.Module, share: float) -> tuple[list[tuple[int, int]], int]:
    """The streaming time model's terms (trainer/memory/planner.streaming_time): (fp8 weight bytes, multiply-adds
    per image) of each layer that streams at `share`, and the multiply-adds per image of every ranked layer (the
    step's matmul work)."""
    layers = [layer for layer in module.modules() if _fp8_computed(layer)]
    work = lambda layer: getattr(layer, "leanlora_stream_rows", 0) * layer.weight.numel()  # noqa: E731
    return ([(layer.weight.numel(), work(layer)) for layer in streamed_layers(module, share)],
            sum(work(layer) for layer in layers))


def stream_weights_from_cpu(module: torch.nn.Module, share: float = 1.0) -> int:
    """Moves the frozen weights and biases of the fp8 Linear/Conv2d layers (store_weights_fp8 first) that stream
    at `share` (streamed_layers) to pinned CPU memory; their forward copies them to the compute device on the
    current stream just before the layer runs. With gradient checkpointing only the block being recomputed holds
    device copies. Returns the bytes kept off the device.

    Every other layer (norms: a few MB; the fp8 layers beyond `share`) stays on the device. Streamed through
    ComfyUI's generic cast, a layer is copied on ComfyUI's offload streams and its copy freed there; under
    cudaMallocAsync a free is stream work, and inside a CUDA-graph capture that work lands on a stream the capture
    never joins again."""
    moved = 0
    pin = torch.cuda.is_available()  # pinned pages let the host-to-device copies run asynchronously
    for layer in streamed_layers(module, share):
        if not isinstance(layer, _Fp8Compute):
            continue
        for name in ("weight", "bias"):
            tensor = getattr(layer, name, None)
            if tensor is None or tensor.requires_grad:
                continue
            moved += tensor.numel() * tensor.element_size()
            memory = device_memory(tensor.device)  # a CPU test's simulated card holds CPU tensors too
            if memory is not None and memory.holds(tensor):
                host = memory.to_host(tensor.data, pinned=pin)
            elif tensor.is_pinned() or not pin:
                continue  # in host RAM as streaming wants it already
            else:  # ComfyUI's own pages where the copy shares them (comfy_adapter._host_aliases): no second copy
                host = pin_in_place(tensor.data)
            setattr(layer, name, torch.nn.Parameter(host, requires_grad=False))
        layer.leanlora_streamed = True  # placement keeps this layer's weight and bias in CPU memory
    return moved


def projected_weight_bytes(module: torch.nn.Module, compute_dtype: torch.dtype, base_weights: BaseWeights,
                           stream_share: float = 1.0) -> int:
    """Device bytes the frozen tensors will take under `base_weights` (streaming `stream_share` of them), before
    any conversion is made: every parameter and buffer that placement (frozen_weights.device_bound) puts on the
    device, each as it will be stored there (fp8 weights, the file's included, at 1 byte; other floating tensors in
    the compute dtype, as cast_frozen_weights stores them)."""
    fp8 = base_weights.fp8
    streamed = {id(layer) for layer in streamed_layers(module, stream_share)} if base_weights.streamed else set()
    compute_size = torch.empty((), dtype=compute_dtype).element_size()
    total = 0
    for layer in module.modules():
        castable = hasattr(layer, "comfy_cast_weights")
        for name, tensor in [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]:
            if getattr(tensor, "requires_grad", False):
                continue  # LoRA parameters: the estimate counts them apart
            if id(layer) in streamed and name in ("weight", "bias"):
                continue
            if tensor.dtype == FP8 or (castable and fp8 and name == "weight" and tensor.dim() >= 2):
                size = 1
            elif tensor.is_floating_point() and tensor.element_size() > 1 and tensor.numel() > 1 \
                    and not name.endswith(FP8_SCALE):
                size = compute_size  # cast_frozen_weights' rule
            else:
                size = tensor.element_size()
            total += tensor.numel() * size
        if fp8 and _fp8_computed(layer) and not hasattr(layer, FP8_SCALE):
            total += 4  # the fp32 scale store_weights_fp8 will give it (stays on the device, streamed or not)
    return total
