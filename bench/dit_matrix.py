"""The DiT families (Z-Image, FLUX.1-dev, Qwen-Image, Chroma, Wan 2.1 T2V 14B) in the server matrix: the LeanLoRA
Train node as users run it, in a real ComfyUI server, stock loaders, full-size random weights, 1024², batch 1,
rank 16, under emulated card sizes.

    python -m bench.dit_matrix --plan z_image --out DIR [--comfyui PATH] [--budget-s S] [--only NAME,...]
    python -m bench.dit_matrix --plan qwen_image --list          # the rows, time estimates, disk / RAM estimates
    python -m bench.dit_matrix --plan smoke --tiny --out DIR     # CPU: the tiny fixtures, no caps, no NVML
    python -m bench.dit_matrix --plan smoke_wan --tiny --out DIR # CPU: one newer family (smoke_qwen_image,
                                                                 # smoke_chroma, smoke_wan; smoke_families: all 3)

Everything but what differs for these families is bench/server_matrix.py's (servers, jobs, NVML peaks, the
trainer's s/step with the first burst left out, the time budget, results.json / table.md); this file supplies:
- the files (bench/dit_assets.py, built in a child process: its CUDA context stays out of the NVML baseline);
- the prompt: UNETLoader + CLIPLoader type lumina2 (Z-Image) / qwen_image / chroma / wan or DualCLIPLoader type
  flux (CLIP-L + fp8 T5-XXL) + VAELoader, then LeanLoRA Dataset / Memory Settings / LoRA Config / Train and a
  KSampler after training, sampled as the family's shipped template samples (scripts/family_templates.py
  FAMILIES: scheduler simple; euler, cfg 1 for Z-Image and FLUX.1-dev; euler, cfg 4 with the empty negative for
  Chroma; euler, cfg 2.5 for Qwen-Image; uni_pc, cfg 6 on a one-frame EmptyHunyuanLatentVideo for Wan;
  EmptySD3LatentImage otherwise), or ComfyUI's own TrainLoraNode as the peer;
- the launcher: bench/dit_launcher.py (comfy_launcher.py + the text-encoder placement a real card of that size
  gets; see its docstring);
- host RAM: the server process's resident set (/proc/PID/status VmRSS) sampled every 0.1 s during each job (job
  peak, and the peak from the first training step to the job's end), and its VmHWM (lifetime peak) after the job.
Plans: z_image (uncapped fast, 24 GiB, 8 GiB), flux_dev (the same), chroma (the same), wan (the same),
qwen_image (uncapped fast, 24, 12, 8 GiB: issue 31's Qwen-Image targets are 12/8/6), flux_peer (ComfyUI's
TrainLoraNode on that Flux, uncapped: bf16, rank 16, its default gradient checkpointing), smoke (CPU: Z-Image,
FLUX.1-dev, the peer), smoke_<family> / smoke_families (CPU: the newer families).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

from bench import server_matrix as sm
from bench.server_matrix import Job, Server, settings

REPO = sm.REPO
DIT_LAUNCHER = REPO / "bench" / "dit_launcher.py"
TINY_CONFIGS = REPO / "tests" / "tiny_dit_configs"
GIB = sm.GIB
FAMILIES = ("z_image", "flux_dev")  # the smoke plan's; the newer ones have their own smoke plans
NEW_FAMILIES = ("qwen_image", "chroma", "wan")


# --- plans ---------------------------------------------------------------------------------------------------

def _family(fam: str, step_s: tuple[float, ...], setup_s: tuple[float, ...], cards: tuple[float, ...] = (24, 8),
            timeouts: tuple[float, ...] = (420, 480, 540)) -> list[Server]:
    """Uncapped fast (the ratio's denominator), then auto-fit at each card size: 110 steps each (102 measured).
    step_s / setup_s / timeouts: the uncapped row's, then each card's."""
    servers = [Server(f"{fam}_uncapped", fam, [Job("fast", settings("fast"), est_step_s=step_s[0],
                                                   est_setup_s=setup_s[0], timeout_s=timeouts[0])],
                      card_gib=None, est_start_s=15)]
    for card, step, setup, timeout in zip(cards, step_s[1:], setup_s[1:], timeouts[1:]):
        servers.append(Server(f"{fam}_{card:g}", fam, [Job(f"autofit_{card:g}", settings("fast", auto_fit=f"{card:g} GiB"),
                                                            est_step_s=step, est_setup_s=setup, timeout_s=timeout)],
                              card_gib=card, est_start_s=15))
    return servers


def plan_z_image() -> list[Server]:
    return _family("z_image", (0.33, 0.45, 0.8), (45, 50, 60))


def plan_flux_dev() -> list[Server]:
    return _family("flux_dev", (0.5, 0.7, 1.1), (60, 60, 70))


# Not measured yet: s/step guesses from DESIGN.md's frozen-model measurements (Qwen-Image 0.446 s bf16, FLUX 0.448)
# and the FLUX.1-dev rows' card ratios; setup from the files' sizes (loading ~0.6 GiB/s + encoding + caching).
def plan_qwen_image() -> list[Server]:
    """Qwen-Image 20.4 B (an fp8 file, as users load it), uncapped and at 24 / 12 / 8 GiB."""
    return _family("qwen_image", (0.55, 0.9, 1.3, 1.8), (90, 90, 100, 110), cards=(24, 12, 8),
                   timeouts=(480, 540, 560, 560))


def plan_chroma() -> list[Server]:
    """Chroma 8.9 B bf16 + the fp8 T5-XXL (CLIPLoader type chroma), uncapped and at 24 / 8 GiB."""
    return _family("chroma", (0.45, 0.65, 1.0), (60, 60, 70))


def plan_wan() -> list[Server]:
    """Wan 2.1 T2V 14 B (an fp8 file) + umt5-xxl (scaled fp8), one-frame 1024² videos, uncapped and at 24 / 8 GiB."""
    return _family("wan", (0.7, 1.1, 1.6), (75, 80, 90), timeouts=(480, 540, 560))


def plan_flux_peer() -> list[Server]:
    """ComfyUI 0.3.75's own trainer on the same Flux, uncapped (it fits no consumer card: 46 GiB in-process)."""
    return [Server("flux_dev_peer_uncapped", "flux_dev", [
        Job("peer_builtin", kind="peer", steps=sm.PEER_WARMUP_STEPS + 40, est_step_s=1.05, est_setup_s=60,
            timeout_s=400)], card_gib=None, est_start_s=15)]


def plan_smoke() -> list[Server]:
    """CPU, the tiny fixtures: each family trains + samples (fast preset; auto-fit is CUDA-only), the peer on Flux."""
    tiny = dict(est_step_s=0.5, est_setup_s=20, timeout_s=240)
    return [Server(f"smoke_{fam}_cpu", fam, [Job("fast", settings("fast"), steps=3, **tiny)], est_start_s=15)
            for fam in FAMILIES] + [
        Server("smoke_flux_dev_peer_cpu", "flux_dev", [Job("peer_builtin", kind="peer", steps=sm.PEER_WARMUP_STEPS + 2,
                                                           **tiny)], est_start_s=15)]


def _plan_smoke_new(families=NEW_FAMILIES) -> list[Server]:
    """CPU, the tiny fixtures of the newer families: each trains 3 steps + samples (fast preset)."""
    tiny = dict(est_step_s=0.5, est_setup_s=20, timeout_s=240)
    return [Server(f"smoke_{fam}_cpu", fam, [Job("fast", settings("fast"), steps=3, **tiny)], est_start_s=15)
            for fam in families]


def plan_cards24() -> list[Server]:
    """The two 24 GiB rows again, with the NVML timeline (where in the job the process peak falls)."""
    return [s for s in plan_flux_dev() + plan_z_image() if s.card_gib == 24]


PLANS = {"cards24": plan_cards24, "z_image": plan_z_image, "flux_dev": plan_flux_dev, "flux_peer": plan_flux_peer, "smoke": plan_smoke,
         "flux_all": lambda: plan_flux_dev() + plan_flux_peer(), "qwen_image": plan_qwen_image, "chroma": plan_chroma,
         "wan": plan_wan, "smoke_families": _plan_smoke_new,
         **{f"smoke_{fam}": (lambda fam=fam: _plan_smoke_new((fam,))) for fam in NEW_FAMILIES}}


# --- prompt --------------------------------------------------------------------------------------------------

_base_build_prompt = sm.build_prompt


def sampling(family: str) -> dict:
    """The family's KSampler inputs and latent node as its shipped template has them (scripts/family_templates.py
    FAMILIES; the bench's own sampler steps): {"cfg", "sampler_name", "latent": {"class_type", "inputs"}}."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from family_templates import FAMILIES as TEMPLATES
    spec = TEMPLATES[family]
    return {"cfg": float(spec["sampler"].get("cfg", 1.0)), "sampler_name": spec["sampler"].get("sampler_name", "euler"),
            "latent": spec.get("latent", {"class_type": "EmptySD3LatentImage"})}


def build_prompt(job, model, form, assets, memory_inputs, run_tag, sampler_steps, cfg=5.0, peer_lora_output=0):
    """server_matrix's prompt with the family's stock loaders and its template's sampling (cfg, sampler, latent)."""
    files = assets[model]
    if "loaders" not in files:  # an SD model: as server_matrix has it
        return _base_build_prompt(job, model, form, assets, memory_inputs, run_tag, sampler_steps, cfg,
                                  peer_lora_output)
    shim = {model: {"unet": "-", "vae": "-", "clip": ["-"], "dataset": files["dataset"],
                    "resolution": files["resolution"]}}
    prompt = _base_build_prompt(job, model, "split", shim, memory_inputs, run_tag, sampler_steps, 1.0,
                                peer_lora_output)
    loaders = files["loaders"]
    prompt["unet"] = {"class_type": "UNETLoader", "inputs": dict(loaders["UNETLoader"])}
    prompt["vae"] = {"class_type": "VAELoader", "inputs": dict(loaders["VAELoader"])}
    clip_node = "DualCLIPLoader" if "DualCLIPLoader" in loaders else "CLIPLoader"
    prompt["clip"] = {"class_type": clip_node, "inputs": dict(loaders[clip_node])}
    sampler = sampling(model)
    for node in prompt.values():
        if node["class_type"] == "EmptyLatentImage":  # 16-channel latents (Wan: a one-frame video)
            node["class_type"] = sampler["latent"]["class_type"]
            node["inputs"].update(sampler["latent"].get("inputs", {}))
        elif node["class_type"] == "KSampler":
            node["inputs"].update(scheduler="simple", cfg=sampler["cfg"], sampler_name=sampler["sampler_name"])
    return prompt


# --- host RAM --------------------------------------------------------------------------------------------------

def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class RssSampler:
    """The server process's VmRSS every `period` s in a thread: (monotonic time, bytes)."""

    def __init__(self, pid: int | None, period: float = 0.1, nvml=None):
        self.pid, self.period, self.samples, self.nvml, self.device = pid, period, [], nvml, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss")
        if pid is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            kib = _status_kib(self.pid, "VmRSS")
            if kib is not None:
                self.samples.append((time.monotonic(), kib * 1024))
            if self.nvml is not None and self.nvml.available:  # device-level used memory: a timeline beside the peaks
                try:
                    self.device.append((time.monotonic(), self.nvml.used()))
                except Exception:
                    pass
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)

    def peak(self, since: float | None = None, series=None) -> int | None:
        values = [b for t, b in (self.samples if series is None else series) if since is None or t >= since]
        return max(values) if values else None


_base_run_job = sm.run_job


def run_job(server, job, assets, run_tag, timeout_s, sampler_steps, cfg):
    pid = server.proc.pid if server.proc else None
    rss = RssSampler(pid, nvml=server.nvml)
    started = time.monotonic()
    try:
        row = _base_run_job(server, job, assets, run_tag, timeout_s, sampler_steps, cfg)
    finally:
        rss.stop()
    peak = rss.peak()
    row["host_rss_job_peak_gib"] = round(peak / GIB, 3) if peak else None
    if row.get("first_step_after_s") is not None:
        training = rss.peak(started + row["first_step_after_s"])
        row["host_rss_from_first_step_peak_gib"] = round(training / GIB, 3) if training else None
    if rss.device:  # NVML over the server's baseline: before the first reported step (setup, probes, capture) / after
        base = server.nvml_baseline
        first = started + row["first_step_after_s"] if row.get("first_step_after_s") is not None else None
        before = [b for t, b in rss.device if first is None or t < first]
        row["nvml_before_first_step_peak_over_baseline_gib"] = round((max(before) - base) / GIB, 3) if before else None
        if first is not None:
            after = rss.peak(first, rss.device)
            row["nvml_from_first_step_peak_over_baseline_gib"] = round((after - base) / GIB, 3) if after else None
        row["nvml_timeline_over_baseline"] = [(round(t - started, 1), round((b - base) / GIB, 2))
                                              for t, b in rss.device[::5]]
    hwm = _status_kib(pid, "VmHWM") if pid else None
    row["host_vmhwm_gib"] = round(hwm * 1024 / GIB, 3) if hwm else None
    if rss.samples:  # a coarse timeline: one sample per second, seconds since the job was queued
        row["host_rss_timeline"] = [(round(t - started, 1), round(b / GIB, 2)) for t, b in rss.samples[::10]]
    print(f"[dit] {server.spec.name}/{job.name}: host RSS job peak {row['host_rss_job_peak_gib']} GiB, from the "
          f"first step {row.get('host_rss_from_first_step_peak_gib')}, VmHWM {row['host_vmhwm_gib']}; NVML over baseline "
          f"before the first step {row.get('nvml_before_first_step_peak_over_baseline_gib')}, from it "
          f"{row.get('nvml_from_first_step_peak_over_baseline_gib')}", flush=True)
    return row


# --- server and assets -----------------------------------------------------------------------------------------

def _popen_with_dit_launcher(real_popen):
    def popen(cmd, *args, **kwargs):
        cmd = [str(DIT_LAUNCHER) if str(c) == str(REPO / "bench" / "comfy_launcher.py") else c for c in cmd]
        return real_popen(cmd, *args, **kwargs)
    return popen


class DitServer(sm.MatrixServer):
    """A MatrixServer started through bench/dit_launcher.py; with --tiny, tests/tiny_dit_configs loaded beside
    the pack (the narrow fixtures' widths)."""

    tiny = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tiny:
            link = self.base / "custom_nodes" / TINY_CONFIGS.name
            if not link.exists():
                link.symlink_to(TINY_CONFIGS, target_is_directory=True)
            self.spec = sm.replace(self.spec, extra_args=(*self.spec.extra_args, "--whitelist-custom-nodes",
                                                          sm.PACK_NAME, TINY_CONFIGS.name))

    def start(self, timeout: float = 180) -> None:
        super().start(timeout)
        self.command = [str(DIT_LAUNCHER) if c == str(REPO / "bench" / "comfy_launcher.py") else c
                        for c in self.command]


def build_assets(out: Path, servers, tiny: bool, comfyui: Path) -> dict:
    families = sorted({s.model for s in servers})
    cmd = [sys.executable, "-m", "bench.dit_assets", "--out", str(out), "--families", ",".join(families)]
    if tiny:
        cmd += ["--tiny", "--images", "3"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "COMFYUI_PATH": str(comfyui)})
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode != 0:
        raise SystemExit(f"dit_matrix: building assets failed ({shlex.join(cmd)}):\n{done.stderr[-3000:]}")
    print("\n".join(line for line in done.stdout.splitlines() if line.startswith("[assets]")), flush=True)
    print(f"[dit] assets ready in {time.monotonic() - started:.1f} s", flush=True)
    return json.loads((out / "assets.json").read_text())


def install() -> None:
    """Points server_matrix at this file's plans, prompt, job wrapper, server class and assets."""
    sm.PLANS.update({name: plan for name, plan in PLANS.items() if name not in ("smoke",)})
    sm.PLANS["dit_smoke"] = plan_smoke
    sm.build_prompt = build_prompt
    sm.run_job = run_job
    sm.MatrixServer = DitServer
    sm.build_assets = build_assets
    sm.subprocess = types.SimpleNamespace(**{k: getattr(subprocess, k) for k in dir(subprocess) if not k.startswith("__")})
    sm.subprocess.Popen = _popen_with_dit_launcher(subprocess.Popen)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    install()
    if "--tiny" in argv:
        DitServer.tiny = True
    for i, arg in enumerate(argv):  # this file's smoke plan is server_matrix's dit_smoke
        if arg == "--plan" and i + 1 < len(argv) and argv[i + 1] == "smoke":
            argv[i + 1] = "dit_smoke"
        elif arg == "--plan=smoke":
            argv[i] = "--plan=dit_smoke"
    sys.argv = [sys.argv[0], *argv]
    sm.main(argv)
    if "--list" in argv and "--tiny" not in argv:
        print_asset_estimates(argv)


def print_asset_estimates(argv) -> None:
    """--list: the plan's full-size files against the GPU machine (bench.dit_assets --estimate, in a child process:
    it imports ComfyUI to build the models on the meta device)."""
    plan = next((a.split("=", 1)[1] for a in argv if a.startswith("--plan=")), None) or \
        next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--plan"), "core")
    comfyui = next((a.split("=", 1)[1] for a in argv if a.startswith("--comfyui=")), None) or \
        next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--comfyui"), None)
    families = sorted({s.model for s in sm.PLANS[plan]()} & set(FAMILIES + NEW_FAMILIES))
    if not families:
        return
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if comfyui:
        env["COMFYUI_PATH"] = str(Path(comfyui).resolve())
    done = subprocess.run([sys.executable, "-m", "bench.dit_assets", "--estimate", "--families", ",".join(families)],
                          cwd=REPO, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[assets]")]
    print("\n".join(lines) if lines else f"[assets] estimate unavailable: {done.stderr.strip()[-500:]}", flush=True)


if __name__ == "__main__":
    main()
