"""The conformance checks every model family passes, for the tests that run them: tests/test_families.py (ComfyUI
0.3.75's families) and tests/test_families_033.py (the families only ComfyUI 0.33 loads). Each check takes a family's
tiny MODEL, CLIP and VAE as the stock loaders load them (scripts/tiny_dit_assets.py) or a server with those files,
and asserts what every family must do: units that cover the blocks, targets that exist, training that resumes
exactly, a LoRA file ComfyUI applies key for key and `continue_from` reads back, an unchanged base model, fp8 files,
samples, the memory techniques, and the same through the stock loader nodes of a real server."""
from __future__ import annotations

import dataclasses
import hashlib
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import tiny_dit_assets
from comfy_headless import execution_error
from trainer.settings import BaseWeights, LoraSettings, LoraTargets, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX

FP32_CHECKPOINTED = MemorySettings("no", True)  # CPU, every number reproducible; checkpointing recomputes blocks
LORA = LoraSettings(rank=4, alpha=4.0, targets="attention+feed-forward")
PROMPT = "lnlr, a red circle on a blue background"


def adapter(objects):
    from bridge.comfy_adapter import ComfyAdapter
    return ComfyAdapter(*objects)


def train(objects, dataset, folder, steps, name, continue_from=None, **settings):
    lora = dataclasses.replace(LORA, continue_from=continue_from) if continue_from else LORA
    return train_lora(adapter(objects), dataset, FP32_CHECKPOINTED, lora,
                      TrainSettings(steps, 1e-3, 0, name, "cosine", 1, **settings), folder,
                      lambda **event: None, lambda: False)


def fingerprint(model) -> str:
    """The base diffusion model's weights, every byte."""
    digest = hashlib.sha256()
    with torch.inference_mode():
        for name, tensor in model.model.diffusion_model.state_dict().items():
            digest.update(name.encode())
            # reshape: a quantized file's scales are 0-d, which view() cannot reinterpret as bytes
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_latent_shape(model) -> tuple[int, ...]:
    """An 8x8 latent of the model's own format: its channels, and a time axis of one frame where its latents are
    video (Qwen-Image's and Wan's 5-D)."""
    from bridge.families.common import empty_latent
    return tuple(empty_latent(model.model.latent_format, 8, 8).shape)


def base_output(model, latent_shape) -> bytes:
    """The base model's prediction on fixed inputs, as ComfyUI's sampler calls it (its MODEL, its conditioning)."""
    with torch.inference_mode():
        noise = torch.randn(latent_shape, generator=torch.Generator().manual_seed(3))
        context = torch.randn(1, 8, _context_width(model), generator=torch.Generator().manual_seed(4))
        return model.model.apply_model(noise, torch.tensor([0.6]), c_crossattn=context,
                                       **_extra_inputs(model)).numpy().tobytes()


def _context_width(model) -> int:
    """The width of the text conditioning the model's blocks take (c_crossattn's last axis)."""
    unet = model.model.diffusion_model
    if type(model.model).__name__ == "Krea2":  # 12 Qwen3-VL-4B hidden states side by side per token
        return unet.txtlayers * unet.txtdim
    return unet.state_dict()[_context_key(model)].shape[-1]


def _context_key(model) -> str:
    state = model.model.diffusion_model.state_dict()
    return next(k for k in ("txt_in.weight", "cap_embedder.1.weight", "txt_norm.weight", "text_embedding.0.weight",
                            "blocks.0.cross_attn.k_proj.weight",
                            "txt_in.input_embedder.weight")  # the last: HunyuanImage 2.1's
                if k in state)


def _extra_inputs(model) -> dict:
    name = type(model.model).__name__
    if name == "Flux":
        return {"y": torch.zeros(1, model.model.diffusion_model.params.vec_in_dim), "guidance": torch.tensor([3.5])}
    if name in ("Chroma", "Flux2"):
        return {"guidance": torch.tensor([0.0])}
    if name == "Lumina2":
        return {"num_tokens": 8}
    return {}


# --- in-process checks ---------------------------------------------------------------------------------------------

def check_units_cover_the_blocks_and_every_target_exists(objects, family: str, dit: bool = True) -> None:
    """Checkpoint units: every one once, partial checkpointing only reorders them; for a DiT they are the family's
    blocks and its compile units. Every LoRA target suffix names Linear layers, all inside a unit."""
    trainer = adapter(objects)
    unet = trainer.training_unet()
    units = trainer.checkpoint_blocks(unet)
    assert units and len({id(u) for u in units}) == len(units)
    ordered = trainer.checkpoint_blocks(unet, latent_size=(8, 8))
    assert {id(u) for u in ordered} == {id(u) for u in units}  # partial checkpointing orders, never drops
    if dit:
        assert [id(b) for b in units] == [id(b) for b in trainer.family.blocks(unet)]
        assert {id(b) for b in trainer.prepare_compile_units(unet)} == {id(b) for b in units}
    linears = [path for path, m in unet.named_modules() if isinstance(m, torch.nn.Linear)]
    inside = {path for path, m in unet.named_modules() for unit in units if m is unit}
    for targets in LoraTargets:
        suffixes = trainer.lora_targets(unet, targets)
        for suffix in suffixes:
            hits = [p for p in linears if p == suffix or p.endswith(f".{suffix}")]
            assert hits, f"{family}: target {suffix!r} matches no Linear layer"
            assert all(any(p.startswith(f"{unit}.") for unit in inside) for p in hits), suffix


def check_trains_resumes_exactly_loads_in_comfyui_continues_and_leaves_the_model(objects, dataset, name: str, folder,
                                                                                 caplog) -> None:
    """4 steps saved at step 2; resumed from there, the same losses and the same file bytes; the file's identity
    is the family's; ComfyUI's LoRA loader applies every key; continue_from reads every module back; the base
    model's weights and prediction are as before."""
    import comfy.lora
    import comfy.sd
    model, clip, _ = objects
    shape = model_latent_shape(model)
    weights_before, output_before = fingerprint(model), base_output(model, shape)

    straight = train(objects, dataset, folder / "straight", 4, name, save_every_steps=2)
    assert straight.lora_path.is_file() and not straight.partial and len(straight.losses) == 4
    assert all(np.isfinite(straight.losses))
    state = folder / "straight" / f"{name}_step2{STATE_SUFFIX}"
    resumed = train(objects, dataset, folder / "resumed", 4, name, resume_from=state)
    assert resumed.losses == straight.losses
    assert resumed.lora_path.read_bytes() == straight.lora_path.read_bytes()

    saved = load_file(str(straight.lora_path))
    with safe_open(str(straight.lora_path), "pt") as file:
        metadata = file.metadata()
    identity = adapter(objects).identity()
    assert metadata["ss_base_model_version"] == identity.base_model_version
    assert metadata["modelspec.architecture"] == f"{identity.architecture}/lora"
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    assert modules and all(k.startswith("lora_unet_") for k in saved)
    # what the stock LoraLoader runs: every key applied, none "not loaded"
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, saved, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    assert len(comfy.lora.load_lora(saved, comfy.lora.model_lora_keys_unet(model.model, {}))) == len(modules)
    assert len(patched.patches) == len(modules)

    continued = train(objects, dataset, folder / "continued", 2, f"{name}_more", continue_from=str(straight.lora_path))
    assert f"{len(modules)} modules loaded" in continued.report and "4 steps recorded" in continued.report

    assert fingerprint(model) == weights_before
    assert base_output(model, shape) == output_before


def check_fp8_weights_as_loaded_train_without_a_16_bit_copy(unet_file, objects, dataset, name: str, folder) -> None:
    """UNETLoader's weight_dtype fp8_e4m3fn: the training copy keeps the fp8 weights (ComfyUI's per-call cast
    upcasts one layer at a time) instead of storing the model again in the compute dtype."""
    import comfy.sd
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(unet_file), model_options={"dtype": torch.float8_e4m3fn})
    _, clip, vae = objects
    trainer = adapter((model, clip, vae))
    unet = trainer.training_unet()
    trainer.set_compute_dtype(unet, torch.bfloat16)
    weights = [p for key, p in unet.named_parameters() if key.endswith(".weight") and p.dim() == 2]
    assert weights and all(p.dtype == torch.float8_e4m3fn for p in weights)
    outcome = train_lora(trainer, dataset, MemorySettings("bf16", True), LORA,
                         TrainSettings(2, 1e-3, 0, f"fp8_{name}"), folder, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses)) and outcome.lora_path.is_file()


def write_scaled_fp8_file(unet_file, path):
    """`unet_file` as the fp8 files users download (e.g. flux1-dev-fp8) store it: each matrix in fp8 with its
    `scale_weight`, and a `scaled_fp8` marker."""
    from safetensors.torch import save_file
    scaled = {}
    for key, tensor in load_file(str(unet_file)).items():
        if key.endswith(".weight") and tensor.dim() == 2:
            scale = tensor.float().abs().max() / 448
            scaled[key] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            scaled[key[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            scaled[key] = tensor
    scaled["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    save_file(scaled, str(path))
    return path


def check_a_scaled_fp8_file_trains_with_its_scales_as_stored(unet_file, objects, dataset, name: str, folder) -> None:
    """The fp8 files users download (e.g. flux1-dev-fp8): each matrix in fp8 with its `scale_weight`, and a
    `scaled_fp8` marker; ComfyUI's loader builds scaled-fp8 ops for them. The scales stay fp32 in the copy."""
    import comfy.sd
    file = write_scaled_fp8_file(unet_file, folder / f"{name}_fp8_scaled.safetensors")
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(file))
    _, clip, vae = objects
    trainer = adapter((model, clip, vae))
    unet = trainer.training_unet()
    trainer.set_compute_dtype(unet, torch.bfloat16)
    scales = [p for key, p in unet.named_parameters() if key.endswith("scale_weight")]
    assert scales and all(p.dtype == torch.float32 for p in scales) and any(float(p) != 1.0 for p in scales)
    assert any(p.dtype == torch.float8_e4m3fn for p in unet.parameters())
    outcome = train_lora(trainer, dataset, MemorySettings("bf16", True), LORA,
                         TrainSettings(2, 1e-3, 0, f"fp8s_{name}"), folder, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses)) and outcome.lora_path.is_file()


def check_a_quantized_scaled_fp8_file_trains_and_leaves_the_model(unet_file, objects, dataset, name: str, folder,
                                                                   caplog) -> None:
    """ComfyUI 0.33 loads a scaled-fp8 file as comfy_kitchen QuantizedTensor layers: the training copy takes their
    dequantized values as plain weights (fp8 again under LeanLoRA's own fp8 storage), the LoRA trains, ComfyUI's
    loader applies every key to the quantized MODEL, and that MODEL's weights and prediction stay as they were."""
    import comfy.lora
    import comfy.sd
    file = write_scaled_fp8_file(unet_file, folder / f"{name}_fp8_scaled.safetensors")
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model(str(file))
    quantized = [m for m in model.model.diffusion_model.modules()
                 if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]
    assert quantized, "the file should load as quantized layers"
    shape = model_latent_shape(model)
    weights_before, output_before = fingerprint(model), base_output(model, shape)
    _, clip, vae = objects
    trainer = adapter((model, clip, vae))
    unet = trainer.training_unet()
    assert not any(type(p).__name__ == "QuantizedTensor" or type(p.data).__name__ == "QuantizedTensor"
                   for p in unet.parameters())
    dequantized = dict(unet.named_parameters())[f"{_module_name(model, quantized[0])}.weight"]
    assert torch.equal(dequantized.float(), quantized[0].weight.dequantize().float())
    outcome = train_lora(trainer, dataset, MemorySettings("bf16", True, base_weights=BaseWeights.FP8), LORA,
                         TrainSettings(2, 1e-3, 0, f"fp8q_{name}"), folder, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses)) and outcome.lora_path.is_file()
    assert "frozen weights stored as fp8" in outcome.report
    saved = load_file(str(outcome.lora_path))
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, saved, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    assert modules and len(comfy.lora.load_lora(saved, comfy.lora.model_lora_keys_unet(model.model, {}))) \
        == len(modules) == len(patched.patches)
    assert fingerprint(model) == weights_before
    assert base_output(model, shape) == output_before


def _module_name(model, module) -> str:
    return next(name for name, m in model.model.diffusion_model.named_modules() if m is module)


def check_samples_render_with_the_familys_sampler(objects, folder) -> None:
    """A sample during training: the family's sampler and schedule, a 64x64 image, the family's size limit."""
    import re

    from bridge.samples import SampleRenderer
    from trainer.errors import LeanLoRAError
    from trainer.lora import inject_lora, kohya_state_dict
    from trainer.settings import SampleSettings
    model, clip, vae = objects
    trainer = adapter(objects)
    defaults = trainer.family.sample_defaults
    renderer = SampleRenderer(model, clip, vae, SampleSettings((PROMPT,), every_steps=0, size=64, steps=2, cfg=1.0,
                                                               seed=1), folder)
    assert (renderer.sampler, renderer.scheduler) == (defaults.sampler, defaults.scheduler)
    unet = trainer.training_unet()
    inject = LoraSettings(rank=4, alpha=4.0)
    inject_lora(unet, inject, 0, trainer.lora_targets(unet, inject.targets))
    [path] = renderer(3, kohya_state_dict(unet, inject))
    image = Image.open(path)
    assert path.name == "step3_0.png" and image.size == (64, 64)
    assert f"{defaults.sampler} {defaults.scheduler}" in image.text["parameters"]
    limits = trainer.family.sample_limits
    with pytest.raises(LeanLoRAError, match=rf"sample_size: got 4096; {re.escape(limits.family)} samples are at most "
                                            r"2048 px \(its native size is [12]\d\d\d\D"):  # HunyuanImage 2.1's: 2048
        SampleSettings((PROMPT,), every_steps=5, size=4096).check_within(limits)


def check_a_memory_technique_runs(objects, dataset, memory: MemorySettings, name: str, folder) -> str:
    """Two steps under `memory` (fp8 weights, partial checkpointing, offload or streaming...) with step-seeded LoRA
    dropout through the recompute: finite, no recovery, fp8 said; the report, for the family's own checks."""
    lora = LoraSettings(rank=4, alpha=4.0, dropout=0.1)
    outcome = train_lora(adapter(objects), dataset, memory, lora, TrainSettings(2, 1e-3, 0, f"memory_{name}"), folder,
                         lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses)) and not outcome.run.recoveries
    assert "frozen weights stored as fp8" in outcome.report and outcome.lora_path.is_file()
    return outcome.report


# --- the same through a real server, with the stock loader nodes -------------------------------------------------

def defaults(info: dict, class_type: str, **overrides) -> dict:
    """A node's required widget inputs at their defaults (as a new node in the browser), then `overrides`."""
    inputs = {}
    for name, spec in info[class_type]["input"]["required"].items():
        kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
        if isinstance(kind, list):
            inputs[name] = options.get("default", kind[0])
        elif kind in ("INT", "FLOAT", "STRING", "BOOLEAN") and "default" in options:
            inputs[name] = options["default"]
    inputs.update(overrides)
    return inputs


def loaders(tiny_set: str) -> dict:
    """Node 1: the diffusion model (UNETLoader), 2: the text encoder(s), 3: the VAE, as the family's users load them."""
    table = tiny_dit_assets.WORKFLOW[tiny_set]
    clip_loader = "DualCLIPLoader" if "DualCLIPLoader" in table else "CLIPLoader"
    return {"1": {"class_type": "UNETLoader", "inputs": dict(table["UNETLoader"])},
            "2": {"class_type": clip_loader, "inputs": dict(table[clip_loader])},
            "3": {"class_type": "VAELoader", "inputs": dict(table["VAELoader"])}}


def sampling(model_link, prefix: str, latent_node: str = "EmptyLatentImage") -> dict:
    """KSampler (euler / simple, 2 steps) on a 64x64 image of `latent_node`, decoded and saved."""
    return {
        "10": {"class_type": "CLIPTextEncode", "inputs": {"text": PROMPT, "clip": ["2", 0]}},
        "11": {"class_type": latent_node, "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "12": {"class_type": "KSampler", "inputs": {"seed": 7, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
                                                    "scheduler": "simple", "denoise": 1.0, "model": model_link,
                                                    "positive": ["10", 0], "negative": ["10", 0],
                                                    "latent_image": ["11", 0]}},
        "13": {"class_type": "VAEDecode", "inputs": {"samples": ["12", 0], "vae": ["3", 0]}},
        "14": {"class_type": "SaveImage", "inputs": {"filename_prefix": prefix, "images": ["13", 0]}},
    }


def training(info: dict, name: str) -> dict:
    """Dataset (the tiny folder at 64 px), Memory Settings (fp32 where offered, checkpointed), LoRA Config (rank 4)
    and a 4-step Train named server_<name> on nodes 1-3, its report previewed."""
    memory = {**info["LeanLoRAMemorySettings"]["input"].get("required", {}),
              **info["LeanLoRAMemorySettings"]["input"].get("optional", {})}  # all optional since `card` leads
    mixed = "no" if "no" in memory["mixed_precision"][0] else None
    return {
        "4": {"class_type": "LeanLoRADataset",
              "inputs": defaults(info, "LeanLoRADataset", folder="tiny_dataset", resolution=64, repeats=1)},
        "5": {"class_type": "LeanLoRAMemorySettings",
              "inputs": defaults(info, "LeanLoRAMemorySettings", gradient_checkpointing=True,
                                 **({"mixed_precision": mixed} if mixed else {}))},
        "6": {"class_type": "LeanLoRALoraConfig", "inputs": defaults(info, "LeanLoRALoraConfig", rank=4, alpha=4.0)},
        "7": {"class_type": "LeanLoRATrain",
              "inputs": defaults(info, "LeanLoRATrain", steps=4, learning_rate=1e-3, output_name=f"server_{name}",
                                 model=["1", 0], clip=["2", 0], vae=["3", 0], dataset=["4", 0], memory=["5", 0],
                                 lora_config=["6", 0])},
        "8": {"class_type": "PreviewAny", "inputs": {"source": ["7", 5]}},
    }


def saved_image(server, entry, node_id) -> np.ndarray:
    image = entry["outputs"][node_id]["images"][0]
    return np.asarray(Image.open(server.base_dir / image["type"] / image["subfolder"] / image["filename"]))


def check_trains_through_the_stock_loaders_in_a_real_server(server, tiny_set: str,
                                                            latent_node: str = "EmptyLatentImage") -> str:
    """The stock loader nodes, a Train node and KSampler on its MODEL: the LoRA trained, saved and applied key for
    key (no "not loaded" in the log); the base MODEL samples the same image before and after. The report."""
    info = server.object_info()
    before = server.run({**loaders(tiny_set), **sampling(["1", 0], f"{tiny_set}_base_before", latent_node)})
    assert before["status"]["status_str"] == "success", execution_error(before)
    log_start = len(server.log_text())
    trained = server.run({**loaders(tiny_set), **training(info, tiny_set),
                          **sampling(["7", 0], f"{tiny_set}_with_lora", latent_node)}, timeout=900)
    assert trained["status"]["status_str"] == "success", execution_error(trained)
    log = server.log_text()[log_start:]
    assert "lora key not loaded" not in log and "NOT LOADED" not in log
    report = trained["outputs"]["8"]["text"][0]
    assert "trained 4/4 steps" in report and f"server_{tiny_set}.safetensors" in report
    assert (server.base_dir / "models" / "loras" / f"server_{tiny_set}.safetensors").is_file()
    after = server.run({**loaders(tiny_set), **sampling(["1", 0], f"{tiny_set}_base_after", latent_node)})
    assert after["status"]["status_str"] == "success", execution_error(after)
    cached = {n for event, data in after["status"]["messages"] if event == "execution_cached" for n in data["nodes"]}
    assert "1" in cached and "12" not in cached  # the trained-on MODEL, sampled again
    assert np.array_equal(saved_image(server, before, "14"), saved_image(server, after, "14"))
    return report


def tiny_template_overrides(tiny_set: str, template: str) -> dict:
    """A shipped family template (scripts/family_templates.py's `template` entry) with the tiny fixtures' files and
    sizes: what a test runs instead of a user's files."""
    import family_templates
    files = {"UNETLoader": "1", "CLIPLoader": "2", "DualCLIPLoader": "2", "VAELoader": "3"}
    overrides = {files[loader]: dict(inputs) for loader, inputs in tiny_dit_assets.WORKFLOW[tiny_set].items()}
    overrides["1"]["weight_dtype"] = family_templates.FAMILIES[template]["loaders"]["UNETLoader"]["weight_dtype"]
    overrides.update({"4": {"folder": "tiny_dataset", "resolution": 64}, "7": {"steps": 3},
                      "10": {"width": 64, "height": 64}, "11": {"steps": 2}})
    return overrides


def check_the_template_trains_then_samples(server, tiny_set: str, template: str, pinned_version: str | None) -> None:
    """The shipped template: current (regenerated from `pinned_version`'s node list, where that is the running
    ComfyUI), every value and link as family_templates writes them, and it trains then samples on the tiny files."""
    import json

    import comfyui_version
    import family_templates
    from workflow_convert import apply_overrides, ui_to_api
    info = server.object_info()
    shipped = json.loads(family_templates.template_path(template).read_text())
    if comfyui_version.__version__ == pinned_version:  # generated from that version's node list; others add
        # widgets, which the frontend fills with their defaults when it opens the template
        assert shipped == json.loads(json.dumps(family_templates.family_template(template, info))), (
            "regenerate: python scripts/family_templates.py --object-info URL")
    prompt = ui_to_api(shipped, info)
    for node_id, node in family_templates.family_prompt(template).items():  # every value and link as written
        assert prompt[node_id]["class_type"] == node["class_type"]
        assert prompt[node_id]["inputs"] | node["inputs"] == prompt[node_id]["inputs"], node_id
    run = apply_overrides(prompt, tiny_template_overrides(tiny_set, template))
    entry = server.run(run, timeout=900)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    assert entry["outputs"]["13"]["images"] and "trained 3/3 steps" in entry["outputs"]["14"]["text"][0]
    assert (server.base_dir / "models" / "loras" / f"my_{template}_lora.safetensors").is_file()
