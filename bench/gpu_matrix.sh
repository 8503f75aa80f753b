#!/usr/bin/env bash
# The families x cards GPU matrix (issue 41) as device commands, one group each (bench/gpu_matrix.py GROUPS; every
# group fits one command: <= 560 s with setup, by the estimates `python -m bench.gpu_matrix --list` prints).
# On the GPU machine, repo root, carry [".gpu"] (bash bench/prepare_gpu_carry.sh: wheels, ComfyUI 0.3.75, the DiT
# tokenizers; ~22 MB):
#   LIMIT_S=560 bash bench/gpu_matrix.sh GROUP $OUT
# The exact commands, in priority order (device time is short; run from the top, stop where it runs out):
#   (a) the rows that failed before step 1 on 6 Dec (fits checks, 24 steps; Qwen-Image uncapped at 110 as × fast)
#     LIMIT_S=560 bash bench/gpu_matrix.sh qwen_a $OUT     # Qwen-Image uncapped, 24, 12 GiB   ~545 s (files built)
#     LIMIT_S=560 bash bench/gpu_matrix.sh qwen_b $OUT     # Qwen-Image 8, 6 GiB                ~450 s (~350 warm)
#     LIMIT_S=560 bash bench/gpu_matrix.sh wan_a $OUT      # Wan 2.1 T2V 24, 12, 8 GiB          ~495 s
#   (b) the tests CI skips for want of CUDA, under the native allocator and under cudaMallocAsync (junit + summary)
#     LIMIT_S=560 bash bench/gpu_matrix.sh cuda_tests $OUT
#   (c) the rest, at speed (110 steps), the base-identity / LoRA-loading checks on each family's 6 GiB row:
#     sd15_1 sdxl_1 sdxl_adapters_1 sdxl_adapters_2 z_image_speed_1 z_image_speed_2 generic_speed_1 generic_speed_2
#     flux_dev_speed_1..3 chroma_speed_1..3 wan_speed_1..4 qwen_image_speed_1..4   (--list: rows and estimates)
#   (d) issue 44 item 6, each auto-fit plan's LoRA after 50 seeded steps against the fast plan's (each group has its
#       own fast, second fast (yardstick) and fast-with-fp8 runs; summary.md ends with the agreement table):
#     sdxl_agreement_1 sdxl_agreement_2 flux_agreement_1..4 (FLUX.1's 8 GiB plans first)
# Rows a group's budget skipped: the same command again with ONLY="server,..." (a warm machine keeps the files in
# /tmp/gm_assets: no second build). EMULATION=fraction: the old per-process cap instead of the holder process.
# FITS_STEPS=N: the fits rows' steps (24). What comes back in $OUT: results.json (every job; copied every 10 s
# while running), table.md, summary.md (families x cards), console.txt (machine, holder, progress lines),
# logs.tgz (each server's ComfyUI log); cuda_tests: cuda_tests_{native,async}.{xml,txt}, cuda_tests_summary.md.
set -uo pipefail
GROUP="${1:?group: python -m bench.gpu_matrix --list}"; mkdir -p "${2:?output folder}"; OUT="$(cd "$2" && pwd)"
LIMIT_S="${LIMIT_S:-560}"
begun=$SECONDS
mkdir -p .cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  >/dev/null 2>&1 || echo "[gpu_matrix] pip install failed"
tar xzf .gpu/comfyui.tgz -C .cache
[ -f .gpu/dit_tokenizers.tgz ] && tar xzf .gpu/dit_tokenizers.tgz -C .cache/comfyui
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1
  free -g | head -2; df -h /tmp | tail -1; nproc; git log --oneline -1 2>/dev/null
} > "$OUT/console.txt" 2>&1
echo "[gpu_matrix] $GROUP: setup took $((SECONDS - begun)) s" | tee -a "$OUT/console.txt"

if [ "$GROUP" = cuda_tests ]; then
  # each allocator gets half of what is left; -v writes each outcome as it comes (the junit file only at the end)
  half=$(( (LIMIT_S - (SECONDS - begun) - 20) / 2 ))
  for allocator in native async; do
    if [ "$allocator" = async ]; then with=(env PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync); else with=(env -u PYTORCH_CUDA_ALLOC_CONF); fi
    "${with[@]}" timeout -k 10 "$half" python3 -m pytest -p bench.cuda_only -p no:cacheprovider tests/ -v -rfE \
      --durations=15 --junitxml="$OUT/cuda_tests_$allocator.xml" > "$OUT/cuda_tests_$allocator.txt" 2>&1
    rc=$?
    echo "[gpu_matrix] cuda_tests $allocator (${with[*]:1}): exit $rc after $((SECONDS - begun)) s; $(tail -1 "$OUT/cuda_tests_$allocator.txt")" \
      | tee -a "$OUT/console.txt"
  done
  python3 -m bench.cuda_only --summary "$OUT"/cuda_tests_*.xml | tee "$OUT/cuda_tests_summary.md"
  exit 0
fi

RUN="/tmp/gpu_matrix_$GROUP"
ASSETS=/tmp/gm_assets
( while sleep 10; do cp "$RUN/results.json" "$OUT/results.json" 2>/dev/null; done ) &
copier=$!
left=$((LIMIT_S - (SECONDS - begun)))
echo "[gpu_matrix] matrix budget $((left - 30)) s" | tee -a "$OUT/console.txt"
timeout -k 10 "$left" python3 -m bench.gpu_matrix --group "$GROUP" --out "$RUN" --assets "$ASSETS" \
  --comfyui .cache/comfyui --budget-s "$((left - 30))" --sampler-steps "${SAMPLER_STEPS:-2}" \
  --emulation "${EMULATION:-holder}" ${ONLY:+--only "$ONLY"} ${MATRIX_ARGS:-} \
  2>&1 | tee -a "$OUT/console.txt" | grep --line-buffered -E "^\[(matrix|assets|dit|holder|gpu_matrix)\]" | cut -c1-300
echo "[gpu_matrix] matrix exit code ${PIPESTATUS[0]} after $((SECONDS - begun)) s" | tee -a "$OUT/console.txt"
kill "$copier" 2>/dev/null
case "$GROUP" in *agreement*)  # the LoRA comparison, where the budget's timeout ended the matrix before it
  grep -q '"agreement": ' "$RUN/results.json" 2>/dev/null || python3 -m bench.gpu_matrix --agreement "$RUN" \
    >> "$OUT/console.txt" 2>&1 || echo "[gpu_matrix] the LoRA comparison failed (console.txt)" | tee -a "$OUT/console.txt" ;;
esac
cp "$RUN/results.json" "$RUN/table.md" "$OUT/" 2>/dev/null
python3 -m bench.gpu_matrix --summary "$OUT/results.json" > "$OUT/summary.md" 2>&1
(cd "$RUN" && tar czf "$OUT/logs.tgz" $(find servers -name comfyui.log) 2>/dev/null)
{ free -g | head -2; df -h /tmp | tail -1; } >> "$OUT/console.txt"
cat "$OUT/summary.md"
