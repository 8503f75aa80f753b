#!/usr/bin/env bash
# Issue 43's scaling rows: the headless runner under torchrun on 1, 2, 4, 8 GPUs of one machine, SDXL or FLUX.1-dev at
# 1024², rank 16, batch 1 per GPU, auto-fit to the GPU; random full-size weights built on the device
# (bench/full_size_assets.py, bench/dit_assets.py), the same images and seed in every row.
# Throughput is images/s = GPUs x batch / steady s/step (rank 0's last progress line); x one GPU is against the
# N=1 row of the same command. The LoRA of each N is compared (bench/lora_agreement.py's dW distance, relative to how
# far the LoRA moved) with a one-GPU run of batch N: the ranks draw that run's batch and split it
# (trainer/distributed.py), so it is the same update within float rounding.
#   GPU machine (kind nvidia-h100-x8, or -x2/-x4; carry [".gpu"]):
#     MODEL=sdxl GPUS="1 2 4 8" STEPS=60 bash bench/multi_gpu.sh $OUT     # then MODEL=flux_dev
#   CPU dry run of the same path (tiny SD1.5, gloo ranks, 64², 4 steps):  DRY=1 GPUS="1 2" bash bench/multi_gpu.sh OUT
# OUT gets results.json (one row per N: s/step, images/s, x one GPU, LoRA distance) and each run's log.
set -uo pipefail
mkdir -p "${1:?output folder}"; OUT="$(cd "$1" && pwd)"
MODEL="${MODEL:-sdxl}"; GPUS="${GPUS:-1 2 4 8}"; STEPS="${STEPS:-60}"; ASSETS="${ASSETS:-/tmp/mg_assets}"
PY="${PYTHON:-python3}"
if [ "${DRY:-0}" = 1 ]; then
  MODEL=sd15; STEPS=4; RESOLUTION=64; COMFYUI="${COMFYUI_PATH:-$PWD/.cache/comfyui}"; export OMP_NUM_THREADS=1
  "$PY" -m bench.full_size_assets --out "$ASSETS" --models sd15 --forms checkpoint --tiny --images 4 >/dev/null
else
  RESOLUTION=1024; COMFYUI="$PWD/.cache/comfyui"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    >/dev/null 2>&1 || echo "[multi_gpu] pip install failed"
  mkdir -p .cache && tar xzf .gpu/comfyui.tgz -C .cache
  [ -f .gpu/dit_tokenizers.tgz ] && tar xzf .gpu/dit_tokenizers.tgz -C .cache/comfyui
  export PYTHONPATH=/tmp/site
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
  if [ "$MODEL" = sdxl ]; then "$PY" -m bench.full_size_assets --out "$ASSETS" --models sdxl --forms checkpoint
  else "$PY" -m bench.dit_assets --out "$ASSETS" --families flux_dev; fi
fi
export PYTHONUNBUFFERED=1 COMFYUI_PATH="$COMFYUI"
config() {  # config NAME BATCH_SIZE -> path of the run's TOML
  "$PY" - "$ASSETS" "$MODEL" "$OUT" "$1" "$STEPS" "$RESOLUTION" "$2" <<'PY'
import json, sys
from pathlib import Path
assets, model, out, name, steps, resolution, batch_size = sys.argv[1:]
models = Path(assets) / "models"
if model == "flux_dev":
    from bench.dit_assets import _FILES as FILES
    path = lambda key: str(models / FILES[key][0] / FILES[key][1])  # noqa: E731
    loaders = {"diffusion_model": path("flux_dev"), "text_encoder": [path("clip_l"), path("t5xxl_fp8")],
               "clip_type": "flux", "vae": path("ae")}
else:
    loaders = {"checkpoint": str(next((models / "checkpoints").glob(f"*{model}*.safetensors")))}
data = next(p for p in sorted((Path(assets) / "data").iterdir()) if model.split("_")[0] in p.name)
lines = ["[model]", *(f"{key} = {json.dumps(value)}" for key, value in loaders.items()),
         f"output_dir = {json.dumps(out + '/loras')}", "[dataset]", f"folder = {json.dumps(str(data))}",
         f"resolution = {resolution}", "[memory]", f"batch_size = {batch_size}", "[lora]", "rank = 16",
         "alpha = 16.0", "[train]", f"steps = {steps}", "seed = 0", f"output_name = {json.dumps(name)}"]
config = Path(out) / f"{name}.toml"
config.write_text("\n".join(lines) + "\n")
print(config)
PY
}
for n in $GPUS; do
  cfg="$(config "${MODEL}_gpus$n" 1)"
  echo "[multi_gpu] $MODEL on $n GPU(s): torchrun --nproc_per_node=$n -m leanlora train $cfg"
  ( time "$PY" -m torch.distributed.run --nproc_per_node="$n" -m leanlora train "$cfg" ) > "$OUT/${MODEL}_gpus$n.log" 2>&1
  echo "[multi_gpu]   exit $?; last speed $(grep -o '[0-9.]* s/step' "$OUT/${MODEL}_gpus$n.log" | tail -1)"
  if [ "$n" != 1 ]; then  # the same update on one GPU: the ranks' whole batch
    cfg="$(config "${MODEL}_one_gpu_batch$n" "$n")"
    "$PY" -m leanlora train "$cfg" > "$OUT/${MODEL}_one_gpu_batch$n.log" 2>&1
    echo "[multi_gpu]   one GPU, batch $n: exit $?"
  fi
done
"$PY" - "$OUT" "$MODEL" "$GPUS" <<'PY' | tee "$OUT/summary.txt"
import json, re, sys
from pathlib import Path
from bench.lora_agreement import delta_distance, lora_factors
out, model, gpus = Path(sys.argv[1]), sys.argv[2], [int(n) for n in sys.argv[3].split()]
rows = []
for n in gpus:
    log = (out / f"{model}_gpus{n}.log").read_text(errors="replace")
    speeds = re.findall(r"([0-9.]+) s/step", log)
    row = {"gpus": n, "s_per_step": float(speeds[-1]) if speeds else None}
    row["images_per_s"] = n / row["s_per_step"] if row["s_per_step"] else None
    lora, reference = out / "loras" / f"{model}_gpus{n}.safetensors", \
        out / "loras" / f"{model}_one_gpu_batch{n}.safetensors"
    if n != 1 and lora.is_file() and reference.is_file():
        distance = delta_distance(lora_factors(lora), lora_factors(reference))
        row["lora_vs_one_gpu"] = distance["distance"] / distance["norm_b"]  # relative to how far the LoRA moved
    rows.append(row)
one = next((r for r in rows if r["gpus"] == 1 and r["images_per_s"]), None)
for row in rows:
    if one and row["images_per_s"]:
        row["x_one_gpu"] = row["images_per_s"] / one["images_per_s"]
    print(json.dumps(row))
(out / "results.json").write_text(json.dumps({"model": model, "rows": rows}, indent=1))
PY
