"""UI labels are the node layer's business: one table (nodes/labels.py) maps them to the trainer's values, so a
label can be renamed without changing how training runs, and workflows saved with today's labels keep working."""
import ast
import importlib
from pathlib import Path

import pytest

from helpers import PACK, node_module as _node_module, sd_targets

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def labels():
    return _node_module("labels")


def test_every_label_maps_to_a_value_and_back(labels):
    settings = importlib.import_module(f"{PACK}.trainer.settings")
    for field, table in labels.LABELS.items():
        for label, value in table.items():
            assert labels.label_of(field, value) == label, (field, label)
            kind = settings.LoraSettings if field == "targets" else settings.MemorySettings
            assert getattr(kind(**{field: value}), field) == value, (field, label)


def test_the_dropdowns_are_the_table_and_todays_labels_still_load(labels):
    node_settings = _node_module("settings")
    trainer_settings = importlib.import_module(f"{PACK}.trainer.settings")
    inputs = node_settings.LeanLoRAMemorySettings.INPUT_TYPES()
    inputs = {**inputs["required"], **inputs["optional"], **node_settings.LeanLoRALoraConfig.INPUT_TYPES()["required"]}
    for field, table in labels.LABELS.items():
        options, extra = inputs[field]
        assert options == list(table) and extra["default"] in table, field
    # a workflow saved before the table existed: its widget values are today's labels
    memory, = node_settings.LeanLoRAMemorySettings().execute(
        mixed_precision="bf16", gradient_checkpointing=True, batch_size=1, gradient_accumulation=1,
        optimizer="AdamW", base_weights="fp8 streamed from CPU", auto_fit="8 GiB", latent_cache="RAM + disk",
        attention="chunked (sub-quadratic)", checkpoint_depth="per block", fast_path="off",
        lora_weights="bf16 + stochastic rounding", allocator="as started")
    s = trainer_settings
    assert (memory.base_weights, memory.auto_fit, memory.latent_cache, memory.attention, memory.checkpoint_depth,
            memory.fast_path, memory.lora_weights, memory.allocator) == (
        s.BaseWeights.FP8_STREAMED, s.AutoFit(card_gib=8), s.LatentCache.RAM_AND_DISK, s.Attention.SUB_QUADRATIC,
        s.CheckpointDepth.BLOCK, s.FastPath.OFF, s.LoraWeights.BF16_STOCHASTIC_ROUNDING, s.Allocator.AS_STARTED)
    lora, = node_settings.LeanLoRALoraConfig().execute(8, 8.0, 0.0, "attention+feed-forward")
    assert lora.targets is s.LoraTargets.ATTENTION_FEED_FORWARD and "ff.net.2" in sd_targets(lora)


def test_an_unknown_label_names_the_field_and_its_choices(labels):
    errors = importlib.import_module(f"{PACK}.trainer.errors")
    with pytest.raises(errors.LeanLoRAError, match=r"base_weights: got 'fp4'; choose one of as loaded, fp8"):
        labels.values_of({"base_weights": "fp4"})


def _string_constants(tree: ast.AST) -> set[str]:
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_the_trainer_holds_no_ui_label(labels):
    """A label that is not also the spelling of a value ("as loaded", "8 GiB", "per layer"; not "fp8" or "off")
    never appears as a string in trainer/: the trainer decides on values, so renaming the label cannot change a run."""
    spelled_values = {getattr(value, "value", None) for table in labels.LABELS.values() for value in table.values()}
    wording_only = {label for table in labels.LABELS.values() for label in table} - spelled_values
    assert "fp8 streamed from CPU" in wording_only and "8 GiB" in wording_only and "fp8" not in wording_only
    found = {}
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for constant in _string_constants(ast.parse(path.read_text(), str(path))) & wording_only:
            found.setdefault(constant, []).append(path.relative_to(REPO).as_posix())
    assert not found, found
