"""Continue training from an existing LoRA file (kohya's prev_lora_ckpt): read it (safetensors only, never pickle),
recognise its naming and its adapter type (the first of registry.ADAPTER_TYPES whose parts its modules hold: LoHa, LoKr,
OFT, DoRA, plain LoRA), match its modules to the adapter layers injected into the training copy and copy its weights
in. The file fixes type, rank, alpha and targets: a LoRA Config that says otherwise, or a file made for another
model, is an error naming both sides and the file.

Names are matched from the model side: every weight module of the training copy (ComfyUI's ldm paths) is spelled
the ways LoRA files spell it (kohya with either module-name style, ComfyUI's `diffusion_model.` paths, diffusers
and peft), and the file's module names are looked up among those spellings. kohya's underscored names are never
un-underscored (`to_out_0` and `attn1` cannot be split back reliably)."""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import LeanLoRAError
from ..model import FamilyIdentity
from ..settings import LoraSettings, LoraTargets
from .registry import ADAPTER_TYPES, adapter_type
from .dropout import ADAPTER
from .file import UNET_PREFIX



def _key_pattern() -> re.Pattern:
    """One LoRA tensor per key, `<module><part>`: each adapter type's own parts and spellings (AdapterType.key_parts,
    key_spellings), and alpha. The module part is matched against the model's spellings below."""
    spellings = dict.fromkeys(spelling for kind in ADAPTER_TYPES for spelling in kind.key_spellings)
    parts = dict.fromkeys(part for kind in ADAPTER_TYPES for part in kind.key_parts)
    named = r"\.(?P<part>" + "|".join(map(re.escape, parts)) + ")"
    return re.compile(r"^(?P<module>.+?)(?:" + "|".join([*spellings, r"\.(?P<alpha>alpha)", named]) + ")$")


_LORA_KEY = _key_pattern()
# Weights of adapter forms LeanLoRA does not train (peft's DoRA with its magnitude per output, Tucker convs, OFT's
# learned rescale)
# and ComfyUI trainer's full bias/norm differences: continuing would silently drop what they learned.
_VARIANT_PARTS = {".lora_magnitude_vector": "peft DoRA (magnitude per output feature)",
                  ".hada_t1": "Tucker (LoHa on convs)", ".lokr_t2": "Tucker (LoKr on convs)",
                  ".lora_mid.weight": "Tucker (LoCon)", ".rescale": "OFT rescale (LyCORIS' rescaled)",
                  ".diff": "full weight differences", ".diff_b": "bias differences"}
_TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "te1.", "te2.", "te.", "base_model.model.text_encoder")

_KOHYA_LDM = "kohya (ldm-style names)"
_KOHYA_DIFFUSERS = "kohya (diffusers-style names)"
_COMFY = "ComfyUI (diffusion_model. paths)"
_DIFFUSERS = "diffusers/peft"


@dataclass(frozen=True)
class ContinuedLora:
    """What a continued run started from, for the report and the new file's metadata."""
    file: Path
    format: str
    modules: int
    rank: int
    alpha: float
    steps: int | None  # the file's ss_steps, when it records them
    text_encoder_keys_skipped: int
    text_encoder_modules: int | None = None  # with text_encoder_lr on: its modules loaded from the file

    def describe(self) -> str:
        steps = f"{self.steps} steps recorded" if self.steps is not None else "no step count recorded"
        skipped = (f"; {self.text_encoder_keys_skipped} text-encoder keys skipped (text_encoder_lr is 0: this run "
                   "trains the diffusion model only and its file holds no text-encoder LoRA; set text_encoder_lr "
                   "above 0 to train them on)" if self.text_encoder_keys_skipped else "")
        if self.text_encoder_modules == 0:
            skipped += "; the file has no text-encoder LoRA: the text encoder's starts fresh"
        elif self.text_encoder_modules:
            skipped += f"; {self.text_encoder_modules} text-encoder modules loaded"
        return (f"continued from {self.file.name} ({self.format}): {self.modules} modules loaded, rank {self.rank}, "
                f"alpha {self.alpha:g}, {steps}{skipped}; the optimizer starts fresh")

    def metadata(self, steps_done: int) -> dict[str, str]:
        """The new file's entries: where it came from, and kohya's step count over both runs."""
        return {"leanlora_continued_from": self.file.name, "ss_steps": str((self.steps or 0) + steps_done)}


def continue_from_file(unet: torch.nn.Module, settings: LoraSettings, diffusers_names: Mapping[str, str] | None,
                       family: FamilyIdentity,
                       presets: Mapping[LoraTargets, tuple[str, ...]] | None = None,
                       text_encoder=None) -> ContinuedLora:
    """Loads `settings.continue_from` into the LoRA layers `inject_lora` put into `unet` (fp32 master weights).
    `diffusers_names` is the adapter's diffusers_module_names() (training-copy path -> diffusers path of each
    weight module: kohya's SD1.x names and diffusers/peft files use them); None reads ComfyUI-named files only.
    `presets`: the modules each target preset trains in this model (ModelAdapter.lora_targets), to name the
    preset a file was trained with. `text_encoder` (text_encoder_lr on; trainer/text_encoder.py): the file's kohya
    text-encoder modules (lora_te_, lora_te1_, lora_te2_) are loaded into its LoRA layers too."""
    path = Path(settings.continue_from)
    name = f"continue_from {path.name!r}"
    keys, metadata = _read_keys(path, name)
    model = family.name
    _check_base_model(name, metadata, family)

    file_modules, text_encoder_keys = _lora_modules(keys, name)
    kind = _check_type(name, path, settings, file_modules)
    lora_layers = kind.layers(unet)
    if not lora_layers:
        raise LeanLoRAError("continue_from: the training copy holds no LoRA layers to load the file into")
    spellings = _spellings(unet, lora_layers, diffusers_names)
    parts: dict[str, dict[str, str]] = {}  # module path -> {"down"/"up"/"alpha": key}
    formats: Counter[str] = Counter()
    unmatched = []
    for module, module_parts in file_modules.items():
        hit = spellings.get(module)
        if hit is None:
            unmatched.append(module_parts.get("down") or next(iter(module_parts.values())))
            continue
        parts[hit[0]] = module_parts
        formats[hit[1]] += 1
    if unmatched and _splits_a_fused_projection(file_modules, unet):
        raise LeanLoRAError(
            f"{name} puts its LoRA on separate q, k and v projections (diffusers/ai-toolkit naming, e.g. "
            f"{unmatched[0]!r}), and this {model} model computes q, k and v in one fused layer: one LoRA of rank "
            f"{settings.rank} there cannot hold three LoRAs of that rank, so LeanLoRA cannot continue this file. It "
            "still works for sampling (ComfyUI's LoRA loaders slice it onto the fused layer); to train on, start a "
            "new LoRA, or continue one saved by LeanLoRA or kohya's scripts")
    if unmatched:
        hint = (" (this model has no diffusers names: pick a kohya- or ComfyUI-named file)"
                if diffusers_names is None and "down_blocks" in unmatched[0] else "")
        raise LeanLoRAError(
            f"{name} does not fit this {model} model: {len(unmatched)} of its {len(file_modules)} LoRA modules "
            f"match none of its modules, e.g. {unmatched[0]!r}{hint}. It was made for another model family (e.g. an "
            f"SDXL LoRA on SD1.5) or another architecture: pick a LoRA trained on a {model} model")

    file_targets = _file_targets(name, set(parts), lora_layers, unet, presets or {})  # before shapes: a conv LoRA is a target matter
    tensors = _read_tensors(path, {key for module_parts in parts.values() for key in module_parts.values()})
    _check_finite(name, tensors)
    weights = {}
    for module_path, module_parts in parts.items():
        _check_complete(name, kind, module_parts)
        module_tensors = {part: tensors[key] for part, key in module_parts.items()}
        if "down" in module_parts:  # the plain-LoRA factors (LoRA, DoRA): against the base layer's shape
            down, up = module_tensors["down"], module_tensors["up"]
            base = _base_weight_shape(unet.get_submodule(module_path))
            if down.dim() != 2 or up.dim() != 2 or base is None or (up.shape[0], down.shape[1]) != base \
                    or up.shape[1] != down.shape[0]:
                raise LeanLoRAError(
                    f"{name} does not fit this {model} model: {module_parts['down']!r} has shape {tuple(down.shape)} "
                    f"and its lora_up {tuple(up.shape)}, but that module of the model has a weight of shape "
                    f"{base}. It was made for another model family or size: pick a LoRA trained on a {model} model")
        weights[module_path] = module_tensors

    ranks = {p: kind.rank_of({part: tuple(t.shape) for part, t in w.items()}) for p, w in weights.items()}
    ranks = {p: r for p, r in ranks.items() if r is not None}  # LoKr's full w2 has no rank: its shapes decide
    differences = (([f"targets {file_targets.value}"], [f"targets {settings.targets.value}"]) if file_targets
                   else ([], []))
    rank = alpha = None
    if ranks:
        rank = _one_value(name, "rank", ranks)
        alpha = _file_alpha(name, metadata, rank, {p: w.get("alpha") for p, w in weights.items() if p in ranks})
        _rank_and_alpha(name, path, settings, rank, alpha, *differences)
    elif differences[0]:
        _rank_and_alpha(name, path, settings, settings.rank, settings.alpha, *differences)

    with torch.no_grad():
        for module_path, module_tensors in weights.items():
            kind.load(lora_layers[module_path], module_tensors, f"{name} ({next(iter(parts[module_path].values()))!r})")
    style = formats.most_common(1)[0][0]
    if metadata.get("leanlora_version"):
        style = f"LeanLoRA {metadata['leanlora_version']}, {style}"
    steps = metadata.get("ss_steps", "")
    loaded = None
    if text_encoder is not None:
        loaded = _load_text_encoder(name, path, keys, settings, text_encoder)
        text_encoder_keys = 0
    return ContinuedLora(path, f"{kind.label}, {style}" if kind is not ADAPTER_TYPES[-1] else style, len(weights),
                         settings.rank if rank is None else rank, settings.alpha if alpha is None else alpha,
                         int(steps) if steps.isdigit() else None, text_encoder_keys, loaded)


def _load_text_encoder(name: str, path: Path, keys: list[str], settings: LoraSettings, text_encoder) -> int:
    """The file's text-encoder LoRA modules into the trained encoder's layers (kohya names, plain LoRA); returns
    how many. A module it has no layer for, or of another rank, is an error naming the key."""
    layers = text_encoder.layers()  # kohya module name -> peft LoRA layer
    modules: dict[str, dict[str, str]] = {}
    for key in keys:
        match = _LORA_KEY.match(key)
        if match is None or not match["module"].startswith(_TEXT_ENCODER_PREFIXES):
            continue
        part = "alpha" if match["alpha"] else match["kohya"]
        if part is None or match["module"] not in layers:
            raise LeanLoRAError(
                f"{name}: its text-encoder key {key!r} matches no layer LeanLoRA trains in this text encoder (it "
                "reads kohya's lora_te_ / lora_te1_ / lora_te2_ LoRAs on the CLIP layers' attention and MLP); set "
                "text_encoder_lr to 0 to continue its diffusion-model part only")
        modules.setdefault(match["module"], {})[part] = key
    tensors = _read_tensors(path, {key for parts in modules.values() for key in parts.values()})
    _check_finite(name, tensors)
    with torch.no_grad():
        for module, parts in modules.items():
            if "down" not in parts or "up" not in parts:
                raise LeanLoRAError(f"{name} is incomplete: {next(iter(parts.values()))!r} has no matching "
                                    "lora_down/lora_up weight. Pick a complete LoRA file")
            layer, down, up = layers[module], tensors[parts["down"]], tensors[parts["up"]]
            wanted = (tuple(layer.lora_A[ADAPTER].weight.shape), tuple(layer.lora_B[ADAPTER].weight.shape))
            if (tuple(down.shape), tuple(up.shape)) != wanted:
                raise LeanLoRAError(
                    f"{name} does not fit this text encoder: {parts['down']!r} has shape {tuple(down.shape)} (lora_up "
                    f"{tuple(up.shape)}), and LoRA Config's rank {settings.rank} makes {wanted[0]} ({wanted[1]}): set "
                    "rank as the file was trained, or text_encoder_lr to 0 to continue its diffusion-model part only")
            adapter_type(settings).load(layer, {"down": down, "up": up}, f"{name} ({parts['down']!r})")
    return len(modules)


def check_file(settings: LoraSettings) -> None:
    """What `settings.continue_from` says without a model, read from its header and alpha tensors only: a file
    that is no readable LoRA, or whose rank or alpha differ from the settings, fails here, before any encoding
    (the LoRA Config node calls this; the model-side checks come in continue_from_file)."""
    path = Path(settings.continue_from)
    name = f"continue_from {path.name!r}"
    keys, metadata = _read_keys(path, name)
    modules, _ = _lora_modules(keys, name)
    kind = _check_type(name, path, settings, modules)
    with safe_open(str(path), "pt") as file:
        shapes = {m: {part: tuple(file.get_slice(key).get_shape()) for part, key in p.items() if part != "alpha"}
                  for m, p in modules.items()}
        ranks = {m: kind.rank_of(s) for m, s in shapes.items()}
        ranks = {m: r for m, r in ranks.items() if r is not None}
        alphas = {m: file.get_tensor(p["alpha"]) if "alpha" in p else None for m, p in modules.items() if m in ranks}
    if not ranks:
        return  # continue_from_file names the incomplete module
    _check_finite(name, _read_tensors(path, {key for parts in modules.values() for key in parts.values()}))
    rank = _one_value(name, "rank", ranks)
    _rank_and_alpha(name, path, settings, rank, _file_alpha(name, metadata, rank, alphas), [], [])


# --- the file ---

def _lora_modules(keys: list[str], name: str) -> tuple[dict[str, dict[str, str]], int]:
    """The file's UNet LoRA modules as the file names them -> {"down"/"up"/"alpha": key}, and how many
    text-encoder keys were skipped. Files of LoRA variants, or holding no LoRA, are errors."""
    modules: dict[str, dict[str, str]] = {}
    text_encoder_keys, other = 0, []
    for key in keys:
        variant = next((kind for part, kind in _VARIANT_PARTS.items() if key.endswith(part)), None)
        if variant:
            raise LeanLoRAError(
                f"{name} holds {variant} weights (e.g. {key!r}), which LeanLoRA does not train: continuing it would "
                "drop what they learned" + (". It looks like ComfyUI's own trainer's output (LoRA on every layer "
                                            "plus bias and norm differences): continue it with ComfyUI's Train LoRA "
                                            "node" if "diff" in key else "")
                + ". Pick a LoRA, LoHa, LoKr, DoRA or OFT file (kohya, LyCORIS, diffusers/peft or LeanLoRA) or train "
                  "a new one")
        match = _LORA_KEY.match(key)
        if match is None:
            other.append(key)
            continue
        if match["module"].startswith(_TEXT_ENCODER_PREFIXES):
            text_encoder_keys += 1
            continue
        part = "alpha" if match["alpha"] else match["part"] or next(
            {"A": "down", "B": "up"}.get(value, value) for value in
            (match["kohya"], match["peft"], match["compatible"], match["processor"]) if value)
        modules.setdefault(match["module"], {})[part] = key
    if not modules:
        if text_encoder_keys:
            raise LeanLoRAError(f"{name} holds only text-encoder LoRA weights ({text_encoder_keys} keys); LeanLoRA "
                                "trains the diffusion model: pick a LoRA with UNet weights")
        example = f" (e.g. {other[0]!r})" if other else ""
        raise LeanLoRAError(f"{name} holds no LoRA weights: {len(keys)} tensors{example}, none named like a LoRA's "
                            "lora_down/lora_up (kohya, ComfyUI) or lora_A/lora_B (diffusers/peft). Is it a checkpoint "
                            "or an embedding? Pick a LoRA file from the loras folder")
    return modules, text_encoder_keys


def _file_type(name: str, modules: Mapping[str, dict[str, str]]):
    """The file's adapter type: per module the first of ADAPTER_TYPES whose parts it holds; one for the file."""
    found: dict = {}
    for module, parts in modules.items():
        kind = next((k for k in ADAPTER_TYPES if any(part in parts for part in k.file_parts)), None)
        if kind is None:  # an alpha alone: _check_complete names what is missing
            kind = ADAPTER_TYPES[-1]
        found.setdefault(kind, next(iter(parts.values())))
    if len(found) > 1:
        (a, key_a), (b, key_b) = list(found.items())[:2]
        raise LeanLoRAError(f"{name} mixes adapter types ({a.label} in {key_a!r}, {b.label} in {key_b!r}); LeanLoRA "
                            "trains one type per LoRA: pick a file of one type")
    return next(iter(found))


def _check_type(name: str, path: Path, settings: LoraSettings, modules: Mapping[str, dict[str, str]]):
    """The file's type must be the one LoRA Config asks for (its parts could not be trained as another)."""
    kind = _file_type(name, modules)
    if kind is not adapter_type(settings):
        key = next(key for parts in modules.values() for key in parts.values())
        raise LeanLoRAError(f"{name} is a {kind.label} file (e.g. {key!r}); LoRA Config's type says "
                            f"{settings.type.value}: set type to {kind.kind.value} to continue it, or pick a "
                            f"{adapter_type(settings).label} file ({path})")
    return kind


def _check_complete(name: str, kind, module_parts: Mapping[str, str]) -> None:
    missing = [part for part in kind.required_parts if part not in module_parts]
    if missing:
        present = next(iter(module_parts.values()))
        part = {"down": "lora_down", "up": "lora_up"}.get(missing[0], missing[0])
        raise LeanLoRAError(f"{name} is incomplete: {present!r} has no matching {part} weight. Pick a complete "
                            f"{kind.label} file")


def _read_keys(path: Path, name: str) -> tuple[list[str], dict[str, str]]:
    if not path.is_file():
        raise LeanLoRAError(f"{name}: no such file ({path}); pick a LoRA that is in the loras folder")
    if path.suffix.lower() != ".safetensors":
        raise LeanLoRAError(f"{name}: LeanLoRA reads LoRAs from .safetensors files only (never pickled "
                            ".pt/.ckpt files, which can run code); pick or convert to a .safetensors LoRA")
    try:
        with safe_open(str(path), "pt") as file:
            return list(file.keys()), dict(file.metadata() or {})
    except Exception as error:  # safetensors raises its own error type, or OSError, for a damaged header
        with open(path, "rb") as file:
            head = file.read(2)
        # torch.save's zip archive, or a bare pickle (protocol 2-5); a valid safetensors header can start with
        # these bytes too, so only a file safetensors refused is taken for one
        if head == b"PK" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
            raise LeanLoRAError(f"{name} ({path}) is a pickled PyTorch file renamed to .safetensors; LeanLoRA never "
                                "unpickles files (they can run code). Convert it to safetensors in a tool you trust, "
                                "or pick another LoRA") from error
        raise LeanLoRAError(f"{name} ({path}) is not a readable safetensors file ({type(error).__name__}: {error}); "
                            "it may be truncated or another format: pick another LoRA file") from error


def _read_tensors(path: Path, keys: set[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as file:
        return {key: file.get_tensor(key) for key in keys}


def _check_base_model(name: str, metadata: Mapping[str, str], family: FamilyIdentity) -> None:
    """kohya's ss_base_model_version (or the SAI model spec's architecture), where the file records one and the
    family knows how files name it."""
    recorded = [value for value in (metadata.get("ss_base_model_version"), metadata.get("modelspec.architecture"))
                if value]
    if not recorded or not family.recorded_as or any(family.recognises(value) for value in recorded):
        return
    raise LeanLoRAError(f"{name} was trained on another model (its metadata says {recorded[0]!r}); this is a "
                        f"{family.name} model: pick a LoRA trained on a {family.name} model")


def _alpha_without_tensors(metadata: Mapping[str, str], rank: int) -> float:
    """A file without `.alpha` tensors: diffusers' adapter metadata, kohya's ss_network_alpha, else alpha = rank
    (scale 1, what kohya, diffusers and ComfyUI apply such files with)."""
    try:
        return float(json.loads(metadata["lora_adapter_metadata"])["lora_alpha"])
    except (KeyError, ValueError, TypeError):
        pass
    try:
        return float(metadata["ss_network_alpha"])
    except (KeyError, ValueError):
        return float(rank)


def _file_alpha(name: str, metadata: Mapping[str, str], rank: int,
                alphas: Mapping[str, torch.Tensor | None]) -> float:
    default = _alpha_without_tensors(metadata, rank)
    return _one_value(name, "alpha", {m: float(a) if a is not None else default for m, a in alphas.items()},
                      close=True)


def _one_value(name: str, what: str, per_module: dict[str, float], close: bool = False) -> float:
    """The file's rank or alpha: every module must have the same (a LoRA Config has one of each), finite and
    positive."""
    odd = next(((p, v) for p, v in per_module.items() if not (math.isfinite(v) and v > 0)), None)
    if odd is not None:  # NaN never equals itself: checked before the comparison below
        raise LeanLoRAError(f"{name} has {what} {odd[1]:g} for {odd[0]}: the file is damaged (a LoRA's {what} is a "
                            f"positive number); pick another LoRA file")
    values = sorted(set(per_module.values()))
    first = values[0]
    other = next((v for v in values if not (math.isclose(v, first, rel_tol=1e-3) if close else v == first)), None)
    if other is not None:
        a = next(p for p, v in per_module.items() if v == first)
        b = next(p for p, v in per_module.items() if v == other)
        raise LeanLoRAError(f"{name} has a different {what} per module ({a}: {first:g}, {b}: {other:g}); a LoRA "
                            f"Config has one {what}, so LeanLoRA cannot continue it: pick another file")
    return first


def _check_finite(name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Continuing from NaN/inf weights would end as a 'diverged' run with the wrong advice: named here instead."""
    bad = sorted(key for key, tensor in tensors.items()
                 if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()))
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise LeanLoRAError(f"{name} holds NaN/inf values in {bad[0]!r}{more}: the file is damaged or was saved "
                            "from a diverged run, and training from it cannot work. Pick another LoRA file (an "
                            "earlier save of that run, if it has one)")


# --- the model ---

def _base_weight_shape(module: torch.nn.Module) -> tuple[int, int] | None:
    base = getattr(module, "base_layer", module)  # peft's LoRA layers and LeanLoRA's own wrap the Linear alike
    weight = getattr(base, "weight", None)
    return tuple(weight.shape) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def _weight_modules(unet: torch.nn.Module, lora_layers: Mapping[str, torch.nn.Module]) -> list[str]:
    """Paths of the modules a LoRA file can name: the LoRA layers, and every other module with a weight of its
    own outside them (so a file for other targets of this model says so instead of 'another model')."""
    inside = tuple(f"{path}." for path in lora_layers)
    paths = list(lora_layers)
    for path, module in unet.named_modules():
        if path and path not in lora_layers and not path.startswith(inside) \
                and isinstance(module._parameters.get("weight"), torch.Tensor):
            paths.append(path)
    return paths


def _spellings(unet: torch.nn.Module, lora_layers: Mapping[str, torch.nn.Module],
               diffusers_names: Mapping[str, str] | None) -> dict[str, tuple[str, str]]:
    """Every way a LoRA file names each module of the training copy -> (module path, format)."""
    spelled: dict[str, tuple[str, str]] = {}
    for path in _weight_modules(unet, lora_layers):
        names = [(UNET_PREFIX + path.replace(".", "_"), _KOHYA_LDM), (f"diffusion_model.{path}", _COMFY),
                 (path, _COMFY)]
        diffusers = diffusers_names.get(path) if diffusers_names is not None else None
        if diffusers:
            processor = re.sub(r"\.(to_[qkv]|to_out)(\.0)?$", r".processor.\1", diffusers)
            names += [(UNET_PREFIX + diffusers.replace(".", "_"), _KOHYA_DIFFUSERS)]
            names += [(prefix + spelling, _DIFFUSERS) for spelling in dict.fromkeys((diffusers, processor))
                      for prefix in ("", "unet.", "transformer.", "base_model.model.", "base_model.model.unet.",
                                     "base_model.model.transformer.")]
        for spelling, style in names:
            spelled.setdefault(spelling, (path, style))
    return spelled


_SPLIT_PROJECTION = re.compile(r"(^|[._])(to_[qkv]|add_[qkv]_proj)$")


def _splits_a_fused_projection(file_modules: Mapping[str, dict], unet: torch.nn.Module) -> bool:
    """Whether the file names separate q/k/v projections where the model has fused ones (a `qkv` layer) only."""
    split = any(_SPLIT_PROJECTION.search(module) for module in file_modules)
    paths = [path for path, _ in unet.named_modules()]
    return split and any(p.endswith("qkv") for p in paths) and not any(_SPLIT_PROJECTION.search(p) for p in paths)


def _targets_of(paths: set[str], all_paths: list[str],
                presets: Mapping[LoraTargets, tuple[str, ...]]) -> LoraTargets | None:
    """The target preset that puts LoRA on exactly `paths` in this model (peft's suffix match), if one does."""
    for targets, modules in presets.items():
        chosen = {p for p in all_paths if any(p == t or p.endswith(f".{t}") for t in modules)}
        if chosen == paths:
            return targets
    return None


def _file_targets(name: str, loaded: set[str], lora_layers: Mapping[str, torch.nn.Module], unet: torch.nn.Module,
                  presets: Mapping[LoraTargets, tuple[str, ...]]) -> LoraTargets | None:
    """None when the file has LoRA on exactly the layers the settings injected; else the other target preset it
    was trained with, or an error when no preset trains its layers."""
    if loaded == set(lora_layers):
        return None
    file_targets = _targets_of(loaded, _weight_modules(unet, lora_layers), presets)
    if file_targets is None:
        extra, missing = sorted(loaded - set(lora_layers)), sorted(set(lora_layers) - loaded)
        example = f"it has LoRA on {extra[0]}" if extra else f"it has none on {missing[0]}"
        raise LeanLoRAError(
            f"{name} has LoRA on {len(loaded)} modules that no target preset trains together ({example}): LeanLoRA "
            "trains the attention or the attention+feed-forward layers of every transformer block. Pick a LoRA "
            "trained on those")
    return file_targets


def _rank_and_alpha(name: str, path: Path, settings: LoraSettings, rank: int, alpha: float,
                    file_side: list[str], config_side: list[str]) -> None:
    """One error for every way the file and the settings differ (`file_side`/`config_side`: the targets, if they do)."""
    shape_file, shape_config = [], []
    if rank != settings.rank:
        shape_file.append(f"rank {rank}")
        shape_config.append(f"rank {settings.rank}")
    if not math.isclose(alpha, settings.alpha, rel_tol=1e-3):
        shape_file.append(f"alpha {alpha:g}")
        shape_config.append(f"alpha {settings.alpha:g}")
    file_side, config_side = shape_file + file_side, shape_config + config_side
    if file_side:
        raise LeanLoRAError(f"{name} has {', '.join(file_side)}; LoRA Config says {', '.join(config_side)}: set "
                            f"those in the LoRA Config or pick another file ({path})")
