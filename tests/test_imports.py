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


def _trainer_attribute_writes(source: str, name: str) -> list[str]:
    """Assignments (`x.attr = ...`, `setattr(x, ...)`) whose object is a trainer module or something imported from
    trainer/: how an experiment would patch the product instead of passing it arguments."""
    tree = ast.parse(source, name)
    from_trainer = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trainer":
            from_trainer |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            from_trainer |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                             if alias.name.split(".")[0] == "trainer"}
    writes = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for target in targets:
            while isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
                target = target.value  # trainer.step.compiled_blocks.X = ...
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id in from_trainer:
                writes.append(f"{name}:{node.lineno}: {target.value.id}.{target.attr}")
    return writes


def test_the_bench_sets_no_attribute_on_trainer_modules():
    """The bench's experiment knobs are arguments of the public API (TrainingSession's inductor_settings and
    offload_settings), not patches of the product's modules or classes."""
    writes = [w for path in sorted((REPO / "bench").glob("*.py"))
              for w in _trainer_attribute_writes(path.read_text(), path.relative_to(REPO).as_posix())]
    assert not writes, writes


def test_the_attribute_scan_sees_the_patches_it_must_refuse():
    sample = ("from trainer.step import compiled_blocks\nimport trainer.session\n"
              "def f():\n    from trainer.step.activation_offload import ActivationOffload\n"
              "    setattr(ActivationOffload, 'IN_FLIGHT', 8)\n    compiled_blocks.INDUCTOR_OPTIONS = {}\n"
              "    trainer.session.FIT_HEADROOM = 1\n    ok = object(); ok.x = 1\n")
    assert sorted(_trainer_attribute_writes(sample, "s")) == ["s:5: ActivationOffload.?",
                                                              "s:6: compiled_blocks.INDUCTOR_OPTIONS", "s:7: trainer.session"]


def test_loading_the_pack_imports_neither_peft_nor_bitsandbytes():
    """Quiet start (issue 33 item 5): ComfyUI loading the pack imports no peft and no bitsandbytes (bitsandbytes
    prints a warning on CPU machines and peft takes seconds); both load when a training starts. The pack is loaded
    as ComfyUI loads it: a package from its folder, with ComfyUI's own modules importable."""
    from comfy_headless import comfyui_path
    code = ("import sys, importlib.util\n"
            f"sys.path.insert(0, {str(comfyui_path())!r})\n"
            "import comfy.cli_args\ncomfy.cli_args.args.cpu = True\n"
            f"spec = importlib.util.spec_from_file_location('LeanLoRA', {str(REPO / '__init__.py')!r}, "
            f"submodule_search_locations=[{str(REPO)!r}])\n"
            "pack = importlib.util.module_from_spec(spec)\nsys.modules['LeanLoRA'] = pack\n"
            "spec.loader.exec_module(pack)\n"
            "assert len(pack.NODE_CLASS_MAPPINGS) == 6 and pack.WEB_DIRECTORY == './web'\n"
            "loaded = sorted({n.split('.')[0] for n in sys.modules} & {'peft', 'bitsandbytes'})\n"
            "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_bridge_decides_its_import_root_in_one_place():
    """bridge/trainer_api.py alone says where the trainer package is (the pack's or the top-level one); no other
    bridge module carries its own `if __package__` block, and every name it lists exists in its trainer module."""
    copies = [path.relative_to(REPO).as_posix() for path in sorted((REPO / "bridge").rglob("*.py"))
              if path.name != "trainer_api.py" and "__package__" in path.read_text()]
    assert not copies, copies
    code = ("from bridge import trainer_api\n"
            "missing = [name for name in trainer_api._HOME if not hasattr(trainer_api, name)]\n"
            "assert trainer_api.ROOT == 'trainer' and not missing, missing\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_step_and_memory_packages_sit_below_the_session_and_the_device_below_both():
    """trainer/device/ (the device's memory primitives) imports neither step/ nor memory/; step/ imports no memory/;
    neither imports the session: compiling and fitting get the session's narrow interfaces (step/probe_steps.py,
    memory/fit.FitTarget), not the session object."""
    below = {"device": {"step", "memory", "session"}, "step": {"memory", "session"}, "memory": {"session"}}
    offending = []
    for package, forbidden in below.items():
        for path in sorted((REPO / "trainer" / package).rglob("*.py")):
            for level, module in _imports(path):
                if level == 2:  # `..memory.fit` from trainer/step/x.py
                    name = module.split(".")[0]
                elif level == 0 and module.startswith("trainer."):
                    name = module.split(".")[1]
                else:
                    continue
                if name in forbidden:
                    offending.append(f"{path.relative_to(REPO)}: {'.' * level}{module}")
    assert not offending, offending
