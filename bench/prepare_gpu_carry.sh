#!/usr/bin/env bash
# Builds .gpu/ (git-ignored): what the GPU machine lacks, small enough to travel with the working tree (< 64 MiB):
#   .gpu/whl/         diffusers, bitsandbytes (CUDA 13.0 + CPU libraries only), av, torchsde, trampoline wheels
#   .gpu/comfyui.tgz  the pinned ComfyUI source without tests, API nodes and models
# On the GPU machine: pip install --target /tmp/site .gpu/whl/*.whl; tar xzf .gpu/comfyui.tgz -C .cache
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh >/dev/null  # for .cache/comfyui
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
TMP="$(mktemp -d)"
download() {  # wheels for the GPU machine's Python 3.12 on x86_64
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}" 2>&1 | grep -v "is ignored" || true
}
download .gpu/whl diffusers==0.42.1 "av>=14.2.0,<20" torchsde==0.2.6 trampoline==0.1.2
download "$TMP" bitsandbytes==0.50.2
# bitsandbytes ships a library per CUDA/ROCm/XPU version (43 MB); the H200 image runs CUDA 13.0.
mkdir "$TMP/bnb" && (cd "$TMP/bnb" && python3 -m zipfile -e "$TMP"/bitsandbytes-*.whl . \
  && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete \
  && python3 -m zipfile -c "$ROOT/.gpu/whl/$(basename "$TMP"/bitsandbytes-*.whl)" bitsandbytes bitsandbytes-*.dist-info)
tar czf .gpu/comfyui.tgz -C .cache --exclude='comfyui/tests*' --exclude='comfyui/comfy_api_nodes' \
  --exclude='__pycache__' --exclude='comfyui/models' --exclude='comfyui/input' --exclude='comfyui/output' comfyui
rm -rf "$TMP"
du -sh .gpu
