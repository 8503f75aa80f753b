#!/usr/bin/env bash
# GPU-machine check of CUDA graphs under both CUDA allocators (ComfyUI's default cudaMallocAsync and PyTorch's
# native one): the CUDA tests, then bench rows of the settings that aborted ComfyUI servers, in-process, under
# cudaMallocAsync. Usage: bash bench/gpu_allocators.sh OUT_DIR   (needs .gpu/ from bench/prepare_gpu_carry.sh)
set -uo pipefail
OUT="${1:?output folder}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p .cache "$OUT" && tar xzf .gpu/comfyui.tgz -C .cache
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync python3 - <<'PY'
import torch
x = torch.ones(1 << 20, device="cuda")
print("backend", torch.cuda.get_allocator_backend())
for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved", "reset_peak_memory_stats"):
    try:
        print(name, getattr(torch.cuda, name)())
    except Exception as error:
        print(name, "unavailable:", str(error).splitlines()[0])
free, total = torch.cuda.mem_get_info()
print("device used GiB", (total - free) / 2**30, "torch reserved GiB", torch.cuda.memory_reserved() / 2**30)
PY
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py tests/test_cuda_allocators.py -rA 2>&1 | tail -40 | tee "$OUT/cuda_tests.txt"
for row in "sd15:lean" "sdxl:lean" "sdxl:gc+fp8+8bit@6" "sdxl:fast+compile"; do
  model="${row%%:*}"; config="${row#*:}"
  PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync timeout 150 python3 -m bench.run --out "$OUT/${model}_${config//[@+]/_}" \
    --models "$model" --configs "$config" --steps 30 --warmup 3 --budget-s 120 2>&1 | grep -E "^\[bench\]|@|OOM|rror|fast path|terminate|captured" | head -20
  echo "exit[$row]=${PIPESTATUS[0]}"
done
