"""The one bridge between the trainer and ComfyUI objects (MODEL = ModelPatcher, CLIP, VAE): ComfyAdapter
implements the trainer's ModelAdapter (trainer/model.py) for any model a family in bridge/families/ knows: what all
ComfyUI models share lives here (encoders, the training copy, attention, fp8 and streaming through ComfyUI's cast
ops), what differs per family is asked of the family.

The user's MODEL is never modified: training runs on a private copy of the diffusion model with normal
(non-inference) tensors, and the trained LoRA comes back as ordinary ComfyUI patches on fresh clones."""
from __future__ import annotations

import contextlib
import copy
import hashlib

import torch

import comfy.ldm.modules.attention as comfy_attention
import comfy.lora
import comfy.model_management
import comfy.sd

from . import cast_weights
from .families import family_for
from .families.common import empty_latent
from .text_encoder import ComfyTextEncoderLora, caption_tokens, text_encoder_support
from .trainer_api import (GIB, HOST_STORAGES, Attention, BaseWeights, CheckpointDepth, FamilyIdentity, LeanLoRAError,
                          LoraSettings, LoraTargets, available_ram_bytes, cast_frozen_weights, move_to_host,
                          unpin_in_place)


def _get_param(module: torch.nn.Module, dotted: str) -> torch.Tensor | None:
    try:
        return module.get_parameter(dotted)
    except AttributeError:
        return None


def _hash_tensor(digest, tensor: torch.Tensor) -> None:
    """Name-independent part of a weight's fingerprint: shape, dtype and ~64 evenly strided values. Hashing
    every byte of a multi-GB text encoder would take seconds; a different checkpoint differs in the samples.
    Read in inference mode: a ComfyUI that loads models partially (low VRAM) keeps inference tensors, which
    normal-mode views refuse ("Inference tensors do not track version counter"); reading never needs autograd."""
    with torch.inference_mode():
        sample = tensor.detach().reshape(-1)[:: max(1, tensor.numel() // 64)].to("cpu", torch.float32)
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())


def _hash_patch_value(digest, value) -> None:
    """A LoRA patch (comfy.weight_adapter objects keep their tensors in .weights; older forms are tuples)."""
    if isinstance(value, torch.Tensor):
        _hash_tensor(digest, value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _hash_patch_value(digest, item)
    elif hasattr(value, "weights"):
        digest.update(type(value).__name__.encode())
        _hash_patch_value(digest, value.weights)
    else:
        digest.update(repr(value).encode())  # numbers, names; anything else at worst makes a needless miss


def weights_fingerprint(patcher, *extra: str, prefix: str = "") -> str:
    """Identity of a ComfyUI model as it encodes: its unpatched weights plus the patches (LoRAs) on top; with
    `prefix`, only the weights and patches whose keys start with it."""
    with torch.inference_mode():  # ComfyUI's weights are read as ComfyUI reads them (see ComfyAdapter.encode_image)
        return _weights_fingerprint(patcher, *extra, prefix=prefix)


def _weights_fingerprint(patcher, *extra: str, prefix: str = "") -> str:
    digest = hashlib.sha256("\0".join((type(patcher.model).__name__, *extra)).encode())
    for name, weight in patcher.model.state_dict().items():
        if not name.startswith(prefix):
            continue
        original = patcher.backup.get(name)  # while loaded, patched weights are modified in place
        digest.update(name.encode())
        _hash_tensor(digest, original.weight if original is not None else weight)
    for name in sorted(name for name in patcher.patches if name.startswith(prefix)):
        for strength, value, strength_model, offset, function in patcher.patches[name]:
            function = getattr(function, "__qualname__", repr(function))
            digest.update(repr((name, strength, strength_model, offset, function)).encode())
            _hash_patch_value(digest, value)
    return digest.hexdigest()


class ComfyAdapter:
    # ComfyUI's ops check (and clear) the Cancel flag on every layer call, in whatever thread runs them: in the
    # forward pass, in checkpointed recomputation during backward, in VAE/CLIP encoding. Any of these means Cancel.
    cancel_errors = (comfy.model_management.InterruptProcessingException,)

    @classmethod
    def for_cached_inputs(cls, model) -> "ComfyAdapter":
        """An adapter without CLIP and VAE, for callers that bring cached latents and text embeddings (the bench):
        any use of an encoder is an error naming it."""
        return cls(model, _NoEncoder("CLIP"), _NoEncoder("VAE"))

    def __init__(self, model, clip, vae):
        for name, value in (("model", model), ("clip", clip), ("vae", vae)):
            if value is None:
                raise LeanLoRAError(f"LeanLoRA Train: the {name} input is empty; connect Load Checkpoint's {name.upper()}")
        self.patcher, self.clip, self.vae = model, clip, vae
        self.base = model.model
        self.family = family_for(self.base)  # an error naming the model and the families, before any GPU work
        self.sequence_conditioning = self.family.sequence_conditioning
        self.timestep_sampling = self.family.timestep_sampling
        self.graph_blocker = self.family.graph_blocker
        self.device = comfy.model_management.get_torch_device()
        # Object patches first: ComfyUI's ModelSamplingDiscrete node (e.g. v_prediction) patches the schedule
        # onto the MODEL without touching the base model until sampling.
        self.model_sampling = model.get_model_object("model_sampling")
        self.transformer_options: dict = {}
        self._encoder_ids: dict[str, str] = {}

    def describe(self) -> str:
        return self.family.describe(self.base)

    # --- encoders (used once, to fill the cache) ---
    # Training runs in a thread of its own, outside the inference mode ComfyUI executes nodes in. ComfyUI's model
    # management (loading, partial loading, unloading its models) must still run in inference mode: done in normal
    # mode it turns the models' inference tensors into tensors without a version counter that are not inference
    # tensors either, and every later use fails, ComfyUI's own CLIPTextEncode too ("Inference tensors do not track
    # version counter": H200 server, low-VRAM SDXL, and any re-queue after a cancelled run). What the encoders
    # return is cloned outside it, into normal tensors training can use.
    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            latent = self.base.process_latent_in(self.vae.encode(pixels).float())
        return latent.clone()

    def encode_text(self, caption: str, width: int, height: int) -> dict[str, torch.Tensor]:
        """The conditioning the model's blocks take for `caption`, as ComfyUI's sampler builds it: the text
        encoder's output dict (cond, pooled output, attention mask...) through the model's own extra_conds (SDXL's
        size embedding, Flux's guidance, Lumina's token count). A constant (a number) becomes a one-element tensor
        so a batch stacks it."""
        with torch.inference_mode():
            encoded = dict(self.clip.encode_from_tokens(self.clip.tokenize(caption), return_dict=True))
            cond = encoded.pop("cond")
            # a latent of the model's own format (extra_conds reads its shape: Wan builds image channels for any
            # channels the model takes beyond it), with a time axis of one frame where the latents are video
            noise = empty_latent(self.base.latent_format, max(1, height // 8), max(1, width // 8))
            conds = self.base.extra_conds(cross_attn=cond, **{**encoded, **self.family.text_conditioning},
                                          width=width, height=height, noise=noise, device=torch.device("cpu"))
        out = {}
        for name, value in conds.items():
            value = value.cond
            if isinstance(value, torch.Tensor):
                out[name] = value.clone()
            elif isinstance(value, (bool, int, float)):
                out[name] = torch.tensor([value])
        return out

    def control_encoder(self, dataset):
        """A folder of edit pairs: the family's edit variant takes over (Qwen-Image-Edit, FLUX.1 Kontext) and this
        encodes the control images as its ComfyUI node does (bridge/edit_pairs.py); None for plain images. Refuses
        an edit-only model given plain images."""
        from .edit_pairs import control_encoder
        return control_encoder(self, dataset)

    # --- encoder identities (cache keys): computed once per adapter ---
    def image_encoder_id(self) -> str:
        """The VAE and the model's latent scaling (encode_image applies process_latent_in)."""
        if "image" not in self._encoder_ids:
            latent_format = self.base.latent_format
            self._encoder_ids["image"] = weights_fingerprint(
                self.vae.patcher, str(self.vae.vae_dtype), type(latent_format).__name__,
                f"{latent_format.scale_factor} {getattr(latent_format, 'shift_factor', 0.0)}")
        return self._encoder_ids["image"]

    def text_encoder_id(self) -> str:
        """CLIP with its LoRA patches and options, and the model family (extra_conds differ per family); for a
        family whose extra_conds run part of the diffusion model on the text (Anima's LLM adapter:
        ModelFamily.conditioning_weights, a MODEL state-dict prefix), also those weights and their patches."""
        if "text" not in self._encoder_ids:
            extra = ()
            prefix = getattr(self.family, "conditioning_weights", None)
            if prefix:
                extra = (weights_fingerprint(self.patcher, prefix=prefix),)
            self._encoder_ids["text"] = weights_fingerprint(
                self.clip.patcher, type(self.base).__name__, str(self.clip.layer_idx),
                repr(sorted(self.clip.tokenizer_options.items())), *extra)
        return self._encoder_ids["text"]

    def reserved_vram(self) -> int:
        """VRAM ComfyUI keeps free for itself (--reserve-vram, else its default of a few hundred MiB)."""
        return int(comfy.model_management.extra_reserved_memory())

    def release_encoders(self) -> None:
        """ComfyUI's models off the GPU and their VRAM given back, before training measures what it has. ComfyUI
        0.33's DynamicVRAM (comfy-aimdo) also keeps per-stream cast buffers on the GPU after unloading; ComfyUI
        drops them only after each node (reset_cast_buffers), and its encoders just ran inside this one."""
        with torch.inference_mode():  # see encode_image
            comfy.model_management.unload_all_models()
            if getattr(getattr(comfy, "memory_management", None), "aimdo_enabled", False) \
                    and hasattr(comfy.model_management, "reset_cast_buffers"):
                comfy.model_management.reset_cast_buffers()
            comfy.model_management.soft_empty_cache()

    # --- the diffusion model ---
    def training_unet(self) -> torch.nn.Module:
        """A private copy of the diffusion model, in CPU memory until the training session places it (so fp8 and
        streaming are decided before anything lands on the GPU): cloning turns ComfyUI's inference tensors
        (which cannot be saved for backward) into normal ones. LoRAs already patched onto the MODEL are baked in."""
        with torch.inference_mode():  # see encode_image
            comfy.model_management.unload_all_models()  # weights back to their unpatched, offloaded state
        self._check_ram_for_copy()
        unet = _plain_copy(self.base.diffusion_model)
        for key, patches in self.patcher.patches.items():
            if key.startswith("diffusion_model."):
                weight = _get_param(unet, key[len("diffusion_model."):])
                if weight is not None:
                    # a copy (calculate_weight adds in place, and the copy shares ComfyUI's memory: _host_aliases)
                    weight.data = comfy.lora.calculate_weight(patches, weight.data.to(torch.float32, copy=True),
                                                              key).to(weight.dtype)
        unet.requires_grad_(False)
        self.family.prepare(unet)
        # ComfyUI's storages the copy shares: a weight placed from one goes back to it when parked, not to a copy
        setattr(unet, HOST_STORAGES, frozenset(self.shared_host_storages()))
        return unet

    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]:
        return self.family.lora_targets(unet, targets)

    def _check_ram_for_copy(self) -> None:
        """The private copy is made in host RAM: a machine without the room gets an error naming the numbers
        instead of swapping to a halt or being killed by the system (a 12B FLUX in bf16 is a 22 GiB copy)."""
        need = sum(t.numel() * t.element_size() for t in self.base.diffusion_model.state_dict().values()
                   if not _shareable(t))  # the rest is ComfyUI's memory, shared (_host_aliases)
        available = available_ram_bytes()
        if available is not None and need > available:
            raise LeanLoRAError(
                f"LeanLoRA Train: its private copy of the diffusion model ({type(self.base).__name__}) needs "
                f"{need / GIB:.2f} GiB of free RAM, and this machine has {available / GIB:.2f} GiB available. Load the "
                "model with weight_dtype fp8_e4m3fn in Load Diffusion Model (or an fp8 file) to halve that, or free "
                "RAM (close programs, unload other models)")

    def shared_host_storages(self) -> set[int]:
        """Addresses of ComfyUI's host storages, which the training copy shares instead of copying (_host_aliases):
        the host RAM plan (trainer/memory/host_ram.py) counts only the copy's other tensors as its own."""
        return {t.untyped_storage().data_ptr() for t in self.base.diffusion_model.state_dict().values()
                if _shareable(t)}

    def checkpoint_blocks(self, unet: torch.nn.Module, depth: CheckpointDepth = CheckpointDepth.LAYER,
                          latent_size: tuple[int, int] | None = None) -> list[torch.nn.Module]:
        """The family's units to recompute; with `latent_size` best first for partial checkpointing."""
        return self.family.checkpoint_units(unet, depth, latent_size)

    def prepare_compile_units(self, unet: torch.nn.Module, scope: str = "layers") -> list[torch.nn.Module]:
        """Makes the training copy ready for torch.compile and returns what compiles, each on its own."""
        return self.family.compile_units(unet, scope)

    def set_attention(self, backend: Attention, compiled: bool = False) -> str | None:
        """Picks the attention kernel for training through ComfyUI's per-call override hook (the sampler's own
        choice stays untouched). 'auto' keeps what ComfyUI chose at start-up. Returns a note for the report, or
        None.

        ComfyUI's split and sub-quadratic kernels (its choice on CPUs, or when started with
        --use-split-cross-attention / --use-quad-cross-attention) ask for free memory on every call; dynamo
        guards on that number, so under torch.compile every step would compile again. Compiled runs call them
        outside the compiled graphs instead (a graph break), keeping the user's choice and its memory behaviour."""
        kernels = {Attention.SDPA: comfy_attention.attention_pytorch,
                   Attention.XFORMERS: comfy_attention.attention_xformers,
                   Attention.SUB_QUADRATIC: comfy_attention.attention_sub_quad}
        if backend is Attention.XFORMERS and not comfy.model_management.xformers_enabled():
            raise LeanLoRAError("attention: xformers is not usable here (it needs an NVIDIA GPU and an importable "
                                "xformers matching your torch); choose 'pytorch SDPA' or 'auto'")
        kernel = comfy_attention.optimized_attention if backend is Attention.AUTO else kernels[backend]
        note = None
        if compiled and kernel in (comfy_attention.attention_sub_quad, comfy_attention.attention_split):
            note = (f"attention: {kernel.__name__} reads free memory on every call, so it runs outside the compiled "
                    "graphs (compiled, each step would compile again); 'pytorch SDPA' compiles into them")
            kernel = torch.compiler.disable(kernel)
        elif backend is Attention.AUTO:
            self.transformer_options = {}
            return None
        self.transformer_options = {"optimized_attention_override": lambda default, *a, **k: kernel(*a, **k)}
        return note

    # --- frozen weights through ComfyUI's cast ops (bridge/cast_weights.py) ---
    def store_weights_fp8(self, unet: torch.nn.Module) -> int:
        return cast_weights.store_weights_fp8(unet)

    def group_upcasts(self, unet: torch.nn.Module) -> None:
        """Each of the family's blocks has its fp8 weights upcast together (cast_weights.UpcastGroup)."""
        cast_weights.group_upcasts(self.family.upcast_groups(unet))

    def stream_weights_from_cpu(self, unet: torch.nn.Module, share: float = 1.0) -> int:
        return cast_weights.stream_weights_from_cpu(unet, share)

    def rank_streaming(self, unet: torch.nn.Module, latent_size: tuple[int, int]) -> None:
        """The streamed layers' order from the family's cost model at `latent_size` (the most multiply-adds per
        weight byte first); a family without one streams the largest layers first."""
        rows = getattr(self.family, "stream_rows", None)
        if rows is not None:
            cast_weights.rank_streaming(rows(unet, latent_size))

    def stream_costs(self, unet: torch.nn.Module, share: float) -> tuple[list[tuple[int, int]], int]:
        return cast_weights.stream_costs(unet, share)

    def projected_weight_bytes(self, unet: torch.nn.Module, compute_dtype: torch.dtype,
                               base_weights: BaseWeights, stream_share: float = 1.0) -> int:
        return cast_weights.projected_weight_bytes(unet, compute_dtype, base_weights, stream_share)

    def set_compute_dtype(self, unet: torch.nn.Module, dtype: torch.dtype) -> None:
        cast_frozen_weights(unet, dtype)
        unet.dtype = dtype  # ComfyUI's UNet casts its input to this; predict feeds it the same

    def set_conv_layout(self, unet: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype) -> str | None:
        return self.family.set_conv_layout(self.base, unet, device, compute_dtype)

    def predict(self, unet: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.family.predict(unet, x, timestep, cond, dict(self.transformer_options))

    def resolution_shift(self, latent_size: tuple[int, int]) -> float:
        return self.family.resolution_shift(self.model_sampling, latent_size)

    # --- the LoRA file: the family's identity and naming ---
    def identity(self) -> FamilyIdentity:
        return self.family.identity(self.base, self.model_sampling)

    def kohya_module_names(self) -> dict[str, str] | None:
        return self.family.kohya_module_names(self.base)

    def diffusers_module_names(self) -> dict[str, str] | None:
        return self.family.diffusers_module_names(self.base)

    # --- the text encoder, trained beside the diffusion model (LoRA Config's text_encoder_lr) ---
    def check_text_encoder(self, lora: LoraSettings) -> None:
        """A model whose text encoder LeanLoRA cannot train is refused here, naming the field, before any work."""
        text_encoder_support(self.base, self.clip, self.family.name, lora.text_encoder_lr)

    def text_encoder_tokens(self, caption: str) -> dict[str, torch.Tensor]:
        return caption_tokens(self.clip, caption)

    def training_text_encoder(self, lora: LoraSettings, seed: int) -> ComfyTextEncoderLora:
        """A private copy of the CLIP model with LoRA layers (the user's CLIP untouched), in CPU memory until the
        session places it."""
        encoders = text_encoder_support(self.base, self.clip, self.family.name, lora.text_encoder_lr)
        return ComfyTextEncoderLora(self.clip, encoders, lora, seed, self.device)

    @contextlib.contextmanager
    def training_kernels(self):
        """While training steps and memory probes run: ComfyUI 0.33's DiT attention takes comfy-kitchen's fused
        inference kernels (rope, rms norm + rope), which have no backward ("no autograd formula was registered"),
        unless `comfy.model_management.in_training` is set, as ComfyUI's own trainer sets it around its loop.
        0.3.75 has no such switch."""
        if not hasattr(comfy.model_management, "in_training"):
            yield
            return
        before = comfy.model_management.in_training
        comfy.model_management.in_training = True
        try:
            yield
        finally:
            comfy.model_management.in_training = before

    def free(self, unet: torch.nn.Module) -> None:
        move_to_host(unet)
        unpin_in_place()  # ComfyUI's pages that streaming registered: pageable again before ComfyUI frees them
        with torch.inference_mode():
            comfy.model_management.soft_empty_cache()


class _NoEncoder:
    """Stands for an encoder an adapter was made without (ComfyAdapter.for_cached_inputs)."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attribute: str):
        raise LeanLoRAError(f"this training has no {self.name} (it trains from cached inputs only): "
                            f"{self.name}.{attribute} is unavailable")


# What a ComfyUI loader leaves on a layer (comfy/model_patcher.py, comfy/ops.py, comfy/pinned_memory.py):
# - 0.33's dynamic VRAM loader (ModelPatcherDynamic, the default on CUDA) keeps it after unloading. `_v` and
#   `_v_block` hold the model's VRAM allocation (a ModelVBAR), `_pin_state` and `_pins` its pinned host buffers,
#   `_v_weight`, `_v_bias`, `_prefetch` and `_comfy_graph` GPU views and graphs over them. A copy of a ModelVBAR or
#   HostBuffer frees the same native memory when it is garbage-collected, under the user's loaded model.
# - Per-call casting that a dynamic or low-VRAM load switches on (`comfy_cast_weights` set on the instance, weight
#   functions, LoRA patches applied per call): the copy keeps its ops' class defaults and bakes the LoRAs in.
_LOADER_STATE = frozenset({
    "_v", "_v_block", "_v_block_faulted", "_v_signature", "_v_weight", "_v_bias", "_prefetch", "_comfy_graph",
    "_pin_state", "_pins", "seed_key", "weight_lowvram_function", "bias_lowvram_function",
    "comfy_cast_weights", "prev_comfy_cast_weights", "weight_function", "bias_function",
})
_ATOMIC = (type(None), bool, int, float, str, bytes, torch.dtype, torch.device)  # deepcopy returns these as they are


def _plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deepcopy of module without _LOADER_STATE: the same layers and weights as ComfyUI built them, in both
    0.3.75 and 0.33, and the user's module untouched. The loader's objects are mapped to a placeholder in the memo
    (so they are never copied) and the placeholders removed after; immutable values (flags, names) need no memo
    entry, and must not get one: the memo is keyed by identity, and True or None appear all over a module.
    Rebuilding through the loader (0.33's clone(disable_dynamic=True)) would read the checkpoint again and works
    only for core loaders; a fresh UNet from the config would not carry ops a loader chose."""
    dropped = object()
    memo = {id(value): dropped for layer in module.modules() for name, value in vars(layer).items()
            if name in _LOADER_STATE and not isinstance(value, _ATOMIC)}
    memo.update(_host_aliases(module))
    memo.update(_dequantized_weights(module))
    copied = copy.deepcopy(module, memo)
    for layer in copied.modules():
        for name in _LOADER_STATE.intersection(vars(layer)):
            delattr(layer, name)
        _as_plain_linear(layer)
    return copied


def _dequantized_weights(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """deepcopy memo entries that give the copy each quantized weight (0.33 loads scaled-fp8 and other quantized
    files as comfy_kitchen QuantizedTensor weights, which deepcopy cannot copy) as a plain frozen Parameter of its
    dequantized value in the dtype ComfyUI computes that layer in; LeanLoRA's weight storage (fp8 or the compute
    dtype) re-stores it as for any unquantized file. ComfyUI's own weights are only read."""
    plain = {}
    for name, layer in module.named_modules():
        weight = layer._parameters.get("weight")
        if weight is None or type(weight.data).__name__ != "QuantizedTensor" or id(weight) in plain:
            continue
        try:
            with torch.inference_mode(False), torch.no_grad():
                value = weight.data.dequantize().clone()
                # AWQ-style smoothing scales the layer's input: folded into the weight, the plain layer computes as it
                smoothing = getattr(layer, "pre_quant_scale", None)
                if smoothing is not None:
                    value = (value.float() * smoothing.to(value.device, torch.float32)).to(value.dtype)
        except Exception as error:  # a layout comfy_kitchen cannot dequantize on this device
            quant_format = getattr(layer, "quant_format", None) or "an unknown format"
            raise LeanLoRAError(
                f"LeanLoRA Train: the model's layer {name} is quantized as {quant_format}, which cannot be read back "
                f"as plain weights here ({error}); load an unquantized (bf16) file of this model with Load Diffusion "
                "Model's weight_dtype fp8_e4m3fn instead") from error
        plain[id(weight)] = torch.nn.Parameter(value, requires_grad=False)
    return plain


def _as_plain_linear(layer: torch.nn.Module) -> None:
    """A copied 0.33 mixed-precision Linear (the op a quantized file's layers get; not a torch Linear, and its
    forward quantizes the input wherever a `layout_type` is set) becomes ComfyUI's manual-cast Linear over the same
    plain weight: what an unquantized file's layer is, so LoRA injection and LeanLoRA's weight casts take it."""
    import comfy.ops
    if type(layer).__name__ != "Linear" or isinstance(layer, torch.nn.Linear) \
            or not hasattr(layer, "_full_precision_mm") or not isinstance(getattr(layer, "weight", None), torch.Tensor):
        return
    for name in ("layout_type", "quant_format", "tensor_class", "factory_kwargs", "_orig_shape",
                 "_full_precision_mm", "_full_precision_mm_config", "input_scale", "pre_quant_scale"):
        if name in vars(layer):
            delattr(layer, name)
        layer._parameters.pop(name, None)
        layer._buffers.pop(name, None)
    layer.__class__ = comfy.ops.manual_cast.Linear


def _shareable(tensor: torch.Tensor) -> bool:
    """Whether the training copy can share `tensor`'s memory: a plain tensor in host RAM."""
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu"


def _host_aliases(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """deepcopy memo entries that give the copy each plain host tensor of `module` as a new tensor over the same
    memory, not a second copy: the training copy's frozen weights never change in place (every conversion, move
    and LoRA bake assigns a new tensor to `.data`), so ComfyUI's host copy serves both, and the copy costs host RAM
    only for what training converts (fp8, the compute dtype). A 20 GiB Qwen-Image file was held twice before.
    The alias is a normal tensor (ComfyUI's are inference tensors, which autograd cannot save for backward);
    tensor subclasses (0.33's quantized weights) and device tensors are copied as before."""
    aliases = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        data = tensor.data
        if not _shareable(data) or id(tensor) in aliases:
            continue
        alias = torch.empty(0, dtype=data.dtype)
        alias.set_(data.untyped_storage(), data.storage_offset(), data.size(), data.stride())
        aliases[id(tensor)] = (torch.nn.Parameter(alias, requires_grad=tensor.requires_grad)
                               if isinstance(tensor, torch.nn.Parameter) else alias)
    return aliases


def apply_lora(model, clip, lora_state_dict: dict[str, torch.Tensor], strength_model: float, strength_clip: float):
    """Fresh clones with the LoRA as normal patches (what KSampler expects); the inputs stay untouched."""
    if not lora_state_dict:
        raise LeanLoRAError("the LORA_MODEL input is empty")
    return comfy.sd.load_lora_for_models(model, clip, lora_state_dict, strength_model, strength_clip)
