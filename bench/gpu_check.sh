#!/usr/bin/env bash
# Short GPU check of the product path and the capped SDXL lean rows (subset of bench/gpu_campaign.sh).
# Usage: bash bench/gpu_check.sh OUT_DIR
set -uo pipefail
OUT="${1:?output folder}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
mkdir -p .cache "$OUT" && tar xzf .gpu/comfyui.tgz -C .cache
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/test_fast_path.py 2>&1 | tail -1
for config in lean@3 lean-eager@3; do
  timeout 80 python3 -m bench.run --out "$OUT/sdxl_$config" --models sdxl --configs "$config" --steps 27 --warmup 3 2>&1 \
    | grep -E "^\[bench\]|^sdxl@|OOM|error|fast path"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(r['config'], r['status'], [n for n in r.get('notes', []) if 'fast path' in n or 'allocated' in n])" "$OUT/sdxl_$config/results.json" 2>/dev/null
done
timeout 240 python3 -m bench.product_path --out "$OUT/product" --steps 24 --budget-s 200 2>&1 | grep -v "^{" | tail -22
tar czf "$OUT/results.tgz" -C "$OUT" . --exclude results.tgz 2>/dev/null; find "$OUT" -mindepth 1 -not -name results.tgz -delete
