"""Where the memory of one training step goes, phase by phase, for our presets on a full-size model (GPU).

    python -m bench.memory_breakdown [--models sdxl] [--configs lean]

Prints, in GiB: resident after setup (weights, LoRA, optimizer), allocated after the forward pass (what the
backward pass will need: saved activations / checkpoint inputs), the step's peak, and the bytes autograd saved
for backward outside checkpointed blocks, grouped by tensor size."""
from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace

import torch

from bench.run import GIB, SPECS, free_device_memory, make_workload, presets, start_session


def breakdown(spec, preset: str, device: torch.device) -> None:
    work = make_workload(spec, 1, device)
    session, estimate, _, _ = start_session(work, replace(presets()[preset], fast_path="off"), 10, start_on_cpu=True)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated(device)
    saved = Counter()

    def pack(tensor):
        if tensor.is_cuda:
            saved[(tuple(tensor.shape), str(tensor.dtype))] += 1
        return tensor

    import contextlib
    torch.cuda.reset_peak_memory_stats(device)
    offload = session.micro_step.offload
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with session.precision.autocast(), offload.saving() if offload else contextlib.nullcontext():
            loss = session.loss(next(session.data))
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated(device)
    forward_peak = torch.cuda.max_memory_allocated(device)
    loss.backward()
    if offload:
        offload.finish()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    saved_bytes = sum(n * torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, d.split(".")[1])).element_size()
                      for (shape, d), n in saved.items())
    print(f"[breakdown] {spec.name} {preset}: {session.memory.describe()}")
    print(f"[breakdown]   {estimate.format()}")
    print(f"[breakdown]   resident after setup {static / GIB:.3f}; after forward {after_forward / GIB:.3f} "
          f"(+{(after_forward - static) / GIB:.3f}); forward peak {forward_peak / GIB:.3f}; step peak {peak / GIB:.3f}; "
          f"reserved {torch.cuda.max_memory_reserved(device) / GIB:.3f}")
    if offload:
        print(f"[breakdown]   offloaded to CPU RAM: {offload.offloaded_bytes / GIB:.3f} GiB")
    print(f"[breakdown]   saved for backward outside checkpoints (hook view, may double count views): "
          f"{saved_bytes / GIB:.3f} GiB in {sum(saved.values())} tensors; largest:")
    by_size = sorted(saved.items(), key=lambda kv: -kv[1] * torch.Size(kv[0][0]).numel())
    for (shape, dtype), n in by_size[:12]:
        print(f"[breakdown]     {n:4d} x {shape} {dtype}")
    session.close()
    del session, loss
    free_device_memory(device)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="sdxl")
    p.add_argument("--configs", default="lean")
    args = p.parse_args()
    import comfy.model_management
    device = comfy.model_management.get_torch_device()
    for model in args.models.split(","):
        for preset in args.configs.split(","):
            breakdown(SPECS[model], preset, device)


if __name__ == "__main__":
    main()
