"""What ComfyUI's diffusion models share, for the family files: the prediction type, the repeated blocks of a
transformer, its Linear layers, and ComfyUI's own way of calling a diffusion model with its conditioning."""
from __future__ import annotations

import torch

import comfy.model_sampling


def prediction_of(model_sampling) -> str:
    """The SAI model spec's prediction type of a ComfyUI model_sampling: epsilon, v or flow."""
    if isinstance(model_sampling, comfy.model_sampling.CONST):
        return "flow"
    if isinstance(model_sampling, comfy.model_sampling.V_PREDICTION):
        return "v"
    return "epsilon"


def repeated_blocks(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    """The highest repeated children: (path, block) of every ModuleList/Sequential entry whose list holds at least
    two blocks of one class, searched from the top and not inside a block found (ComfyUI's trainer checkpoints
    the same). A transformer's layers; a UNet's levels."""
    found = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) and len(child) >= 2 \
                and len({type(entry) for entry in child}) == 1 and any(True for _ in child[0].parameters()):
            found += [(f"{path}.{index}", entry) for index, entry in enumerate(child)]
        else:
            found += repeated_blocks(child, f"{path}.")
    return found


def linear_paths(unet: torch.nn.Module, blocks: list[tuple[str, torch.nn.Module]]) -> list[str]:
    """Full paths of the Linear layers inside `blocks` (peft matches a full path exactly)."""
    return [f"{path}.{name}" for path, block in blocks for name, layer in block.named_modules()
            if isinstance(layer, torch.nn.Linear)]


def linear_cost(unit: torch.nn.Module, tokens: int) -> tuple[int, int]:
    """A transformer block's checkpointing cost, roughly: each Linear keeps an output-sized activation for
    backward and costs its weight's multiply-adds per token (attention's own terms grow alike for blocks of one
    width, so they do not change the order among them)."""
    linears = [m for m in unit.modules() if isinstance(m, torch.nn.Linear)]
    return tokens * sum(m.out_features for m in linears), tokens * sum(m.weight.numel() for m in linears)


def call_diffusion_model(unet: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                         cond: dict[str, torch.Tensor], transformer_options: dict) -> torch.Tensor:
    """ComfyUI's BaseModel._apply_model after its input scaling: the cross-attention conditioning as `context`,
    every other conditioning entry as a keyword, floating ones in the model's dtype, integer ones (token counts,
    ids) as they are."""
    dtype = unet.dtype
    extra = {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items() if k != "c_crossattn"}
    context = cond.get("c_crossattn")
    return unet(x.to(dtype), timestep, context=None if context is None else context.to(dtype),
                transformer_options=transformer_options, **extra)
