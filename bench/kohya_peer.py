"""kohya sd-scripts as a peer (issue 14 item 7, issue 44 "ahead of the peers"): its documented low-VRAM LoRA recipes
on random full-size weights, offline, on an emulated card; device-level peak (NVML) and s/step beside ours.

    python -m bench.kohya_peer --kohya SD_SCRIPTS_DIR --work DIR --cards 24,8,6,4 [--steps 110]          # SDXL
    python -m bench.kohya_peer --family flux --kohya SD_SCRIPTS_DIR --cards 8 --assets /tmp/gm_assets \
        --steps 60 --budget-s 220                                                                       # FLUX.1-dev
    python -m bench.kohya_peer --family flux --kohya SD_SCRIPTS_DIR --dry-run     # CPU: args, tokenizers, dataset,
                                                                                  # kohya's loaders on our files

kohya's code is not part of this repository: the source tree is given at run time (bench/kohya_peer.sh packs it).
What this module supplies, per family:
- sdxl: bench/full_size_assets.py's SDXL checkpoint in the single-file layout ComfyUI saves (kohya's loader reads it:
  sdxl_model_util handles its `position_ids` key); `sdxl_train_network.py` with docs/train_SDXL-en.md's low-VRAM
  settings. Tokenizers: `openai_clip-vit-large-patch14` and `laion_CLIP-ViT-bigG-14-laion2B-39B-b160k`, both the
  CLIP BPE vocabulary ComfyUI ships in comfy/sd1_tokenizer.
- flux: the files bench/dit_assets.py writes for our FLUX.1-dev rows (the same random weights: bench/gpu_matrix.py's
  /tmp/gm_assets when --assets names it, else built under WORK/assets): the bf16 flux1-dev single file (BFL keys,
  which kohya's flux_utils reads as is), clip_l, t5xxl_fp8_e4m3fn and ae; `flux_train_network.py` with
  docs/flux_train_network.md's recipe for a small card: fp8 base, `--blocks_to_swap` from its VRAM table (8 GB: 28),
  cached latents and text-encoder outputs, U-Net (DiT) only, gradient checkpointing, AdamW8bit, SDPA, and its
  example's guidance 1.0 / flux_shift / raw. Tokenizers: `openai_clip-vit-large-patch14` (ComfyUI's CLIP BPE files)
  and `google_t5-v1_1-xxl` (ComfyUI's comfy/text_encoders/t5_tokenizer, the T5 v1.1 SentencePiece vocabulary).
Both: the captioned 1024² set in kohya's `<repeats>_<name>` folder layout and kohya's --tokenizer_cache_dir, so that
nothing is fetched from the hub.

The card, as our rows have it (bench/server_matrix.py, --emulation): "holder" (default): bench/card_holder.py takes
the rest of the device in a separate process before kohya starts, and kohya's process is also capped to the card
(set_per_process_memory_fraction, a second check, as bench/comfy_launcher.py does); "fraction": the cap alone (what
the SDXL rows of 3-4 Dec used). kohya runs under PyTorch's native allocator, as it does for its users.

The clock: each card runs the script in a child process that stamps every optimizer step with a global step
post-hook (kohya reads the loss every step, so the stamps follow the GPU) into a file, line by line; this process
samples NVML every 20 ms (it never touches CUDA itself) from a baseline taken with the holder up, before the child
starts. A card that runs out of time is killed and still gives s/step over the steps it did. s/step leaves out
the first --warmup-steps (cuDNN/cuBLAS set-up, bitsandbytes' first steps, the block swapper's first pass).

transformers: kohya pins 4.54; the GPU image has 5.x. The child adds shims outside kohya's code (install_shims).
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
WARMUP_STEPS = 10
SCRIPTS = {"sdxl": "sdxl_train_network.py", "flux": "flux_train_network.py"}
# kohya's --tokenizer_cache_dir folders (model id with "/" -> "_") and the ComfyUI folder each is filled from
TOKENIZERS = {
    "sdxl": {"openai_clip-vit-large-patch14": "comfy/sd1_tokenizer",
             "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k": "comfy/sd1_tokenizer"},
    "flux": {"openai_clip-vit-large-patch14": "comfy/sd1_tokenizer",
             "google_t5-v1_1-xxl": "comfy/text_encoders/t5_tokenizer"},
}
# docs/flux_train_network.md, "VRAM Usage Optimization" (with --fp8_base): card GB -> --blocks_to_swap. 24 GB needs
# none (its batch 2 aside); 16 GB says "use --blocks_to_swap" without a number, so it is not guessed here.
FLUX_BLOCKS_TO_SWAP = {24: 0, 12: 16, 10: 22, 8: 28}


def flux_blocks_to_swap(card_gib: float) -> int:
    if card_gib not in FLUX_BLOCKS_TO_SWAP:
        raise SystemExit(f"kohya peer: docs/flux_train_network.md gives --blocks_to_swap for "
                         f"{sorted(FLUX_BLOCKS_TO_SWAP)} GB cards, not {card_gib:g}: pass --blocks-to-swap N")
    return FLUX_BLOCKS_TO_SWAP[int(card_gib)]


def recipe(family: str, kohya_args: dict) -> list[str]:
    """kohya's low-VRAM LoRA settings for the family, SDPA, rank 16, 1024², batch 1, seed 0, then kohya_args.
    sdxl: docs/train_SDXL-en.md (U-Net only, cached latents and text-encoder outputs, gradient checkpointing, bf16
    everywhere, 8-bit AdamW; --fp8_base for the least memory). flux: docs/flux_train_network.md's example and its
    small-card options (fp8 base, block swap, cached latents and text-encoder outputs, AdamW8bit, guidance 1.0,
    flux_shift, raw), DiT only, bf16 mixed precision (the example's fp16 is for cards without bf16)."""
    common = ["--network_dim", "16", "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
              "--gradient_checkpointing", "--fp8_base", "--mixed_precision", "bf16", "--optimizer_type", "AdamW8bit",
              "--learning_rate", "1e-4", "--sdpa", "--resolution", "1024,1024", "--train_batch_size", "1",
              "--caption_extension", ".txt", "--seed", "0", "--max_data_loader_n_workers", "0",
              "--save_model_as", "safetensors"]
    if family == "sdxl":
        own = ["--network_module", "networks.lora", "--network_alpha", "16", "--full_bf16"]
    else:
        own = ["--network_module", "networks.lora_flux", "--network_alpha", "1", "--lr_scheduler", "constant",
               "--guidance_scale", "1.0", "--timestep_sampling", "flux_shift", "--model_prediction_type", "raw"]
    return own + common + [str(x) for kv in kohya_args.items() for x in kv]


def tokenizer_cache(tokenizers: Path, comfyui: Path, family: str) -> Path:
    """kohya's --tokenizer_cache_dir, filled from ComfyUI's tokenizer files instead of the hub."""
    for name, source in TOKENIZERS[family].items():
        if (tokenizers / name).exists():
            continue
        if not (comfyui / source).is_dir():
            raise SystemExit(f"kohya peer: no {comfyui / source} for the {name} tokenizer (the T5 one comes with "
                             f".gpu/dit_tokenizers.tgz: bench/prepare_gpu_carry.sh)")
        shutil.copytree(comfyui / source, tokenizers / name)
        if "clip" not in name.lower():
            continue
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


def kohya_dataset(source: Path, folder: Path) -> Path:
    """kohya's DreamBooth layout: train_data_dir/1_shapes/<our images and captions> (links); returns train_data_dir."""
    data = folder / "1_shapes"
    data.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if not (data / item.name).exists():
            (data / item.name).symlink_to(item.resolve())
    return folder


def flux_files(assets: Path) -> dict | None:
    """Our FLUX.1-dev files and image set in an assets folder (bench/dit_assets.py's layout), or None if absent."""
    from bench import dit_assets
    listing = assets / "assets.json"
    dataset = json.loads(listing.read_text()).get("flux_dev", {}).get("dataset") if listing.is_file() else None
    loaders = dit_assets.names("flux_dev")
    models = assets / "models"
    files = {"pretrained_model_name_or_path": models / "diffusion_models" / loaders["UNETLoader"]["unet_name"],
             "clip_l": models / "text_encoders" / loaders["DualCLIPLoader"]["clip_name1"],
             "t5xxl": models / "text_encoders" / loaders["DualCLIPLoader"]["clip_name2"],
             "ae": models / "vae" / loaders["VAELoader"]["vae_name"]}
    if dataset is None or not Path(dataset).is_dir() or not all(path.is_file() for path in files.values()):
        return None
    return {**{key: str(path) for key, path in files.items()}, "dataset": dataset}


def prepare(family: str, work: Path, comfyui: Path, assets: Path | None = None) -> dict:
    """Weights, kohya-layout dataset and tokenizer cache under work/: kohya's path arguments (without the --).
    The weights are built in a child (CUDA context) unless `assets` already holds them (flux)."""
    env = {**os.environ, "COMFYUI_PATH": str(comfyui)}
    tokenizers = str(tokenizer_cache(work / "tokenizers", comfyui, family))
    if family == "sdxl":
        subprocess.run([sys.executable, "-m", "bench.full_size_assets", "--out", str(work / "assets"), "--models",
                        "sdxl", "--forms", "checkpoint"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        built = json.loads((work / "assets" / "assets.json").read_text())["sdxl"]
        return {"pretrained_model_name_or_path": str(work / "assets" / "models" / "checkpoints" / built["checkpoint"]),
                "train_data_dir": str(kohya_dataset(Path(built["dataset"]), work / "kohya_data")),
                "tokenizer_cache_dir": tokenizers}
    files = flux_files(assets) if assets else None
    if files is None:
        if assets:
            print(f"[kohya] no FLUX.1-dev files in {assets}: building them under {work / 'assets'}", flush=True)
        subprocess.run([sys.executable, "-m", "bench.dit_assets", "--out", str(work / "assets"), "--families",
                        "flux_dev"], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        files = flux_files(work / "assets")
    dataset = files.pop("dataset")
    return {**files, "train_data_dir": str(kohya_dataset(Path(dataset), work / "kohya_data_flux")),
            "tokenizer_cache_dir": tokenizers}


# --- inside kohya's process ---------------------------------------------------------------------------------------

def install_shims(family: str) -> None:
    """transformers 5 (the GPU image's) under kohya's code written for 4.54; nothing in kohya's files is changed.
    - both: the `CLIPFeatureExtractor` alias, which kohya's lpw_stable_diffusion imports at start-up (image
      generation, not training);
    - CLIP-L: transformers 5's CLIPTextModel has no `text_model` submodule, so the files' `text_model.` keys are
      stripped (else kohya's non-strict load leaves them unloaded);
    - flux, T5: transformers 5's T5EncoderModel holds `encoder.embed_tokens` apart from `shared` and ties them only
      in from_pretrained; kohya builds it from a config and loads `shared.weight` alone, which leaves
      `encoder.embed_tokens` on the meta device: it is given `shared` (one module, as 4.x built it);
    - flux, T5: kohya's fp8 text-encoder path keys on the model's first parameter (the token embedding) being fp8;
      the t5xxl_fp8_e4m3fn layout (ours as ComfyUI reads it) keeps the embedding and norms fp16 beside fp8 Linear
      weights, which would send kohya down its 16-bit path (the whole T5 upcast to bf16 on the card, 9.5 GB). Where
      the Linear weights are fp8, those few tensors are stored as fp8 as well; kohya's prepare_text_encoder_fp8
      then upcasts the embeddings and norms to bf16 itself, as for an all-fp8 file."""
    import torch
    import transformers
    if not hasattr(transformers, "CLIPFeatureExtractor"):
        # the first attribute access swaps the lazy module in sys.modules: set the alias on the one there afterwards
        processor = transformers.CLIPImageProcessor
        sys.modules["transformers"].CLIPFeatureExtractor = processor
    sys.path.insert(0, os.getcwd())
    if family == "sdxl":
        import library.sdxl_model_util as sdxl_model_util  # kohya's own loader (from the sd-scripts tree)
        load_on_device = sdxl_model_util._load_state_dict_on_device

        def load_with_transformers_5_keys(model, state_dict, device, dtype=None):
            if not hasattr(model, "text_model") and any(key.startswith("text_model.") for key in state_dict):
                state_dict = {key.removeprefix("text_model."): value for key, value in state_dict.items()}
            return load_on_device(model, state_dict, device, dtype)
        sdxl_model_util._load_state_dict_on_device = load_with_transformers_5_keys
        return
    import library.flux_utils as flux_utils
    from library.safetensors_utils import load_safetensors
    load_clip_l, load_t5xxl = flux_utils.load_clip_l, flux_utils.load_t5xxl

    def load_clip_l_transformers_5(ckpt_path, dtype, device, disable_mmap=False, state_dict=None):
        if state_dict is None:
            state_dict = load_safetensors(ckpt_path, device=str(device), disable_mmap=disable_mmap, dtype=dtype)
        clip = load_clip_l(ckpt_path, dtype, device, disable_mmap, state_dict)
        if not hasattr(clip, "text_model") and any(key.startswith("text_model.") for key in state_dict):
            info = clip.load_state_dict({key.removeprefix("text_model."): value for key, value in state_dict.items()},
                                        strict=False, assign=True)
            print(f"[kohya-shim] CLIP-L reloaded without the text_model. prefix: {info}", flush=True)
        return clip

    def load_t5xxl_transformers_5(ckpt_path, dtype, device, disable_mmap=False, state_dict=None):
        t5 = load_t5xxl(ckpt_path, dtype, device, disable_mmap, state_dict)
        if t5.encoder.embed_tokens is not t5.shared and t5.encoder.embed_tokens.weight.is_meta:
            t5.encoder.embed_tokens = t5.shared
            print("[kohya-shim] T5: encoder.embed_tokens is shared (tied as transformers 4 built it)", flush=True)
        linear = flux_utils.get_t5xxl_actual_dtype(t5)
        if linear == torch.float8_e4m3fn and t5.dtype != linear:
            others = [p for p in t5.parameters() if p.is_floating_point() and p.dtype != linear]
            for param in others:
                param.data = param.data.to(linear)
            print(f"[kohya-shim] T5: {len(others)} embedding / norm tensors stored as {linear} beside the fp8 Linear "
                  f"weights (kohya's fp8 T5 path upcasts them to bf16 itself)", flush=True)
        return t5
    flux_utils.load_clip_l, flux_utils.load_t5xxl = load_clip_l_transformers_5, load_t5xxl_transformers_5


def child(family: str, card_gib: float, result_path: Path, stamps_path: Path, script_argv: list[str]) -> None:
    """Inside kohya's process: the card cap, the step clock, the shims, then kohya's script as __main__ (cwd = the
    sd-scripts tree)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, card_gib * GIB / total), 0)
    stamps: list[float] = []
    clock = open(stamps_path, "w", buffering=1)

    def stamp(*_):
        stamps.append(time.perf_counter())
        clock.write(f"{stamps[-1]:.6f}\n")
    register_optimizer_step_post_hook(stamp)
    outcome, started = {"status": "ok"}, time.perf_counter()
    install_shims(family)
    sys.argv = script_argv
    try:
        runpy.run_path(script_argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            outcome = {"status": "error", "error": f"exit {done.code}"}
    except BaseException as error:  # OOM and friends: the row records it
        outcome = {"status": "error", "error": f"{type(error).__name__}: {str(error)[:800]}"}
    outcome.update(wall_s=round(time.perf_counter() - started, 1),
                   torch_peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                   torch_peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 3))
    result_path.write_text(json.dumps(outcome, indent=1))


def step_times(stamps_path: Path, warmup: int) -> dict:
    """s/step from the child's stamp file: the steps after the first `warmup`, between their stamps (only whole
    lines: a child killed mid-write would leave its last one cut)."""
    try:
        text = stamps_path.read_text()
    except OSError:
        text = ""
    stamps = [float(line) for line in text.split("\n")[:-1] if line]
    steady = stamps[warmup:]
    return {"optimizer_steps": len(stamps), "warmup_steps": warmup, "steady_steps": max(0, len(steady) - 1),
            "s_per_step": round((steady[-1] - steady[0]) / (len(steady) - 1), 4) if len(steady) > 1 else None}


# --- this process: one child per card ------------------------------------------------------------------------------

def run_card(args, card: float, files: dict, nvml) -> dict:
    """One card: the holder (if any), the NVML baseline, kohya in a child until done or out of time."""
    from bench.card_holder import CardHolder
    result, stamps, log = (args.work / f"card_{card:g}{suffix}" for suffix in (".json", ".steps", ".log"))
    for path in (result, stamps):
        path.unlink(missing_ok=True)
    blocks = {}
    if args.family == "flux":
        swap = args.blocks_to_swap if args.blocks_to_swap is not None else flux_blocks_to_swap(card)
        blocks = {"--blocks_to_swap": swap} if swap else {}
    kohya = {**{f"--{key}": value for key, value in files.items()}, **blocks,
             "--output_dir": args.work / f"out_{card:g}", "--output_name": f"kohya_peer_{args.family}_{card:g}",
             "--max_train_steps": args.steps}
    cmd = [sys.executable, "-m", "bench.kohya_peer", "--family", args.family, "--child", f"{card:g}", str(result),
           str(stamps), "--", str(args.script), *recipe(args.family, kohya)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH":
           os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    row = {"family": args.family, "card_gib": card, "card_emulation": args.emulation,
           **({"blocks_to_swap": blocks["--blocks_to_swap"]} if blocks else {})}
    holder = CardHolder(card) if args.emulation == "holder" and nvml.available else None
    if args.emulation == "holder" and holder is None:
        row.update(card_emulation="fraction", holder_error="no NVML to measure the holder: " + nvml.reason)
    left = args.deadline - time.monotonic()
    started = time.perf_counter()
    try:
        if holder is not None:
            idle = nvml.used()
            try:
                info = holder.start()
            except Exception as error:  # noqa: BLE001 - recorded; the card still runs, capped the old way
                holder = None
                row.update(card_emulation="fraction", holder_error=f"{type(error).__name__}: {error}")
            else:
                time.sleep(0.5)  # NVML's used memory settles after the allocations
                row["holder"] = {**{f"{k}_gib": info.get("gib", {}).get(k) for k in ("held", "fresh_process_free")},
                                 "device_gib": round((nvml.used() - idle) / GIB, 3)}
        baseline = nvml.used() if nvml.available else None
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=args.kohya, env=env, stdout=out, stderr=subprocess.STDOUT)
            nvml.start_window(proc.pid)
            timeout = max(10.0, min(args.timeout_s, args.deadline - time.monotonic()))
            try:
                ended = {"status": f"no result (exit {proc.wait(timeout=timeout)})"}
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                ended = {"status": "stopped", "error": f"stopped after {timeout:.0f} s, the card's time ({left:.0f} s "
                                                       f"of the run were left): s/step over the steps it did"}
        peak, process_peak, samples = nvml.window() if nvml.available else (None, None, 0)
    finally:
        if holder is not None:
            holder.stop()
    row.update(json.loads(result.read_text()) if result.exists() else ended)
    row.update(step_times(stamps, args.warmup_steps), process_wall_s=round(time.perf_counter() - started, 1),
               nvml_peak_gib=round(peak / GIB, 3) if peak else None,
               nvml_peak_over_baseline_gib=round((peak - baseline) / GIB, 3) if peak and baseline else None,
               nvml_process_peak_gib=round(process_peak / GIB, 3) if process_peak else None, nvml_samples=samples)
    if row.get("status") != "ok":
        row["log_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(SCRIPTS), default="sdxl")
    parser.add_argument("--kohya", type=Path, help="kohya-ss/sd-scripts source tree (holds the training scripts)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/leanlora_kohya"))
    parser.add_argument("--comfyui", type=Path, default=REPO / ".cache" / "comfyui", help="tokenizers, weights' layout")
    parser.add_argument("--assets", type=Path, help="flux: a folder that already holds our FLUX.1-dev files "
                        "(bench/gpu_matrix.py's /tmp/gm_assets); else they are built under WORK/assets")
    parser.add_argument("--cards", default="24,8,6,4")
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="left out of s/step")
    parser.add_argument("--blocks-to-swap", type=int, help="flux: instead of the VRAM table's number for the card")
    parser.add_argument("--emulation", choices=("holder", "fraction"),
                        default=os.environ.get("BENCH_CARD_EMULATION", "holder"))
    parser.add_argument("--timeout-s", type=float, help="per card size (sdxl: 240; flux: what --budget-s leaves)")
    parser.add_argument("--budget-s", type=float, default=None, help="the whole run (setup included): a card that "
                        "would run past it is stopped and keeps the steps it did")
    parser.add_argument("--dry-run", action="store_true", help="CPU: kohya's parser, tokenizers, dataset and loaders "
                        "on our files' layout (flux; bench/kohya_dry_run.py)")
    parser.add_argument("--child", nargs=3, metavar=("CARD_GIB", "RESULT", "STAMPS"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child:
        child(args.family, float(args.child[0]), Path(args.child[1]), Path(args.child[2]),
              rest[1:] if rest[:1] == ["--"] else rest)
        return
    args.script = args.kohya.resolve() / SCRIPTS[args.family] if args.kohya else None
    if args.script is None or not args.script.is_file():
        raise SystemExit(f"kohya peer: no {SCRIPTS[args.family]} in {args.kohya} (give the sd-scripts source tree)")
    args.kohya = args.kohya.resolve()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        if args.family != "flux":
            raise SystemExit("kohya peer: --dry-run checks the flux family (the SDXL peer ran on the GPU, 3-4 Dec)")
        from bench import kohya_dry_run
        raise SystemExit(kohya_dry_run.main(args))
    if args.timeout_s is None:
        args.timeout_s = 240 if args.family == "sdxl" else float("inf")
    begun = time.perf_counter()
    args.deadline = time.monotonic() + (args.budget_s if args.budget_s else float("inf"))
    files = prepare(args.family, args.work, args.comfyui.resolve(), args.assets.resolve() if args.assets else None)
    print(f"[kohya] {args.family}: weights, dataset and tokenizer cache ready in {time.perf_counter() - begun:.0f} s",
          flush=True)
    from bench.server_matrix import NvmlSampler
    nvml = NvmlSampler()
    rows = []
    for card in [float(c) for c in args.cards.split(",")]:
        if args.deadline - time.monotonic() < 30:
            rows.append({"family": args.family, "card_gib": card, "status": "skipped: out of time"})
            continue
        row = run_card(args, card, files, nvml)
        rows.append(row)
        print(f"[kohya] {args.family} card {card:g} GiB ({row.get('card_emulation')}"
              f"{', blocks_to_swap ' + str(row['blocks_to_swap']) if 'blocks_to_swap' in row else ''}): "
              f"{row.get('status')} s/step {row.get('s_per_step')} over {row.get('steady_steps')} steps "
              f"({row.get('optimizer_steps')} done, first {args.warmup_steps} apart); NVML peak "
              f"{row.get('nvml_peak_gib')} (over baseline {row.get('nvml_peak_over_baseline_gib')}) torch "
              f"{row.get('torch_peak_allocated_gib')}/{row.get('torch_peak_reserved_gib')} {row.get('error', '')}",
              flush=True)
        if row.get("status") != "ok":
            print(row["log_tail"][-2500:], flush=True)
        # after every card: a command's time limit ending a later card keeps the earlier ones
        (args.work / "kohya_peer.json").write_text(json.dumps(
            {"family": args.family, "recipe": recipe(args.family, {}), "steps": args.steps,
             "warmup_steps": args.warmup_steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
