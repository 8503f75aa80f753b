"""CI smoke test of the benchmark harness: the tiny SD1.5-shaped model on the CPU, every runner, 2 timed steps.

Runs bench.run's main in-process (conftest already put ComfyUI first on sys.path and set CPU mode)."""
import json
import math

EXPECTED = {"fast", "balanced", "lean", "diffusers", "comfyui"}


def test_bench_tiny_runs_our_presets_and_peers(tmp_path, capsys):
    from bench.run import TABLE_COLUMNS, main

    out = tmp_path / "bench"
    main(["--tiny", "--steps", "2", "--warmup", "1", "--out", str(out),
          "--configs", "fast,balanced,balanced+sac,lean,diffusers,comfyui,autofit@3,fast:bs2:autotune"])

    results = json.loads((out / "results.json").read_text())
    assert results["complete"]
    rows = {row["config"]: row for row in results["rows"]}
    assert EXPECTED <= set(rows)
    for name in ("fast", "balanced", "lean", "diffusers"):  # the ComfyUI peer is reported, not required to pass
        row = rows[name]
        assert row["status"] == "ok", (name, row.get("reason"))
        assert row["timed_steps"] == 2 and math.isfinite(row["s_per_step"]) and row["s_per_step"] > 0, row
        assert row["loss_finite"], row
        assert row.get("peak_alloc_gib") is None  # CPU: no CUDA memory to report
    assert rows["comfyui"]["status"] in ("ok", "unavailable", "error")
    assert rows["autofit@3"]["status"] == "skipped" and "CUDA" in rows["autofit@3"]["reason"]
    assert rows["fast:bs2:autotune"]["status"] == "ok" and rows["fast:bs2:autotune"]["batch"] == 2
    import torch
    assert torch.backends.cudnn.benchmark is False  # the row's autotune setting did not outlive it
    assert rows["fast"]["ratio"]["diffusers"]["s_per_step"] > 0  # ratios to the peer are filled in
    assert results["flops"]["sd15-tiny"]["per_image"] > 0 and rows["fast"]["mfu"] > 0
    assert (out / "bench.png").stat().st_size > 0
    # each row's LoRA after the run against the fast preset's (the same seeded start): checkpointing, full or
    # selective, recomputes the same numbers; fp8 weights and 8-bit optimizer states change them; peers and other
    # batch sizes have no reference
    assert rows["balanced"]["lora_vs_fast"] == rows["balanced+sac"]["lora_vs_fast"] == 0.0
    assert rows["lean"]["lora_vs_fast"] > 1e-4
    assert rows["balanced"]["lora_within"] and "lora_within" not in rows["lean"]  # lean's is reported, not bounded
    assert all("lora_vs_fast" not in rows[name] for name in ("fast", "diffusers", "fast:bs2:autotune"))
    assert rows["fast"]["lora_moved"] > 0 and all("_lora" not in row for row in results["rows"])

    printed = capsys.readouterr().out
    table = results["table"]
    assert printed.rstrip().endswith(table.rstrip())  # the table is the last thing printed
    assert table.splitlines()[0].split()[:2] == list(TABLE_COLUMNS[:2]) and "n/a (cpu)" in table
    for name in EXPECTED:
        assert f" {name} " in table
    assert "LoRA Δ fast %" in table


def test_plans_that_only_move_memory_are_held_to_the_fast_plans_own_spread():
    """A second fast row is the yardstick: a memory-only plan may differ twice as much (at least 0.5%); one beyond
    is listed under the table. A plan that changes the numbers (fp8 weights here) is reported, not bounded."""
    import pytest
    import torch
    from bench.run import format_table, lora_agreement
    base = dict(model="sd15", resolution=512, batch=1, status="ok", cap_gib=None, notes=[])
    fast, again, offload, fp8 = ({**base, "config": name} for name in ("fast", "fast", "gc+offload", "gc+fp8"))
    fast["lora_moved"] = again["lora_moved"] = 2.0
    fp8["changes_numbers"] = True
    start = torch.zeros(4)
    finals = {id(fast): start, id(again): start + torch.tensor([0.02, 0, 0, 0]),
              id(offload): start + torch.tensor([0, 0.1, 0, 0]), id(fp8): start + torch.tensor([0, 0, 0.5, 0])}
    rows = [fast, again, offload, fp8]
    lora_agreement(rows, finals)
    assert fast["lora_vs_fast"] == pytest.approx(0.01) == again["lora_vs_fast"]  # the yardstick: 1%
    assert offload["lora_vs_fast"] == pytest.approx(0.05) and offload["lora_tolerance"] == pytest.approx(0.02)
    assert offload["lora_within"] is False and fast["lora_within"] and again["lora_within"]
    assert fp8["lora_vs_fast"] == pytest.approx(0.25) and "lora_within" not in fp8
    beyond = format_table(rows, cuda=False).split("LoRA beyond the fast plan's tolerance")[1]
    assert "sd15 gc+offload: 5.00% > 2.00%" in beyond and "gc+fp8" not in beyond


def test_profile_step_groups_step_time_by_kernel_family(capsys):
    """CPU smoke mode of bench.profile_step: the tiny model's operators, grouped into families with shares."""
    from bench.profile_step import family, main

    assert family("ampere_bf16_s16816gemm_bf16_128x64") == "matmul"
    assert family("pytorch_flash::flash_fwd_kernel") == "attention"
    assert family("sm90_xmma_fprop_implicit_gemm_bf16") == "convolution"
    assert family("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel") == "normalization"
    assert family("aten::native_group_norm") == "normalization"

    main(["--tiny", "--configs", "fast", "--batch", "2", "--steps", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[profile]")]
    assert "sd15-tiny@64 fast batch 2" in lines[0]
    assert "busy" in lines[1]
    shares = {line.split()[1]: float(line.split()[-1].rstrip("%")) for line in lines[2:]
              if line.strip().endswith("%")}
    assert {"matmul", "convolution"} <= set(shares)
    assert abs(sum(shares.values()) - 100) < 1  # every timed operator lands in exactly one family


def test_leak_report_names_the_chain_that_holds_a_tensor():
    """What the bench prints when a row leaves memory behind: the holder chain of the largest tensors."""
    import torch
    from bench.run import who_holds_cuda_memory

    class Keeper:
        pass
    leaked = torch.zeros(1234567)
    keeper = Keeper()
    keeper.stash = {"params": [leaked]}
    report = who_holds_cuda_memory(top=1, wanted=lambda t: t.shape == (1234567,))
    import re
    assert report.startswith("1 tensors alive")
    assert re.search(r"\(1234567,\) torch\.float32 <- list( \(\+\d+\))? <- dict\{params\}( \(\+\d+\))? <- Keeper", report), report
    assert keeper.stash["params"][0] is leaked


def test_config_tokens_can_name_one_model():
    """`sdxl/fast+compile:bs8` runs on SDXL only, so one command can mix SD1.5 and SDXL rows (campaign part issue4)."""
    import pytest
    from bench.run import SPECS, parse_config
    row = parse_config("sdxl/fast+compile:bs8")
    assert (row.name, row.preset, row.batch, row.model) == ("sdxl/fast+compile:bs8", "fast+compile", 8, "sdxl")
    assert row.applies_to(SPECS["sdxl"]) and not row.applies_to(SPECS["sd15"])
    assert parse_config("sd15/comfyui").applies_to(SPECS["sd15-tiny"])  # its family in --tiny mode
    assert parse_config("lean").applies_to(SPECS["sdxl"]) and parse_config("lean").model is None
    with pytest.raises(SystemExit, match="model prefix"):
        parse_config("sd3/fast")


def test_throwaway_steps_leave_the_runs_noise_and_gradients_alone():
    """The estimate's probes and the compile step are throwaway steps: training must draw the same noise and
    start from zero gradients whether or not they ran."""
    import torch
    from bench.run import SPECS, make_workload, presets, start_session
    session, _, _, _ = start_session(make_workload(SPECS["sd15-tiny"], 1, torch.device("cpu")), presets()["fast"], 2)
    rng = session.generator.get_state()
    session.throwaway_step(session.largest_batch())
    assert torch.equal(session.generator.get_state(), rng)
    assert all(p.grad is None for p in session.params)
    session.close()


def test_kernel_benchmarks_run():
    """bench.kernels on the CPU (small shapes): the fp8 upcast part, one line of numbers for each variant."""
    from bench.kernels import main
    lines = main(["--only", "fp8"])
    assert lines[0].startswith("cpu (smoke run")
    assert "one kernel per weight" in lines[1] and "one per 12 weights" in lines[1] and "floor" in lines[1]
