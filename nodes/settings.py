import os

from ..trainer.errors import LeanLoRAError
from ..trainer.lora_import import check_file
from ..trainer.settings import MIXED_PRECISION, OPTIMIZERS, LoraSettings, MemorySettings
from .common import CATEGORY
from .labels import choices, values_of

NO_LORA = "none"  # continue_from: start a new LoRA


class LeanLoRAMemorySettings:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "mixed_precision": (list(MIXED_PRECISION), {"default": "bf16", "tooltip":
                    "bf16: half the activation memory, no loss scaling needed (RTX 30xx and newer). fp16: for older "
                    "GPUs, with dynamic loss scaling (overflowed steps are skipped and counted). no: full fp32."}),
                "gradient_checkpointing": ("BOOLEAN", {"default": True, "tooltip":
                    "Recompute activations during backward instead of storing them: much less VRAM (SDXL 1024: 5.7 instead "
                    "of 10.5 GiB), ~35% slower steps (the forward pass runs twice)."}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip":
                    "Images per forward pass. More is faster per image but needs more VRAM."}),
                "gradient_accumulation": ("INT", {"default": 1, "min": 1, "max": 256, "tooltip":
                    "Add up gradients of this many batches before each optimizer step: effective batch = "
                    "batch_size x gradient_accumulation at the VRAM cost of batch_size."}),
                "optimizer": (list(OPTIMIZERS), {"default": "AdamW", "tooltip":
                    "AdamW: the reference. AdamW8bit / Lion8bit (bitsandbytes): optimizer state in 8 bits, ~4x "
                    "smaller. PagedAdamW8bit: state can spill to CPU RAM. Lion: one moment instead of two (use a "
                    "3-10x lower learning rate). Adafactor: factored state, smallest. Without bitsandbytes the "
                    "8-bit choices fall back to AdamW/Lion and the report says so."}),
                "base_weights": (choices("base_weights"), {"default": "as loaded", "tooltip":
                    "fp8: store the frozen checkpoint weights of the training copy in fp8 (half of fp16), upcast "
                    "layer by layer while computing. fp8 streamed from CPU: also keep those weights in CPU RAM "
                    "and copy each layer to the GPU just before it runs (least VRAM, slower; CUDA only)."}),
                "auto_fit": (choices("auto_fit"), {"default": "off", "tooltip":
                    "Before step 1, measure the memory these settings need and, if it exceeds the budget, take "
                    "the next memory saver (batch -> accumulation, bf16, checkpointing, 8-bit optimizer, fp8, activation offload, "
                    "streaming) until it fits. 'free VRAM' = what the GPU has free now. The report says what "
                    "was chosen and why."}),
                "latent_cache": (choices("latent_cache"), {"default": "RAM", "tooltip":
                    "Keep image latents and caption embeddings between runs, keyed by file content, crop and "
                    "encoder: re-queuing with other settings skips the VAE/CLIP, and only changed images are "
                    "re-encoded. RAM: up to 2 GiB in this ComfyUI process. RAM + disk: also in "
                    "models/leanlora_cache (survives restarts). off: encode every run."}),
                "attention": (choices("attention"), {"default": "auto", "tooltip":
                    "Attention kernel used while training. auto: what ComfyUI picked at start-up. pytorch SDPA: "
                    "flash / memory-efficient kernels where the GPU has them. xformers: only if installed for "
                    "your torch on an NVIDIA GPU. chunked: sub-quadratic attention in slices, least memory, slowest."}),
            },
            # Optional so workflows saved before these existed still load with the defaults; a new one goes last (a
            # UI workflow stores its widget values by position).
            "optional": {
                "checkpoint_depth": (choices("checkpoint_depth"), {"default": "per layer", "tooltip":
                    "With gradient checkpointing: recompute each ResBlock and each single transformer layer (per "
                    "layer: least memory during backward on SDXL, whose deep blocks stack 10 layers) or each whole "
                    "transformer block (per block: fewer stored block inputs, more memory while one block is "
                    "recomputed). Same compute either way."}),
                "checkpoint_share": ("FLOAT", {"default": 1.0, "min": 0.05, "max": 1.0, "step": 0.05, "tooltip":
                    "With gradient checkpointing: the fraction of blocks recomputed. 1 = all (least memory). Lower "
                    "keeps more activations in VRAM and runs faster: the blocks that free the most memory per "
                    "recomputed FLOP go first (SDXL 1024, estimated: 0.4 frees about half the activation memory for 42% of "
                    "the extra compute). With checkpointing off, auto_fit and out-of-memory recovery try 0.2, 0.4, 0.6 "
                    "and 0.8 before all blocks."}),
                "fast_path": (choices("fast_path"), {"default": "CUDA graphs", "tooltip":
                    "CUDA graphs: record each step's GPU work once per image size and replay it, removing the "
                    "Python overhead that dominates small batches (often 3-6x faster steps). Falls back to normal "
                    "steps, saying why, where capture is not possible. off: plain PyTorch steps."}),
                "activation_offload": ("BOOLEAN", {"default": False, "tooltip":
                    "Keep what the forward pass saves for backward (with checkpointing: each block's input) in "
                    "pinned CPU RAM instead of VRAM. Saves ~0.5 GiB on SDXL at 1024; the copies run beside the "
                    "compute (~6 ms per SDXL step on an H200)."}),
                "compile": ("BOOLEAN", {"default": False, "tooltip":
                    "torch.compile the diffusion model (fused kernels; needs a C++ compiler, and Triton on the "
                    "GPU). Each repeated block (transformer layer; ResBlock, except at the deepest levels' widest "
                    "channel count, where compiling costs more time than it saves) is compiled once per batch shape and shared by its twins, before step 1, and the report says how long it "
                    "took; another image size (bucket) or a smaller last batch compiles once more when it first "
                    "comes. Where compiling fails the report says why and training runs uncompiled. Measured on "
                    "SDXL 1024 (H200): 33-62 s of compiling the first time (about 9 s after a restart, 2 s when "
                    "re-queued), then at batch 8 14% faster steps and 7 GiB less memory; with fp8 weights, "
                    "checkpointing and offload (lean) 15-24% faster steps."}),
                "lora_weights": (choices("lora_weights"), {"default": "fp32", "tooltip":
                    "fp32: the usual master weights. bf16 + stochastic rounding: LoRA weights and gradients in half "
                    "the memory (matters at high ranks: ~0.7 GiB at SDXL rank 128); each update is rounded up or "
                    "down at random so small steps still add up; ~10% faster steps. The optimizer steps fp32 "
                    "copies of a few million weights at a time. Needs mixed_precision bf16."}),
                "allocator": (choices("allocator"), {"default": "expandable segments", "tooltip":
                    "expandable segments: PyTorch's allocator grows one mapping instead of many fixed blocks, so "
                    "reserved VRAM stays close to what is used (less fragmentation), for this run only. Needs "
                    "PyTorch's native allocator (start ComfyUI with --disable-cuda-malloc); otherwise the report "
                    "says it was not applied. as started: leave the allocator as it is."}),
                "stream_share": ("FLOAT", {"default": 1.0, "min": 0.05, "max": 1.0, "step": 0.05, "tooltip":
                    "With base weights 'fp8 streamed from CPU': the share of the fp8 weights kept in CPU RAM and "
                    "copied in layer by layer, the largest layers first; the rest stays in VRAM. 1 = all (least "
                    "VRAM). Each streamed weight crosses PCIe twice per step, so a lower share is faster. auto_fit "
                    "and out-of-memory recovery stream 0.2, 0.4, 0.6 and 0.8 before all of them."}),
            },
        }

    RETURN_TYPES = ("MEMORY",)
    FUNCTION = "execute"
    CATEGORY = CATEGORY
    DESCRIPTION = ("If a step runs out of memory anyway, training frees memory, takes the next memory saver "
                   "(batch -> accumulation, mixed precision, checkpointing, 8-bit optimizer, fp8 weights, activation "
                   "offload, streamed weights) and "
                   "repeats that step; the report lists each recovery.")

    def execute(self, **settings):
        # input names are MemorySettings' fields; omitted optionals default
        return (MemorySettings(**values_of(settings)),)


class LeanLoRALoraConfig:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "rank": ("INT", {"default": 16, "min": 1, "max": 256, "tooltip":
                    "LoRA dimension (network_dim). Higher learns more detail and makes bigger files; 8-32 is typical."}),
                "alpha": ("FLOAT", {"default": 16.0, "min": 0.01, "max": 1024.0, "step": 0.5, "tooltip":
                    "LoRA alpha (network_alpha): the update is scaled by alpha / rank. Equal to rank = scale 1."}),
                "dropout": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 0.9, "step": 0.01, "tooltip":
                    "Dropout on the LoRA input during training; a little (0.05-0.1) can reduce overfitting."}),
                "targets": (choices("targets"), {"default": "attention", "tooltip":
                    "Which UNet layers get LoRA: attention (q/k/v/out projections) or attention plus feed-forward."}),
            },
            # Optional so workflows saved before it existed still load (as "none").
            "optional": {
                "continue_from": ([NO_LORA, *_lora_files()], {"default": NO_LORA, "tooltip":
                    "Train further from a LoRA in the loras folder (kohya's prev_lora_ckpt): kohya, ComfyUI, "
                    "diffusers/peft or LeanLoRA .safetensors files. Its rank, alpha and targets must match the "
                    "ones above (the error says which differ); the optimizer starts fresh, and the new file "
                    "records the steps of both runs. none: start a new LoRA."}),
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

    def execute(self, rank, alpha, dropout, targets, continue_from=NO_LORA):
        path = None
        if continue_from != NO_LORA:
            path = _lora_path(continue_from)
            if path is None:
                raise LeanLoRAError(f"continue_from: {continue_from!r} is not in the loras folder any more; pick "
                                    "another LoRA (refresh the list with R) or none")
        settings = LoraSettings(rank, alpha, dropout, values_of({"targets": targets})["targets"], path)
        if path is not None:
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
