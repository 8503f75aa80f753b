"""python -m leanlora train CONFIG | config-from-workflow WORKFLOW | config-to-workflow CONFIG WORKFLOW.

`train` loads the model with ComfyUI's loaders, runs the Dataset, Memory Settings and LoRA Config nodes and then the
Train node itself (nodes/train.py -> trainer/train_lora.py), so progress lines, saves, samples, resume and the report
are the node's. Ctrl-C stops within one step and keeps a partial LoRA, as the node's Cancel does."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
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


@contextlib.contextmanager
def _ctrl_c_stops():
    """The first Ctrl-C asks the run to stop (ComfyUI's interrupt: the node's Cancel), the second quits."""
    import comfy.model_management

    def stop(signum, frame):
        if comfy.model_management.processing_interrupted():
            raise KeyboardInterrupt
        print("LeanLoRA: stopping after this step (Ctrl-C again to quit at once)", flush=True)
        comfy.model_management.interrupt_current_processing(True)
    try:
        previous = signal.signal(signal.SIGINT, stop)
    except ValueError:  # not the main thread: no handler
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
    except comfy.model_management.InterruptProcessingException:
        print("LeanLoRA: stopped before step 1: nothing was learned, nothing saved", flush=True)
        return STOPPED
    finally:
        stopped = comfy.model_management.processing_interrupted()
        comfy.model_management.interrupt_current_processing(False)
    lora_name = output["result"][3]
    saved = Path(folder_paths.get_folder_paths("loras")[0]) / lora_name
    if stopped:
        return STOPPED  # the node logged "stopped; partial saved to ...; set resume to continue"
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
            with _logging(sys.stdout, logging.INFO), _ctrl_c_stops():  # the node's progress lines
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
