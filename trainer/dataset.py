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


BUCKET_STEP = 64      # pixel sizes stay multiples of 64: latents of SD UNets must divide by 8 three times
MAX_BUCKET_ASPECT = 4.0


@dataclass(frozen=True)
class Sample:
    path: Path
    caption: str
    size: tuple[int, int] = (0, 0)  # original (width, height), read from the header


def bucket_size(width: int, height: int, resolution: int) -> tuple[int, int]:
    """The (width, height) an image trains at with aspect-ratio buckets: its own aspect (clamped to 1:4..4:1),
    an area of at most resolution², both sides rounded down to multiples of 64 so the image is never upscaled
    (when it is at least 64 px on each side) and only a thin border is cropped."""
    aspect = min(max(width / height, 1 / MAX_BUCKET_ASPECT), MAX_BUCKET_ASPECT)
    area = min(resolution * resolution, width * height)
    ideal_width = (area * aspect) ** 0.5
    snap = lambda side: max(BUCKET_STEP, int(side // BUCKET_STEP) * BUCKET_STEP)  # noqa: E731
    return snap(ideal_width), snap(area / ideal_width)


@dataclass(frozen=True)
class Dataset:
    folder: Path
    samples: tuple[Sample, ...]
    resolution: int
    repeats: int = 1
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (file name, reason)
    buckets: bool = False  # aspect-ratio buckets instead of square center crops

    def target_size(self, sample: Sample) -> tuple[int, int]:
        if not self.buckets:
            return self.resolution, self.resolution
        return bucket_size(*sample.size, self.resolution)

    def summary(self) -> str:
        shape = "aspect-ratio buckets up to" if self.buckets else "square crops of"
        lines = [f"{len(self.samples)} images x {self.repeats} repeats from {self.folder}, {shape} {self.resolution}px"]
        if self.buckets:
            sizes: dict[tuple[int, int], int] = {}
            for sample in self.samples:
                sizes[self.target_size(sample)] = sizes.get(self.target_size(sample), 0) + 1
            lines.append("  buckets: " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(sizes.items())))
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


def _check_image(path: Path) -> tuple[str | None, tuple[int, int]]:
    """(why the file cannot be used or None, its upright (width, height)). Reads the header only."""
    try:
        with Image.open(path) as image:
            image.verify()  # must come straight after open; it invalidates the image object
        with Image.open(path) as image:
            size = image.size
            if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that swap the sides
                size = size[::-1]
            if min(size) < 8:
                return f"too small ({size[0]}x{size[1]})", size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        return f"not a readable image ({error.__class__.__name__})", (0, 0)
    return None, size


def scan_folder(folder: str | Path, resolution: int, repeats: int = 1, trigger_word: str = "",
                buckets: bool = False) -> Dataset:
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
        problem, size = _check_image(path)
        if problem:
            skipped.append((path.name, problem))
            continue
        sidecar = path.with_suffix(".txt")
        caption = sidecar.read_text(encoding="utf-8").strip() if sidecar.is_file() else csv_captions.get(path.name, "")
        if trigger:
            caption = f"{trigger}, {caption}" if caption else trigger
        samples.append(Sample(path, caption, size))

    if not samples:
        if not skipped:
            raise LeanLoRAError(f"dataset folder {folder} is empty; put images ({', '.join(IMAGE_EXTENSIONS)}) "
                                "with <image>.txt captions or a metadata.csv into it")
        details = "; ".join(f"{name}: {reason}" for name, reason in skipped[:5])
        raise LeanLoRAError(f"dataset folder {folder} has no usable images ({len(skipped)} files skipped: {details}); "
                            f"add images ({', '.join(IMAGE_EXTENSIONS)})")
    return Dataset(folder, tuple(samples), resolution, repeats, tuple(skipped), buckets)


def load_image(path: Path, size: int | tuple[int, int]) -> torch.Tensor:
    """Decodes one image as float [H, W, 3] in 0..1 (ComfyUI's IMAGE layout), scaled to cover `size` (an int
    for a square, or (width, height)) and center-cropped to it. EXIF rotation is honoured; alpha is dropped."""
    width, height = (size, size) if isinstance(size, int) else size
    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise LeanLoRAError(f"{path}: cannot decode image ({error}); remove or replace the file") from error
    scale = max(width / image.width, height / image.height)
    covering = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(covering, Image.Resampling.LANCZOS)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    image = image.crop((left, top, left + width, top + height))
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3).float() / 255.0
