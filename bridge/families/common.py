"""What ComfyUI's diffusion models share, for the family files: the prediction type, the repeated blocks of a
transformer, its Linear layers, ComfyUI's own way of calling a diffusion model with its conditioning, and
TransformerFamily, what the DiT families have in common."""
from __future__ import annotations

import torch

import comfy.model_sampling

from ..trainer_api import CheckpointDepth, LoraTargets, SampleDefaults, TimestepSampling, most_memory_per_flop_first


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


def rows_cost(linears: list[tuple[torch.nn.Linear, int]]) -> tuple[int, int]:
    """linear_cost where each Linear runs on its own number of rows (tokens): (activation elements checkpointing
    the unit frees, multiply-adds its recompute costs)."""
    return (sum(rows * layer.out_features for layer, rows in linears),
            sum(rows * layer.weight.numel() for layer, rows in linears))


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    return any(path == prefix or path.startswith(f"{prefix}.") for prefix in prefixes)


def empty_latent(latent_format, height: int, width: int) -> torch.Tensor:
    """A zero latent of a model's own format (ComfyUI's latent_format): its channels, and a time axis of one frame
    where its latents are video (Wan, Qwen-Image)."""
    return torch.zeros(1, latent_format.latent_channels, *(1,) * (latent_format.latent_dimensions - 2), height, width)


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


class TransformerFamily:
    """A diffusion transformer as ComfyUI builds it: its repeated blocks (`blocks`, the subclass's) are the
    checkpoint, compile, upcast and stream units; LoRA goes on the module-name suffixes of `LORA_TARGETS`; the
    model is called as ComfyUI's sampler calls it; noise levels are drawn logit-normal over its flow schedule;
    ComfyUI names its LoRA keys by the model's own paths. A family file says what differs."""
    LORA_TARGETS: dict[LoraTargets, tuple[str, ...]] = {}
    text_tokens = 0  # text tokens each block attends over beside the image's (the checkpointing cost model)
    timestep_sampling = TimestepSampling.LOGIT_NORMAL  # kohya's and ai-toolkit's flow-model default
    sequence_conditioning = ()  # captions of other lengths never share a batch (cache.stack_shape)
    sample_defaults = SampleDefaults(sampler="euler", scheduler="simple", size_multiple=16)
    graph_blocker = None
    text_conditioning: dict = {}

    def blocks(self, unet: torch.nn.Module) -> list[torch.nn.Module]:
        raise NotImplementedError

    def unsupported(self, base) -> str | None:
        return None

    def prepare(self, unet: torch.nn.Module) -> None:
        pass  # blocks that add out of place recompute as they ran

    def lora_targets(self, unet: torch.nn.Module, targets: LoraTargets) -> tuple[str, ...]:
        return self.LORA_TARGETS[targets]

    # The cost model's rows (tokens) per Linear, by the Linear's path inside its block, matched at a dot: the
    # modulations read the timestep's vector (one row per image at any size); a two-stream block's text and image
    # layers run on their own stream's tokens; every other Linear on the block's whole sequence (unit_tokens).
    PER_IMAGE_LINEARS: tuple[str, ...] = ()
    TEXT_LINEARS: tuple[str, ...] = ()
    IMAGE_LINEARS: tuple[str, ...] = ()

    def checkpoint_units(self, unet: torch.nn.Module, depth: CheckpointDepth = CheckpointDepth.LAYER,
                         latent_size: tuple[int, int] | None = None) -> list[torch.nn.Module]:
        units = self.blocks(unet)
        if latent_size is None:
            return units
        return most_memory_per_flop_first(units, [rows_cost(linears) for _, linears in
                                                  self.unit_linears(unet, latent_size)])

    def latent_patch(self, unet: torch.nn.Module) -> tuple[int, int]:
        """Latent positions per image token (height, width): what checkpoint_units counts tokens with."""
        return unet.patch_size, unet.patch_size

    def unit_tokens(self, unet: torch.nn.Module, units: list[torch.nn.Module], image: int) -> list[tuple[int, int]]:
        """(image tokens, text tokens) in each unit's sequence: every block sees both, unless a family's blocks
        differ (Z-Image's refiners run on one stream each)."""
        return [(image, self.text_tokens)] * len(units)

    def linear_rows(self, path: str, image: int, text: int) -> int:
        """The rows a Linear at `path` inside a block with `image` and `text` tokens multiplies per image."""
        if _under(path, self.PER_IMAGE_LINEARS):
            return 1
        if _under(path, self.TEXT_LINEARS):
            return text
        if _under(path, self.IMAGE_LINEARS):
            return image
        return image + text

    def unit_linears(self, unet: torch.nn.Module, latent_size: tuple[int, int]
                     ) -> list[tuple[torch.nn.Module, list[tuple[torch.nn.Linear, int]]]]:
        """Each block with its Linears and the rows each multiplies at `latent_size`: the one cost model that both
        ranks the checkpoint units (memory freed per recomputed multiply-add) and the streamed layers
        (multiply-adds per weight byte, stream_rows)."""
        patch_h, patch_w = self.latent_patch(unet)
        image = (latent_size[0] // patch_h) * (latent_size[1] // patch_w)
        units = self.blocks(unet)
        return [(unit, [(layer, self.linear_rows(path, *tokens)) for path, layer in unit.named_modules()
                        if isinstance(layer, torch.nn.Linear)])
                for unit, tokens in zip(units, self.unit_tokens(unet, units, image))]

    def stream_rows(self, unet: torch.nn.Module, latent_size: tuple[int, int]) -> list[tuple[torch.nn.Linear, int]]:
        """Every block Linear with its rows at `latent_size`: its multiply-adds per weight element, i.e. how much
        compute a streamed copy of its weight hides behind (bridge/cast_weights.streamed_layers streams the most
        first)."""
        return [pair for _, linears in self.unit_linears(unet, latent_size) for pair in linears]

    def compile_units(self, unet: torch.nn.Module, scope: str = "layers") -> list[torch.nn.Module]:
        return self.blocks(unet)

    def upcast_groups(self, unet: torch.nn.Module):
        return self.blocks(unet)

    def predict(self, unet, x, timestep, cond, transformer_options):
        return call_diffusion_model(unet, x, timestep, cond, transformer_options)

    def set_conv_layout(self, base, unet, device, compute_dtype) -> str | None:
        return None

    def kohya_module_names(self, base) -> dict[str, str] | None:
        return None  # ComfyUI reads lora_unet_<its path> (and diffusion_model.<path>) for every model

    def diffusers_module_names(self, base) -> dict[str, str] | None:
        return None

    def resolution_shift(self, model_sampling, latent_size: tuple[int, int]) -> float:
        return 1.0  # a fixed shift (ComfyUI's AuraFlow-style schedules): the table as it is at every size
