"""The layering, checked on the source: trainer/ is a library that knows no ComfyUI (the bridge package does), and
importing all of it loads no ComfyUI module."""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMFY_MODULES = {"comfy", "comfy_extras", "comfy_api", "comfy_execution", "folder_paths", "server", "nodes",
                 "latent_preview", "execution", "comfyui_version"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of every import in a file: level 0 = absolute, 1 = `.x`, 2 = `..x` ..."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


def test_the_trainer_imports_no_comfyui_and_nothing_outside_itself():
    offending = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        depth = len(path.relative_to(REPO / "trainer").parts) - 1  # a sub-package may import its parent
        for level, module in _imports(path):
            top = module.split(".")[0]
            if (level == 0 and top in COMFY_MODULES) or level > depth + 1:
                offending.append(f"{path.relative_to(REPO)}: {'.' * level}{module}")
    assert not offending, offending


def test_the_scan_sees_what_it_must_refuse(tmp_path):
    """The check above is not vacuous: these forms are what it reports."""
    sample = tmp_path / "sample.py"
    sample.write_text("import comfy.model_management\nfrom folder_paths import models_dir\nfrom ..bridge import x\n"
                      "def f():\n    import server\n")
    assert _imports(sample) == [(0, "comfy.model_management"), (0, "folder_paths"), (2, "bridge"), (0, "server")]


def test_importing_every_trainer_module_loads_no_comfyui():
    code = ("import pkgutil, importlib, sys, trainer\n"
            "for m in pkgutil.iter_modules(trainer.__path__):\n"
            "    importlib.import_module('trainer.' + m.name)\n"
            f"loaded = sorted(name for name in sys.modules if name.split('.')[0] in {sorted(COMFY_MODULES)!r})\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
