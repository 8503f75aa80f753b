"""Continue from an existing LoRA file (issue 17, item 1), on a small torch model with ComfyUI's (ldm) module paths;
imports no ComfyUI. Files are written here the way each tool writes them: kohya with diffusers-style SD1.x names
(its networks/lora.py walks a diffusers UNet) and with ldm-style names, ComfyUI (`diffusion_model.<ldm path>`),
diffusers/peft (`unet.<diffusers path>.lora_A.weight` and its older spellings) and LeanLoRA's own export."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from trainer.errors import LeanLoRAError
from trainer.lora import inject_lora, kohya_state_dict
from trainer.model import FamilyIdentity
from trainer.lora.continue_from import ContinuedLora, check_file, continue_from_file
from trainer.settings import LoraSettings, LoraTargets
from helpers import SD_TARGETS, sd_targets  # noqa: E402

# as bridge/families/sd_unet.py names them (this file imports no ComfyUI)
SD1 = FamilyIdentity("SD1.x", "sd_v1", "stable-diffusion-v1", "diffusers", recorded_as=("sd_v1", "stable-diffusion-v1"))
SDXL = FamilyIdentity("SDXL", "sdxl_base_v1-0", "stable-diffusion-xl-v1-base", "x",
                      recorded_as=("sdxl", "stable-diffusion-xl"))
PRESETS = {LoraTargets(name): modules for name, modules in SD_TARGETS.items()}
DIM, CONTEXT = 16, 8
# ldm block -> diffusers block in SD1.5 (ComfyUI's unet_to_diffusers says the same for these four)
TRANSFORMERS = {"input_blocks.1.1": "down_blocks.0.attentions.0", "input_blocks.4.1": "down_blocks.1.attentions.0",
                "middle_block.1": "mid_block.attentions.0", "output_blocks.3.1": "up_blocks.1.attentions.0"}


class Attention(torch.nn.Module):
    def __init__(self, context):
        super().__init__()
        self.to_q = torch.nn.Linear(DIM, DIM, bias=False)
        self.to_k, self.to_v = (torch.nn.Linear(context, DIM, bias=False) for _ in range(2))
        self.to_out = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Dropout(0.0))


class GEGLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(DIM, 4 * DIM)


class TransformerBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn1, self.attn2 = Attention(DIM), Attention(CONTEXT)
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.ff = torch.nn.Module()
        self.ff.net = torch.nn.Sequential(GEGLU(), torch.nn.Dropout(0.0), torch.nn.Linear(2 * DIM, DIM))


class SpatialTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = torch.nn.Conv2d(DIM, DIM, 1)  # SD1.5's (SDXL's is a Linear)
        self.transformer_blocks = torch.nn.ModuleList([TransformerBlock()])


def tiny_unet(seed=0) -> torch.nn.Module:
    """input_blocks / middle_block / output_blocks with SpatialTransformers where SD1.5 has some."""
    torch.manual_seed(seed)
    unet = torch.nn.Module()
    for name, count in (("input_blocks", 5), ("output_blocks", 4)):
        setattr(unet, name, torch.nn.ModuleList(torch.nn.ModuleList([torch.nn.Conv2d(4, 4, 1)]) for _ in range(count)))
    unet.middle_block = torch.nn.ModuleList([torch.nn.Conv2d(4, 4, 1), SpatialTransformer()])
    for ldm in TRANSFORMERS:
        if not ldm.startswith("middle"):
            blocks, index, _ = ldm.split(".")
            getattr(unet, blocks)[int(index)].append(SpatialTransformer())
    return unet


def diffusers_names(unet) -> dict[str, str]:
    """ldm path -> diffusers path of every module with a weight (what ComfyAdapter.kohya_module_names gives)."""
    names = {}
    for path, module in unet.named_modules():
        if "weight" in module._parameters:
            block = next((b for b in TRANSFORMERS if path.startswith(b + ".")), None)
            if block:
                names[path] = TRANSFORMERS[block] + path[len(block):]
    return names


NAMES = diffusers_names(tiny_unet())


def injected(settings, seed=0):
    unet = tiny_unet()
    inject_lora(unet, settings, seed, target_modules=sd_targets(settings))
    return unet


def lora_layers(unet) -> dict[str, torch.nn.Module]:
    return {path: m for path, m in unet.named_modules() if hasattr(m, "lora_A") and "leanlora" in m.lora_A}


def trained_weights(settings, seed=1) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """ldm path -> (down, up) of a LoRA with random non-zero weights in both, fp16 like a saved file."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for path, layer in lora_layers(injected(settings)).items():
        a, b = layer.lora_A["leanlora"].weight, layer.lora_B["leanlora"].weight
        out[path] = (torch.randn(a.shape, generator=generator).half(), torch.randn(b.shape, generator=generator).half())
    return out


def write(path, tensors, metadata=None):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata)
    return str(path)


def kohya_file(tmp_path, settings, style, *, alpha=None, name="kohya.safetensors", weights=None):
    weights = weights or trained_weights(settings)
    names = NAMES
    tensors = {}
    for path, (down, up) in weights.items():
        module = "lora_unet_" + (names[path] if style == "diffusers" else path).replace(".", "_")
        tensors |= {f"{module}.lora_down.weight": down, f"{module}.lora_up.weight": up,
                    f"{module}.alpha": torch.tensor(float(alpha if alpha is not None else settings.alpha))}
    return write(tmp_path / name, tensors), weights, tensors


def assert_loaded(unet, weights):
    layers = lora_layers(unet)
    assert set(layers) == set(weights)
    for path, (down, up) in weights.items():
        a, b = layers[path].lora_A["leanlora"].weight, layers[path].lora_B["leanlora"].weight
        assert a.dtype == b.dtype == torch.float32  # the fp32 master weights
        assert torch.equal(a, down.float()) and torch.equal(b, up.float()), path


ATTENTION = LoraSettings(rank=4, alpha=2.0)


@pytest.mark.parametrize("style", ["diffusers", "ldm"])
def test_kohya_files_of_both_naming_styles_load_exactly(tmp_path, style):
    file, weights, tensors = kohya_file(tmp_path, ATTENTION, style)
    expected = {"diffusers": "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
                "ldm": "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_down.weight"}[style]
    assert expected in tensors
    unet = injected(LoraSettings(rank=4, alpha=2.0, continue_from=file))
    loaded = continue_from_file(unet, LoraSettings(rank=4, alpha=2.0, continue_from=file), NAMES, SD1, PRESETS)
    assert_loaded(unet, weights)
    assert (loaded.modules, loaded.rank, loaded.alpha, loaded.steps) == (len(weights), 4, 2.0, None)
    assert loaded.format == f"kohya ({style}-style names)"


def test_sdxl_naming_without_a_diffusers_map_is_ldm_style(tmp_path):
    file, weights, _ = kohya_file(tmp_path, ATTENTION, "ldm")
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    unet = injected(settings)
    continue_from_file(unet, settings, None, SDXL, PRESETS)
    assert_loaded(unet, weights)


@pytest.mark.parametrize("spelling", ["unet.{d}.lora_A.weight", "base_model.model.{d}.lora_A.default.weight",
                                      "{d}.lora.down.weight", "unet.{p}_lora.down.weight"])
def test_diffusers_and_peft_files_load_exactly(tmp_path, spelling):
    weights = trained_weights(ATTENTION)
    names = NAMES
    up_spelling = spelling.replace("lora_A", "lora_B").replace("down", "up")
    tensors = {}
    for path, (down, up) in weights.items():
        d = names[path]
        processor = d.replace(".to_out.0", ".processor.to_out").replace(".to_q", ".processor.to_q") \
            .replace(".to_k", ".processor.to_k").replace(".to_v", ".processor.to_v")
        tensors[spelling.format(d=d, p=processor)] = down
        tensors[up_spelling.format(d=d, p=processor)] = up
    example = spelling.format(d="down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
                              p="down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor.to_q")
    assert example in tensors
    # diffusers' adapter metadata carries alpha (its files have no .alpha tensors)
    file = write(tmp_path / "peft.safetensors", tensors, {"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 2})})
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    unet = injected(settings)
    loaded = continue_from_file(unet, settings, NAMES, SD1, PRESETS)
    assert_loaded(unet, weights)
    assert loaded.format == "diffusers/peft" and loaded.alpha == 2.0


def test_a_peft_file_without_alpha_is_alpha_equal_to_rank(tmp_path):
    weights = trained_weights(LoraSettings(rank=4, alpha=4.0))
    names = NAMES
    tensors = {f"unet.{names[p]}.lora_{ab}.weight": w for p, (down, up) in weights.items()
               for ab, w in (("A", down), ("B", up))}
    file = write(tmp_path / "peft.safetensors", tensors)
    with pytest.raises(LeanLoRAError, match=r"has alpha 4; LoRA Config says alpha 2"):
        continue_from_file(injected(ATTENTION), LoraSettings(rank=4, alpha=2.0, continue_from=file), names, SD1, PRESETS)
    settings = LoraSettings(rank=4, alpha=4.0, continue_from=file)
    unet = injected(settings)
    assert continue_from_file(unet, settings, names, SD1, PRESETS).alpha == 4.0
    assert_loaded(unet, weights)


def test_comfyui_named_files_load_exactly(tmp_path):
    weights = trained_weights(ATTENTION)
    tensors = {}
    for path, (down, up) in weights.items():
        tensors |= {f"diffusion_model.{path}.lora_down.weight": down, f"diffusion_model.{path}.lora_up.weight": up,
                    f"diffusion_model.{path}.alpha": torch.tensor(2.0)}
    file = write(tmp_path / "comfy.safetensors", tensors)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    unet = injected(settings)
    assert continue_from_file(unet, settings, NAMES, SD1, PRESETS).format == "ComfyUI (diffusion_model. paths)"
    assert_loaded(unet, weights)


def test_our_own_file_loads_exactly_with_its_steps(tmp_path):
    settings = LoraSettings(rank=4, alpha=2.0, targets="attention+feed-forward")
    source = injected(settings, seed=3)
    generator = torch.Generator().manual_seed(5)
    for name, p in source.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=generator)
    state_dict = kohya_state_dict(source, settings, NAMES)
    file = write(tmp_path / "ours.safetensors", state_dict,
                 {"ss_network_dim": "4", "ss_network_alpha": "2.0", "ss_steps": "120", "leanlora_version": "0.9",
                  "ss_base_model_version": "sd_v1"})
    weights = {path: (state_dict[f"lora_unet_{d.replace('.', '_')}.lora_down.weight"],
                      state_dict[f"lora_unet_{d.replace('.', '_')}.lora_up.weight"])
               for path, d in NAMES.items() if path in lora_layers(source)}
    continued = LoraSettings(rank=4, alpha=2.0, targets="attention+feed-forward", continue_from=file)
    unet = injected(continued)
    loaded = continue_from_file(unet, continued, NAMES, SD1, PRESETS)
    assert_loaded(unet, weights)
    assert loaded.steps == 120 and loaded.format.startswith("LeanLoRA 0.9, kohya (diffusers")
    assert loaded.metadata(30) == {"leanlora_continued_from": "ours.safetensors", "ss_steps": "150"}
    assert "continued from ours.safetensors" in loaded.describe() and "120 steps recorded" in loaded.describe()


def test_text_encoder_keys_are_skipped_and_counted(tmp_path):
    _, weights, tensors = kohya_file(tmp_path, ATTENTION, "diffusers")
    te = {"lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": torch.zeros(4, 8),
          "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": torch.zeros(8, 4),
          "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha": torch.tensor(2.0)}
    file = write(tmp_path / "with_te.safetensors", tensors | te)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    unet = injected(settings)
    loaded = continue_from_file(unet, settings, NAMES, SD1, PRESETS)
    assert loaded.text_encoder_keys_skipped == 3 and "3 text-encoder keys skipped" in loaded.describe()
    assert_loaded(unet, weights)


# --- what the file fixes: rank, alpha, targets ---

def test_a_rank_and_alpha_mismatch_names_both_and_the_file(tmp_path):
    file, _, _ = kohya_file(tmp_path, LoraSettings(rank=4, alpha=4.0), "diffusers", name="x.safetensors")
    settings = LoraSettings(rank=8, alpha=8.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"continue_from 'x.safetensors' has rank 4, alpha 4; LoRA Config says "
                                            r"rank 8, alpha 8: set those"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)
    settings = LoraSettings(rank=4, alpha=1.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"has alpha 4; LoRA Config says alpha 1:"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_the_file_alone_is_checked_for_rank_and_alpha_before_any_model_work(tmp_path):
    file, _, _ = kohya_file(tmp_path, LoraSettings(rank=4, alpha=4.0), "diffusers", name="x.safetensors")
    check_file(LoraSettings(rank=4, alpha=4.0, continue_from=file))
    with pytest.raises(LeanLoRAError, match=r"continue_from 'x.safetensors' has rank 4; LoRA Config says rank 8:"):
        check_file(LoraSettings(rank=8, alpha=4.0, continue_from=file))
    with pytest.raises(LeanLoRAError, match=r"has alpha 4; LoRA Config says alpha 16:"):
        check_file(LoraSettings(rank=4, alpha=16.0, continue_from=file))
    not_lora = write(tmp_path / "vae.safetensors", {"decoder.conv_in.weight": torch.ones(4, 4)})
    with pytest.raises(LeanLoRAError, match=r"'vae.safetensors' holds no LoRA weights"):
        check_file(LoraSettings(continue_from=not_lora))


@pytest.mark.parametrize("file_targets, config_targets", [("attention+feed-forward", "attention"),
                                                          ("attention", "attention+feed-forward")])
def test_a_targets_mismatch_names_both(tmp_path, file_targets, config_targets):
    file, _, _ = kohya_file(tmp_path, LoraSettings(rank=4, alpha=2.0, targets=file_targets), "diffusers")
    settings = LoraSettings(rank=4, alpha=2.0, targets=config_targets, continue_from=file)
    with pytest.raises(LeanLoRAError, match=re.escape(f"has targets {file_targets}; LoRA Config says targets {config_targets}")):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_a_file_on_layers_no_preset_trains_is_refused(tmp_path):
    file, weights, tensors = kohya_file(tmp_path, ATTENTION, "diffusers")
    proj_in = "lora_unet_down_blocks_0_attentions_0_proj_in"  # kohya's LoRAs also train proj_in / proj_out
    tensors |= {f"{proj_in}.lora_down.weight": torch.ones(4, DIM, 1, 1), f"{proj_in}.lora_up.weight": torch.ones(DIM, 4, 1, 1),
                f"{proj_in}.alpha": torch.tensor(2.0)}
    file = write(tmp_path / "proj.safetensors", tensors)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"has LoRA on 33 modules that no target preset trains together \(it has LoRA on "
                                            r"input_blocks.1.1.proj_in\)"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_a_file_on_part_of_the_targets_is_refused(tmp_path):
    weights = trained_weights(ATTENTION)
    cross_attention_only = {p: w for p, w in weights.items() if ".attn2." in p}  # a LoRA on attn2 only
    file, _, _ = kohya_file(tmp_path, ATTENTION, "diffusers", weights=cross_attention_only)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"has LoRA on 16 modules that no target preset trains together \(it has "
                                            r"none on input_blocks.1.1.transformer_blocks.0.attn1.to_k\)"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_a_per_module_alpha_is_refused(tmp_path):
    _, _, tensors = kohya_file(tmp_path, ATTENTION, "diffusers")
    tensors["lora_unet_mid_block_attentions_0_transformer_blocks_0_attn1_to_q.alpha"] = torch.tensor(1.0)
    file = write(tmp_path / "alphas.safetensors", tensors)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"different alpha per module \(middle_block.1.*: 1, .*: 2\)"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


# --- files for another model, and files that are not LoRAs ---

def test_an_sdxl_lora_on_sd15_names_the_model_kind_and_a_key(tmp_path):
    # SDXL's deep blocks (input_blocks.7.1 with 10 transformer layers) do not exist in SD1.5
    key = "lora_unet_input_blocks_7_1_transformer_blocks_9_attn1_to_q"
    file = write(tmp_path / "sdxl.safetensors", {f"{key}.lora_down.weight": torch.ones(4, 1280),
                                                 f"{key}.lora_up.weight": torch.ones(1280, 4),
                                                 f"{key}.alpha": torch.tensor(4.0)})
    settings = LoraSettings(rank=4, alpha=4.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=rf"continue_from 'sdxl.safetensors' does not fit this SD1.x model: 1 of "
                                            rf"its 1 LoRA modules match none of its modules, e.g. '{key}.lora_(down|up).weight'"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_a_file_whose_shapes_are_another_models_is_refused(tmp_path):
    # same module names, other widths (SD2's attention is wider than SD1's, SDXL's names overlap SD1.5's ldm ones)
    weights = {path: (torch.ones(4, 2 * down.shape[1]), torch.ones(2 * up.shape[0], 4))
               for path, (down, up) in trained_weights(ATTENTION).items()}
    file, _, _ = kohya_file(tmp_path, ATTENTION, "ldm", weights=weights)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"does not fit this SD1.x model: 'lora_unet_.*' has shape \(4, (16|32)\) "
                                            r"and its lora_up \((16|32), 4\), but that module of the model has a weight "
                                            r"of shape \((16, 16|16, 8)\)"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_a_file_recorded_for_sdxl_is_refused_on_sd15(tmp_path):
    _, _, tensors = kohya_file(tmp_path, ATTENTION, "ldm")
    file = write(tmp_path / "meta.safetensors", tensors, {"ss_base_model_version": "sdxl_base_v1-0"})
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"'meta.safetensors' was trained on another model \(its metadata says "
                                            r"'sdxl_base_v1-0'\); this is a SD1.x model"):
        continue_from_file(injected(settings), settings, None, SD1, PRESETS)


def test_a_safetensors_file_that_is_not_a_lora_is_refused(tmp_path):
    file = write(tmp_path / "checkpoint.safetensors", {"model.diffusion_model.input_blocks.0.0.weight": torch.ones(4, 4)})
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"'checkpoint.safetensors' holds no LoRA weights: 1 tensors \(e.g. "
                                            r"'model.diffusion_model.input_blocks.0.0.weight'\).*Is it a checkpoint"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


@pytest.mark.parametrize("zipped", [True, False], ids=["torch.save", "legacy-pickle"])
def test_a_pickle_renamed_to_safetensors_is_never_unpickled(tmp_path, monkeypatch, zipped):
    path = tmp_path / "renamed.safetensors"
    torch.save({"lora_unet_x.lora_down.weight": torch.ones(2, 2)}, path, _use_new_zipfile_serialization=zipped)
    settings = LoraSettings(rank=4, alpha=2.0, continue_from=str(path))
    import pickle
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))  # and torch.load is never reached
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load"))
    with pytest.raises(LeanLoRAError, match=r"'renamed.safetensors' .* is a pickled PyTorch file renamed to "
                                            r".safetensors; LeanLoRA never unpickles"):
        continue_from_file(injected(settings), settings, None, SD1, PRESETS)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(LeanLoRAError, match=r"'renamed.safetensors' .* is not a readable safetensors file"):
        continue_from_file(injected(settings), settings, None, SD1, PRESETS)


def test_a_safetensors_file_whose_header_starts_like_a_pickle_is_read(tmp_path):
    """safetensors files begin with their header's length: 0x80 0x02 is a length of 640 bytes, and also the start
    of a pickle (protocol 2). Only a file safetensors refuses is taken for a pickle."""
    module = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    tensors = {f"{module}.lora_down.weight": torch.ones(4, DIM), f"{module}.lora_up.weight": torch.ones(DIM, 4),
               f"{module}.alpha": torch.tensor(2.0)}
    for pad in range(2000):
        file = write(tmp_path / "looks_pickled.safetensors", tensors, {"ss_note": "x" * pad})
        if Path(file).read_bytes()[:2] == b"\x80\x02":
            break
    else:
        pytest.fail("no padding gave a pickle-like header length")
    check_file(LoraSettings(rank=4, alpha=2.0, continue_from=file))  # read, not refused as a pickle


def test_comfyui_trainer_output_with_bias_differences_is_refused_with_where_to_continue_it(tmp_path):
    # ComfyUI's TrainLoraNode saves `<ldm path>.lora_up/down.weight`, `.alpha` and, for every bias, `.diff_b`
    path = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    file = write(tmp_path / "comfy_trained.safetensors", {
        f"{path}.lora_up.weight": torch.ones(DIM, 4), f"{path}.lora_down.weight": torch.ones(4, DIM),
        f"{path}.alpha": torch.tensor(1.0),
        "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_out.0.diff_b": torch.ones(DIM)})
    settings = LoraSettings(rank=4, alpha=1.0, continue_from=file)
    with pytest.raises(LeanLoRAError, match=r"holds bias differences weights .*ComfyUI's own trainer.*ComfyUI's "
                                            r"Train LoRA node"):
        continue_from_file(injected(settings), settings, NAMES, SD1, PRESETS)


def test_the_setting_accepts_only_an_existing_safetensors_file(tmp_path):
    with pytest.raises(LeanLoRAError, match=r"continue_from: got '.*old.pt'; use the path of a .safetensors LoRA"):
        LoraSettings(continue_from=str(tmp_path / "old.pt"))
    with pytest.raises(LeanLoRAError, match=r"continue_from: '.*gone.safetensors' is not a file"):
        LoraSettings(continue_from=str(tmp_path / "gone.safetensors"))
    assert LoraSettings().continue_from is None


def test_the_summary_reads_for_people():
    summary = ContinuedLora(Path("a/b.safetensors"), "diffusers/peft", 12, 4, 2.0, None, 0)
    assert summary.describe() == ("continued from b.safetensors (diffusers/peft): 12 modules loaded, rank 4, alpha 2, "
                                  "no step count recorded; the optimizer starts fresh")
    assert summary.metadata(7) == {"leanlora_continued_from": "b.safetensors", "ss_steps": "7"}
