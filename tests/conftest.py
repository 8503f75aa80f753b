"""Shared fixtures. Tests import the library as `import trainer` and the harness as `import comfy_headless`.

Tests marked `comfy` share one real ComfyUI server per session (start ~10 s), whose base directory holds the tiny
SD1.5 checkpoint and dataset built by scripts/tiny_assets.py.
"""
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
for path in (REPO / "tests", REPO / "scripts", REPO):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import importlib.abc  # noqa: E402
import importlib.machinery  # noqa: E402

from comfy_headless import comfyui_path  # noqa: E402  (a path and a subprocess harness: imports no ComfyUI)

# The real ComfyUI goes first on sys.path: ComfyUI's top-level `nodes` module must win over this pack's `nodes/`
# package. Tests run ComfyUI on the CPU, as in CI. Nothing here imports ComfyUI: unit tests (test_imports.py,
# test_pure_torch_training.py) run without it, and the first `import comfy...` of a test that needs it sets the CPU
# flag on ComfyUI's arguments before any ComfyUI module reads them.
sys.path.insert(0, str(comfyui_path()))


class _ComfyOnCpu(importlib.abc.MetaPathFinder):
    """Sets comfy.cli_args.args.cpu the moment comfy.cli_args is first imported (comfy.model_management reads it
    while importing)."""

    def find_spec(self, name, path, target=None):
        if name != "comfy.cli_args":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.args.cpu = True
            spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _ComfyOnCpu())

# pytest imports the root's __init__.py before the first test (the repo root is a package: the pack), and that file
# registers every node, importing ComfyUI. Registered here as a bare package (its folder, no __init__ run), which
# pytest's importlib mode takes as already imported; tests that need the nodes import the pack themselves.
_pack_root = types.ModuleType(REPO.name)
_pack_root.__path__ = [str(REPO)]
sys.modules.setdefault(REPO.name, _pack_root)

import tiny_assets as tiny_assets_lib  # noqa: E402  (importable thanks to the sys.path entries above)
from comfy_headless import ComfyServer  # noqa: E402

TINY_CHECKPOINT = "leanlora_tiny_sd15.safetensors"
TINY_DATASET = "tiny_dataset"


def pytest_configure(config):
    config.addinivalue_line("markers", "comfy: needs the real ComfyUI server (session fixture comfy_server)")
    config.addinivalue_line("markers", "comfy033: about ComfyUI 0.33; run on both versions (scripts/test.sh)")


@pytest.fixture(scope="session")
def comfy_base(tmp_path_factory) -> Path:
    """The session's ComfyUI base directory (ComfyServer adds models/, input/, output/, custom_nodes/LeanLoRA)."""
    return tmp_path_factory.mktemp("comfy_base")


@pytest.fixture(scope="session")
def tiny_assets(comfy_base) -> dict:
    """Paths of the tiny checkpoint (models/checkpoints/TINY_CHECKPOINT) and dataset (input/TINY_DATASET)."""
    return {
        "checkpoint": tiny_assets_lib.build_tiny_sd15_checkpoint(comfy_base / "models/checkpoints" / TINY_CHECKPOINT),
        "dataset": tiny_assets_lib.build_tiny_dataset(comfy_base / "input" / TINY_DATASET),
    }


@pytest.fixture(scope="session")
def comfy_server(comfy_base, tiny_assets):
    """The session's server: this pack, plus the test-only package that lets ComfyUI's stock loaders build the tiny
    DiT models at their size (tests/tiny_dit_configs; it changes nothing for real-size files)."""
    with ComfyServer(comfy_base, extra_packs=(REPO / "tests" / "tiny_dit_configs",)) as server:
        yield server


@pytest.fixture(scope="session")
def comfy_objects(tiny_assets):
    """MODEL, CLIP and VAE of the tiny checkpoint, loaded by ComfyUI's own loader in this process."""
    import torch
    import comfy.sd
    with torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(
            str(tiny_assets["checkpoint"]), output_vae=True, output_clip=True, embedding_directory=None)
    return model, clip, vae


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Two images of the tiny dataset, scanned at 64 px (the in-process train_lora tests)."""
    from trainer.dataset import scan_folder
    return scan_folder(tiny_assets_lib.build_tiny_dataset(tmp_path_factory.mktemp("ds"), n=2), 64)


@pytest.fixture()
def adapter(comfy_objects):
    """The bridge's ModelAdapter over the tiny checkpoint's MODEL, CLIP and VAE."""
    from bridge.comfy_adapter import ComfyAdapter
    return ComfyAdapter(*comfy_objects)
