"""Names from workflows are untrusted (shared workflows can be hostile): every file LeanLoRA writes gets a
sanitized name inside a folder it was given, and is written atomically (temp file + rename). A LoRA whose folder
fails at save time (read-only, disk full) goes to a fallback folder instead of being lost."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import unicodedata
from pathlib import Path
from typing import Callable

import torch
import safetensors.torch
from safetensors import SafetensorError

from .errors import LeanLoRAError, one_line

_UMASK = os.umask(0)
os.umask(_UMASK)
# Windows refuses these characters and device names in file names (a LoRA folder may be shared with Windows).
_WINDOWS_RESERVED_CHARS = set('<>:"/\\|?*')
_WINDOWS_RESERVED_NAMES = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
MAX_STEM_CHARS, MAX_STEM_BYTES = 100, 150  # file systems limit names to 255 bytes; suffixes like _partial_step need room
SAVE_ERRORS = (OSError, SafetensorError)  # read-only folder, disk full (safetensors reports it as SafetensorError)


def _allowed(char: str) -> bool:
    """Letters, digits and combining marks of any script, and `._ -`; never control or reserved characters."""
    if char in "._ -":
        return True
    return char not in _WINDOWS_RESERVED_CHARS and unicodedata.category(char)[0] in "LNM"


def sanitize_name(name: str, default: str = "leanlora") -> str:
    """A plain file stem: no folders, no '..', no leading dots or spaces, no control or Windows-reserved
    characters or device names, at most 100 characters / 150 UTF-8 bytes. Letters of every script are kept."""
    stem = Path(unicodedata.normalize("NFC", str(name)).replace("\\", "/")).name
    for suffix in (".safetensors", ".ckpt", ".pt"):
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
    kept: list[str] = []
    for char in stem:
        if _allowed(char):
            kept.append(char)
        elif not kept or kept[-1] != "_":  # a run of unsafe characters becomes one "_"
            kept.append("_")
    stem = "".join(kept).strip(" .")[:MAX_STEM_CHARS]
    while len(stem.encode("utf-8")) > MAX_STEM_BYTES:
        stem = stem[:-1]
    stem = stem.strip(" .")
    if stem.split(".")[0].upper() in _WINDOWS_RESERVED_NAMES:
        stem = f"_{stem}"
    return stem or default


def unused_path(folder: Path, stem: str, suffix: str = ".safetensors") -> Path:
    """`stem.safetensors`, or `stem_2.safetensors`, ... : a new run never overwrites an earlier LoRA."""
    candidate, n = folder / f"{stem}{suffix}", 2
    while candidate.exists():
        candidate, n = folder / f"{stem}_{n}{suffix}", n + 1
    return candidate


def new_folder(path: Path) -> Path:
    """Creates and returns `path`, or `path_2`, `path_3`, ...: the first that did not exist. mkdir is atomic, so
    two runs never get the same folder and a run never writes over an earlier run's files (its samples)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = path, 2
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            candidate, n = path.with_name(f"{path.name}_{n}"), n + 1


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    return write_atomic(path, lambda tmp: write_safetensors(tensors, tmp, metadata))


def write_safetensors(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
    Path(filename).write_bytes(safetensors_bytes(tensors, metadata or {}))


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors file, its header written with sorted keys: safetensors writes its metadata map in no fixed
    order, so equal content gave files of other bytes (and another whole-file hash, the AutoV2 hash A1111 and
    civitai show). The tensor data and offsets are safetensors' own."""
    blob = safetensors.torch.save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    length = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8:8 + length]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data stays 8-byte aligned, as safetensors pads it
    return len(header).to_bytes(8, "little") + header + blob[8 + length:]


def write_atomic(path: Path, write: Callable[[str], None]) -> Path:
    """`write(temp path)` fills a temp file next to `path`, which is then renamed into place: `path` is either the
    old file or the complete new one, never half written; a failed write leaves no temp file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".leanlora-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a saved file should be readable like any other
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def check_writable(folder: Path, need_bytes: int, what: str) -> None:
    """Before any training: a file can be created in `folder` and it has room for `need_bytes` (with margin).
    Raises LeanLoRAError naming the folder and the fix."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".leanlora-probe-", suffix=".tmp", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise LeanLoRAError(f"cannot write to the {what} {folder} ({one_line(error)}): make it writable for the "
                            "user running ComfyUI (or free it from a read-only mount) and queue again") from error
    free = shutil.disk_usage(folder).free
    if free < 2 * need_bytes:
        raise LeanLoRAError(f"the {what} {folder} has {free / 2 ** 20:.1f} MiB free; the LoRA needs about "
                            f"{need_bytes / 2 ** 20:.1f} MiB: free some space on that disk and queue again")


def save_with_fallback(tensors: dict[str, torch.Tensor], folder: Path, stem: str, metadata: dict[str, str],
                       fallback: Path | None) -> tuple[Path, str | None]:
    """Saves `stem` (never overwriting) into `folder`; where that fails, into `fallback`. Returns the path and,
    after a fallback, a note saying why and where. Raises LeanLoRAError naming both folders if both fail."""
    path = unused_path(folder, stem)
    try:
        return save_safetensors_atomic(tensors, path, metadata), None
    except SAVE_ERRORS as error:
        first = error
    if fallback is None:
        raise LeanLoRAError(f"could not save the LoRA to {path} ({one_line(first)})") from first
    spare = unused_path(fallback, stem)
    try:
        save_safetensors_atomic(tensors, spare, metadata)
    except SAVE_ERRORS as error:
        raise LeanLoRAError(f"could not save the LoRA to {path} ({one_line(first)}) nor to the fallback {spare} "
                            f"({one_line(error)}): free space or fix the folders' permissions") from first
    return spare, (f"WARNING: could not save to {path} ({one_line(first)}); the LoRA was saved to {spare} "
                   f"instead: move it into your loras folder to use it in Load LoRA")


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors holding NaN/inf: such weights are never saved or applied (they render black)."""
    return [name for name, tensor in tensors.items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
