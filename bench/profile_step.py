"""Where a training step's GPU time goes, by kernel family, for one of our presets on a full-size model.

    python -m bench.profile_step [--models sdxl] [--configs fast] [--batch 8] [--steps 2] [--graphs]

Runs the preset's session (the Train node's code) with eager steps, so every kernel is visible to the profiler,
and prints for the profiled steps: GPU busy time per kernel family
(matmul, attention, convolution, normalization, elementwise, copies, optimizer, other) with its share, the
largest kernels, and busy time against wall time (the gap is time the GPU waited for the host). The step-time
targets are about what is left once CUDA graphs remove that gap, so this shows what a faster step must shrink.
`--graphs` profiles replayed CUDA graphs instead (the preset's fast path, after its capture): what the steps as
timed really run, for waits that eager steps hide, such as activation offload's copies against compute (CUPTI
traces the kernels inside graphs on CUDA 12; where it does not, busy time reads near zero). On CPU (`--tiny`)
it profiles CPU operators instead: a smoke test of the script."""
from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict
from dataclasses import replace

import torch

from bench.run import SPECS, free_device_memory, make_workload, presets, start_session

# Checked in order; the first family whose pattern matches a kernel's name wins.
FAMILIES = (
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("convolution", r"conv|implicit_gemm|fprop|dgrad|wgrad|winograd|cudnn"),
    ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|matmul|\bb?mm\b|addmm|baddbmm|linear"),
    ("normalization", r"norm|welford|moments"),
    ("optimizer", r"adam|lion|adafactor|optimizer|8bit|blockwise"),
    ("copies", r"copy|memcpy|memset|cat|transpose|contiguous|to_copy|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|silu|gelu|add|mul|div|reduce|sum|mean"),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def summarize(events, wall_s: float, steps: int, top: int = 12, cpu: bool = False) -> list[str]:
    """Lines of the report from profiler events (`key_averages()` rows): their device self time in µs, or with
    `cpu` (the CPU smoke mode) the operators' self CPU time in its place."""
    per_family: dict[str, float] = defaultdict(float)
    kernels = []
    for event in events:
        us = event.self_cpu_time_total if cpu else getattr(event, "self_device_time_total", 0)
        if us <= 0:
            continue
        per_family[family(event.key)] += us
        kernels.append((us, event.key))
    busy = sum(per_family.values()) / 1e6
    lines = [f"GPU busy {busy / steps:.4f} s/step of {wall_s / steps:.4f} s/step wall "
             f"({100 * busy / wall_s if wall_s else 0:.0f}% busy)"]
    for label, us in sorted(per_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:13} {us / 1e6 / steps:.4f} s/step  {100 * us / 1e6 / busy if busy else 0:5.1f}%")
    lines.append("largest kernels (s/step):")
    for us, name in sorted(kernels, reverse=True)[:top]:
        lines.append(f"  {us / 1e6 / steps:.4f}  {family(name):13} {name[:110]}")
    return lines


def profile(spec, preset: str, batch: int, steps: int, device: torch.device, graphs: bool = False) -> list[str]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    work = make_workload(spec, batch, device)
    memory = replace(presets()[preset], batch_size=batch)
    memory = memory if graphs else replace(memory, fast_path="off")
    warmup = 2 if graphs else 1
    session, _, _, _ = start_session(work, memory, warmup + steps)

    def run(n: int) -> None:  # the Train node's run, n more steps
        session.run(until=session.steps_done + n)

    run(warmup)  # warm-up: lazy initialisation, cuDNN/cuBLAS heuristics and capture stay out
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        run(steps)
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - started
    events = prof.key_averages()
    kind = "replayed CUDA graphs" if getattr(session.micro_step, "graphs", None) else "eager steps"
    header = f"{spec.name}@{spec.resolution} {preset} batch {batch}, {kind}: {session.memory.describe()}"
    session.close()
    free_device_memory(device)  # what the session still holds goes when this frame ends
    return [header, *summarize(events, wall, steps, cpu=not cuda)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sdxl")
    parser.add_argument("--configs", default="fast")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke model (sd15-tiny)")
    parser.add_argument("--graphs", action="store_true", help="profile replayed CUDA graphs, not eager steps")
    args = parser.parse_args(argv)
    import comfy.model_management
    device = comfy.model_management.get_torch_device()
    models = ["sd15-tiny"] if args.tiny else args.models.split(",")
    for model in models:
        for preset in args.configs.split(","):
            for line in profile(SPECS[model], preset, args.batch, args.steps, device, args.graphs):
                print(f"[profile] {line}", flush=True)


if __name__ == "__main__":
    main()
