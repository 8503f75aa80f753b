"""Folder -> samples. Scans a folder of images with captions without decoding the images (lazy); images are
decoded one at a time, resized and center-cropped, only when they are encoded into the cache.

One bad file never stops a scan: it is skipped and listed with its reason (`Dataset.skipped`); what was read in
a way the user may not expect (a caption that is not UTF-8, transparency composited, a 16-bit image) is listed
as a note (`Dataset.notes`). Both appear in the training report."""
from __future__ import annotations

import csv
import hashlib
import io
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import LeanLoRAError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MASK_SUFFIX = "_mask.png"  # <image stem>_mask.png: white = the loss counts there, black = it does not
# Edit pairs (edit models: Qwen-Image-Edit, FLUX.1 Kontext): each target <stem>.<ext> has its control image(s) beside it
# as <stem>_control.<ext> (or <stem>_control1.<ext>, <stem>_control2.<ext>, ... for several), or in a control/
# subfolder under the target's own name (or the same _control<N> names)
CONTROL_SUFFIX = "_control"
CONTROL_FOLDER = "control"
PAIRS_LAYOUT = (f"each target image <name>.png with its control image beside it as <name>{CONTROL_SUFFIX}.png (several: "
                f"<name>{CONTROL_SUFFIX}1.png, <name>{CONTROL_SUFFIX}2.png) or as {CONTROL_FOLDER}/<name>.png, and the "
                "instruction as its caption (<name>.txt or metadata.csv)")
NOT_CANDIDATES = (".txt", ".csv", ".json", ".toml", ".yaml", ".npz", ".safetensors")  # captions and caches
CAPTION_CSV = "metadata.csv"  # columns file_name,text (the lora-scripts / Hugging Face imagefolder layout)

BUCKET_STEP = 64      # pixel sizes stay multiples of 64: latents of SD UNets must divide by 8 three times
MAX_BUCKET_ASPECT = 4.0
MAX_RESOLUTION = 4096  # also the node's widget limits: a value fed through a link is checked here
MAX_REPEATS = 1000     # repeats only shape the shuffle (steps set the length); more is never useful
# Larger images are skipped: above any camera's normal frame (a 100 MP sensor is 11648x8736), and a header that
# claims more is most likely a decompression bomb (a tiny file that would decode to gigabytes).
MAX_IMAGE_PIXELS = 150_000_000
# Transparent pixels are composited onto white (the usual background of cut-outs, logos and product shots)
# instead of training the arbitrary colours hidden under alpha 0.
ALPHA_BACKGROUND = (255, 255, 255)
_SIXTEEN_BIT_GREY = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # PIL's modes of 16-bit greyscale PNGs
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")

NOTE_SIXTEEN_BIT = "16-bit greyscale, scaled to 8 bits"
NOTE_ALPHA = "transparent pixels composited onto white"


class UnusableImage(LeanLoRAError):
    """An image that cannot be used (gone, unreadable, undecodable, too large): skipped and listed, not fatal."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}; remove or replace the file")
        self.path, self.reason = Path(path), reason


@dataclass(frozen=True)
class Sample:
    path: Path
    caption: str
    size: tuple[int, int] = (0, 0)  # original (width, height), read from the header
    controls: tuple[Path, ...] = ()  # an edit pair's control image(s), in order (control1, control2, ...)


def bucket_size(width: int, height: int, resolution: int) -> tuple[int, int]:
    """The (width, height) an image trains at with aspect-ratio buckets: its own aspect (clamped to 1:4..4:1),
    an area of at most resolution², both sides rounded down to multiples of 64 so the image is never upscaled
    (when it is at least 64 px on each side) and only a thin border is cropped."""
    aspect = min(max(width / height, 1 / MAX_BUCKET_ASPECT), MAX_BUCKET_ASPECT)
    area = min(resolution * resolution, width * height)
    ideal_width = (area * aspect) ** 0.5
    snap = lambda side: max(BUCKET_STEP, int(side // BUCKET_STEP) * BUCKET_STEP)  # noqa: E731
    return snap(ideal_width), snap(area / ideal_width)


def _grouped(entries: tuple[tuple[str, str], ...], limit: int = 8) -> list[str]:
    """Report lines for (subject, text) pairs: one line per text, naming its subjects (a few, then a count)."""
    by_text: dict[str, list[str]] = {}
    for subject, text in entries:
        by_text.setdefault(text, []).append(subject)
    lines = []
    for text, subjects in by_text.items():
        named = ", ".join(subjects[:limit]) + (f" and {len(subjects) - limit} more" if len(subjects) > limit else "")
        lines.append(f"  {named}: {text}")
    return lines


@dataclass(frozen=True)
class Confinement:
    """Files a workflow names must stay inside `root` once links are resolved (bridge/folder_policy.py says
    when); `why` says why and which setting lifts it, for the error."""
    root: Path
    why: str

    def leads_out(self, path: Path) -> bool:
        """Whether `path` (a link, or inside one) resolves to somewhere outside root; never opens the file."""
        return not Path(os.path.realpath(path)).is_relative_to(Path(os.path.realpath(self.root)))

    def links_out(self, entries) -> list[str]:
        """The names of the entries (paths in one folder) that are links leading out of root."""
        return [p.name for p in entries if p.is_symlink() and self.leads_out(p)]

    @property
    def link_reason(self) -> str:
        """Why one file is not read (a skipped image's reason)."""
        return (f"a link to a file outside ComfyUI's input folder ({self.root}), which this server does not read; "
                f"replace it with a copy of the file. Why: {self.why}")

    def refusal(self, folder: Path, names: list[str]) -> str:
        listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        one = len(names) == 1
        return (f"dataset folder {folder}: {listed} {'is a link' if one else 'are links'} to "
                f"{'a file' if one else 'files'} outside ComfyUI's input folder ({self.root}), which this server "
                f"does not read; replace {'it' if one else 'each'} with a copy of the file. Why: {self.why}")


@dataclass(frozen=True)
class Dataset:
    folder: Path
    samples: tuple[Sample, ...]
    resolution: int
    repeats: int = 1
    skipped: tuple[tuple[str, str], ...] = field(default=())  # (file name, reason)
    buckets: bool = False  # aspect-ratio buckets instead of square center crops
    notes: tuple[tuple[str, str], ...] = field(default=())  # (file name or "metadata.csv line N", what was done)
    confinement: Confinement | None = None  # checked again when each image is read (cache.build_cache)
    trigger_word: str = ""  # first in every caption; caption options (captions.py) never move or drop it
    pairs: bool = False  # edit pairs: every sample has its control image(s) (PAIRS_LAYOUT)

    def __post_init__(self):
        check_numbers(self.resolution, self.repeats)

    def target_size(self, sample: Sample) -> tuple[int, int]:
        if not self.buckets:
            return self.resolution, self.resolution
        return bucket_size(*sample.size, self.resolution)

    def summary(self) -> str:
        shape = "aspect-ratio buckets up to" if self.buckets else "square crops of"
        what = f"{len(self.samples)} images"
        if self.pairs:
            counts = sorted({len(sample.controls) for sample in self.samples})
            what = (f"{len(self.samples)} edit pairs (target + "
                    + "/".join(str(n) for n in counts) + f" control image{'s' if counts != [1] else ''})")
        lines = [f"{what} x {self.repeats} repeats from {self.folder}, {shape} {self.resolution}px"]
        if self.buckets:
            sizes: dict[tuple[int, int], int] = {}
            for sample in self.samples:
                sizes[self.target_size(sample)] = sizes.get(self.target_size(sample), 0) + 1
            lines.append("  buckets: " + ", ".join(f"{w}x{h}: {n}" for (w, h), n in sorted(sizes.items())))
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        if self.notes:
            lines += ["  notes:", *("  " + line for line in _grouped(self.notes))]
        return "\n".join(lines)


def check_numbers(resolution: int, repeats: int) -> None:
    """Bounds for values that may come through a link, which skips the widgets' own limits."""
    if not 64 <= resolution <= MAX_RESOLUTION or resolution % 64:
        raise LeanLoRAError(f"resolution: got {resolution}; use a multiple of 64 up to {MAX_RESOLUTION} "
                            "(512 for SD1.5, 1024 for SDXL)")
    if not 1 <= repeats <= MAX_REPEATS:
        raise LeanLoRAError(f"repeats: got {repeats}; use 1 to {MAX_REPEATS} (repeats only decide how often an "
                            "image comes up per epoch; train longer with more steps)")


def resolve_folder(folder: str, input_dir: str | Path, confined: str | None = None) -> Path:
    """The Dataset node's folder: an absolute path (or ~/...) as given, a relative one inside ComfyUI's input
    folder. An empty string or a relative path that climbs out of input/ ('..') is an error, never input/
    itself or a folder elsewhere. `confined` (the reason, for the message): the folder, symlinks resolved, must
    be inside input/ (a server others can reach: bridge/folder_policy.py)."""
    path = _resolve_folder(folder, input_dir)
    if confined is not None:
        real_input = Path(os.path.realpath(input_dir))
        real = Path(os.path.realpath(path))
        if real == real_input or not real.is_relative_to(real_input):
            link = f" (a link to {real})" if real != path else ""
            raise LeanLoRAError(f"folder {folder.strip()!r}{link} is outside ComfyUI's input folder ({input_dir}): "
                                f"{confined}")
    return path


NAME_MAX, PATH_MAX = 255, 4095  # bytes of one path part and of a whole path that file systems hold (Linux's)


def _resolve_folder(folder: str, input_dir: str | Path) -> Path:
    if not isinstance(folder, str):  # an API prompt or another node's output can send any JSON value
        raise LeanLoRAError(f"folder: got the {type(folder).__name__} {folder!r:.80}, not a folder name; give a folder "
                            f"name inside ComfyUI's input folder ({input_dir}) or an absolute path")
    text = folder.strip()
    input_dir = Path(os.path.normpath(input_dir))
    longest = max((len(part.encode(errors="surrogateescape")) for part in text.split(os.sep)), default=0)
    if longest > NAME_MAX or len(os.path.join(input_dir, text).encode(errors="surrogateescape")) > PATH_MAX:
        raise LeanLoRAError(f"folder {text[:60]!r}... is {len(text):,} characters long, beyond what a file system "
                            f"holds ({NAME_MAX} bytes a name, {PATH_MAX} a path), so no such folder exists; pick a "
                            "folder from the list or type its path")
    if not text:
        raise LeanLoRAError(f"folder is empty; give a folder name inside ComfyUI's input folder ({input_dir}) "
                            "or an absolute path")
    if "\x00" in text:  # no path holds one; os.path.realpath would raise ValueError on it
        raise LeanLoRAError(f"folder {text!r} holds a NUL character, which no path can; type the folder's name "
                            "again")
    try:
        path = Path(text).expanduser()
    except RuntimeError as error:  # "~name" of a user this machine does not know
        raise LeanLoRAError(f"folder {text!r}: {error}; give an absolute path or a folder name inside ComfyUI's "
                            f"input folder ({input_dir})") from None
    if path.is_absolute():
        return path
    inside = Path(os.path.normpath(input_dir / path))
    if inside == input_dir or not inside.is_relative_to(input_dir):
        where = "is ComfyUI's input folder itself" if inside == input_dir else "leads out of ComfyUI's input folder"
        raise LeanLoRAError(f"folder {text!r} {where} ({input_dir}); a relative folder must name a folder inside "
                            "it (give an absolute path for a folder elsewhere)")
    return inside


def folder_fingerprint(folder: Path, confinement: Confinement | None = None) -> str:
    """Changes whenever a scan of the folder could: a file added, removed, renamed or rewritten (name, size,
    modification time), and any change to a caption file's text even within the clock's resolution. A link
    leading out of `confinement` counts by its own name and target, never by what it points to. An edit-pairs
    folder's control/ subfolder counts too."""
    digest = hashlib.sha256(str(folder).encode())
    try:
        with os.scandir(folder) as listing:
            entries = sorted(listing, key=lambda entry: entry.name)
    except OSError as error:
        return f"unreadable: {error}"  # scan_folder raises the clear error
    _fingerprint_entries(digest, entries, confinement)
    controls = Path(folder) / CONTROL_FOLDER
    if controls.is_dir() and not (confinement is not None and confinement.leads_out(controls)):
        try:
            with os.scandir(controls) as listing:
                _fingerprint_entries(digest, sorted(listing, key=lambda entry: entry.name), confinement, "control/")
        except OSError as error:
            digest.update(f"control/\0unreadable\0{error}".encode())
    return digest.hexdigest()


def _fingerprint_entries(digest, entries, confinement: Confinement | None, prefix: str = "") -> None:
    for entry in entries:
        try:
            if confinement is not None and entry.is_symlink() and confinement.leads_out(Path(entry.path)):
                digest.update(f"{prefix}{entry.name}\0link\0{os.readlink(entry.path)}\0".encode())
                continue
            if not entry.is_file():
                continue
            stat = entry.stat()
            digest.update(f"{prefix}{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
            if Path(entry.name).suffix.lower() in (".txt", ".csv") and stat.st_size <= 1 << 20:
                digest.update(Path(entry.path).read_bytes())
        except OSError:
            digest.update(f"{prefix}{entry.name}\0gone\0".encode())


def _decode_text(data: bytes) -> tuple[str, str | None]:
    """(text, note): UTF-8 (a BOM allowed); else Windows-1252, what Windows editors write as "ANSI" (every
    byte decodes as Latin-1 if even that fails), with a note saying so and where the first non-UTF-8 byte is."""
    try:
        return data.decode("utf-8-sig"), None
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        for encoding, label in (("cp1252", "Windows-1252"), ("latin-1", "Latin-1")):
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError:
                continue
            return text, (f"not UTF-8 (byte 0x{data[error.start]:02x} on line {line}), read as {label}; "
                          "save it as UTF-8 if accented letters look wrong")
    raise AssertionError("latin-1 decodes every byte")  # pragma: no cover


@dataclass(frozen=True)
class _CsvCaption:
    text: str
    line: int


def _read_caption_csv(folder: Path, notes: list[tuple[str, str]]) -> dict[str, _CsvCaption]:
    """file name -> caption from metadata.csv. A row that cannot be used is listed in `notes`; quotes that
    break the file's structure (rows after them would be swallowed) are an error naming the line."""
    path = folder / CAPTION_CSV
    if not path.is_file():
        return {}
    try:
        text, note = _decode_text(path.read_bytes())
    except OSError as error:
        raise LeanLoRAError(f"{path}: cannot be read ({error.strerror or error}); fix its permissions or delete "
                            "it and use <image>.txt captions") from error
    if note:
        notes.append((CAPTION_CSV, note))
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    header = None
    captions: dict[str, _CsvCaption] = {}
    while True:
        line = reader.line_num + 1  # where the next row starts (a quoted caption may span lines)
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as error:
            if "field larger than field limit" in str(error):
                notes.append((f"{CAPTION_CSV} line {line}", f"a field is over {csv.field_size_limit():,} characters; "
                                                            "row ignored"))
                continue
            unclosed = "end of data" in str(error)
            raise LeanLoRAError(
                f"{path} line {line}: " + ("a quote opened in this row is never closed" if unclosed else
                                           f"broken quotes ({error})") +
                "; a caption in quotes must end with a quote and write a quote inside it as \"\" (or use no "
                "quotes at all)") from error
        if header is None:
            header = [name.strip() for name in row]
            if not {"file_name", "text"} <= set(header):
                raise LeanLoRAError(f"{path}: the header must be 'file_name,text' (found {header}); "
                                    "fix the header or delete the file and use <image>.txt captions")
            name_at, text_at = header.index("file_name"), header.index("text")
            continue
        if not any(value.strip() for value in row):
            continue
        if len(row) > len(header):
            if text_at != len(header) - 1:
                notes.append((f"{CAPTION_CSV} line {line}", f"{len(row)} fields for {len(header)} columns; row "
                                                            "ignored (put captions with commas in double quotes)"))
                continue
            row = row[:text_at] + [",".join(row[text_at:])]
            notes.append((f"{CAPTION_CSV} line {line}", "unquoted commas kept as part of the caption"))
        name = row[name_at].strip() if name_at < len(row) else ""
        if not name:
            notes.append((f"{CAPTION_CSV} line {line}", "no file_name; row ignored"))
            continue
        if name in captions:
            notes.append((f"{CAPTION_CSV} line {line}", f"{name} is listed again (first on line "
                                                        f"{captions[name].line}); this later caption is used"))
        captions[name] = _CsvCaption((row[text_at] if text_at < len(row) else "").strip(), line)
    if header is None:
        notes.append((CAPTION_CSV, "empty; not used"))
    return captions


def _swallowed_row(caption: _CsvCaption, image_names: set[str]) -> str | None:
    """A multi-line caption holding a line that starts like another row ("img_003.png,..."): an opening quote
    was not closed where the user meant it to be, and the rows up to the next quote were swallowed."""
    for continuation in caption.text.splitlines()[1:]:
        first = continuation.split(",", 1)[0].strip()
        if "," in continuation and first.casefold() in image_names:
            return first
    return None


def _match_ignoring_case(names, wanted: str, exact_owners: set[str]) -> str | None:
    """The one key of `names` equal to `wanted` ignoring case, unless that is ambiguous: two such keys, or the
    key is exactly another file's own name."""
    folded = [name for name in names if name.casefold() == wanted.casefold()]
    return folded[0] if len(folded) == 1 and folded[0] not in exact_owners else None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB of any mode PIL opens: 16-bit greyscale scaled to 8 bits (PIL's own convert clips it to white),
    transparency composited onto ALPHA_BACKGROUND (PIL's own convert drops alpha, keeping hidden colours)."""
    if image.mode in _SIXTEEN_BIT_GREY:
        return image.convert("I").point(lambda value: value / 257 + 0.5).convert("L").convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _too_large(size: tuple[int, int]) -> str | None:
    width, height = size
    if width * height > MAX_IMAGE_PIXELS:
        return (f"too large ({width}x{height} = {width * height / 1e6:,.0f} megapixels; the limit is "
                f"{MAX_IMAGE_PIXELS / 1e6:.0f}, a guard against decompression bombs); downscale it")
    return None


def _os_reason(error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return "no longer exists (deleted or moved after the folder was scanned)"
    return f"cannot be read ({error.strerror or error})"


def _check_image(path: Path) -> tuple[str | None, tuple[int, int], list[str]]:
    """(why the file cannot be used or None, its upright (width, height), notes on its conversion). Reads the
    header, checks the file's structure; JPEGs are also decoded at 1/8 scale (cheap) to catch truncation."""
    try:
        with warnings.catch_warnings():  # our own pixel limit decides, whatever PIL's global one is
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                if problem := _too_large(image.size):
                    return problem, image.size, []
                image.verify()  # must come straight after open; it invalidates the image object
            with Image.open(path) as image:
                size = image.size
                if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that swap the sides
                    size = size[::-1]
                if min(size) < 8:
                    return f"too small ({size[0]}x{size[1]})", size, []
                notes = [NOTE_SIXTEEN_BIT] if image.mode in _SIXTEEN_BIT_GREY else []
                if image.mode in _ALPHA_MODES or "transparency" in image.info:
                    notes.append(NOTE_ALPHA)
                if image.format == "JPEG":  # verify() does not read a JPEG's image data; a truncated one passes
                    image.draft("RGB", (max(1, image.width // 8), max(1, image.height // 8)))
                    image.load()
    except Image.DecompressionBombError as error:
        return f"too large ({error}); downscale it", (0, 0), []
    except (FileNotFoundError, PermissionError) as error:
        return _os_reason(error), (0, 0), []
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        detail = f": {error}" if str(error) else ""
        return f"not a readable image ({error.__class__.__name__}{detail})", (0, 0), []
    return None, size, notes


def scan_folder(folder: str | Path, resolution: int, repeats: int = 1, trigger_word: str = "",
                buckets: bool = False, confinement: Confinement | None = None) -> Dataset:
    """Finds images and their captions: `<image>.txt` next to the image wins, then `metadata.csv`; a caption
    whose name differs from its image's only in case is matched when that is unambiguous. With `confinement`,
    a folder holding a link that leads out of its root (an image, a caption, metadata.csv, anything) is an
    error before any file is opened: a link planted in a dataset folder must not read /etc or ~/.ssh."""
    try:
        folder = Path(folder).expanduser()
    except RuntimeError as error:
        raise LeanLoRAError(f"dataset folder {folder}: {error}; give an absolute path") from None
    if not folder.is_dir():
        raise LeanLoRAError(f"dataset folder {folder} does not exist or is not a folder; give an absolute path "
                            "or a folder name inside ComfyUI's input folder")
    check_numbers(resolution, repeats)  # before the scan, which may take a while

    try:
        entries = sorted(folder.iterdir())
    except OSError as error:
        raise LeanLoRAError(f"dataset folder {folder} cannot be listed ({error.strerror or error}); fix its "
                            "permissions") from error
    if confinement is not None:
        if leaving := confinement.links_out(entries):
            raise LeanLoRAError(confinement.refusal(folder, leaving))
    notes: list[tuple[str, str]] = []
    csv_captions = _read_caption_csv(folder, notes)
    files = [p for p in entries if p.is_file()]
    # a link to nothing (or to what cannot be read) is not silently dropped: it is listed with its reason
    broken = [(p.name, "a link to a file that does not exist") for p in entries if p.is_symlink() and not p.exists()]
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    # <image>_mask.png beside an image is its loss mask (masked_loss), never a training image itself
    stems = {p.stem for p in images}
    masks = {p for p in images if p.name.endswith(MASK_SUFFIX) and p.name[:-len(MASK_SUFFIX)] in stems}
    notes += [(p.name, f"the loss mask of {p.name[:-len(MASK_SUFFIX)]} (used with masked_loss), not a training "
                       "image") for p in sorted(masks)]
    images = [p for p in images if p not in masks]
    files = [p for p in files if p not in masks]
    controls, unmatched = _find_controls(folder, images, confinement)
    pairs = bool(controls)
    if pairs:  # control images are never targets; those of no target are listed
        beside = {c for found in controls.values() for c in found} | {p for p, _ in unmatched}
        images = [p for p in images if p not in beside]
        files = [p for p in files if p not in beside]
    folded_image_count: dict[str, int] = {}
    for p in images:
        folded_image_count[p.name.casefold()] = folded_image_count.get(p.name.casefold(), 0) + 1
    sidecars = {p.name: p for p in files if p.suffix.lower() == ".txt"}
    for name, caption in csv_captions.items():
        if swallowed := _swallowed_row(caption, set(folded_image_count)):
            raise LeanLoRAError(f"{folder / CAPTION_CSV} line {caption.line}: the caption of {name} runs over "
                                f"into the row of {swallowed} (a quote opened on line {caption.line} closes "
                                "later); close it on its own line, and write a quote inside a caption as \"\"")

    trigger = trigger_word.strip()
    samples, skipped = [], list(broken)
    skipped += [(_control_name(folder, p), reason) for p, reason in unmatched]
    used_sidecars, used_rows = set(), set()
    own_sidecars, own_names = {f"{p.stem}.txt" for p in images}, {p.name for p in images}
    for path in files:
        if path.suffix.lower() in NOT_CANDIDATES:
            continue
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            skipped.append((path.name, f"extension {path.suffix or '(none)'} is not one of {', '.join(IMAGE_EXTENSIONS)}"))
            continue
        sidecar = f"{path.stem}.txt"
        if sidecar not in sidecars:
            sidecar = _match_ignoring_case(sidecars, sidecar, own_sidecars)
        row = path.name if path.name in csv_captions else None
        if row is None and folded_image_count[path.name.casefold()] == 1:  # IMG_1.PNG and img_1.png: ambiguous
            row = _match_ignoring_case(csv_captions, path.name, own_names)
        used_sidecars.add(sidecar)
        used_rows.add(row)

        problem, size, image_notes = _check_image(path)
        if problem:
            skipped.append((path.name, problem))
            continue
        notes += [(path.name, note) for note in image_notes]
        own_controls = controls.get(path, ())
        if pairs:
            if not own_controls:
                skipped.append((path.name, f"no control image ({path.stem}{CONTROL_SUFFIX}{path.suffix} beside it or "
                                           f"{CONTROL_FOLDER}/{path.name}); in a folder of edit pairs every target "
                                           "needs one"))
                continue
            if bad := next(((c, _check_image(c)[0]) for c in own_controls if _check_image(c)[0]), None):
                skipped.append((path.name, f"its control image {_control_name(folder, bad[0])} is unusable: {bad[1]}"))
                continue
        if sidecar is not None:
            try:
                caption, note = _decode_text(sidecars[sidecar].read_bytes())
            except OSError as error:
                skipped.append((path.name, f"its caption {sidecar} {_os_reason(error)}"))
                continue
            notes += [(sidecar, note)] if note else []
            notes += [(sidecar, "caption matched ignoring case")] if sidecar != f"{path.stem}.txt" else []
        elif row is not None:
            caption = csv_captions[row].text
            notes += [(f"{CAPTION_CSV} line {csv_captions[row].line} ({row})", "caption matched ignoring case")
                      ] if row != path.name else []
        else:
            caption = ""
        caption = caption.strip()
        if trigger:
            caption = f"{trigger}, {caption}" if caption else trigger
        samples.append(Sample(path, caption, size, own_controls))
    notes += [(name, "caption file matches no image; not used") for name in sidecars if name not in used_sidecars]
    notes += [(f"{CAPTION_CSV} line {row.line} ({name})", "file_name matches no image in the folder; not used")
              for name, row in csv_captions.items() if name not in used_rows]

    if pairs and not samples:
        details = "; ".join(f"{name}: {reason}" for name, reason in skipped[:5])
        raise LeanLoRAError(f"dataset folder {folder} has control images but no usable edit pair ({details}); lay it "
                            f"out as {PAIRS_LAYOUT}")
    if not samples:
        if not skipped:
            raise LeanLoRAError(f"dataset folder {folder} is empty; put images ({', '.join(IMAGE_EXTENSIONS)}) "
                                "with <image>.txt captions or a metadata.csv into it")
        details = "; ".join(f"{name}: {reason}" for name, reason in skipped[:5])
        raise LeanLoRAError(f"dataset folder {folder} has no usable images ({len(skipped)} files skipped: {details}); "
                            f"add images ({', '.join(IMAGE_EXTENSIONS)})")
    return Dataset(folder, tuple(samples), resolution, repeats, tuple(skipped), buckets, tuple(notes), confinement,
                   trigger, pairs)


_CONTROL_STEM = re.compile(rf"(.+){CONTROL_SUFFIX}(\d*)", re.IGNORECASE)


def _control_name(folder: Path, path: Path) -> str:
    return path.name if path.parent == folder else f"{CONTROL_FOLDER}/{path.name}"


def _find_controls(folder: Path, images: list[Path], confinement: Confinement | None
                   ) -> tuple[dict[Path, tuple[Path, ...]], list[tuple[Path, str]]]:
    """({target: its control images in order}, [(control image of no target, why)]). A control is
    <stem>_control[N].<ext> beside target <stem>.<ext>, or in control/ as <stem>.<ext> or <stem>_control[N].<ext>;
    "_control" comes before "_control1". Empty unless at least one control has its target (a plain folder's
    "x_control.png" without an "x.png" stays an ordinary image)."""
    targets = {p.stem: p for p in images if not _CONTROL_STEM.fullmatch(p.stem)}
    found: dict[Path, list[tuple[int, Path]]] = {}
    unmatched: list[tuple[Path, str]] = []
    candidates = [(p, False) for p in images if p.stem not in targets]
    subfolder = folder / CONTROL_FOLDER
    if subfolder.is_dir():
        try:
            entries = sorted(subfolder.iterdir())
        except OSError as error:
            raise LeanLoRAError(f"the control folder {subfolder} cannot be listed ({error.strerror or error}); fix "
                                "its permissions") from error
        if confinement is not None and (leaving := confinement.links_out(entries)):
            raise LeanLoRAError(confinement.refusal(subfolder, leaving))
        candidates += [(p, True) for p in entries if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]
    for path, inside in candidates:
        match = _CONTROL_STEM.fullmatch(path.stem)
        stem, order = (match[1], int(match[2] or 0)) if match else (path.stem, 0)
        target = targets.get(stem)
        if target is None:
            unmatched.append((path, f"a control image whose target {stem}.<png/jpg/...> is not in the folder; not used"))
            continue
        found.setdefault(target, []).append((order, path))
    controls = {}
    for target, entries in found.items():
        orders = [order for order, _ in entries]
        if len(set(orders)) < len(orders):
            twice = sorted(path.name for order, path in entries if orders.count(order) > 1)
            unmatched += [(path, f"{target.name} has two control images of one place ({', '.join(twice)}); rename one "
                                 f"{target.stem}{CONTROL_SUFFIX}1, {target.stem}{CONTROL_SUFFIX}2, ...")
                          for order, path in entries]
            continue
        controls[target] = tuple(path for _, path in sorted(entries))
    if not controls:
        return {}, [(p, reason) for p, reason in unmatched if p.parent == subfolder]  # a control/ of no pairs
    return controls, unmatched


def load_image(path: Path, size: int | tuple[int, int]) -> torch.Tensor:
    """Decodes one image as float [H, W, 3] in 0..1 (ComfyUI's IMAGE layout), scaled to cover `size` (an int
    for a square, or (width, height)) and center-cropped to it. EXIF rotation is honoured; see _to_rgb for
    16-bit and transparent images. A file that cannot be used raises UnusableImage."""
    width, height = (size, size) if isinstance(size, int) else size
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                if problem := _too_large(opened.size):
                    raise UnusableImage(path, problem)
                image = _to_rgb(ImageOps.exif_transpose(opened))
    except Image.DecompressionBombError as error:
        raise UnusableImage(path, f"too large ({error}); downscale it") from error
    except (FileNotFoundError, PermissionError) as error:
        raise UnusableImage(path, _os_reason(error)) from error
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise UnusableImage(path, f"cannot decode image ({error})") from error
    image = _cover_and_crop(image, width, height, Image.Resampling.LANCZOS)
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3).float() / 255.0


def _cover_and_crop(image: Image.Image, width: int, height: int, resample) -> Image.Image:
    scale = max(width / image.width, height / image.height)
    covering = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(covering, resample)
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


def mask_path(path: Path) -> Path:
    return path.with_name(path.stem + MASK_SUFFIX)


def load_mask(path: Path, size: tuple[int, int]) -> tuple[torch.Tensor | None, str]:
    """The loss mask of image `path` as float [H, W] in 0..1, framed exactly as load_image frames the image:
    `<image>_mask.png` beside it (as greyscale) wins, else the image's own alpha channel; (None, "") for neither.
    The second value says which. A mask file that cannot be used raises UnusableImage naming it."""
    width, height = size
    source, where = (mask_path(path), "mask file") if mask_path(path).is_file() else (path, "alpha channel")
    try:
        with Image.open(source) as opened:
            image = ImageOps.exif_transpose(opened)
            if source == path:
                if image.mode not in _ALPHA_MODES and "transparency" not in image.info:
                    return None, ""
                grey = image.convert("RGBA").getchannel("A")
            else:
                grey = image.convert("L") if image.mode not in _SIXTEEN_BIT_GREY else \
                    image.convert("I").point(lambda value: value / 257 + 0.5).convert("L")
            grey.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise UnusableImage(path, f"its loss mask {source.name} cannot be decoded ({error})") from error
    grey = _cover_and_crop(grey, width, height, Image.Resampling.BILINEAR)
    return torch.frombuffer(bytearray(grey.tobytes()), dtype=torch.uint8).view(height, width).float() / 255.0, where
