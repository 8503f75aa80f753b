"""Kernel micro-benchmarks at SDXL shapes: the two kernels campaign 7's profiles point at, each timed against
its memory-traffic floor and against an alternative, so that one device call says which change is worth making.

    python -m bench.kernels          # on CUDA: ms per SDXL step for each variant; on CPU: a smoke run, small shapes

1. GEGLU (compiled transformer layer, SDXL batch 8): its backward kernel took 22.8 ms per step, about 3x its
   memory traffic. Inductor writes `cat(d_value, d_gate)` as one pointwise kernel that computes both halves per
   element; `max_pointwise_cat_inputs=1` makes it write each half into its slice instead; splitting the
   projection into two matmuls needs no cat at all (timed with the matmuls, which the other variants also run).
2. fp8 upcast (lean, SDXL batch 1): 9.9 ms per step for about 2 x 1,700 weights. One kernel per weight, as the
   trainer does, against one kernel per group of weights (a flat fp8 buffer per group): is it launch-bound?
Both are timed by replaying CUDA graphs, as the trainer's fast path does."""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.run import SPECS  # importing bench.run also puts ComfyUI first on sys.path
from bridge.cast_weights import _castable_layers
from trainer.step.frozen_weights import FP8, dequantize

# SDXL at 1024², batch 8: tokens per layer and GEGLU width (half the projection), and how many layers of each
GEGLU_SHAPES = [(8 * 32 * 32, 5120, 60), (8 * 64 * 64, 2560, 10)]


def geglu(projected: torch.Tensor) -> torch.Tensor:
    """ComfyUI's GEGLU after its projection: value * gelu(gate)."""
    value, gate = projected.chunk(2, dim=-1)
    return value * F.gelu(gate)


def replay_ms(work, device: torch.device, reps: int = 20) -> float:
    """Milliseconds per call of `work` (no arguments), replayed from a CUDA graph; plain calls on the CPU."""
    if device.type != "cuda":
        work()  # compiling
        started = time.perf_counter()
        for _ in range(3):
            work()
        return (time.perf_counter() - started) / 3 * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: compiling, autotuning, lazy initialisation
            work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per ms a plain device copy moves (read + write): the floor's yardstick."""
    n = (1 << 28) if device.type == "cuda" else (1 << 22)
    source, target = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16, device=device)
    return 2 * n * 2 / replay_ms(lambda: target.copy_(source), device)


def projected_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ComfyUI's GEGLU with its (frozen) projection: one matmul, then the halves."""
    return geglu(F.linear(x, weight, bias))


def split_geglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The same math with the projection split in two matmuls (row slices of the same weight): backward writes
    the two halves' gradients as separate tensors, no cat."""
    half = weight.shape[0] // 2
    return F.linear(x, weight[:half], bias[:half]) * F.gelu(F.linear(x, weight[half:], bias[half:]))


GEGLU_VARIANTS = (("pointwise cat (default)", geglu, {}),
                  ("cat into slices", geglu, {"max_pointwise_cat_inputs": 1}),
                  ("with projection, default", projected_geglu, {}),
                  ("with projection, cat into slices", projected_geglu, {"max_pointwise_cat_inputs": 1}),
                  ("with projection split in two matmuls", split_geglu, {}))


def bench_geglu(device: torch.device, bandwidth: float, scale: int) -> list[str]:
    lines = []
    for variant, function, patch in GEGLU_VARIANTS:
        total = floor = 0.0
        for tokens, width, count in GEGLU_SHAPES:
            tokens, width = tokens // scale, width // scale
            dim = width // 4  # SDXL's feed-forward: 4x the layer width, doubled for the gate
            torch._dynamo.reset()
            compiled = torch.compile(function, dynamic=False, options=patch)
            upstream = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
            if function is geglu:
                inputs = [torch.randn(tokens, 2 * width, device=device, dtype=torch.bfloat16, requires_grad=True)]
            else:  # frozen projection, as with LoRA on attention only: backward needs the input's gradient
                inputs = [torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True),
                          torch.randn(2 * width, dim, device=device, dtype=torch.bfloat16) / dim ** 0.5,
                          torch.zeros(2 * width, device=device, dtype=torch.bfloat16)]

            def step():
                inputs[0].grad = None
                compiled(*inputs).backward(upstream)
            total += count * replay_ms(step, device)
            # forward reads 2N, writes N; backward reads 2N + N, writes 2N (N = tokens x width, bf16)
            floor += count * 8 * tokens * width * 2 / bandwidth
        lines.append(f"GEGLU forward + backward, {variant}: {total:.2f} ms per SDXL bs8 step "
                     f"(pointwise memory-traffic floor {floor:.2f} ms)")
    return lines


def sdxl_weight_shapes() -> list[torch.Size]:
    """The shapes of the weights fp8 storage converts, from ComfyUI's SDXL UNet built on the meta device."""
    import comfy.model_detection
    config = comfy.model_detection.model_config_from_unet_config(dict(SPECS["sdxl"].comfy_unet, dtype=torch.bfloat16))
    config.set_inference_dtype(torch.bfloat16, None)
    with torch.device("meta"):
        unet = config.get_model({}, "", device=torch.device("meta")).diffusion_model
    unet.requires_grad_(False)
    return [layer.weight.shape for layer in _castable_layers(unet)]


def bench_fp8(device: torch.device, bandwidth: float, scale: int, group: int = 12) -> list[str]:
    shapes = sdxl_weight_shapes()
    if scale > 1:
        shapes = [torch.Size([max(1, s[0] // scale), *s[1:]]) for s in shapes[:60]]
    weights = [torch.randn(s, device=device).to(FP8) for s in shapes]
    scales = [torch.tensor(0.01, device=device) for _ in shapes]
    # one flat fp8 buffer per `group` consecutive weights (about one transformer layer's)
    groups = [torch.cat([w.reshape(-1) for w in weights[i:i + group]]) for i in range(0, len(weights), group)]
    elements = sum(w.numel() for w in weights)
    floor = elements * 3 / bandwidth  # read 1 byte, write 2
    per_weight = replay_ms(lambda: [dequantize(w, s, torch.bfloat16) for w, s in zip(weights, scales)], device)
    per_group = replay_ms(lambda: [dequantize(g, scales[0], torch.bfloat16) for g in groups], device)
    return [f"fp8 upcast of {len(weights)} weights ({elements / 1e9:.2f} G elements), once: one kernel per weight "
            f"{per_weight:.2f} ms, one per {group} weights {per_group:.2f} ms (memory-traffic floor {floor:.2f} ms; "
            "a lean step upcasts twice: forward and recompute)"]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("geglu", "fp8"), default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = 1 if device.type == "cuda" else 64  # the CPU smoke run: same code, tiny shapes
    bandwidth = copy_bandwidth(device)
    lines = [f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (smoke run, small shapes)'}: "
             f"device copy {bandwidth * 1e3 / 1e9:.0f} GB/s (read + write)"]
    if args.only in (None, "geglu"):
        lines += bench_geglu(device, bandwidth, scale)
    if args.only in (None, "fp8"):
        lines += bench_fp8(device, bandwidth, scale)
    for line in lines:
        print(f"[kernels] {line}", flush=True)
    return lines


if __name__ == "__main__":
    main()
