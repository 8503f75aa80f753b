#!/usr/bin/env bash
# kohya sd-scripts as a third peer (bench/kohya_peer.py says what runs and how it is measured).
#   here:        bash bench/kohya_peer.sh prepare <sd-scripts source: a checkout, or the bare git directory the
#                fetch tool gives for github:kohya-ss/sd-scripts>
#                -> .gpu_kohya/ (git-ignored, ~3 MB): its source without docs/tests/configs + the small wheels it needs
#                that neither the GPU image (opencv-python-headless is there) nor .gpu/whl has (imagesize, voluptuous,
#                toml); diffusers, bitsandbytes and nvidia-ml-py come from .gpu/whl (bench/prepare_gpu_carry.sh).
#   GPU machine: bash bench/kohya_peer.sh run OUT_DIR        carry [".gpu", ".gpu_kohya"] (the matrix's carry + 3 MB:
#                one device call can run both)
#                SDXL: CARDS="24,8,6,4" STEPS=110 by default.
#                FLUX.1-dev: FAMILY=flux CARDS=8 STEPS=60 WARMUP=10 ASSETS=/tmp/gm_assets (our files, as
#                bench/gpu_matrix.sh left them; built under the work folder otherwise).
#                LIMIT_S: the whole run (a card that would run past it is stopped and keeps the steps it did);
#                EMULATION=holder (default) | fraction. Writes OUT_DIR/kohya_peer.json, console.txt and logs.tgz.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
case "${1:?prepare SRC | run OUT_DIR}" in
  prepare)
    SRC="${2:?sd-scripts source}"
    EXCLUDE="$(git rev-parse --git-path info/exclude)"
    grep -qx '/.gpu_kohya/' "$EXCLUDE" 2>/dev/null || echo '/.gpu_kohya/' >> "$EXCLUDE"
    [ -f .gpu/comfyui.tgz ] || { echo "run bench/prepare_gpu_carry.sh first (.gpu/comfyui.tgz, .gpu/whl)"; exit 2; }
    rm -rf .gpu_kohya && mkdir -p .gpu_kohya/whl && TMP="$(mktemp -d)"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_kohya/whl \
      imagesize==1.4.1 voluptuous==0.15.2 toml==0.10.2 2>&1 | grep -v "is ignored" || true
    mkdir "$TMP/sd-scripts"
    if [ -f "$SRC/sdxl_train_network.py" ]; then
      cp -r "$SRC"/. "$TMP/sd-scripts/"
    else
      python3 bench/git_snapshot.py "$SRC" "$TMP/sd-scripts"
    fi
    tar czf .gpu_kohya/sd-scripts.tgz -C "$TMP" --exclude='sd-scripts/docs' --exclude='sd-scripts/tests' \
      --exclude='sd-scripts/.git' --exclude='sd-scripts/.github' --exclude='sd-scripts/configs' sd-scripts
    rm -rf "$TMP"
    ls -la .gpu_kohya .gpu_kohya/whl
    echo "[kohya] .gpu_kohya: $(du -sb .gpu_kohya | cut -f1) bytes + .gpu/comfyui.tgz $(du -sb .gpu/comfyui.tgz | cut -f1)" \
      "+ tracked tree $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1); limit $((64 * 1024 * 1024))" ;;
  run)
    mkdir -p "${2:?output folder}"; OUT="$(cd "$2" && pwd)"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_kohya \
      .gpu_kohya/whl/*.whl .gpu/whl/diffusers-*.whl .gpu/whl/bitsandbytes-*.whl .gpu/whl/nvidia_ml_py-*.whl >/dev/null 2>&1 \
      || echo "[kohya] pip install failed"
    export PYTHONPATH=/tmp/site_kohya PYTHONUNBUFFERED=1
    mkdir -p .cache /tmp/kohya && tar xzf .gpu/comfyui.tgz -C .cache && tar xzf .gpu_kohya/sd-scripts.tgz -C /tmp/kohya
    [ -f .gpu/dit_tokenizers.tgz ] && tar xzf .gpu/dit_tokenizers.tgz -C .cache/comfyui  # T5's (flux)
    LIMIT="${LIMIT_S:-530}"
    timeout -k 10 "$LIMIT" python3 -m bench.kohya_peer --family "${FAMILY:-sdxl}" --kohya /tmp/kohya/sd-scripts \
      --work /tmp/leanlora_kohya --cards "${CARDS:-24,8,6,4}" --steps "${STEPS:-110}" --warmup-steps "${WARMUP:-10}" \
      --emulation "${EMULATION:-holder}" --budget-s "$((LIMIT - 15))" ${ASSETS:+--assets "$ASSETS"} \
      2>&1 | tee "$OUT/console.txt" | grep -E "^\[kohya|Error|error" | tail -40
    cp /tmp/leanlora_kohya/kohya_peer.json "$OUT/" 2>/dev/null
    (cd /tmp/leanlora_kohya && tar czf "$OUT/logs.tgz" card_*.log card_*.steps 2>/dev/null) ;;
esac
