"""bench/comfy_launcher.py (ComfyUI's main.py in this process, the whole process capped to a card of N GiB) plus
the text-encoder placement of a real N GiB card:

    cd <ComfyUI> && python <repo>/bench/dit_launcher.py --card-gib N  <ComfyUI's own arguments ...>

Why (../shared/DESIGN.md, "Card emulation caveat for DiTs"): comfy.model_management.text_encoder_initial_device
puts a text encoder of more than 1 GiB on the GPU when get_free_memory(GPU) > half the free host RAM and > 1.2 x
its size. get_free_memory reads the real device (cudaMemGetInfo), which neither --reserve-vram nor the per-process
memory fraction changes: on the H200 (~139 GiB free) every encoder goes to the GPU, where a real 8 or 24 GiB card
beside a machine with more RAM than that keeps it on the CPU until ComfyUI loads it for encoding (and under a cap
an 8 GB Qwen3-4B or 9.5 GB T5 then fails in the loader). Here, only while text_encoder_initial_device runs, the
GPU's free memory is what the card would have: N GiB less what this process holds on the device
(total - cudaMemGetInfo's free, i.e. its CUDA context and allocations). Every other use of get_free_memory
(ComfyUI's loading of models for encoding and sampling, LeanLoRA's own planning) is untouched. Without --card-gib
this is comfy_launcher.py exactly.

With `--emulation holder` (bench/card_holder.py holds the rest of the device: the free memory ComfyUI reads is
already the card's) there is no placement patch: the placement is ComfyUI's own, as on that card. The patch is
the fallback of `--emulation fraction` (the default) only.

`--families generic` (the bench's "generic" rows): the pack's family list is the generic path alone, so a model
that a family of its own would take (Z-Image) trains as any other ComfyUI diffusion model would.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import comfy_launcher  # noqa: E402  (bench/comfy_launcher.py; its main() resets sys.path[0] to ComfyUI's folder)

sys.path.pop(0)


def _placement_as_card(card_gib: float):
    def then(mm) -> None:
        import torch
        real_initial_device, card = mm.text_encoder_initial_device, card_gib * comfy_launcher.GIB

        def text_encoder_initial_device(load_device, offload_device, model_size=0):
            real_free = mm.get_free_memory

            def card_free(dev=None, torch_free_too=False):
                value = real_free(dev, torch_free_too)
                if dev is not None and getattr(dev, "type", None) == "cuda":
                    free, total = torch.cuda.mem_get_info(dev)
                    emulated = max(0, int(card - (total - free)))
                    value = (min(value[0], emulated), value[1]) if torch_free_too else min(value, emulated)
                return value
            mm.get_free_memory = card_free
            try:
                chosen = real_initial_device(load_device, offload_device, model_size)
            finally:
                mm.get_free_memory = real_free
            print(f"[launcher] text encoder of {model_size / comfy_launcher.GIB:.2f} GiB placed as on a {card_gib:g} "
                  f"GiB card: {chosen}", file=sys.stderr, flush=True)
            return chosen
        mm.text_encoder_initial_device = text_encoder_initial_device
        print(f"[launcher] text-encoder placement as on a {card_gib:g} GiB card", file=sys.stderr, flush=True)
    return then


class _FamiliesOnly:
    """After the pack's bridge/families/__init__.py runs (ComfyUI imports the pack under its folder path, so the
    name ends in .bridge.families), its FAMILIES list becomes the named families alone."""

    def __init__(self, names: list[str]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.endswith(".bridge.families"):
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, names = spec.loader.exec_module, self.names

        def exec_then(module):
            exec_module(module)
            module.FAMILIES[:] = [f for f in module.FAMILIES if type(f).__name__.lower() in names]
            print(f"[launcher] LeanLoRA's families: {[type(f).__name__ for f in module.FAMILIES]}", file=sys.stderr,
                  flush=True)
        spec.loader.exec_module = exec_then
        return spec


def main() -> None:
    options, _ = comfy_launcher.launcher_options(sys.argv[1:])
    if "card_gib" in options and options.get("emulation", "fraction") != "holder":
        sys.meta_path.insert(0, comfy_launcher._AfterImport("comfy.model_management",
                                                            _placement_as_card(float(options["card_gib"]))))
    if options.get("families"):
        sys.meta_path.insert(0, _FamiliesOnly(options["families"].lower().split(",")))
    comfy_launcher.main()


if __name__ == "__main__":
    main()
