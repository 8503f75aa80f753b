import os

from ..trainer.errors import LeanLoRAError
from ..trainer.settings import MIXED_PRECISION, OPTIMIZERS, THIS_GPU, LoraSettings, MemorySettings
from .common import CATEGORY
from .labels import CARD_AUTO, CARDS, choices, memory_values, values_of
from .workers import chosen_devices, gpu_choices

NO_LORA = "none"  # continue_from: start a new LoRA


# Widgets behind the node's "Show Advanced" (web/leanlora.js marks them): with a card set, the plan picks them.
ADVANCED = {"advanced": True}


class LeanLoRAMemorySettings:
    @classmethod
    def INPUT_TYPES(cls):
        # A UI workflow stores widget values by position: `card` leads, then the widgets in the order workflows
        # saved before it have them (web/leanlora.js puts "manual" in front of such a workflow's values). All are
        # optional so that an API prompt without `card` (or any newer widget) still runs as it always did.
        return {
            "required": {},
            "optional": {
                "card": (list(CARDS), {"default": CARD_AUTO, "tooltip":
                    "The GPU to plan memory for. auto: this GPU; a size: plan for that card (to leave room for "
                    "other apps). manual: use every setting below exactly as set."}),
                "mixed_precision": (list(MIXED_PRECISION), {"default": "bf16", **ADVANCED, "tooltip":
                    "bf16 for RTX 30xx and newer; fp16 (with loss scaling) for older GPUs; no: fp32, the most "
                    "memory. A GPU without bf16 gets fp16 by itself."}),
                "gradient_checkpointing": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "Recompute activations in backward: much less VRAM, about 35% slower. With a card set it is "
                    "turned on only for the blocks the card needs."}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip":
                    "Images per step: faster per image, more VRAM. With a card set, a batch that does not fit "
                    "becomes gradient accumulation (same effective batch)."}),
                "gradient_accumulation": ("INT", {"default": 1, "min": 1, "max": 256, "tooltip":
                    "Batches added up per optimizer step: effective batch = batch_size x this, at the VRAM of "
                    "batch_size."}),
                "optimizer": (list(OPTIMIZERS), {"default": "AdamW", **ADVANCED, "tooltip":
                    "AdamW is the reference; 8bit ones: 4x less state; Lion: 3-10x lower learning rate. Prodigy "
                    "(learning rate 1.0), AdamWScheduleFree, CAME: pip install prodigyopt / schedulefree / "
                    "came-pytorch."}),
                "base_weights": (choices("base_weights"), {"default": "as loaded", **ADVANCED, "tooltip":
                    "fp8 halves the frozen weights' VRAM; streamed from CPU keeps them in RAM (least VRAM, "
                    "slower). With a card set they are chosen only where needed."}),
                "auto_fit": (choices("auto_fit"), {"default": "off", **ADVANCED, "tooltip":
                    "Read only when card is manual (older workflows). off: settings as given. A size or free "
                    "VRAM: trade speed for memory until the estimate fits."}),
                "latent_cache": (choices("latent_cache"), {"default": "RAM", "tooltip":
                    "Keep encoded images and captions between runs, so a re-queue skips the VAE and CLIP. RAM + "
                    "disk also survives restarts (models/leanlora_cache)."}),
                "attention": (choices("attention"), {"default": "auto", **ADVANCED, "tooltip":
                    "Leave on auto (ComfyUI's choice). chunked takes the least memory and is the slowest; "
                    "xformers only if it is installed."}),
                "checkpoint_depth": (choices("checkpoint_depth"), {"default": "per layer", **ADVANCED, "tooltip":
                    "With checkpointing: per layer takes the least memory on SDXL; per block stores fewer block "
                    "inputs. Same compute either way."}),
                "checkpoint_share": ("FLOAT", {"default": 1.0, "min": 0.05, "max": 1.0, "step": 0.05, **ADVANCED,
                    "tooltip": "With checkpointing: the share of blocks recomputed, those freeing the most memory "
                               "first. 1 = all (least memory); lower is faster."}),
                "fast_path": (choices("fast_path"), {"default": "CUDA graphs", **ADVANCED, "tooltip":
                    "CUDA graphs replay each step's GPU work: often 3-6x faster at batch 1. Where that is not "
                    "possible it says why and runs plain steps (off)."}),
                "activation_offload": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "Keep saved activations in CPU RAM instead of VRAM (about 0.5 GiB less on SDXL 1024). A card "
                    "setting turns it on when needed."}),
                "compile": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "torch.compile the repeated blocks: faster steps after about a minute of compiling per image "
                    "size. Needs a C++ compiler and Triton."}),
                "lora_weights": (choices("lora_weights"), {"default": "fp32", **ADVANCED, "tooltip":
                    "bf16 + stochastic rounding halves the LoRA's weight and gradient memory (matters at high "
                    "ranks). Needs mixed_precision bf16."}),
                "allocator": (choices("allocator"), {"default": "expandable segments", **ADVANCED, "tooltip":
                    "expandable segments: less fragmentation for this run (needs ComfyUI started with "
                    "--disable-cuda-malloc). as started: leave it."}),
                "stream_share": ("FLOAT", {"default": 1.0, "min": 0.05, "max": 1.0, "step": 0.05, **ADVANCED,
                    "tooltip": "With fp8 streamed from CPU: the share of the weights kept in CPU RAM, largest "
                               "first. 1 = all (least VRAM); lower is faster."}),
                # after the widgets saved workflows have: one saved before it keeps its values' positions
                "ram": (choices("ram"), {"default": "auto (free RAM)", "tooltip":
                    "The host RAM the run may take. auto: what the machine has free. A plan needing more is not "
                    "chosen; where none fits, training is refused before step 1."}),
                "selective_recompute": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "With checkpointing: keep matmul and attention outputs, recompute only elementwise ops (more "
                    "VRAM). With a card set it is the first thing given up for memory. Not with compile."}),
                "prefetch_streamed": ("BOOLEAN", {"default": False, **ADVANCED, "tooltip":
                    "With fp8 streamed from CPU: copy each streamed weight a layer ahead, overlapped with compute "
                    "(faster; a layer's weights more VRAM). With a card set it is on wherever weights stream."}),
                # last, so saved workflows keep their values' positions; only "this GPU" on a one-GPU machine
                "gpus": (gpu_choices(), {"default": THIS_GPU, **ADVANCED, "tooltip":
                    "More than one: the same run as one process per GPU (batch_size per GPU); this server's GPU "
                    "shows progress and samples, the others load the model from the loaders' files."}),
            },
        }

    RETURN_TYPES = ("MEMORY",)
    FUNCTION = "execute"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Pick your card (auto: this GPU) and leave the rest: before step 1 the plan gives up speed for "
                   "memory (checkpointing, 8-bit optimizer, fp8 weights, offload, streaming) only as far as the card "
                   "needs, and the report says what it chose. The other widgets are where the plan starts (right-click "
                   "> Show Advanced); manual takes them as given. A step that still runs out of memory takes the next "
                   "saver and is repeated.")

    @classmethod
    def VALIDATE_INPUTS(cls, gpus=THIS_GPU):
        # a workflow shared from a machine of several GPUs keeps its choice: refused in our words (what this machine
        # has, what to set) when queued, instead of ComfyUI's "Value not in list"
        try:
            chosen_devices(gpus)
        except LeanLoRAError as error:
            return str(error)
        return True

    def execute(self, **settings):
        # input names are MemorySettings' fields (and card); omitted optionals default
        chosen_devices(settings.get("gpus", THIS_GPU))  # an index this machine lacks is refused here
        return (MemorySettings(**memory_values(settings)),)


class LeanLoRALoraConfig:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "rank": ("INT", {"default": 16, "min": 1, "max": 256, "tooltip":
                    "LoRA dimension (network_dim). Higher learns more detail and makes bigger files; 8-32 is typical. "
                    "oft: the block size (LyCORIS' dim): each layer's outputs are rotated in blocks of rank rows "
                    "(smaller where rank does not divide a layer's width or exceeds its square root); 2 or more."}),
                "alpha": ("FLOAT", {"default": 16.0, "min": 0.01, "max": 1024.0, "step": 0.5, "tooltip":
                    "LoRA alpha (network_alpha): the update is scaled by alpha / rank. Equal to rank = scale 1. "
                    "oft: the constraint instead, the largest size of each layer's rotation (smaller = closer to the "
                    "base model; 16 hardly constrains)."}),
                "dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.9, "step": 0.01, "tooltip":
                    "Dropout on the LoRA input during training; a little (0.05-0.1) can reduce overfitting."}),
                "targets": (choices("targets"), {"default": "attention", "tooltip":
                    "Which UNet layers get LoRA: attention (q/k/v/out projections) or attention plus feed-forward."}),
            },
            # Optional so workflows saved before them still load (as "none", type lora): new inputs go last.
            "optional": {
                "continue_from": ([NO_LORA, *_lora_files()], {"default": NO_LORA, "tooltip":
                    "Train further from a LoRA in the loras folder (kohya's prev_lora_ckpt): kohya, ComfyUI, "
                    "diffusers/peft, LyCORIS or LeanLoRA .safetensors files. Its type, rank, alpha and targets must "
                    "match the ones above (the error says which differ); the optimizer starts fresh, and the new file "
                    "records the steps of both runs. none: start a new LoRA."}),
                "type": (choices("type"), {"default": "lora", "tooltip":
                    "The kind of adapter. lora: the usual one. loha, lokr: LyCORIS types that learn more per file "
                    "size (lokr files are the smallest). dora: LoRA that also learns each input's strength, often "
                    "closer to full fine-tuning; a bit slower. oft: rotates each layer's outputs (LyCORIS diag-oft), "
                    "keeping the base model's structure; rank is its block size, alpha its constraint. ComfyUI's "
                    "Load LoRA loads all five."}),
                "factor": ("INT", {"default": -1, "min": -1, "max": 1024, "tooltip":
                    "lokr only: how each layer's size is split into two factors. -1 splits as evenly as possible "
                    "(LyCORIS' default); a larger number such as 8 or 16 makes smaller files that learn less."}),
                "text_encoder_lr": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0, "step": 0.00001,
                    "round": False, "tooltip":
                    "SD1.5/SDXL only (kohya's text_encoder_lr). 0: off, the LoRA trains the diffusion model alone. "
                    "Above 0: it also trains a LoRA on the CLIP text encoder(s) at this rate, saved in the same file "
                    "(lora_te_ keys); about half the learning rate is usual (5e-5 next to 1e-4; Prodigy: 1.0). "
                    "Costs the text encoder's memory on the GPU and a text encoding per step; type lora only."}),
            },
        }

    RETURN_TYPES = ("LORA_CONFIG",)
    FUNCTION = "execute"
    CATEGORY = CATEGORY

    @classmethod
    def IS_CHANGED(cls, continue_from=NO_LORA, **_):
        """A file replaced under the same name is another starting point: run again."""
        path = _lora_path(continue_from) if continue_from != NO_LORA else None
        if path is None:
            return continue_from
        stat = os.stat(path)
        return f"{path}:{stat.st_size}:{stat.st_mtime_ns}"

    def execute(self, rank, alpha, dropout, targets, continue_from=NO_LORA, type="lora",  # noqa: A002 - the widget
                factor=-1, text_encoder_lr=0.0):
        path = None
        if continue_from != NO_LORA:
            path = _lora_path(continue_from)
            if path is None:
                raise LeanLoRAError(f"continue_from: {continue_from!r} is not in the loras folder any more; pick "
                                    "another LoRA (refresh the list with R) or none")
        labels = values_of({"targets": targets, "type": type})
        settings = LoraSettings(rank, alpha, dropout, labels["targets"], path, labels["type"], factor, text_encoder_lr)
        if path is not None:
            from ..trainer.lora.continue_from import check_file  # imports peft: only when a file is checked
            check_file(settings)  # unreadable, not a LoRA, other rank/alpha: fails here, before any encoding
        return (settings,)


# folder_paths is imported where it is used, so the node table (nodes/labels.py tests) loads without ComfyUI.
def _lora_files() -> list[str]:
    """The loras folder's .safetensors files; none while the folder is missing (Train recreates it)."""
    import folder_paths
    try:
        names = folder_paths.get_filename_list("loras")
    except OSError:  # ComfyUI's listing cache stats the folder: a deleted loras folder must not break the node
        return []
    return [name for name in names if name.lower().endswith(".safetensors")]


def _lora_path(name: str) -> str | None:
    import folder_paths
    return folder_paths.get_full_path("loras", name)
