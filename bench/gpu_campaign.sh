#!/usr/bin/env bash
# The GPU campaign behind docs/BENCHMARKS.md, on the GPU machine (repo root, .gpu/ carried; see
# bench/prepare_gpu_carry.sh). One device command runs at most 10 minutes, so the campaign comes in parts:
#   bash bench/gpu_campaign.sh OUT caps    # 30-step rows under per-process caps, each in its own process; product path
#   bash bench/gpu_campaign.sh OUT table   # ours vs both peers, same process, no cap (+ memory breakdown)
#   bash bench/gpu_campaign.sh OUT bs8     # batch 8 (MFU), with cuDNN autotune (ComfyUI's --fast autotune)
#   bash bench/gpu_campaign.sh OUT profile # eager step time by kernel family (bench/profile_step.py; GRAPHS=1: replayed graphs)
#   bash bench/gpu_campaign.sh OUT verify  # CUDA tests, rows changed since the last run, forced OOM (eager)
#   bash bench/gpu_campaign.sh OUT issue4  # issue 4's "Done when" rows in one bench run: both models, both peers, bs8, compile
#   bash bench/gpu_campaign.sh OUT compile # compile warm-up cold and again with inductor's on-disk caches
#   bash bench/gpu_campaign.sh OUT levers  # issue 32's levers on and off (selective checkpointing, the prefetch ring) + CUDA tests
#   bash bench/gpu_campaign.sh OUT agreement # every plan's LoRA after 50 steps against the fast plan's (LoRA Δ fast %)
#   bash bench/gpu_campaign.sh OUT splits  # auto-fit at batch 4: where the planner splits the batch, and what it costs
#   bash bench/gpu_campaign.sh OUT kernels # GEGLU backward and fp8 upcast kernels alone, with alternatives (bench/kernels.py)
#   bash bench/gpu_campaign.sh OUT setup   # only installs the carried wheels and unpacks ComfyUI (before other commands)
# Capped rows run in their own process so nothing one row leaves behind counts in another's cap.
set -uo pipefail
OUT="${1:?output folder}"; PART="${2:-table}"; STEPS="${STEPS:-27}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p .cache "$OUT" && tar xzf .gpu/comfyui.tgz -C .cache
run() { local name="$1"; shift; timeout "${LIMIT:-150}" python3 -m bench.run --out "$OUT/$name" "$@" 2>&1 \
  | grep -E "^\[bench\]|^(sd15|sdxl)@|OOM|error" | grep -v "^\s*$"
  python3 - "$OUT/$name/results.json" <<'PY' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    keep = [n for n in r.get("notes", []) if any(k in n for k in ("fast path", "auto-fit", "memory estimate", "allocated", "offload", "retried", "torch.compile"))]
    print("  ", r["config"], r["status"], r.get("where", ""), "|", " | ".join(keep)[:900])
PY
}
case "$PART" in
  setup) ;;
  compile)  # warm-up cold (each row from an empty inductor cache), then a new process finding the first row's caches
    # (a restarted ComfyUI) running it twice: the second time in the same process is a re-queued run (with autotune)
    rows=(${ROWS:-fast+compile:bs8 fast+compile-no-resblocks:bs8}); first=""
    for row in "${rows[@]}"; do
      export TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"; first="${first:-$TORCHINDUCTOR_CACHE_DIR}"
      LIMIT=200 run "cold_${row//[:+]/_}" --models "${MODELS:-sdxl}" --steps "${CSTEPS:-4}" --warmup 1 --configs "$row"
    done
    [ "${CACHED:-1}" = 1 ] && TORCHINDUCTOR_CACHE_DIR="$first" LIMIT=200 run cached --models "${MODELS:-sdxl}" --steps 6 --warmup 1 \
      --configs "${rows[0]},${rows[0]}:autotune"
    for name in "$OUT"/cold_* "$OUT"/cached; do tail -n +3 "$name/table.txt" 2>/dev/null | head -2; done ;;
  issue4)  # compile last: the bench's budget estimates each row from the slowest so far
    LIMIT=${LIMIT:-570} run issue4 --models sd15,sdxl --steps 8 --warmup 2 --budget-s "${BUDGET:-550}" --configs \
      "${CONFIGS:-fast,lean,diffusers,comfyui,sdxl/fast:bs8,sdxl/diffusers:bs8,sdxl/comfyui:bs8,sdxl/fast+compile:bs8,sdxl/fast+compile:bs8:autotune,sdxl/lean+compile,sdxl/fast+compile}"
    cat "$OUT/issue4/table.txt" 2>/dev/null | tail -14 ;;
  caps)
    for row in ${ROWS:-sdxl:lean@3 sdxl:leanest@2 sd15:leanest@1 sdxl:autofit@4 sdxl:autofit@6 sdxl:autofit@8}; do
      LIMIT=${ROW_LIMIT:-75} run "${row/:/_}" --models "${row%%:*}" --configs "${row#*:}" --steps "$STEPS" --warmup 3
    done
    # the Train node's own path: estimate accuracy per setting, base MODEL unchanged
    [ "${PRODUCT:-1}" = 1 ] && timeout 200 python3 -m bench.product_path --out "$OUT/product" --steps 24 --budget-s 170 2>&1 | grep -v "^{" | tail -17 ;;
  table)
    [ "${BREAKDOWN:-1}" = 1 ] && timeout 100 python3 -m bench.memory_breakdown --models sdxl --configs lean 2>&1 | grep "^\[breakdown\]" | head -5
    LIMIT=${LIMIT:-420} run table --models "${MODELS:-sd15,sdxl}" --steps 12 --warmup 3 --budget-s "${BUDGET:-400}" \
      --configs "${CONFIGS:-fast,fast-eager,balanced,lean,lean-eager,leanest,gc+fp8,gc+8bit,diffusers,comfyui}"
    cat "$OUT/table/table.txt" 2>/dev/null | tail -30 ;;
  bs8)
    LIMIT=${LIMIT:-500} run bs8 --models sdxl --steps 8 --warmup 2 --budget-s "${BUDGET:-480}" \
      --configs "${CONFIGS:-fast:bs8,fast:bs8:autotune,diffusers:bs8}"
    cat "$OUT/bs8/table.txt" 2>/dev/null | tail -8 ;;
  verify)  # what changed after the last GPU run: CUDA tests, capped rows, the forced OOM (eager steps)
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py tests/test_optimizers.py 2>&1 | tail -1
    for row in ${ROWS:-sdxl:lean+bf16w@3 sdxl:autofit@4 sd15:leanest@1}; do
      LIMIT=75 run "${row/:/_}" --models "${row%%:*}" --configs "${row#*:}" --steps "$STEPS" --warmup 3
    done
    timeout 120 python3 -m bench.product_path --out "$OUT/product" --steps 16 --only forced 2>&1 | grep -v "^{" | tail -3 ;;
  levers)  # issue 32's levers, each beside its row without it; their CUDA tests first (both allocators, each type in graphs)
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_allocators.py tests/test_fast_path.py tests/test_training_options.py \
      -k "allocators or prefetch or each_type_trains_in_cuda_graphs or graphed_steps_with_each_optimizer" 2>&1 | tail -3
    LIMIT=${LIMIT:-400} run levers --models sdxl --steps 110 --warmup 8 --budget-s "${BUDGET:-380}" --configs \
      "${CONFIGS:-fast,fast,balanced,balanced+sac,gc+fp8+8bit,gc+fp8+8bit+sac,stream20,stream20+prefetch,leanest,leanest+prefetch}"
    cat "$OUT/levers/table.txt" 2>/dev/null | tail -14 ;;
  agreement)  # the same seeded 50 steps per plan; a second fast row is the yardstick (README, "Memory and speed")
    LIMIT=${LIMIT:-560} run agreement --models "${MODELS:-sdxl}" --steps 50 --warmup 0 --budget-s "${BUDGET:-540}" --configs \
      "${CONFIGS:-fast,fast,balanced,balanced+sac,gc+8bit,gc+fp8,lean,leanest,leanest+prefetch,lean+bf16w,autofit@12,autofit@8,autofit@6,autofit@4,autofit@3}"
    cat "$OUT/agreement/table.txt" 2>/dev/null | tail -28 ;;
  splits)  # the planner's batch splits (planner.BATCH_EFFICIENCY, from batch 1 and 8 only) against the whole batch
    LIMIT=${LIMIT:-400} run splits --models sdxl --steps 30 --warmup 4 --budget-s "${BUDGET:-380}" --configs \
      "${CONFIGS:-fast:bs4,fast:bs2,balanced:bs4,autofit@16:bs4,autofit@12:bs4,autofit@8:bs4}"
    cat "$OUT/splits/table.txt" 2>/dev/null | tail -16 ;;
  kernels)  # GEGLU backward and the fp8 upcast against their memory-traffic floors and an alternative each
    timeout "${LIMIT:-300}" python3 -m bench.kernels 2>&1 | grep "^\[kernels\]" | tee "$OUT/kernels.txt" ;;
  profile)  # where eager step time goes, by kernel family: what a faster step (bs8 MFU, lean) must shrink
    for row in ${ROWS:-fast:8 lean:1 fast:1}; do
      timeout "${LIMIT:-150}" python3 -m bench.profile_step --models "${MODELS:-sdxl}" --configs "${row%%:*}" --batch "${row#*:}" ${GRAPHS:+--graphs} \
        --steps 2 2>&1 | grep "^\[profile\]" | tee -a "$OUT/profile.txt"
    done ;;
esac
# the device tool returns a limited number of files: one archive
tar czf "/tmp/results.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tgz "$OUT/"
