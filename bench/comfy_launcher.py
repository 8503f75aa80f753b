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

    cd <ComfyUI> && python <repo>/bench/comfy_launcher.py --card-gib N --emulation holder  <ComfyUI's arguments ...>

With a holder (bench/card_holder.py: another process holds the rest of the device, so cudaMemGetInfo's free is
already the card's) the cap stays as a second check (it never binds first: the context is outside it), no
--reserve-vram is wanted, and torch.cuda.mem_get_info reports the card's total (N GiB) beside the real free
memory: the one thing a holder cannot change, and what ComfyUI's total_vram and LeanLoRA's "auto (this GPU)" / card
budget read (total - free: what the process and others hold on the card).
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


def _card_total(torch, card_gib: float) -> None:
    """torch.cuda.mem_get_info's total as the card's (N GiB); its free as the device reports it (a holder keeps the
    rest of the device), never above that total."""
    memory = torch.cuda.memory
    real = memory.mem_get_info
    card = int(card_gib * GIB)

    def mem_get_info(device=None):
        free, _total = real(device)
        return min(free, card), card
    memory.mem_get_info = torch.cuda.mem_get_info = mem_get_info
    print(f"[launcher] card emulation: a holder process keeps the rest of the device; mem_get_info's total "
          f"reported as {card_gib:g} GiB, its free as measured", file=sys.stderr, flush=True)


def _after_cuda_malloc(card_gib: float, holder: bool = False):
    def apply(torch):
        _cap(torch, card_gib)
        if holder and torch.cuda.is_available():
            _card_total(torch, card_gib)

    def then(_module):
        if "torch" in sys.modules:  # imported before cuda_malloc (ComfyUI warns about that itself): cap now
            apply(sys.modules["torch"])
        else:
            sys.meta_path.insert(0, _AfterImport("torch", apply))
    return then


def launcher_options(argv: list[str]) -> tuple[dict, list[str]]:
    """This launcher's leading options (--card-gib N, --emulation holder|fraction, and any --name value pair a
    wrapping launcher reads) and ComfyUI's arguments after them."""
    options = {}
    while argv[:1] and argv[0] in ("--card-gib", "--emulation", "--families"):
        options[argv[0][2:].replace("-", "_")], argv = argv[1], argv[2:]
    return options, argv


def main() -> None:
    options, argv = launcher_options(sys.argv[1:])
    card_gib = float(options["card_gib"]) if "card_gib" in options else None
    holder = options.get("emulation", "fraction") == "holder"
    comfy_dir = os.getcwd()
    if not os.path.isfile(os.path.join(comfy_dir, "main.py")):
        raise SystemExit(f"launcher: run it from a ComfyUI folder (no main.py in {comfy_dir})")
    sys.argv = [os.path.join(comfy_dir, "main.py"), *argv]
    sys.path[0] = comfy_dir  # as `python main.py` has it; this file's folder (bench/) must not shadow anything
    if card_gib is not None:
        sys.meta_path.insert(0, _AfterImport("cuda_malloc", _after_cuda_malloc(card_gib, holder)))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
