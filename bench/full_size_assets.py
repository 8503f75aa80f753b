"""Random SD1.5 / SDXL weights in the two forms users load, plus captioned image sets, for the server matrix.

    python -m bench.full_size_assets --out DIR [--models sd15,sdxl] [--forms checkpoint,split] [--tiny]

Forms (files under DIR/models/, which a ComfyUI server uses as its models folders):
  checkpoint  one .safetensors for CheckpointLoaderSimple (models/checkpoints)
  split       UNet for UNETLoader (SD1.5 in models/unet, SDXL in models/diffusion_models: both folders users have),
              CLIP-L for CLIPLoader (SD1.5, models/clip) / CLIP-L + CLIP-G for DualCLIPLoader type sdxl
              (models/text_encoders), VAE for VAELoader (models/vae)
Shapes come from ComfyUI's own classes (built on the meta device), key names from its own converters: the split
files hold each module's state dict as ComfyUI's loaders read it (ldm UNet keys; `text_model.*` +
`text_projection.weight`; AutoencoderKL `encoder.*`/`decoder.*`/`quant_conv`/`post_quant_conv`), the checkpoint
what ComfyUI's own CheckpointSave writes (supported_models' process_*_state_dict_for_saving: SDXL's CLIP-G in
OpenCLIP layout under conditioner.embedders.1.model). Values are random (fan-in scaled normals, identity norms):
finite, input-dependent, not a picture of anything. On a GPU the tensors are made there (seconds for SDXL's 2.6 B
parameters); --tiny builds SD1.5 with a one-level UNet (full CLIP-L and VAE) on the CPU for the smoke test (SDXL has
no tiny form: its supported_models config pins the depths).
Datasets: DIR/data/<model>/ with n captioned PNGs at the model's resolution, all square but the last (5:4).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import tiny_assets  # noqa: E402  (the tiny UNet layout, dataset drawing, ComfyUI import with --cpu)

GIB = 2 ** 30
RESOLUTION = {"sd15": 512, "sdxl": 1024}
TINY_RESOLUTION = 64
# What ComfyUI's model detection derives from real SD1.5 / SDXL checkpoints (bench/run.py SPECS, the same values).
UNET_CONFIGS = {
    "sd15": tiny_assets.UNET_CONFIGS["sd15"],
    "sd15-tiny": tiny_assets.UNET_CONFIGS["tiny"],
    "sdxl": dict(tiny_assets.UNET_CONFIGS["tiny"], num_classes="sequential", adm_in_channels=2816,
                 num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4], transformer_depth=[0, 0, 2, 2, 10, 10],
                 transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], transformer_depth_middle=10,
                 use_linear_in_transformer=True, context_dim=2048, num_heads=-1, num_head_channels=64),
}
# ComfyUI's VAE class builds this AutoencoderKL for SD1.x/SDXL state dicts (comfy/sd.py, VAE.__init__).
VAE_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
SPLIT_FOLDERS = {"sd15": ("unet", "clip"), "sdxl": ("diffusion_models", "text_encoders")}


def file_names(model: str) -> dict:
    """Loader inputs for a model's files (names inside ComfyUI's folders)."""
    stem = f"leanlora_random_{model}"
    names = {"checkpoint": f"{stem}.safetensors", "unet": f"{stem}_unet.safetensors",
             "vae": f"{stem}_vae.safetensors", "clip": [f"{stem}_clip_l.safetensors"]}
    if model == "sdxl":
        names["clip"].append(f"{stem}_clip_g.safetensors")
    return names


def _meta_modules(model: str, tiny: bool) -> dict:
    """ComfyUI's UNet, text encoder(s) and VAE for `model`, shapes only (meta device)."""
    comfy = tiny_assets._import_comfy()
    import comfy.ldm.models.autoencoder
    ops = comfy.ops.disable_weight_init
    configs = Path(comfy.sd1_clip.__file__).parent
    clip_l = json.loads((configs / "sd1_clip_config.json").read_text())
    key = "sd15-tiny" if tiny else model
    with torch.device("meta"):
        modules = {
            "unet": comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel(
                **UNET_CONFIGS[key], dtype=torch.float16, device="meta", operations=ops),
            "clip_l": comfy.clip_model.CLIPTextModel(clip_l, torch.float16, "meta", ops),
            "vae": comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=VAE_DDCONFIG, embed_dim=4),
        }
        if model == "sdxl":
            clip_g = json.loads((configs / "clip_config_bigg.json").read_text())
            modules["clip_g"] = comfy.clip_model.CLIPTextModel(clip_g, torch.float16, "meta", ops)
    return modules


@torch.no_grad()
def _random_state_dict(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    """The module's parameters as new random tensors on `device`: norms identity, biases zero, embeddings
    N(0, 0.02) (CLIP's own init), every other weight N(0, 1/fan_in) so activations stay O(1) through layers
    without normalisation (the VAE's convs) and the out-convs ComfyUI zero-initialises are not zero."""
    state = {}
    for mname, sub in module.named_modules():
        is_norm = isinstance(sub, (torch.nn.GroupNorm, torch.nn.LayerNorm))
        for pname, p in sub.named_parameters(recurse=False):
            key = f"{mname}.{pname}" if mname else pname
            if is_norm:
                tensor = (torch.ones if pname == "weight" else torch.zeros)(p.shape, device=device, dtype=dtype)
            elif isinstance(sub, torch.nn.Embedding):
                tensor = torch.empty(p.shape, device=device, dtype=dtype).normal_(0.0, 0.02)
            elif p.ndim >= 2:
                tensor = torch.empty(p.shape, device=device, dtype=dtype).normal_(0.0, 1.0 / math.sqrt(math.prod(p.shape[1:])))
            else:
                tensor = torch.zeros(p.shape, device=device, dtype=dtype)
            state[key] = tensor
    return state


def model_state_dicts(model: str, tiny: bool = False, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float16, seed: int = 0) -> dict[str, dict]:
    """{"unet", "clip_l", ("clip_g"), "vae"} -> state dict in the split files' layout."""
    torch.manual_seed(seed)  # also seeds the CUDA generator
    return {name: _random_state_dict(module, torch.device(device), dtype)
            for name, module in _meta_modules(model, tiny).items()}


def checkpoint_state_dict(model: str, parts: dict[str, dict], tiny: bool = False) -> dict:
    """The single-file checkpoint of `parts`, converted by ComfyUI's own saving code for the detected model."""
    import comfy.model_detection
    config = comfy.model_detection.model_config_from_unet_config(dict(UNET_CONFIGS["sd15-tiny" if tiny else model]))
    if config is None:
        raise RuntimeError(f"ComfyUI does not detect the {model} UNet config")
    clip = {f"{name}.transformer.{key}": tensor for name in ("clip_l", "clip_g") for key, tensor in parts.get(name, {}).items()}
    state = {**config.process_unet_state_dict_for_saving(dict(parts["unet"])),
             **config.process_clip_state_dict_for_saving(clip),
             **config.process_vae_state_dict_for_saving(dict(parts["vae"]))}
    return {key: tensor.contiguous() for key, tensor in state.items()}


def _save(state: dict, path: Path) -> int:
    from safetensors.torch import save_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)  # a half-written file never carries the name a loader lists
    return path.stat().st_size


def build_model_files(model: str, models_dir: Path, forms=("checkpoint", "split"), tiny: bool = False,
                      device: str | None = None, dtype: torch.dtype = torch.float16) -> dict:
    """Writes the forms' files under models_dir (skipping files already there) and returns their loader names."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = file_names(model)
    unet_folder, clip_folder = SPLIT_FOLDERS[model]
    wanted = {}
    if "split" in forms:
        wanted["unet"] = models_dir / unet_folder / names["unet"]
        wanted["vae"] = models_dir / "vae" / names["vae"]
        for part, name in zip(("clip_l", "clip_g"), names["clip"]):
            wanted[part] = models_dir / clip_folder / name
    if "checkpoint" in forms:
        wanted["checkpoint"] = models_dir / "checkpoints" / names["checkpoint"]
    missing = {part: path for part, path in wanted.items() if not path.exists()}
    if missing:
        started = time.perf_counter()
        parts = model_state_dicts(model, tiny, device, dtype)
        sizes = {}
        for part, path in missing.items():
            state = checkpoint_state_dict(model, parts, tiny) if part == "checkpoint" else parts[part]
            sizes[part] = _save(state, path) / GIB
        del parts
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        print(f"[assets] {model}{' (tiny)' if tiny else ''}: wrote {', '.join(f'{k} {v:.2f} GiB' for k, v in sizes.items())} "
              f"in {time.perf_counter() - started:.1f} s", flush=True)
    return {**names, "unet_folder": unet_folder, "clip_folder": clip_folder}


def build_dataset(folder: Path, resolution: int, n: int = 6, seed: int = 0) -> Path:
    """n captioned PNGs (<stem>.txt), all resolution² except the last, which is 5:4 (resolution*5/4 x resolution):
    the center-crop path and, with aspect-ratio buckets, a second bucket."""
    import random
    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.png"))) != n:  # another size of set was built here before: start again
        for old in [*folder.glob("*.png"), *folder.glob("*.txt")]:
            old.unlink()
    rng = random.Random(seed)
    combos = [(s, c, b) for s in tiny_assets._SHAPES for c in tiny_assets._COLOURS for b in tiny_assets._COLOURS if b != c]
    for i, (shape, colour, background) in enumerate(rng.sample(combos, n)):
        image = folder / f"img_{i:03d}.png"
        if image.exists() and image.with_suffix(".txt").exists():
            continue
        width = resolution * 5 // 4 if i == n - 1 else resolution
        tiny_assets._render(shape, colour, background, width, resolution, rng).save(image)
        image.with_suffix(".txt").write_text(
            f"{tiny_assets._a(colour)} {colour} {shape} on {tiny_assets._a(background)} {background} background\n")
    return folder


def build_all(out: Path, models=("sd15", "sdxl"), forms=("checkpoint", "split"), tiny: bool = False,
              images: int = 6) -> dict:
    """Everything the matrix loads, under out/: {model: {loader names..., "dataset": folder, "resolution": px}}."""
    out = Path(out)
    assets = {}
    for model in models:
        if tiny and model != "sd15":
            raise SystemExit(f"assets: {model} has no tiny form (ComfyUI's config pins its depths); use sd15")
        resolution = TINY_RESOLUTION if tiny else RESOLUTION[model]
        assets[model] = {**build_model_files(model, out / "models", forms, tiny),
                         "dataset": str(build_dataset(out / "data" / model, resolution, images)),
                         "resolution": resolution}
    return assets


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="sd15,sdxl")
    parser.add_argument("--forms", default="checkpoint,split")
    parser.add_argument("--tiny", action="store_true", help="SD1.5 with a one-level UNet, built on the CPU")
    parser.add_argument("--images", type=int, default=6, help="images per dataset (the last one 5:4)")
    args = parser.parse_args(argv)
    assets = build_all(args.out, args.models.split(","), args.forms.split(","), args.tiny, args.images)
    (args.out / "assets.json").write_text(json.dumps(assets, indent=1))  # what bench/server_matrix.py reads
    print(json.dumps(assets, indent=1))


if __name__ == "__main__":
    main()
