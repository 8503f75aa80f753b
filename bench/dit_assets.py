"""Full-size random-weight DiT file sets (Z-Image, FLUX.1-dev, Qwen-Image, Chroma, Wan 2.1 T2V 14B) in the files
users load with ComfyUI's stock loaders, plus a captioned 1024² image set, for bench/dit_matrix.py:

    python -m bench.dit_assets --out DIR [--families z_image,flux_dev,...] [--tiny] [--images 6]
    python -m bench.dit_assets --estimate [--families ...]     # full-size disk / host-RAM estimates, nothing written

Per family (under DIR/models/, which a ComfyUI server uses as its models folders):
  z_image    UNETLoader: diffusion_models/leanlora_random_z_image_bf16.safetensors (NextDiT, dim 3840, 30 layers +
             2 + 2 refiners, 6.15 B, bf16); CLIPLoader type lumina2: text_encoders/leanlora_random_qwen_3_4b
             .safetensors (Qwen3-4B, bf16, 8 GB); VAELoader: vae/leanlora_random_ae.safetensors (the 16-channel ae)
  flux_dev   UNETLoader: diffusion_models/leanlora_random_flux1_dev_bf16.safetensors (Flux, 19 double + 38 single
             blocks, guidance embed, 11.9 B, bf16); DualCLIPLoader type flux: text_encoders/leanlora_random_clip_l
             .safetensors (fp16) + text_encoders/leanlora_random_t5xxl_fp8_e4m3fn.safetensors (T5 v1.1 XXL encoder,
             its Linear weights float8_e4m3fn as in the t5xxl_fp8_e4m3fn file users download, the rest fp16); the ae
  qwen_image UNETLoader: diffusion_models/leanlora_random_qwen_image_fp8_e4m3fn.safetensors (QwenImageTransformer2D
             Model, the constructor's defaults: 60 blocks, 24 heads x 128, joint_attention_dim 3584, 20.4 B; the
             blocks' Linear weights float8_e4m3fn, the rest bf16, as qwen_image_fp8_e4m3fn: UNETLoader's default
             weight_dtype keeps a mostly-fp8 file as fp8 storage where the GPU computes fp8, as the H200 does);
             CLIPLoader type qwen_image: text_encoders/leanlora_random_qwen_2.5_vl_7b_fp8_scaled.safetensors
             (Qwen2.5-VL-7B's language model in ComfyUI's "scaled fp8" layout, as qwen_2.5_vl_7b_fp8_scaled: every
             Linear weight float8_e4m3fn with a float32 scale_weight of 1, a `scaled_fp8` marker, embeddings and
             norms bf16; its vision tower, which only image inputs use, is left out); VAELoader:
             vae/leanlora_random_wan21_vae.safetensors (the Wan 2.1 VAE at full width, 96, bf16)
  chroma     UNETLoader: diffusion_models/leanlora_random_chroma_bf16.safetensors (Chroma: hidden 3072, 19 double +
             38 single blocks, approximator 64 -> 5120 x 5 layers -> 3072, 8.9 B, bf16); CLIPLoader type chroma:
             the fp8 T5-XXL above; the ae
  wan        UNETLoader: diffusion_models/leanlora_random_wan2.1_t2v_14B_fp8_e4m3fn.safetensors (WanModel t2v, dim
             5120, 40 blocks, ffn 13824, 40 heads, text_dim 4096, in/out 16, 14.3 B; the blocks' Linear weights
             float8_e4m3fn as wan2.1_t2v_14B_fp8_e4m3fn); CLIPLoader type wan: text_encoders/leanlora_random_umt5
             _xxl_fp8_e4m3fn_scaled.safetensors (umt5-xxl encoder, scaled fp8 as umt5_xxl_fp8_e4m3fn_scaled, the
             rest fp16, with a SentencePiece `spiece_model`: ComfyUI's 32,000-piece T5 pile tokenizer, read from
             comfy/text_encoders/t5_pile_tokenizer, in place of umt5's own); the Wan 2.1 VAE
Shapes and key names come from ComfyUI's own classes built on the meta device (the configs that ComfyUI 0.3.75's
detection derives from the real files, ../shared/DESIGN.md); values from a seeded generator on the GPU (fan-in
scaled normals, norm scales 1, biases 0, embeddings, pad tokens and Wan's modulation tables N(0, 0.02)): finite,
input-dependent, nothing learned. Files are written one tensor at a time (the safetensors layout written
directly), so a 20 GB model never sits in host memory at all. --tiny writes the narrow configs of
scripts/tiny_dit_assets.py with this same writer on the CPU (they load only in a ComfyUI that also imported
tests/tiny_dit_configs: the CPU smoke test); the Flux ae is full size in both modes (comfy.sd.VAE pins it).
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
FAMILIES = ("z_image", "flux_dev", "qwen_image", "chroma", "wan")
# the GPU machine (nvidia-h200): /tmp's disk and host memory
MACHINE_DISK_GIB, MACHINE_RAM_GIB = 64, 128

# ComfyUI 0.3.75's detection of the real files (comfy/model_detection.py; ../shared/DESIGN.md)
Z_IMAGE_FULL = dict(tiny_dit_assets.Z_IMAGE, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                    cap_feat_dim=2560)
FLUX_DEV_FULL = dict(tiny_dit_assets.FLUX_DEV, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, num_heads=24,
                     depth=19, depth_single_blocks=38)
# Qwen-Image: detection sets only in_channels (64) and num_layers (60); the rest are the constructor's defaults
QWEN_IMAGE_FULL = dict(tiny_dit_assets.QWEN_IMAGE, num_layers=60, attention_head_dim=128, num_attention_heads=24,
                       joint_attention_dim=3584)
# Chroma: the Flux branch with hidden 3072 / 24 heads, then chroma's pinned approximator (in 64, hidden 5120, 5 layers,
# out 3072) and 64 in/out channels
CHROMA_FULL = dict(tiny_dit_assets.CHROMA, context_in_dim=4096, hidden_size=3072, num_heads=24, depth=19,
                   depth_single_blocks=38, in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5)
# Wan 2.1 T2V 14B: dim from head.modulation, heads dim // 128, ffn from blocks.0.ffn.0, 40 blocks, text_dim 4096
WAN21_T2V_14B = dict(tiny_dit_assets.WAN21_T2V, dim=5120, ffn_dim=13824, text_dim=4096, num_heads=40, num_layers=40)
WAN21_VAE_FULL = dict(tiny_dit_assets.WAN21_VAE, dim=96)

_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
           torch.uint8: "U8"}

# file kind -> (models folder, file name); the loaders' inputs per family below
_FILES = {
    "z_image": ("diffusion_models", "leanlora_random_z_image_bf16.safetensors"),
    "flux_dev": ("diffusion_models", "leanlora_random_flux1_dev_bf16.safetensors"),
    "qwen_image": ("diffusion_models", "leanlora_random_qwen_image_fp8_e4m3fn.safetensors"),
    "chroma": ("diffusion_models", "leanlora_random_chroma_bf16.safetensors"),
    "wan": ("diffusion_models", "leanlora_random_wan2.1_t2v_14B_fp8_e4m3fn.safetensors"),
    "qwen3_4b": ("text_encoders", "leanlora_random_qwen_3_4b.safetensors"),
    "clip_l": ("text_encoders", "leanlora_random_clip_l.safetensors"),
    "t5xxl_fp8": ("text_encoders", "leanlora_random_t5xxl_fp8_e4m3fn.safetensors"),
    "qwen25_7b_fp8": ("text_encoders", "leanlora_random_qwen_2.5_vl_7b_fp8_scaled.safetensors"),
    "umt5_xxl_fp8": ("text_encoders", "leanlora_random_umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
    "ae": ("vae", "leanlora_random_ae.safetensors"),
    "wan21_vae": ("vae", "leanlora_random_wan21_vae.safetensors"),
}
# family -> its file kinds: diffusion model, text encoder(s), VAE
_FAMILY_FILES = {"z_image": ("z_image", "qwen3_4b", "ae"), "flux_dev": ("flux_dev", "clip_l", "t5xxl_fp8", "ae"),
                 "qwen_image": ("qwen_image", "qwen25_7b_fp8", "wan21_vae"),
                 "chroma": ("chroma", "t5xxl_fp8", "ae"), "wan": ("wan", "umt5_xxl_fp8", "wan21_vae")}


def names(family: str) -> dict:
    """The stock loaders' inputs for a family (file names inside ComfyUI's model folders)."""
    if family not in _FAMILY_FILES:
        raise SystemExit(f"dit_assets: unknown family {family!r} (known: {', '.join(FAMILIES)})")
    kinds = _FAMILY_FILES[family]
    out = {"UNETLoader": {"unet_name": _FILES[kinds[0]][1], "weight_dtype": "default"}}
    if family == "flux_dev":
        out["DualCLIPLoader"] = {"clip_name1": _FILES["clip_l"][1], "clip_name2": _FILES["t5xxl_fp8"][1],
                                 "type": "flux"}
    else:
        te_type = {"z_image": "lumina2", "qwen_image": "qwen_image", "chroma": "chroma", "wan": "wan"}[family]
        out["CLIPLoader"] = {"clip_name": _FILES[kinds[1]][1], "type": te_type}
    out["VAELoader"] = {"vae_name": _FILES[kinds[-1]][1]}
    return out


# --- modules on the meta device ------------------------------------------------------------------------------

def _meta(build):
    comfy = tiny_dit_assets._import_comfy()
    import comfy.ops
    with torch.device("meta"):
        return build(comfy, comfy.ops.disable_weight_init)


def _cfg(tiny_cfg: dict, full_cfg: dict, tiny: bool) -> dict:
    return {k: v for k, v in (tiny_cfg if tiny else full_cfg).items() if k != "image_model"}


def z_image_module(tiny: bool):
    cfg = _cfg(tiny_dit_assets.Z_IMAGE, Z_IMAGE_FULL, tiny)

    def build(comfy, ops):
        import comfy.ldm.lumina.model
        return comfy.ldm.lumina.model.NextDiT(dtype=torch.bfloat16, device="meta", operations=ops, **cfg)
    return _meta(build)


def flux_module(tiny: bool):
    cfg = _cfg(tiny_dit_assets.FLUX_DEV, FLUX_DEV_FULL, tiny)

    def build(comfy, ops):
        import comfy.ldm.flux.model
        return comfy.ldm.flux.model.Flux(image_model="flux", dtype=torch.bfloat16, device="meta", operations=ops, **cfg)
    return _meta(build)


def qwen_image_module(tiny: bool):
    cfg = _cfg(tiny_dit_assets.QWEN_IMAGE, QWEN_IMAGE_FULL, tiny)

    def build(comfy, ops):
        import comfy.ldm.qwen_image.model
        return comfy.ldm.qwen_image.model.QwenImageTransformer2DModel(dtype=torch.bfloat16, device="meta",
                                                                      operations=ops, **cfg)
    return _meta(build)


def chroma_module(tiny: bool):
    cfg = _cfg(tiny_dit_assets.CHROMA, CHROMA_FULL, tiny)

    def build(comfy, ops):
        import comfy.ldm.chroma.model
        return comfy.ldm.chroma.model.Chroma(image_model="chroma", dtype=torch.bfloat16, device="meta",
                                             operations=ops, **cfg)
    return _meta(build)


def wan_module(tiny: bool):
    cfg = _cfg(tiny_dit_assets.WAN21_T2V, WAN21_T2V_14B, tiny)

    def build(comfy, ops):
        import comfy.ldm.wan.model
        return comfy.ldm.wan.model.WanModel(image_model="wan2.1", dtype=torch.bfloat16, device="meta",
                                            operations=ops, **cfg)
    return _meta(build)


def qwen3_4b_module(tiny: bool):
    def build(comfy, ops):
        import comfy.text_encoders.llama
        return comfy.text_encoders.llama.Qwen3_4B(dict(tiny_dit_assets.QWEN3_4B) if tiny else {}, torch.bfloat16,
                                                  "meta", ops)
    return _meta(build)


def qwen25_7b_module(tiny: bool):
    def build(comfy, ops):
        import comfy.text_encoders.llama
        return comfy.text_encoders.llama.Qwen25_7BVLI(dict(tiny_dit_assets.QWEN25_7B) if tiny else {},
                                                      torch.bfloat16, "meta", ops)
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


def umt5_xxl_module(tiny: bool):
    def build(comfy, ops):
        import comfy.text_encoders.t5
        with open(Path(comfy.text_encoders.t5.__file__).parent / "umt5_config_xxl.json") as f:
            config = json.load(f)
        if tiny:
            config.update(tiny_dit_assets.UMT5XXL)
        return comfy.text_encoders.t5.T5(config, torch.float16, "meta", ops)
    return _meta(build)


def wan21_vae_module(tiny: bool):
    def build(comfy, ops):
        import comfy.ldm.wan.vae
        return comfy.ldm.wan.vae.WanVAE(**(tiny_dit_assets.WAN21_VAE if tiny else WAN21_VAE_FULL))
    return _meta(build)


# --- values and the writer -----------------------------------------------------------------------------------

def _entries(root: torch.nn.Module, dtype_of, skip: tuple[str, ...] = ()
             ) -> list[tuple[str, torch.nn.Module, str, tuple, torch.dtype]]:
    """(key, owning module, parameter name, shape, file dtype) in construction order; keys starting with skip out."""
    out = []
    for mname, module in root.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            key = f"{mname + '.' if mname else ''}{pname}"
            if skip and key.startswith(skip):
                continue
            out.append((key, module, pname, tuple(p.shape), dtype_of(key, module, pname, tuple(p.shape))))
    return out


@torch.no_grad()
def _value(module: torch.nn.Module, pname: str, shape: tuple, dtype: torch.dtype, device: torch.device,
           gen: torch.Generator) -> torch.Tensor:
    """tiny_dit_assets' rules (fan-in normals, norm scales 1, biases 0, embeddings/pad tokens/Wan's modulation tables
    N(0, 0.02)), on device; anything else 0."""
    if isinstance(module, torch.nn.Embedding) or pname.endswith("pad_token") or pname == "modulation":
        t = torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
    elif pname in ("scale", "gamma") or (pname == "weight" and len(shape) == 1):
        t = torch.ones(shape, device=device, dtype=torch.float32)
    elif pname == "weight" and len(shape) >= 2:
        t = torch.empty(shape, device=device, dtype=torch.float32).normal_(
            0.0, 1.0 / math.sqrt(math.prod(shape[1:])), generator=gen)
    else:
        t = torch.zeros(shape, device=device, dtype=torch.float32)
    return t.to(dtype)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def file_bytes(root: torch.nn.Module, dtype_of, skip: tuple[str, ...] = (), extra=None) -> int:
    """The tensor bytes write_random writes for root (the header aside)."""
    total = sum(_nbytes(shape, dtype) for _k, _m, _p, shape, dtype in _entries(root, dtype_of, skip))
    return total + sum(t.numel() * t.element_size() for t in (extra(root, dtype_of, skip) if extra else {}).values())


def write_random(path: Path, root: torch.nn.Module, dtype_of, device: torch.device, seed: int = 0,
                 metadata: dict | None = None, skip: tuple[str, ...] = (), extra=None) -> float:
    """Writes root's parameters as random tensors to a .safetensors file, one tensor at a time, then extra(root,
    dtype_of, skip)'s {key: small CPU tensor} as given; returns GiB."""
    path = Path(path)
    entries = _entries(root, dtype_of, skip)
    literal = extra(root, dtype_of, skip) if extra else {}
    header, offset = {}, 0
    for key, shape, dtype in [(k, shape, dtype) for k, _m, _p, shape, dtype in entries] + [
            (k, tuple(t.shape), t.dtype) for k, t in literal.items()]:
        size = _nbytes(shape, dtype)
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
                t = _value(module, pname, shape, dtype, device, gen).contiguous().reshape(-1)
                f.write(t.view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")
            for t in literal.values():
                t = t.contiguous().reshape(-1)  # (a 0-d scale_weight cannot be viewed as bytes)
                f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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


def _linear_fp8(rest: torch.dtype, blocks: str | None = None):
    """Every Linear weight float8_e4m3fn (only those under `blocks` when given), everything else `rest`."""
    def dtype_of(key, module, pname, shape):
        if (pname == "weight" and len(shape) == 2 and isinstance(module, torch.nn.Linear)
                and (blocks is None or key.startswith(blocks))):
            return torch.float8_e4m3fn
        return rest
    return dtype_of


def _scaled_fp8(root, dtype_of, skip) -> dict:
    """ComfyUI's scaled-fp8 text-encoder layout (comfy.ops.scaled_fp8_ops, chosen by a `scaled_fp8` key whose dtype
    is the fp8 format): a float32 scale_weight (here 1) beside every fp8 Linear weight."""
    out = {}
    for key, module, pname, shape, dtype in _entries(root, dtype_of, skip):
        if dtype == torch.float8_e4m3fn:
            out[key[:-len("weight")] + "scale_weight"] = torch.ones((), dtype=torch.float32)
    out["scaled_fp8"] = torch.empty((0,), dtype=torch.float8_e4m3fn)
    return out


def _umt5_extra(root, dtype_of, skip) -> dict:
    """The scaled-fp8 keys plus the SentencePiece model as `spiece_model` (CLIPLoader type wan reads its tokenizer
    from the file): ComfyUI's T5 pile tokenizer (32,000 pieces; every id indexes umt5's 256,384-row embedding)."""
    comfy = tiny_dit_assets._import_comfy()
    import comfy.text_encoders.t5
    model = Path(comfy.text_encoders.t5.__file__).parent / "t5_pile_tokenizer" / "tokenizer.model"
    return {**_scaled_fp8(root, dtype_of, skip),
            "spiece_model": torch.frombuffer(bytearray(model.read_bytes()), dtype=torch.uint8)}


# file kind -> (module builder, dtype rule, skipped key prefixes, extra tensors, the dtype the loader keeps it in
#               when that is not the file's: None = as written)
_RECIPES = {
    "z_image": (z_image_module, _all(torch.bfloat16), (), None, None),
    "flux_dev": (flux_module, _all(torch.bfloat16), (), None, None),
    "qwen_image": (qwen_image_module, _linear_fp8(torch.bfloat16, "transformer_blocks."), (), None, None),
    "chroma": (chroma_module, _all(torch.bfloat16), (), None, None),
    "wan": (wan_module, _linear_fp8(torch.bfloat16, "blocks."), (), None, None),
    "qwen3_4b": (qwen3_4b_module, _all(torch.bfloat16), (), None, None),
    "clip_l": (clip_l_module, _all(torch.float16), (), None, None),
    # t5_xxl_detect takes the final norm's dtype (fp16) for the whole encoder: the fp8 weights load as fp16
    "t5xxl_fp8": (t5xxl_module, _t5_fp8, (), None, torch.float16),
    "qwen25_7b_fp8": (qwen25_7b_module, _linear_fp8(torch.bfloat16), ("visual.",), _scaled_fp8, None),
    "umt5_xxl_fp8": (umt5_xxl_module, _linear_fp8(torch.float16), (), _umt5_extra, None),
    "wan21_vae": (wan21_vae_module, _all(torch.bfloat16), (), None, None),
}


def _seed(kind: str, seed: int) -> int:
    return seed + sorted(_FILES).index(kind)  # one seed per file, whichever family writes it


def build_family(family: str, models_dir: Path, tiny: bool = False, device: str | None = None,
                 seed: int = 0) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaders = names(family)
    for kind in _FAMILY_FILES[family]:
        folder, name = _FILES[kind]
        path = models_dir / folder / name
        if kind == "ae":  # full size in every mode (comfy.sd.VAE pins its widths)
            if not path.exists():
                started = time.perf_counter()
                tiny_dit_assets.build_flux_ae(path, seed=seed)
                print(f"[assets] {name}: {path.stat().st_size / GIB:.2f} GiB in {time.perf_counter() - started:.1f} s",
                      flush=True)
            continue
        stamp = f"{kind}-{'tiny' if tiny else 'full'}-seed{_seed(kind, seed)}"
        if path.exists() and _stamp(path) == stamp:
            continue
        module, dtype_of, skip, extra, _loaded = _RECIPES[kind]
        started = time.perf_counter()
        gib = write_random(path, module(tiny), dtype_of, device, _seed(kind, seed), {"leanlora_random": stamp},
                           skip, extra)
        print(f"[assets] {name}: {gib:.2f} GiB in {time.perf_counter() - started:.1f} s ({device})", flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return loaders


def estimate(family: str, tiny: bool = False) -> dict:
    """What building a family's files takes and what a server loading them holds, from the meta modules:
    disk_gib (its files), loaded_gib (diffusion model + text encoder in the dtypes ComfyUI keeps them in),
    host_ram_gib (a rough server peak: 2 x loaded + 3 GiB; the measured Z-Image / FLUX.1-dev rows peaked at
    1.7-1.8 x their loaded files: 33.2 and 56.6 GiB), build_ram_gib (the writer: twice its largest tensor on the
    host) and whether they fit the GPU machine (64 GiB disk under /tmp, 128 GiB RAM)."""
    files, disk, loaded, largest = {}, 0, 0, 0
    for kind in _FAMILY_FILES[family]:
        if kind == "ae":
            size = 84_000_000 * 2  # 83.7 M parameters, bf16
            files[_FILES[kind][1]] = round(size / GIB, 2)
            disk += size
            continue
        module, dtype_of, skip, extra, loaded_dtype = _RECIPES[kind]
        root = module(tiny)
        size = file_bytes(root, dtype_of, skip, extra)
        entries = _entries(root, dtype_of, skip)
        largest = max([largest] + [_nbytes(shape, dtype) for _k, _m, _p, shape, dtype in entries])
        files[_FILES[kind][1]] = round(size / GIB, 2)
        disk += size
        if _FILES[kind][0] != "vae":
            loaded += (size if loaded_dtype is None else
                       sum(_nbytes(shape, loaded_dtype) for _k, _m, _p, shape, _d in entries))
    host = 2 * loaded / GIB + 3
    return {"family": family, "files_gib": files, "disk_gib": round(disk / GIB, 1),
            "loaded_gib": round(loaded / GIB, 1), "host_ram_gib": round(host, 1),
            "build_ram_gib": round(2 * largest / GIB, 1),
            "fits": disk / GIB < MACHINE_DISK_GIB - 8 and host < MACHINE_RAM_GIB}


def estimate_line(family: str) -> str:
    e = estimate(family)
    return (f"[assets] {family} full size: {e['disk_gib']} GiB on disk (machine {MACHINE_DISK_GIB}), loaded "
            f"{e['loaded_gib']} GiB, server host RAM ~{e['host_ram_gib']} GiB (machine {MACHINE_RAM_GIB}; writer "
            f"{e['build_ram_gib']} GiB): {'fits' if e['fits'] else 'DOES NOT FIT'}; "
            + ", ".join(f"{k} {v}" for k, v in e["files_gib"].items()))


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
    parser.add_argument("--out", type=Path)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--tiny", action="store_true", help="the narrow CPU-test configs, written on the CPU")
    parser.add_argument("--images", type=int, default=6)
    parser.add_argument("--estimate", action="store_true", help="print the full-size disk / RAM estimates only")
    args = parser.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    for family in families:
        names(family)  # unknown names fail before anything is written
    if args.estimate:
        for family in families:
            print(estimate_line(family), flush=True)
        return
    if args.out is None:
        parser.error("--out is required (unless --estimate)")
    if args.tiny:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    assets = build_all(args.out, families, args.tiny, args.images)
    (args.out / "assets.json").write_text(json.dumps(assets, indent=1))
    print(json.dumps(assets, indent=1))


if __name__ == "__main__":
    main()
