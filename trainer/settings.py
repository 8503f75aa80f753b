"""The three settings objects that flow between nodes (MEMORY, LORA_CONFIG) and into the trainer.

Validated on construction so bad values fail at the node that produced them, before any GPU work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from .errors import LeanLoRAError
from .captions import CaptionOptions
from .objective import DEFAULT_SHIFT, LossKind, TimestepSampling
from .optimizers import OPTIMIZERS

def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise LeanLoRAError(f"{field}: {message}")


def _require_choice(settings, field: str, choices) -> None:
    """`settings.<field>` must be one of `choices` (the node's dropdown; a hand-edited workflow may not be)."""
    value = getattr(settings, field)
    _require(value in choices, field, f"got {value!r}; choose one of {', '.join(choices)}")


def _require_share(settings, field: str, meaning: str) -> None:
    """`settings.<field>` must be a fraction in (0, 1]; `meaning` says what its ends do."""
    share = getattr(settings, field)
    _require(isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1, field,
             f"got {share!r}; use a fraction above 0 up to 1 ({meaning})")


def _require_member(settings, field: str, kind: type[Enum]) -> None:
    """`settings.<field>` becomes a member of `kind`; a string is taken as a member's value."""
    value = getattr(settings, field)
    if not isinstance(value, kind):
        values = [member.value for member in kind]
        _require(isinstance(value, str) and value in values, field,
                 f"got {value!r}; choose one of {', '.join(values)}")
        object.__setattr__(settings, field, kind(value))


# Values, not UI wording: nodes/labels.py maps each dropdown label to one of these (renaming a label there changes
# nothing here). A string equal to a value is accepted too (MemorySettings(fast_path="off")).
MIXED_PRECISION = ("bf16", "fp16", "no")


class BaseWeights(Enum):
    """How the frozen base weights of the training copy are stored."""
    AS_LOADED = "as_loaded"
    FP8 = "fp8"
    FP8_STREAMED = "fp8_streamed"  # fp8, kept in CPU RAM and copied to the GPU layer by layer

    @property
    def fp8(self) -> bool:
        return self is not BaseWeights.AS_LOADED

    @property
    def streamed(self) -> bool:
        return self is BaseWeights.FP8_STREAMED


class LatentCache(Enum):
    RAM = "ram"
    RAM_AND_DISK = "ram_and_disk"
    OFF = "off"


class Attention(Enum):
    AUTO = "auto"  # the kernel ComfyUI picked at start-up
    SDPA = "sdpa"
    XFORMERS = "xformers"
    SUB_QUADRATIC = "sub_quadratic"


class FastPath(Enum):
    """Whether steps are replayed from CUDA graphs (the eager step is the fallback either way)."""
    CUDA_GRAPHS = "cuda_graphs"
    OFF = "off"


class LoraWeights(Enum):
    FP32 = "fp32"
    BF16_STOCHASTIC_ROUNDING = "bf16_stochastic_rounding"


class CheckpointDepth(Enum):
    """The unit gradient checkpointing recomputes: each transformer layer, or each whole transformer block."""
    LAYER = "layer"
    BLOCK = "block"


class Allocator(Enum):
    EXPANDABLE_SEGMENTS = "expandable_segments"
    AS_STARTED = "as_started"


@dataclass(frozen=True)
class AutoFit:
    """The budget settings are fitted to before step 1: off, a card of `card_gib` GiB, or the VRAM free now."""
    card_gib: float | None = None
    free_vram: bool = False

    def __post_init__(self):
        _require(self.card_gib is None or (isinstance(self.card_gib, (int, float)) and self.card_gib > 0),
                 "auto_fit", f"got a card of {self.card_gib!r} GiB; use a positive size")
        _require(not (self.free_vram and self.card_gib is not None), "auto_fit",
                 "choose a card size or the free VRAM, not both")

    @property
    def on(self) -> bool:
        return self.free_vram or self.card_gib is not None

    def describe(self) -> str:
        return "the free VRAM" if self.free_vram else f"{self.card_gib:g} GiB" if self.card_gib else "off"


AUTO_FIT_OFF = AutoFit()
AUTO_FIT_FREE_VRAM = AutoFit(free_vram=True)


@dataclass(frozen=True)
class RamLimit:
    """The host RAM a run may take (trainer/memory/host_ram.py plans it as auto-fit plans the card): `gib` GiB, or
    None: what the machine has free when training starts (MemAvailable) beside what the run holds already."""
    gib: float | None = None

    def __post_init__(self):
        _require(self.gib is None or (_number(self.gib) and self.gib > 0), "ram",
                 f"got {self.gib!r} GiB; use a positive size, or auto (what the machine has free)")

    def describe(self) -> str:
        return "the free RAM" if self.gib is None else f"{self.gib:g} GiB"


RAM_AUTO = RamLimit()


class LoraTargets(Enum):
    """Which layers get LoRA; the values are also what the LoRA file's metadata records. Which modules those are
    is the model family's knowledge (ModelFamily.lora_targets)."""
    ATTENTION = "attention"
    ATTENTION_FEED_FORWARD = "attention+feed-forward"


class AdapterKind(Enum):
    """The adapter type trained on each target layer (trainer/lora/: one file per type); the values are the LoRA
    Config's `type` and what the resume state records."""
    LORA = "lora"
    LOHA = "loha"
    LOKR = "lokr"
    DORA = "dora"
    OFT = "oft"


THIS_GPU = "this GPU"  # Memory Settings' gpus: the server's own GPU, one process


@dataclass(frozen=True)
class MemorySettings:
    mixed_precision: str = "bf16"
    gradient_checkpointing: bool = True
    batch_size: int = 1
    gradient_accumulation: int = 1
    optimizer: str = "AdamW"
    base_weights: BaseWeights = BaseWeights.AS_LOADED
    auto_fit: AutoFit = AUTO_FIT_OFF
    latent_cache: LatentCache = LatentCache.RAM
    attention: Attention = Attention.AUTO
    fast_path: FastPath = FastPath.CUDA_GRAPHS
    allocator: Allocator = Allocator.EXPANDABLE_SEGMENTS
    activation_offload: bool = False
    compile: bool = False
    lora_weights: LoraWeights = LoraWeights.FP32
    checkpoint_depth: CheckpointDepth = CheckpointDepth.LAYER
    checkpoint_share: float = 1.0  # with checkpointing: the fraction of units recomputed (trainer/step/checkpointing.py)
    # with checkpointing: keep matmul, convolution and attention outputs, recompute only the cheap ops between them
    selective_recompute: bool = False
    stream_share: float = 1.0  # with fp8 streamed: the fraction of the fp8 weights kept in CPU RAM, largest first
    # with fp8 streamed: each streamed weight copied a layer ahead on a copy stream (step/weight_prefetch.py)
    prefetch_streamed: bool = False
    ram: RamLimit = RAM_AUTO  # the host RAM the run may take (memory/host_ram.py)
    # the Train node's GPUs (nodes/workers.py): "this GPU", "all N GPUs" or CUDA indices "0,1"; the trainer runs
    # one process either way (its data-parallel world is a launcher's or the node's, trainer/distributed.py)
    gpus: str = THIS_GPU

    def __post_init__(self):
        _require_choice(self, "mixed_precision", MIXED_PRECISION)
        _require_choice(self, "optimizer", OPTIMIZERS)
        _require_member(self, "base_weights", BaseWeights)
        _require(isinstance(self.auto_fit, AutoFit), "auto_fit", f"got {self.auto_fit!r}; use an AutoFit")
        _require(isinstance(self.ram, RamLimit), "ram", f"got {self.ram!r}; use a RamLimit (auto or N GiB)")
        _require_member(self, "latent_cache", LatentCache)
        _require_member(self, "attention", Attention)
        _require_member(self, "fast_path", FastPath)
        _require_member(self, "allocator", Allocator)
        _require_member(self, "lora_weights", LoraWeights)
        _require(self.lora_weights is LoraWeights.FP32 or self.mixed_precision == "bf16", "lora_weights",
                 "bf16 LoRA weights need mixed_precision bf16 (fp16 loss scaling and fp32 runs keep fp32 weights)")
        _require(self.lora_weights is LoraWeights.FP32 or self.optimizer not in ("Prodigy", "AdamWScheduleFree"),
                 "lora_weights", "bf16 LoRA weights are stepped in chunks, one optimizer step each, which "
                 f"{self.optimizer}'s whole-model statistics (Prodigy's step size, schedule-free's average) "
                 "cannot take: set lora_weights to fp32 or choose another optimizer")
        _require_member(self, "checkpoint_depth", CheckpointDepth)
        _require_share(self, "checkpoint_share",
                       "1 = every block recomputed, 0.5 = the half that frees the most memory per recompute")
        _require_share(self, "stream_share", "1 = every fp8 weight streamed from CPU RAM, 0.3 = the largest layers "
                       "holding 30% of them, the rest stays in VRAM")
        _require(self.batch_size >= 1, "batch_size", f"got {self.batch_size}; use 1 or more")
        _require(self.gradient_accumulation >= 1, "gradient_accumulation",
                 f"got {self.gradient_accumulation}; use 1 or more")

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.gradient_accumulation

    @property
    def _share_text(self) -> str:
        return f", {self.checkpoint_share:.0%} of the blocks" if self.checkpoint_share < 1 else ""

    @property
    def _selective_text(self) -> str:
        return ", selective: matmul/attention outputs kept" if self.selective_recompute else ""

    def describe(self) -> str:
        """The settings in the report's words (its own phrases: the UI's labels live in nodes/labels.py)."""
        depth = f"per {self.checkpoint_depth.value}"
        return (f"precision {self.mixed_precision}, gradient checkpointing "
                f"{f'on ({depth}{self._share_text}{self._selective_text})' if self.gradient_checkpointing else 'off'}, "
                f"batch {self.batch_size} x accumulation "
                f"{self.gradient_accumulation} = effective batch {self.effective_batch}, optimizer {self.optimizer}, "
                + _BASE_WEIGHTS_TEXT[self.base_weights]
                + (f" ({self.stream_share:.0%} of them)"
                   if self.base_weights.streamed and self.stream_share < 1 else "")
                + (", fetched a layer ahead" if self.base_weights.streamed and self.prefetch_streamed else "")
                + (", activations offloaded to CPU RAM" if self.activation_offload else "")
                + f", {_ATTENTION_TEXT[self.attention]}, {_FAST_PATH_TEXT[self.fast_path]}"
                + (", torch.compile" if self.compile else "")
                + (", LoRA weights bf16 + stochastic rounding" if self.lora_weights is not LoraWeights.FP32 else "")
                + (f", auto-fit to {self.auto_fit.describe()}" if self.auto_fit.on else "")
                + (f", host RAM limit {self.ram.describe()}" if self.ram.gib is not None else ""))


_BASE_WEIGHTS_TEXT = {BaseWeights.AS_LOADED: "base weights as loaded", BaseWeights.FP8: "base weights fp8",
                      BaseWeights.FP8_STREAMED: "base weights fp8 streamed from CPU"}
_ATTENTION_TEXT = {Attention.AUTO: "attention auto", Attention.SDPA: "attention pytorch SDPA",
                   Attention.XFORMERS: "attention xformers",
                   Attention.SUB_QUADRATIC: "attention chunked (sub-quadratic)"}
_FAST_PATH_TEXT = {FastPath.CUDA_GRAPHS: "fast path CUDA graphs", FastPath.OFF: "fast path off"}


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: LoraTargets = LoraTargets.ATTENTION
    continue_from: str | None = None  # a LoRA .safetensors to start from (kohya's prev_lora_ckpt; lora/continue_from.py)
    type: AdapterKind = AdapterKind.LORA
    factor: int = -1  # LoKr's Kronecker factor (LyCORIS' `factor`): -1 splits each dimension as evenly as it can
    # 0: off (the diffusion model alone, as before). Else kohya's text_encoder_lr: a LoRA on the CLIP text
    # encoder(s) of SD1.x/SDXL too, stepped at this rate (trainer/text_encoder.py)
    text_encoder_lr: float = 0.0

    def __post_init__(self):
        _require(1 <= self.rank <= 1024, "rank", f"got {self.rank}; use 1..1024 (4-32 is typical)")
        _require(self.alpha > 0, "alpha", f"got {self.alpha}; use a positive number (often equal to rank)")
        _require(0.0 <= self.dropout < 1.0, "dropout", f"got {self.dropout}; use 0 <= dropout < 1")
        _require_member(self, "targets", LoraTargets)
        _require_member(self, "type", AdapterKind)
        _require(isinstance(self.factor, int) and not isinstance(self.factor, bool)
                 and (self.factor == -1 or self.factor >= 1), "factor",
                 f"got {self.factor!r}; use -1 (split each layer's size as evenly as possible) or a whole number such "
                 "as 4, 8 or 16")
        path = self.continue_from
        if path is not None:
            _require(isinstance(path, str) and path.lower().endswith(".safetensors"), "continue_from",
                     f"got {path!r}; use the path of a .safetensors LoRA (pickled .pt/.ckpt files are never read)")
            _require(Path(path).is_file(), "continue_from", f"{path!r} is not a file; pick an existing LoRA")
        rate = self.text_encoder_lr
        _require(_number(rate) and 0 <= rate <= 10, "text_encoder_lr",
                 f"got {rate!r}; use 0 (off: the diffusion model alone) or a small rate such as 5e-5 (about half the "
                 "learning rate)")
        _require(not rate or self.type is AdapterKind.LORA, "text_encoder_lr",
                 f"got {rate:g} with type {getattr(self.type, 'value', self.type)}: the text encoder is trained with "
                 "plain LoRA only; set type to lora, or text_encoder_lr to 0")

    @property
    def trains_text_encoder(self) -> bool:
        return self.text_encoder_lr > 0


LR_SCHEDULES = ("constant", "cosine", "linear", "cosine_with_restarts", "polynomial")  # diffusers' names


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 500
    learning_rate: float = 1e-4
    seed: int = 0
    output_name: str = "leanlora"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    save_every_steps: int = 0  # 0: only the final file; N: also <name>_step<N>.safetensors + its training state
    keep_last_saves: int = 0  # of those step files, keep the last K (0: all)
    resume_from: Path | None = None  # a training state (training_state.py) to go on from
    validation_fraction: float = 0.0  # 0: off; else this share of the images is held out for validation loss
    validation_every_steps: int = 50  # validation loss every N steps (and at the end); 0: at the end only
    # Timesteps and loss (trainer/objective.py); the defaults train exactly as runs before these existed
    noise_offset: float = 0.0  # kohya's noise_offset: noise += offset * N(0, 1) per image and channel
    min_snr_gamma: float = 0.0  # 0: off; else kohya's min-SNR-γ weighting (eps and v models; 5 is usual)
    timestep_sampling: TimestepSampling | None = None  # None: the model family's
    timestep_shift: float = DEFAULT_SHIFT  # the shift of TimestepSampling.SHIFTED_SIGMOID
    loss: LossKind = LossKind.MSE
    huber_c: float = 0.1  # Huber's delta / smooth L1's beta
    ema_decay: float = 0.0  # 0: off; else an EMA of the LoRA weights is what is saved (trainer/ema.py)
    # Captions (trainer/captions.py); all off: each image trains on its caption as written, as before
    shuffle_tags: bool = False
    keep_tokens: int = 0
    tag_dropout: float = 0.0
    caption_dropout: float = 0.0
    caption_variants: int = 4
    multires_noise_iterations: int = 0  # 0: off; kohya's multires (pyramid) noise, 6-10 is usual
    multires_noise_discount: float = 0.3  # each coarser level's weight factor (kohya's default)
    masked_loss: bool = False  # the loss only where the image's alpha or <image>_mask.png is white (weighted)

    def __post_init__(self):
        _require(self.steps >= 1, "steps", f"got {self.steps}; use 1 or more")
        _require(self.save_every_steps >= 0, "save_every_n_steps", f"got {self.save_every_steps}; use 0 (off) or more")
        _require(self.keep_last_saves >= 0, "keep_last_saves", f"got {self.keep_last_saves}; use 0 (all) or more")
        _require_choice(self, "lr_schedule", LR_SCHEDULES)
        _require(0 <= self.warmup_steps < self.steps, "warmup_steps",
                 f"got {self.warmup_steps}; use 0 up to steps - 1 ({self.steps - 1})")
        # up to 10 for Prodigy, whose rate (1.0 is usual) multiplies the step it estimates; the optimizer is a
        # Memory Settings value, so optimizers.check_learning_rate checks the pair when training starts
        _require(_number(self.learning_rate) and 0 < self.learning_rate <= 10, "learning_rate",
                 f"got {self.learning_rate}; use a small positive value such as 1e-4 (1.0 for Prodigy)")
        fraction = self.validation_fraction
        _require(isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and 0 <= fraction < 1,
                 "validation_fraction", f"got {fraction!r}; use 0 (off) or a share below 1 such as 0.1 (at least "
                 "one image is held out, at least one left to train on)")
        _require(isinstance(self.validation_every_steps, int) and self.validation_every_steps >= 0,
                 "validation_every_n_steps", f"got {self.validation_every_steps!r}; use 0 (at the end only) or more")
        _require(_number(self.noise_offset) and 0 <= self.noise_offset <= 1, "noise_offset",
                 f"got {self.noise_offset!r}; use 0 (off) up to 1 (0.05-0.1 is usual)")
        _require(_number(self.min_snr_gamma) and 0 <= self.min_snr_gamma <= 100, "min_snr_gamma",
                 f"got {self.min_snr_gamma!r}; use 0 (off) or a positive γ up to 100 (5 is usual)")
        if self.timestep_sampling is not None:
            _require_member(self, "timestep_sampling", TimestepSampling)
        _require(_number(self.timestep_shift) and 0 < self.timestep_shift <= 100, "timestep_shift",
                 f"got {self.timestep_shift!r}; use a positive shift up to 100 (3 is kohya's, 1 is no shift)")
        _require_member(self, "loss", LossKind)
        _require(_number(self.ema_decay) and (self.ema_decay == 0 or 0.5 <= self.ema_decay < 1), "ema_decay",
                 f"got {self.ema_decay!r}; use 0 (off) or a decay from 0.5 up to but below 1 (0.999 is usual)")
        iterations = self.multires_noise_iterations
        _require(isinstance(iterations, int) and not isinstance(iterations, bool) and 0 <= iterations <= 20,
                 "multires_noise_iterations", f"got {iterations!r}; use 0 (off) up to 20 (6-10 is usual)")
        _require(_number(self.multires_noise_discount) and 0 < self.multires_noise_discount <= 1,
                 "multires_noise_discount", f"got {self.multires_noise_discount!r}; use a factor above 0 up to 1 "
                 "(0.3 is kohya's, 0.1 weaker)")
        _require(isinstance(self.masked_loss, bool), "masked_loss", f"got {self.masked_loss!r}; use true or false")
        _require(isinstance(self.shuffle_tags, bool), "shuffle_tags", f"got {self.shuffle_tags!r}; use true or false")
        for field in ("tag_dropout", "caption_dropout"):
            rate = getattr(self, field)
            _require(_number(rate) and 0 <= rate < 1, field, f"got {rate!r}; use 0 (off) or a rate below 1 (0.05-0.1 "
                     "is usual)")
        _require(isinstance(self.keep_tokens, int) and not isinstance(self.keep_tokens, bool)
                 and 0 <= self.keep_tokens <= 255, "keep_tokens", f"got {self.keep_tokens!r}; use 0 up to 255 tags")
        _require(not self.keep_tokens or self.shuffle_tags or self.tag_dropout, "keep_tokens",
                 f"got {self.keep_tokens}, but neither shuffle_tags nor tag_dropout is on, so there is nothing to keep "
                 "the first tags from: turn one on, or set keep_tokens to 0")
        _require(isinstance(self.caption_variants, int) and not isinstance(self.caption_variants, bool)
                 and 1 <= self.caption_variants <= 64, "caption_variants",
                 f"got {self.caption_variants!r}; use 1 to 64 variants per image (each is one more text encoding "
                 "before training and its embedding in RAM)")
        _require(_number(self.huber_c) and 0 < self.huber_c <= 100, "huber_c",
                 f"got {self.huber_c!r}; use a positive value up to 100 (0.1 is kohya's)")

    def objective_values(self) -> dict[str, str]:
        """The timestep and loss knobs as the report and the training state word them (the family's sampling is
        "default")."""
        sampling = self.timestep_sampling.value if self.timestep_sampling else "default"
        return {"noise_offset": f"{self.noise_offset:g}", "min_snr_gamma": f"{self.min_snr_gamma:g}",
                "timestep_sampling": sampling, "timestep_shift": f"{self.timestep_shift:g}",
                "loss": self.loss.value, "huber_c": f"{self.huber_c:g}"}

    def option_values(self) -> dict[str, str]:
        """Train's other training options (EMA, captions, multires noise, masked loss) as the report and the training
        state word them."""
        varied = self.shuffle_tags or self.tag_dropout
        return {"ema_decay": f"{self.ema_decay:g}", "shuffle_tags": str(self.shuffle_tags).lower(),
                "keep_tokens": str(self.keep_tokens), "tag_dropout": f"{self.tag_dropout:g}",
                "caption_dropout": f"{self.caption_dropout:g}",
                # counts only where tags vary (otherwise nothing is encoded for it)
                "caption_variants": str(self.caption_variants) if varied else "4",
                "multires_noise_iterations": str(self.multires_noise_iterations),
                # counts only with iterations (otherwise nothing is drawn with it)
                "multires_noise_discount":
                    f"{self.multires_noise_discount:g}" if self.multires_noise_iterations else "0.3",
                "masked_loss": str(self.masked_loss).lower()}

    def caption_options(self) -> CaptionOptions:
        return CaptionOptions(self.shuffle_tags, self.keep_tokens, self.tag_dropout, self.caption_dropout,
                              self.caption_variants)

    def option_changes(self) -> dict[str, str]:
        return {key: value for key, value in self.option_values().items() if OPTION_DEFAULTS[key] != value}

    def objective_changes(self) -> dict[str, str]:
        """Those knobs set away from their defaults (empty for a run as before they existed)."""
        return {key: value for key, value in self.objective_values().items() if OBJECTIVE_DEFAULTS[key] != value}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


OBJECTIVE_DEFAULTS = TrainSettings().objective_values()  # what a training state from before the knobs trained with
OPTION_DEFAULTS = TrainSettings().option_values()


@dataclass(frozen=True)
class SampleLimits:
    """What a sample may cost, for one model family: sizes up to about twice its native resolution and a sampler's
    usual steps. Checked before training (SampleSettings.check_within), so a sample cannot hold the server for
    minutes; Cancel still stops a sample between two sampler steps."""
    family: str = "SD1.x/SDXL"
    max_size: int = 2048  # SD1.5 trains at 512, SDXL at 1024
    max_steps: int = 150  # A1111's slider ends here; 20-30 is usual
    native: str = "512 for SD1.5, 1024 for SDXL"


SD_SAMPLE_LIMITS = SampleLimits()


@dataclass(frozen=True)
class SampleSettings:
    """Images rendered while training from the LoRA at its current weights (the Train node's sample_* inputs):
    every `every_steps` optimizer steps, one image per prompt at `size`² with `steps` sampler steps, `cfg` and a
    fixed `seed` (the same noise each time, so the images show what the LoRA learned in between)."""
    prompts: tuple[str, ...] = ()
    every_steps: int = 0  # 0: off
    size: int = 512
    steps: int = 20
    cfg: float = 7.0
    seed: int = 0

    def __post_init__(self):
        _require(isinstance(self.prompts, tuple) and all(isinstance(p, str) and p.strip() for p in self.prompts),
                 "sample_prompts", f"got {self.prompts!r}; write one prompt per line")
        _require(isinstance(self.every_steps, int) and self.every_steps >= 0, "sample_every_n_steps",
                 f"got {self.every_steps!r}; use 0 (off) or more")
        _require(not self.every_steps or self.prompts, "sample_prompts",
                 f"sample_every_n_steps is {self.every_steps} but there is no prompt: write one prompt per line, "
                 "or set sample_every_n_steps to 0")
        _require(isinstance(self.size, int) and 64 <= self.size <= 4096 and self.size % 64 == 0, "sample_size",
                 f"got {self.size!r}; use a multiple of 64 from 64 to 4096 (512 for SD1.5, 1024 for SDXL)")
        _require(isinstance(self.steps, int) and 1 <= self.steps <= 1000, "sample_steps",
                 f"got {self.steps!r}; use 1 to 1000 sampler steps (20 is usual)")
        cfg = self.cfg
        _require(isinstance(cfg, (int, float)) and not isinstance(cfg, bool) and 0 <= cfg <= 100, "sample_cfg",
                 f"got {cfg!r}; use a guidance scale from 0 to 100 (7 is usual for SD1.5)")
        _require(isinstance(self.seed, int) and 0 <= self.seed <= 0xFFFFFFFFFFFFFFFF, "sample_seed",
                 f"got {self.seed!r}; use 0 or a positive integer")

    @classmethod
    def from_text(cls, prompts: str, **values) -> "SampleSettings":
        """Prompts as the node's multiline box holds them: one per line, blank lines skipped."""
        _require(isinstance(prompts, str), "sample_prompts", f"got {prompts!r}; write one prompt per line")
        return cls(tuple(line.strip() for line in prompts.splitlines() if line.strip()), **values)

    @property
    def on(self) -> bool:
        return self.every_steps > 0

    def check_within(self, limits: SampleLimits = SD_SAMPLE_LIMITS) -> None:
        """The size and steps within what samples of `limits.family` are worth (only when sampling is on)."""
        if not self.on:
            return
        _require(self.size <= limits.max_size, "sample_size",
                 f"got {self.size}; {limits.family} samples are at most {limits.max_size} px ({limits.native}): "
                 "lower sample_size (a larger sample takes minutes and many GiB per image)")
        _require(self.steps <= limits.max_steps, "sample_steps",
                 f"got {self.steps}; {limits.family} samples take at most {limits.max_steps} sampler steps (20 is "
                 "usual): lower sample_steps")
