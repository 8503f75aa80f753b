#!/usr/bin/env bash
# The GPU campaign behind docs/BENCHMARKS.md, one command on the GPU machine (repo root, .gpu/ carried; see
# bench/prepare_gpu_carry.sh). Capped rows run in their own process so nothing one row leaves behind counts
# in another's cap. Usage: bash bench/gpu_campaign.sh OUT_DIR [STEPS]
set -uo pipefail
OUT="${1:?output folder}"; STEPS="${2:-27}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p .cache "$OUT" && tar xzf .gpu/comfyui.tgz -C .cache
run() { local name="$1"; shift; timeout "${LIMIT:-150}" python3 -m bench.run --out "$OUT/$name" "$@" 2>&1 \
  | grep -E "^\[bench\]|^(sd15|sdxl)@|OOM|error" | grep -v "^\s*$"; }
timeout 120 python3 -m bench.memory_breakdown --models sdxl --configs lean 2>&1 | grep "^\[breakdown\]" | head -5
# 30 steps (3 warm-up + STEPS timed) under per-process caps
run sdxl_lean_3 --models sdxl --configs lean@3 --steps "$STEPS" --warmup 3
run sdxl_leanest_2 --models sdxl --configs leanest@2 --steps "$STEPS" --warmup 3
run sd15_lean_1 --models sd15 --configs lean@1 --steps "$STEPS" --warmup 3
run sdxl_autofit_3 --models sdxl --configs autofit@3 --steps "$STEPS" --warmup 3
# ours vs both peers, same process, no cap
LIMIT=420 run table --models sd15,sdxl --steps 12 --warmup 3 --budget-s 400 \
  --configs fast,fast-eager,balanced,lean,lean-eager,leanest,gc+fp8,gc+8bit,diffusers,comfyui
cat "$OUT/table/table.txt" 2>/dev/null | tail -30
