#!/usr/bin/env bash
# The GPU server matrix, as one device command on the GPU machine (repo root, .gpu/ carried; see
# bench/prepare_gpu_carry.sh, run with ComfyUI 0.33's source for the v033 plan):
#   bash bench/server_gpu.sh PLAN OUT_DIR      PLAN: core | cards | more | extra | all | v033 | resume | requeue | soak | soak5000   (python -m bench.server_matrix --plan P --list)
# Installs the carried wheels into /tmp/site, unpacks ComfyUI (0.3.75; for v033 also 0.33), runs the plan with a
# time budget that ends the whole command within LIMIT_S (default 530 s), and leaves four files in OUT_DIR:
# results.json (every job), table.md, console.txt (nvidia-smi + the matrix's progress lines), logs.tgz (each
# ComfyUI server's log). Weights and the servers' folders stay in /tmp (OUT_DIR is what comes back).
# MATRIX_ARGS passes more flags, e.g. MATRIX_ARGS="--only sdxl_6_default" or "--cards 4,6".
# Runs longer than one device command (the 5,000-step soak): DETACH=1 MATRIX_BUDGET_S=1500 starts the matrix in its
# own process session (it outlives the command while the machine stays held) and waits LIMIT_S; the same command
# again, within the machine's idle release (~30 s), finds it running, waits for it up to LIMIT_S more and collects.
set -uo pipefail
PLAN="${1:?plan: core, more, extra, all, v033 or resume}"; mkdir -p "${2:?output folder}"; OUT="$(cd "$2" && pwd)"
LIMIT_S="${LIMIT_S:-530}"
begun=$SECONDS
RUN="/tmp/leanlora_matrix_$PLAN"
finish() {  # what comes back: the results so far, the console, the servers' logs
  cp "$RUN/results.json" "$RUN/table.md" "$OUT/" 2>/dev/null
  cat "$RUN.console" >> "$OUT/console.txt" 2>/dev/null
  (cd "$RUN" && tar czf "$OUT/logs.tgz" $(find servers -name comfyui.log) 2>/dev/null)
  grep -E "^\[(matrix|assets|server_gpu)\]" "$OUT/console.txt" | cut -c1-400 | tail -40
  cat "$OUT/table.md" 2>/dev/null
}
wait_detached() {  # until the detached matrix ends or LIMIT_S is up
  pid="$(cat "$RUN.pid")"
  while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - begun)) -lt $((LIMIT_S - 15)) ]; do sleep 5; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "[server_gpu] the matrix (pid $pid) is still running after $((SECONDS - begun)) s: run the same command again within ~30 s to collect it" | tee -a "$OUT/console.txt"
  else
    echo "[server_gpu] the detached matrix ended; $((SECONDS - begun)) s in this command" | tee -a "$OUT/console.txt"
  fi
  finish
}
if [ -f "$RUN.pid" ] && kill -0 "$(cat "$RUN.pid")" 2>/dev/null; then  # the second command of a detached run
  echo "[server_gpu] collecting the detached $PLAN matrix (pid $(cat "$RUN.pid"))" | tee "$OUT/console.txt"
  wait_detached; exit 0
fi
mkdir -p .cache
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" >/dev/null 2>&1 \
  || echo "[server_gpu] pip install of $* failed"; }
install .gpu/whl/*.whl
tar xzf .gpu/comfyui.tgz -C .cache
COMFY=.cache/comfyui
if [ "$PLAN" = v033 ]; then
  [ -f .gpu/033/comfyui.tgz ] || { echo "[server_gpu] no .gpu/033/: run bench/prepare_gpu_carry.sh <0.33 source>"; exit 2; }
  install .gpu/033/whl/*.whl
  rm -rf .cache/comfyui033 && mkdir -p .cache/comfyui033 && tar xzf .gpu/033/comfyui.tgz -C .cache/comfyui033 --strip-components=1
  COMFY=.cache/comfyui033
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  python3 -c "import torch, torchaudio; print('torch', torch.__version__, 'torchaudio', torchaudio.__version__)" 2>&1 | tail -1
} > "$OUT/console.txt" 2>&1
left=$((LIMIT_S - (SECONDS - begun)))
if [ "${DETACH:-0}" = 1 ]; then
  budget="${MATRIX_BUDGET_S:?DETACH=1 needs MATRIX_BUDGET_S: the time budget of the matrix in seconds}"
  echo "[server_gpu] setup took $((SECONDS - begun)) s; detached matrix budget $budget s" | tee -a "$OUT/console.txt"
  setsid nohup timeout -k 10 "$((budget + 60))" python3 -m bench.server_matrix --plan "$PLAN" --out "$RUN" \
    --comfyui "$COMFY" --budget-s "$budget" ${MATRIX_ARGS:-} > "$RUN.console" 2>&1 < /dev/null &
  echo $! > "$RUN.pid"
  wait_detached; exit 0
fi
echo "[server_gpu] setup took $((SECONDS - begun)) s; matrix budget $((left - 20)) s" | tee -a "$OUT/console.txt"
# the matrix stops starting jobs at its budget; timeout is the backstop (SIGTERM: it stops its servers first)
timeout -k 10 "$left" python3 -m bench.server_matrix --plan "$PLAN" --out "$RUN" --comfyui "$COMFY" \
  --budget-s "$((left - 20))" ${MATRIX_ARGS:-} >> "$OUT/console.txt" 2>&1
echo "[server_gpu] matrix exit code $? after $((SECONDS - begun)) s" >> "$OUT/console.txt"
finish
