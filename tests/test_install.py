"""Installing the pack into a supported ComfyUI environment changes no installed package (issue 15, item 15).

The environment: a throwaway venv holding ComfyUI's own requirements (the requirements.txt of the ComfyUI in use)
at their oldest allowed versions. uv resolves them with `--resolution lowest-direct`: every requirement with a
lower bound at the oldest version that works with the others (transformers 4.50.3 -> tokenizers 0.21, ...), the
unbounded ones at their newest (pass 1), and torch / torchvision as installed here. The venv gets real installs of
that lock (uv, --no-deps, from uv's cache after the first run), except torch, torchvision and their CUDA/triton
wheels, which are this venv's own distributions linked in through a .pth file (GBs to copy otherwise).
Then `pip install --dry-run --report` of requirements.txt runs against that venv, as a user's install would, and
nothing already installed may be upgraded, downgraded or reinstalled. Skipped only when no package registry answers.
"""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from comfy_headless import comfyui_path

REPO = Path(__file__).resolve().parents[1]
TORCH_FAMILY = ("torch", "torchvision", "torchaudio")
# Listed only to bound what another dependency pulls in (see requirements.txt), never imported by the pack
BOUNDS_ONLY = ("accelerate",)
NETWORK_ERRORS = re.compile(r"Failed to fetch|dns error|Connection refused|Could not connect|timed out|"
                            r"Temporary failure in name resolution|Network is unreachable", re.I)


def _uv(*args: str, cwd: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "uv", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        if NETWORK_ERRORS.search(result.stderr):
            pytest.skip(f"no package registry reachable: {result.stderr.strip()[-300:]}")
        raise AssertionError(f"uv {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def _pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==([^\s;]+)", line)
        if match:
            pins[canonicalize_name(match[1])] = match[2]
    return pins


def _oldest_comfyui_lock(work: Path) -> dict[str, str]:
    """ComfyUI's requirements at their oldest allowed versions (see the module docstring), as {name: version}."""
    requirements = []
    for line in (comfyui_path() / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and canonicalize_name(Requirement(line).name) not in TORCH_FAMILY:
            requirements.append(Requirement(line))
    installed_torch = [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in TORCH_FAMILY[:2]]
    (work / "torch.txt").write_text("\n".join(installed_torch) + "\n")
    (work / "comfyui.in").write_text("\n".join(map(str, requirements)) + "\n")
    common = ["--python-version", f"{sys.version_info.major}.{sys.version_info.minor}", "-c", "torch.txt",
              "--no-header", "--no-annotate", "-q"]
    _uv("pip", "compile", "comfyui.in", *common, "-o", "newest.txt", cwd=work)
    newest = _pins(work / "newest.txt")
    bounded = (">=", "==", "~=", ">", "===")
    oldest_in = [str(r) if any(s.operator in bounded for s in r.specifier)
                 else f"{r.name}=={newest[canonicalize_name(r.name)]}" for r in requirements]
    (work / "oldest.in").write_text("\n".join(oldest_in) + "\n")
    _uv("pip", "compile", "oldest.in", *common, "--resolution", "lowest-direct", "-o", "oldest.txt", cwd=work)
    return _pins(work / "oldest.txt")


def _host_torch_stack() -> set[str]:
    """torch, torchvision and the binary wheels they need here (CUDA libraries, triton, with the extras asked for,
    e.g. cuda-toolkit[cufft]): linked, not installed."""
    names, todo = set(), [(name, frozenset()) for name in TORCH_FAMILY[:2]]
    while todo:
        name, extras = todo.pop()
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        names.add(canonicalize_name(name))
        for requirement in map(Requirement, dist.requires or ()):
            wanted = requirement.marker is None or any(requirement.marker.evaluate({"extra": extra})
                                                        for extra in {"", *extras})
            if wanted and re.match(r"(nvidia|cuda|triton)", canonicalize_name(requirement.name)):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return names


def _link_distribution(name: str, into: Path) -> None:
    dist = importlib.metadata.distribution(name)
    site = Path(dist.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    for top in tops:
        target = into / top
        if not target.exists() and (site / top).exists():
            target.symlink_to(site / top)


def _build_environment(work: Path) -> Path:
    lock = _oldest_comfyui_lock(work)
    linked = _host_torch_stack()
    env = work / "comfyui-env"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(env)],
                   check=True, timeout=300)
    python = env / "bin" / "python"
    # the lock's torch stack is PyPI's idea of torch's wheels; this machine's own torch stack stands in for it
    (work / "install.txt").write_text("".join(f"{name}=={version}\n" for name, version in lock.items()
                                              if name not in linked and name not in TORCH_FAMILY
                                              and not re.match(r"(nvidia|cuda|triton)", name)))
    _uv("pip", "install", "--python", str(python), "--no-deps", "-q", "-r", "install.txt", cwd=work)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    host = work / "host-torch"
    host.mkdir()
    for name in linked:
        _link_distribution(name, host)
    (site / "host_torch.pth").write_text(f"{host}\n")
    return python


def _installed(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return {canonicalize_name(k): v for k, v in json.loads(out).items()}


def _changes(python: Path, requirements: Path, work: Path) -> tuple[list[str], list[str]]:
    """(installed packages pip would change, packages it would add) for `pip install -r requirements`."""
    report = work / f"report-{requirements.stem}.json"
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "-q",
                             "--report", str(report), "-r", str(requirements)],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        if NETWORK_ERRORS.search(result.stderr):
            pytest.skip(f"no package registry reachable: {result.stderr.strip()[-300:]}")
        raise AssertionError(f"pip could not install {requirements} into the ComfyUI environment:\n"
                             f"{result.stderr[-3000:]}")
    installed = _installed(python)
    changed, added = [], []
    for item in json.loads(report.read_text())["install"]:
        name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
        if name in installed:
            changed.append(f"{name} {installed[name]} -> {version}")
        else:
            added.append(f"{name} {version}")
    return changed, added


@pytest.fixture(scope="module")
def comfyui_environment(tmp_path_factory):
    work = tmp_path_factory.mktemp("install")
    python = _build_environment(work)
    installed = _installed(python)
    # the environment is what it claims: ComfyUI's oldest transformers stack, and the torch of this machine
    assert installed["torch"] == importlib.metadata.version("torch")
    return python, work, installed


def test_environment_holds_comfyuis_oldest_requirements(comfyui_environment):
    _python, _work, installed = comfyui_environment
    for line in (comfyui_path() / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name in TORCH_FAMILY[2:]:
            continue  # torchaudio: see scripts/setup_env.sh
        assert name in installed and installed[name] in requirement.specifier, (name, installed.get(name))
        lowest = [s.version for s in requirement.specifier if s.operator in (">=", "==", "~=")]
        if name == "transformers" and lowest:
            assert installed[name] == lowest[0]  # the oldest allowed


def test_installing_the_pack_changes_no_installed_package(comfyui_environment):
    python, work, _installed_now = comfyui_environment
    changed, added = _changes(python, REPO / "requirements.txt", work)
    assert not changed, f"pip install -r requirements.txt would change: {changed}"
    assert added, "the pack's own dependencies should be new installs"


def _torch_only_environment(work: Path, version: str) -> Path:
    """A venv whose one distribution is torch `version`, as metadata: what pip sees of a ComfyUI environment's torch
    when it resolves (the wheel itself, GBs, plays no part in that). Returns its python."""
    env = work / f"torch-{version}"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(env)],
                   check=True, timeout=300)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    return python


@pytest.mark.parametrize("torch_version", ["2.4.1", "2.5.1", "newest"])
def test_installing_the_pack_keeps_every_torch_comfyui_accepts(tmp_path, torch_version):
    """Issue 45: with torch 2.4 or 2.5, peft pulled accelerate 1.16, which needs torch>=2.6, and pip replaced the
    user's torch. "newest": this machine's torch, the newest its registry offers."""
    version = importlib.metadata.version("torch").split("+")[0] if torch_version == "newest" else torch_version
    changed, added = _changes(_torch_only_environment(tmp_path, version), REPO / "requirements.txt", tmp_path)
    assert not changed, f"pip install -r requirements.txt beside torch {version} would change: {changed}"
    assert not [line for line in added if line.split()[0] in TORCH_FAMILY], added


def test_the_check_sees_an_upgrade(comfyui_environment):
    """The control: the requirement the pack listed before (diffusers, whose current releases need
    huggingface-hub>=1.32) upgrades huggingface-hub, so the assertion above can fail."""
    python, work, _installed_now = comfyui_environment
    before = work / "diffusers-requirement.txt"
    before.write_text("diffusers>=0.31\n")
    changed, _added = _changes(python, before, work)
    assert any(line.startswith("huggingface-hub ") for line in changed), changed


def test_every_listed_dependency_is_imported_by_the_pack():
    sources = "\n".join(p.read_text() for folder in ("trainer", "bridge", "nodes")
                        for p in (REPO / folder).rglob("*.py"))
    sources += (REPO / "__init__.py").read_text()
    import_names = {"pillow": "PIL", "nvidia-ml-py": "pynvml"}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name = canonicalize_name(Requirement(line).name)
        if name in BOUNDS_ONLY:
            continue
        module = import_names.get(name, name.replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {module}\b", sources, re.M), f"{name} is listed but never imported"


def _torchaudio_step(python: Path, comfy_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "install_torchaudio.sh"), str(python), str(comfy_dir)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PIP": f"{sys.executable} -m pip --python {python}"})


def test_setup_installs_a_torchaudio_matching_torch_only_where_comfyui_imports_it(comfyui_environment, tmp_path):
    """Item 17 (runs last: it installs into the shared throwaway environment). ComfyUI 0.33 imports torchaudio
    at start-up; setup_env.sh keeps it out of ComfyUI's requirements so that pip cannot replace torch, and then
    installs one that works with the installed torch, without touching torch."""
    python, _work, before = comfyui_environment
    assert "torchaudio" not in before
    silent = tmp_path / "comfyui-without-audio"
    (silent / "comfy").mkdir(parents=True)
    (silent / "comfy" / "sd.py").write_text("import torch\n")
    result = _torchaudio_step(python, silent)
    assert result.returncode == 0, result.stderr
    assert "torchaudio" not in _installed(python)  # that ComfyUI does not import it: nothing installed
    loud = tmp_path / "comfyui-0.33"
    (loud / "comfy").mkdir(parents=True)
    (loud / "comfy" / "sd.py").write_text("import torch\nimport torchaudio\n")  # as comfy/sd.py in 0.33
    result = _torchaudio_step(python, loud)
    assert result.returncode == 0, result.stdout + result.stderr
    after = _installed(python)
    assert "torchaudio" in after
    assert {k: v for k, v in after.items() if k != "torchaudio"} == before  # torch and the rest untouched
    check = subprocess.run([str(python), "-c", "import torch, torchaudio, torchaudio.functional as F; "
                            "print(F.resample(torch.randn(1, 1600), 16000, 8000).shape[-1])"],
                           capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == "800", check.stderr[-2000:]
    again = _torchaudio_step(python, loud)  # importable now: a no-op
    assert again.returncode == 0 and "installing" not in again.stdout
