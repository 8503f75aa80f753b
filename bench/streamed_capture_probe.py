"""Which ingredient of a streamed step breaks CUDA-graph capture under cudaMallocAsync (ComfyUI's default), and
whether a capture that holds trains like the eager steps. One child process per variant and allocator (an abort
kills only its child); prints one line each. GPU machine, after bench/server_gpu.sh (or its install step):

    PYTHONPATH=/tmp/site python3 -m bench.streamed_capture_probe [VARIANT ...]   # default: all
"""
import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).resolve().parents[1] / "tests" / "cuda_allocator_cases.py"
ALLOCATORS = {"native": "backend:native", "cudaMallocAsync": "backend:cudaMallocAsync"}
VARIANTS = ["streamed", "streamed_no_offload", "streamed_no_checkpoint", "resident_fp8", "norms_through_comfyui",
            "empty_cache_while_capturing"]


def main() -> None:
    for variant in sys.argv[1:] or VARIANTS:
        for allocator, conf in ALLOCATORS.items():
            env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
            run = subprocess.run([sys.executable, str(CASES), "probe", variant], env=env, capture_output=True,
                                 text=True, timeout=300)
            lines = [line for line in run.stdout.splitlines() if line.startswith("probe ")]
            if run.returncode == 0 and lines:
                print(lines[-1], flush=True)
            else:
                tail = [line for line in run.stderr.splitlines() if "rror" in line or "terminate" in line][-3:]
                print(f"probe {variant} allocator={allocator} exit={run.returncode} {' | '.join(tail)[:600]}",
                      flush=True)


if __name__ == "__main__":
    main()
