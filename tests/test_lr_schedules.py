"""The learning-rate schedules without diffusers (issue 15, item 15): torch's LambdaLR with the shapes of diffusers'
get_scheduler, checked against the formulas and, where diffusers is installed (a test dependency), against it."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.optimizers import build_lr_schedule
from trainer.settings import LR_SCHEDULES

REPO = Path(__file__).resolve().parents[1]
TOTAL, WARMUP, LR = 20, 4, 1e-2


def _rates(name: str, warmup=WARMUP, total=TOTAL, lr=LR) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = build_lr_schedule(optimizer, name, warmup, total)
    rates = []
    for _ in range(total + 2):  # two steps past the end: the schedules stay at their floor
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


def _formula(name: str, step: int, warmup=WARMUP, total=TOTAL, lr=LR) -> float:
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (total - warmup)
    return lr * {
        "constant": 1.0,
        "linear": max(0.0, 1 - progress),
        "cosine": max(0.0, 0.5 * (1 + math.cos(math.pi * progress))),  # past the end it rises again, as there
        "cosine_with_restarts": 0.0 if progress >= 1 else 0.5 * (1 + math.cos(math.pi * progress)),
        "polynomial": (1e-7 + (lr - 1e-7) * max(0.0, 1 - progress)) / lr,
    }[name]


@pytest.mark.parametrize("name", LR_SCHEDULES)
def test_schedules_follow_their_formulas(name):
    assert _rates(name) == pytest.approx([_formula(name, s) for s in range(TOTAL + 2)], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("name", LR_SCHEDULES)
@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_schedules_match_diffusers(name, warmup):
    get_scheduler = pytest.importorskip("diffusers.optimization").get_scheduler
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    their_name = "constant_with_warmup" if name == "constant" and warmup else name
    schedule = get_scheduler(their_name, optimizer, num_warmup_steps=warmup, num_training_steps=TOTAL)
    theirs = []
    for _ in range(TOTAL + 2):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert _rates(name, warmup=warmup) == pytest.approx(theirs, rel=1e-12, abs=1e-18)


def test_a_resumed_schedule_continues_the_curve_and_unknown_names_fail():
    full = _rates("cosine")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    build_lr_schedule(optimizer, "cosine", WARMUP, TOTAL, done_steps=9)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(full[9])
    with pytest.raises(ValueError, match="schedule"):
        build_lr_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR), "step", 0, TOTAL)


def test_the_pack_imports_no_diffusers():
    """diffusers pulls huggingface-hub>=1.32 and so transformers 5 into a ComfyUI environment: the pack must not
    need it. Every trainer and bridge module but the ComfyUI adapter imports, and a schedule and a LoRA export run,
    with diffusers unimportable."""
    code = (
        "import sys; sys.modules['diffusers'] = None\n"
        "import pkgutil, importlib, torch, trainer, bridge\n"
        "for m in pkgutil.iter_modules(trainer.__path__):\n"
        "    importlib.import_module('trainer.' + m.name)\n"
        "importlib.import_module('bridge.cast_weights')\n"
        "from trainer.optimizers import build_lr_schedule\n"
        "from trainer.lora import inject_lora, kohya_state_dict\n"
        "from trainer.settings import LoraSettings\n"
        "from helpers import TinyNet, sd_targets\n"
        "opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)\n"
        "build_lr_schedule(opt, 'cosine', 2, 10)\n"
        "net = TinyNet(); inject_lora(net, LoraSettings(rank=2, alpha=2.0), 0, target_modules=sd_targets(LoraSettings(rank=2, alpha=2.0)))\n"
        "assert kohya_state_dict(net, LoraSettings(rank=2, alpha=2.0))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
