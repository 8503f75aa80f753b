"""The three settings objects that flow between nodes (MEMORY, LORA_CONFIG) and into the trainer.

Validated on construction so bad values fail at the node that produced them, before any GPU work.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import LeanLoRAError
from .optimizers import OPTIMIZERS

MIXED_PRECISION = ("bf16", "fp16", "no")
BASE_WEIGHTS = ("as loaded", "fp8", "fp8 streamed from CPU")
LATENT_CACHE = ("RAM", "RAM + disk", "off")
ATTENTION = ("auto", "pytorch SDPA", "xformers", "chunked (sub-quadratic)")
FAST_PATH = ("CUDA graphs", "off")
LORA_WEIGHTS = ("fp32", "bf16 + stochastic rounding")
CHECKPOINT_DEPTH = ("per layer", "per block")
ALLOCATOR = ("expandable segments", "as started")
AUTO_FIT = ("off", "free VRAM", "2 GiB", "3 GiB", "4 GiB", "6 GiB", "8 GiB", "10 GiB", "12 GiB", "16 GiB", "24 GiB")
LORA_TARGETS = {
    # Module-name suffixes inside ComfyUI's (ldm) UNet; peft matches them against full module paths.
    "attention": ("to_q", "to_k", "to_v", "to_out.0"),
    "attention+feed-forward": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
}


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise LeanLoRAError(f"{field}: {message}")


def _require_choice(settings, field: str, choices) -> None:
    """`settings.<field>` must be one of `choices` (the node's dropdown; a hand-edited workflow may not be)."""
    value = getattr(settings, field)
    _require(value in choices, field, f"got {value!r}; choose one of {', '.join(choices)}")


@dataclass(frozen=True)
class MemorySettings:
    mixed_precision: str = "bf16"
    gradient_checkpointing: bool = True
    batch_size: int = 1
    gradient_accumulation: int = 1
    optimizer: str = "AdamW"
    base_weights: str = "as loaded"
    auto_fit: str = "off"
    latent_cache: str = "RAM"
    attention: str = "auto"
    fast_path: str = "CUDA graphs"
    allocator: str = "expandable segments"
    activation_offload: bool = False
    compile: bool = False
    lora_weights: str = "fp32"
    checkpoint_depth: str = "per layer"
    checkpoint_share: float = 1.0  # with checkpointing: the fraction of units recomputed (trainer/checkpointing.py)

    def __post_init__(self):
        _require_choice(self, "mixed_precision", MIXED_PRECISION)
        _require_choice(self, "optimizer", OPTIMIZERS)
        _require_choice(self, "base_weights", BASE_WEIGHTS)
        _require_choice(self, "auto_fit", AUTO_FIT)
        _require_choice(self, "latent_cache", LATENT_CACHE)
        _require_choice(self, "attention", ATTENTION)
        _require_choice(self, "fast_path", FAST_PATH)
        _require_choice(self, "allocator", ALLOCATOR)
        _require_choice(self, "lora_weights", LORA_WEIGHTS)
        _require(self.lora_weights == "fp32" or self.mixed_precision == "bf16", "lora_weights",
                 "bf16 LoRA weights need mixed_precision bf16 (fp16 loss scaling and fp32 runs keep fp32 weights)")
        _require_choice(self, "checkpoint_depth", CHECKPOINT_DEPTH)
        share = self.checkpoint_share
        _require(isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1,
                 "checkpoint_share", f"got {share!r}; use a fraction above 0 up to 1 (1 = every block recomputed, "
                 "0.5 = the half that frees the most memory per recompute)")
        _require(self.batch_size >= 1, "batch_size", f"got {self.batch_size}; use 1 or more")
        _require(self.gradient_accumulation >= 1, "gradient_accumulation",
                 f"got {self.gradient_accumulation}; use 1 or more")

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.gradient_accumulation

    @property
    def _share_text(self) -> str:
        return f", {self.checkpoint_share:.0%} of the blocks" if self.checkpoint_share < 1 else ""

    def describe(self) -> str:
        return (f"precision {self.mixed_precision}, gradient checkpointing "
                f"{f'on ({self.checkpoint_depth}{self._share_text})' if self.gradient_checkpointing else 'off'}, batch {self.batch_size} x accumulation "
                f"{self.gradient_accumulation} = effective batch {self.effective_batch}, optimizer {self.optimizer}, "
                f"base weights {self.base_weights}"
                + (", activations offloaded to CPU RAM" if self.activation_offload else "")
                + f", attention {self.attention}, fast path {self.fast_path}"
                + (", torch.compile" if self.compile else "")
                + (f", LoRA weights {self.lora_weights}" if self.lora_weights != "fp32" else "")
                + (f", auto-fit to {self.auto_fit}" if self.auto_fit != "off" else ""))


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "attention"

    def __post_init__(self):
        _require(1 <= self.rank <= 1024, "rank", f"got {self.rank}; use 1..1024 (4-32 is typical)")
        _require(self.alpha > 0, "alpha", f"got {self.alpha}; use a positive number (often equal to rank)")
        _require(0.0 <= self.dropout < 1.0, "dropout", f"got {self.dropout}; use 0 <= dropout < 1")
        _require_choice(self, "targets", LORA_TARGETS)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return LORA_TARGETS[self.targets]


LR_SCHEDULES = ("constant", "cosine", "linear", "cosine_with_restarts", "polynomial")  # diffusers' names


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 500
    learning_rate: float = 1e-4
    seed: int = 0
    output_name: str = "leanlora"
    lr_schedule: str = "constant"
    warmup_steps: int = 0

    def __post_init__(self):
        _require(self.steps >= 1, "steps", f"got {self.steps}; use 1 or more")
        _require_choice(self, "lr_schedule", LR_SCHEDULES)
        _require(0 <= self.warmup_steps < self.steps, "warmup_steps",
                 f"got {self.warmup_steps}; use 0 up to steps - 1 ({self.steps - 1})")
        _require(0 < self.learning_rate < 1, "learning_rate",
                 f"got {self.learning_rate}; use a small positive value such as 1e-4")
