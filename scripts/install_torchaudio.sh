#!/usr/bin/env bash
# install_torchaudio.sh PYTHON COMFYUI_DIR: ComfyUI from 0.33 on imports torchaudio at start-up (comfy/sd.py), but
# setup_env.sh drops it from ComfyUI's requirements so that pip cannot replace torch. This installs the torchaudio
# that matches the installed torch, only when that ComfyUI imports it and none is importable yet. torch and
# torchvision are pinned to the installed builds, so pip takes the newest torchaudio that declares it works with
# them: torchaudio==<torch's version> where the registry has it (for torch 2.14.1 it has none; 2.11.1, which
# needs torch>=2.11, is the newest), and never touches torch. PIP overrides the pip command ("$PYTHON -m pip").
set -euo pipefail
PY="$1"
COMFY="$2"
read -r -a PIP_CMD <<< "${PIP:-$PY -m pip}"
if ! grep -rqsE '^(import|from) torchaudio' "$COMFY/comfy"; then
  exit 0  # this ComfyUI does not import it
fi
if "$PY" -c "import torchaudio" 2>/dev/null; then
  exit 0
fi
PINS="$(mktemp)"
trap 'rm -f "$PINS"' EXIT
"$PY" -c 'import importlib.metadata as m
for name in ("torch", "torchvision"):
    try: print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError: pass' > "$PINS"
grep -q '^torch==' "$PINS" || { echo "[setup] torchaudio: no torch installed in $PY" >&2; exit 1; }
TORCH_VERSION="$(sed -n 's/^torch==\([^+]*\).*/\1/p' "$PINS")"
echo "[setup] ComfyUI imports torchaudio: installing the one matching torch $TORCH_VERSION"
# (pip warns once per missing entry of this machine's local index mirrors: dropped, real errors kept)
"${PIP_CMD[@]}" install -q "torchaudio==$TORCH_VERSION" -c "$PINS" 2>/dev/null \
  || "${PIP_CMD[@]}" install -q torchaudio -c "$PINS" 2> >(grep -v "is ignored: it is neither" >&2)
"$PY" -c "import torchaudio" || { echo "[setup] torchaudio was installed but does not import with this torch" >&2; exit 1; }
