#!/usr/bin/env bash
# The browser tests' tools (tests/test_browser.py, scripts/browser_ui.py), idempotent:
#   chromium      Debian's package (apt-get), the browser the tests drive
#   playwright    Python's package in .venv, told to use that system chromium (executable_path): nothing
#                 downloads a browser build (no `playwright install`)
# Without root or apt-get it says why and leaves the browser tests to skip with that reason.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VPY="$ROOT/.venv/bin/python"
PLAYWRIGHT_VERSION="1.65.2"

if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing chromium (Debian package)"
    (apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }) \
      || echo "[setup] chromium could not be installed: the browser tests will skip"
  else
    echo "[setup] no chromium and no root apt-get: the browser tests will skip (apt-get install chromium)"
  fi
fi
if ! "$VPY" -c "import playwright" 2>/dev/null; then
  echo "[setup] installing playwright $PLAYWRIGHT_VERSION (Python package only; the browser is the system chromium)"
  "$VPY" -m pip install -q "playwright==$PLAYWRIGHT_VERSION" 2>&1 | grep -v "is ignored: it is neither a file" || true
fi
