"""kohya sd-scripts as a peer (issue 14 item 7): its documented low-VRAM SDXL LoRA recipe on random full-size SDXL,
offline, in a process capped to a card size; device-level peak (NVML) and s/step beside ours.

    python -m bench.kohya_peer --kohya SD_SCRIPTS_DIR --work DIR --cards 24,8,6,4 [--steps 110]

kohya's code is not part of this repository: the source tree is given at run time (bench/kohya_peer.sh packs it).
What this module supplies: the weights (bench/full_size_assets.py's SDXL checkpoint in the single-file layout ComfyUI
saves, which kohya's loader reads: sdxl_model_util handles its `position_ids` key), the captioned 1024² set in
kohya's `<repeats>_<name>` folder layout, a tokenizer cache so that nothing is fetched from the hub (kohya's
--tokenizer_cache_dir looks for `openai_clip-vit-large-patch14` and `laion_CLIP-ViT-bigG-14-laion2B-39B-b160k`
folders; both hold the CLIP BPE vocabulary ComfyUI ships in comfy/sd1_tokenizer, the one both SDXL encoders use),
and a clock: each card size runs `sdxl_train_network.py` in a child process that caps itself
(set_per_process_memory_fraction, PyTorch's native allocator as kohya runs), samples NVML every 20 ms and stamps
every optimizer step with a global step post-hook (kohya reads the loss every step, so the stamps follow the GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
TOKENIZER_FOLDERS = ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k")
WARMUP_STEPS = 10  # left out of s/step (cuDNN/cuBLAS set-up, bitsandbytes' first steps)


def recipe(kohya_args: dict) -> list[str]:
    """kohya's low-VRAM SDXL LoRA settings (docs/train_SDXL-en.md: U-Net only, cached latents and text encoder
    outputs, gradient checkpointing, bf16 everywhere, 8-bit AdamW; --fp8_base for the least memory), SDPA."""
    return ["--network_module", "networks.lora", "--network_dim", "16", "--network_alpha", "16",
            "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
            "--gradient_checkpointing", "--fp8_base", "--mixed_precision", "bf16", "--full_bf16",
            "--optimizer_type", "AdamW8bit", "--learning_rate", "1e-4", "--sdpa", "--resolution", "1024,1024",
            "--train_batch_size", "1", "--caption_extension", ".txt", "--seed", "0", "--max_data_loader_n_workers", "0",
            "--save_model_as", "safetensors", *[str(x) for kv in kohya_args.items() for x in kv]]


def tokenizer_cache(tokenizers: Path, comfyui: Path) -> Path:
    """kohya's --tokenizer_cache_dir, filled from ComfyUI's CLIP BPE files instead of the hub."""
    for name in TOKENIZER_FOLDERS:
        if not (tokenizers / name).exists():
            shutil.copytree(comfyui / "comfy" / "sd1_tokenizer", tokenizers / name)
            # as the hub's copies have it: 77 tokens (ComfyUI's config says 8192, it chunks prompts itself);
            # OpenCLIP's bigG pads with "!"
            config_path = tokenizers / name / "tokenizer_config.json"
            config = json.loads(config_path.read_text())
            config.update(model_max_length=77, name_or_path=name.replace("_", "/", 1))
            if name.startswith("laion"):
                config["pad_token"] = "!"
                special = json.loads((tokenizers / name / "special_tokens_map.json").read_text())
                special["pad_token"] = "!"
                (tokenizers / name / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
            config_path.write_text(json.dumps(config, indent=1))
    return tokenizers


def prepare(work: Path, comfyui: Path) -> dict:
    """Checkpoint, kohya-layout dataset and tokenizer cache under work/ (the checkpoint in a child: CUDA context)."""
    env = {**os.environ, "COMFYUI_PATH": str(comfyui)}
    subprocess.run([sys.executable, "-m", "bench.full_size_assets", "--out", str(work / "assets"), "--models", "sdxl",
                    "--forms", "checkpoint"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    assets = json.loads((work / "assets" / "assets.json").read_text())["sdxl"]
    data = work / "kohya_data" / "1_shapes"
    data.mkdir(parents=True, exist_ok=True)
    for item in Path(assets["dataset"]).iterdir():
        if not (data / item.name).exists():
            (data / item.name).symlink_to(item)
    tokenizers = tokenizer_cache(work / "tokenizers", comfyui)
    return {"checkpoint": str(work / "assets" / "models" / "checkpoints" / assets["checkpoint"]),
            "train_data_dir": str(data.parent), "tokenizer_cache_dir": str(tokenizers)}


def child(card_gib: float, result_path: Path, script_argv: list[str]) -> None:
    """Inside the capped process: cap, clocks, then kohya's script as __main__ (cwd = the sd-scripts tree)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from bench.server_matrix import NvmlSampler
    nvml = NvmlSampler()
    baseline = nvml.used() if nvml.available else None  # before this process touches CUDA
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, card_gib * GIB / total), 0)
    nvml.start_window(os.getpid())
    stamps: list[float] = []
    register_optimizer_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    outcome, started = {"status": "ok"}, time.perf_counter()
    import transformers
    if not hasattr(transformers, "CLIPFeatureExtractor"):
        # kohya pins transformers 4.54; 5.x (the GPU image's) dropped this alias, which kohya's
        # lpw_stable_diffusion imports at start-up (for image generation, not training). The first attribute
        # access swaps the lazy module in sys.modules: set the alias on the module that is there afterwards.
        processor = transformers.CLIPImageProcessor
        sys.modules["transformers"].CLIPFeatureExtractor = processor
    sys.argv = script_argv
    sys.path.insert(0, os.getcwd())
    import library.sdxl_model_util as sdxl_model_util  # kohya's own loader (from the sd-scripts tree)
    load_on_device = sdxl_model_util._load_state_dict_on_device

    def load_with_transformers_5_keys(model, state_dict, device, dtype=None):
        # transformers 5's CLIPTextModel has no `text_model` submodule: its keys lack that prefix, which kohya's
        # SDXL loader (written for 4.x) keeps for text encoder 1 and then rejects as missing/unexpected keys
        if not hasattr(model, "text_model") and any(key.startswith("text_model.") for key in state_dict):
            state_dict = {key.removeprefix("text_model."): value for key, value in state_dict.items()}
        return load_on_device(model, state_dict, device, dtype)
    sdxl_model_util._load_state_dict_on_device = load_with_transformers_5_keys
    try:
        runpy.run_path(script_argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            outcome = {"status": "error", "error": f"exit {done.code}"}
    except BaseException as error:  # OOM and friends: the row records it
        outcome = {"status": "error", "error": f"{type(error).__name__}: {str(error)[:800]}"}
    peak, process_peak, samples = nvml.window() if nvml.available else (None, None, 0)
    steady = stamps[WARMUP_STEPS:]
    outcome.update(card_gib=card_gib, wall_s=round(time.perf_counter() - started, 1), optimizer_steps=len(stamps),
                   s_per_step=round((steady[-1] - steady[0]) / (len(steady) - 1), 4) if len(steady) > 1 else None,
                   steady_steps=max(0, len(steady) - 1),
                   torch_peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                   torch_peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 3),
                   nvml_peak_gib=round(peak / GIB, 3) if peak else None,
                   nvml_peak_over_baseline_gib=round((peak - baseline) / GIB, 3) if peak and baseline else None,
                   nvml_process_peak_gib=round(process_peak / GIB, 3) if process_peak else None, nvml_samples=samples)
    result_path.write_text(json.dumps(outcome, indent=1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kohya", type=Path, help="kohya-ss/sd-scripts source tree (holds sdxl_train_network.py)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/leanlora_kohya"))
    parser.add_argument("--comfyui", type=Path, default=REPO / ".cache" / "comfyui", help="for the weights' layout")
    parser.add_argument("--cards", default="24,8,6,4")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--timeout-s", type=float, default=240, help="per card size")
    parser.add_argument("--child", nargs=2, metavar=("CARD_GIB", "RESULT"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child:
        child(float(args.child[0]), Path(args.child[1]), rest[1:] if rest[:1] == ["--"] else rest)
        return
    script = args.kohya.resolve() / "sdxl_train_network.py"
    if not script.is_file():
        raise SystemExit(f"kohya peer: no sdxl_train_network.py in {args.kohya} (give the sd-scripts source tree)")
    args.work.mkdir(parents=True, exist_ok=True)
    begun = time.perf_counter()
    files = prepare(args.work.resolve(), args.comfyui.resolve())
    print(f"[kohya] weights, dataset and tokenizer cache ready in {time.perf_counter() - begun:.0f} s", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH":
           os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    rows = []
    for card in [float(c) for c in args.cards.split(",")]:
        result = args.work / f"card_{card:g}.json"
        result.unlink(missing_ok=True)
        output = args.work / f"out_{card:g}"
        cmd = [sys.executable, "-m", "bench.kohya_peer", "--child", f"{card:g}", str(result), "--", str(script),
               *recipe({"--pretrained_model_name_or_path": files["checkpoint"],
                        "--train_data_dir": files["train_data_dir"], "--tokenizer_cache_dir": files["tokenizer_cache_dir"],
                        "--output_dir": output, "--output_name": f"kohya_peer_{card:g}",
                        "--max_train_steps": args.steps})]
        log = args.work / f"card_{card:g}.log"
        started = time.perf_counter()
        try:
            with open(log, "w") as out:
                code = subprocess.run(cmd, cwd=args.kohya, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        row = json.loads(result.read_text()) if result.exists() else {"card_gib": card, "status": f"no result ({code})"}
        row["process_wall_s"] = round(time.perf_counter() - started, 1)
        if row.get("status") != "ok":
            row["log_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        rows.append(row)
        print(f"[kohya] card {card:g} GiB: {row.get('status')} s/step {row.get('s_per_step')} "
              f"NVML peak {row.get('nvml_peak_gib')} (over baseline {row.get('nvml_peak_over_baseline_gib')}) "
              f"torch {row.get('torch_peak_allocated_gib')}/{row.get('torch_peak_reserved_gib')} "
              f"{row.get('error', '')}", flush=True)
        if row.get("status") != "ok":
            print(row["log_tail"][-2500:], flush=True)
        # after every card: a command's time limit ending a later card keeps the earlier ones
        (args.work / "kohya_peer.json").write_text(json.dumps({"recipe": recipe({}), "steps": args.steps,
                                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
