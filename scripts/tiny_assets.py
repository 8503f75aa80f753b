"""Tiny, random-weight test assets: an SD1.5-shaped checkpoint and a captioned image folder.

Nothing here downloads weights. The checkpoint's tensor *shapes* come from ComfyUI's own model classes
(built on the meta device, so no memory is spent), and its values from a seeded generator, so the
file is deterministic for a seed and loads through ComfyUI's CheckpointLoaderSimple as SD1.5.

CLI:  python scripts/tiny_assets.py --checkpoint OUT.safetensors --dataset OUTDIR
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# SD1.5 detection (comfy/supported_models.py SD15.unet_config) looks only at context_dim=768,
# model_channels=320, use_linear_in_transformer=False, adm_in_channels=None and no temporal layers;
# depths are read back from tensor shapes (comfy/model_detection.py detect_unet_config). So a
# one-level UNet is still "SD1.5". The entries below mirror what detect_unet_config derives for it plus
# SD15.unet_extra_config (num_heads=8), so the module we build has exactly the layout ComfyUI rebuilds.
_TINY_UNET_CONFIG = dict(
    use_checkpoint=False,
    image_size=32,
    use_spatial_transformer=True,
    legacy=False,
    adm_in_channels=None,
    in_channels=4,
    out_channels=4,
    model_channels=320,
    num_res_blocks=[1],
    channel_mult=[1],
    transformer_depth=[1],
    transformer_depth_output=[1, 1],  # output blocks = input blocks + 1 (the conv_in level)
    transformer_depth_middle=1,
    use_linear_in_transformer=False,
    context_dim=768,
    use_temporal_resblock=False,
    use_temporal_attention=False,
    num_heads=8,
    num_head_channels=-1,
)

# The real SD1.5 UNet layout (860M parameters), for GPU checks of the whole ComfyUI path at full size.
_FULL_SD15_UNET_CONFIG = dict(
    _TINY_UNET_CONFIG,
    num_res_blocks=[2, 2, 2, 2],
    channel_mult=[1, 2, 4, 4],
    transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
    transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],  # ComfyUI pops these from the end
)
UNET_CONFIGS = {"tiny": _TINY_UNET_CONFIG, "sd15": _FULL_SD15_UNET_CONFIG}

# Key prefixes of an original-format (LDM) single-file checkpoint, as load_checkpoint_guess_config reads them:
# the UNet prefix is found by model_detection.unet_prefix_from_state_dict, SD15.process_clip_state_dict maps
# "cond_stage_model." -> "clip_l.", and BASE.vae_key_prefix strips "first_stage_model." before comfy.sd.VAE
# picks TAESD because "taesd_decoder.1.weight" is present.
UNET_PREFIX = "model.diffusion_model."
CLIP_PREFIX = "cond_stage_model.transformer.text_model."
VAE_PREFIX = "first_stage_model."

# ComfyUI's VAELoader gives the SD1.x TAESD these values (nodes.py load_taesd): the encoder output is
# divided by vae_scale, i.e. latents live in the same unscaled space as the full SD VAE's.
_TAESD_SD15_SCALE = 0.18215
_TAESD_SD15_SHIFT = 0.0


def _import_comfy():
    """Make ComfyUI importable (COMFYUI_PATH, else the repo's .cache/comfyui) and return the comfy package.

    comfy.model_management picks a device when first imported and crashes without a CUDA driver
    unless ComfyUI's --cpu flag is set, so on a machine without CUDA we set it before that import.
    """
    try:
        import comfy  # noqa: F401
    except ImportError:
        comfy_dir = Path(os.environ.get("COMFYUI_PATH", REPO_ROOT / ".cache" / "comfyui"))
        if not (comfy_dir / "comfy").is_dir():
            raise RuntimeError(f"ComfyUI not found at {comfy_dir}; run scripts/setup_env.sh or set COMFYUI_PATH")
        sys.path.insert(0, str(comfy_dir))
    if "comfy.model_management" not in sys.modules and not torch.cuda.is_available():
        import comfy.cli_args

        comfy.cli_args.args.cpu = True
    import comfy.clip_model
    import comfy.ldm.modules.diffusionmodules.openaimodel
    import comfy.ops
    import comfy.sd1_clip
    import comfy.taesd.taesd

    return comfy


def _meta_modules(unet_size: str = "tiny"):
    """ComfyUI's own UNet, CLIP-L text model and TAESD, shapes only, keyed by checkpoint prefix.

    Only CLIP's text_model is kept: SD15.process_clip_state_dict moves any other key under
    "cond_stage_model.transformer." into text_model, so a text_projection can't be loaded from an SD1.5
    checkpoint; ComfyUI's SD1.5 text encoder returns the unprojected pooled output and never uses it.
    """
    comfy = _import_comfy()
    ops = comfy.ops.disable_weight_init  # skips torch's default init: we set every value ourselves
    with open(Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json") as f:
        clip_config = json.load(f)  # the fixed CLIP-L config ComfyUI builds for SD1.5 checkpoints
    with torch.device("meta"):
        unet = comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel(
            **UNET_CONFIGS[unet_size], dtype=torch.float32, device="meta", operations=ops
        )
        clip = comfy.clip_model.CLIPTextModel(clip_config, torch.float32, "meta", ops)
        taesd = comfy.taesd.taesd.TAESD(latent_channels=4)
    return {UNET_PREFIX: unet, CLIP_PREFIX: clip.text_model, VAE_PREFIX: taesd}


def _init_tensor(module: torch.nn.Module, pname: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Small, sensible random values so every forward pass is finite and input-dependent.

    Linear/conv weights get fan-in scaled normals (std 1/sqrt(fan_in)) so activations stay O(1) through
    TAESD, which has no normalisation layers; this also makes the out-convs that ComfyUI's UNet
    zero-initialises non-zero, so the UNet output depends on its input and its text conditioning.
    """
    if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)):
        return torch.ones(shape) if pname == "weight" else torch.zeros(shape)
    if isinstance(module, torch.nn.Embedding):
        return torch.randn(shape, generator=gen) * 0.02  # CLIP's own initializer_range
    if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
        if pname == "bias":
            return torch.zeros(shape)
        fan_in = math.prod(shape[1:])
        return torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    if pname == "vae_scale":  # TAESD's own scalars (only TAESD has parameters with these names)
        return torch.tensor(_TAESD_SD15_SCALE)
    if pname == "vae_shift":
        return torch.tensor(_TAESD_SD15_SHIFT)
    # Fail loudly rather than write uninitialised memory if a ComfyUI update adds a new kind of parameter.
    raise TypeError(f"no init rule for {type(module).__name__}.{pname} {tuple(shape)}")


def build_tiny_sd15_state_dict(seed: int = 0, dtype: torch.dtype = torch.float16,
                               unet_size: str = "tiny") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: ~26M-param UNet (unet_size="sd15": the real 860M layout) + full-size random
    CLIP-L (123M) + TAESD (2.4M)."""
    gen = torch.Generator().manual_seed(seed)
    roots = _meta_modules(unet_size)
    sd = {}
    for prefix, root in roots.items():
        # Deterministic order: named_modules/named_parameters follow module construction order.
        for mname, module in root.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                key = f"{prefix}{mname + '.' if mname else ''}{pname}"
                sd[key] = _init_tensor(module, pname, p.shape, gen).to(dtype).contiguous()
    # TAESD's decoder emits pixels in [0, 1] (ComfyUI clamps there); a zero bias would centre the random
    # output on 0 and clamp half of it away, so centre it on mid-grey instead.
    last_conv = len(roots[VAE_PREFIX].taesd_decoder) - 1
    sd[f"{VAE_PREFIX}taesd_decoder.{last_conv}.bias"].fill_(0.5)
    return sd


def build_tiny_sd15_checkpoint(path: str | Path, seed: int = 0, prediction: str = "eps",
                               unet_size: str = "tiny") -> Path:
    """Write a tiny random SD1.5 single-file checkpoint (.safetensors, fp16) and return its path.

    ComfyUI's CheckpointLoaderSimple / comfy.sd.load_checkpoint_guess_config detects it as SD15 (EPS)
    and returns MODEL, CLIP (SD1ClipModel, CLIP-L) and VAE (TAESD). fp16 keeps the file ~300 MB;
    ComfyUI casts to its compute dtype (fp32 on CPU) when loading.

    prediction: only "eps". SD1.5 cannot be made v-prediction through the checkpoint: ComfyUI's SD15
    config inherits BASE.model_type, which always returns EPS; the "v_pred" / "edm_vpred.sigma_max" keys
    are honoured only by SDXL-family configs, and SD2.x guesses from a full-depth UNet's
    output_blocks.11 statistics. For v-prediction at run time use ComfyUI's ModelSamplingDiscrete node
    (sampling="v_prediction") on the loaded MODEL.
    """
    if prediction == "v":
        raise NotImplementedError(
            "ComfyUI always detects SD1.5 checkpoints as EPS (no state-dict key switches it); "
            "patch the loaded model with ModelSamplingDiscrete(sampling='v_prediction') instead"
        )
    if prediction != "eps":
        raise ValueError(f"prediction must be 'eps' or 'v', got {prediction!r}")
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = build_tiny_sd15_state_dict(seed, unet_size=unet_size)
    # Write beside the target then rename: a half-written checkpoint is never visible under its name.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        # One metadata entry only: safetensors writes a metadata map in hash order, so with several
        # entries two builds of the same seed would differ byte-wise.
        save_file(sd, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --- dataset -------------------------------------------------------------------------------------

_COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (235, 210, 40),
    "purple": (140, 50, 170),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
_SHAPES = ("circle", "square", "triangle", "ellipse", "diamond")


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _draw_shape(draw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "circle":
        r = min(x1 - x0, y1 - y0) / 2
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        r = min(x1 - x0, y1 - y0) / 2
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "ellipse":
        draw.ellipse(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    else:  # diamond
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)


def _render(shape: str, colour: str, background: str, width: int, height: int, rng: random.Random):
    """A vertical gradient background (lighter at the top) with one shape at a random place and size."""
    from PIL import Image, ImageDraw

    bg = _COLOURS[background]
    img = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(img)
    for y in range(height):
        t = 0.35 * (1 - y / max(height - 1, 1))  # mix towards white by up to 35%
        draw.line([(0, y), (width, y)], fill=tuple(round(c + (255 - c) * t) for c in bg))
    side = rng.uniform(0.4, 0.7) * min(width, height)
    aspect = rng.uniform(1.3, 1.7) if shape == "ellipse" else 1.0  # make the ellipse visibly not a circle
    w, h = min(side * aspect, width - 2), side
    x0, y0 = rng.uniform(0, width - w), rng.uniform(0, height - h)
    _draw_shape(draw, shape, (round(x0), round(y0), round(x0 + w), round(y0 + h)), _COLOURS[colour])
    return img


def build_tiny_dataset(folder: str | Path, n: int = 6, size: int = 64, seed: int = 0, captions: str = "txt") -> Path:
    """Write n distinct captioned PNGs ("a red circle on a blue background") into folder; return folder.

    Sizes cycle through size x size, landscape (1.25 * size) x size and portrait size x (1.5 * size) so
    that loaders' resize + centre-crop paths are exercised. captions="txt" writes a <stem>.txt sidecar per
    image, captions="csv" one metadata.csv (header file_name,text, the Hugging Face imagefolder layout).
    Deterministic for a seed.
    """
    if captions not in ("txt", "csv"):
        raise ValueError(f"captions must be 'txt' or 'csv', got {captions!r}")
    rng = random.Random(seed)
    combos = [(s, c, b) for s in _SHAPES for c in _COLOURS for b in _COLOURS if b != c]
    if n > len(combos):
        raise ValueError(f"at most {len(combos)} distinct images, asked for {n}")
    sizes = [(size, size), (size * 5 // 4, size), (size, size * 3 // 2)]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (shape, colour, background) in enumerate(rng.sample(combos, n)):
        width, height = sizes[i % len(sizes)]
        name = f"img_{i:03d}.png"
        _render(shape, colour, background, width, height, rng).save(folder / name)
        text = f"{_a(colour)} {colour} {shape} on {_a(background)} {background} background"
        if captions == "txt":
            (folder / name).with_suffix(".txt").write_text(text + "\n")
        rows.append((name, text))
    if captions == "csv":
        with open(folder / "metadata.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(("file_name", "text"))
            writer.writerows(rows)
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="write a tiny SD1.5 .safetensors checkpoint here")
    parser.add_argument("--dataset", type=Path, help="write a tiny captioned image folder here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=6, help="number of dataset images")
    parser.add_argument("--size", type=int, default=64, help="base image side in pixels")
    parser.add_argument("--captions", choices=("txt", "csv"), default="txt")
    args = parser.parse_args(argv)
    if args.checkpoint is None and args.dataset is None:
        parser.error("give --checkpoint and/or --dataset")
    if args.checkpoint is not None:
        t = time.perf_counter()
        out = build_tiny_sd15_checkpoint(args.checkpoint, seed=args.seed)
        print(f"checkpoint: {out} ({out.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - t:.1f} s)")
    if args.dataset is not None:
        out = build_tiny_dataset(args.dataset, n=args.n, size=args.size, seed=args.seed, captions=args.captions)
        files = sorted(p.name for p in out.iterdir())
        print(f"dataset: {out} ({len(files)} files: {', '.join(files)})")


if __name__ == "__main__":
    main()
