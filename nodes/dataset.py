import os
from pathlib import Path

import folder_paths

from ..bridge.folder_policy import folder_confinement
from ..trainer.dataset import (IMAGE_EXTENSIONS, MAX_REPEATS, MAX_RESOLUTION, Confinement, folder_fingerprint,
                               resolve_folder, scan_folder)
from ..trainer.errors import LeanLoRAError
from .common import CATEGORY

FRAMING = {"center crop (square)": False, "aspect-ratio buckets": True}
# the list's only entry while input/ holds no folder of images (an empty combo would send no value at all)
NO_FOLDER = "(no folder of images in input/ yet)"
COMFY_OWN_FOLDERS = {"clipspace"}  # the mask editor's files, not a dataset


def input_subfolders(input_dir: str | Path) -> list[str]:
    """Folders directly inside input/ holding at least one image (by extension): the folder widget's list."""
    found = []
    try:
        with os.scandir(input_dir) as listing:
            folders = [entry for entry in listing if entry.is_dir() and not entry.name.startswith(".")
                       and entry.name not in COMFY_OWN_FOLDERS]
    except OSError:
        return []
    for entry in folders:
        try:
            with os.scandir(entry.path) as files:
                if any(f.name.lower().endswith(IMAGE_EXTENSIONS) for f in files):  # stops at the first image
                    found.append(entry.name)
        except OSError:
            continue  # unreadable: not offered; typed by hand it fails with the reason
    return sorted(found, key=str.casefold)


def confinement(input_dir: str | Path, why: str | None) -> Confinement | None:
    """The folder policy's `why` (None: any folder and any link may be read) as the scan's confinement to input/,
    which also covers each file in the folder: a link to /etc/passwd named a.png or a.txt is refused."""
    return Confinement(Path(os.path.normpath(input_dir)), why) if why is not None else None


def folder_problem(folder: str, input_dir: str | Path) -> str | None:
    """Why `folder` cannot be a dataset before anything loads (VALIDATE_INPUTS), or None: the folder policy's
    refusals (of the folder, and of links inside it that lead out of input/), a folder that is not there, or the
    placeholder of an empty list."""
    input_dir = os.path.normpath(input_dir)
    if folder == NO_FOLDER:
        return (f"folder: ComfyUI's input folder ({input_dir}) holds no folder of images yet; copy the training "
                "images into a new folder there and press R to refresh the list, or choose 'type a folder path' "
                "in the list and give an absolute path")
    why = folder_confinement()
    try:
        path = resolve_folder(folder, input_dir, why)
    except LeanLoRAError as error:
        return f"{error}"
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        return (f"folder {folder.strip()!r} {what} ({path}); pick a folder from the list (press R to refresh "
                f"it), copy the images into a folder inside ComfyUI's input folder ({input_dir}), or type an "
                "absolute path")
    return links_problem(path, confinement(input_dir, why))


def links_problem(path: Path, confined: Confinement | None) -> str | None:
    """The refusal of a folder holding links that lead out of the confinement (None: none, or not confined)."""
    try:
        if confined is None or not path.is_dir():
            return None
        leaving = confined.links_out(sorted(path.iterdir()))
    except OSError:
        return None  # unreadable (or a name too long for the file system): the scan names the reason
    return confined.refusal(path, leaving) if leaving else None


class LeanLoRADataset:
    """A folder of images + captions, checked now (cheaply) and decoded only when training caches it."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                # A list of input/ subfolders; VALIDATE_INPUTS takes `folder`, so ComfyUI accepts any value there
                # (an absolute path typed in the browser, an old workflow's name, an API prompt's path).
                "folder": (input_subfolders(folder_paths.get_input_directory()) or [NO_FOLDER], {"tooltip":
                    "The folder with the training images: one inside ComfyUI's input folder (press R after adding "
                    "one), or 'type a folder path' for an absolute path elsewhere."}),
                "resolution": ("INT", {"default": 512, "min": 64, "max": MAX_RESOLUTION, "step": 64, "tooltip":
                    "Images are resized (shorter side) and center-cropped to this square size. 512 for SD1.5, 1024 for SDXL."}),
                "repeats": ("INT", {"default": 1, "min": 1, "max": MAX_REPEATS, "tooltip":
                    "How many times each image appears per epoch (kohya's folder repeats)."}),
                "trigger_word": ("STRING", {"default": "", "tooltip":
                    "Optional word put in front of every caption, to call the LoRA up in prompts later."}),
                "framing": (list(FRAMING), {"default": "center crop (square)", "tooltip":
                    "center crop (square): every image resized and cropped to resolution x resolution. "
                    "aspect-ratio buckets: each image keeps its shape (area up to resolution², sides multiples "
                    "of 64, never upscaled); batches hold images of one bucket, so nothing is padded."}),
            }
        }

    RETURN_TYPES = ("DATASET",)
    OUTPUT_TOOLTIPS = ("The checked list of images and captions; decoded only when training caches it.",)
    FUNCTION = "execute"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Captions come from <image>.txt files next to the images, or from a metadata.csv with columns "
                   "file_name,text. Unusable files are skipped and listed in the training report; transparent "
                   "pixels are composited onto white.")

    @classmethod
    def VALIDATE_INPUTS(cls, folder=None):
        """Before the run (and before the checkpoint loads): a folder that is not there fails here."""
        if folder is None:  # fed through a link: checked when it runs
            return True
        return folder_problem(folder, folder_paths.get_input_directory()) or True

    @classmethod
    def IS_CHANGED(cls, folder=None, **_):
        """ComfyUI re-runs the node (and everything after it) when this changes: the folder's file names,
        sizes, modification times and caption texts, so an edited caption or an added/deleted image is seen."""
        if not isinstance(folder, str):  # fed through a link: unknown until run, so always re-scan
            return float("nan")
        input_dir, why = folder_paths.get_input_directory(), folder_confinement()
        try:
            return folder_fingerprint(resolve_folder(folder, input_dir, why), confinement(input_dir, why))
        except LeanLoRAError:
            return float("nan")  # execute raises the clear error

    def execute(self, folder, resolution, repeats, trigger_word, framing):
        input_dir, why = folder_paths.get_input_directory(), folder_confinement()
        path = resolve_folder(folder, input_dir, why)
        return (scan_folder(path, resolution, repeats, trigger_word, buckets=FRAMING[framing],
                            confinement=confinement(input_dir, why)),)
