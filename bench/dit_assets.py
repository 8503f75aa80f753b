"""Full-size random-weight DiT file sets (Z-Image, FLUX.1-dev) in the files users load with ComfyUI's stock
loaders, plus a captioned 1024² image set, for bench/dit_matrix.py:

    python -m bench.dit_assets --out DIR [--families z_image,flux_dev] [--tiny] [--images 6]

Per family (under DIR/models/, which a ComfyUI server uses as its models folders):
  z_image   UNETLoader: diffusion_models/leanlora_random_z_image_bf16.safetensors (NextDiT, dim 3840, 30 layers +
            2 + 2 refiners, 6.15 B, bf16); CLIPLoader type lumina2: text_encoders/leanlora_random_qwen_3_4b.safetensors
            (Qwen3-4B, bf16, 8 GB); VAELoader: vae/leanlora_random_ae.safetensors (the 16-channel Flux "ae")
  flux_dev  UNETLoader: diffusion_models/leanlora_random_flux1_dev_bf16.safetensors (Flux, 19 double + 38 single
            blocks, guidance embed, 11.9 B, bf16); DualCLIPLoader type flux: text_encoders/leanlora_random_clip_l
            .safetensors (fp16) + text_encoders/leanlora_random_t5xxl_fp8_e4m3fn.safetensors (T5 v1.1 XXL encoder,
            its Linear weights float8_e4m3fn as in the t5xxl_fp8_e4m3fn file users download, the rest fp16); the ae
Shapes and key names come from ComfyUI's own classes built on the meta device (the configs that ComfyUI 0.3.75's
detection derives from the real files, ../shared/DESIGN.md); values from a seeded generator on the GPU (fan-in
scaled normals, norm scales 1, biases 0, embeddings and pad tokens N(0, 0.02)): finite, input-dependent, nothing
learned. Files are written one tensor at a time (the safetensors layout written directly), so a 24 GB model never
sits in host memory twice. --tiny writes the narrow configs of scripts/tiny_dit_assets.py with this same writer on
the CPU (they load only in a ComfyUI that also imported tests/tiny_dit_configs: the CPU smoke test).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import tiny_dit_assets  # noqa: E402  (tiny configs, the full-size Flux ae builder, ComfyUI import)

GIB = 2 ** 30
RESOLUTION, TINY_RESOLUTION = 1024, 64
FAMILIES = ("z_image", "flux_dev")

# ComfyUI 0.3.75's detection of the real files (comfy/model_detection.py; ../shared/DESIGN.md)
Z_IMAGE_FULL = dict(tiny_dit_assets.Z_IMAGE, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                    cap_feat_dim=2560)
FLUX_DEV_FULL = dict(tiny_dit_assets.FLUX_DEV, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, num_heads=24,
                     depth=19, depth_single_blocks=38)

_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def names(family: str) -> dict:
    """The stock loaders' inputs for a family (file names inside ComfyUI's model folders)."""
    if family == "z_image":
        return {"UNETLoader": {"unet_name": "leanlora_random_z_image_bf16.safetensors", "weight_dtype": "default"},
                "CLIPLoader": {"clip_name": "leanlora_random_qwen_3_4b.safetensors", "type": "lumina2"},
                "VAELoader": {"vae_name": "leanlora_random_ae.safetensors"}}
    if family == "flux_dev":
        return {"UNETLoader": {"unet_name": "leanlora_random_flux1_dev_bf16.safetensors", "weight_dtype": "default"},
                "DualCLIPLoader": {"clip_name1": "leanlora_random_clip_l.safetensors",
                                   "clip_name2": "leanlora_random_t5xxl_fp8_e4m3fn.safetensors", "type": "flux"},
                "VAELoader": {"vae_name": "leanlora_random_ae.safetensors"}}
    raise SystemExit(f"dit_assets: unknown family {family!r} (known: {', '.join(FAMILIES)})")


# --- modules on the meta device ------------------------------------------------------------------------------

def _meta(build):
    comfy = tiny_dit_assets._import_comfy()
    import comfy.ops
    with torch.device("meta"):
        return build(comfy, comfy.ops.disable_weight_init)


def z_image_module(tiny: bool):
    cfg = {k: v for k, v in (tiny_dit_assets.Z_IMAGE if tiny else Z_IMAGE_FULL).items() if k != "image_model"}

    def build(comfy, ops):
        import comfy.ldm.lumina.model
        return comfy.ldm.lumina.model.NextDiT(dtype=torch.bfloat16, device="meta", operations=ops, **cfg)
    return _meta(build)


def flux_module(tiny: bool):
    cfg = {k: v for k, v in (tiny_dit_assets.FLUX_DEV if tiny else FLUX_DEV_FULL).items() if k != "image_model"}

    def build(comfy, ops):
        import comfy.ldm.flux.model
        return comfy.ldm.flux.model.Flux(image_model="flux", dtype=torch.bfloat16, device="meta", operations=ops, **cfg)
    return _meta(build)


def qwen3_4b_module(tiny: bool):
    def build(comfy, ops):
        import comfy.text_encoders.llama
        return comfy.text_encoders.llama.Qwen3_4B(dict(tiny_dit_assets.QWEN3_4B) if tiny else {}, torch.bfloat16,
                                                  "meta", ops)
    return _meta(build)


def clip_l_module(tiny: bool):
    def build(comfy, ops):
        import comfy.sd1_clip
        with open(Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json") as f:
            config = json.load(f)
        if tiny:
            config.update(tiny_dit_assets.CLIP_L)
        return comfy.clip_model.CLIPTextModel(config, torch.float16, "meta", ops)
    return _meta(build)


def t5xxl_module(tiny: bool):
    def build(comfy, ops):
        import comfy.text_encoders.t5
        with open(Path(comfy.text_encoders.t5.__file__).parent / "t5_config_xxl.json") as f:
            config = json.load(f)
        if tiny:
            config.update(tiny_dit_assets.T5XXL)
        return comfy.text_encoders.t5.T5(config, torch.float16, "meta", ops)
    return _meta(build)


# --- values and the writer -----------------------------------------------------------------------------------

def _entries(root: torch.nn.Module, dtype_of) -> list[tuple[str, torch.nn.Module, str, tuple, torch.dtype]]:
    """(key, owning module, parameter name, shape, file dtype) in construction order."""
    out = []
    for mname, module in root.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            key = f"{mname + '.' if mname else ''}{pname}"
            out.append((key, module, pname, tuple(p.shape), dtype_of(key, module, pname, tuple(p.shape))))
    return out


@torch.no_grad()
def _value(module: torch.nn.Module, pname: str, shape: tuple, dtype: torch.dtype, device: torch.device,
           gen: torch.Generator) -> torch.Tensor:
    """tiny_dit_assets' rules (fan-in normals, norm scales 1, biases 0, embeddings/pad tokens N(0, 0.02)), on device;
    anything else 0."""
    if isinstance(module, torch.nn.Embedding) or pname.endswith("pad_token"):
        t = torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
    elif pname in ("scale", "gamma") or (pname == "weight" and len(shape) == 1):
        t = torch.ones(shape, device=device, dtype=torch.float32)
    elif pname == "weight" and len(shape) >= 2:
        t = torch.empty(shape, device=device, dtype=torch.float32).normal_(
            0.0, 1.0 / math.sqrt(math.prod(shape[1:])), generator=gen)
    else:
        t = torch.zeros(shape, device=device, dtype=torch.float32)
    return t.to(dtype)


def write_random(path: Path, root: torch.nn.Module, dtype_of, device: torch.device, seed: int = 0,
                 metadata: dict | None = None) -> float:
    """Writes root's parameters as random tensors to a .safetensors file, one tensor at a time; returns GiB."""
    path = Path(path)
    entries = _entries(root, dtype_of)
    header, offset = {}, 0
    for key, _m, _p, shape, dtype in entries:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors' own writer pads
    gen = torch.Generator(device=device).manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for key, module, pname, shape, dtype in entries:
                t = _value(module, pname, shape, dtype, device, gen).contiguous()
                f.write(t.view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")
        os.replace(tmp, path)  # a half-written file never carries the name a loader lists
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size / GIB


def _all(dtype):
    return lambda key, module, pname, shape: dtype


def _t5_fp8(key, module, pname, shape):
    """The t5xxl_fp8_e4m3fn layout: the blocks' Linear weights fp8, embeddings (shared, relative attention bias)
    and layer norms fp16."""
    if len(shape) == 2 and isinstance(module, torch.nn.Linear):
        return torch.float8_e4m3fn
    return torch.float16


def build_family(family: str, models_dir: Path, tiny: bool = False, device: str | None = None,
                 seed: int = 0) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaders = names(family)
    files = []
    if family == "z_image":
        files += [(models_dir / "diffusion_models" / loaders["UNETLoader"]["unet_name"],
                   lambda: z_image_module(tiny), _all(torch.bfloat16)),
                  (models_dir / "text_encoders" / loaders["CLIPLoader"]["clip_name"],
                   lambda: qwen3_4b_module(tiny), _all(torch.bfloat16))]
    else:
        files += [(models_dir / "diffusion_models" / loaders["UNETLoader"]["unet_name"],
                   lambda: flux_module(tiny), _all(torch.bfloat16)),
                  (models_dir / "text_encoders" / loaders["DualCLIPLoader"]["clip_name1"],
                   lambda: clip_l_module(tiny), _all(torch.float16)),
                  (models_dir / "text_encoders" / loaders["DualCLIPLoader"]["clip_name2"],
                   lambda: t5xxl_module(tiny), _t5_fp8)]
    stamp = f"{family}-{'tiny' if tiny else 'full'}-seed{seed}"
    for i, (path, module, dtype_of) in enumerate(files):
        if path.exists() and _stamp(path) == stamp:
            continue
        started = time.perf_counter()
        gib = write_random(path, module(), dtype_of, device, seed + i, {"leanlora_random": stamp})
        print(f"[assets] {path.name}: {gib:.2f} GiB in {time.perf_counter() - started:.1f} s ({device})", flush=True)
    vae = models_dir / "vae" / loaders["VAELoader"]["vae_name"]
    if not vae.exists():
        started = time.perf_counter()
        tiny_dit_assets.build_flux_ae(vae, seed=seed)  # full size in every mode (comfy.sd.VAE pins its widths)
        print(f"[assets] {vae.name}: {vae.stat().st_size / GIB:.2f} GiB in {time.perf_counter() - started:.1f} s",
              flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return loaders


def _stamp(path: Path) -> str | None:
    from safetensors import safe_open
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("leanlora_random")
    except Exception:
        return None


def build_all(out: Path, families=FAMILIES, tiny: bool = False, images: int = 6) -> dict:
    from bench.full_size_assets import build_dataset
    out = Path(out)
    resolution = TINY_RESOLUTION if tiny else RESOLUTION
    dataset = str(build_dataset(out / "data" / "dit", resolution, images))
    return {family: {"loaders": build_family(family, out / "models", tiny), "dataset": dataset,
                     "resolution": resolution, "tiny": tiny} for family in families}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--tiny", action="store_true", help="the narrow CPU-test configs, written on the CPU")
    parser.add_argument("--images", type=int, default=6)
    args = parser.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    assets = build_all(args.out, [f for f in args.families.split(",") if f], args.tiny, args.images)
    (args.out / "assets.json").write_text(json.dumps(assets, indent=1))
    print(json.dumps(assets, indent=1))


if __name__ == "__main__":
    main()
