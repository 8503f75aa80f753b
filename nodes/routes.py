"""The pack's hooks on ComfyUI's server, registered only inside a running ComfyUI: the Dataset node's preview route
(image and caption counts, a few thumbnails) while a folder is picked, before Queue; and a prompt hook that makes a
Dataset folder that is not there refuse the whole prompt, not only the outputs that need it."""
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Callable

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
        # not there (yet): an answer, not a failed request (a 404 is a red console error on every template load)
        return 200, {**answer, "exists": False, "error": problem}
    try:
        dataset = scan_folder(path, 64, confinement=confined)
    except LeanLoRAError as error:  # empty, no usable image: counts are 0, the reason is shown
        return 200, {**answer, "images": 0, "captions": 0, "skipped": 0, "thumbnails": [], "problem": str(error)}
    thumbnails = []
    if path.is_relative_to(input_dir):  # an opted-in folder elsewhere: counts only
        subfolder = path.relative_to(input_dir).as_posix()
        thumbnails = [{"filename": s.path.name, "subfolder": subfolder, "type": "input"}
                      for s in dataset.samples[:THUMBNAILS]]
    return 200, {**answer, "exists": True, "path": str(path), "images": len(dataset.samples),
                 "captions": sum(1 for s in dataset.samples if s.caption), "skipped": len(dataset.skipped),
                 "thumbnails": thumbnails, **_pair_counts(dataset)}


def outputs_needing_a_missing_folder(request: dict, output_node: Callable[[str], bool]) -> list[str] | None:
    """ComfyUI runs the outputs of a prompt that pass validation and drops the others: with a misspelt Dataset
    folder the template's "base, no LoRA" branch would load the checkpoint and sample while nothing trains. For a
    prompt (POST /prompt's body) with a Dataset node whose typed folder fails the node's own validation, the
    outputs it would run that depend on that node (Train at least); None: nothing to change. Made the prompt's only
    targets, they all fail validation, so ComfyUI refuses the prompt whole with its error dialog, before any model
    loads. A prompt run for other outputs only (the frontend's partial execution) is left as it is."""
    prompt = request.get("prompt")
    if not isinstance(prompt, dict):
        return None
    import folder_paths
    input_dir = folder_paths.get_input_directory()
    missing = {key for key, node in prompt.items() if isinstance(node, dict)
               and node.get("class_type") == "LeanLoRADataset" and isinstance(node.get("inputs"), dict)
               and isinstance(node["inputs"].get("folder"), str) and folder_problem(node["inputs"]["folder"], input_dir)}
    if not missing:
        return None
    after = missing  # every node fed (through any chain of links) by a failing Dataset node
    while True:
        grown = after | {key for key, node in prompt.items() if isinstance(node, dict) and any(
            isinstance(value, list) and len(value) == 2 and str(value[0]) in after
            for value in (node.get("inputs") or {}).values())}
        if grown == after:
            break
        after = grown
    targets = request.get("partial_execution_targets")
    outputs = [key for key, node in prompt.items() if isinstance(node, dict) and output_node(node.get("class_type"))
               and (targets is None or key in targets)]
    needing = [key for key in outputs if key in after]
    return needing if needing and len(needing) < len(outputs) else None


def _output_node(class_type) -> bool:
    import nodes
    return getattr(nodes.NODE_CLASS_MAPPINGS.get(class_type), "OUTPUT_NODE", False) is True


def refuse_prompts_with_a_missing_folder(request: dict) -> dict:
    """ComfyUI's on_prompt hook (see outputs_needing_a_missing_folder); never fails a prompt by itself."""
    try:
        if isinstance(request, dict) and (needing := outputs_needing_a_missing_folder(request, _output_node)):
            request["partial_execution_targets"] = needing
    except Exception:  # a hook that raises is only logged by ComfyUI: validation still names the folder
        logging.exception("LeanLoRA: checking the prompt's Dataset folders")
    return request


def _pair_counts(dataset) -> dict:
    """A folder of edit pairs (targets with control images, docs/FAMILIES.md): how many pairs and controls."""
    if not dataset.pairs:
        return {}
    return {"pairs": len(dataset.samples), "controls": sum(len(sample.controls) for sample in dataset.samples)}


def register_routes() -> None:
    """Adds the route and the prompt hook to ComfyUI's server when one is running (main.py made it before loading packs); nothing in
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

    instance.add_on_prompt_handler(refuse_prompts_with_a_missing_folder)
