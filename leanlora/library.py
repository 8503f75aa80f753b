"""ComfyUI as a library: found, put first on sys.path, imported with its own arguments; the pack's nodes imported
as a package (their relative imports work) without running the pack's __init__.py (no routes, no web folder); the
model loaded by ComfyUI's own loader nodes, from files only (a path, or a name in ComfyUI's model folders)."""
from __future__ import annotations

import importlib
import os
import shlex
import sys
import types
from pathlib import Path

PACK_DIR = Path(__file__).resolve().parents[1]
PACK = "leanlora_pack"  # the pack's import name here (ComfyUI gives it its folder's path)
ENV = "COMFYUI_PATH"


class ConfigError(ValueError):
    """A config file, key or value the headless run refuses (the nodes' own refusals are LeanLoRAError)."""


def is_comfyui(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy").is_dir() and (path / "folder_paths.py").is_file()


def find_comfyui(given: str | None = None, from_config: str | None = None) -> Path:
    """--comfyui, else the config's `comfyui`, else $COMFYUI_PATH, else the ComfyUI this process has already
    imported (tests), else the ComfyUI this pack is installed in (<ComfyUI>/custom_nodes/<pack>), else the current
    folder when it is ComfyUI's."""
    for source, value in (("--comfyui", given), ("the config's comfyui key", from_config), (ENV, os.environ.get(ENV))):
        if value:
            path = Path(value).expanduser().resolve()
            if not is_comfyui(path):
                raise ConfigError(f"{source}: {path} is not a ComfyUI folder (no main.py, comfy/ and folder_paths.py)")
            return path
    if "folder_paths" in sys.modules:
        return Path(sys.modules["folder_paths"].__file__).resolve().parent
    # the pack's folder as reached (a linked pack resolves elsewhere), or the folder it was started from
    here = [Path(os.environ["PWD"])] if os.environ.get("PWD") else []
    for pack_dir in (Path(__file__).absolute().parents[1], *here):
        if pack_dir.parent.name == "custom_nodes" and is_comfyui(pack_dir.parents[1]):
            return pack_dir.parents[1]
    for folder in (*here, Path.cwd()):
        if is_comfyui(folder):
            return folder
    raise ConfigError(f"ComfyUI not found: this pack is not inside <ComfyUI>/custom_nodes ({PACK_DIR}); name it with "
                      f"--comfyui PATH, the config key comfyui = \"PATH\", or the environment variable {ENV}")


def import_comfyui(path: Path, comfyui_args: str = "") -> None:
    """ComfyUI first on sys.path (its top-level `nodes` must win over the pack's nodes/), its arguments parsed from
    `comfyui_args` (as main.py's: "--cpu --lowvram"), the CPU taken where torch sees no GPU, extra_model_paths.yaml
    and ComfyUI's folder arguments applied as main.py applies them. A process that imported ComfyUI before keeps it
    as it is (tests)."""
    if "comfy.cli_args" not in sys.modules:
        sys.path[:] = [str(path), *(entry for entry in sys.path if entry != str(path))]
        import torch
        import comfy.options
        comfy.options.enable_args_parsing()  # ComfyUI's own parse of its arguments, as main.py's
        argv, sys.argv = sys.argv, ["main.py", *shlex.split(comfyui_args)]
        try:
            import comfy.cli_args
        finally:
            sys.argv = argv
        mps = getattr(torch.backends, "mps", None)
        if not torch.cuda.is_available() and not (mps and mps.is_available()):
            comfy.cli_args.args.cpu = True
        _custom_paths(path, comfy.cli_args.args)
    import comfy.model_management  # noqa: F401  (the device, from the arguments above)


def _custom_paths(path: Path, args) -> None:
    """main.py's folders: extra_model_paths.yaml (ComfyUI's own and --extra-model-paths-config), --output-directory,
    --input-directory and --user-directory (--base-directory is read by folder_paths itself)."""
    import folder_paths
    import utils.extra_config
    configs = [path / "extra_model_paths.yaml", *(c for group in args.extra_model_paths_config or [] for c in group)]
    for extra in configs:
        if Path(extra).is_file():
            utils.extra_config.load_extra_path_config(str(extra))
    for setting, setter in (("output_directory", folder_paths.set_output_directory),
                            ("input_directory", folder_paths.set_input_directory),
                            ("user_directory", folder_paths.set_user_directory)):
        if getattr(args, setting, None):
            setter(os.path.abspath(getattr(args, setting)))


def pack(module: str):
    """A module of the pack (nodes.train, trainer.settings, ...), imported under PACK."""
    return import_as_package(PACK, PACK_DIR, module)


def import_as_package(package: str, folder: Path, module: str):
    """`folder`'s `module` imported as `package`.`module` (its relative imports work) without running the pack's
    __init__.py or nodes/__init__.py (which import every node, and ComfyUI with the Train node)."""
    if package not in sys.modules:
        for name, path in ((package, folder), (f"{package}.nodes", folder / "nodes")):
            namespace = types.ModuleType(name)
            namespace.__path__ = [str(path)]
            sys.modules[name] = namespace
    return importlib.import_module(f"{package}.{module}")


def node_class(name: str):
    """A ComfyUI core node class (CheckpointLoaderSimple, UNETLoader, ...)."""
    import nodes
    return nodes.NODE_CLASS_MAPPINGS[name]


def as_name(kind: str, value: str, key: str) -> str:
    """A file of ComfyUI's folder `kind` as its loader node takes it: an existing path (absolute, or relative to
    the current folder) has its folder put first in ComfyUI's list for `kind`; else a name in ComfyUI's folders."""
    import folder_paths
    path = Path(value).expanduser()
    if path.is_file():
        folder_paths.add_model_folder_path(kind, str(path.resolve().parent), is_default=True)
        return path.name
    if folder_paths.get_full_path(kind, value) is not None:
        return value
    folders = ", ".join(folder_paths.get_folder_paths(kind))
    raise ConfigError(f"{key}: {value!r} is neither a file nor a name in ComfyUI's {kind} folders ({folders}); "
                      "LeanLoRA never downloads a model: give the path of a file you have")


def load_model(values: dict):
    """MODEL, CLIP and VAE by ComfyUI's own loader nodes: a checkpoint gives all three, and diffusion_model,
    text_encoder and vae each replace its part (or stand alone)."""
    checkpoint, unet, encoders, vae = (values.get(key) for key in ("checkpoint", "diffusion_model", "text_encoder",
                                                                    "vae"))
    encoders = [encoders] if isinstance(encoders, str) else list(encoders or [])
    if checkpoint is None and not (unet and encoders and vae):
        parts = (("diffusion_model", unet), ("text_encoder", encoders), ("vae", vae))
        missing = [key for key, given in parts if not given]
        raise ConfigError("the model: set checkpoint, or diffusion_model, text_encoder and vae (missing: "
                          f"{', '.join(missing)})")
    if encoders:  # the type is the loader's own widget: Load CLIP's for one file, DualCLIPLoader's for two
        loader = "CLIPLoader" if len(encoders) == 1 else "DualCLIPLoader"
        types_ = node_class(loader).INPUT_TYPES()["required"]["type"][0]
        clip_type = values.get("clip_type") or ("stable_diffusion" if len(encoders) == 1 else None)
        if clip_type not in types_:
            raise ConfigError(f"clip_type: {clip_type!r} is not a type of {loader} ({len(encoders)} text encoder"
                              f"{'s' if len(encoders) > 1 else ''}); choose one of {', '.join(types_)}")
    model = clip = loaded_vae = None
    if checkpoint is not None and not (unet and encoders and vae):
        loader = node_class("CheckpointLoaderSimple")()
        model, clip, loaded_vae = loader.load_checkpoint(as_name("checkpoints", checkpoint, "checkpoint"))
    if unet:
        model, = node_class("UNETLoader")().load_unet(as_name("diffusion_models", unet, "diffusion_model"),
                                                       values.get("weight_dtype", "default"))
    if encoders:
        names = [as_name("text_encoders", name, "text_encoder") for name in encoders]
        if len(names) == 1:
            clip, = node_class("CLIPLoader")().load_clip(names[0], clip_type)
        else:
            clip, = node_class("DualCLIPLoader")().load_clip(names[0], names[1], clip_type)
    if vae:
        loaded_vae, = node_class("VAELoader")().load_vae(as_name("vae", vae, "vae"))
    return model, clip, loaded_vae
