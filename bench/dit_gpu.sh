#!/usr/bin/env bash
# The DiT server matrix (bench/dit_matrix.py) as one device command on the GPU machine (repo root, .gpu/ carried:
# bash bench/prepare_gpu_carry.sh, which also builds .gpu/dit_tokenizers.tgz: Qwen2.5's tokenizer (Qwen-Image;
# Z-Image's Qwen3 reads it too), T5's (FLUX.1-dev, Chroma) and T5 pile's (its SentencePiece model goes into the
# random umt5-xxl file as `spiece_model`, which CLIPLoader type wan reads). The issue-41 matrix: bench/gpu_matrix.sh.
#   LIMIT_S=560 bash bench/dit_gpu.sh PLAN OUT_DIR
#   PLAN: z_image | flux_dev | flux_peer | flux_all | cards24 | qwen_image | chroma | wan
# Installs the carried wheels into /tmp/site, unpacks ComfyUI 0.3.75 (+ tokenizers), writes the family's full-size
# random files to /tmp/dit_assets (other families' files there are removed first: the disk is 64 GiB), runs the
# plan with a time budget that ends the whole command within LIMIT_S, and leaves in OUT_DIR: results.json (every
# job, copied every 10 s too), table.md, console.txt (machine, progress lines), logs.tgz (each server's log).
# Rows the budget skips are run by the same command again with MATRIX_ARGS="--only ROW,..." (the files stay).
set -uo pipefail
PLAN="${1:?plan: z_image, flux_dev, flux_peer, flux_all, cards24, qwen_image, chroma or wan}"; mkdir -p "${2:?output folder}"; OUT="$(cd "$2" && pwd)"
LIMIT_S="${LIMIT_S:-560}"
begun=$SECONDS
mkdir -p .cache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  >/dev/null 2>&1 || echo "[dit_gpu] pip install failed"
tar xzf .gpu/comfyui.tgz -C .cache && tar xzf .gpu/dit_tokenizers.tgz -C .cache/comfyui
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
case "$PLAN" in
  z_image|cards24) FAMILY=z_image ;;
  qwen_image*) FAMILY=qwen_image ;;
  chroma*) FAMILY=chroma ;;
  wan*) FAMILY=wan ;;
  *) FAMILY=flux_dev ;;
esac
if [ "$FAMILY" = wan ] && [ ! -f .cache/comfyui/comfy/text_encoders/t5_pile_tokenizer/tokenizer.model ]; then
  echo "[dit_gpu] .gpu/dit_tokenizers.tgz lacks comfy/text_encoders/t5_pile_tokenizer (Wan's umt5 file needs it): rebuild it as above"
  exit 2
fi
ASSETS=/tmp/dit_assets
if [ -f "$ASSETS/assets.json" ] && ! grep -q "\"$FAMILY\"" "$ASSETS/assets.json"; then rm -rf "$ASSETS"; fi
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1
  free -g | head -2; df -h /tmp | tail -1; nproc
} > "$OUT/console.txt" 2>&1
RUN="/tmp/dit_matrix_$PLAN"
( while sleep 10; do cp "$RUN/results.json" "$OUT/results.json" 2>/dev/null; done ) &
copier=$!
left=$((LIMIT_S - (SECONDS - begun)))
echo "[dit_gpu] setup took $((SECONDS - begun)) s; matrix budget $((left - 25)) s" | tee -a "$OUT/console.txt"
timeout -k 10 "$left" python3 -m bench.dit_matrix --plan "$PLAN" --out "$RUN" --assets "$ASSETS" \
  --comfyui .cache/comfyui --budget-s "$((left - 25))" --sampler-steps "${SAMPLER_STEPS:-2}" ${MATRIX_ARGS:-} \
  2>&1 | tee -a "$OUT/console.txt" | grep --line-buffered -E "^\[(matrix|assets|dit|dit_gpu)\]" | cut -c1-300
echo "[dit_gpu] matrix exit code $? after $((SECONDS - begun)) s" | tee -a "$OUT/console.txt"
kill "$copier" 2>/dev/null
cp "$RUN/results.json" "$RUN/table.md" "$OUT/" 2>/dev/null
(cd "$RUN" && tar czf "$OUT/logs.tgz" $(find servers -name comfyui.log) 2>/dev/null)
free -g | head -2 >> "$OUT/console.txt"; df -h /tmp | tail -1 >> "$OUT/console.txt"
cat "$OUT/table.md" 2>/dev/null
