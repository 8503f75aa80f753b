"""The one table between the UI's dropdown labels and the trainer's setting values.

Renaming a label here changes no training; workflows saved with a label keep loading as long as it stays listed
(an old label can map to the same value as its new name)."""
from ..trainer.errors import LeanLoRAError
from ..trainer.objective import LossKind, TimestepSampling
from ..trainer.settings import (AUTO_FIT_FREE_VRAM, AUTO_FIT_OFF, RAM_AUTO, AdapterKind, Allocator, Attention, AutoFit,
                                BaseWeights, CheckpointDepth, FastPath, LatentCache, LoraTargets, LoraWeights,
                                RamLimit)

CARD_SIZES_GIB = (2, 3, 4, 6, 8, 10, 12, 16, 24)
RAM_SIZES_GIB = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # Memory Settings' `ram`: the host RAM planned for
# Memory Settings' first widget: the card memory is planned for. "auto" (the card as it is, less ComfyUI's reserve) or
# a size sets auto-fit's budget and the auto_fit widget is not read; "manual" takes every widget as given, auto_fit
# included: what a workflow saved before this widget existed meant (it has no card value: see card_to_auto_fit).
CARD_AUTO, CARD_MANUAL = "auto (this GPU)", "manual"
CARDS = {CARD_AUTO: AUTO_FIT_FREE_VRAM, **{f"{gib} GiB": AutoFit(card_gib=gib) for gib in CARD_SIZES_GIB},
         CARD_MANUAL: None}
# Train's resume dropdown: these two, then the training states found in the loras folders
RESUME_OFF, RESUME_LATEST = "off", "latest state of this output name"

# field -> {label: value}, in dropdown order; the first label of a value is the one shown for it
LABELS = {
    "base_weights": {"as loaded": BaseWeights.AS_LOADED, "fp8": BaseWeights.FP8,
                     "fp8 streamed from CPU": BaseWeights.FP8_STREAMED},
    "auto_fit": {"off": AUTO_FIT_OFF, "free VRAM": AUTO_FIT_FREE_VRAM,
                 **{f"{gib} GiB": AutoFit(card_gib=gib) for gib in CARD_SIZES_GIB}},
    "ram": {"auto (free RAM)": RAM_AUTO, **{f"{gib} GiB": RamLimit(gib) for gib in RAM_SIZES_GIB}},
    "latent_cache": {"RAM": LatentCache.RAM, "RAM + disk": LatentCache.RAM_AND_DISK, "off": LatentCache.OFF},
    "attention": {"auto": Attention.AUTO, "pytorch SDPA": Attention.SDPA, "xformers": Attention.XFORMERS,
                  "chunked (sub-quadratic)": Attention.SUB_QUADRATIC},
    "fast_path": {"CUDA graphs": FastPath.CUDA_GRAPHS, "off": FastPath.OFF},
    "lora_weights": {"fp32": LoraWeights.FP32, "bf16 + stochastic rounding": LoraWeights.BF16_STOCHASTIC_ROUNDING},
    "checkpoint_depth": {"per layer": CheckpointDepth.LAYER, "per block": CheckpointDepth.BLOCK},
    "allocator": {"expandable segments": Allocator.EXPANDABLE_SEGMENTS, "as started": Allocator.AS_STARTED},
    "targets": {"attention": LoraTargets.ATTENTION, "attention+feed-forward": LoraTargets.ATTENTION_FEED_FORWARD},
    "type": {"lora": AdapterKind.LORA, "loha": AdapterKind.LOHA, "lokr": AdapterKind.LOKR, "dora": AdapterKind.DORA,
             "oft": AdapterKind.OFT},
    # Train's timesteps and loss (None: the model family's own sampling)
    "timestep_sampling": {"family default": None, "uniform": TimestepSampling.UNIFORM,
                          "logit-normal": TimestepSampling.LOGIT_NORMAL,
                          "shifted sigmoid": TimestepSampling.SHIFTED_SIGMOID},
    "loss": {"MSE": LossKind.MSE, "Huber": LossKind.HUBER, "smooth L1": LossKind.SMOOTH_L1},
}


def choices(field: str) -> list[str]:
    """The dropdown of `field`."""
    return list(LABELS[field])


def label_of(field: str, value) -> str:
    """The label the UI shows for a value of `field`."""
    return next(label for label, known in LABELS[field].items() if known == value)


def values_of(inputs: dict) -> dict:
    """A node's inputs with every labelled field turned into its value; other inputs pass through. An unknown
    label (a hand-edited or outdated workflow) is an error naming the field and its choices."""
    values = dict(inputs)
    for field, table in LABELS.items():
        if field in values:
            label = values[field]
            if label not in table:
                raise LeanLoRAError(f"{field}: got {label!r}; choose one of {', '.join(table)}")
            values[field] = table[label]
    return values


def memory_values(inputs: dict) -> dict:
    """Memory Settings' inputs as MemorySettings fields: the card (absent in workflows saved before it: manual)
    decides auto_fit unless it is manual, then every labelled field becomes its value."""
    inputs = dict(inputs)
    card = inputs.pop("card", CARD_MANUAL)
    if card not in CARDS:
        raise LeanLoRAError(f"card: got {card!r}; choose one of {', '.join(CARDS)}")
    values = values_of(inputs)
    if CARDS[card] is not None:
        values["auto_fit"] = CARDS[card]
    return values
