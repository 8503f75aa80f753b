"""CUDA graphs under both CUDA allocators: PyTorch's native one and cudaMallocAsync, which ComfyUI's main.py
selects on NVIDIA GPUs unless started with --disable-cuda-malloc. Each scenario runs in a child process
(tests/cuda_allocator_cases.py): under cudaMallocAsync a wrong free of graph memory aborts the process."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("cuda_allocator_cases.py")
ALLOCATORS = {"native": "backend:native", "cudaMallocAsync": "backend:cudaMallocAsync"}
SCENARIOS = ["shape_captured_last_never_replayed", "rebuilt_mid_run", "with_offload", "with_compiled_code",
             "with_raw_compiled_code", "with_8bit_optimizer", "fp16_loss_scaling", "failed_capture",
             "capture_broken_by_cuda_gives_its_pool_back", "earlier_graph_kept_alive", "fp8_weights",
             "partly_streamed_fp8_weights", "streamed_fp8_weights", "prefetched_streamed_fp8_weights", "lora_dropout",
             "graph_over_budget_raises_before_capture"]

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need an NVIDIA GPU")


def _run(scenarios: list[str], allocator: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ALLOCATORS[allocator]}
    return subprocess.run([sys.executable, str(CASES), *scenarios], env=env, capture_output=True, text=True,
                          timeout=600)


@cuda
def test_freeing_graph_memory_before_its_first_launch_aborts_under_cuda_malloc_async():
    """Why the fast path launches each graph right after capture: this is the abort ComfyUI servers saw."""
    result = _run(["raw_free_before_launch"], "cudaMallocAsync")
    assert result.returncode != 0, result.stdout + result.stderr
    assert "captured allocation" in result.stderr


@cuda
@pytest.mark.parametrize("allocator", list(ALLOCATORS))
def test_graphed_steps_never_abort_the_process(allocator):
    """All scenarios in one child (CUDA start-up and compiles once); its output says which one was reached."""
    result = _run(SCENARIOS, allocator)
    passed = [s for s in SCENARIOS if f"ok {s} allocator={allocator}" in result.stdout]
    assert result.returncode == 0 and passed == SCENARIOS, \
        f"exit {result.returncode}, passed {passed}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"

