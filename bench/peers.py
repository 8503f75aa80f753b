"""What every benchmark row shares (the cached workload, random init, step clock) and the two peers we measure
against in the same process: the plain diffusers+peft recipe and ComfyUI's built-in TrainLoraNode.

Peers are driven with their own code paths; the bench only supplies random weights, cached latents/text and a
clock. A peer that cannot run in a configuration raises PeerUnavailable with the reason (never a made-up number).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

LORA_RANK = 16
LORA_ALPHA = 16
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


class PeerUnavailable(RuntimeError):
    """This peer cannot run this configuration; the message says why."""


@dataclass
class Workload:
    """One model/resolution/batch: the cached inputs every runner trains on (created once, kept on the CPU
    like a real latent/text cache) and the hooks the runners call."""
    family: str                       # "sd15" or "sdxl" (ComfyUI model family; the tiny model is "sd15")
    resolution: int                   # image side in pixels (latent side = resolution // 8)
    batch: int
    device: torch.device
    latents: torch.Tensor             # (B, 4, h, w), already in the model's latent space
    context: torch.Tensor             # (B, 77, context_dim) text encoder hidden states
    pooled: torch.Tensor | None       # (B, 1280) SDXL pooled text embedding
    build_comfy_model: Callable[[torch.dtype], torch.nn.Module]  # -> comfy BaseModel on device, random weights
    diffusers_config: dict
    reset_peak: Callable[[], None]    # called once a runner has built its model, before its first step
    notes: list[str] = field(default_factory=list)


class StepClock:
    """Marks step boundaries without adding host syncs: CUDA events on a GPU (read once at the end), wall clock
    on the CPU. interval i = time between mark i and mark i+1."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self, *_ignored) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@torch.no_grad()
def random_init_(module: torch.nn.Module, std: float = 0.02) -> None:
    """Fast in-place random weights (models are built without init): norms = identity, biases = 0, everything
    else N(0, std). Not a realistic init, just finite values so every step does real math."""
    for sub in module.modules():
        is_norm = isinstance(sub, (torch.nn.GroupNorm, torch.nn.LayerNorm))
        for name, p in sub.named_parameters(recurse=False):
            if is_norm and name == "weight":
                p.fill_(1.0)
            elif p.ndim >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()


# --- diffusers UNet configs (the published SD1.5 / SDXL unet/config.json values that matter) ---

_DIFFUSERS_COMMON = dict(
    sample_size=64, in_channels=4, out_channels=4, flip_sin_to_cos=True, freq_shift=0, act_fn="silu",
    norm_num_groups=32, norm_eps=1e-5, downsample_padding=1, mid_block_scale_factor=1, center_input_sample=False,
)
DIFFUSERS_SD15 = dict(
    _DIFFUSERS_COMMON,
    block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, cross_attention_dim=768, attention_head_dim=8,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
)
DIFFUSERS_SDXL = dict(
    _DIFFUSERS_COMMON, sample_size=128,
    block_out_channels=(320, 640, 1280), layers_per_block=2, transformer_layers_per_block=(1, 2, 10),
    cross_attention_dim=2048, attention_head_dim=(5, 10, 20), use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
)
# The one-level SD1.5-shaped UNet of --tiny (same shape as the bench's tiny ComfyUI model).
DIFFUSERS_TINY = dict(
    _DIFFUSERS_COMMON, sample_size=8,
    block_out_channels=(320,), layers_per_block=1, cross_attention_dim=768, attention_head_dim=8,
    down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
)


# --- peer (a): diffusers + peft, as in diffusers' examples/text_to_image/train_text_to_image_lora(_sdxl).py ---

def run_diffusers_peer(work: Workload, warmup: int, steps: int) -> dict:
    """fp16 weights, LoRA params fp32, fp16 autocast + GradScaler, gradient checkpointing, AdamW8bit, DDPM
    add_noise + eps MSE, grad clip 1.0 and a per-step loss read (the script logs loss.item() every step)."""
    try:
        import bitsandbytes as bnb
    except ImportError as error:
        raise PeerUnavailable(f"bitsandbytes not importable ({error}); the recipe uses AdamW8bit") from error
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    device = work.device
    # fp16 as in the recipe; CPUs have no fast fp16 matmul (25x slower than bf16 here), so the CPU smoke run
    # uses bf16 there, which needs no loss scaling.
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    with torch.device(device):
        unet = UNet2DConditionModel(**work.diffusers_config)
    unet.to(dtype=half)
    random_init_(unet)
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, init_lora_weights="gaussian",
                                target_modules=LORA_TARGETS))
    cast_training_params(unet, dtype=torch.float32)
    unet.enable_gradient_checkpointing()
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = bnb.optim.AdamW8bit(params, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    scaler = torch.amp.GradScaler(device.type, enabled=half == torch.float16)
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear")

    bsz = work.batch
    added = None
    if work.pooled is not None:  # SDXL: pooled text + (orig size, crop, target size) time ids
        res = work.resolution
        added = {"text_embeds": work.pooled,
                 "time_ids": torch.tensor([[res, res, 0, 0, res, res]], dtype=torch.float32).repeat(bsz, 1)}

    def step() -> float:
        latents = work.latents.to(device, half)
        context = work.context.to(device, half)
        cond = {k: v.to(device, half) for k, v in added.items()} if added else None
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (bsz,), device=device).long()
        noisy = scheduler.add_noise(latents, noise, timesteps)
        with torch.autocast(device.type, dtype=half):
            pred = unet(noisy, timesteps, context, added_cond_kwargs=cond, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        return loss.item()

    clock = StepClock(device)
    work.reset_peak()
    clock.mark()
    losses = []
    for _ in range(warmup + steps):
        losses.append(step())
        clock.mark()
    recipe = "fp16 weights + fp16 autocast + GradScaler" if half == torch.float16 else \
        "CPU: bf16 weights + bf16 autocast instead of fp16"
    return {"intervals": clock.intervals(), "losses": losses, "setup_in_first_step": False,
            "notes": [f"{recipe}, GC, AdamW8bit"]}


# --- peer (b): ComfyUI's built-in TrainLoraNode (comfy_extras/nodes_train.py of the ComfyUI in use) ---

def _node_arguments(node, chosen: dict) -> dict:
    """TrainLoraNode.execute's arguments for the installed ComfyUI: the bench's choices, and the node's own schema
    defaults for the inputs the bench leaves alone (0.33 added quantized_backward, checkpoint_depth, offloading,
    bucket_mode and bypass_mode to 0.3.75's), each a one-element list (the node takes every input as a list)."""
    import inspect
    accepted = list(inspect.signature(node.execute).parameters)
    unknown = sorted(set(chosen) - set(accepted))
    if unknown:
        raise PeerUnavailable(f"this ComfyUI's TrainLoraNode has no {', '.join(unknown)} input")
    defaults = {entry.id: getattr(entry, "default", None) for entry in node.define_schema().inputs}
    missing = [name for name in accepted if name not in chosen and defaults.get(name) is None]
    if missing:
        raise PeerUnavailable(f"this ComfyUI's TrainLoraNode needs {', '.join(missing)}, which the bench does not know")
    return {name: chosen[name] if name in chosen else [defaults[name]] for name in accepted}


def run_comfyui_peer(work: Workload, warmup: int, steps: int, offloading: bool = False) -> dict:
    """Calls TrainLoraNode.execute itself: its weight-wrapper LoRA on every >=2-D weight (alpha 1), its own
    TrainSampler loop through Guider_Basic, bf16, gradient checkpointing, AdamW, rank 16. Steps are timed by a
    global optimizer step hook, so its setup (adapter creation, load_models_gpu) lands in the first step,
    which is always a warm-up step.

    offloading (ComfyUI 0.33's lowest-memory setting): the weights wait in CPU memory and the node loads them
    with its offloading input on, streaming them to the GPU layer by layer in forward and recompute."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils
    try:
        from comfy_extras.nodes_train import TrainLoraNode
    except ImportError as error:
        raise PeerUnavailable(f"this ComfyUI has no comfy_extras.nodes_train.TrainLoraNode ({error})") from error
    chosen = dict(
        batch_size=[work.batch], steps=[max(1, warmup) + steps], grad_accumulation_steps=[1], learning_rate=[5e-4],
        rank=[LORA_RANK], optimizer=["AdamW"], loss_function=["MSE"], seed=[0], training_dtype=["bf16"],
        lora_dtype=["bf16"], algorithm=["LoRA"], gradient_checkpointing=[True], existing_lora=["[None]"],
        **({"offloading": [True]} if offloading else {}))
    extras = {}
    if work.pooled is not None:  # what CLIPTextEncodeSDXL puts next to the SDXL text embedding
        extras = {"pooled_output": work.pooled, "width": work.resolution, "height": work.resolution}
    positive = [[work.context, extras]]
    # The 0.3.75 node crashes on a single LATENT input (`multi_res` unbound), so the latent comes as a list of
    # equal-shape LATENTs, which it concatenates into one dataset; batch_size picks from them.
    latents = [{"samples": work.latents[i % work.batch][None]} for i in range(max(2, work.batch))]
    # before the model is built, so an input this ComfyUI lacks costs nothing
    arguments = _node_arguments(TrainLoraNode, dict(chosen, model=None, latents=latents, positive=[positive]))
    loss_output = [output.io_type for output in TrainLoraNode.define_schema().outputs].index("LOSS_MAP")

    device = work.device
    # bf16 weights: what ComfyUI loads for a bf16 checkpoint, and the node's own training dtype (no casts).
    base = work.build_comfy_model(torch.bfloat16)
    # Without offloading, offload_device = load device: unloading afterwards frees memory instead of copying the
    # weights to the CPU. With it, the weights start where ComfyUI keeps an unloaded model: in CPU memory.
    offload_device = torch.device("cpu") if offloading else device
    patcher = comfy.model_patcher.ModelPatcher(base.to(offload_device), load_device=device,
                                               offload_device=offload_device)
    if hasattr(patcher, "cached_patcher_init"):
        # 0.33's node trains on model.clone(force_deepcopy=True), which re-runs the loader that made the MODEL (a
        # core loader records itself here). A server would then hold the user's MODEL in CPU memory and the
        # node's copy on the GPU; re-building the bench's model would put both on the GPU. So its "loader" hands
        # back this patcher: the node trains on the one model, as 0.3.75's node does on its plain clone.
        patcher.cached_patcher_init = (lambda disable_dynamic=False: patcher, ())
    arguments["model"] = [patcher]

    clock = StepClock(device)
    hook = register_optimizer_step_post_hook(clock.mark)
    progress_was = comfy.utils.PROGRESS_BAR_ENABLED
    comfy.utils.PROGRESS_BAR_ENABLED = False  # its tqdm bar would interleave with our table
    work.reset_peak()
    clock.mark()
    try:
        out = TrainLoraNode.execute(**arguments)
        intervals = clock.intervals()
        losses = list(out.args[loss_output]["loss"])
    finally:
        hook.remove()
        comfy.utils.PROGRESS_BAR_ENABLED = progress_was
        comfy.model_management.unload_all_models()  # drops its loaded-model entry (holds the patcher)
    notes = ["bf16 weights + bf16 autocast, GC (every top-level block), AdamW, LoRA on every >=2-D weight, alpha 1"]
    if offloading:
        notes.append("offloading: weights streamed from CPU memory")
    if warmup < 1:
        notes.append("1 warm-up step forced: the node's setup is inside its first step")
    return {"intervals": intervals, "losses": losses, "setup_in_first_step": True, "warmup": max(1, warmup),
            "notes": notes}
