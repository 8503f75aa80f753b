"""python -m leanlora train CONFIG | config-from-workflow WORKFLOW | config-to-workflow CONFIG WORKFLOW.

`train` loads the model with ComfyUI's loaders, runs the Dataset, Memory Settings and LoRA Config nodes and then the
Train node itself (nodes/train.py -> trainer/train_lora.py), so progress lines, saves, samples, resume and the report
are the node's. Ctrl-C stops within one step and keeps a partial LoRA, as the node's Cancel does.

Under a launcher (`torchrun --nproc_per_node N -m leanlora train CONFIG`, or accelerate launch) each process is one
rank of a data-parallel run (trainer/distributed.py) on its own GPU: rank 0 prints, saves and samples."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from . import library
from .library import ConfigError

STOPPED = 130  # the exit status of a run stopped by Ctrl-C (a partial LoRA was kept)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m leanlora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a LoRA from a config file (TOML, or YAML with PyYAML)")
    train.add_argument("config", nargs="?", help="the config file (optional with --print-config)")
    train.add_argument("--print-config", action="store_true",
                       help="write the full config (the file's values, defaults for the rest) as TOML and exit")
    export = sub.add_parser("config-from-workflow",
                            help="a workflow's Train node (and the nodes feeding it) as a config")
    export.add_argument("workflow", help="a workflow .json (as the browser saves it, or API format)")
    back = sub.add_parser("config-to-workflow", help="write a config's values into a workflow's Train node and the "
                                                     "nodes feeding it")
    back.add_argument("config")
    back.add_argument("workflow")
    for command in (export, back):
        command.add_argument("--node", help="the Train node's id, where the workflow has several")
        command.add_argument("-o", "--output", help="write here instead of stdout")
    for command in (train, export, back):
        command.add_argument("--comfyui", help="ComfyUI's folder (else the config's comfyui, $COMFYUI_PATH, or the "
                                               "ComfyUI this pack is installed in)")
        command.add_argument("--comfyui-args", default="", help='ComfyUI\'s own arguments, quoted: "--lowvram"')
    return parser


@contextlib.contextmanager
def _logging(stream, level):
    """ComfyUI's and the node's log lines as plain lines on `stream` from `level` up; ours the root's only handler
    meanwhile (a module-level logging.info() with none would add Python's own, and print each line twice)."""
    root, handler = logging.getLogger(), logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handlers, old_level = root.handlers[:], root.level
    root.handlers = [handler]
    root.setLevel(level)
    try:
        yield
    finally:
        root.handlers = handlers
        root.setLevel(old_level)


def _launched_rank() -> int | None:
    """This process's rank where a launcher started several (WORLD_SIZE > 1), else None."""
    if int(os.environ.get("WORLD_SIZE") or 1) <= 1:
        return None
    return int(os.environ.get("RANK") or 0)


def _one_gpu_per_rank(comfyui_args: str) -> None:
    """Under a launcher, each rank sees the GPU of its LOCAL_RANK alone (ComfyUI trains on the GPU it sees first),
    before torch is imported; --cuda-device in ComfyUI's arguments wins."""
    local_rank = os.environ.get("LOCAL_RANK")
    if _launched_rank() is None or local_rank is None or "--cuda-device" in comfyui_args or "torch" in sys.modules:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else None
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[int(local_rank) % len(devices)] if devices else local_rank


@contextlib.contextmanager
def _ctrl_c_stops():
    """The first Ctrl-C asks the run to stop (ComfyUI's interrupt: the node's Cancel), the second quits. Under a
    launcher a stop is asked of every rank before the next step (trainer/distributed.py), never inside a step (the
    ranks would part at different collectives); SIGTERM (the launcher ending its ranks) asks it too, and only a
    Ctrl-C 2 s or more after the first quits at once."""
    import comfy.model_management
    distributed = library.pack("trainer.distributed") if _launched_rank() is not None else None
    first_asked = []  # when the stop was first asked

    def stop(signum, frame):
        asked = distributed.STOP.is_set() if distributed else comfy.model_management.processing_interrupted()
        # torchrun passes the terminal's Ctrl-C on to its ranks, which had it already: that copy is no second Ctrl-C
        if asked:
            forwarded = distributed is not None and (signum != signal.SIGINT or not first_asked
                                                     or time.monotonic() - first_asked[0] < 2)
            if forwarded:
                return
            raise KeyboardInterrupt
        first_asked.append(time.monotonic())
        if _launched_rank() in (None, 0):
            print("LeanLoRA: stopping after this step (Ctrl-C again to quit at once)", flush=True)
        if distributed:
            distributed.STOP.set()
        else:
            comfy.model_management.interrupt_current_processing(True)
    signals = (signal.SIGINT, signal.SIGTERM) if distributed else (signal.SIGINT,)
    try:
        previous = {number: signal.signal(number, stop) for number in signals}
    except ValueError:  # not the main thread: no handler
        yield
        return
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if distributed:
            distributed.STOP.clear()
            distributed.leave()


def _file_in(kind: str, value: str) -> str:
    """A path given for continue_from or resume, as the node's name in a loras folder (its folder added last)."""
    import folder_paths
    path = Path(value).expanduser()
    if path.is_file():
        folder_paths.add_model_folder_path(kind, str(path.resolve().parent))
        return path.name
    return value


def node_inputs(values: dict) -> dict:
    """{section: the node's inputs} of a complete config."""
    from .config import keys
    inputs = {section: {} for section in ("model", "dataset", "memory", "lora", "train")}
    for name, value in values.items():
        inputs[keys()[name].section][name] = value
    return inputs


def train(values: dict) -> int:
    """One run, as the Train node runs it; 0 when saved, STOPPED when Ctrl-C kept a partial LoRA."""
    import comfy.model_management
    import folder_paths
    inputs = node_inputs(values)
    if inputs["model"].get("output_dir"):
        loras = Path(inputs["model"]["output_dir"]).expanduser().resolve()
        loras.mkdir(parents=True, exist_ok=True)
        folder_paths.add_model_folder_path("loras", str(loras), is_default=True)  # where Train saves
    folder = Path(inputs["dataset"]["folder"]).expanduser()
    if not folder.is_absolute() and folder.is_dir():  # relative to here; else a name in ComfyUI's input folder
        inputs["dataset"]["folder"] = str(folder.resolve())
    for key in ("continue_from", "resume"):
        if key in inputs["lora"] or key in inputs["train"]:
            section = inputs["lora"] if key in inputs["lora"] else inputs["train"]
            section[key] = _file_in("loras", section[key])
    settings, dataset_node = library.pack("nodes.settings"), library.pack("nodes.dataset").LeanLoRADataset
    memory, = settings.LeanLoRAMemorySettings().execute(**inputs["memory"])
    lora_config, = settings.LeanLoRALoraConfig().execute(**inputs["lora"])
    problem = dataset_node.VALIDATE_INPUTS(folder=inputs["dataset"]["folder"])
    if problem is not True:
        raise library.pack("trainer.errors").LeanLoRAError(problem)
    dataset, = dataset_node().execute(**inputs["dataset"])
    model, clip, vae = library.load_model(inputs["model"])
    node = library.pack("nodes.train")
    comfy.model_management.interrupt_current_processing(False)
    try:
        output = node.LeanLoRATrain().execute(model, clip, vae, dataset, memory, lora_config, **inputs["train"])
        stopped_by_signal = _launched_rank() is not None and library.pack("trainer.distributed").STOP.is_set()
    except comfy.model_management.InterruptProcessingException:
        print("LeanLoRA: stopped before step 1: nothing was learned, nothing saved", flush=True)
        return STOPPED
    finally:
        stopped = comfy.model_management.processing_interrupted()
        comfy.model_management.interrupt_current_processing(False)
    lora_name = output["result"][3]
    saved = Path(folder_paths.get_folder_paths("loras")[0]) / lora_name
    if stopped or stopped_by_signal:
        return STOPPED  # the node logged "stopped; partial saved to ...; set resume to continue"
    if _launched_rank() in (None, 0):  # rank 0 saved it
        print(f"LeanLoRA: saved {saved}", flush=True)
    return 0


def _comfyui(args, config_path: str | None) -> None:
    from_config = None
    if config_path:
        from .config import flatten, read
        from_config = flatten(read(config_path)).get("comfyui")
    library.import_comfyui(library.find_comfyui(args.comfyui, from_config), args.comfyui_args)


def _write(text: str, output: str | None) -> None:
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            _one_gpu_per_rank(args.comfyui_args)
        with _logging(sys.stderr, logging.WARNING):  # stdout stays the config's (--print-config)
            _comfyui(args, getattr(args, "config", None))
        from . import config
        if args.command == "train":
            if args.config is None and not args.print_config:
                raise ConfigError("train: give a config file (python -m leanlora train --print-config > my_lora.toml "
                                  "writes one with every key)")
            values = config.load(args.config) if args.config else config.complete({})
            if args.print_config:
                _write(config.to_toml(values), None)
                return 0
            # the node's progress lines (rank 0's where a launcher started several: the others print warnings)
            with _logging(sys.stdout, logging.INFO if _launched_rank() in (None, 0) else logging.WARNING), \
                    _ctrl_c_stops():
                return train(values)
        if args.command == "config-from-workflow":
            workflow = json.loads(Path(args.workflow).read_text(encoding="utf-8"))
            values = config.from_workflow(workflow, args.node, warn=lambda text: print(text, file=sys.stderr))
            _write(config.to_toml(values), args.output)
            return 0
        values = config.load(args.config)
        workflow = config.into_workflow(json.loads(Path(args.workflow).read_text(encoding="utf-8")), values, args.node)
        _write(json.dumps(workflow, indent=2, ensure_ascii=False) + "\n", args.output)
        return 0
    except (ConfigError, OSError) as error:
        print(f"leanlora: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if not isinstance(error, library.pack("trainer.errors").LeanLoRAError):  # the nodes' refusals: the message
            raise  # is the answer; anything else keeps its traceback
        print(f"leanlora: {error}", file=sys.stderr)
        return 1
