import folder_paths

from ..bridge.folder_policy import folder_confinement
from ..trainer.dataset import MAX_REPEATS, MAX_RESOLUTION, folder_fingerprint, resolve_folder, scan_folder
from ..trainer.errors import LeanLoRAError
from .common import CATEGORY

FRAMING = {"center crop (square)": False, "aspect-ratio buckets": True}


class LeanLoRADataset:
    """A folder of images + captions, checked now (cheaply) and decoded only when training caches it."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "folder": ("STRING", {"default": "my_dataset", "tooltip":
                    "Folder with the training images: an absolute path, or a folder name inside ComfyUI's input folder."}),
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
    def IS_CHANGED(cls, folder=None, **_):
        """ComfyUI re-runs the node (and everything after it) when this changes: the folder's file names,
        sizes, modification times and caption texts, so an edited caption or an added/deleted image is seen."""
        if not isinstance(folder, str):  # fed through a link: unknown until run, so always re-scan
            return float("nan")
        try:
            return folder_fingerprint(resolve_folder(folder, folder_paths.get_input_directory(), folder_confinement()))
        except LeanLoRAError:
            return float("nan")  # execute raises the clear error

    def execute(self, folder, resolution, repeats, trigger_word, framing):
        path = resolve_folder(folder, folder_paths.get_input_directory(), folder_confinement())
        return (scan_folder(path, resolution, repeats, trigger_word, buckets=FRAMING[framing]),)
