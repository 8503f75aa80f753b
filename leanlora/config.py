"""The headless run's config: one key per widget of the Dataset, Memory Settings, LoRA Config and Train nodes (read
from their INPUT_TYPES, so the two cannot drift), the model's files, kohya's key names mapped onto them, checks
that give ComfyUI's own validation messages, TOML out, and a workflow's Train node in and out.

A config is flat (`rank = 16`); tables are read as kohya reads them, their keys joined into one namespace, and
--print-config writes one table per node. Values are the widgets' own (the labels the nodes show)."""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .library import ConfigError, node_class, pack

MISSING = object()
WIDGETS = {"INT", "FLOAT", "STRING", "BOOLEAN"}
SEED_NAMES = {"seed", "noise_seed"}  # the frontend gives these INTs a "control after generate" value
# section -> (the pack's module, its node class); the order --print-config writes
NODES = {"dataset": ("nodes.dataset", "LeanLoRADataset"), "memory": ("nodes.settings", "LeanLoRAMemorySettings"),
         "lora": ("nodes.settings", "LeanLoRALoraConfig"), "train": ("nodes.train", "LeanLoRATrain")}
SECTIONS = ("model", *NODES)
NODE_SECTION = {cls: section for section, (_, cls) in NODES.items()}
# combos whose lists are folders' contents: the dataset folder (a path or a name in input/, checked by the node's
# VALIDATE_INPUTS), continue_from and resume (a path, or a name in the loras folders, checked by the nodes)
DYNAMIC = {"folder", "continue_from", "resume"}


@dataclass(frozen=True)
class Key:
    name: str
    section: str
    kind: str  # INT FLOAT STRING BOOLEAN COMBO (a node's widget) or FILE FILES (the model's)
    choices: tuple | None
    options: dict
    default: Any
    tooltip: str
    width: int = 1  # values the widget takes in a UI workflow's widgets_values


def _model_keys() -> list[Key]:
    weight_dtypes = tuple(node_class("UNETLoader").INPUT_TYPES()["required"]["weight_dtype"][0])
    clip_types = tuple(dict.fromkeys([*node_class("CLIPLoader").INPUT_TYPES()["required"]["type"][0],
                                      *node_class("DualCLIPLoader").INPUT_TYPES()["required"]["type"][0]]))
    def key(name, kind, tooltip, choices=None, default=MISSING):
        return Key(name, "model", kind, choices, {}, default, tooltip)
    return [
        key("comfyui", "STRING", "ComfyUI's folder (else --comfyui, $COMFYUI_PATH, or the ComfyUI the pack is in)."),
        key("checkpoint", "FILE", "A checkpoint (MODEL, CLIP and VAE): a path, or a name in ComfyUI's "
                                  "models/checkpoints. kohya: pretrained_model_name_or_path."),
        key("diffusion_model", "FILE", "A diffusion model alone (ComfyUI's Load Diffusion Model): path or name."),
        key("weight_dtype", "COMBO", "The diffusion model's weight dtype, as Load Diffusion Model.", weight_dtypes,
            "default"),
        key("text_encoder", "FILES", "One text encoder, or a list of two (Load CLIP / DualCLIPLoader): paths or "
                                     "names."),
        key("clip_type", "COMBO", "The text encoders' type, as Load CLIP's (one: stable_diffusion by default) or "
                                  "DualCLIPLoader's (two: sdxl, flux, ...).", clip_types),
        key("vae", "FILE", "A VAE (Load VAE): path or name; replaces the checkpoint's."),
        key("output_dir", "STRING", "Where the LoRA is saved (kohya's output_dir); else ComfyUI's models/loras."),
    ]


def _node_keys(section: str) -> list[Key]:
    module, cls = NODES[section]
    inputs = getattr(pack(module), cls).INPUT_TYPES()
    found = []
    for group in ("required", "optional"):
        for name, spec in inputs.get(group, {}).items():
            kind, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            if isinstance(kind, (list, tuple)):
                choices = tuple(kind)
                first = MISSING if name in DYNAMIC or not choices else choices[0]  # the frontend shows the first
                found.append(Key(name, section, "COMBO", choices, options, options.get("default", first),
                                 options.get("tooltip", "")))
            elif kind in WIDGETS and not options.get("forceInput"):
                control = options.get("control_after_generate")
                control = kind == "INT" and name in SEED_NAMES if control is None else control
                found.append(Key(name, section, kind, None, options, options.get("default", MISSING),
                                 options.get("tooltip", ""), 2 if control else 1))
    return found


@cache
def keys() -> dict[str, Key]:
    """Every key, by name, in --print-config's order."""
    table = {}
    for key in [*_model_keys(), *(key for section in NODES for key in _node_keys(section))]:
        if key.name in table:
            raise RuntimeError(f"two settings named {key.name!r} ({table[key.name].section}, {key.section}): the "
                               "config's flat namespace needs one of them renamed or given a section rule")
        table[key.name] = key
    return table


def _square(value):
    """kohya's resolution: 512, "512", "512,512" or [512, 512]; LeanLoRA's is square (buckets keep the area)."""
    sides = value if isinstance(value, (list, tuple)) else str(value).replace(" ", "").split(",") \
        if isinstance(value, str) else [value]
    if len(set(map(str, sides))) != 1:
        raise ConfigError(f"resolution: {value!r} is not square; LeanLoRA trains at resolution x resolution (with "
                          "framing 'aspect-ratio buckets' each image keeps its shape at that area)")
    return int(sides[0]) if str(sides[0]).isdigit() else sides[0]


def _optimizer(value):
    from_kohya = {name.lower(): name for name in keys()["optimizer"].choices}
    return from_kohya.get(str(value).lower(), value)


def _flag(target_value):
    """kohya's switches (xformers = true): their value when on, nothing when off."""
    return lambda value: target_value if value is True else (None if value is False else value)


# kohya's key -> (LeanLoRA's key, value conversion or None)
ALIASES = {
    "pretrained_model_name_or_path": ("checkpoint", None),
    "vae": ("vae", None),
    "train_data_dir": ("folder", None),
    "resolution": ("resolution", _square),
    "enable_bucket": ("framing", _flag("aspect-ratio buckets")),
    "network_dim": ("rank", None),
    "network_alpha": ("alpha", None),
    "network_dropout": ("dropout", None),
    "network_weights": ("continue_from", None),
    "learning_rate": ("learning_rate", None),
    "optimizer_type": ("optimizer", _optimizer),
    "mixed_precision": ("mixed_precision", None),
    "gradient_checkpointing": ("gradient_checkpointing", None),
    "gradient_accumulation_steps": ("gradient_accumulation", None),
    "train_batch_size": ("batch_size", None),
    "save_every_n_steps": ("save_every_n_steps", None),
    "max_train_steps": ("steps", None),
    "output_name": ("output_name", None),
    "output_dir": ("output_dir", None),
    "seed": ("seed", None),
    "lr_scheduler": ("lr_schedule", None),
    "lr_warmup_steps": ("warmup_steps", None),
    "shuffle_caption": ("shuffle_tags", None),
    "caption_dropout_rate": ("caption_dropout", None),
    "caption_tag_dropout_rate": ("tag_dropout", None),
    "loss_type": ("loss", lambda v: {"l2": "MSE", "huber": "Huber", "smooth_l1": "smooth L1"}.get(v, v)),
    "discrete_flow_shift": ("timestep_shift", None),
    "xformers": ("attention", _flag("xformers")),
    "sdpa": ("attention", _flag("pytorch SDPA")),
    "fp8_base": ("base_weights", _flag("fp8")),
    "cache_latents_to_disk": ("latent_cache", _flag("RAM + disk")),
}
# kohya's values of a key LeanLoRA shares (read only where the value is not already one of the widget's)
KOHYA_VALUES = {"timestep_sampling": {"sigmoid": "logit-normal", "logit_normal": "logit-normal",
                                      "shift": "shifted sigmoid"},
                "lr_schedule": {"constant_with_warmup": "constant"}}  # LeanLoRA's warm-up precedes every schedule
# Memory Settings' sizes: a number is taken as GiB (ram = 32 is "32 GiB"; the size must be one of the widget's)
GIB_SIZED = {"card", "ram"}


def flatten(raw: dict) -> dict:
    """A config's tables joined into one namespace (kohya's rule); a key given twice is refused."""
    flat = {}
    for name, value in raw.items():
        items = value.items() if isinstance(value, dict) else [(name, value)]
        for key, item in items:
            if isinstance(item, dict):
                raise ConfigError(f"{name}.{key}: tables nest one level only ([train] then steps = 500)")
            if key in flat:
                raise ConfigError(f"{key}: given twice")
            flat[key] = item
    return flat


def unknown_key(name: str) -> ConfigError:
    known = [*keys(), *ALIASES]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ConfigError(f"unknown key {name!r}{hint} (`python -m leanlora train --print-config` lists every key)")


def normalize(raw: dict) -> tuple[dict, dict]:
    """The file's keys as LeanLoRA's: kohya's names mapped (with their values), tables flattened, unknown keys
    refused with the closest known ones; also the name each key was given as."""
    table, given, values = keys(), {}, {}
    for name, value in flatten(raw).items():
        if name in table:
            target, convert = name, (ALIASES[name][1] if name in ALIASES else None)
        elif name in ALIASES:
            target, convert = ALIASES[name]
        else:
            raise unknown_key(name)
        if convert is not None:
            value = convert(value)
        if value is None:  # a kohya switch that is off
            continue
        if target in GIB_SIZED and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = f"{value:g} GiB"
        kohya = KOHYA_VALUES.get(target)
        if kohya and isinstance(value, str) and value not in (table[target].choices or ()):
            value = kohya.get(value, value)
        if target in given:
            raise ConfigError(f"{target} given twice: as {given[target]} and as {name}")
        given[target], values[target] = name, value
    return values, given


def _named(key: Key, given_as: str | None) -> str:
    return key.name if not given_as or given_as == key.name else f"{given_as} ({key.name})"


def check_value(key: Key, value):
    """One value as ComfyUI's validation takes it (the same messages: 'Value 0 smaller than min of 1', 'Value not
    in list'), stricter on types where TOML/YAML give them (a string is not a number, nor a switch)."""
    if key.kind == "INT":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            raise ConfigError(f"{key.name}: Failed to convert an input value to a INT value ({value!r})")
        value = int(value)
    elif key.kind == "FLOAT":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key.name}: Failed to convert an input value to a FLOAT value ({value!r})")
        value = float(value)
    elif key.kind == "BOOLEAN":
        if not isinstance(value, bool):
            raise ConfigError(f"{key.name}: Failed to convert an input value to a BOOLEAN value ({value!r}): "
                              "true or false")
    elif key.kind in ("STRING", "FILE") or (key.kind == "COMBO" and key.name in DYNAMIC):
        if not isinstance(value, str):
            raise ConfigError(f"{key.name}: Failed to convert an input value to a STRING value ({value!r})")
    elif key.kind == "FILES":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not 1 <= len(names) <= 2 or not all(isinstance(n, str) for n in names):
            raise ConfigError(f"{key.name}: a file, or a list of two files ({value!r})")
    elif key.kind == "COMBO" and value not in key.choices:
        shown = list(key.choices) if len(key.choices) <= 20 else f"(list of length {len(key.choices)})"
        raise ConfigError(f"{key.name}: Value not in list: {value!r} not in {shown}")
    if "min" in key.options and value < key.options["min"]:
        raise ConfigError(f"{key.name}: Value {value} smaller than min of {key.options['min']}")
    if "max" in key.options and value > key.options["max"]:
        raise ConfigError(f"{key.name}: Value {value} bigger than max of {key.options['max']}")
    return value



def complete(values: dict, given: dict | None = None) -> dict:
    """Every key with its value checked, defaults for the rest (keys without a default stay out)."""
    out = {}
    for name, key in keys().items():
        if name in values:
            try:
                out[name] = check_value(key, values[name])
            except ConfigError as error:
                named = _named(key, (given or {}).get(name))
                raise ConfigError(str(error).replace(f"{name}:", f"{named}:", 1)) from None
        elif key.default is not MISSING:
            out[name] = key.default
    return out


def read(path: str | Path) -> dict:
    """A TOML file (YAML with PyYAML installed) as its raw mapping."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the config as "
                              "TOML (python -m leanlora train --print-config > my_lora.toml)") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
    else:
        import tomllib
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not valid TOML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config is a mapping of keys to values")
    return raw


def parse(raw: dict) -> dict:
    """A config's raw mapping as its values, checked, with every default filled in."""
    return complete(*normalize(raw))


def load(path: str | Path) -> dict:
    """A config file's values, checked, with every default filled in."""
    return parse(read(path))


# --- TOML out -------------------------------------------------------------------------------------------------------

def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def _comment(key: Key, width: int = 116) -> list[str]:
    """The key's tooltip, sentence by sentence up to a line ("0: off." alone says little), its range, kohya's name."""
    text = ""
    for sentence in key.tooltip.split(". "):
        text = f"{text} {sentence.rstrip('.')}." if text else sentence.rstrip(".") + "."
        if len(text) >= 40:
            break
    if len(text) > width - 2:
        text = text[:width - 5].rstrip() + "..."
    extra = []
    if "min" in key.options and "max" in key.options:
        extra.append(f"{key.options['min']}..{key.options['max']}")
    kohya = [name for name, (target, _) in ALIASES.items() if target == key.name and name != key.name]
    if kohya:
        extra.append(f"kohya: {', '.join(kohya)}")
    if key.kind == "COMBO" and key.name not in DYNAMIC:
        extra.insert(0, f"one of: {' | '.join(map(str, key.choices))}")
    return [f"# {text}", *([f"# {'; '.join(extra)}"] if extra else [])]


def to_toml(values: dict, comments: bool = True) -> str:
    """The config as TOML: one table per node, keys in the nodes' order; a key without a value (a required file or
    folder) written commented out."""
    lines = ["# LeanLoRA headless config: python -m leanlora train THIS_FILE (docs/HEADLESS.md)"]
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        for name, key in keys().items():
            if key.section != section:
                continue
            if comments:
                lines += _comment(key)
            if name in values:
                lines.append(f"{name} = {_toml(values[name])}")
            else:
                lines.append(f"# {name} = ...")
    return "\n".join(lines) + "\n"


# --- a workflow's Train node ----------------------------------------------------------------------------------------

LOADERS = {  # ComfyUI's loader node -> its widgets (in order) and the config key of each
    "CheckpointLoaderSimple": (("ckpt_name", "checkpoint"),),
    "UNETLoader": (("unet_name", "diffusion_model"), ("weight_dtype", "weight_dtype")),
    "CLIPLoader": (("clip_name", "text_encoder"), ("type", "clip_type")),
    "DualCLIPLoader": (("clip_name1", "text_encoder"), ("clip_name2", "text_encoder"), ("type", "clip_type")),
    "VAELoader": (("vae_name", "vae"),),
}
OUTPUT_OF = {"model": "MODEL", "clip": "CLIP", "vae": "VAE"}
PARTS = {"CheckpointLoaderSimple": {"model", "clip", "vae"}, "UNETLoader": {"model"}, "CLIPLoader": {"clip"},
         "DualCLIPLoader": {"clip"}, "VAELoader": {"vae"}}
OLD_MEMORY_FIRST = ("bf16", "fp16", "no")  # mixed_precision led Memory Settings before `card` (web/leanlora.js)


class Graph:
    """A workflow in either format: the UI's (nodes + links, widget values by position) or the API's (inputs by
    name), read and written by input name."""

    def __init__(self, workflow: dict):
        self.workflow = workflow
        self.ui = isinstance(workflow.get("nodes"), list)
        if self.ui:
            self.nodes = {str(node["id"]): node for node in workflow["nodes"]}
            self.links = {}
            for link in workflow.get("links", []):
                if isinstance(link, dict):
                    self.links[link["id"]] = (str(link["origin_id"]), link["origin_slot"])
                else:
                    self.links[link[0]] = (str(link[1]), link[2])
        else:
            self.nodes = {str(k): v for k, v in workflow.items() if isinstance(v, dict) and "class_type" in v}

    def type_of(self, node_id: str) -> str:
        node = self.nodes[node_id]
        return node["type"] if self.ui else node["class_type"]

    def source(self, node_id: str, input_name: str) -> str | None:
        """The node feeding `input_name` of node_id, or None."""
        node = self.nodes[node_id]
        if self.ui:
            for slot in node.get("inputs", []):
                if slot["name"] == input_name and slot.get("link") is not None:
                    return self.links[slot["link"]][0]
            return None
        link = node["inputs"].get(input_name)
        return str(link[0]) if isinstance(link, list) and len(link) == 2 else None

    def widgets(self, node_id: str, names: list[tuple[str, int]]) -> dict:
        """The node's widget values by name; `names` are (input name, width) in the frontend's order."""
        node = self.nodes[node_id]
        if not self.ui:
            return {name: value for name, value in node["inputs"].items() if not isinstance(value, list)}
        raw = node.get("widgets_values") or []
        if isinstance(raw, dict):
            return dict(raw)
        values, i = {}, 0
        for name, width in names:
            if i >= len(raw):  # saved before this widget existed: its default
                break
            values[name] = raw[i]
            i += width
        return values

    def set_widgets(self, node_id: str, names: list[tuple[str, int]], values: dict) -> None:
        node = self.nodes[node_id]
        if not self.ui:
            node["inputs"].update(values)
            return
        old = node.get("widgets_values") or []
        if isinstance(old, dict):
            old.update(values)
            return
        new, i = [], 0
        for name, width in names:
            extra = list(old[i + 1:i + width]) if len(old) >= i + width else ["fixed"] * (width - 1)
            new += [values.get(name, old[i] if i < len(old) else None), *extra]
            i += width
        node["widgets_values"] = new + list(old[i:])  # values of widgets not read here (a loader's device)


def _slots(section: str) -> list[tuple[str, int]]:
    return [(key.name, key.width) for key in keys().values() if key.section == section]


def train_node(graph: Graph, node_id: str | None) -> str:
    found = [nid for nid in graph.nodes if graph.type_of(nid) == "LeanLoRATrain"]
    if node_id is not None:
        if str(node_id) not in found:
            raise ConfigError(f"--node {node_id}: not a LeanLoRA Train node (Train nodes: "
                              f"{', '.join(found) or 'none'})")
        return str(node_id)
    if len(found) != 1:
        raise ConfigError(f"the workflow has {len(found)} LeanLoRA Train nodes ({', '.join(found)}): pick one with "
                          "--node ID" if found else "the workflow has no LeanLoRA Train node")
    return found[0]


def _settings_nodes(graph: Graph, train_id: str):
    """(section, node id) of the Dataset, Memory Settings and LoRA Config nodes feeding the Train node."""
    for section, input_name in (("dataset", "dataset"), ("memory", "memory"), ("lora", "lora_config")):
        source = graph.source(train_id, input_name)
        if source is None or graph.type_of(source) != NODES[section][1]:
            what = "nothing" if source is None else f"node {source} ({graph.type_of(source)})"
            raise ConfigError(f"Train node {train_id}'s {input_name} comes from {what}, not a {NODES[section][1]} node")
        yield section, source


def _loaders(graph: Graph, train_id: str):
    """(part, node id, loader type) of the MODEL, CLIP and VAE inputs; a part from another node is reported."""
    for part in ("model", "clip", "vae"):
        source = graph.source(train_id, part)
        kind = graph.type_of(source) if source is not None else None
        if kind in LOADERS and part in PARTS[kind]:
            yield part, source, kind
        else:
            yield part, source, None


def from_workflow(workflow: dict, node_id: str | None = None, warn=print) -> dict:
    """The config of a workflow's Train node: its widgets, its Dataset / Memory Settings / LoRA Config nodes', and
    the files of the loaders its MODEL, CLIP and VAE come from."""
    graph = Graph(workflow)
    train_id = train_node(graph, node_id)
    values = {}
    for section, source in [*_settings_nodes(graph, train_id), ("train", train_id)]:
        widgets = graph.widgets(source, _slots(section))
        raw = graph.nodes[source].get("widgets_values") if graph.ui else None
        if section == "memory" and isinstance(raw, list) and raw and raw[0] in OLD_MEMORY_FIRST:
            old = [name for name, _ in _slots("memory")][1:]  # saved before `card`: every value as given
            widgets = {"card": "manual", **dict(zip(old, raw))}
        values.update(widgets)
    parts = list(_loaders(graph, train_id))
    if {kind for _, _, kind in parts} == {"CheckpointLoaderSimple"} and len({source for _, source, _ in parts}) == 1:
        parts = parts[:1]  # one checkpoint gives all three
    for part, source, kind in parts:
        if kind is None:
            what = "nothing" if source is None else f"node {source} ({graph.type_of(source)})"
            warn(f"warning: Train node {train_id}'s {part} comes from {what}, which a config cannot hold (it names "
                 f"the loaders' files only): set {'checkpoint' if part == 'model' else part} in the config by hand")
            continue
        loader = graph.widgets(source, [(name, 1) for name, _ in LOADERS[kind]])
        for widget, key in LOADERS[kind]:
            if widget not in loader:
                continue
            if key == "text_encoder" and kind == "DualCLIPLoader":
                values.setdefault(key, []).append(loader[widget])
            elif key == "checkpoint" and part != "model":
                values.setdefault(key, loader[widget])
            else:
                values[key] = loader[widget]
    return complete(values)


def into_workflow(workflow: dict, values: dict, node_id: str | None = None) -> dict:
    """The config's values written into the workflow's Train node and the nodes feeding it (widgets, and the files
    of its loaders where they are loaders of the matching kind); returns the workflow (changed in place)."""
    graph = Graph(workflow)
    train_id = train_node(graph, node_id)
    for section, source in [*_settings_nodes(graph, train_id), ("train", train_id)]:
        slots = _slots(section)
        graph.set_widgets(source, slots, {name: values[name] for name, _ in slots if name in values})
    for part, source, kind in _loaders(graph, train_id):
        if kind is None:
            continue
        names = [(widget, 1) for widget, _ in LOADERS[kind]]
        loader = graph.widgets(source, names)
        encoders = values.get("text_encoder")
        encoders = [encoders] if isinstance(encoders, str) else list(encoders or [])
        for widget, key in LOADERS[kind]:
            if key == "text_encoder":
                index = int(widget[-1]) - 1 if widget[-1].isdigit() else 0
                if index < len(encoders):
                    loader[widget] = encoders[index]
            elif key in values:
                loader[widget] = values[key]
        graph.set_widgets(source, names, loader)
    return workflow
