"""Folder -> samples. Scans a folder of images with captions without decoding the images (lazy); images are
decoded one at a time, resized and center-cropped, only when they are encoded into the cache."""
from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import LeanLoRAError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
CAPTION_CSV = "metadata.csv"  # columns file_name,text (the lora-scripts / Hugging Face imagefolder layout)


@dataclass(frozen=True)
class Sample:
    path: Path
    caption: str


@dataclass(frozen=True)
class Dataset:
    folder: Path
    samples: tuple[Sample, ...]
    resolution: int
    repeats: int = 1
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (file name, reason)

    def summary(self) -> str:
        lines = [f"{len(self.samples)} images x {self.repeats} repeats from {self.folder} at {self.resolution}px"]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _read_caption_csv(folder: Path) -> dict[str, str]:
    path = folder / CAPTION_CSV
    if not path.is_file():
        return {}
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"file_name", "text"} <= set(reader.fieldnames):
            raise LeanLoRAError(f"{path}: the header must be 'file_name,text' (found {reader.fieldnames}); "
                                "fix the header or delete the file and use <image>.txt captions")
        return {row["file_name"].strip(): (row["text"] or "").strip() for row in reader if row.get("file_name")}


def _check_image(path: Path) -> str | None:
    """Returns why the file cannot be used, or None. Reads the header only (no full decode)."""
    try:
        with Image.open(path) as image:
            image.verify()
            if min(image.size) < 8:
                return f"too small ({image.size[0]}x{image.size[1]})"
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        return f"not a readable image ({error.__class__.__name__})"
    return None


def scan_folder(folder: str | Path, resolution: int, repeats: int = 1, trigger_word: str = "") -> Dataset:
    """Finds images and their captions: `<image>.txt` next to the image wins, then `metadata.csv`."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LeanLoRAError(f"dataset folder {folder} does not exist or is not a folder; give an absolute path "
                            "or a folder name inside ComfyUI's input folder")
    if resolution < 64 or resolution % 64:
        raise LeanLoRAError(f"resolution: got {resolution}; use a multiple of 64 (512 for SD1.5, 1024 for SDXL)")
    if repeats < 1:
        raise LeanLoRAError(f"repeats: got {repeats}; use 1 or more")

    csv_captions = _read_caption_csv(folder)
    trigger = trigger_word.strip()
    samples, skipped = [], []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        if path.suffix.lower() in (".txt", ".csv", ".json", ".toml", ".yaml", ".npz", ".safetensors"):
            continue  # captions and caches, not candidates
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            skipped.append((path.name, f"extension {path.suffix or '(none)'} is not one of {', '.join(IMAGE_EXTENSIONS)}"))
            continue
        problem = _check_image(path)
        if problem:
            skipped.append((path.name, problem))
            continue
        sidecar = path.with_suffix(".txt")
        caption = sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else csv_captions.get(path.name, "")
        if trigger:
            caption = f"{trigger}, {caption}" if caption else trigger
        samples.append(Sample(path, caption))

    if not samples:
        if not skipped:
            raise LeanLoRAError(f"dataset folder {folder} is empty; put images ({', '.join(IMAGE_EXTENSIONS)}) "
                                "with <image>.txt captions or a metadata.csv into it")
        details = "; ".join(f"{name}: {reason}" for name, reason in skipped[:5])
        raise LeanLoRAError(f"dataset folder {folder} has no usable images ({len(skipped)} files skipped: {details}); "
                            f"add images ({', '.join(IMAGE_EXTENSIONS)})")
    return Dataset(folder, tuple(samples), resolution, repeats, tuple(skipped))


def load_image(path: Path, resolution: int) -> torch.Tensor:
    """Decodes one image as float [H, W, 3] in 0..1 (ComfyUI's IMAGE layout): shorter side scaled to
    `resolution`, then center-cropped square. EXIF rotation is honoured; alpha is dropped."""
    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise LeanLoRAError(f"{path}: cannot decode image ({error}); remove or replace the file") from error
    scale = resolution / min(image.size)
    size = (max(resolution, round(image.width * scale)), max(resolution, round(image.height * scale)))
    image = image.resize(size, Image.Resampling.LANCZOS)
    left, top = (image.width - resolution) // 2, (image.height - resolution) // 2
    image = image.crop((left, top, left + resolution, top + resolution))
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(resolution, resolution, 3).float() / 255.0
