"""The LoRA agreement (issue 44 item 6) on the CPU: bench/lora_agreement.py's comparison on the LoRA files real
servers saved (python -m bench.gpu_matrix --group agreement_smoke --tiny: SD1.5's fast plan, the fast plan again,
fast with fp8 weights, an 8 GiB card with selective recompute, and FLUX.1's first three, 4 seeded steps each), checked
against each layer's weight difference formed explicitly; the plan read from the report's own settings line; every agreement group for the GPU
fits one device command and trains every plan with the same seed, steps, data and LoRA."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
# conftest has the repo on sys.path already (after ComfyUI's folder, see test_gpu_matrix.py)
from bench import gpu_matrix, lora_agreement  # noqa: E402
from bench.server_matrix import FAST  # noqa: E402
from tests.helpers import TinyNet, sd_targets  # noqa: E402


@pytest.fixture(scope="module")
def agreement_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement") / "run"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_matrix", "--group", "agreement_smoke", "--tiny", "--out",
                           str(out), "--budget-s", "500"], cwd=REPO, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), done.stdout, out


def saved(out: Path, server: str, output_name: str) -> Path:
    return out / "servers" / server / "models" / "loras" / f"{output_name}.safetensors"


def formed_distance(a: Path, b: Path) -> tuple[float, float]:
    """||dW_a - dW_b|| and ||dW_b|| with every layer's dW = alpha / rank * up @ down formed (float64)."""
    ta, tb = load_file(str(a)), load_file(str(b))

    def delta(tensors, layer):
        down = tensors[f"{layer}.lora_down.weight"].double().flatten(1)
        up = tensors[f"{layer}.lora_up.weight"].double().flatten(1)
        return float(tensors[f"{layer}.alpha"]) / down.shape[0] * (up @ down)
    layers = [k.removesuffix(".lora_down.weight") for k in ta if k.endswith(".lora_down.weight")]
    assert layers and len(layers) == sum(k.endswith(".lora_up.weight") for k in tb)
    difference = sum(float((delta(ta, layer) - delta(tb, layer)).pow(2).sum()) for layer in layers) ** 0.5
    return difference, sum(float(delta(tb, layer).pow(2).sum()) for layer in layers) ** 0.5


def test_every_run_of_the_smoke_group_is_judged_against_its_models_fast_lora(agreement_run):
    result, stdout, out = agreement_run
    assert all(r["status"] == "ok" and r["steps_done"] == 4 for r in result["rows"])
    assert set(result["agreement"]) == {"sd15", "flux_dev"}
    flux = {r["job"]: r for r in result["rows"] if r["model"] == "flux_dev"}
    assert result["agreement"]["flux_dev"]["reference"] == "smoke_flux_dev_uncapped/fast"
    assert flux["fast_fp8"]["changes_numbers"] == ["fp8 base weights"] and flux["fast_fp8"]["lora_vs_fast"] > 0
    assert result["agreement"]["flux_dev"]["tolerance"] == max(
        lora_agreement.LORA_YARDSTICKS * flux["fast_yardstick"]["lora_vs_fast"], lora_agreement.LORA_FLOOR)
    rows = {r["job"]: r for r in result["rows"] if r["model"] == "sd15"}
    assert set(rows) == {"fast", "fast_yardstick", "fast_fp8", "card_8_selective"}
    verdict = result["agreement"]["sd15"]
    assert verdict["reference"] == "smoke_sd15_uncapped/fast" and verdict["fast_moved"] > 0
    assert verdict["yardstick"] == rows["fast_yardstick"]["lora_vs_fast"]
    assert verdict["tolerance"] == max(lora_agreement.LORA_YARDSTICKS * verdict["yardstick"], lora_agreement.LORA_FLOOR)
    for job in ("fast_fp8", "card_8_selective"):
        assert rows[job]["lora_tolerance"] == verdict["tolerance"]
        assert rows[job]["lora_within"] == (rows[job]["lora_vs_fast"] <= verdict["tolerance"])
    assert "lora_within" not in rows["fast"] and "lora_within" not in rows["fast_yardstick"]
    assert set(verdict["outside"]) == {f"{r['server']}/{r['job']}" for r in (rows["fast_fp8"], rows["card_8_selective"])
                                       if not r["lora_within"]}
    # the plans as the reports wrote them, and what in them changes the numbers
    assert "base weights fp8" in rows["fast_fp8"]["plan"] and rows["fast_fp8"]["changes_numbers"] == ["fp8 base weights"]
    assert "auto-fit to 8 GiB" in rows["card_8_selective"]["plan"] and rows["card_8_selective"]["changes_numbers"] == []
    assert verdict["auto_fit_plans"] == 1
    assert verdict["auto_fit_plans_within"] == int(rows["card_8_selective"]["lora_within"])
    table = gpu_matrix.summary([str(out / "results.json")])
    line = next(li for li in table.splitlines() if li.startswith("| smoke_sd15_8_selective/card_8_selective |"))
    assert f"| {rows['card_8_selective']['lora_vs_fast']:.4f} | {verdict['tolerance']:.4f} |" in line
    assert "[matrix] agreement:" in stdout


@pytest.mark.parametrize("model", ["sd15", "flux_dev"])
def test_the_comparison_on_the_saved_files_is_the_distance_of_the_formed_weight_differences(agreement_run, model):
    result, _, out = agreement_run
    rows = {r["job"]: r for r in result["rows"] if r["model"] == model}
    head = f"smoke_{model}_uncapped"
    fast = saved(out, head, f"gm_{model}_uncapped")
    others = {"fast_fp8": saved(out, head, f"gm_{model}_uncapped_fp8"),
              "fast_yardstick": saved(out, head, f"gm_{model}_uncapped_yardstick")}
    if model == "sd15":
        others["card_8_selective"] = saved(out, "smoke_sd15_8_selective", "gm_sd15_8_selective")
    reference = lora_agreement.lora_factors(fast)
    for job, path in others.items():
        measured = lora_agreement.delta_distance(lora_agreement.lora_factors(path), reference)
        difference, norm = formed_distance(path, fast)
        assert measured["norm_b"] == pytest.approx(norm, rel=1e-9) and norm > 0
        assert measured["distance"] == pytest.approx(difference, rel=1e-6, abs=1e-7 * norm), job
        assert rows[job]["lora_vs_fast"] == pytest.approx(difference / norm, rel=1e-6, abs=1e-7), job
    # fp8 rounds the base weights the forward computes with: its LoRA differs, and the comparison sees it
    assert formed_distance(others["fast_fp8"], fast)[0] > 0 and rows["fast_fp8"]["lora_vs_fast"] > 0
    same = lora_agreement.delta_distance(reference, reference)
    assert same["distance"] <= 1e-6 * same["norm_a"]


def test_a_plain_lora_starts_at_a_zero_weight_difference():
    """The metric's premise: the up factors start at zero (peft's init), so dW starts at zero in every run and the
    fast LoRA's ||dW|| is how far it moved from its seeded start; the down factors are the seed's random draws."""
    from trainer.lora import inject_lora
    from trainer.settings import LoraSettings
    net = TinyNet()
    settings = LoraSettings(rank=4, alpha=4)
    inject_lora(net, settings, seed=0, target_modules=sd_targets(settings))
    ups = [p for n, p in net.named_parameters() if "lora_B" in n]
    downs = [p for n, p in net.named_parameters() if "lora_A" in n]
    assert ups and len(ups) == len(downs)
    assert all(torch.count_nonzero(p) == 0 for p in ups) and all(torch.count_nonzero(p) > 0 for p in downs)


def test_the_plan_and_what_changes_its_numbers_come_from_the_reports_last_settings_line():
    from trainer.settings import BaseWeights, LoraWeights, MemorySettings
    asked = MemorySettings()
    chose = replace(asked, base_weights=BaseWeights.FP8_STREAMED, optimizer="AdamW8bit", gradient_checkpointing=True)
    report = "\n".join(["LeanLoRA on cuda:0", asked.describe(), "auto-fit: ... fits the 7.84 GiB budget with: "
                        + chose.describe(), "trained 50/50 steps in 40.0 s (0.8 s/step)"])
    plan = lora_agreement.plan_of(report)
    assert plan == {"plan": chose.describe(), "changes_numbers": ["fp8 base weights", "8-bit optimizer (AdamW8bit)"]}
    assert lora_agreement.plan_of(asked.describe())["changes_numbers"] == []
    bf16 = replace(asked, lora_weights=next(w for w in LoraWeights if w is not LoraWeights.FP32))
    assert lora_agreement.plan_of(bf16.describe())["changes_numbers"] == ["bf16 LoRA weights"]
    assert lora_agreement.plan_of("no settings line") == {"plan": None, "changes_numbers": None}


def test_a_file_the_comparison_cannot_read_is_named_with_what_is_wrong(tmp_path):
    loha = tmp_path / "loha.safetensors"
    save_file({"lora_unet_x.hada_w1_a": torch.ones(2, 2)}, str(loha))
    with pytest.raises(ValueError, match=r"hada_w1_a.*plain LoRA"):
        lora_agreement.lora_factors(loha)
    half = tmp_path / "half.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.ones(2, 3)}, str(half))
    with pytest.raises(ValueError, match=r"lora_unet_x.*only its lora_down"):
        lora_agreement.lora_factors(half)
    assert "error" in lora_agreement.judge([{"kind": "train", "job": "card_8", "status": "ok"}], lambda row: None)


def test_every_agreement_group_fits_one_device_command_and_trains_every_plan_on_the_same_run():
    issue_cards = {"sdxl": {(12, False), (8, False), (8, True), (6, False), (4, False), (3, False)},
                   "flux_dev": {(24, False), (12, False), (8, False), (8, True)}}
    for family, prefix in (("sdxl", "sdxl_agreement"), ("flux_dev", "flux_agreement")):
        names = [g for g in gpu_matrix.PRIORITY if g.startswith(prefix)]
        cards = []
        for name in names:
            servers = gpu_matrix.GROUPS[name]()
            assert gpu_matrix.estimate(servers) <= gpu_matrix.GROUP_LIMIT_S - 20, name
            assert gpu_matrix.estimate(servers, assets=False) <= gpu_matrix.GROUP_LIMIT_S - 60, name
            head, rows = servers[0], servers[1:]
            assert head.card_gib is None and [j.name for j in head.jobs] == ["fast", "fast_yardstick", "fast_fp8"]
            assert head.jobs[0].memory == head.jobs[1].memory == FAST
            assert head.jobs[2].memory == {**FAST, "base_weights": "fp8"}
            cards += [(s.card_gib, bool(s.jobs[0].memory.get("selective_recompute"))) for s in rows]
            jobs = [j for s in servers for j in s.jobs]
            assert all(s.model == gpu_matrix.model_of(family) for s in servers)
            # what a Train prompt takes from the job beside its memory plan (server_matrix.build_prompt): the rest
            # (seed, learning rate, dataset, LoRA rank and targets) is the same for every job by construction
            assert {(j.kind, j.steps, j.framing, j.lora_dropout, json.dumps(j.lora_config), json.dumps(j.train_extra))
                    for j in jobs} == {("train", gpu_matrix.AGREEMENT_STEPS, "center crop (square)", 0.0, "{}", "{}")}
            assert len({j.output_name for j in jobs}) == len(jobs)
            assert all(s.jobs[0].memory["card"] == f"{s.card_gib:g} GiB" for s in rows)
        assert sorted(cards) == sorted(issue_cards[family]) and len(cards) == len(issue_cards[family])
