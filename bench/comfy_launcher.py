"""Runs ComfyUI's main.py in this process as `python main.py ARGS` would, with the whole process emulating a
card of N GiB:

    cd <ComfyUI> && python <repo>/bench/comfy_launcher.py --card-gib N  <ComfyUI's own arguments ...>

The cap is `torch.cuda.set_per_process_memory_fraction(N GiB / total)`, set once torch has been imported and
before ComfyUI's code runs anything on the GPU. The allocator stays the one ComfyUI picks: its own cuda_malloc.py
(imported by main.py, before torch) sets PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync unless
--disable-cuda-malloc is given. This launcher never imports torch itself before cuda_malloc has run: an import hook
waits for cuda_malloc, then for torch (CUDA, and with it the allocator, is initialised only by the cap call).
ComfyUI's own planning is told the same card with `--reserve-vram <total - N>` (the caller passes it: 0.33 reads
it before torch is imported).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import runpy
import sys

GIB = 2 ** 30


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` right after the top-level module `name` has been executed (once)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders, exactly once
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then
        return spec


def _cap(torch, card_gib: float) -> None:
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if not torch.cuda.is_available():
        print(f"[launcher] no CUDA device: card emulation ({card_gib:g} GiB) not applied, "
              f"PYTORCH_CUDA_ALLOC_CONF={allocator!r}", file=sys.stderr, flush=True)
        return
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, card_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    print(f"[launcher] card emulation: {card_gib:g} GiB of {total / GIB:.2f} GiB (memory fraction {fraction:.5f}), "
          f"PYTORCH_CUDA_ALLOC_CONF={allocator!r}", file=sys.stderr, flush=True)


def _after_cuda_malloc(card_gib: float):
    def then(_module):
        if "torch" in sys.modules:  # imported before cuda_malloc (ComfyUI warns about that itself): cap now
            _cap(sys.modules["torch"], card_gib)
        else:
            sys.meta_path.insert(0, _AfterImport("torch", lambda torch: _cap(torch, card_gib)))
    return then


def main() -> None:
    argv = sys.argv[1:]
    card_gib = None
    if argv[:1] == ["--card-gib"]:
        card_gib, argv = float(argv[1]), argv[2:]
    comfy_dir = os.getcwd()
    if not os.path.isfile(os.path.join(comfy_dir, "main.py")):
        raise SystemExit(f"launcher: run it from a ComfyUI folder (no main.py in {comfy_dir})")
    sys.argv = [os.path.join(comfy_dir, "main.py"), *argv]
    sys.path[0] = comfy_dir  # as `python main.py` has it; this file's folder (bench/) must not shadow anything
    if card_gib is not None:
        sys.meta_path.insert(0, _AfterImport("cuda_malloc", _after_cuda_malloc(card_gib)))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
