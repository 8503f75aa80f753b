"""The Train and Apply LoRA nodes as a user meets them (issue 15 items 1, 10, 11, 13, 14): over a real ComfyUI
server where the browser's contract matters, in this process where a fault must be injected."""
import importlib
import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from comfy_headless import execution_error

REPO = Path(__file__).resolve().parents[1]
API_WORKFLOW = REPO / "workflows" / "api" / "train_then_generate.json"


def train_only_prompt(**train_inputs) -> dict:
    """Checkpoint -> Dataset / Memory / LoRA Config -> Train, and nothing after Train."""
    api = json.loads(API_WORKFLOW.read_text())
    prompt = {k: api[k] for k in ("1", "2", "3", "4", "5")}
    prompt["5"]["inputs"].update(train_inputs)
    return prompt


def frontend_float(value: float, spec: dict) -> float:
    """What comfyui-frontend-package 1.32.9 (ComfyUI 0.3.75's) stores for a typed FLOAT value: useFloatWidget
    takes its precision from the step's decimals and, unless the input sets `round`, rounds to that precision
    (onFloatValueChange)."""
    step = spec.get("step", 0.5)
    precision = max(0, -math.floor(math.log10(step)))
    rounding = 10 ** -precision if precision and not spec.get("round") else spec.get("round")
    if not rounding:
        return value
    return round(round(value / rounding) * rounding, precision)


@pytest.mark.comfy
def test_train_node_contract_in_object_info(comfy_server):
    info = comfy_server.object_info()["LeanLoRATrain"]
    assert info["output_node"] is True  # a graph with Train and no Save/Preview node has an output
    seed = info["input"]["required"]["seed"][1]
    # the frontend adds a "control after generate: randomize" widget to every INT named seed unless this is False
    assert seed.get("control_after_generate", True) is False
    learning_rate = info["input"]["required"]["learning_rate"][1]
    for typed in (5e-6, 2e-7, 1e-4, 3e-3):
        assert frontend_float(typed, learning_rate) == pytest.approx(typed, rel=1e-9), typed
    assert learning_rate["min"] <= 1e-7


@pytest.mark.comfy
def test_a_graph_with_only_train_runs_with_a_learning_rate_below_1e_5(comfy_server):
    entry = comfy_server.run(train_only_prompt(steps=2, learning_rate=5e-6, output_name="tiny_rate"), timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    lora = comfy_server.base_dir / "models" / "loras" / "tiny_rate.safetensors"
    with safe_open(str(lora), "pt") as f:
        assert f.metadata()["ss_learning_rate"] == "5e-06"
    report = entry["outputs"]["5"]["text"][0]
    assert "learning rate 5e-06" in report and str(lora) in report


@pytest.mark.comfy
def test_cancel_shows_the_partial_lora_through_the_api_and_a_requeue_trains_again(comfy_server):
    prompt = train_only_prompt(steps=100000, output_name="cancel_me")
    prompt["17"] = {"class_type": "PreviewAny", "inputs": {"source": ["5", 5]}}
    loras = comfy_server.base_dir / "models" / "loras"
    for attempt in (1, 2):
        log_start = len(comfy_server.log_text())
        prompt_id = comfy_server.queue(prompt)
        deadline = time.monotonic() + 300
        while "LeanLoRA step 1/100000" not in comfy_server.log_text()[log_start:]:
            assert time.monotonic() < deadline, "training never reached step 1"
            time.sleep(0.2)
        comfy_server.interrupt()
        entry = comfy_server.wait(prompt_id, timeout=60)
        events = [event for event, _ in entry["status"]["messages"]]
        assert "execution_interrupted" in events, entry["status"]  # the rest of the graph stopped
        report = entry["outputs"]["5"]["text"][0]  # the Train node's own output, in /history
        name = report.rsplit("saved to ", 1)[1].strip()
        assert "CANCELLED after step" in report and Path(name).parent == loras and Path(name).is_file()
        assert re.fullmatch(r"cancel_me_partial_step\d+(_2)?\.safetensors", Path(name).name), name
        cached = {n for event, data in entry["status"]["messages"] if event == "execution_cached" for n in data["nodes"]}
        assert "5" not in cached, "a re-queue after Cancel was served the cancelled run from ComfyUI's cache"
    assert len(list(loras.glob("cancel_me_partial_step*.safetensors"))) == 2


# --- in this process: the pack's nodes with injected faults ----------------------------------------------------

@pytest.fixture(scope="module")
def pack():
    """The pack imported as ComfyUI imports it (a package with relative imports), under its own name."""
    name = "leanlora_pack_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return lambda sub: importlib.import_module(f"{name}.{sub}")


def _one_module_lora(model) -> dict:
    module = "input_blocks.1.1.transformer_blocks.0.attn1.to_q"
    weight = model.model.diffusion_model.get_submodule(module).weight
    key = "lora_unet_" + module.replace(".", "_")
    return {f"{key}.lora_down.weight": torch.ones(2, weight.shape[1]) * 1e-3,
            f"{key}.lora_up.weight": torch.ones(weight.shape[0], 2) * 1e-3, f"{key}.alpha": torch.tensor(2.0)}


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -float("inf")])
def test_apply_lora_refuses_a_non_finite_strength(pack, comfy_objects, strength):
    model, clip, _ = comfy_objects
    apply = pack("nodes.apply").LeanLoRAApplyLoRA()
    with pytest.raises(pack("trainer.errors").LeanLoRAError, match="strength_model is .*finite number"):
        apply.execute(model, clip, _one_module_lora(model), strength, 1.0)
    with pytest.raises(pack("trainer.errors").LeanLoRAError, match="strength_clip"):
        apply.execute(model, clip, _one_module_lora(model), 1.0, strength)
    assert apply.execute(model, clip, _one_module_lora(model), 0.5, 1.0)[0] is not model


def test_apply_lora_refuses_nan_weights(pack, comfy_objects):
    model, clip, _ = comfy_objects
    lora = _one_module_lora(model)
    next(v for k, v in lora.items() if k.endswith("lora_up.weight"))[0, 0] = float("nan")
    with pytest.raises(pack("trainer.errors").LeanLoRAError, match="NaN/inf weights"):
        pack("nodes.apply").LeanLoRAApplyLoRA().execute(model, clip, lora, 1.0, 1.0)


def test_cancel_is_seen_by_the_training_loop_itself(pack, comfy_objects, tmp_path, monkeypatch):
    """With no layer code running (a replayed CUDA graph runs none), ComfyUI's per-layer interrupt check cannot
    stop training: the node must turn Cancel into job.cancel() and the loop must check it between steps."""
    import comfy.model_management
    import comfy.ops
    import tiny_assets
    monkeypatch.setattr(comfy.ops, "run_every_op", lambda: None)
    train_node, settings = pack("nodes.train"), pack("trainer.settings")
    dataset = pack("trainer.dataset").scan_folder(tiny_assets.build_tiny_dataset(tmp_path / "ds", n=2), 64)
    adapter = pack("bridge.comfy_adapter").ComfyAdapter(*comfy_objects)
    steps = 400

    def target(job):
        def emit(**event):
            job.emit(**event)
            if event.get("kind") == "step" and event["step"] == 3:
                comfy.model_management.interrupt_current_processing(True)  # what POST /interrupt does
        return pack("trainer.train_lora").train_lora(
            adapter, dataset, settings.MemorySettings("no", False, 1, 1, latent_cache="off"),
            settings.LoraSettings(rank=4, alpha=4.0), settings.TrainSettings(steps, 1e-3, 0, "loop_cancel"),
            tmp_path / "loras", emit, lambda: job.cancelled)
    job = train_node.JOBS.start(target)
    try:
        outcome = train_node.wait_for(job, steps)
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert outcome.partial and 3 <= len(outcome.losses) <= 20, len(outcome.losses)
    assert outcome.lora_path.name == f"loop_cancel_partial_step{len(outcome.losses)}.safetensors"
    assert f"CANCELLED after step {len(outcome.losses)}" in outcome.report
