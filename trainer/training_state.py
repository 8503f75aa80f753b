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
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import LeanLoRAError, one_line
from .files import save_safetensors_atomic

STATE_SUFFIX = ".leanlora-state"
FORMAT = "leanlora-training-state/1"
_TENSOR = "__tensor__"  # a JSON leaf that stands for a tensor of the file


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
            "output_name": state.output_name, "validation_losses": state.validation_losses}
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


def dataset_fingerprint(dataset) -> str:
    """The images (name, size on disk) and captions, repeats, resolution and framing."""
    parts = []
    for sample in dataset.samples:
        try:
            nbytes = sample.path.stat().st_size
        except OSError:
            nbytes = -1
        parts.append(f"{sample.path.name}|{nbytes}|{sample.caption}")
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


def lora_fingerprint(lora, params: list[torch.nn.Parameter]) -> str:
    return _digest(lora.rank, lora.alpha, lora.targets.value, *(tuple(p.shape) for p in params))


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


def check_resumable(state: TrainingState, path: Path, fingerprints: dict[str, str], total_steps: int,
                    checks: tuple[str, ...] = ("dataset", "model", "lora", "validation")) -> None:
    """Raises a LeanLoRAError naming the file and what differs; a state is resumed only on its own dataset,
    base model, LoRA shape and validation split, with steps left to train. `checks`: the fingerprints to compare
    (the dataset's alone can be checked before any encoding)."""
    what = {"dataset": "the dataset (images, captions, repeats, resolution or framing) differs from the one it "
                       "trained on: resume on the same dataset, or train further on new data with LoRA Config's "
                       "continue_from (its LoRA file)",
            "model": "the base model differs from the one it trained on: resume with the same checkpoint, or "
                     "continue from its LoRA file (LoRA Config's continue_from) on this one",
            "lora": "the LoRA shape (rank, alpha or targets) differs: set LoRA Config as the state was trained",
            "validation": "the images held out for validation differ (validation_fraction or seed changed): set "
                          "them as the state was trained, so it trains on the same images"}
    for key in checks:
        if state.fingerprints.get(key) != fingerprints.get(key):
            why = what[key]
            raise LeanLoRAError(f"cannot resume from {path.name}: {why}")
    if state.step >= total_steps:
        raise LeanLoRAError(f"cannot resume from {path.name}: it has trained {state.step} steps already, and Train "
                            f"asks for {total_steps}: raise steps above {state.step} to train further")
