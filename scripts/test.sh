#!/usr/bin/env bash
# Builds the environment (idempotent) and runs the test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
bash scripts/setup_browser.sh  # chromium + playwright for tests/test_browser.py
exec .venv/bin/python -m pytest -q tests "$@"
