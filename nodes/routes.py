"""The pack's HTTP route on ComfyUI's server: the Dataset node's preview (image and caption counts, a few
thumbnails) while a folder is picked, before Queue. Registered only inside a running ComfyUI."""
import asyncio
import os
import sys
from pathlib import Path

from ..bridge.folder_policy import ALLOW_ANY_FOLDER, folder_confinement
from ..trainer.dataset import resolve_folder, scan_folder
from ..trainer.errors import LeanLoRAError
from .dataset import confinement, folder_problem, input_subfolders, links_problem

DATASET_PREVIEW = "/leanlora/dataset_preview"
THUMBNAILS = 6


def preview_confinement() -> str | None:
    """Any page the browser opens can call a server on localhost, so the preview reads only folders inside
    input/ unless the admin opted in, even where the Dataset node itself may read any folder."""
    if folder_confinement(addresses=["0.0.0.0"]) is None:  # the policy of a reachable server: only the opt-in lifts it
        return None
    return folder_confinement() or (
        "the preview shows only folders inside ComfyUI's input folder (training still reads this one); start "
        f"ComfyUI with the environment variable {ALLOW_ANY_FOLDER}=1 to preview folders elsewhere")


def folder_preview(folder: str, input_dir: str | Path) -> tuple[int, dict]:
    """(HTTP status, answer) for the folder widget's value. Thumbnails are file names for ComfyUI's own /view
    (type input), which serves only what is inside input/; this route serves no file itself."""
    input_dir = Path(os.path.normpath(input_dir))
    answer = {"folder": folder, "folders": input_subfolders(input_dir)}
    try:
        resolve_folder(folder, input_dir)  # an empty name or '..' out of input/
    except LeanLoRAError as error:
        return 400, {**answer, "error": str(error)}
    why = preview_confinement()
    try:
        path = resolve_folder(folder, input_dir, why)
    except LeanLoRAError as error:
        return 403, {**answer, "error": str(error)}
    confined = confinement(input_dir, why)
    if refused := links_problem(path, confined):  # a link in the folder leading out of input/
        return 403, {**answer, "error": refused}
    if problem := folder_problem(folder, input_dir):
        return 404, {**answer, "error": problem}
    try:
        dataset = scan_folder(path, 64, confinement=confined)
    except LeanLoRAError as error:  # empty, no usable image: counts are 0, the reason is shown
        return 200, {**answer, "images": 0, "captions": 0, "skipped": 0, "thumbnails": [], "problem": str(error)}
    thumbnails = []
    if path.is_relative_to(input_dir):  # an opted-in folder elsewhere: counts only
        subfolder = path.relative_to(input_dir).as_posix()
        thumbnails = [{"filename": s.path.name, "subfolder": subfolder, "type": "input"}
                      for s in dataset.samples[:THUMBNAILS]]
    return 200, {**answer, "path": str(path), "images": len(dataset.samples),
                 "captions": sum(1 for s in dataset.samples if s.caption), "skipped": len(dataset.skipped),
                 "thumbnails": thumbnails}


def register_routes() -> None:
    """Adds the route to ComfyUI's server when one is running (main.py made it before loading packs); nothing in
    tests and scripts that import the pack without a server."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return
    import folder_paths
    from aiohttp import web

    @instance.routes.get(DATASET_PREVIEW)
    async def dataset_preview(request):
        folder = request.rel_url.query.get("folder", "")
        # the scan reads every image's header: off the event loop, which serves the queue and the websocket
        status, answer = await asyncio.to_thread(folder_preview, folder, folder_paths.get_input_directory())
        return web.json_response(answer, status=status)
