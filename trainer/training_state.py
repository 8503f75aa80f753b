"""Exact resume: everything a run needs to go on where it stopped, in one file beside its LoRA.

`<lora stem>.leanlora-state` is a safetensors file (never pickle): the fp32 LoRA weights, the optimizer's state
(8-bit states included), the fp16 loss scaler, step, RNG states (torch CPU/CUDA, Python, the sampler's generator),
the epoch's batch order and position, the losses so far (validation's too), and fingerprints of the dataset, the
base model, the LoRA shape, the validation split and the settings. Non-tensor parts go into the file's JSON metadata.
It is LoRA-sized (weights plus two optimizer moments), never the base model; the extension keeps it out of ComfyUI's
LoRA lists."""
from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .dataset import MASK_SUFFIX
from .distributed import refused_world
from .errors import LeanLoRAError, one_line
from .files import sanitize_name, save_safetensors_atomic
from .optimizers import build_lr_schedule
from .settings import OBJECTIVE_DEFAULTS, OPTION_DEFAULTS

STATE_SUFFIX = ".leanlora-state"
FORMAT = "leanlora-training-state/1"
_TENSOR = "__tensor__"  # a JSON leaf that stands for a tensor of the file
MAX_RATE = 10.0  # the learning_rate and text_encoder_lr widgets' maximum (settings.py holds Train's to it too)
# Optimizer state names of running averages of squared gradients (torch, transformers' Adafactor, CAME,
# bitsandbytes' 32-bit path): never negative
SECOND_MOMENTS = ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col", "state2")
# Param group values that are an optimizer's running state, not its settings (Prodigy's step-size estimate,
# schedule-free's averaging weights): a resume carries these over; every other group value is this run's own
RUNNING_GROUP_VALUES = ("d", "d_max", "d_numerator", "k", "weight_sum", "lr_max", "scheduled_lr", "train_mode")


def state_path(lora_path: Path) -> Path:
    """Where the state of the LoRA file `lora_path` lives: beside it."""
    return lora_path.with_name(lora_path.stem + STATE_SUFFIX)


@dataclass
class TrainingState:
    step: int  # optimizer steps done
    lora: list[torch.Tensor]  # the LoRA parameters, in the trainer's order and dtype
    optimizer_name: str  # the class that made `optimizer` (its state loads only into the same kind)
    optimizer: dict | None
    scaler: dict | None  # fp16 loss scaling
    rng: dict  # "sampler": the run's generator (noise, timesteps, LoRA dropout seeds); "torch", "cuda", "python": process-wide ones
    data: dict  # cache.Batches.state_dict()
    losses: list[float]
    fingerprints: dict[str, str]  # "dataset", "model", "lora", "settings"; "validation" with images held out
    settings: dict[str, str] = field(default_factory=dict)  # for the report: what the run trained with
    output_name: str = ""
    validation_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) so far
    ema: dict | None = None  # ema.LoraEMA.state_dict() with Train's ema_decay on (states before it: None)


def _flatten(value, tensors: dict[str, torch.Tensor], prefix: str):
    """Nested dicts/lists/tuples of tensors and JSON values -> a JSON skeleton; tensors go to `tensors`."""
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach().to("cpu").contiguous()
        return {_TENSOR: key, "path": prefix}
    if isinstance(value, dict):
        return {"__dict__": [[_flatten(k, tensors, f"{prefix}.key"), _flatten(v, tensors, f"{prefix}.{k}")]
                             for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        items = [_flatten(v, tensors, f"{prefix}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} at {prefix} in a training state")


def _unflatten(skeleton, tensors: dict[str, torch.Tensor]):
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if "__dict__" in skeleton:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in skeleton["__dict__"]}
        if "__tuple__" in skeleton:
            return tuple(_unflatten(v, tensors) for v in skeleton["__tuple__"])
    if isinstance(skeleton, list):
        return [_unflatten(v, tensors) for v in skeleton]
    return skeleton


def save_training_state(path: Path, state: TrainingState) -> Path:
    """Atomic (see files.save_safetensors_atomic): the file is the old state or the complete new one."""
    tensors: dict[str, torch.Tensor] = {}
    body = {"step": state.step, "lora": state.lora, "optimizer_name": state.optimizer_name,
            "optimizer": state.optimizer, "scaler": state.scaler, "rng": state.rng, "data": state.data,
            "losses": state.losses, "fingerprints": state.fingerprints, "settings": state.settings,
            "output_name": state.output_name, "validation_losses": state.validation_losses, "ema": state.ema}
    skeleton = _flatten(body, tensors, "state")
    metadata = {"format": FORMAT, "state": json.dumps(skeleton), "step": str(state.step),
                "output_name": state.output_name}
    return save_safetensors_atomic(tensors, path, metadata)


def read_state_header(path: Path) -> dict[str, str]:
    """The file's metadata only (cheap: the header), or a LeanLoRAError naming the file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:  # noqa: BLE001 - any unreadable file is the same problem for the user
        raise LeanLoRAError(f"training state {path} cannot be read ({one_line(error)}): pick another state or "
                            "resume 'off'") from error
    if metadata.get("format") != FORMAT:
        raise LeanLoRAError(f"{path} is not a LeanLoRA training state (format {metadata.get('format')!r}, expected "
                            f"{FORMAT!r}): pick a .leanlora-state file written by LeanLoRA Train")
    return metadata


def load_training_state(path: Path) -> TrainingState:
    metadata = read_state_header(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        body = _unflatten(json.loads(metadata["state"]), tensors)
        return TrainingState(**body)
    except LeanLoRAError:
        raise
    except Exception as error:  # noqa: BLE001 - a damaged file: say so, never train from half of it
        raise LeanLoRAError(f"training state {path} is damaged ({one_line(error)}): pick another state (every "
                            "save point writes one) or resume 'off'") from error


def find_latest_state(folders: list[Path], output_name: str) -> Path | None:
    """The state of `output_name` (sanitized) with the most steps in `folders`, newest first among equals."""
    found = []
    for folder in folders:
        for path in Path(folder).glob(f"*{STATE_SUFFIX}"):
            try:
                metadata = read_state_header(path)
            except LeanLoRAError:
                continue  # another program's file or a damaged one: not a candidate
            if metadata.get("output_name") == output_name:
                found.append((int(metadata.get("step", 0)), path.stat().st_mtime, path))
    return max(found)[2] if found else None


# --- what a state must match to be resumed ---------------------------------------------------------------------

def _digest(*parts) -> str:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError as error:
        return f"unreadable {error.errno}"
    return digest.hexdigest()[:16]


def dataset_fingerprint(dataset) -> str:
    """The images (name, size on disk) and captions, their mask files (size), an edit pair's control images (their
    content: a control redrawn to the same size is another pair), repeats, resolution and framing."""
    parts = []
    for sample in dataset.samples:
        try:
            nbytes = sample.path.stat().st_size
        except OSError:
            nbytes = -1
        part = f"{sample.path.name}|{nbytes}|{sample.caption}"
        mask = sample.path.with_name(sample.path.stem + MASK_SUFFIX)
        if mask.is_file():  # masked_loss reads it (only then is it part of the name: older states still match)
            part += f"|mask {mask.stat().st_size}"
        if sample.controls:  # only then is it part of the name: states of plain folders still match
            part += "|controls " + " ".join(f"{c.name}:{_file_digest(c)}" for c in sample.controls)
        parts.append(part)
    return _digest(dataset.resolution, dataset.repeats, dataset.buckets, *sorted(parts))


def model_fingerprint(unet: torch.nn.Module) -> str:
    """The base weights, sampled (~64 values per tensor: a different checkpoint differs there), before LoRA."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in unet.state_dict().items():
            sample = tensor.detach().reshape(-1)[:: max(1, tensor.numel() // 64)].to("cpu", torch.float32)
            digest.update(f"{name} {tuple(tensor.shape)}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def check_base_weights(unet: torch.nn.Module) -> None:
    """The base weights, sampled as model_fingerprint samples them, must be finite: a checkpoint with NaN/inf
    weights fails here, before step 1, instead of as a divergence whose advice (learning rate, alpha) is wrong."""
    with torch.no_grad():
        for name, tensor in unet.state_dict().items():
            if not tensor.is_floating_point():
                continue
            sample = tensor.detach().reshape(-1)[:: max(1, tensor.numel() // 64)].to("cpu", torch.float32)
            if not bool(torch.isfinite(sample).all()):
                raise LeanLoRAError(f"the base model's weight {name!r} holds NaN/inf values: the checkpoint is "
                                    "damaged or was converted badly (e.g. to fp16 with overflow). Pick another "
                                    "checkpoint or download this one again")


def lora_fingerprint(lora, params: list[torch.nn.Parameter], type_part: tuple = ()) -> str:
    """`type_part`: the adapter type's own part (trainer/lora, AdapterType.fingerprint); plain LoRA's is empty, so
    states saved before adapter types existed still resume."""
    return _digest(lora.rank, lora.alpha, lora.targets.value, *(tuple(p.shape) for p in params), *type_part)


def rng_states(generator: torch.Generator) -> dict:
    states = {"sampler": generator.get_state(), "torch": torch.get_rng_state(),
              "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict, generator: torch.Generator) -> None:
    generator.set_state(states["sampler"])
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(states["cuda"]))


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _tensors_in(value, where: str):
    """(where, tensor) for every tensor inside nested dicts/lists/tuples, `where` naming it like state.x[3].y."""
    if isinstance(value, torch.Tensor):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_in(item, f"{where}[{index}]")


def _non_finite(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())


def check_state_values(state: TrainingState, path: Path, images: int | None = None) -> None:
    """Every value of a loaded state that a resume uses, checked before any encoding: the step, the losses so far,
    the LoRA and optimizer tensors (finite), the loss scale, the random generators' states and the data position
    (`images`: the dataset's image count, which bounds the batch order's indices). A hand-edited or damaged file
    fails here with a LeanLoRAError naming the file and the value, never later as a divergence or a bare error."""
    pick = "pick another state (every save point writes one) or set resume to 'off'"

    def damaged(what: str) -> LeanLoRAError:
        return LeanLoRAError(f"training state {path} is damaged: {what}; {pick}")

    step = state.step
    if not _is_count(step):
        raise damaged(f"its step is {step!r}, not a count of the steps trained (0 or more)")
    losses = state.losses
    if not isinstance(losses, list) or len(losses) != step:
        count = len(losses) if isinstance(losses, list) else repr(losses)
        raise damaged(f"it records {count} losses for its {step} steps (one per step)")
    bad_loss = next((i for i, loss in enumerate(losses) if not _is_number(loss)), None)
    if bad_loss is not None:
        raise damaged(f"the loss of step {bad_loss + 1} is {losses[bad_loss]!r}, not a finite number")
    for index, (at, loss) in enumerate(_pairs(state.validation_losses)):
        if not (_is_count(at, 1) and at <= step and _is_number(loss)):
            raise damaged(f"validation loss {index} is {loss!r} at step {at!r} (a finite loss at a step up to {step})")
    lora = state.lora
    if not isinstance(lora, list) or not lora or not all(isinstance(t, torch.Tensor) for t in lora):
        raise damaged("it holds no LoRA tensors")
    for index, tensor in enumerate(lora):
        if not tensor.is_floating_point():
            raise damaged(f"its LoRA tensor {index} of {len(lora)} (state.lora[{index}]) is {tensor.dtype}, not floating point")
        if _non_finite(tensor):
            raise LeanLoRAError(
                f"training state {path} holds NaN/inf values in its LoRA tensor {index} of {len(lora)} "
                f"(state.lora[{index}], shape {tuple(tensor.shape)}): the file is damaged or was edited (LeanLoRA "
                f"saves only weights checked finite), so resuming would train from broken weights; {pick}")
    for where, tensor in _tensors_in(state.optimizer, "state.optimizer"):
        if _non_finite(tensor):
            raise LeanLoRAError(f"training state {path} holds NaN/inf values in its optimizer state ({where}, shape "
                                f"{tuple(tensor.shape)}): the file is damaged or was edited; {pick}")
    for where, tensor in _tensors_in(state.ema, "state.ema"):
        if _non_finite(tensor):
            raise LeanLoRAError(f"training state {path} holds NaN/inf values in its EMA of the LoRA weights ({where}): "
                                f"the file is damaged or was edited; {pick}")
    _check_optimizer_values(state.optimizer, damaged)
    if state.scaler and not (_is_number(state.scaler.get("scale")) and state.scaler["scale"] > 0):
        raise damaged(f"its fp16 loss scale is {state.scaler.get('scale')!r}, not a positive finite number")
    _check_rng(state.rng, damaged)
    data = state.data if isinstance(state.data, dict) else {}
    order, position, batch_size = data.get("order"), data.get("position"), data.get("batch_size")
    if not _is_count(batch_size, 1):
        raise damaged(f"its data batch size is {batch_size!r} (1 or more)")
    if not isinstance(order, list) or not all(isinstance(chunk, list) and chunk and
                                              all(_is_count(i) for i in chunk) for chunk in order):
        raise damaged("its batch order is not a list of batches of image indices")
    if not _is_count(position) or position > len(order):
        raise damaged(f"its data position is {position!r}; the epoch it records has {len(order)} batches (0 to "
                      f"{len(order)})")
    high = max((i for chunk in order for i in chunk), default=-1)
    if images is not None and high >= images:
        raise damaged(f"its batch order names image {high}, but the dataset has {images} images")


def _check_optimizer_values(optimizer, damaged) -> None:
    """The optimizer's settings and second moments, which its first step would use: an edited value otherwise
    ends as a divergence blamed on the learning rate, or as a bare error from inside the optimizer."""
    if not isinstance(optimizer, dict):
        return
    for index, group in enumerate(optimizer.get("param_groups", [])):
        def bad(key: str, value, expected: str) -> LeanLoRAError:
            return damaged(f"its optimizer's {key} is {value!r} (param group {index}), not {expected}")
        for key in ("lr", "initial_lr"):
            if key in group and not (_is_number(group[key]) and 0 <= group[key] <= MAX_RATE):
                raise bad(key, group[key], f"a rate from 0 to {MAX_RATE:g} (the learning_rate widget's range)")
        betas = group.get("betas", ())
        if not isinstance(betas, (list, tuple)) or not all(_is_number(b) and 0 <= b < 1 for b in betas):
            raise bad("betas", betas, "numbers in [0, 1)")
        eps = group.get("eps", 1.0)
        if not all(_is_number(e) and e > 0 for e in (eps if isinstance(eps, (list, tuple)) else (eps,))):
            raise bad("eps", eps, "a positive number")
        for key in RUNNING_GROUP_VALUES:  # carried over as stored (others are this run's; Prodigy's growth_rate is inf)
            if isinstance(group.get(key), float) and not math.isfinite(group[key]):
                raise bad(key, group[key], "a finite number")
    for where, tensor in _tensors_in(optimizer.get("state"), "state.optimizer.state"):
        moment = where.rsplit(".", 1)[-1]
        if moment in SECOND_MOMENTS and tensor.is_floating_point() and bool((tensor < 0).any()):
            raise damaged(f"its optimizer's second moment {where} holds negative values (a sum of squares never "
                          "is)")


def _pairs(values):
    try:
        return [tuple(pair) for pair in values]
    except TypeError:
        return [(None, values)]


def _check_rng(rng, damaged) -> None:
    """The generators' states must load (into scratch generators: the run's own are set only when resuming)."""
    if not isinstance(rng, dict):
        raise damaged("it holds no random generator states")
    for key in ("sampler", "torch"):
        try:
            torch.Generator().set_state(rng[key])
        except (KeyError, TypeError, RuntimeError) as error:
            raise damaged(f"its random generator state {key!r} cannot be loaded ({one_line(error)})") from None
    try:
        version, internal, gauss = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError) as error:
        raise damaged(f"its Python random state cannot be loaded ({one_line(error)})") from None


def check_resumable(state: TrainingState, path: Path, fingerprints: dict[str, str], total_steps: int,
                    checks: tuple[str, ...] = ("dataset", "model", "lora", "validation", "text_encoder"),
                    lora_shapes: list[tuple[int, ...]] | None = None, lora_type: str | None = None) -> None:
    """Raises a LeanLoRAError naming the file and what differs; a state is resumed only on its own dataset,
    base model, LoRA shape and validation split, with steps left to train. `checks`: the fingerprints to compare
    (the dataset's alone can be checked before any encoding)."""
    what = {"dataset": "the dataset (images, control images, captions, repeats, resolution or framing) differs from "
                       "the one it trained on: resume on the same dataset, or train further on new data with LoRA "
                       "Config's continue_from (its LoRA file)",
            "model": "the base model differs from the one it trained on: resume with the same checkpoint, or "
                     "continue from its LoRA file (LoRA Config's continue_from) on this one",
            "lora": "the LoRA shape (rank, alpha, targets or LoKr factor) differs: set LoRA Config as the state was "
                    "trained",
            "validation": "the images held out for validation differ (validation_fraction or seed changed): set "
                          "them as the state was trained, so it trains on the same images",
            "text_encoder": "the text encoder (CLIP) differs from the one it trained: resume with the same CLIP, or "
                            "continue from its LoRA file (LoRA Config's continue_from)"}
    trained_type = state.settings.get("lora_type", "lora")  # states saved before adapter types trained LoRA
    if lora_type is not None and trained_type != lora_type:
        raise LeanLoRAError(f"cannot resume from {path.name}: it trained a {trained_type} adapter, and LoRA Config's "
                            f"type says {lora_type}: set type to {trained_type} to resume it (or resume 'off' to "
                            "start a new one)")
    if "lora" in checks:  # on or off as it trained (before the shapes, which differ then too)
        trained_lr = float(state.settings.get("text_encoder_lr", "0"))
        if (trained_lr > 0) != ("text_encoder" in fingerprints):
            raise LeanLoRAError(
                f"cannot resume from {path.name}: " + (
                    f"it trained the text encoder too (text_encoder_lr {trained_lr:g}), and LoRA Config's "
                    "text_encoder_lr is 0: set it above 0 to resume it" if trained_lr > 0 else
                    "it trained the diffusion model alone (text_encoder_lr 0), and LoRA Config's text_encoder_lr is "
                    "set: set it to 0 to resume it (or resume 'off' to start a new LoRA)"))
    for key in checks:
        if state.fingerprints.get(key) != fingerprints.get(key):
            why = what[key]
            raise LeanLoRAError(f"cannot resume from {path.name}: {why}")
    if lora_shapes is not None and [tuple(t.shape) for t in state.lora] != [tuple(s) for s in lora_shapes]:
        raise LeanLoRAError(f"cannot resume from {path.name}: its LoRA tensors do not have this LoRA's shapes (the "
                            "file was edited or is damaged): pick another state or set resume to 'off'")
    if state.step >= total_steps:
        raise LeanLoRAError(f"cannot resume from {path.name}: it has trained {state.step} steps already, and Train "
                            f"asks for {total_steps}: raise steps above {state.step} to train further")


class Resume:
    """A run's resume, in one place: the state read and checked before any encoding (`Resume.of`), checked against
    the injected LoRA (`check`), put into the session once it started (`restore`, which returns the report's lines).
    Without a state (resume off) it is a new run's start: step 0, no losses, and every method does nothing."""

    # settings a state records that this run may change (Train's values are the ones used); a state from before the
    # timestep and loss knobs and the other options trained with their defaults
    COMPARED = ("seed", "learning_rate", "lr_schedule", "warmup_steps", "text_encoder_lr", *OBJECTIVE_DEFAULTS,
                *OPTION_DEFAULTS)

    def __init__(self, path: Path | None = None, state: TrainingState | None = None, total_steps: int = 0):
        self.path, self.state, self.total_steps = path, state, total_steps

    @classmethod
    def of(cls, path: Path | None, dataset_id: str, images: int, total_steps: int, world_size: int = 1) -> Resume:
        """`path` (Train's resume_from; None: off) read, its values checked and its dataset compared; a state
        written by another number of processes (data-parallel: distributed.py) is refused."""
        if path is None:
            return cls()
        path = Path(path)
        state = load_training_state(path)
        check_state_values(state, path, images)
        trained_world = state.settings.get("world_size", "1")  # a state of one process records none
        if trained_world != str(world_size):
            raise refused_world(path.name, trained_world, world_size)
        check_resumable(state, path, {"dataset": dataset_id}, total_steps, checks=("dataset",))
        return cls(path, state, total_steps)

    @property
    def step(self) -> int:
        return self.state.step if self.state else 0

    @property
    def losses(self) -> list[float]:
        return list(self.state.losses) if self.state else []

    @property
    def validation_losses(self) -> list[tuple[int, float]]:
        """The curve so far: a resumed run's curve is the uninterrupted run's."""
        return [(int(step), float(value)) for step, value in self.state.validation_losses] if self.state else []

    def started_at(self, now: float) -> float:
        """Wall clock, for the file's metadata: a resumed run's file says when its training began."""
        return float(self.state.settings.get("started_at", now)) if self.state else now

    def beginning(self, now: float) -> tuple[int, list[float], float]:
        """Where the run begins: the steps done, their losses and when its training began (`now` for a new run)."""
        return self.step, self.losses, self.started_at(now)

    def check(self, fingerprints: dict[str, str], params: list[torch.nn.Parameter], lora_type: str) -> None:
        if self.state is not None:
            check_resumable(self.state, self.path, fingerprints, self.total_steps,
                            lora_shapes=[tuple(p.shape) for p in params], lora_type=lora_type)

    def restore(self, session, settings: dict[str, str], validation=None) -> list[str]:
        """Puts the session (and the validation curve) where the state stopped; returns what the report says: where
        from, what changed since the state (`settings`: this run's, which it trains with) and what could not carry
        over."""
        if self.state is None:
            return []
        if validation is not None:  # a resumed run's curve is the uninterrupted run's
            validation.losses[:] = self.validation_losses
        notes = restore_state(session, self.state)
        trained = self.state.settings.get("memory") or "the same settings"
        before = {**OBJECTIVE_DEFAULTS, **OPTION_DEFAULTS, **self.state.settings}
        changed = [f"{key} {before[key]} -> {value}" for key, value in settings.items()
                   if key in self.COMPARED and before.get(key, value) != value]
        return [f"resumed from {self.path.name}: step {self.step} of {self.total_steps}, trained with {trained}",
                *(["resume: changed since the state: " + ", ".join(changed)] if changed else []), *notes]

    def unchanged(self) -> str:
        """For a run stopped before its first step."""
        return f" (the state {self.path.name} is unchanged)" if self.state else ""


def capture_state(session, losses: list[float], fingerprints: dict[str, str], settings: dict[str, str],
                  validation_losses: list[tuple[int, float]] = ()) -> TrainingState:
    """What restore_state needs to go on exactly from the session's steps_done (between steps, or after the run
    stopped). A step stopped part-way (Cancel, out of memory) had drawn its batches and noise already: the RNG and
    batch order are those from before it (session.step_start), so a resume draws what it would have."""
    scaler = session.precision.scaler
    rng, data = rng_states(session.generator), session.data.state_dict()
    if session.step_start is not None and session.step_start[0] == session.steps_done:
        _, rng, data = session.step_start
    return TrainingState(
        step=session.steps_done, lora=[p.detach().clone() for p in session.params],
        optimizer_name=type(session.optimizer).__name__, optimizer=session.optimizer.state_dict(),
        scaler=scaler.state_dict() if scaler is not None else None, rng=rng, data=data,
        losses=list(losses[:session.steps_done]), fingerprints=fingerprints, settings=settings,
        output_name=sanitize_name(session.train.output_name),
        validation_losses=[(step, value) for step, value in validation_losses if step <= session.steps_done],
        ema=session.ema.state_dict() if session.ema is not None else None)  # updated only by complete steps


def restore_state(session, state: TrainingState) -> list[str]:
    """Puts the session where `state` stopped (after session.start(): the memory settings may differ from the
    state's). Returns notes for the report where something could not carry over."""
    notes = []
    if [tuple(p.shape) for p in session.params] != [tuple(t.shape) for t in state.lora]:
        raise LeanLoRAError("the training state's LoRA tensors do not match this LoRA's shapes")
    with torch.no_grad():
        for param, saved in zip(session.params, state.lora):
            param.copy_(saved.to(param.device, param.dtype))
    optimizer = session.optimizer
    if state.optimizer is not None and state.optimizer_name == type(optimizer).__name__:
        chosen = [{key: value for key, value in group.items() if key not in ("params", *RUNNING_GROUP_VALUES)}
                  for group in optimizer.param_groups]  # this run's rates and settings (Train's, not the state's)
        try:
            optimizer.load_state_dict(state.optimizer)
        except (ValueError, KeyError, RuntimeError) as error:
            notes.append(f"resume: the optimizer state could not be loaded ({one_line(error)}); its moments "
                         "restart (the LoRA weights are kept)")
        else:
            notes += _keep_chosen_settings(optimizer, chosen)
    else:
        notes.append(f"resume: the state was trained with {state.optimizer_name}, this run uses "
                     f"{type(optimizer).__name__}: the optimizer moments restart (the LoRA weights are kept)")
    if session.precision.scaler is not None and state.scaler:
        session.precision.scaler.load_state_dict(state.scaler)
    session.steps_done = state.step
    train = session.train
    session.lr_schedule = build_lr_schedule(optimizer, train.lr_schedule, train.warmup_steps, train.steps,
                                            session.steps_done)
    restore_rng_states(state.rng, session.generator)
    session.data.load_state_dict(state.data)
    if session.ema is not None and state.ema:
        session.ema.load_state_dict(state.ema)
    elif session.ema is not None:
        session.ema.updates = state.step  # its warm-up as if it had run: the average starts at the resumed weights
        notes.append("resume: the state holds no EMA of the LoRA weights (ema_decay was off): the average starts "
                     "from the resumed weights")
    return notes


def _keep_chosen_settings(optimizer, chosen: list[dict]) -> list[str]:
    """Puts this run's group settings back over the loaded ones (the moments stay the state's), so a resume trains at
    Train's learning rate; returns a note naming what the state had stored otherwise. The schedule is rebuilt
    after this, from initial_lr (build_lr_schedule), so `lr` itself is not compared."""
    replaced = []
    for index, (group, values) in enumerate(zip(optimizer.param_groups, chosen)):
        for key, value in values.items():
            stored = group.get(key)
            if key != "lr" and stored != value:
                name = ("learning_rate", "text_encoder_lr")[min(index, 1)] if key == "initial_lr" else key
                replaced.append(f"{name} {_shown(stored)} -> {_shown(value)}")
        group.update(values)
    if not replaced:
        return []
    return ["resume: the optimizer steps with this run's settings, not those stored in the state: "
            + ", ".join(dict.fromkeys(replaced))]


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return str(value)
