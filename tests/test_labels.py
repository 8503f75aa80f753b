"""UI labels are the node layer's business: one table (nodes/labels.py) maps them to the trainer's values, so a
label can be renamed without changing how training runs, and workflows saved with today's labels keep working."""
import ast
import importlib
from pathlib import Path

import pytest

from helpers import PACK, node_module as _node_module, sd_targets

REPO = Path(__file__).resolve().parents[1]
TRAIN_FIELDS = ("timestep_sampling", "loss")  # Train's dropdowns in the table; the rest are Memory / LoRA Config's


@pytest.fixture(scope="module")
def labels():
    return _node_module("labels")


def test_every_label_maps_to_a_value_and_back(labels):
    settings = importlib.import_module(f"{PACK}.trainer.settings")
    for field, table in labels.LABELS.items():
        for label, value in table.items():
            assert labels.label_of(field, value) == label, (field, label)
            kind = settings.LoraSettings if field in ("targets", "type") else settings.TrainSettings \
                if field in TRAIN_FIELDS else settings.MemorySettings
            assert getattr(kind(**{field: value}), field) == value, (field, label)


def test_the_dropdowns_are_the_table_and_todays_labels_still_load(labels):
    node_settings = _node_module("settings")
    trainer_settings = importlib.import_module(f"{PACK}.trainer.settings")
    inputs = node_settings.LeanLoRAMemorySettings.INPUT_TYPES()
    lora_config = node_settings.LeanLoRALoraConfig.INPUT_TYPES()
    inputs = {**inputs["required"], **inputs["optional"], **lora_config["required"], **lora_config["optional"],
              **_node_module("train").LeanLoRATrain.INPUT_TYPES()["optional"]}
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
    assert (lora.type, lora.factor) == (s.AdapterKind.LORA, -1)  # saved before type and factor: plain LoRA
    lokr, = node_settings.LeanLoRALoraConfig().execute(8, 8.0, 0.0, "attention", type="lokr", factor=8)
    assert (lokr.type, lokr.factor) == (s.AdapterKind.LOKR, 8)


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


def test_the_card_leads_memory_settings_and_decides_auto_fit_unless_manual(labels):
    """Issue 33 item 1: `card` is the first widget, auto by default; a card sets auto-fit's budget whatever the
    auto_fit widget says; manual takes auto_fit as given, and so does a workflow saved before the card existed."""
    node_settings = _node_module("settings")
    s = importlib.import_module(f"{PACK}.trainer.settings")
    inputs = node_settings.LeanLoRAMemorySettings.INPUT_TYPES()
    order = [*inputs["required"], *inputs["optional"]]  # the frontend's widget order
    assert order[0] == "card" and inputs["optional"]["card"][1]["default"] == labels.CARD_AUTO
    assert inputs["optional"]["card"][0] == [labels.CARD_AUTO, *(f"{g} GiB" for g in labels.CARD_SIZES_GIB),
                                             labels.CARD_MANUAL]
    # after the card, the widgets in the order a workflow saved before it holds their values
    assert order[1:] == ["mixed_precision", "gradient_checkpointing", "batch_size", "gradient_accumulation",
                         "optimizer", "base_weights", "auto_fit", "latent_cache", "attention", "checkpoint_depth",
                         "checkpoint_share", "fast_path", "activation_offload", "compile", "lora_weights", "allocator",
                         "stream_share", "ram", "selective_recompute", "prefetch_streamed", "gpus"]
    run = lambda **given: node_settings.LeanLoRAMemorySettings().execute(**given)[0]  # noqa: E731
    assert run(card=labels.CARD_AUTO, auto_fit="off").auto_fit == s.AUTO_FIT_FREE_VRAM
    assert run(card="8 GiB", auto_fit="free VRAM").auto_fit == s.AutoFit(card_gib=8)
    assert run(card="2 GiB").auto_fit == s.AutoFit(card_gib=2)
    assert run(card=labels.CARD_MANUAL, auto_fit="off").auto_fit == s.AUTO_FIT_OFF
    assert run(card=labels.CARD_MANUAL, auto_fit="6 GiB").auto_fit == s.AutoFit(card_gib=6)
    assert run(auto_fit="4 GiB").auto_fit == s.AutoFit(card_gib=4)  # no card: an older workflow, as it meant
    assert run().auto_fit == s.AUTO_FIT_OFF
    # the other widgets are taken as given in every mode (the plan starts from them)
    memory = run(card="8 GiB", mixed_precision="fp16", batch_size=3, base_weights="fp8")
    assert (memory.mixed_precision, memory.batch_size, memory.base_weights) == ("fp16", 3, s.BaseWeights.FP8)
    errors = importlib.import_module(f"{PACK}.trainer.errors")
    with pytest.raises(errors.LeanLoRAError, match=r"card: got '5 GiB'; choose one of auto \(this GPU\), 2 GiB"):
        run(card="5 GiB")


def test_memory_settings_tooltips_are_short_and_the_simple_set_is_small():
    node_settings = _node_module("settings")
    inputs = node_settings.LeanLoRAMemorySettings.INPUT_TYPES()["optional"]
    long = {name: len(spec[1]["tooltip"]) for name, spec in inputs.items() if len(spec[1]["tooltip"]) > 200}
    assert not long, long
    simple = [name for name, spec in inputs.items() if not spec[1].get("advanced")]
    assert simple == ["card", "batch_size", "gradient_accumulation", "latent_cache", "ram"]


def test_the_trainer_holds_no_card_label(labels):
    wording = set(labels.CARDS)
    found = [path.name for path in (REPO / "trainer").rglob("*.py")
             if _string_constants(ast.parse(path.read_text(), str(path))) & wording]
    assert not found, found
