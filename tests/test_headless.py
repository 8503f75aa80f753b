"""python -m leanlora (issue 43 item 1): the config's keys are the nodes' widgets, kohya's names map onto them, every
key refuses a bad value with a clear error, a workflow's Train node goes to a config and back unchanged, and the
headless run of the tiny checkpoint writes the same LoRA as the nodes run in this process."""
import copy
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leanlora import cli, config, library
from leanlora.library import ConfigError

REPO = Path(__file__).resolve().parents[1]
UI_WORKFLOW = REPO / "example_workflows" / "leanlora_train_with_samples.json"
API_WORKFLOW = REPO / "workflows" / "api" / "train_then_generate.json"


@pytest.fixture(autouse=True)
def comfy_folders():
    """ComfyUI's folder table as it was: the runs here add loras and checkpoint folders."""
    import folder_paths
    saved = copy.deepcopy(folder_paths.folder_names_and_paths)
    yield
    folder_paths.folder_names_and_paths.clear()
    folder_paths.folder_names_and_paths.update(saved)


def _error(values: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        config.parse(values)
    return str(caught.value)


# --- the keys ---------------------------------------------------------------------------------------------------------

def test_every_widget_of_the_four_nodes_is_a_key_and_every_kohya_name_maps_to_one():
    table = config.keys()
    for section, (module, cls) in config.NODES.items():
        inputs = getattr(library.pack(module), cls).INPUT_TYPES()
        widgets = [name for group in ("required", "optional") for name, spec in inputs.get(group, {}).items()
                   if isinstance(spec[0], list) or spec[0] in config.WIDGETS]
        assert widgets and all(table[name].section == section for name in widgets), section
    assert {"checkpoint", "diffusion_model", "text_encoder", "vae", "output_dir"} <= set(table)
    assert all(target in table for target, _ in config.ALIASES.values())
    for kohya in ("pretrained_model_name_or_path", "train_data_dir", "resolution", "network_dim", "network_alpha",
                  "learning_rate", "optimizer_type", "mixed_precision", "gradient_checkpointing",
                  "gradient_accumulation_steps", "save_every_n_steps", "max_train_steps", "output_name", "seed",
                  "lr_scheduler", "lr_warmup_steps", "train_batch_size", "network_dropout"):
        assert kohya in config.ALIASES, kohya


def test_kohya_names_and_values_are_mapped(tmp_path):
    kohya = tmp_path / "kohya.toml"
    kohya.write_text('pretrained_model_name_or_path = "/models/sd15.safetensors"\ntrain_data_dir = "/data/cats"\n'
                     'resolution = "768,768"\nnetwork_dim = 32\nnetwork_alpha = 16\nlearning_rate = 5e-5\n'
                     'optimizer_type = "adamw8bit"\nmixed_precision = "fp16"\ngradient_checkpointing = true\n'
                     'gradient_accumulation_steps = 4\nsave_every_n_steps = 100\nmax_train_steps = 1600\n'
                     'output_name = "cats"\nseed = 42\nlr_scheduler = "cosine"\nlr_warmup_steps = 50\n'
                     'train_batch_size = 2\nnetwork_dropout = 0.1\nloss_type = "huber"\nxformers = true\n'
                     'fp8_base = false\nshuffle_caption = true\ncaption_tag_dropout_rate = 0.05\n'
                     '[dataset_arguments]\nenable_bucket = true\n')
    values = config.load(kohya)
    assert {k: values[k] for k in ("checkpoint", "folder", "resolution", "rank", "alpha", "learning_rate", "optimizer",
                                   "mixed_precision", "gradient_checkpointing", "gradient_accumulation",
                                   "save_every_n_steps", "steps", "output_name", "seed", "lr_schedule",
                                   "warmup_steps", "batch_size", "dropout", "loss", "attention", "base_weights",
                                   "shuffle_tags", "tag_dropout", "framing")} == {
        "checkpoint": "/models/sd15.safetensors", "folder": "/data/cats", "resolution": 768, "rank": 32,
        "alpha": 16.0, "learning_rate": 5e-5, "optimizer": "AdamW8bit", "mixed_precision": "fp16",
        "gradient_checkpointing": True, "gradient_accumulation": 4, "save_every_n_steps": 100, "steps": 1600,
        "output_name": "cats", "seed": 42, "lr_schedule": "cosine", "warmup_steps": 50, "batch_size": 2,
        "dropout": 0.1, "loss": "Huber", "attention": "xformers", "base_weights": "as loaded", "shuffle_tags": True,
        "tag_dropout": 0.05, "framing": "aspect-ratio buckets"}
    yaml_file = tmp_path / "kohya.yaml"
    yaml_file.write_text("network_dim: 8\nmax_train_steps: 10\nlr_scheduler: constant_with_warmup\n")
    from_yaml = config.load(yaml_file)
    assert (from_yaml["rank"], from_yaml["steps"], from_yaml["lr_schedule"]) == (8, 10, "constant")


def test_yaml_without_pyyaml_says_to_use_toml_or_install_it(tmp_path, monkeypatch):
    path = tmp_path / "c.yml"
    path.write_text("network_dim: 8\n")
    monkeypatch.setitem(sys.modules, "yaml", None)
    with pytest.raises(ConfigError, match=r"needs PyYAML \(pip install pyyaml\); or write the config as TOML"):
        config.read(path)


def test_an_unknown_key_names_the_closest_known_ones():
    assert "unknown key 'netwrok_dim'; did you mean network_dim" in _error({"netwrok_dim": 8})
    assert "unknown key 'learning_rte'; did you mean learning_rate" in _error({"learning_rte": 1e-4})
    assert _error({"max_grad_norm": 1.0}).startswith("unknown key 'max_grad_norm'")
    assert _error({"network_dim": 8, "rank": 8}) == "rank given twice: as network_dim and as rank"


def _bad_values(key):
    """(value, what the error says) for each way a value of this key can be wrong."""
    cases = {"INT": [("x", "Failed to convert an input value to a INT value"), (1.5, "INT value")],
             "FLOAT": [("x", "Failed to convert an input value to a FLOAT value")],
             "BOOLEAN": [("yes", "Failed to convert an input value to a BOOLEAN value")],
             "STRING": [(3, "Failed to convert an input value to a STRING value")],
             "FILE": [(3, "STRING value")], "FILES": [(["a", "b", "c"], "a file, or a list of two files")],
             "COMBO": [(["x"], "STRING value") if key.name in config.DYNAMIC else ("no such", "Value not in list")]}
    found = list(cases[key.kind])
    if "min" in key.options:
        found.append((key.options["min"] - 1, f"Value {key.options['min'] - 1} smaller than min of"))
    if "max" in key.options:
        found.append((key.options["max"] + 1, f"Value {key.options['max'] + 1} bigger than max of"))
    return found


def test_every_key_refuses_a_bad_value_naming_itself_as_comfyui_does():
    for name, key in config.keys().items():
        for value, says in _bad_values(key):
            message = _error({name: value})
            assert message.startswith(f"{name}: ") and says in message, (name, value, message)
    assert _error({"max_train_steps": 0}) == "max_train_steps (steps): Value 0 smaller than min of 1"
    assert _error({"optimizer_type": "Adam"}).startswith("optimizer_type (optimizer): Value not in list: 'Adam' not in")
    assert "not square" in _error({"resolution": "512,768"})


def test_a_value_the_node_refuses_is_the_nodes_error(tmp_path, capsys):
    memory = {"card": "manual", "mixed_precision": "no", "lora_weights": "bf16 + stochastic rounding"}
    node = library.pack("nodes.settings").LeanLoRAMemorySettings
    with pytest.raises(library.pack("trainer.errors").LeanLoRAError) as caught:
        node().execute(**memory)
    path = tmp_path / "bad.toml"
    path.write_text(config.to_toml({**config.complete(memory), "folder": str(tmp_path)}))
    assert cli.main(["train", str(path)]) == 1
    assert capsys.readouterr().err.strip() == f"leanlora: {caught.value}"
    path.write_text("[train]\nsteps = 0\n")
    assert cli.main(["train", str(path)]) == 2
    assert capsys.readouterr().err.strip() == "leanlora: steps: Value 0 smaller than min of 1"


def test_the_model_needs_a_checkpoint_or_all_three_parts_and_a_loaders_type():
    with pytest.raises(ConfigError, match=r"set checkpoint, or diffusion_model, text_encoder and vae \(missing: "
                                          r"text_encoder, vae\)"):
        library.load_model({"diffusion_model": "flux1-dev.safetensors"})
    with pytest.raises(ConfigError, match=r"clip_type: None is not a type of DualCLIPLoader \(2 text encoders\); "
                                          r"choose one of sdxl, sd3, flux"):
        library.load_model({"diffusion_model": "a", "text_encoder": ["clip_l", "t5xxl"], "vae": "ae"})
    with pytest.raises(ConfigError, match=r"checkpoint: 'no_such.safetensors' is neither a file nor a name in "
                                          r"ComfyUI's checkpoints folders .*never downloads"):
        library.load_model({"checkpoint": "no_such.safetensors"})


# --- config <-> workflow ----------------------------------------------------------------------------------------------

def _edited_ui_workflow() -> dict:
    """The samples template with every LeanLoRA widget set away from its default (strings with quotes, new lines,
    non-ASCII), in full."""
    workflow = json.loads(UI_WORKFLOW.read_text())
    nodes = {node["type"]: node for node in workflow["nodes"]}
    edits = {"LeanLoRADataset": ["cats \"2\"", 768, 3, "ñlnr", "aspect-ratio buckets"],
             "LeanLoRALoraConfig": [24, 12.0, 0.05, "attention+feed-forward", "none", "lokr", 8, 0.0]}
    train = dict(zip([name for name, _ in config._slots("train")], nodes["LeanLoRATrain"]["widgets_values"]))
    train.update(learning_rate=5e-6, seed=7, output_name="it's \"mine\"", noise_offset=0.05, loss="Huber",
                 sample_prompts="a\nb \\ c\t\"d\"", shuffle_tags=True, keep_tokens=1, masked_loss=True, ema_decay=0.999)
    defaults = config.complete({})
    edits["LeanLoRATrain"] = [train.get(name, defaults.get(name)) for name, _ in config._slots("train")]
    memory = list(nodes["LeanLoRAMemorySettings"]["widgets_values"])
    memory[0:3] = ["8 GiB", "fp16", True]
    # widgets newer than the template (saved without them) come back from the config at their defaults
    memory += [defaults.get(name) for name, _ in config._slots("memory")[len(memory):]]
    edits["LeanLoRAMemorySettings"] = memory
    for kind, values in edits.items():
        nodes[kind]["widgets_values"] = values
    nodes["CheckpointLoaderSimple"]["widgets_values"] = ["sdxl/base 1.0.safetensors"]
    return workflow


def _leanlora_widgets(workflow: dict) -> dict:
    return {node["type"]: node["widgets_values"] for node in workflow["nodes"]
            if node["type"] in config.NODE_SECTION or node["type"] == "CheckpointLoaderSimple"}


def test_a_workflows_train_node_goes_to_a_config_and_back_unchanged(tmp_path):
    workflow = _edited_ui_workflow()
    values = config.from_workflow(workflow)
    assert values["checkpoint"] == "sdxl/base 1.0.safetensors" and values["type"] == "lokr"
    assert values["sample_prompts"] == "a\nb \\ c\t\"d\"" and values["card"] == "8 GiB"
    path = tmp_path / "exported.toml"
    path.write_text(config.to_toml(values))
    assert config.load(path) == values  # through the TOML text
    back = config.into_workflow(json.loads(UI_WORKFLOW.read_text()), config.load(path))  # the template's old values
    assert _leanlora_widgets(back) == _leanlora_widgets(workflow)
    # the same through the commands, on the API twin of the SD template
    out = tmp_path / "api.toml"
    assert cli.main(["config-from-workflow", str(API_WORKFLOW), "-o", str(out)]) == 0
    api = json.loads(API_WORKFLOW.read_text())
    assert config.load(out)["rank"] == api["4"]["inputs"]["rank"] and config.load(out)["checkpoint"] == \
        api["1"]["inputs"]["ckpt_name"]
    result = tmp_path / "api.json"
    assert cli.main(["config-to-workflow", str(out), str(API_WORKFLOW), "-o", str(result)]) == 0
    written = json.loads(result.read_text())
    for node_id in ("1", "2", "3", "4", "5"):
        assert {k: v for k, v in written[node_id]["inputs"].items() if k in api[node_id]["inputs"]} == \
            api[node_id]["inputs"]


def test_a_memory_node_saved_before_card_exports_as_manual():
    workflow = json.loads(UI_WORKFLOW.read_text())
    memory = next(node for node in workflow["nodes"] if node["type"] == "LeanLoRAMemorySettings")
    memory["widgets_values"] = memory["widgets_values"][1:]  # no card: mixed_precision first
    memory["widgets_values"][1] = True  # gradient_checkpointing
    values = config.from_workflow(workflow)
    assert values["card"] == "manual" and values["gradient_checkpointing"] is True


def test_print_config_writes_every_key_with_its_default(capsys):
    assert cli.main(["train", "--print-config"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert config.parse(printed) == config.complete({})
    written = {key for table in printed.values() for key in table}
    assert written == {name for name, key in config.keys().items() if key.default is not config.MISSING}


# --- the run ----------------------------------------------------------------------------------------------------------

STEPS = 3


def _node_path(tiny_assets, loras: Path) -> dict:
    """The API workflow's training nodes run in this process as ComfyUI runs them: its checkpoint loader, then the
    pack's Dataset, Memory Settings, LoRA Config and Train nodes with the workflow's inputs."""
    import folder_paths
    import nodes
    api = json.loads(API_WORKFLOW.read_text())
    folder_paths.add_model_folder_path("checkpoints", str(tiny_assets["checkpoint"].parent))
    folder_paths.add_model_folder_path("loras", str(loras), is_default=True)
    model, clip, vae = nodes.CheckpointLoaderSimple().load_checkpoint(api["1"]["inputs"]["ckpt_name"])
    dataset, = library.pack("nodes.dataset").LeanLoRADataset().execute(
        **{**api["2"]["inputs"], "folder": str(tiny_assets["dataset"])})
    settings = library.pack("nodes.settings")
    memory, = settings.LeanLoRAMemorySettings().execute(**api["3"]["inputs"])
    lora, = settings.LeanLoRALoraConfig().execute(**api["4"]["inputs"])
    train = {k: v for k, v in api["5"]["inputs"].items() if not isinstance(v, list)}
    train.update(steps=STEPS, output_name="node_run", save_every_n_steps=STEPS)  # a state to resume from
    output = library.pack("nodes.train").LeanLoRATrain().execute(model, clip, vae, dataset, memory, lora, **train)
    return load_file(loras / output["result"][3])


def test_the_headless_run_writes_the_same_lora_as_the_nodes(tiny_assets, tmp_path, capsys):
    node_lora = _node_path(tiny_assets, tmp_path / "node")
    toml = tmp_path / "run.toml"
    assert cli.main(["config-from-workflow", str(API_WORKFLOW), "-o", str(toml)]) == 0
    text = toml.read_text().replace('checkpoint = "leanlora_tiny_sd15.safetensors"',
                                    f'checkpoint = "{tiny_assets["checkpoint"]}"')
    text = text.replace('folder = "tiny_dataset"', f'folder = "{tiny_assets["dataset"]}"')
    text = text.replace("\nsteps = 40", f"\nsteps = {STEPS}").replace('"leanlora_demo"', '"cli_run"')
    text = text.replace("save_every_n_steps = 0", f"save_every_n_steps = {STEPS}")
    toml.write_text(text.replace("# output_dir = ...", f'output_dir = "{tmp_path / "cli"}"'))
    capsys.readouterr()
    assert cli.main(["train", str(toml)]) == 0
    out = capsys.readouterr().out
    assert f"LeanLoRA step 1/{STEPS}, loss" in out and "LeanLoRA: saved " in out, out[-3000:]
    assert out.rstrip().endswith(str(tmp_path / "cli" / "cli_run.safetensors"))
    cli_lora = load_file(tmp_path / "cli" / "cli_run.safetensors")
    assert cli_lora.keys() == node_lora.keys() and len(cli_lora) > 0
    for name, tensor in node_lora.items():
        assert torch.equal(cli_lora[name], tensor), name
    # resume: the state the run wrote, taken up by a longer run, as the node's resume takes it
    toml.write_text(toml.read_text().replace(f"\nsteps = {STEPS}", f"\nsteps = {STEPS + 2}")
                    .replace('resume = "off"', 'resume = "latest state of this output name"'))
    assert cli.main(["train", str(toml)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from cli_run.leanlora-state: step {STEPS} of {STEPS + 2}" in out, out[-3000:]
    assert (tmp_path / "cli" / "cli_run_2.safetensors").is_file()


def test_python_dash_m_leanlora_runs_from_the_packs_folder():
    """The entry point itself, in a fresh process (its usage: no ComfyUI import needed for --help)."""
    result = subprocess.run([sys.executable, "-m", "leanlora", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "config-from-workflow" in result.stdout, result.stderr
    folder = subprocess.run([sys.executable, str(REPO / "leanlora"), "train", "--help"], cwd="/", capture_output=True,
                            text=True, timeout=60)
    assert folder.returncode == 0 and "--print-config" in folder.stdout, folder.stderr
