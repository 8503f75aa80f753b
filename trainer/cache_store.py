"""Where encoded latents and text embeddings are kept between runs: a process-wide, bounded RAM layer (a re-queued
run in the same ComfyUI process re-uses its encodings) and an optional folder of small .safetensors files.

Entries are addressed by content: an image's key hashes its file bytes, its preprocessing and the encoder's
identity, a caption's key hashes the text, the target size and the encoder's identity. So a changed image,
preprocessing or model gets new keys (its old entries are never read again) and nothing needs invalidating."""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .files import save_safetensors_atomic

_KEY_VERSION = "leanlora-cache-v1"  # bump when what an entry holds changes; every old key then misses


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join((_KEY_VERSION, *parts)).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def image_key(path: Path, preprocess: str, encoder_id: str) -> str:
    return _digest("image", file_sha256(path), preprocess, encoder_id)


def text_key(caption: str, width: int, height: int, encoder_id: str) -> str:
    # SDXL's conditioning embeds the image size, so one caption at two sizes is two entries.
    return _digest("text", caption, f"{width}x{height}", encoder_id)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class RamCache:
    """Least-recently-used entries up to max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._bytes = 0

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        size = _nbytes(tensors)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= _nbytes(old)
        self._entries[key] = tensors
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= _nbytes(evicted)

    def __len__(self) -> int:
        return len(self._entries)


# ~1 MB per SDXL 1024² image (latent + text embedding): room for a couple of thousand images.
SHARED_RAM = RamCache(max_bytes=2 << 30)


class LatentTextStore:
    """get/put of small tensor dicts by key: RAM first, then the folder (when given). Entries are CPU tensors
    shared with the caller, who must not modify them in place. The folder is optional: when it cannot be
    written, the store says why once (`disk_problem`) and carries on in RAM."""

    def __init__(self, folder: Path | None = None, ram: RamCache | None = SHARED_RAM):
        self.folder = Path(folder) if folder is not None else None
        self.ram = ram
        self.disk_problem: str | None = None

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        entry = self.ram.get(key) if self.ram is not None else None
        if entry is not None:
            if self.folder is not None and not self._path(key).is_file():
                self._write(key, entry)  # encoded by a RAM-only run: kept on disk too, so a restart finds it
            return entry
        if self.folder is not None:
            entry = self._load(self._path(key))
            if entry is not None and self.ram is not None:
                self.ram.put(key, entry)
        return entry

    @staticmethod
    def _load(path: Path) -> dict[str, torch.Tensor] | None:
        """safetensors only (never pickle); a missing, truncated or corrupt file is a miss, rewritten by put."""
        try:
            return load_file(path) or None
        except (OSError, SafetensorError):
            return None

    def _write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.disk_problem is not None:
            return
        try:
            save_safetensors_atomic(tensors, self._path(key), {"format": _KEY_VERSION})
        except (OSError, SafetensorError) as error:
            self.disk_problem = (f"latent cache folder {self.folder} cannot be written ({error}); this run's "
                                 "encodings stay in RAM only")

    def put(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        if self.ram is not None:
            self.ram.put(key, tensors)
        if self.folder is not None:
            self._write(key, tensors)
