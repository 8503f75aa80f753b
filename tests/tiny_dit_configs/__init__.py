"""Test-only ComfyUI "custom node" package: lets ComfyUI's STOCK loaders load the tiny DiT test models.

Loaded only into test servers, beside LeanLoRA (or imported in-process before loading); it registers no nodes.
The files come from scripts/tiny_dit_assets.py. Why it is needed: ComfyUI 0.3.75 reads the *depths* of these
models from tensor shapes but pins their *widths* in code, so a small file would otherwise be built at full size:

- Diffusion models (comfy/model_detection.py detect_unet_config): Flux fixes num_heads=24 with 128-wide heads,
  so hidden_size must be 3072; Qwen-Image keeps the class defaults num_attention_heads=24 and
  joint_attention_dim=3584; Z-Image's settings (heads, RoPE axes, z_image_modulation, ...) are set only when
  dim == 3840, and supported_models.ZImage matches only dim 3840 (any other width becomes plain Lumina 2).
  Wan 2.1 derives heads from dim (128 wide, as here) but keeps the constructor's text_dim=4096 (umt5-xxl's width).
- Text encoders: T5-XXL's width comes from t5_config_xxl.json, umt5-xxl's from umt5_config_xxl.json, CLIP-L's from
  sd1_clip_config.json, Qwen3-4B's and Qwen2.5-VL-7B's from dataclasses in comfy/text_encoders/llama.py; the loaders
  never look at the file's shapes. comfy.sd.detect_te_model knows a T5-XXL or umt5-xxl only by its 24th block
  (encoder.block.23) being 4096 wide; a narrower one is taken for T5-base.

What is patched, at import, and only for files narrower than the real model (a real file is never affected,
so the SD1.5 fixture and real models load exactly as before in the same server):

1. comfy.model_detection.detect_unet_config is wrapped. After ComfyUI's own detection it fills in the widths
   ComfyUI pins, from the file's shapes, keeping the real head width (128) and RoPE axes:
   Flux (image_model "flux", hidden_size != 3072): num_heads = hidden_size // sum(axes_dim).
   Chroma (image_model "chroma", hidden_size != 3072): the same num_heads, and its approximator's widths and depth
   (out_dim = hidden_size, hidden_dim and n_layers from distilled_guidance_layer's shapes).
   Lumina 2 with a `cap_pad_token` (only Z-Image has one) and dim not 2304/3840: Z-Image's own settings
   (z_image_modulation, time_scale 1000, axes [32, 48, 48], rope_theta 256, ffn 8/3, pad to 32) with
   n_heads = n_kv_heads = dim // 128.
   Qwen-Image (img_in width != 3072): num_attention_heads = width // 128, joint_attention_dim = txt_in width.
   Wan 2.1 (text_embedding.0 input width != 4096): text_dim = that width.
2. comfy.model_detection.model_config_from_unet_config is wrapped: such a tiny Z-Image config returns
   comfy.supported_models.ZImage(unet_config), exactly what ComfyUI returns when ZImage matches (it would
   otherwise fall through to Lumina2, with shift 6 instead of 3).
3. comfy.sd.detect_te_model is wrapped: a narrow T5-XXL file loaded alone (CLIPLoader, Chroma) has 2 blocks, not
   24, and would be taken for T5-base; it is detected as T5-XXL. So is a narrow umt5-xxl (T5 v1.1 gated blocks, a
   relative attention bias in every block, encoder width below 4096: Wan's, CLIPLoader type wan), as ComfyUI
   detects the real file; CLIPLoader type wan then builds its umt5 encoder and tokenizer. A narrow Qwen3-4B is
   detected as Qwen3-4B (ComfyUI 0.33 tells Qwen3 sizes apart by width and would take it for Llama-3-8B).
4. comfy.sd.load_text_encoder_state_dicts (behind CLIPLoader, DualCLIPLoader and comfy.sd.load_clip) is wrapped:
   for a narrow CLIP-L, T5-XXL, umt5-xxl, Qwen3-4B or Qwen2.5-VL-7B state dict it adds ComfyUI's own per-encoder
   config override, model_options["<t5xxl|umt5xxl|qwen3_4b|qwen25_7b>_model_config"] (read by
   sd1_clip.SDClipModel and merged into the json / dataclass config), with the widths and depths read from the file. For CLIP-L it is
   model_options["model_config"]: ComfyUI's long-CLIP support (text_encoders/long_clipl.py) rebuilds
   "clip_l_model_config" from that key for every CLIP-L file. ComfyUI's loaders, encoder classes, tokenizers and
   encode code are otherwise unchanged.

5. comfy.text_encoders.qwen_vl.Qwen2VLVisionTransformer.__init__ is wrapped: while a text encoder file whose
   vision tower (visual.*) is narrower than the real 1280 loads, the tower is built at the file's widths and depth
   (16-wide heads), so Qwen-Image-Edit's control images go through a tiny tower (ComfyUI pins it in llama.py).

6. Krea 2 (ComfyUI 0.33): detection pins the text fusion's heads (txtheads = txtkvheads = 20, for txtdim 2560); for
   a narrower txtdim they are txtdim // 128 (its real 128-wide heads). Its Qwen3-VL-4B text encoder: a narrow file
   (model.language_model.*, model.visual.*) gets model_options["qwen3vl_4b_model_config"] from its shapes, is detected
   as Qwen3-VL-4B (0.33 tells 4B from 8B by the merger's 2560-wide output) and its vision tower, pinned in
   qwen3vl.QWEN3VL_VISION, is built at the file's widths, depth and DeepStack mergers (on its first layers).

8. HunyuanImage 2.1: its diffusion model needs nothing (detection derives the heads from the width).
   Its byT5-small glyph encoder's depth and feed-forward come from byt5_config_small_glyph.json, and the encoder class
   gets no model name to look up an override by: while a byT5 file shallower than the real 12 blocks loads, the
   encoder is built with model_options["byt5_small_model_config"] read from the file (its width stays the real 1472:
   the diffusion model's byT5 mapper pins it). Its VAE's widths are pinned in comfy.sd.VAE ([128, 256, 512, 512, 1024,
   1024], 2 res blocks); while a HunyuanImage VAE file narrower than that (decoder.conv_in not 1024 wide) loads, the
   encoder and decoder are built at the file's widths and depth.

7. Anima (ComfyUI 0.33): detection pins Cosmos-Predict2-2B's 16 heads (only at width 2048) and 1024-wide
   cross-attention; for another width the heads are model_channels // 128 (its real 128-wide heads) and the
   cross-attention width is read from the file. Anima.__init__ pins its LLM adapter (6 blocks, 1024 wide, over
   Qwen3-0.6B's 1024-wide states): such a file's adapter is built at its widths and depth (64-wide heads, as the real
   one's), passed as the config key leanlora_tiny_llm_adapter that only these files get. Its narrow Qwen3-0.6B text
   encoder (query twice as wide as its hidden states, the one Qwen3 size so) gets
   model_options["qwen3_06b_model_config"] and is detected as Qwen3-0.6B (0.33 tells Qwen3 sizes by width).

Not shrinkable this way: llama.py's head_dim (a class attribute, 128, so Qwen files keep 128-wide heads; the
Qwen2.5-VL-7B detection also needs k_proj.bias of 512 = 4 kv heads x 128). A file without a vision tower (Qwen-Image's
tiny one) gets it built at full size but never loaded or touched for text (its memory stays unallocated; ComfyUI
logs its keys as missing).
"""
from __future__ import annotations

import functools
import logging
import re

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

_HEAD_DIM = 128  # Flux, Z-Image, Qwen-Image and the Qwen text encoders all use 128-wide attention heads
_log = logging.getLogger(__name__)


def _count(sd: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in sd if (m := rx.match(k))})


def _tiny_unet_config(cfg: dict | None, sd: dict, prefix: str) -> dict | None:
    if cfg is None:
        return cfg
    model = cfg.get("image_model")
    if model == "flux" and cfg.get("hidden_size", 3072) != 3072:
        cfg["num_heads"] = cfg["hidden_size"] // sum(cfg["axes_dim"])
    elif model == "chroma" and cfg.get("hidden_size", 3072) != 3072:
        # Chroma also pins its approximator (out_dim 3072 = the blocks' width, hidden_dim 5120, 5 layers)
        cfg.update(num_heads=cfg["hidden_size"] // sum(cfg["axes_dim"]), out_dim=cfg["hidden_size"],
                   hidden_dim=sd[f"{prefix}distilled_guidance_layer.in_proj.weight"].shape[0],
                   n_layers=_count(sd, rf"{re.escape(prefix)}distilled_guidance_layer\.layers\.(\d+)\."))
    elif model == "lumina2" and cfg["dim"] not in (2304, 3840) and f"{prefix}cap_pad_token" in sd:
        cfg.update(n_heads=cfg["dim"] // _HEAD_DIM, n_kv_heads=cfg["dim"] // _HEAD_DIM, axes_dims=[32, 48, 48],
                   axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0,
                   z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32)
    elif model == "wan2.1" and sd[f"{prefix}text_embedding.0.weight"].shape[1] != 4096:
        cfg["text_dim"] = sd[f"{prefix}text_embedding.0.weight"].shape[1]
    elif model == "anima" and cfg["model_channels"] != 2048:
        _tiny_anima_config(cfg, sd, prefix)
    elif model == "krea2" and cfg["txtdim"] != 2560:
        _tiny_krea2_config(cfg)
    elif model == "qwen_image" and sd[f"{prefix}img_in.weight"].shape[0] != 3072:
        cfg["num_attention_heads"] = sd[f"{prefix}img_in.weight"].shape[0] // _HEAD_DIM
        cfg["joint_attention_dim"] = sd[f"{prefix}txt_in.weight"].shape[1]
    return cfg


def _tiny_krea2_config(cfg: dict) -> None:
    """Krea 2's text fusion heads, which ComfyUI 0.33 leaves at the constructor's 20 (2560 / 128): 128 wide."""
    cfg["txtheads"] = cfg["txtkvheads"] = cfg["txtdim"] // _HEAD_DIM


def _qwen3vl_overrides(sd: dict) -> tuple[dict, dict]:
    """A Qwen3-VL-4B file (Hugging Face layout) narrower than the real one (2560): its language model's config
    override and its vision tower's widths (16-wide heads; its DeepStack mergers on the first layers), else ({}, {})."""
    lm, visual = "model.language_model.", "model.visual."
    if f"{visual}deepstack_merger_list.0.norm.weight" not in sd or f"{lm}embed_tokens.weight" not in sd:
        return {}, {}
    vocab, hidden = sd[f"{lm}embed_tokens.weight"].shape
    if hidden in (2560, 4096):
        return {}, {}
    language = {"qwen3vl_4b_model_config": dict(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=sd[f"{lm}layers.0.mlp.gate_proj.weight"].shape[0],
        num_hidden_layers=_count(sd, rf"{re.escape(lm)}layers\.(\d+)\."),
        num_attention_heads=sd[f"{lm}layers.0.self_attn.q_proj.weight"].shape[0] // _HEAD_DIM,
        num_key_value_heads=sd[f"{lm}layers.0.self_attn.k_proj.weight"].shape[0] // _HEAD_DIM)}
    width = sd[f"{visual}patch_embed.proj.weight"].shape[0]
    vision = dict(hidden_size=width, num_heads=max(1, width // 16),
                  intermediate_size=sd[f"{visual}blocks.0.mlp.linear_fc1.weight"].shape[0],
                  depth=_count(sd, rf"{re.escape(visual)}blocks\.(\d+)\."),
                  deepstack_visual_indexes=list(range(_count(sd, rf"{re.escape(visual)}deepstack_merger_list\.(\d+)\."))))
    return language, vision


_QWEN3VL_VISION: dict = {}  # while a narrow Qwen3-VL-4B text encoder loads: its vision tower's widths


def _tiny_anima_config(cfg: dict, sd: dict, prefix: str) -> None:
    """Anima's heads (128 wide), cross-attention width and LLM adapter, read from a narrow file (see the docstring)."""
    adapter = f"{prefix}llm_adapter."
    model_dim = sd[f"{adapter}blocks.0.self_attn.q_proj.weight"].shape[0]
    cfg.update(num_heads=cfg["model_channels"] // _HEAD_DIM,
               crossattn_emb_channels=sd[f"{prefix}blocks.0.cross_attn.k_proj.weight"].shape[1],
               leanlora_tiny_llm_adapter=dict(
                   source_dim=sd[f"{adapter}blocks.0.cross_attn.k_proj.weight"].shape[1],
                   target_dim=sd[f"{adapter}embed.weight"].shape[1], model_dim=model_dim,
                   num_layers=_count(sd, rf"{re.escape(adapter)}blocks\.(\d+)\."), num_heads=max(1, model_dim // 64)))


def _qwen3_06b(sd: dict) -> bool:
    """A Qwen3 state dict whose query is twice its hidden width: Qwen3-0.6B's 16 x 128 over 1024 (Qwen3-1.7B/4B/8B
    are 1x to 1.6x), narrow or not."""
    q_proj, embed = sd.get("model.layers.0.self_attn.q_proj.weight"), sd.get("model.embed_tokens.weight")
    return (q_proj is not None and embed is not None and "model.layers.0.self_attn.q_norm.weight" in sd
            and q_proj.shape[0] == 2 * embed.shape[1])


def _qwen3_06b_overrides(sd: dict) -> dict:
    """{"qwen3_06b_model_config": {...}} for a Qwen3-0.6B narrower than the real one (1024), else {}."""
    if not _qwen3_06b(sd) or sd["model.embed_tokens.weight"].shape[1] == 1024:
        return {}
    vocab, hidden = sd["model.embed_tokens.weight"].shape
    q_proj = sd["model.layers.0.self_attn.q_proj.weight"]
    return {"qwen3_06b_model_config": dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=sd["model.layers.0.mlp.gate_proj.weight"].shape[0],
        num_hidden_layers=_count(sd, r"model\.layers\.(\d+)\."), num_attention_heads=q_proj.shape[0] // _HEAD_DIM,
        num_key_value_heads=sd["model.layers.0.self_attn.k_proj.weight"].shape[0] // _HEAD_DIM)}


def _te_overrides(sd: dict) -> dict:
    """{"<model_name>_model_config": {...}} for a state dict narrower than the real encoder, else {}."""
    if _qwen3_06b(sd):  # Anima's text encoder: a real one is left as it is (not taken for a narrow Qwen3-4B)
        return _qwen3_06b_overrides(sd)
    if "model.embed_tokens.weight" in sd and "model.layers.0.self_attn.q_proj.weight" in sd:  # Qwen (llama.py)
        vocab, hidden = sd["model.embed_tokens.weight"].shape
        name, real = ("qwen3_4b", 2560) if "model.layers.0.self_attn.q_norm.weight" in sd else ("qwen25_7b", 3584)
        if name == "qwen25_7b" and "model.layers.0.self_attn.k_proj.bias" not in sd:
            return {}
        if hidden == real:
            return {}
        return {f"{name}_model_config": dict(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=sd["model.layers.0.mlp.gate_proj.weight"].shape[0],
            num_hidden_layers=_count(sd, r"model\.layers\.(\d+)\."),
            num_attention_heads=sd["model.layers.0.self_attn.q_proj.weight"].shape[0] // _HEAD_DIM,
            num_key_value_heads=sd["model.layers.0.self_attn.k_proj.weight"].shape[0] // _HEAD_DIM)}
    if _narrow_umt5(sd):  # Wan's umt5-xxl (umt5_config_xxl.json)
        heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
        return {"umt5xxl_model_config": dict(
            vocab_size=sd["shared.weight"].shape[0], d_model=sd["shared.weight"].shape[1], num_heads=heads,
            d_kv=sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads,
            d_ff=sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
            num_layers=_count(sd, r"encoder\.block\.(\d+)\."))}
    if "shared.weight" in sd and "encoder.block.0.layer.1.DenseReluDense.wi_1.weight" in sd:  # T5 v1.1 (XXL)
        vocab, d_model = sd["shared.weight"].shape
        if d_model == 4096:
            return {}
        heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
        return {"t5xxl_model_config": dict(
            vocab_size=vocab, d_model=d_model, num_heads=heads,
            d_kv=sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads,
            d_ff=sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
            num_layers=_count(sd, r"encoder\.block\.(\d+)\."))}
    if "text_model.embeddings.token_embedding.weight" in sd:  # CLIP-L (sd1_clip_config.json), 64-wide heads
        vocab, hidden = sd["text_model.embeddings.token_embedding.weight"].shape
        if hidden >= 768:
            return {}
        cfg = dict(vocab_size=vocab, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                   intermediate_size=sd["text_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
                   num_hidden_layers=_count(sd, r"text_model\.encoder\.layers\.(\d+)\."),
                   max_position_embeddings=sd["text_model.embeddings.position_embedding.weight"].shape[0])
        return {"clip_l_model_config": cfg}
    return {}


_VISION: dict = {}  # while a text encoder with a narrow Qwen2.5-VL vision tower loads: that tower's widths


def _vision_overrides(sd: dict) -> dict:
    """The widths of a Qwen2.5-VL vision tower narrower than the real one (1280), from its shapes: 16-wide heads."""
    embed = sd.get("visual.patch_embed.proj.weight")
    if embed is None or embed.shape[0] == 1280:
        return {}
    hidden = embed.shape[0]
    return dict(hidden_size=hidden, intermediate_size=sd["visual.blocks.0.mlp.gate_proj.weight"].shape[0],
                num_heads=max(1, hidden // 16), num_layers=_count(sd, r"visual\.blocks\.(\d+)\."))


def _narrow_umt5(sd: dict) -> bool:
    """A umt5 encoder (every block has its own relative attention bias) narrower than umt5-xxl's 4096."""
    return ("shared.weight" in sd and "encoder.block.0.layer.1.DenseReluDense.wi_1.weight" in sd
            and "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" in sd
            and sd["shared.weight"].shape[1] != 4096)


def _install() -> None:
    import comfy.model_detection as md
    import comfy.sd
    import comfy.supported_models

    if getattr(md.detect_unet_config, "_leanlora_tiny", False):
        return  # imported twice (in-process tests and a server both importing it): patch once

    detect = md.detect_unet_config
    config_from_unet_config = md.model_config_from_unet_config
    load_te = comfy.sd.load_text_encoder_state_dicts
    detect_te = comfy.sd.detect_te_model

    @functools.wraps(detect)
    def detect_unet_config(state_dict, key_prefix, metadata=None):
        return _tiny_unet_config(detect(state_dict, key_prefix, metadata=metadata), state_dict, key_prefix)

    @functools.wraps(config_from_unet_config)
    def model_config_from_unet_config(unet_config, state_dict=None, *args, **kwargs):  # 0.33: + unet_key_prefix
        if (unet_config.get("image_model") == "lumina2" and unet_config.get("z_image_modulation")
                and unet_config.get("dim") != 3840):
            return comfy.supported_models.ZImage(unet_config)
        return config_from_unet_config(unet_config, state_dict, *args, **kwargs)

    @functools.wraps(load_te)
    def load_text_encoder_state_dicts(state_dicts=[], embedding_directory=None, clip_type=comfy.sd.CLIPType.STABLE_DIFFUSION,
                                      model_options={}, **kwargs):  # 0.33: + disable_dynamic
        extra = {}
        for sd in state_dicts:
            extra.update(_te_overrides(sd))
        if "clip_l_model_config" in extra:
            # comfy/text_encoders/long_clipl.py replaces "clip_l_model_config" with model_options["model_config"]
            # plus the file's max_position_embeddings (its long-CLIP support), so CLIP-L's goes in there.
            extra["model_config"] = extra.pop("clip_l_model_config")
        if extra:
            _log.info("tiny_dit_configs: tiny text encoder config %s", extra)
            model_options = {**model_options, **extra}
        vision = next((found for sd in state_dicts if (found := _vision_overrides(sd))), {})
        _VISION.update(vision)
        for sd in state_dicts:  # Krea 2's Qwen3-VL-4B
            language, qwen3vl_vision = _qwen3vl_overrides(sd)
            if language:
                _log.info("tiny_dit_configs: tiny Qwen3-VL-4B %s, vision tower %s", language, qwen3vl_vision)
                model_options = {**model_options, **language}
                _QWEN3VL_VISION.update(qwen3vl_vision)
        try:
            return load_te(state_dicts, embedding_directory=embedding_directory, clip_type=clip_type,
                           model_options=model_options, **kwargs)
        finally:
            _VISION.clear()
            _QWEN3VL_VISION.clear()

    @functools.wraps(detect_te)
    def detect_te_model(sd):
        if _narrow_umt5(sd):  # Wan's umt5-xxl (CLIPLoader type wan)
            return comfy.sd.TEModel.T5_XXL
        if _qwen3_06b_overrides(sd):  # Anima's (0.33 only): 0.33 tells Qwen3 sizes by width
            return comfy.sd.TEModel.QWEN3_06B
        if _qwen3vl_overrides(sd)[0]:  # 0.33 tells Qwen3-VL-4B by its merger's 2560-wide output: a narrow one is 8B
            return comfy.sd.TEModel.QWEN3VL_4B
        if "qwen3_4b_model_config" in _te_overrides(sd):  # 0.33 tells Qwen3 sizes by width: a narrow one is "LLAMA3_8"
            return comfy.sd.TEModel.QWEN3_4B
        # a single T5-XXL (CLIPLoader: Chroma) is told from T5-base by its 24th block, which a 2-block file lacks
        found = detect_te(sd)
        if found == comfy.sd.TEModel.T5_BASE and "t5xxl_model_config" in _te_overrides(sd) \
                and sd["shared.weight"].shape[1] != 768:
            return comfy.sd.TEModel.T5_XXL
        return found

    import comfy.text_encoders.qwen_vl as qwen_vl
    vision_init = qwen_vl.Qwen2VLVisionTransformer.__init__

    @functools.wraps(vision_init)
    def narrow_vision_init(self, *args, **kwargs):
        vision_init(self, *args, **{**kwargs, **_VISION})  # Qwen25_7BVLI passes hidden_size=1280 by keyword

    qwen_vl.Qwen2VLVisionTransformer.__init__ = narrow_vision_init
    _install_anima_adapter()
    _install_qwen3vl_vision()
    for f in (detect_unet_config, model_config_from_unet_config, load_text_encoder_state_dicts, detect_te_model):
        f._leanlora_tiny = True
    md.detect_unet_config = detect_unet_config
    md.model_config_from_unet_config = model_config_from_unet_config
    comfy.sd.load_text_encoder_state_dicts = load_text_encoder_state_dicts
    comfy.sd.detect_te_model = detect_te_model  # looked up as a module global by load_text_encoder_state_dicts
    _install_hunyuan_image()  # after the loader wrapper above, which it wraps


def _install_qwen3vl_vision() -> None:
    """ComfyUI 0.33's Qwen3-VL vision tower (Krea 2's text encoder) built at a narrow file's widths while it loads
    (Qwen3VL builds it from the pinned qwen3vl.QWEN3VL_VISION table); 0.3.75 has no Qwen3-VL."""
    try:
        import comfy.text_encoders.qwen3vl as qwen3vl
    except ImportError:
        return
    tower_init = qwen3vl.Qwen3VLVisionModel.__init__

    @functools.wraps(tower_init)
    def narrow_tower_init(self, config, *args, **kwargs):
        tower_init(self, {**config, **_QWEN3VL_VISION}, *args, **kwargs)

    qwen3vl.Qwen3VLVisionModel.__init__ = narrow_tower_init


_BYT5: dict = {}  # while a shallow byT5 glyph file loads: its override for the byT5 encoder's config
_HUNYUAN_VAE: dict = {}  # while a narrow HunyuanImage 2.1 VAE file loads: its widths and depth


def _byt5_override(sd: dict) -> dict:
    """The byT5-small glyph encoder's depth and feed-forward width for a file shallower than the real one (12
    blocks), else {}. byT5 glyph is told by its attention width (6 x 64, as comfy.sd.detect_te_model tells it)."""
    k = sd.get("encoder.block.0.layer.0.SelfAttention.k.weight")
    if k is None or k.shape[0] != 384 or "shared.weight" not in sd:
        return {}
    layers = _count(sd, r"encoder\.block\.(\d+)\.")
    if layers == 12:
        return {}
    return dict(num_layers=layers, d_ff=sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0])


def _hunyuan_vae_widths(sd: dict) -> dict:
    """A HunyuanImage 2.1 VAE file (2-D, 64 latent channels) narrower than the real one: its encoder's widths per
    level and res blocks per level, else {}."""
    conv_in = sd.get("decoder.conv_in.weight")
    if conv_in is None or conv_in.ndim != 4 or conv_in.shape[1] != 64 or conv_in.shape[0] == 1024 \
            or "encoder.down.0.block.0.conv1.weight" not in sd:
        return {}
    levels = _count(sd, r"encoder\.down\.(\d+)\.")
    return dict(block_out_channels=[sd[f"encoder.down.{i}.block.0.conv2.weight"].shape[0] for i in range(levels)],
                num_res_blocks=_count(sd, r"encoder\.down\.0\.block\.(\d+)\."))


def _install_hunyuan_image() -> None:
    """HunyuanImage 2.1's narrow byT5 encoder and VAE (see the docstring, 8), in a ComfyUI that has them."""
    try:
        import comfy.ldm.hunyuan_video.vae as hunyuan_vae
        import comfy.text_encoders.hunyuan_image as hunyuan_image
    except ImportError:
        return
    import comfy.sd

    load_te = comfy.sd.load_text_encoder_state_dicts  # the wrapper above: keeps its overrides

    @functools.wraps(load_te)
    def load_text_encoder_state_dicts(state_dicts=[], *args, **kwargs):
        _BYT5.update(next((found for sd in state_dicts if (found := _byt5_override(sd))), {}))
        try:
            return load_te(state_dicts, *args, **kwargs)
        finally:
            _BYT5.clear()

    byt5_init = hunyuan_image.ByT5SmallModel.__init__

    @functools.wraps(byt5_init)
    def shallow_byt5_init(self, *args, model_options={}, **kwargs):
        if _BYT5:  # SDClipModel merges model_options["<model_name>_model_config"] into the json config
            model_options = {**model_options, "model_name": "byt5_small", "byt5_small_model_config": dict(_BYT5)}
        byt5_init(self, *args, model_options=model_options, **kwargs)

    vae_init = comfy.sd.VAE.__init__

    @functools.wraps(vae_init)
    def vae_narrow_init(self, sd=None, *args, **kwargs):
        _HUNYUAN_VAE.update(_hunyuan_vae_widths(sd or {}))
        try:
            vae_init(self, sd, *args, **kwargs)
        finally:
            _HUNYUAN_VAE.clear()

    def narrow(init):
        @functools.wraps(init)
        def narrow_init(self, *args, **kwargs):
            init(self, *args, **{**kwargs, **_HUNYUAN_VAE})  # comfy.sd.VAE passes its ddconfig by keyword
        return narrow_init

    comfy.sd.load_text_encoder_state_dicts = load_text_encoder_state_dicts
    hunyuan_image.ByT5SmallModel.__init__ = shallow_byt5_init
    comfy.sd.VAE.__init__ = vae_narrow_init
    hunyuan_vae.Encoder.__init__ = narrow(hunyuan_vae.Encoder.__init__)
    hunyuan_vae.Decoder.__init__ = narrow(hunyuan_vae.Decoder.__init__)


_LLM_ADAPTER: dict = {}  # while a narrow Anima builds: its LLM adapter's widths and depth


def _install_anima_adapter() -> None:
    """ComfyUI 0.33's Anima with a narrow file's LLM adapter (Anima.__init__ builds it at fixed widths): the adapter's
    config arrives as unet_config["leanlora_tiny_llm_adapter"], which only such files get (_tiny_anima_config)."""
    try:
        import comfy.ldm.anima.model as anima
    except ImportError:
        return  # 0.3.75 has no Anima
    anima_init, adapter_init = anima.Anima.__init__, anima.LLMAdapter.__init__

    @functools.wraps(anima_init)
    def narrow_anima_init(self, *args, leanlora_tiny_llm_adapter=None, **kwargs):
        _LLM_ADAPTER.update(leanlora_tiny_llm_adapter or {})
        try:
            anima_init(self, *args, **kwargs)
        finally:
            _LLM_ADAPTER.clear()

    @functools.wraps(adapter_init)
    def narrow_adapter_init(self, *args, **kwargs):
        adapter_init(self, *args, **{**kwargs, **_LLM_ADAPTER})  # Anima passes only device, dtype and operations

    anima.Anima.__init__ = narrow_anima_init
    anima.LLMAdapter.__init__ = narrow_adapter_init


_install()
