"""The families x cards GPU matrix (issue 41) in groups that each fit one device command (<= 560 s, setup
included), on bench/dit_matrix.py and bench/server_matrix.py: the Train node in a real ComfyUI 0.3.75 server,
stock loaders, full-size random weights, every capped row on a card emulated by a holder process
(bench/card_holder.py; --emulation fraction for the old per-process cap).

    python -m bench.gpu_matrix --group qwen_a --out DIR [--budget-s S] [--only NAME,...]   # the device command's core
    python -m bench.gpu_matrix --list [--group G]     # every group (or one): rows, steps, time estimates
    python -m bench.gpu_matrix --group smoke --tiny --out DIR                               # CPU: the new row kinds
    python -m bench.gpu_matrix --agreement DIR    # an agreement group's LoRA comparison again (results.json)

Families: sd15 (512²), sdxl, z_image, flux_dev, chroma, qwen_image, wan (1024²) and generic (Z-Image's files through
the pack's generic path alone: bench/dit_launcher.py --families generic). Cards: uncapped (the fast preset, the
× denominator), then 24 / 12 / 8 / 6 GiB set on Memory Settings' card widget (the rest at its defaults, as the
shipped templates have it). Row kinds (each row's `check`): "speed" trains 110 steps (the first burst of 8 left out
of s/step: 102 measured), "fits" FITS_STEPS (memory: does it run, and fit the card; s/step over fewer steps).
With checks (the row's server gets base_identity): a "base_before" job samples the base MODEL before training and
a "lora_loads" job after it loads the trained file with ComfyUI's LoraLoaderModelOnly (every key placed: no "lora
key not loaded" line in the server's log) and samples the base again through the same loader at strength 0 (the
base image must be pixel-identical to the one before training; the new node keeps ComfyUI's cache from reusing it).
Every train row records: steps done, job peak (Train + samples + the KSampler after) and training peak over the
baseline (NVML used - holder - idle) against the card, s/step, × the same call's uncapped row (table), host RSS
peak (bench/dit_matrix.py's sampler), the card's emulation and the holder's bytes.
Agreement groups (issue 44 item 6; bench/lora_agreement.py): every plan auto-fit chooses for SDXL and FLUX.1-dev
(each card whose plan differs, the lever rows included) trains AGREEMENT_STEPS seeded steps on the same data, beside
one uncapped server that trains the fast plan (the reference), the fast plan again (the yardstick) and the fast plan
with fp8 base weights alone; after the rows each saved LoRA is compared with the fast one (results.json: each row's
lora_vs_fast, lora_tolerance, lora_within; "agreement": the verdict per model; summary.md: the agreement table).
Groups in priority order: GROUPS below (bench/gpu_matrix.sh runs one per device command).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from bench import dit_matrix, lora_agreement
from bench import server_matrix as sm
from bench.server_matrix import FAST, GIB, Job, Server, settings

SPEED_STEPS, FITS_STEPS = 110, int(os.environ.get("FITS_STEPS", "24"))
CARDS = (None, 24, 12, 8, 6)
SD_MODELS = ("sd15", "sdxl")
ADAPTERS = ("lora", "loha", "lokr", "dora", "oft")
GROUP_LIMIT_S = 560  # one device command (the tool's 600 s, less the machine's own start of the command)
SETUP_S = 15  # pip install of the carried wheels + unpacking ComfyUI and the tokenizers

# Time estimates (for the budget and --list; not measured where no row ran yet): server start, queue -> first
# step per card, s/step per card (uncapped, 24, 12, 8, 6), the KSampler and saving after training, one sampling
# job (base_before / lora_loads). From the 4 Dec H200 rows (FLUX.1-dev: first step 31 / 50-65 / 69 s, 0.44 /
# 0.64 / 1.04 s/step, ~23 s after training; Z-Image 20-39 s, 0.30 / 0.38 / 0.48; SDXL 0.087-0.14), scaled by
# size for the families not measured yet, and 10% for an H100.
EST = {
    #             start  setup by card (u, 24, 12, 8, 6)   s/step by card (u, 24, 12, 8, 6)          after sample
    "sd15":       (12, (15, 15, 15, 15, 15), (0.024, 0.024, 0.026, 0.03, 0.035), 6, 10),
    "sdxl":       (15, (25, 30, 35, 35, 35), (0.095, 0.095, 0.11, 0.125, 0.15), 8, 14),
    "z_image":    (18, (25, 25, 35, 40, 45), (0.33, 0.42, 0.48, 0.53, 0.6), 15, 22),
    "generic":    (18, (30, 30, 40, 45, 50), (0.45, 0.55, 0.65, 0.75, 0.85), 15, 22),
    "flux_dev":   (18, (35, 55, 65, 70, 75), (0.49, 0.7, 0.9, 1.14, 1.3), 23, 28),
    "chroma":     (18, (35, 50, 60, 65, 70), (0.45, 0.65, 0.85, 1.0, 1.15), 23, 28),
    "qwen_image": (18, (45, 65, 70, 75, 80), (0.6, 0.95, 1.3, 1.8, 2.2), 25, 30),
    "wan":        (18, (40, 55, 60, 65, 70), (0.75, 1.05, 1.3, 1.6, 2.0), 25, 30),
}
# Building the family's files on the device (s; 0 where a warm machine still has them): FLUX.1-dev's 30 GB took
# 47-107 s on 4 Dec; Z-Image's 20 GB 40 s; the SD files ~10 s.
ASSETS_S = {"sd15": 6, "sdxl": 12, "z_image": 45, "generic": 45, "flux_dev": 80, "chroma": 65, "qwen_image": 100,
            "wan": 75}


# Cards below the matrix's CARDS where issue 44 has targets (SDXL 4 and 3 GiB): (setup s, s/step), from the 4 Dec
# H200 rows (SDXL 4 GiB 0.169-0.173 s/step, 3 GiB 2.48x of 0.087).
SMALL_CARDS = {"sdxl": {4: (40, 0.175), 3: (45, 0.22)}}


def model_of(family: str) -> str:
    return "z_image" if family == "generic" else family


# Issue 44's levers as Memory Settings widgets, each measured on a card beside the same card's row without it. The
# prefetch was one (FLUX.1-dev 8 GiB, H100: 0.8154 against 1.0098 s/step): auto-fit now takes it wherever it streams,
# so a card row has it and no row can leave it out.
LEVERS = {"selective": {"selective_recompute": True}}
# Reference plans beside the fast one (no card): "fp8", the fast plan with fp8 base weights and no other saver (the
# agreement run judges the plans with fp8 weights against it as well as against the fast plan).
REFERENCE_PLANS = {"fp8": {"base_weights": "fp8"}}
FP8_STEP_COST = 1.3  # an fp8 row's s/step over the bf16 one, for the estimates (the upcasts; not measured yet)


def row(family: str, card: float | None, check: str = "speed", checks: bool = False, adapter: str | None = None,
        steps: int | None = None, lever: str | None = None) -> Server:
    """One server: the family on the card (None: uncapped fast), optionally the base / LoRA-loading checks, an
    adapter type, or one of LEVERS turned on over the card's plan."""
    start, setups, step_s, after, sample = EST[family]
    if card in CARDS:
        setup, per_step = setups[CARDS.index(card)], step_s[CARDS.index(card)]
    elif card in SMALL_CARDS.get(family, {}):
        setup, per_step = SMALL_CARDS[family][card]
    else:
        raise ValueError(f"gpu_matrix: no time estimate for {family} on a {card} GiB card: add it to EST's cards "
                         "or SMALL_CARDS")
    per_step *= FP8_STEP_COST if lever == "fp8" else 1
    steps = steps or (SPEED_STEPS if check == "speed" else FITS_STEPS)
    memory = settings("fast") if card is None else {**FAST, "card": f"{card:g} GiB"}
    memory.update({**LEVERS, **REFERENCE_PLANS}[lever] if lever else {})
    tail = "".join(f"_{part}" for part in (adapter, lever) if part)
    name = f"{family}_{'uncapped' if card is None else f'{card:g}'}" + tail
    job_name = ("fast" if card is None else f"card_{card:g}") + tail
    train = Job(job_name, memory, steps=steps, check=check, est_step_s=per_step,
                est_setup_s=setup + after - 8, timeout_s=min(560, setup + steps * per_step * 2 + 120),
                lora_config={"type": adapter} if adapter else {}, output_name=f"gm_{name}")
    jobs = [train]
    if checks:
        jobs = [Job("base_before", kind="sample", check="check", est_setup_s=sample, timeout_s=240), train,
                Job("lora_loads", kind="lora_load", load_lora=f"gm_{name}", check="check", est_setup_s=sample,
                    timeout_s=240)]
    return Server(name, model_of(family), jobs, card_gib=card, est_start_s=start, base_identity=checks,
                  families="generic" if family == "generic" else None)


def sampler_only(family: str, card: float) -> Server:
    """One server on the card that samples the base MODEL with ComfyUI's KSampler and nothing else."""
    start, _, _, _, sample = EST[family]
    return Server(f"{family}_{card:g}_sampler_only", model_of(family),
                  [Job("sampler_only", kind="sample", check="check", est_setup_s=sample * 3, timeout_s=300)],
                  card_gib=card, est_start_s=start)


def family_rows(family: str, fits: tuple = (), checks_on: tuple = (6,)) -> list[Server]:
    """The family on every card: speed rows, except the cards in `fits`; the checks on the cards in checks_on."""
    return [row(family, card, "fits" if card in fits else "speed", checks=card in checks_on) for card in CARDS]


def sdxl_adapters() -> list[Server]:
    """SDXL 1024² on an 8 GiB card with each adapter type, CUDA graphs on (the fast path's default), each LoRA file
    then loaded by ComfyUI; the uncapped fast row first (the × denominator)."""
    return [row("sdxl", None)] + [row("sdxl", 8, checks=True, adapter=a) for a in ADAPTERS]


def plan_smoke() -> list[Server]:
    """CPU (--tiny): the new row kinds on the tiny fixtures: SD1.5 with the checks (base before, train, LoRA loaded
    by ComfyUI, base identity), a LoKr row, and Z-Image's files through the generic path alone."""
    tiny = dict(est_step_s=0.5, est_setup_s=20, timeout_s=240)

    def tiny_row(server: Server, steps: int = 3) -> Server:
        jobs = [replace(j, steps=steps if j.kind == "train" else j.steps, **tiny) for j in server.jobs]
        return replace(server, name=f"smoke_{server.name}", jobs=jobs, card_gib=None)
    return [tiny_row(row("sd15", 6, checks=True)), tiny_row(row("sd15", 8, adapter="lokr")),
            tiny_row(row("generic", None))]


def levers_smoke() -> list[Server]:
    """CPU (--tiny): the lever rows' widgets through a real server (SD1.5 and Z-Image's files with selective
    recompute)."""
    tiny = dict(steps=3, est_step_s=0.5, est_setup_s=20, timeout_s=240)
    return [replace(server, name=f"smoke_{server.name}", card_gib=None,
                    jobs=[replace(job, **tiny) for job in server.jobs])
            for server in (row("sd15", 8, lever="selective"), row("generic", 8, lever="selective"))]


AGREEMENT_STEPS = 50
# Each card whose auto-fit plan differs (docs/BENCHMARKS.md's plans), with the levers auto-fit can add on a card;
# FLUX.1's 8 GiB plans first (streamed fp8 + offload + 8-bit states: the most that changes), one card per group
AGREEMENT_CARDS = {"sdxl": ((12, None), (8, None), (8, "selective"), (6, None), (4, None), (3, None)),
                   "flux_dev": ((8, None), (8, "selective"), (24, None), (12, None))}


def agreement_head(family: str) -> Server:
    """One uncapped server, three seeded runs on the same data: the fast plan (the reference), the fast plan again
    (the yardstick: run-to-run nondeterminism), and the fast plan with fp8 base weights alone (the fp8 reference)."""
    fast = row(family, None, "agreement", steps=AGREEMENT_STEPS)
    fp8 = row(family, None, "agreement", steps=AGREEMENT_STEPS, lever="fp8")
    again = replace(fast.jobs[0], name="fast_yardstick", output_name=f"{fast.jobs[0].output_name}_yardstick")
    return replace(fast, jobs=[fast.jobs[0], again, fp8.jobs[0]])


def agreement_groups(prefix: str, family: str, limit: float = GROUP_LIMIT_S - 20) -> dict:
    """The family's agreement rows (AGREEMENT_CARDS) in as few groups as fit one device command, each group with
    its own head (agreement_head): every comparison and its tolerance come from one call on one GPU. One group:
    `prefix`; more: prefix_1, prefix_2, ..."""
    head = agreement_head(family)
    cards = [row(family, card, "agreement", steps=AGREEMENT_STEPS, lever=lever)
             for card, lever in AGREEMENT_CARDS[family]]
    groups, current = [], []
    for spec in cards:
        if current and estimate([head, *current, spec]) > limit:
            groups.append(current)
            current = []
        current.append(spec)
    groups.append(current)
    names = [prefix] if len(groups) == 1 else [f"{prefix}_{i + 1}" for i in range(len(groups))]
    return {name: (lambda group=group: [head, *group]) for name, group in zip(names, groups)}


def agreement_smoke() -> list[Server]:
    """CPU (--tiny): the agreement run on the tiny SD1.5 through real servers (the head's three runs and the 8 GiB
    card's widget with selective recompute) and on the tiny FLUX.1 (the head's runs: FLUX.1's LoRA files), 4 steps
    each, then the comparison of the saved files, per model."""
    tiny = dict(steps=4, est_step_s=0.5, est_setup_s=20, timeout_s=240)
    return [replace(server, name=f"smoke_{server.name}", card_gib=None,
                    jobs=[replace(job, **tiny) for job in server.jobs])
            for server in (agreement_head("sd15"), row("sd15", 8, "agreement", lever="selective"),
                           agreement_head("flux_dev"))]


def write_agreement(out: Path) -> dict:
    """An agreement group's comparison (bench/lora_agreement.py) on the LoRA files its servers saved under `out`,
    each model's rows against its own fast row, written into out/results.json (each row, and "agreement": the
    verdict per model)."""
    results_path = out / "results.json"
    result = json.loads(results_path.read_text())
    group = result["plan"].removeprefix("gm_")
    if group not in GROUPS:
        raise SystemExit(f"gpu_matrix: {results_path} is group {group!r}, not one of this checkout's groups")
    outputs = {(s.name, j.name): j.output_name for s in GROUPS[group]() for j in s.jobs}

    def lora_file(row: dict) -> Path | None:
        name = outputs.get((row["server"], row["job"]))
        found = sorted(out.glob(f"servers/*/models/loras/{name}.safetensors"), key=lambda p: p.stat().st_mtime) \
            if name else []
        return found[-1] if found else None  # a restarted server's folder (name_restartN) saves the same name
    result["agreement"] = {model: lora_agreement.judge([r for r in result["rows"] if r.get("model") == model],
                                                       lora_file)
                           for model in dict.fromkeys(r.get("model") for r in result["rows"])}
    results_path.write_text(json.dumps(result, indent=1, default=str))
    return result["agreement"]


def agreement_table(rows: list[dict]) -> str:
    """The agreement rows of one or more runs: the plan each trained with, its LoRA against the fast one."""
    train = [r for r in rows if r.get("kind") == "train" and ("lora_vs_fast" in r or "lora_error" in r)]
    if not train:
        return ""
    lines = ["", "LoRA agreement: ||dW(plan) - dW(fast)|| / ||dW(fast)|| after the same seeded steps (dW = alpha/rank "
             "up @ down; it starts at zero); tolerance max(2 x the second fast run's, 0.005), per device call.", "",
             "| run | plan trained (report) | changes numbers | ‖dW‖ / fast | LoRA vs fast | tolerance | within | "
             "vs fast_fp8 (within) |", "|---|---|---|---|---|---|---|---|"]
    for r in train:
        within = {True: "✓", False: "✗"}.get(r.get("lora_within"), "")
        measured = f"{r['lora_vs_fast']:.4f}" if "lora_vs_fast" in r else ""
        if "lora_error" in r:
            within, measured = "✗", r["lora_error"].replace("|", "/")[:80]
        moved = f"{r['lora_norm_vs_fast']:.3f}" if "lora_norm_vs_fast" in r else ""
        tolerance = f"{r['lora_tolerance']:.4f}" if "lora_tolerance" in r else ""
        fp8 = (f"{r['lora_vs_fast_fp8']:.4f} ({'✓' if r.get('lora_within_fp8') else '✗'})"
               if "lora_vs_fast_fp8" in r else "")
        role = {"fast_yardstick": " (yardstick)", "fast_fp8": " (fp8 reference)"}.get(r["job"], "")
        changes = r.get("changes_numbers")
        changes = "unknown" if changes is None else ", ".join(changes) or "no"
        lines.append(f"| {r['server']}/{r['job']}{role} | {(r.get('plan') or 'n/a').replace('|', '/')} | {changes} | "
                     f"{moved} | {measured} | {tolerance} | {within} | {fp8} |")
    return "\n".join(lines)


def families_of(servers: list[Server]) -> list[str]:
    return sorted({"generic" if s.families == "generic" else s.model for s in servers})


def estimate(servers: list[Server], assets: bool = True) -> float:
    """Seconds a group takes on the device: setup, the files (cold machine), each server's start and jobs."""
    total = SETUP_S + (sum(ASSETS_S[f] for f in set(families_of(servers)) - ({"generic"} if "z_image" in
                                                                                families_of(servers) else set()))
                       if assets else 0)
    return total + sum(s.est_start_s + sum(sm.job_estimate(j) for j in s.jobs) for s in servers)


def pack(prefix: str, servers: list[Server], limit: float = GROUP_LIMIT_S - 20) -> dict:
    """The servers in order, in groups prefix_1, prefix_2, ... whose cold estimate (files built) stays in `limit`."""
    groups, current = {}, []
    for spec in servers:
        if current and estimate(current + [spec]) > limit:
            groups[f"{prefix}_{len(groups) + 1}"] = current
            current = []
        current.append(spec)
    if current:
        groups[f"{prefix}_{len(groups) + 1}"] = current
    return {name: (lambda group=group: list(group)) for name, group in groups.items()}


def _groups() -> dict:
    """Priority order (issue 41): (a) the rows that failed before step 1 on 6 Dec, as fits checks (Qwen-Image
    uncapped at speed as the × denominator); (b) the CUDA-only tests under both allocators (bench/gpu_matrix.sh, no
    servers); (c) the rest: every family on every card at speed, the checks on its 6 GiB row, SDXL's adapter types."""
    groups = {
        "qwen_a": lambda: [row("qwen_image", None), row("qwen_image", 24, "fits"), row("qwen_image", 12, "fits")],
        "qwen_b": lambda: [row("qwen_image", 8, "fits"), row("qwen_image", 6, "fits")],
        "wan_a": lambda: [row("wan", 24, "fits"), row("wan", 12, "fits"), row("wan", 8, "fits")],
        "cuda_tests": None,
        # ComfyUI's own KSampler alone (no Train before it) on the cards where it ran out of memory after Train on
        # 6 Dec: tells ComfyUI's sampling on that card from anything Train left behind
        "qwen_sampler": lambda: [sampler_only("qwen_image", 12), sampler_only("qwen_image", 8)],
    }
    for family in ("sd15", "sdxl"):
        groups.update(pack(family, family_rows(family)))
    adapters = [row("sdxl", 8, checks=True, adapter=a) for a in ADAPTERS]
    groups["sdxl_adapters_1"] = lambda: [row("sdxl", None)] + adapters[:3]
    groups["sdxl_adapters_2"] = lambda: [row("sdxl", None)] + adapters[3:]
    for family in ("z_image", "generic", "flux_dev", "chroma", "wan", "qwen_image"):
        groups.update(pack(f"{family}_speed", family_rows(family)))
    # issue 44 (whole card): FLUX.1-dev at 8 GiB beside its uncapped row, then each lever beside the rows without it
    groups["flux_whole_card"] = lambda: [row("flux_dev", None), row("flux_dev", 8)]
    groups["flux_levers"] = lambda: [row("flux_dev", 8, lever="selective")]
    groups["sdxl_levers"] = lambda: [row("sdxl", None), row("sdxl", 8), row("sdxl", 8, lever="selective"),
                                     row("sdxl", 6), row("sdxl", 6, lever="selective")]
    # issue 44 item 6: every auto-fit plan's LoRA against the fast plan's (agreement_groups)
    groups.update(agreement_groups("sdxl_agreement", "sdxl"))
    groups.update(agreement_groups("flux_agreement", "flux_dev"))
    return groups


GROUPS = _groups()
PRIORITY = list(GROUPS)
GROUPS["smoke"] = plan_smoke
GROUPS["smoke_levers"] = levers_smoke
GROUPS["agreement_smoke"] = agreement_smoke


# --- assets: the SD builder and the DiT builder into one folder --------------------------------------------------

# The families' full-size files on disk (python -m bench.dit_assets --estimate, 6 Dec); /tmp has 64 GiB
DIT_DISK_GIB = {"z_image": 19.1, "flux_dev": 27.1, "qwen_image": 26.4, "chroma": 21.3, "wan": 20.0}
DISK_MARGIN = 8 * GIB


def make_room(out: Path, families: list[str]) -> list[str]:
    """Deletes other families' DiT files (largest first) until this group's missing files fit /tmp's disk with a
    margin: a warm machine keeps each group's files for the next command while they fit."""
    from bench import dit_assets
    models = out / "models"
    models.mkdir(parents=True, exist_ok=True)
    wanted = {value for f in families for inputs in dit_assets.names(f).values() for value in inputs.values()
              if isinstance(value, str) and value.endswith(".safetensors")}
    present = {p.name: p.stat().st_size for p in models.rglob("*.safetensors")}
    need = sum(DIT_DISK_GIB[f] for f in families) * GIB - sum(size for name, size in present.items() if name in wanted)
    removed = []
    for path in sorted(models.rglob("leanlora_random_*.safetensors"), key=lambda p: -p.stat().st_size):
        if shutil.disk_usage(models).free - need >= DISK_MARGIN:
            break
        if path.name not in wanted:
            removed.append(f"{path.name} ({path.stat().st_size / GIB:.1f} GiB)")
            path.unlink()
    if removed:
        print(f"[gpu_matrix] disk: removed {', '.join(removed)} for {', '.join(families)}", flush=True)
    return removed


def build_assets(out: Path, servers, tiny: bool, comfyui: Path) -> dict:
    """SD1.5 / SDXL files (bench.full_size_assets, split form) and DiT files (bench.dit_assets) under one models
    folder; one assets.json with both."""
    sd = [s for s in servers if s.model in SD_MODELS]
    dit = [s for s in servers if s.model not in SD_MODELS]
    if dit and not tiny:
        make_room(out, sorted({s.model for s in dit}))
    assets = {}
    for group, builder in ((sd, sm_build_assets), (dit, dit_matrix.build_assets)):
        if group:
            assets.update(builder(out, group, tiny, comfyui))
    (out / "assets.json").write_text(json.dumps(assets, indent=1))
    return assets


sm_build_assets = sm.build_assets  # server_matrix's own, before dit_matrix.install() replaces it


def install() -> None:
    dit_matrix.install()
    sm.PLANS.update({f"gm_{name}": plan for name, plan in GROUPS.items()})
    sm.build_assets = build_assets


def summary(paths: list[str]) -> str:
    """The families x cards table of one or more results.json files: one line per server (its train job, with
    the check jobs' verdicts beside it); × against the uncapped row of the same file (the same device call), else
    of another file (marked *)."""
    rows = []
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            rows.append({**r, "_file": path})
    uncapped = {}
    for r in rows:
        if r.get("job") == "fast" and r.get("card_gib") is None and r.get("s_per_step"):
            uncapped.setdefault((r["_file"], r["server"].rsplit("_", 1)[0]), r["s_per_step"])
            uncapped.setdefault(("*", r["server"].rsplit("_", 1)[0]), r["s_per_step"])
    lines = ["| server | card (emulation, holder GiB) | check | status | steps | job peak / card GiB | training peak | "
             "s/step | × uncapped | base unchanged | LoRA loads in ComfyUI | host RSS peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by_server: dict = {}
    for r in rows:
        by_server.setdefault((r["_file"], r["server"]), []).append(r)
    for (path, server), group in by_server.items():
        train = next((r for r in group if r.get("kind") == "train" or r.get("status") == "skipped"
                      and r.get("job") not in ("base_before", "lora_loads")), group[0])
        loads = next((r for r in group if r.get("job") == "lora_loads"), None)
        card = train.get("card_gib")
        holder = (train.get("holder") or {}).get("device_gib")
        card_text = "uncapped" if card is None else f"{card:g} ({train.get('card_emulation')}" + (
            f", {holder:.2f}" if holder is not None else "") + ")"
        family = server.rsplit("_", 1)[0] if card is None else server.split(f"_{card:g}")[0]
        ref = uncapped.get((path, family)) or uncapped.get(("*", family))
        star = "" if uncapped.get((path, family)) else "*"
        per_step = train.get("s_per_step")
        status = train.get("status", "") + ("" if train.get("passed") else " ✗")
        if train.get("error") and not train.get("passed"):
            status += ": " + str(train["error"]).replace("|", "/").replace("\n", " ")[:100]
        peak, training = train.get("nvml_peak_over_baseline_gib"), train.get("nvml_train_peak_over_baseline_gib")
        job_peak = "n/a" if peak is None else f"{peak:.2f}" + (f" / {card:g} {'✓' if peak <= card else '✗'}" if card else "")
        lora = "—" if loads is None else ("✓" if loads.get("passed") else
                                          f"✗ {loads.get('status')}: {(loads.get('lora_load') or {}).get('keys_not_loaded')} keys not loaded "
                                          f"{str(loads.get('error') or '')[:80]}")
        base = "—" if loads is None or "base_identical" not in loads else ("✓" if loads["base_identical"] else "✗ differs")
        lines.append(f"| {server} | {card_text} | {train.get('check', '')} | {status} | {train.get('steps_done', '')} "
                     f"({train.get('steady_steps', '')} timed) | {job_peak} | "
                     f"{'n/a' if training is None else f'{training:.2f}'} | {per_step or 'n/a'} | "
                     f"{f'{per_step / ref:.2f}{star}' if per_step and ref else ''} | {base} | {lora} | "
                     f"{train.get('host_rss_job_peak_gib', '')} |")
    return "\n".join(lines) + agreement_table(rows)


def print_list(groups: list[str]) -> None:
    for name in groups:
        if name == "cuda_tests":
            print(f"== cuda_tests (priority {PRIORITY.index(name) + 1}): the CUDA-only tests under the native "
                  f"allocator and under cudaMallocAsync (bench/gpu_matrix.sh; junit + summary): ~{GROUP_LIMIT_S - 20} s")
            continue
        servers = GROUPS[name]()
        rank = f"priority {PRIORITY.index(name) + 1}" if name in PRIORITY else "CPU"
        print(f"== {name} ({rank}): ~{estimate(servers):.0f} s cold (files built), ~{estimate(servers, False):.0f} s "
              f"warm; families {', '.join(families_of(servers))}")
        for spec in servers:
            est = spec.est_start_s + sum(sm.job_estimate(j) for j in spec.jobs)
            jobs = ", ".join(f"{j.name}({j.steps if j.kind == 'train' else j.kind}"
                             f"{', ' + j.check if j.kind == 'train' else ''})" for j in spec.jobs)
            print(f"   {spec.name:26} card {spec.card_gib or '-':>3}  ~{est:4.0f} s: {jobs}")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    group = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--group"), None)
    if argv[:1] == ["--summary"]:
        print(summary(argv[1:]))
        return
    if argv[:1] == ["--agreement"]:
        out = Path(argv[1])
        print(json.dumps(write_agreement(out), indent=1))
        print(agreement_table(json.loads((out / "results.json").read_text())["rows"]))
        return
    if "--list" in argv:
        print_list([group] if group else PRIORITY + ["smoke"])
        return
    if group not in GROUPS:
        raise SystemExit(f"gpu_matrix: --group one of {', '.join(GROUPS)} (cuda_tests: bench/gpu_matrix.sh)")
    rest = [a for i, a in enumerate(argv) if a != "--group" and (i == 0 or argv[i - 1] != "--group")]
    install()
    if "--tiny" in rest:
        dit_matrix.DitServer.tiny = True
    sm.main(["--plan", f"gm_{group}", *rest])
    if "agreement" in group:
        out = Path(next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--out"), "out/server_matrix"))
        verdict = write_agreement(out)
        print(f"[matrix] agreement: {json.dumps(verdict)}", flush=True)
        print(agreement_table(json.loads((out / "results.json").read_text())["rows"]), flush=True)


if __name__ == "__main__":
    main()
