"""Tiny, random-weight DiT test assets: Z-Image, FLUX.1-dev, Chroma, Qwen-Image and Wan 2.1 T2V file sets for
ComfyUI's stock loaders.

Each set is what a user downloads for that family, shrunk: a diffusion model for UNETLoader
(models/diffusion_models/), its text encoder(s) for CLIPLoader / DualCLIPLoader (models/text_encoders/) and its VAE
for VAELoader (models/vae/). As in tiny_assets.py, the tensors' names and shapes come from ComfyUI's own classes
(built on the meta device) and their values from a seeded generator, so a file is deterministic for a seed.

ComfyUI 0.3.75 pins these models' widths in code (model_detection.py, t5_config_xxl.json, umt5_config_xxl.json,
llama.py), so the
narrow files load through the stock loaders only in a ComfyUI that also imported the test-only package
tests/tiny_dit_configs (see its docstring for exactly what it patches; real files are never affected).
FLUX.2 klein's set (ComfyUI 0.33 only) needs nothing new there: 0.33 reads every FLUX.2 width from the file, and its
28-layer Qwen3-4B loads through the narrow-Qwen3 patch Z-Image's uses; its VAE is the FLUX.2 VAE with the encoder at
its pinned size and a narrow decoder (whose width ComfyUI reads from the file). FLUX.2 dev has no tiny set: its
Mistral tokenizer is a tekken vocabulary carried in the text encoder file, which there is no small one of.
The two VAEs are the exception: the Flux "ae" (AutoencoderKL, ch 128, 16 latent channels) has its widths pinned in
comfy.sd.VAE with no override hook, so it is full size (84M parameters, 168 MB in bf16, shared by Flux and
Z-Image as in the real releases); the Wan 2.1 VAE of Qwen-Image (and of Wan 2.1 / 2.2 14B) takes its width from the file, so it is tiny.
Wan's umt5-xxl file carries its SentencePiece tokenizer (`spiece_model`, as the files users download do); the tiny
one carries ComfyUI's own T5 pile tokenizer model (32,000 pieces) instead of umt5's 256,384-piece one.

For training tests: ComfyUI 0.3.75's Flux blocks add to their residual streams in place (DoubleStreamBlock
`img += ...`, `txt += ...`; SingleStreamBlock `x += ...`) after a LayerNorm saved that tensor, so a backward pass
through them fails ("modified by an inplace operation"), with or without checkpointing. Z-Image's and Qwen-Image's
blocks are out of place and backpropagate as loaded.

CLI:  python scripts/tiny_dit_assets.py BASE_DIR [--family z_image|flux_dev|chroma|qwen_image|wan|all] [--verify]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_assets import REPO_ROOT, _import_comfy  # noqa: E402  (same ComfyUI import rules as the SD1.5 assets)

FORMAT_VERSION = "1"  # bump when a builder's output changes: files with another version are rebuilt
TINY_CONFIGS_PACKAGE = REPO_ROOT / "tests" / "tiny_dit_configs"

# Text encoders. Heads stay 128 wide for the Qwen models (llama.py's head_dim is a class attribute); Qwen2.5-VL-7B
# needs 4 kv heads (k_proj.bias of 512 is how comfy.sd.detect_te_model recognises it); Z-Image takes the
# second-to-last hidden state (layer_idx=-2, which SDClipModel accepts only with 3 or more layers).
CLIP_L = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_hidden_layers=2)
T5XXL = dict(d_model=64, d_ff=128, d_kv=32, num_heads=2, num_layers=2)
QWEN3_4B = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)
QWEN25_7B = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
# Qwen2.5-VL's vision tower (Qwen-Image-Edit reads its control images through it): 16-wide heads (tests/tiny_dit_configs
# derives the heads from the width so)
QWEN25_VL_VISION = dict(hidden_size=32, intermediate_size=64, num_heads=2, num_layers=2)
UMT5XXL = dict(d_model=64, d_ff=128, d_kv=32, num_heads=2, num_layers=2, vocab_size=32000)  # the pile tokenizer's
# Anima's Qwen3-0.6B (ComfyUI 0.33): its real query width is twice its hidden width (16 heads x 128 over 1024), the
# one Qwen3 size so; tests/tiny_dit_configs tells a narrow Qwen3-0.6B from a narrow Qwen3-4B by that
QWEN3_06B = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=1,
                 num_key_value_heads=1)
# HunyuanImage 2.1's byT5-small glyph encoder (byt5_config_small_glyph.json): one block with a small feed-forward;
# its width stays the real 1472 (the diffusion model's byT5 mapper pins that input width) and its 6 x 64 attention
# width is what comfy.sd.detect_te_model tells byT5 by
BYT5_SMALL_GLYPH = dict(num_layers=1, d_ff=64)
# HunyuanImage 2.1 reads Qwen2.5-VL-7B's third-to-last hidden state (layer_idx -3, which SDClipModel accepts only
# with 4 or more layers), so its tiny one has 4; Qwen-Image's 2-layer one cannot serve both
QWEN25_7B_HUNYUAN = dict(QWEN25_7B, num_hidden_layers=4)
# Krea 2's Qwen3-VL-4B (ComfyUI 0.33): 36 layers, because Krea 2 conditions on the hidden states before layers 2, 5,
# ..., 35 (comfy/text_encoders/krea2.py's 12 taps); 128 wide, one 128-wide head, so the model's text fusion keeps its
# real 128-wide heads (tests/tiny_dit_configs sets txtheads = txtdim // 128). Its vision tower (the file must have one:
# ComfyUI tells Qwen3-VL by its DeepStack mergers) is 16-wide heads like Qwen2.5-VL's tiny one, DeepStack on layers 0, 1.
QWEN3VL_4B = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=36, num_attention_heads=1,
                  num_key_value_heads=1)
QWEN3VL_4B_VISION = dict(hidden_size=32, intermediate_size=64, depth=2, num_heads=2, deepstack_visual_indexes=[0, 1])

# Diffusion models: what ComfyUI's detection (+ tests/tiny_dit_configs) derives from the files' shapes. Widths are
# multiples of the real 128-wide heads; Z-Image's must be >= 256 (its modulation input is min(dim, 256) while the
# timestep embedding is always 256 wide).
FLUX_DEV = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=CLIP_L["hidden_size"],
                context_in_dim=T5XXL["d_model"], hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=2,
                depth_single_blocks=2, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
                guidance_embed=True)
Z_IMAGE = dict(image_model="lumina2", patch_size=2, in_channels=16, dim=256, cap_feat_dim=QWEN3_4B["hidden_size"],
               n_layers=2, n_refiner_layers=2, qk_norm=True, n_heads=2, n_kv_heads=2, axes_dims=[32, 48, 48],
               axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True,
               time_scale=1000.0, pad_tokens_multiple=32)
# Chroma: FLUX.1-schnell's blocks without their per-block modulation (a distilled guidance approximator makes every
# block's shift/scale/gate from the timestep); T5-XXL alone. in/out_channels count the 2x2-patched latent (64).
CHROMA = dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=T5XXL["d_model"], hidden_size=256,
              mlp_ratio=4.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[16, 56, 56], theta=10000,
              patch_size=2, qkv_bias=True, in_dim=64, out_dim=256, hidden_dim=128, n_layers=2)
QWEN_IMAGE = dict(image_model="qwen_image", in_channels=64, out_channels=16, num_layers=2, attention_head_dim=128,
                  num_attention_heads=2, joint_attention_dim=QWEN25_7B["hidden_size"])
# Wan 2.1 T2V (and Wan 2.2 T2V-A14B, the same WanModel): detection reads dim, ffn_dim, depth and in/out channels
# from the file and pins 128-wide heads (num_heads = dim // 128) and text_dim 4096 (the constructor's default).
WAN21_T2V = dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=256,
                 ffn_dim=512, freq_dim=256, text_dim=UMT5XXL["d_model"], out_dim=16, num_heads=2, num_layers=2,
                 window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
# Anima (ComfyUI 0.33's comfy.ldm.anima.model.Anima: Cosmos-Predict2's MiniTrainDIT with an LLM adapter). Detection
# reads model_channels and num_blocks from the file and pins the rest (Cosmos-Predict2-2B's: 16 heads at width 2048,
# adaLN-LoRA 256, 1024-wide cross-attention); tests/tiny_dit_configs keeps the real 128-wide heads and reads the
# cross-attention width from the file. The LLM adapter (Qwen3-0.6B's hidden states attended by T5 token embeddings,
# 6 blocks, 1024 wide, pinned in Anima.__init__) is built at ANIMA_LLM_ADAPTER's widths, 64-wide heads as the real one.
ANIMA_LLM_ADAPTER = dict(source_dim=QWEN3_06B["hidden_size"], target_dim=64, model_dim=64, num_layers=2, num_heads=1)
ANIMA = dict(image_model="anima", max_img_h=240, max_img_w=240, max_frames=128, in_channels=16, out_channels=16,
             patch_spatial=2, patch_temporal=1, concat_padding_mask=True, model_channels=256, num_blocks=2,
             num_heads=2, crossattn_emb_channels=ANIMA_LLM_ADAPTER["target_dim"], pos_emb_cls="rope3d",
             pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30, use_adaln_lora=True,
             adaln_lora_dim=256, rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0,
             rope_t_extrapolation_ratio=1.0, extra_per_block_abs_pos_emb=False, extra_h_extrapolation_ratio=1.0,
             extra_w_extrapolation_ratio=1.0, extra_t_extrapolation_ratio=1.0, rope_enable_fps_modulation=False)
# FLUX.2 klein (comfy.ldm.flux.model.Flux, image_model "flux2"): 0.33's detection reads every width from the file
# (num_heads = hidden_size // 128, the four 32-wide RoPE axes) and pins the rest (mlp_ratio 3, SiLU-gated MLPs, no
# biases, one shared modulation per stream). 128-channel latents (the FLUX.2 VAE's 32 channels, 2x2 patched), patch
# 1; the text is three of Qwen3's hidden states stacked (3 x its width). klein has no guidance embedding (dev has).
FLUX2_KLEIN = dict(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None,
                   context_in_dim=3 * 64, hidden_size=256, mlp_ratio=3.0, num_heads=2, depth=2,
                   depth_single_blocks=2, axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False,
                   guidance_embed=False, txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True,
                   ops_bias=False, default_ref_method="index", ref_index_scale=10.0)
# klein 4B's text encoder: Qwen3-4B tapped at layers 9, 18 and 27 (comfy.text_encoders.flux.Qwen3_4BModel), so it
# keeps 28 layers; Z-Image's 3-layer tiny Qwen3-4B cannot serve both
QWEN3_4B_KLEIN = dict(QWEN3_4B, num_hidden_layers=28)
# Krea 2 (ComfyUI 0.33's comfy.ldm.krea2 SingleStreamDiT): detection reads features, channels, layers, heads and kv
# heads (128-wide), txtlayers and txtdim from the file and pins the text fusion's txtheads = txtkvheads = 20 (2560 /
# 128). Grouped-query attention as in the real model (48 heads over 12 kv heads): 2 over 1.
KREA2 = dict(image_model="krea2", features=256, channels=16, patch=2, layers=2, heads=2, kvheads=1, txtlayers=12,
             txtdim=QWEN3VL_4B["hidden_size"], txtheads=1, txtkvheads=1)
# HunyuanImage 2.1 (comfy.ldm.hunyuan_video.model.HunyuanVideo with 2-D 1x1 patches): detection
# reads the widths from the file (num_heads = hidden_size // 128) and pins the RoPE axes [64, 64], theta 256 and
# mlp_ratio 4; the byT5 mapper is at its real widths (1472 -> 2048 -> 2048 -> hidden_size: pinned in code).
HUNYUAN_IMAGE = dict(image_model="hunyuan_video", in_channels=64, out_channels=64, vec_in_dim=None,
                     context_in_dim=QWEN25_7B_HUNYUAN["hidden_size"], hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=2,
                     depth_single_blocks=2, axes_dim=[64, 64], theta=256, patch_size=[1, 1], qkv_bias=True,
                     guidance_embed=False, byt5=True, meanflow=False, use_cond_type_embedding=False,
                     vision_in_dim=None, meanflow_sum=False)  # meanflow_sum: 0.33's (HunyuanVideo 1.5), no weights

# VAEs, as comfy.sd.VAE builds them from these files.
FLUX_AE = dict(double_z=True, z_channels=16, resolution=256, in_channels=3, out_ch=3, ch=128, ch_mult=[1, 2, 4, 4],
               num_res_blocks=2, attn_resolutions=[], dropout=0.0)
WAN21_VAE = dict(dim=16, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)
# The HunyuanImage 2.1 VAE (comfy.ldm.hunyuan_video.vae, 64 latent channels, 32x down): six levels as in the real
# one ([128, 256, 512, 512, 1024, 1024], 2 res blocks, pinned in comfy.sd.VAE; tests/tiny_dit_configs reads these
# from the file); the last width is twice the latent channels, as the real 1024 is a multiple of 64
HUNYUAN_IMAGE_VAE = dict(in_channels=3, out_channels=3, z_channels=64, block_out_channels=[32, 32, 32, 32, 64, 128],
                         num_res_blocks=1, ffactor_spatial=32, downsample_match_channel=True,
                         upsample_match_channel=True)
# The FLUX.2 VAE (comfy.sd.VAE: an AutoencoderKL with 32 latent channels and a batch norm over the 2x2-patched
# latent, 16x down): its encoder's widths are pinned (ch 128) like FLUX.1's "ae"; the decoder's width is read from the
# file (ComfyUI's "full_encoder_small_decoder"), so the decoder is narrow
FLUX2_VAE = dict(double_z=True, z_channels=32, resolution=256, in_channels=3, out_ch=3, ch=128, ch_mult=[1, 2, 4, 4],
                 num_res_blocks=2, attn_resolutions=[], dropout=0.0, batch_norm_latent=True)
FLUX2_VAE_DECODER_CH = 32

# What a workflow uses: loader node, its `type` input, and the file names (relative to models/<folder>/).
WORKFLOW = {
    "z_image": {
        "UNETLoader": {"unet_name": "leanlora_tiny_z_image.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_qwen_3_4b.safetensors", "type": "lumina2"},
        "VAELoader": {"vae_name": "leanlora_tiny_ae.safetensors"},
    },
    "chroma": {
        "UNETLoader": {"unet_name": "leanlora_tiny_chroma.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_t5xxl.safetensors", "type": "chroma"},
        "VAELoader": {"vae_name": "leanlora_tiny_ae.safetensors"},
    },
    "flux_dev": {
        "UNETLoader": {"unet_name": "leanlora_tiny_flux1_dev.safetensors", "weight_dtype": "default"},
        "DualCLIPLoader": {"clip_name1": "leanlora_tiny_clip_l.safetensors",
                           "clip_name2": "leanlora_tiny_t5xxl.safetensors", "type": "flux"},
        "VAELoader": {"vae_name": "leanlora_tiny_ae.safetensors"},
    },
    "qwen_image": {
        "UNETLoader": {"unet_name": "leanlora_tiny_qwen_image.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_qwen_2.5_vl_7b.safetensors", "type": "qwen_image"},
        "VAELoader": {"vae_name": "leanlora_tiny_qwen_image_vae.safetensors"},
    },
    "qwen_image_edit": {  # Qwen-Image-Edit 2509/2511: Qwen-Image's model; the text encoder with its vision tower
        "UNETLoader": {"unet_name": "leanlora_tiny_qwen_image.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_qwen_2.5_vl_7b_vision.safetensors", "type": "qwen_image"},
        "VAELoader": {"vae_name": "leanlora_tiny_qwen_image_vae.safetensors"},
    },
    "krea2": {  # ComfyUI 0.33 only
        "UNETLoader": {"unet_name": "leanlora_tiny_krea2.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_qwen3vl_4b.safetensors", "type": "krea2"},
        "VAELoader": {"vae_name": "leanlora_tiny_qwen_image_vae.safetensors"},  # the Wan 2.1 VAE
    },
    "wan": {
        "UNETLoader": {"unet_name": "leanlora_tiny_wan2.1_t2v.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_umt5_xxl.safetensors", "type": "wan"},
        "VAELoader": {"vae_name": "leanlora_tiny_qwen_image_vae.safetensors"},  # the Wan 2.1 VAE itself
    },
    "anima": {  # ComfyUI 0.33 only; CLIPLoader type as Anima's own workflows (ComfyUI detects Qwen3-0.6B by itself)
        "UNETLoader": {"unet_name": "leanlora_tiny_anima.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_qwen_3_06b.safetensors", "type": "stable_diffusion"},
        "VAELoader": {"vae_name": "leanlora_tiny_qwen_image_vae.safetensors"},  # the Qwen-Image VAE = Wan 2.1's
    },
    "hunyuan_image": {  # the text encoders as ComfyUI's HunyuanImage 2.1 example loads them
        "UNETLoader": {"unet_name": "leanlora_tiny_hunyuan_image_2.1.safetensors", "weight_dtype": "default"},
        "DualCLIPLoader": {"clip_name1": "leanlora_tiny_qwen_2.5_vl_7b_4_layers.safetensors",
                           "clip_name2": "leanlora_tiny_byt5_small_glyph.safetensors", "type": "hunyuan_image"},
        "VAELoader": {"vae_name": "leanlora_tiny_hunyuan_image_2.1_vae.safetensors"},
    },
    "flux2_klein": {  # ComfyUI 0.33 only
        "UNETLoader": {"unet_name": "leanlora_tiny_flux2_klein.safetensors", "weight_dtype": "default"},
        "CLIPLoader": {"clip_name": "leanlora_tiny_qwen_3_4b_klein.safetensors", "type": "flux2"},
        "VAELoader": {"vae_name": "leanlora_tiny_flux2_vae.safetensors"},
    },
}
_FOLDERS = {"unet_name": "diffusion_models", "clip_name": "text_encoders", "clip_name1": "text_encoders",
            "clip_name2": "text_encoders", "vae_name": "vae"}


# --- tensors -------------------------------------------------------------------------------------------------

def _init_tensor(module: torch.nn.Module, pname: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Fan-in scaled normals for matrices and convs, 0.02 normals for embeddings and pad tokens, ones/zeros for
    norm scales/shifts and biases: every forward pass is finite and depends on its inputs."""
    if isinstance(module, torch.nn.Embedding) or pname.endswith("pad_token") or pname == "modulation" or \
            (pname == "lin" and type(module).__name__.endswith("Modulation")):
        # (Wan's per-block `modulation` and Krea 2's modulations' `lin` are learned tables added to the timestep's,
        # small like an embedding)
        return torch.randn(shape, generator=gen) * 0.02
    if pname in ("bias", "beta"):
        return torch.zeros(shape)
    if pname in ("scale", "gamma") or (pname == "weight" and len(shape) == 1):
        return torch.ones(shape)  # RMSNorm / LayerNorm / GroupNorm scales (Wan's RMS_norm gamma is (C, 1, 1[, 1]))
    if pname == "weight" and len(shape) >= 2:
        return torch.randn(shape, generator=gen) / math.sqrt(math.prod(shape[1:]))
    raise TypeError(f"no init rule for {type(module).__name__}.{pname} {tuple(shape)}")


def _state_dict(root: torch.nn.Module, seed: int, dtype: torch.dtype, skip: tuple[str, ...] = ()) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for mname, module in root.named_modules():  # construction order: deterministic
        for pname, p in module.named_parameters(recurse=False):
            key = f"{mname + '.' if mname else ''}{pname}"
            if skip and key.startswith(skip):
                continue
            sd[key] = _init_tensor(module, pname, p.shape, gen).to(dtype).contiguous()
    return sd


def _on_meta(build):
    comfy = _import_comfy()
    import comfy.ops

    with torch.device("meta"):
        return build(comfy, comfy.ops.disable_weight_init)  # no init: every value is ours


def _write(path: Path, tag: str, make_sd) -> Path:
    """Write make_sd() to path unless a file of this tag/version is there already; atomic (temp file + rename)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    stamp = f"{tag}-v{FORMAT_VERSION}"
    if path.exists():
        with safe_open(path, "pt") as f:
            if (f.metadata() or {}).get("leanlora_tiny") == stamp:
                return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(make_sd(), tmp, metadata={"leanlora_tiny": stamp})  # one entry: byte-identical rebuilds
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --- single files ----------------------------------------------------------------------------------------------

# Fields that newer ComfyUIs' parameter dataclasses require and 0.3.75's lack, with the values their model_detection
# gives FLUX.1 and Chroma files (0.33: FluxParams/ChromaParams.txt_ids_dims [], ChromaParams.vec_in_dim None).
NEWER_REQUIRED = {"txt_ids_dims": [], "vec_in_dim": None}


def _newer_required(module, config: dict) -> dict:
    """NEWER_REQUIRED's entries that a params dataclass of `module` requires (no default) and `config` lacks."""
    import dataclasses
    required = {field.name for obj in vars(module).values() if dataclasses.is_dataclass(obj) and isinstance(obj, type)
                for field in dataclasses.fields(obj)
                if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING}
    return {k: v for k, v in NEWER_REQUIRED.items() if k in required and k not in config}


def _diffusion_model(path: str | Path, seed: int, tag: str, config: dict, class_path: str, **extra) -> Path:
    """A diffusion model file: ComfyUI's class at `class_path` built on the meta device from `config` (less its
    `image_model`, which only some classes take, as `extra`), seeded random values, bf16."""
    def make():
        module, _, name = class_path.rpartition(".")
        cfg = {k: v for k, v in config.items() if k != "image_model"}
        cfg.update(_newer_required(importlib.import_module(module), cfg))

        def build(comfy, ops):
            return getattr(importlib.import_module(module), name)(dtype=torch.float32, device="meta",
                                                                  operations=ops, **extra, **cfg)
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"{tag}-seed{seed}", make)


def build_flux_dev_model(path: str | Path, seed: int = 0) -> Path:
    """FLUX.1-dev diffusion model (comfy.ldm.flux.model.Flux, guidance_embed): 2 double + 2 single blocks, bf16."""
    return _diffusion_model(path, seed, "flux_dev", FLUX_DEV, "comfy.ldm.flux.model.Flux", image_model="flux")


def build_chroma_model(path: str | Path, seed: int = 0) -> Path:
    """Chroma diffusion model (comfy.ldm.chroma.model.Chroma): 2 double + 2 single blocks, a 2-layer approximator."""
    return _diffusion_model(path, seed, "chroma", CHROMA, "comfy.ldm.chroma.model.Chroma", image_model="chroma")


def build_z_image_model(path: str | Path, seed: int = 0) -> Path:
    """Z-Image diffusion model (Lumina 2 NextDiT with z_image_modulation): 2 layers + 2 noise/context refiners."""
    return _diffusion_model(path, seed, "z_image", Z_IMAGE, "comfy.ldm.lumina.model.NextDiT")


def build_qwen_image_model(path: str | Path, seed: int = 0) -> Path:
    """Qwen-Image diffusion model (QwenImageTransformer2DModel): 2 transformer blocks, 256 wide, bf16."""
    return _diffusion_model(path, seed, "qwen_image", QWEN_IMAGE,
                            "comfy.ldm.qwen_image.model.QwenImageTransformer2DModel")


def build_wan21_t2v_model(path: str | Path, seed: int = 0) -> Path:
    """Wan 2.1 text-to-video diffusion model (comfy.ldm.wan.model.WanModel, t2v): 2 blocks, 256 wide, bf16."""
    return _diffusion_model(path, seed, "wan21_t2v", WAN21_T2V, "comfy.ldm.wan.model.WanModel", image_model="wan2.1")


def build_anima_model(path: str | Path, seed: int = 0) -> Path:
    """Anima diffusion model (ComfyUI 0.33's comfy.ldm.anima.model.Anima): 2 blocks, 256 wide, with a 2-block LLM
    adapter of ANIMA_LLM_ADAPTER's widths in place of the pinned 1024-wide one, bf16."""
    def make():
        cfg = {k: v for k, v in ANIMA.items() if k != "image_model"}

        def build(comfy, ops):
            import comfy.ldm.anima.model as anima
            model = anima.Anima(dtype=torch.float32, device="meta", operations=ops, image_model="anima", **cfg)
            model.llm_adapter = anima.LLMAdapter(**ANIMA_LLM_ADAPTER, device="meta", dtype=torch.float32,
                                                 operations=ops)
            return model
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"anima-seed{seed}", make)


def build_qwen3_06b(path: str | Path, seed: int = 0) -> Path:
    """Anima's text encoder (ComfyUI 0.33's comfy.text_encoders.llama.Qwen3_06B, keys model.*), bf16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.llama
            return comfy.text_encoders.llama.Qwen3_06B(dict(QWEN3_06B), torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"qwen3_06b-seed{seed}", make)


def build_krea2_model(path: str | Path, seed: int = 0) -> Path:
    """Krea 2 diffusion model (ComfyUI 0.33's comfy.ldm.krea2.model.SingleStreamDiT): 2 blocks, 256 wide, bf16."""
    return _diffusion_model(path, seed, "krea2", KREA2, "comfy.ldm.krea2.model.SingleStreamDiT", image_model="krea2")


def build_qwen3vl_4b(path: str | Path, seed: int = 0) -> Path:
    """Krea 2's text encoder (ComfyUI 0.33's comfy.text_encoders.qwen3vl Qwen3-VL-4B) in the Hugging Face layout
    ComfyUI detects it by (model.language_model.*, model.visual.*: its loader renames them), bf16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.qwen3vl as qwen3vl
            model = qwen3vl._make_qwen3vl_model("qwen3vl_4b")
            vision = qwen3vl.QWEN3VL_VISION["qwen3vl_4b"]
            try:  # the tower's widths are pinned in that table: built narrow here, as tiny_dit_configs loads it
                qwen3vl.QWEN3VL_VISION["qwen3vl_4b"] = {**vision, **QWEN3VL_4B_VISION}
                return model(dict(QWEN3VL_4B), torch.float32, "meta", ops)
            finally:
                qwen3vl.QWEN3VL_VISION["qwen3vl_4b"] = vision
        sd = _state_dict(_on_meta(build), seed, torch.bfloat16)
        return {(f"model.language_model.{k[len('model.'):]}" if k.startswith("model.") else f"model.{k}"): v
                for k, v in sd.items()}
    return _write(path, f"qwen3vl_4b-seed{seed}", make)


def build_flux2_klein_model(path: str | Path, seed: int = 0) -> Path:
    """FLUX.2 klein diffusion model (comfy.ldm.flux.model.Flux, image_model "flux2"): 2 double + 2 single blocks,
    256 wide, bf16 (ComfyUI 0.33 only)."""
    return _diffusion_model(path, seed, "flux2_klein", FLUX2_KLEIN, "comfy.ldm.flux.model.Flux", image_model="flux2")


def build_qwen3_4b_klein(path: str | Path, seed: int = 0) -> Path:
    """FLUX.2 klein 4B's text encoder (comfy.text_encoders.llama.Qwen3_4B, keys model.*), 28 layers, bf16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.llama
            return comfy.text_encoders.llama.Qwen3_4B(dict(QWEN3_4B_KLEIN), torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"qwen3_4b_klein-seed{seed}", make)


def build_flux2_vae(path: str | Path, seed: int = 0) -> Path:
    """The FLUX.2 VAE (AutoencoderKL with a latent batch norm): the encoder at its pinned size, a 32-wide decoder,
    bf16; the batch norm's running statistics at mean 0, variance 1."""
    def make():
        def build(comfy, ops):
            from comfy.ldm.models.autoencoder import AutoencoderKL  # what comfy.sd.VAE builds for this file
            return AutoencoderKL(embed_dim=FLUX2_VAE["z_channels"], ddconfig=dict(FLUX2_VAE),
                                 decoder_ddconfig={**FLUX2_VAE, "ch": FLUX2_VAE_DECODER_CH})
        sd = _state_dict(_on_meta(build), seed, torch.bfloat16)
        channels = 4 * FLUX2_VAE["z_channels"]
        sd.update({"bn.running_mean": torch.zeros(channels), "bn.running_var": torch.ones(channels),
                   "bn.num_batches_tracked": torch.zeros((), dtype=torch.int64)})
        return sd
    return _write(path, f"flux2_vae-seed{seed}", make)


def build_hunyuan_image_model(path: str | Path, seed: int = 0) -> Path:
    """HunyuanImage 2.1 diffusion model (comfy.ldm.hunyuan_video.model.HunyuanVideo, 1x1 patches, a byT5 mapper):
    2 double + 2 single blocks, 256 wide, bf16. The same file on 0.3.75 and 0.33: the settings this ComfyUI's
    HunyuanVideoParams has no field for (0.33's HunyuanVideo 1.5 ones) build no weights."""
    import dataclasses
    _import_comfy()
    import comfy.ldm.hunyuan_video.model as hunyuan_video
    known = {field.name for field in dataclasses.fields(hunyuan_video.HunyuanVideoParams)} | {"image_model"}
    return _diffusion_model(path, seed, "hunyuan_image_2.1", {k: v for k, v in HUNYUAN_IMAGE.items() if k in known},
                            "comfy.ldm.hunyuan_video.model.HunyuanVideo", image_model="hunyuan_video")


def build_qwen25_vl_7b_4_layers(path: str | Path, seed: int = 0) -> Path:
    """HunyuanImage 2.1's Qwen2.5-VL-7B (comfy.text_encoders.llama.Qwen25_7BVLI, language model only, as
    build_qwen25_vl_7b) with QWEN25_7B_HUNYUAN's 4 layers, bf16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.llama
            return comfy.text_encoders.llama.Qwen25_7BVLI(dict(QWEN25_7B_HUNYUAN), torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.bfloat16, skip=("visual.",))
    return _write(path, f"qwen25_7b_4_layers-seed{seed}", make)


def build_byt5_small_glyph(path: str | Path, seed: int = 0) -> Path:
    """HunyuanImage 2.1's glyph text encoder (comfy.text_encoders.t5.T5 from byt5_config_small_glyph.json, the layout
    of byt5_small_glyphxl_fp16.safetensors) with BYT5_SMALL_GLYPH's depth, fp16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.hunyuan_image
            import comfy.text_encoders.t5
            with open(Path(comfy.text_encoders.hunyuan_image.__file__).parent / "byt5_config_small_glyph.json") as f:
                config = {**json.load(f), **BYT5_SMALL_GLYPH}
            return comfy.text_encoders.t5.T5(config, torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.float16)
    return _write(path, f"byt5_small_glyph-seed{seed}", make)


def build_umt5_xxl(path: str | Path, seed: int = 0) -> Path:
    """Wan's text encoder (comfy.text_encoders.t5.T5 as umt5: relative attention bias in every block, the layout
    of umt5_xxl_fp16.safetensors), fp16, with a SentencePiece tokenizer as `spiece_model` (see the docstring)."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.wan
            with open(Path(comfy.text_encoders.wan.__file__).parent / "umt5_config_xxl.json") as f:
                config = {**json.load(f), **UMT5XXL}
            return comfy.text_encoders.t5.T5(config, torch.float32, "meta", ops)
        sd = _state_dict(_on_meta(build), seed, torch.float16)
        import comfy.text_encoders.t5
        tokenizer = Path(comfy.text_encoders.t5.__file__).parent / "t5_pile_tokenizer" / "tokenizer.model"
        sd["spiece_model"] = torch.frombuffer(bytearray(tokenizer.read_bytes()), dtype=torch.uint8)
        return sd
    return _write(path, f"umt5_xxl-seed{seed}", make)


def build_clip_l(path: str | Path, seed: int = 0) -> Path:
    """CLIP-L text encoder (comfy.clip_model.CLIPTextModel, the layout of clip_l.safetensors), fp16."""
    def make():
        def build(comfy, ops):
            import comfy.sd1_clip
            with open(Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json") as f:
                config = {**json.load(f), **CLIP_L}
            return comfy.clip_model.CLIPTextModel(config, torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.float16)
    return _write(path, f"clip_l-seed{seed}", make)


def build_t5xxl(path: str | Path, seed: int = 0) -> Path:
    """T5 v1.1 XXL encoder (comfy.text_encoders.t5.T5, the layout of t5xxl_fp16.safetensors), fp16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.t5
            with open(Path(comfy.text_encoders.t5.__file__).parent / "t5_config_xxl.json") as f:
                config = {**json.load(f), **T5XXL}
            return comfy.text_encoders.t5.T5(config, torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.float16)
    return _write(path, f"t5xxl-seed{seed}", make)


def build_qwen3_4b(path: str | Path, seed: int = 0) -> Path:
    """Z-Image's text encoder (comfy.text_encoders.llama.Qwen3_4B, keys model.*), bf16."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.llama
            return comfy.text_encoders.llama.Qwen3_4B(dict(QWEN3_4B), torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"qwen3_4b-seed{seed}", make)


def build_qwen25_vl_7b(path: str | Path, seed: int = 0) -> Path:
    """Qwen-Image's text encoder (comfy.text_encoders.llama.Qwen25_7BVLI), language model only: its vision tower
    (visual.*, pinned at full size in ComfyUI) serves only image inputs (Qwen-Image-Edit), so it is left out."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.llama
            return comfy.text_encoders.llama.Qwen25_7BVLI(dict(QWEN25_7B), torch.float32, "meta", ops)
        return _state_dict(_on_meta(build), seed, torch.bfloat16, skip=("visual.",))
    return _write(path, f"qwen25_7b-seed{seed}", make)


def build_qwen25_vl_7b_vision(path: str | Path, seed: int = 0) -> Path:
    """Qwen-Image-Edit's text encoder: Qwen2.5-VL-7B with its vision tower (visual.*, QWEN25_VL_VISION wide), which
    reads the control images (TextEncodeQwenImageEdit(Plus)); loads with tests/tiny_dit_configs' narrow tower."""
    def make():
        def build(comfy, ops):
            import comfy.text_encoders.llama
            import comfy.text_encoders.qwen_vl
            model = comfy.text_encoders.llama.Qwen25_7BVLI(dict(QWEN25_7B), torch.float32, "meta", ops)
            model.visual = comfy.text_encoders.qwen_vl.Qwen2VLVisionTransformer(
                output_hidden_size=QWEN25_7B["hidden_size"], device="meta", dtype=torch.float32, ops=ops,
                **QWEN25_VL_VISION)
            return model
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"qwen25_7b_vision-seed{seed}", make)


def build_hunyuan_image_vae(path: str | Path, seed: int = 0) -> Path:
    """The HunyuanImage 2.1 VAE (comfy.ldm.hunyuan_video.vae Encoder/Decoder in an AutoencodingEngine,
    as comfy.sd.VAE builds it) at HUNYUAN_IMAGE_VAE's widths, bf16; loads with tests/tiny_dit_configs."""
    def make():
        def build(comfy, ops):
            from comfy.ldm.models.autoencoder import AutoencodingEngine
            params = {"params": HUNYUAN_IMAGE_VAE}
            return AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                encoder_config={"target": "comfy.ldm.hunyuan_video.vae.Encoder", **params},
                decoder_config={"target": "comfy.ldm.hunyuan_video.vae.Decoder", **params})
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"hunyuan_image_vae-seed{seed}", make)


def build_flux_ae(path: str | Path, seed: int = 0) -> Path:
    """The FLUX.1 / Z-Image VAE "ae" (AutoencoderKL, 16 latent channels) at its real, pinned size, bf16."""
    def make():
        def build(comfy, ops):
            from comfy.ldm.models.autoencoder import AutoencodingEngine
            params = {"params": FLUX_AE}
            return AutoencodingEngine(
                regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", **params},
                decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", **params})
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"flux_ae-seed{seed}", make)


def build_wan21_vae(path: str | Path, seed: int = 0) -> Path:
    """Qwen-Image's VAE (the Wan 2.1 causal 3-D VAE, comfy.ldm.wan.vae.WanVAE), 16 wide instead of 96, bf16."""
    def make():
        def build(comfy, ops):
            import comfy.ldm.wan.vae
            return comfy.ldm.wan.vae.WanVAE(**WAN21_VAE)
        return _state_dict(_on_meta(build), seed, torch.bfloat16)
    return _write(path, f"wan21_vae-seed{seed}", make)


# --- file sets -----------------------------------------------------------------------------------------------

_BUILDERS = {
    "leanlora_tiny_z_image.safetensors": build_z_image_model,
    "leanlora_tiny_flux1_dev.safetensors": build_flux_dev_model,
    "leanlora_tiny_chroma.safetensors": build_chroma_model,
    "leanlora_tiny_qwen_image.safetensors": build_qwen_image_model,
    "leanlora_tiny_qwen_3_4b.safetensors": build_qwen3_4b,
    "leanlora_tiny_clip_l.safetensors": build_clip_l,
    "leanlora_tiny_t5xxl.safetensors": build_t5xxl,
    "leanlora_tiny_qwen_2.5_vl_7b.safetensors": build_qwen25_vl_7b,
    "leanlora_tiny_qwen_2.5_vl_7b_vision.safetensors": build_qwen25_vl_7b_vision,
    "leanlora_tiny_ae.safetensors": build_flux_ae,
    "leanlora_tiny_qwen_image_vae.safetensors": build_wan21_vae,
    "leanlora_tiny_wan2.1_t2v.safetensors": build_wan21_t2v_model,
    "leanlora_tiny_umt5_xxl.safetensors": build_umt5_xxl,
    "leanlora_tiny_anima.safetensors": build_anima_model,
    "leanlora_tiny_qwen_3_06b.safetensors": build_qwen3_06b,
    "leanlora_tiny_hunyuan_image_2.1.safetensors": build_hunyuan_image_model,
    "leanlora_tiny_qwen_2.5_vl_7b_4_layers.safetensors": build_qwen25_vl_7b_4_layers,
    "leanlora_tiny_byt5_small_glyph.safetensors": build_byt5_small_glyph,
    "leanlora_tiny_hunyuan_image_2.1_vae.safetensors": build_hunyuan_image_vae,
    "leanlora_tiny_krea2.safetensors": build_krea2_model,
    "leanlora_tiny_qwen3vl_4b.safetensors": build_qwen3vl_4b,
    "leanlora_tiny_flux2_klein.safetensors": build_flux2_klein_model,
    "leanlora_tiny_qwen_3_4b_klein.safetensors": build_qwen3_4b_klein,
    "leanlora_tiny_flux2_vae.safetensors": build_flux2_vae,
}


def build_family(base_dir: str | Path, family: str, seed: int = 0) -> dict[str, Path]:
    """Write one family's files under base_dir/models/<folder>/ (names in WORKFLOW); {input name: path}."""
    out = {}
    for inputs in WORKFLOW[family].values():
        for key, name in inputs.items():
            if key in _FOLDERS:
                out[key] = _BUILDERS[name](Path(base_dir) / "models" / _FOLDERS[key] / name, seed=seed)
    return out


def build_z_image_set(base_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    return build_family(base_dir, "z_image", seed)


def build_flux_dev_set(base_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    return build_family(base_dir, "flux_dev", seed)


def build_qwen_image_set(base_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    return build_family(base_dir, "qwen_image", seed)


def build_wan_set(base_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    return build_family(base_dir, "wan", seed)


def build_all(base_dir: str | Path, seed: int = 0) -> dict[str, dict[str, Path]]:
    return {family: build_family(base_dir, family, seed) for family in WORKFLOW}


# --- verification --------------------------------------------------------------------------------------------

def import_tiny_configs():
    """Import tests/tiny_dit_configs in this process (a test server loads it as a custom-node package)."""
    if "tiny_dit_configs" not in sys.modules:
        _import_comfy()
        spec = importlib.util.spec_from_file_location("tiny_dit_configs", TINY_CONFIGS_PACKAGE / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["tiny_dit_configs"] = module
        spec.loader.exec_module(module)
    return sys.modules["tiny_dit_configs"]


def load_family(files: dict, family: str, model_options: dict | None = None) -> tuple:
    """MODEL, CLIP and VAE of one tiny set (build_family's files), loaded as the stock loader nodes load them
    (UNETLoader with `model_options`, (Dual)CLIPLoader of the workflow's type, VAELoader)."""
    import_tiny_configs()
    import comfy.sd
    import comfy.utils
    loaders = WORKFLOW[family]
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(files["unet_name"]), model_options=model_options or {})
        if "DualCLIPLoader" in loaders:
            clip = comfy.sd.load_clip([str(files["clip_name1"]), str(files["clip_name2"])],
                                      clip_type=comfy.sd.CLIPType[loaders["DualCLIPLoader"]["type"].upper()])
        else:
            clip = comfy.sd.load_clip([str(files["clip_name"])],
                                      clip_type=comfy.sd.CLIPType[loaders["CLIPLoader"]["type"].upper()])
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(files["vae_name"])))
    return model, clip, vae


def _shapes(d: dict) -> dict:
    return {k: tuple(v.shape) if torch.is_tensor(v) else v for k, v in d.items()}


def verify_family(base_dir: str | Path, family: str, loaders: dict | None = None) -> dict:
    """Load a family's files with the functions the stock loader nodes call, encode "a photo", run the diffusion
    model once on a 64x64-pixel latent and the VAE once each way; print and return the shapes. loaders: other
    files already under base_dir/models/ (the stock loaders' inputs, as WORKFLOW has them; bench/dit_assets.py's)."""
    import_tiny_configs()
    import comfy.sd

    if loaders is None:
        files, loaders = build_family(base_dir, family), WORKFLOW[family]
    else:
        files = {key: Path(base_dir) / "models" / _FOLDERS[key] / name
                 for inputs in loaders.values() for key, name in inputs.items() if key in _FOLDERS}
    model = comfy.sd.load_diffusion_model(str(files["unet_name"]))
    if "DualCLIPLoader" in loaders:
        clip = comfy.sd.load_clip([str(files["clip_name1"]), str(files["clip_name2"])],
                                  clip_type=getattr(comfy.sd.CLIPType, loaders["DualCLIPLoader"]["type"].upper()))
    else:
        clip = comfy.sd.load_clip([str(files["clip_name"])],
                                  clip_type=getattr(comfy.sd.CLIPType, loaders["CLIPLoader"]["type"].upper()))
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(files["vae_name"])))

    with torch.inference_mode():
        out = clip.encode_from_tokens(clip.tokenize("a photo"), return_pooled=True, return_dict=True)
        cond, pooled = out.pop("cond"), out.pop("pooled_output")
        pixels = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(0))
        latent = vae.encode(pixels)
        decoded = vae.decode(latent)
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(1))
        base = model.model
        conds = base.extra_conds(cross_attn=cond, pooled_output=pooled, noise=noise, device=torch.device("cpu"),
                                 **out)
        kwargs = {k: v.cond for k, v in conds.items()}
        sigma = torch.tensor([0.5])
        pred = base.apply_model(noise, sigma, **kwargs)
    report = {
        "family": family, "model_config": type(base.model_config).__name__, "model": type(base).__name__,
        "diffusion_model": type(base.diffusion_model).__name__,
        "params": sum(p.numel() for p in base.diffusion_model.parameters()),
        "clip": type(clip.cond_stage_model).__name__, "cond": tuple(cond.shape),
        "pooled": None if pooled is None else tuple(pooled.shape), "clip_extra": _shapes(out),
        "vae": type(vae.first_stage_model).__name__, "latent": tuple(latent.shape), "decoded": tuple(decoded.shape),
        "extra_conds": _shapes(kwargs), "apply_model": tuple(pred.shape),
        "finite": bool(torch.isfinite(pred).all() and torch.isfinite(decoded).all()),
        "shift": getattr(base.model_sampling, "shift", None),
    }
    for k, v in report.items():
        print(f"  {k}: {v}")
    return report


def verify_all(base_dir: str | Path) -> dict[str, dict]:
    """verify_family for every family (see there); raises if anything does not load or is not finite."""
    reports = {}
    for family in WORKFLOW:
        print(family)
        reports[family] = verify_family(base_dir, family)
        assert reports[family]["finite"], family
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base_dir", type=Path, help="ComfyUI base directory: files go to its models/ subfolders")
    parser.add_argument("--family", choices=(*WORKFLOW, "all"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", action="store_true", help="load and run them in-process (imports ComfyUI)")
    args = parser.parse_args(argv)
    import_tiny_configs()  # the builders take names and shapes from ComfyUI's classes, some at the tiny widths
    for family in WORKFLOW if args.family == "all" else (args.family,):
        t = time.perf_counter()
        files = build_family(args.base_dir, family, seed=args.seed)
        size = sum(p.stat().st_size for p in set(files.values())) / 2**20
        print(f"{family}: {size:.1f} MiB in {time.perf_counter() - t:.1f} s")
        for key, p in files.items():
            print(f"  {key}: {p}")
    if args.verify:
        verify_all(args.base_dir)


if __name__ == "__main__":
    main()
