"""Names from workflows are untrusted (shared workflows can be hostile): every file LeanLoRA writes gets a
sanitized name inside a folder it was given, and is written atomically (temp file + rename)."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

_UNSAFE = re.compile(r"[^A-Za-z0-9._ -]+")
_UMASK = os.umask(0)
os.umask(_UMASK)


def sanitize_name(name: str, default: str = "leanlora") -> str:
    """A plain file stem: no folders, no '..', no leading dots or spaces, at most 100 characters."""
    stem = Path(str(name).replace("\\", "/")).name
    for suffix in (".safetensors", ".ckpt", ".pt"):
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
    stem = _UNSAFE.sub("_", stem).strip(" .")[:100].strip(" .")
    return stem or default


def unused_path(folder: Path, stem: str, suffix: str = ".safetensors") -> Path:
    """`stem.safetensors`, or `stem_2.safetensors`, ... : a new run never overwrites an earlier LoRA."""
    candidate, n = folder / f"{stem}{suffix}", 2
    while candidate.exists():
        candidate, n = folder / f"{stem}_{n}{suffix}", n + 1
    return candidate


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".leanlora-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; a LoRA should be readable like any saved file
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
