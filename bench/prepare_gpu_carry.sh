#!/usr/bin/env bash
# Builds .gpu/ (git-ignored): what the GPU machine lacks, small enough to travel with the working tree (< 64 MiB):
#   .gpu/whl/            diffusers, prodigyopt, schedulefree, came-pytorch, bitsandbytes (CUDA 13.0 + CPU libraries only), av, torchsde, trampoline,
#                        nvidia-ml-py
#   .gpu/comfyui.tgz     the pinned ComfyUI 0.3.75 source without tests, API nodes and models
#   .gpu/033/            only when ComfyUI 0.33's source is given (a checkout, or the bare git directory that the
#                        search tool's fetch of github:yzkee/ComfyUI gives): comfyui.tgz (its source, same
#                        exclusions) and whl/ with what 0.33 imports at start-up beyond 0.3.75: comfy-aimdo,
#                        comfy-kitchen (pure-Python part only), SQLAlchemy + alembic + Mako (0.33's asset code
#                        imports SQLAlchemy unconditionally), simpleeval
# A ComfyUI server needs nothing else on that machine: bench/server_matrix.py serves an empty --front-end-root
# (no comfyui_frontend_package), runs with --database-url sqlite:///:memory: (without alembic/SQLAlchemy ComfyUI
# logs that the database is off and goes on) and --disable-api-nodes; kornia/spandrel are optional (a few
# comfy_extras log an import error). torchaudio, which 0.33 imports at start-up, is installed there (2.11.0,
# matching torch 2.11.0).
# On the GPU machine: pip install --target /tmp/site .gpu/whl/*.whl; tar xzf .gpu/comfyui.tgz -C .cache
# (bench/server_gpu.sh does both).
# Usage: bash bench/prepare_gpu_carry.sh [COMFYUI_0.33_SOURCE]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SOURCE_033="${1:-}"
bash scripts/setup_env.sh >/dev/null  # for .cache/comfyui
EXCLUDE="$(git rev-parse --git-path info/exclude)"  # a worktree shares the main checkout's
# what the device tool must not carry: the carry itself, and a second venv (scripts/setup_env.sh's .venv033, 0.9 GB)
# that .gitignore's `.venv` does not cover; the tool carries every untracked file git does not ignore
mkdir -p "$(dirname "$EXCLUDE")"
for pattern in '/.gpu/' '/.venv033/'; do grep -qxF "$pattern" "$EXCLUDE" 2>/dev/null || echo "$pattern" >> "$EXCLUDE"; done
rm -rf .gpu && mkdir -p .gpu/whl
TMP="$(mktemp -d)"
download() {  # wheels for the GPU machine's Python 3.12 on x86_64
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$1" "${@:2}" 2>&1 | grep -v "is ignored" || true
}
download .gpu/whl diffusers==0.42.1 "av>=16.0.0,<20" torchsde==0.2.6 trampoline==0.1.2 nvidia-ml-py==13.615.71 \
  prodigyopt==1.1.2 schedulefree==1.4.1 came-pytorch==0.1.3  # the optional optimizers the CUDA tests train with
download "$TMP" bitsandbytes==0.50.2
# bitsandbytes ships a library per CUDA/ROCm/XPU version (43 MB); the H200 image runs CUDA 13.0.
mkdir "$TMP/bnb" && (cd "$TMP/bnb" && python3 -m zipfile -e "$TMP"/bitsandbytes-*.whl . \
  && find bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete \
  && python3 -m zipfile -c "$ROOT/.gpu/whl/$(basename "$TMP"/bitsandbytes-*.whl)" bitsandbytes bitsandbytes-*.dist-info)
# Other model families' tokenizer files (T5, Llama, Qwen, ...: ~5 MB compressed) are read only when such a model
# loads; SD1.5/SDXL use comfy/sd1_tokenizer, which stays.
tar czf .gpu/comfyui.tgz -C .cache --exclude='comfyui/tests*' --exclude='comfyui/comfy_api_nodes' \
  --exclude='__pycache__' --exclude='comfyui/models' --exclude='comfyui/input' --exclude='comfyui/output' \
  --exclude='comfyui/comfy/text_encoders/*_tokenizer' comfyui
# The DiT families' tokenizers (bench/dit_gpu.sh, bench/gpu_matrix.sh unpack it into ComfyUI): Qwen2.5's (Qwen-Image;
# Z-Image's Qwen3 reads it too), T5's (FLUX.1-dev, Chroma) and T5 pile's (Wan's random umt5 file embeds its model).
tar czf .gpu/dit_tokenizers.tgz -C .cache/comfyui comfy/text_encoders/qwen25_tokenizer comfy/text_encoders/t5_tokenizer \
  comfy/text_encoders/t5_pile_tokenizer

if [ -n "$SOURCE_033" ]; then
  # ComfyUI 0.33's own pins (its requirements.txt). comfy-kitchen's compiled CUDA/HIP backends are 48 MB
  # compressed: without them it uses its eager/Triton backends, which only quantized checkpoints and int8
  # attention reach; fp16 SD1.5/SDXL and the DynamicVRAM patcher (comfy-aimdo, kept whole) do not.
  # (blake3, also listed, is imported guarded: without it 0.33 only warns.)
  mkdir -p .gpu/033/whl
  download .gpu/033/whl comfy-aimdo==0.4.13 simpleeval==1.0.8 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 \
    pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 pydantic-settings==2.12.0 python-dotenv==1.2.1
  download "$TMP" comfy-kitchen==0.2.31
  mkdir "$TMP/ck" && (cd "$TMP/ck" && python3 -m zipfile -e "$TMP"/comfy_kitchen-*.whl . \
    && find comfy_kitchen -name '_C.abi3.so' -delete \
    && python3 -m zipfile -c "$ROOT/.gpu/033/whl/$(basename "$TMP"/comfy_kitchen-*.whl)" comfy_kitchen comfy_kitchen-*.dist-info)
  mkdir "$TMP/src"
  if [ -f "$SOURCE_033/main.py" ]; then
    cp -r "$SOURCE_033" "$TMP/src/comfyui"
  else  # a bare git directory whose largest blobs may be absent (the fetch tool's snapshots): skip those
    python3 bench/git_snapshot.py "$SOURCE_033" "$TMP/src/comfyui"
  fi
  grep -q '__version__ = "0.33' "$TMP/src/comfyui/comfyui_version.py" || echo "[carry] warning: $SOURCE_033 is not ComfyUI 0.33.x"
  rm -f "$TMP/src/comfyui/extra_model_paths.yaml"
  tar czf .gpu/033/comfyui.tgz -C "$TMP/src" --exclude='comfyui/tests*' --exclude='comfyui/comfy_api_nodes' \
    --exclude='comfyui/.git' --exclude='comfyui/.github' --exclude='__pycache__' --exclude='comfyui/models' \
    --exclude='comfyui/comfy/text_encoders/*_tokenizer' comfyui
fi
rm -rf "$TMP"
ls -laR .gpu
# The device tool carries at most 64 MiB: the tracked tree plus every carried path.
echo "[carry] .gpu: $(du -sb .gpu | cut -f1) bytes; tracked tree: $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes; untracked, not ignored: $(git ls-files --others --exclude-standard -z | xargs -0 -r du -cb | tail -1 | cut -f1) bytes; limit $((64 * 1024 * 1024))"
