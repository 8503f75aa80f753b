#!/usr/bin/env bash
# Train a LoRA on a tiny generated dataset and generate with it, in a real headless ComfyUI (CPU is enough).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"
