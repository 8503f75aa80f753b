"""Text-encoder LoRA for SD1.x and SDXL (LoRA Config's text_encoder_lr; kohya's text_encoder_lr): a LoRA on the CLIP
transformer layers ComfyUI loaded (kohya's targets: CLIPAttention's q/k/v/out_proj and CLIPMLP's fc1/fc2), trained on
a private copy of the CLIP model, so the user's CLIP encodes exactly as before.

The embedding cache still encodes every caption once (the cross-attention length groups batches, and SDXL's size
embedding comes from it); with this on, each caption is also tokenized once, its tokens travel with the batch, and
each step encodes them through the LoRA'd copy with gradients: its output replaces the cached cross-attention
context and, for SDXL, the pooled part (clip_g's) of the `y` vector. Both encoders of SDXL are trained (kohya's
lora_te1_ = clip_l, lora_te2_ = clip_g); SD1.x has one (lora_te_)."""
from __future__ import annotations

import numbers
import types
from dataclasses import replace

import torch

import comfy.clip_model
import comfy.lora
import comfy.model_base
import comfy.model_management

from .trainer_api import (GIB, TOKEN_KEY, LeanLoRAError, LoraSettings, adapter_type, available_ram_bytes,
                          frozen_weight_bytes, inject_lora, model_fingerprint, text_encoder_state_dict)

# kohya's networks/lora.py TEXT_ENCODER_TARGET_REPLACE_MODULE = ["CLIPAttention", "CLIPSdpaAttention", "CLIPMLP"]:
# every Linear inside them, which in ComfyUI's CLIP (comfy/clip_model.py) are these
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")
# {encoder attribute of the CLIP model: kohya's key prefix}; comfy/lora.py model_lora_keys_clip reads these
SD1_ENCODERS = {"clip_l": "lora_te_"}
SDXL_ENCODERS = {"clip_l": "lora_te1_", "clip_g": "lora_te2_"}


def text_encoder_support(base, clip, family_name: str, rate: float) -> dict[str, str]:
    """{encoder: kohya prefix} of the CLIP model to train, or a LeanLoRAError naming the field, before any work."""
    fix = "set LoRA Config's text_encoder_lr to 0 to train the diffusion model alone"
    if isinstance(base, comfy.model_base.SDXL):
        wanted, model = SDXL_ENCODERS, "SDXL"
    elif type(base) is comfy.model_base.BaseModel and type(base.model_config).__name__.startswith("SD15"):
        wanted, model = SD1_ENCODERS, "SD1.x"
    else:
        raise LeanLoRAError(f"text_encoder_lr: got {rate:g}, but this model is {type(base).__name__} ({family_name}); "
                            f"LeanLoRA trains the text encoder of SD1.5 and SDXL only: {fix}")
    encoders = getattr(clip, "cond_stage_model", None)
    missing = [name for name in wanted if not hasattr(encoders, name)]
    if missing or (model == "SD1.x" and hasattr(encoders, "clip_g")):
        raise LeanLoRAError(f"text_encoder_lr: got {rate:g}, but the connected CLIP ({type(encoders).__name__}) is not "
                            f"the {model} text encoder this model was trained with ({', '.join(wanted)}): connect the "
                            f"checkpoint's own CLIP, or {fix}")
    return dict(wanted)


class ComfyTextEncoderLora:
    """The trained text encoder(s): a private copy of `clip.cond_stage_model` with LoRA layers; see the module."""

    def __init__(self, clip, encoders: dict[str, str], lora: LoraSettings, seed: int, device: torch.device):
        self.clip, self.encoders, self.lora, self.device = clip, encoders, lora, device
        # the LoRA's options without dropout: the UNet's step-seeded dropout is fed per step for the UNet only
        self.settings = replace(lora, dropout=0.0)
        from .comfy_adapter import _get_param, _plain_copy  # the UNet copy's helpers (import cycle otherwise)
        with torch.inference_mode():  # ComfyUI's model management in inference mode (see ComfyAdapter.encode_image)
            comfy.model_management.unload_all_models()
        need = sum(t.numel() * t.element_size() for t in clip.cond_stage_model.state_dict().values())
        available = available_ram_bytes()
        if available is not None and need > available:  # as for the UNet's copy: an error, not a swapping halt
            raise LeanLoRAError(f"text_encoder_lr: the private copy of the text encoder needs {need / GIB:.2f} GiB of "
                                f"free RAM, and this machine has {available / GIB:.2f} GiB available: free RAM, or set "
                                "text_encoder_lr to 0")
        self.model = _plain_copy(clip.cond_stage_model)  # normal tensors: ComfyUI's are inference tensors
        for key, patches in clip.patcher.patches.items():  # LoRAs already on the CLIP are baked in, as for the UNet
            weight = _get_param(self.model, key)
            if weight is not None:
                weight.data = comfy.lora.calculate_weight(patches, weight.data.float(), key).to(weight.dtype)
        self.model.requires_grad_(False)
        for layer in self.model.modules():
            if isinstance(layer, comfy.clip_model.CLIPLayer):
                layer.forward = types.MethodType(_residual_out_of_place, layer)
        self.frozen_bytes_total = frozen_weight_bytes(self.model)
        self.base_fingerprint = model_fingerprint(self.model)  # before the LoRA: the weights it trains on
        self.params = inject_lora(self.model, self.settings, seed + 1, self.target_modules())
        # the CLIP's options as CLIP.encode_from_tokens sets them (clip skip: CLIPSetLastLayer)
        self.model.reset_clip_options()
        if clip.layer_idx is not None:
            self.model.set_clip_options({"layer": clip.layer_idx})

    def target_modules(self) -> tuple[str, ...]:
        return tuple(f"{encoder}.transformer.text_model.encoder.layers.{index}.{target}"
                     for encoder in self.encoders
                     for index in range(len(getattr(self.model, encoder).transformer.text_model.encoder.layers))
                     for target in TARGETS)

    def describe(self) -> str:
        names = " and ".join(f"{name} ({prefix[:-1]})" for name, prefix in self.encoders.items())
        return (f"text encoder: LoRA rank {self.lora.rank}, alpha {self.lora.alpha} on {names}, learning rate "
                f"{self.lora.text_encoder_lr:g}; {sum(p.numel() for p in self.params):,} parameters; captions "
                "encoded every step through it (the embedding cache is bypassed for it)")

    # --- captions: tokenized once (cache time, caption_tokens), encoded every step ---
    def condition(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`cond` with the token entries replaced by what the LoRA'd encoder makes of them: the cross-attention
        context, and for SDXL the pooled output at the front of `y` (its size embedding after it stays cached)."""
        tokens = {name[len(TOKEN_KEY):]: cond.pop(name) for name in list(cond) if name.startswith(TOKEN_KEY)}
        if not tokens:  # every caption the cache holds is tokenized: a batch without would train the cached one
            raise RuntimeError("a batch reached the trained text encoder without its captions' tokens")
        keys = sorted({name.rsplit(".", 1)[0] for name in tokens})
        batch = tokens[f"{keys[0]}.ids"].shape[0]
        contexts, pooled = [], []
        for index in range(batch):
            pairs = {key: [list(zip(ids, weights)) for ids, weights in
                           zip(tokens[f"{key}.ids"][index].tolist(), tokens[f"{key}.weights"][index].tolist())]
                     for key in keys}
            context, pool = self.model.encode_token_weights(pairs)[:2]
            contexts.append(context.to(self.device))
            pooled.append(pool.to(self.device) if pool is not None else None)
        context = torch.cat(contexts)
        cached = cond["c_crossattn"]
        cond["c_crossattn"] = context.to(cached.dtype)
        if "y" in cond and pooled[0] is not None:  # SDXL: y = [clip_g's pooled output, size embedding]
            pool = torch.cat(pooled)
            cond["y"] = torch.cat([pool.to(cond["y"].dtype), cond["y"][:, pool.shape[-1]:]], dim=1)
        return cond

    # --- where it lives, what it costs ---
    def to(self, device: torch.device) -> None:
        self.model.to(device)

    def resident_bytes(self) -> int:
        """Its frozen weights, all kept on the device for the whole run (the LoRA counts with the LoRA)."""
        return self.frozen_bytes_total

    def frozen_bytes(self, device: torch.device | None) -> int:
        return frozen_weight_bytes(self.model, device)

    # --- the file ---
    def state_dict(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """kohya's text-encoder keys: lora_te_ (SD1.x), lora_te1_ / lora_te2_ (SDXL's clip_l / clip_g)."""
        return text_encoder_state_dict(self.model, self.settings,
                                       {f"{name}.transformer.": prefix for name, prefix in self.encoders.items()},
                                       dtype)

    def layers(self) -> dict[str, torch.nn.Module]:
        """The LoRA layers by kohya module name (`lora_te1_text_model_encoder_layers_0_self_attn_q_proj`)."""
        out = {}
        for path, layer in adapter_type(self.settings).layers(self.model).items():
            encoder, _, rest = path.partition(".transformer.")
            out[self.encoders[encoder] + rest.replace(".", "_")] = layer
        return out

    def fingerprint(self) -> str:
        """The copy's base weights (sampled), for the resume check: another CLIP is another run."""
        return self.base_fingerprint


def _residual_out_of_place(self, x, mask=None, optimized_attention=None):
    """ComfyUI's CLIPLayer.forward with its residual adds out of place (`x = x + ...`, the same sums): its `x += ...`
    overwrites the input the layer norm keeps for backward, which an inference-only forward can afford."""
    x = x + self.self_attn(self.layer_norm1(x), mask, optimized_attention)
    return x + self.mlp(self.layer_norm2(x))


def caption_tokens(clip, caption: str) -> dict[str, torch.Tensor]:
    """The caption's tokens and their weights as CPU tensors the batches carry: per tokenizer key ("l", "g"),
    [1, chunks, 77] ids and weights, as `clip.tokenize` makes them for CLIP.encode_from_tokens."""
    out = {}
    with torch.inference_mode():
        tokenized = clip.tokenize(caption)
    for key, chunks in tokenized.items():
        ids, weights = [], []
        for chunk in chunks:
            if not all(isinstance(pair[0], numbers.Integral) for pair in chunk):
                raise LeanLoRAError(f"text_encoder_lr: the caption {caption[:60]!r} uses a textual-inversion "
                                    "embedding, which the trained text encoder cannot take token by token: remove "
                                    "it from the caption, or set text_encoder_lr to 0")
            ids.append([int(pair[0]) for pair in chunk])
            weights.append([float(pair[1]) for pair in chunk])
        out[f"{TOKEN_KEY}{key}.ids"] = torch.tensor([ids], dtype=torch.long)
        out[f"{TOKEN_KEY}{key}.weights"] = torch.tensor([weights], dtype=torch.float32)
    return out
