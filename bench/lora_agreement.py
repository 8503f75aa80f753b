"""Does a memory plan train the fast plan's LoRA? Each plan's LoRA file after the same seeded steps on the same data
against the fast plan's file, relative to how far the fast LoRA moved from its seeded start; a second fast run is
the yardstick (run-to-run nondeterminism of one plan). bench/run.py judges its in-process rows with the same
tolerance; bench/gpu_matrix.py's agreement groups judge the LoRA files their servers saved (issue 44, item 6).

The distance is taken on what a LoRA adds to each layer, dW = (alpha / rank) * up @ down (a convolution's factors
flattened), summed over the file's layers (Frobenius):

    lora_vs_fast = ||dW(plan) - dW(fast)|| / ||dW(fast)||

A plain LoRA starts with its up factors at zero (peft's init_lora_weights=True: down Kaiming-uniform from the run's
seed, up zeros), so dW starts at exactly zero in every run, and ||dW(fast)|| is how far the fast LoRA moved from its
seeded start, with nothing to reconstruct (the down factors' init needs the model's layer order; the saved file
keeps neither). Norms and inner products come from the rank x rank Gram matrices of the factors, in float64: no
layer's dW is ever formed (FLUX.1's largest is 21504 x 3072)."""
from __future__ import annotations

import re
from pathlib import Path

import torch

# A plan that only keeps or moves memory elsewhere trains the fast plan's LoRA up to nondeterminism: within this
# many times what a second run of the fast plan differs, and at least LORA_FLOOR.
LORA_YARDSTICKS, LORA_FLOOR = 2.0, 0.005

FACTOR_KEY = re.compile(r"^(?P<layer>.+)\.lora_(?P<part>down|up)\.weight$")
# MemorySettings.describe() as the report writes it: the requested settings first, then what auto-fit chose (each
# fit line ends with the plan) and a recovery's "finished with" plan; the last one is what trained.
PLAN_LINE = re.compile(r"(precision \S+, gradient checkpointing .*?optimizer (?P<optimizer>[^,\s]+), "
                       r"base weights (?P<weights>[^,(]+).*)$")


def lora_factors(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A plain LoRA file's layers: name -> (up as out x rank, down as rank x in, alpha / rank), float64."""
    from safetensors.torch import load_file
    tensors = load_file(str(path))
    layers: dict[str, dict] = {}
    for key, tensor in tensors.items():
        match = FACTOR_KEY.match(key)
        if match:
            layers.setdefault(match["layer"], {})[match["part"]] = tensor
        elif not key.endswith(".alpha"):
            raise ValueError(f"{path}: key {key!r} is not a plain LoRA factor (lora_down / lora_up / alpha); the "
                             "agreement compares plain LoRA files only (LoRA Config type lora)")
    out = {}
    for layer, parts in layers.items():
        if set(parts) != {"down", "up"}:
            raise ValueError(f"{path}: layer {layer!r} has only its lora_{next(iter(parts))} factor")
        down = parts["down"].double().flatten(1)  # rank x (in [x kh x kw])
        up = parts["up"].double().flatten(1)      # out x rank (a convolution's 1 x 1 kernel)
        rank = down.shape[0]
        alpha = tensors.get(f"{layer}.alpha")
        out[layer] = (up, down, (float(alpha) if alpha is not None else rank) / rank)
    if not out:
        raise ValueError(f"{path}: no lora_down / lora_up factors in this file")
    return out


def _inner(a: tuple, b: tuple) -> float:
    """<dW_a, dW_b> (Frobenius) = trace((up_a^T up_b) (down_b down_a^T)) * scale_a * scale_b."""
    (up_a, down_a, scale_a), (up_b, down_b, scale_b) = a, b
    return float(torch.trace((up_a.T @ up_b) @ (down_b @ down_a.T))) * scale_a * scale_b


def delta_distance(a: dict, b: dict) -> dict:
    """||dW_a - dW_b||, ||dW_a||, ||dW_b|| over every layer of two LoRAs (lora_factors) with the same layers."""
    if a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys())
        raise ValueError(f"the two LoRA files train different layers ({len(only)} differ, e.g. {only[0]!r})")
    norm_a = norm_b = cross = 0.0
    for layer in a:
        norm_a += _inner(a[layer], a[layer])
        norm_b += _inner(b[layer], b[layer])
        cross += _inner(a[layer], b[layer])
    # float64 Gram terms: their cancellation leaves ~1e-8 of the norms, far under any tolerance here
    return {"distance": max(norm_a + norm_b - 2 * cross, 0.0) ** 0.5, "norm_a": norm_a ** 0.5, "norm_b": norm_b ** 0.5}


def plan_of(report: str | None) -> dict:
    """The plan a run trained with (its report's last settings line) and what in it computes with other numbers
    than the fast plan: fp8 base weights, an 8-bit optimizer, bf16 LoRA weights (bench/run.py's changes_numbers)."""
    lines = [m for m in (PLAN_LINE.search(line) for line in (report or "").splitlines()) if m]
    if not lines:
        return {"plan": None, "changes_numbers": None}
    last = lines[-1]
    changes = []
    if last["weights"].strip().startswith("fp8"):
        changes.append("fp8 base weights")
    if "8bit" in last["optimizer"].lower():
        changes.append(f"8-bit optimizer ({last['optimizer']})")
    if "LoRA weights bf16" in last[1]:
        changes.append("bf16 LoRA weights")
    return {"plan": last[1].strip(), "changes_numbers": changes}


def judge(rows: list[dict], lora_file, reference: str = "fast", yardstick: str = "fast_yardstick",
          fp8_reference: str = "fast_fp8") -> dict:
    """Writes into each train row of one run (the same device call): lora_vs_fast, lora_norm_vs_fast, plan,
    changes_numbers, lora_tolerance and lora_within (every row but the reference and the yardstick, the rows that
    change numbers included: the target holds for every auto-fit plan), and for a row with fp8 base weights
    lora_vs_fast_fp8 / lora_within_fp8 against the fp8-only fast row (the same numerics as far as the weights go).
    `lora_file(row)`: the row's saved LoRA (Path), None where it has none. Returns the run's verdict."""
    def loaded(row):
        path = lora_file(row)
        if row.get("status") != "ok" or path is None or not Path(path).is_file():
            row["lora_error"] = (f"no LoRA to compare: the job ended {row.get('status')!r}" if row.get("status") != "ok"
                                 else f"no LoRA file {path}")
            return None
        return lora_factors(Path(path))

    train = [r for r in rows if r.get("kind") == "train"]
    for row in train:
        row.update(plan_of(row.get("report")))
        for key in ("lora_vs_fast", "lora_norm_vs_fast", "lora_vs_fast_fp8", "lora_tolerance", "lora_within",
                    "lora_within_fp8", "lora_error"):
            row.pop(key, None)
    ref_row = next((r for r in train if r.get("job") == reference and r.get("card_gib") is None), None)
    fast = loaded(ref_row) if ref_row else None
    if fast is None:
        return {"error": f"no {reference!r} row with a LoRA file in this run: nothing to compare against"}
    fp8_row = next((r for r in train if r.get("job") == fp8_reference), None)
    fp8 = loaded(fp8_row) if fp8_row else None
    for row in train:
        if row is ref_row:
            continue
        mine = loaded(row) if row is not fp8_row else fp8
        if mine is None:
            continue
        versus = delta_distance(mine, fast)
        row["lora_vs_fast"] = versus["distance"] / versus["norm_b"]
        row["lora_norm_vs_fast"] = versus["norm_a"] / versus["norm_b"]
        if fp8 is not None and row is not fp8_row and "fp8 base weights" in (row.get("changes_numbers") or []):
            versus = delta_distance(mine, fp8)
            row["lora_vs_fast_fp8"] = versus["distance"] / versus["norm_b"]
    ruler = next((r for r in train if r.get("job") == yardstick and "lora_vs_fast" in r), None)
    if ruler is None:
        return {"error": f"no {yardstick!r} row with a LoRA file in this run: no tolerance to judge by"}
    tolerance = max(LORA_YARDSTICKS * ruler["lora_vs_fast"], LORA_FLOOR)
    judged = []
    for row in train:
        if row is ref_row or row is ruler:
            continue
        if "lora_vs_fast" in row:
            row["lora_tolerance"] = tolerance
            row["lora_within"] = row["lora_vs_fast"] <= tolerance
            if "lora_vs_fast_fp8" in row:
                row["lora_within_fp8"] = row["lora_vs_fast_fp8"] <= tolerance
        judged.append(row)
    plans = [r for r in judged if "card" in (r.get("settings") or {})]  # a card set: auto-fit's plan
    return {"metric": "||dW(plan) - dW(fast)|| / ||dW(fast)||, dW = alpha/rank * up @ down over every layer "
                      "(dW starts at zero: up factors start at zero)",
            "reference": f"{ref_row['server']}/{ref_row['job']}",
            "fast_moved": sum(_inner(f, f) for f in fast.values()) ** 0.5,
            "yardstick": ruler["lora_vs_fast"],
            "tolerance": tolerance,
            "rule": f"max({LORA_YARDSTICKS:g} x yardstick, {LORA_FLOOR:g})",
            "auto_fit_plans": len(plans),
            "auto_fit_plans_within": sum(1 for r in plans if r.get("lora_within")),
            "outside": [f"{r['server']}/{r['job']}" for r in judged if not r.get("lora_within")]}
