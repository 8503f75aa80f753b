"""ComfyUI 0.33 beside the pinned 0.3.75: the training copy under 0.33's dynamic VRAM loader (ModelPatcherDynamic,
its default on CUDA), and the bench's ComfyUI peer calling either version's TrainLoraNode.

Once a model has been on the GPU, 0.33 leaves native handles on its layers (`_v`: the VRAM allocation, a ModelVBAR;
`_pin_state`: pinned host buffers, HostBuffers) and per-call casting (`comfy_cast_weights=True`, LoRA patches as
`weight_lowvram_function`); unloading keeps them. A copied handle frees the user's model's memory when the copy is
garbage-collected. The first test builds that state by hand and runs on every ComfyUI; the second lets 0.33's own
loader install it on the CPU (host buffers are real; only the VRAM allocation is a stand-in, it needs a GPU).
Tests that need 0.33 skip on 0.3.75; scripts/test.sh runs this whole file again on 0.33 with the real-server tests
(marker comfy033; docs/TESTING.md says how that ComfyUI is set up).
"""
import gc
import importlib

import pytest
import torch

import comfy.model_patcher
import comfy.ops
import comfyui_version

from bridge.comfy_adapter import ComfyAdapter

pytestmark = pytest.mark.comfy033  # run on both versions (scripts/test.sh)

IS_033 = hasattr(comfy.model_patcher, "ModelPatcherDynamic")
LORA_KEY = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
LOADER_STATE = ("_v", "_v_block", "_v_signature", "_v_weight", "_pin_state", "_pins", "seed_key",
                "weight_lowvram_function", "bias_lowvram_function", "comfy_cast_weights", "weight_function")


class VramAllocation:
    """Stands in for 0.33's ModelVBAR: its destructor frees the allocation (comfy_aimdo's vbar_free)."""
    freed: list[int] = []

    def __init__(self, handle: int):
        self.handle = handle

    def __del__(self):
        VramAllocation.freed.append(self.handle)


@pytest.fixture()
def patched_model(tiny_assets):
    """A MODEL of its own (these tests put loader state on its layers) with a LoRA patched on, loaded as ComfyUI's
    worker thread does (inference tensors)."""
    import comfy.sd
    with torch.inference_mode():
        model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(
            str(tiny_assets["checkpoint"]), output_vae=True, output_clip=True, embedding_directory=None)
        delta = torch.full_like(model.get_model_object(LORA_KEY), 0.01)
        model.add_patches({LORA_KEY: ("diff", (delta,))}, 1.0)
    return model, clip, vae


def _castable_layers(model):
    return [(name, m) for name, m in model.model.diffusion_model.named_modules() if hasattr(m, "comfy_cast_weights")]


def _snapshot(model):
    """Identity of every loader attribute and parameter of the user's model, and the parameters' values."""
    layers = {name: {attr: id(value) for attr, value in vars(m).items() if attr in LOADER_STATE}
              for name, m in model.model.diffusion_model.named_modules()}
    params = {name: (id(p), p.detach().clone()) for name, p in model.model.diffusion_model.named_parameters()}
    return layers, params


def _assert_unchanged(model, snapshot):
    layers, params = _snapshot(model)
    assert layers == snapshot[0]
    for name, (identity, value) in snapshot[1].items():
        assert params[name][0] == identity and torch.equal(params[name][1], value), name


def _per_call_casts(monkeypatch, unet) -> int:
    """How many layer calls of one forward of unet go through ComfyUI's per-call weight cast."""
    calls = {"n": 0}
    cast = comfy.ops.cast_bias_weight

    def counting(*args, **kwargs):
        calls["n"] += 1
        return cast(*args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(comfy.ops, "cast_bias_weight", counting)
        with torch.no_grad():
            unet(torch.randn(1, 4, 8, 8), torch.tensor([500.0]), context=torch.randn(1, 77, 768))
    return calls["n"]


def _assert_plain_copy(unet, model):
    """No loader state on any layer, normal frozen CPU tensors (parameters of its own over the model's host memory,
    bridge/comfy_adapter._host_aliases), the model's LoRA baked in."""
    for name, layer in unet.named_modules():
        left = [attr for attr in LOADER_STATE if attr in vars(layer)]
        assert not left, f"{name} kept {left}"
        if hasattr(layer, "comfy_cast_weights"):
            assert layer.comfy_cast_weights is type(layer).comfy_cast_weights and not layer.weight_function
    originals = dict(model.model.diffusion_model.named_parameters())
    for name, p in unet.named_parameters():
        assert not p.is_inference() and not p.requires_grad and p.device.type == "cpu", name
        assert p is not originals[name], name
    baked = unet.get_parameter(LORA_KEY[len("diffusion_model."):])
    assert torch.allclose(baked, model.get_model_object(LORA_KEY) + 0.01)
    assert baked.data_ptr() != model.get_model_object(LORA_KEY).data_ptr()  # baked into memory of its own


def test_training_copy_leaves_dynamic_vram_state_behind(patched_model, monkeypatch):
    """0.33's loader state, built by hand as ModelPatcherDynamic.load and comfy/ops.py install it, on any ComfyUI."""
    model = patched_model[0]
    pin_state = {"weights": (VramAllocation(-1), [], [-1], [0], [0], {})}  # a HostBuffer at index 0
    for index, (name, layer) in enumerate(_castable_layers(model)):
        layer.comfy_cast_weights = True
        layer.seed_key = name
        layer._pin_state = pin_state
        layer._v_signature = None
        layer.weight_function = []
        key = f"diffusion_model.{name}.weight"
        layer.weight_lowvram_function = comfy.model_patcher.LowVramPatch(key, model.patches) \
            if key in model.patches else None
        layer._v = (VramAllocation(index), 512 * index, 512)
        layer._v_weight = torch.zeros(4)  # on a GPU: a view of the VRAM allocation
    block = model.model.diffusion_model.input_blocks[1]
    block._v_block = block[1].proj_in._v  # a whole block's span, on its first layer
    assert _per_call_casts(monkeypatch, model.model.diffusion_model) > 0  # the state routes layers through casts
    before = _snapshot(model)
    VramAllocation.freed.clear()

    unet = ComfyAdapter(*patched_model).training_unet()

    _assert_plain_copy(unet, model)
    assert _per_call_casts(monkeypatch, unet) == 0
    del unet
    gc.collect()
    assert VramAllocation.freed == []  # no copy of a handle existed to free the user's memory
    _assert_unchanged(model, before)


@pytest.mark.skipif(not IS_033, reason=f"needs ComfyUI 0.33's ModelPatcherDynamic; running ComfyUI is "
                                       f"{comfyui_version.__version__}")
def test_training_copy_after_0_33s_own_dynamic_load_trains(patched_model, monkeypatch, tmp_path):
    """ModelPatcherDynamic.load itself installs the state (CPU: host buffers real, no VRAM allocation), then a run
    trains on the copy and the user's model keeps every handle, tensor and output."""
    import comfy_aimdo.control
    import comfy_aimdo.host_buffer
    import tiny_assets
    from trainer.dataset import scan_folder
    from trainer.settings import LoraSettings, MemorySettings, TrainSettings
    from trainer.train_lora import train_lora

    if comfy_aimdo.host_buffer.lib is None:  # ComfyUI inits comfy_aimdo only on a GPU; host buffers work without
        assert comfy_aimdo.control.init(), "comfy_aimdo's native library did not load"
        importlib.reload(comfy_aimdo.host_buffer)  # binds its functions to the now-loaded library
    model, clip, vae = patched_model
    # ModelPatcherDynamic.__new__ hands a CPU load device to the plain ModelPatcher; its load works on the CPU.
    dynamic = object.__new__(comfy.model_patcher.ModelPatcherDynamic)
    dynamic.__init__(model.model, model.load_device, model.offload_device)
    dynamic.patches, dynamic.patches_uuid = model.patches, model.patches_uuid
    with torch.inference_mode():
        dynamic.load(model.load_device)
    staged = [layer for _, layer in _castable_layers(model) if hasattr(layer, "weight_lowvram_function")]
    lora_layer = model.model.diffusion_model.get_submodule(LORA_KEY[len("diffusion_model."):-len(".weight")])
    assert staged and isinstance(lora_layer.weight_lowvram_function, comfy.model_patcher.LowVramPatch)
    host_buffer = lora_layer._pin_state["weights"][0]
    assert isinstance(host_buffer, comfy_aimdo.host_buffer.HostBuffer) and host_buffer._ptr
    for index, layer in enumerate(staged):  # what vbar.alloc would add on a GPU
        layer._v = (VramAllocation(index), 512 * index, 512)
    x, t, context = torch.randn(1, 4, 8, 8), torch.tensor([500.0]), torch.randn(1, 77, 768)
    with torch.no_grad():
        reference = model.model.diffusion_model(x, t, context=context)
    before, pointer = _snapshot(model), host_buffer._ptr
    VramAllocation.freed.clear()

    adapter = ComfyAdapter(dynamic, clip, vae)
    unet = adapter.training_unet()
    _assert_plain_copy(unet, model)
    assert _per_call_casts(monkeypatch, unet) == 0
    del unet
    dataset = scan_folder(tiny_assets.build_tiny_dataset(tmp_path / "ds", n=2), 64)
    outcome = train_lora(adapter, dataset, MemorySettings("no", False, 1, 1), LoraSettings(rank=4, alpha=4.0),
                         TrainSettings(3, 1e-3, 0, "dynamic"), tmp_path, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 3 and all(loss == loss for loss in outcome.losses) and not outcome.partial
    assert outcome.lora_path.is_file()
    gc.collect()

    assert VramAllocation.freed == [] and host_buffer._ptr == pointer
    _assert_unchanged(model, before)
    with torch.no_grad():
        assert torch.equal(model.model.diffusion_model(x, t, context=context), reference)


def _spy_on_train_node(monkeypatch) -> dict:
    """Records the arguments bench's ComfyUI peer passes to TrainLoraNode.execute (which still runs)."""
    import functools
    from comfy_extras.nodes_train import TrainLoraNode
    seen, execute = {}, TrainLoraNode.execute

    @functools.wraps(execute)  # keeps execute's signature, which the peer reads
    def spy(**arguments):
        seen.update(arguments)
        return execute(**arguments)
    monkeypatch.setattr(TrainLoraNode, "execute", spy)
    return seen


def _tiny_workload():
    from bench.run import SPECS, make_workload
    return make_workload(SPECS["sd15-tiny"], 1, torch.device("cpu"))


def test_comfyui_peer_offloading_runs_where_the_node_has_it(monkeypatch):
    """0.33's node gets offloading and trains; 0.3.75's has no such input, so the row says so before any work."""
    import inspect
    from bench.peers import PeerUnavailable, run_comfyui_peer
    from comfy_extras.nodes_train import TrainLoraNode

    seen = _spy_on_train_node(monkeypatch)
    if "offloading" not in inspect.signature(TrainLoraNode.execute).parameters:
        with pytest.raises(PeerUnavailable, match="TrainLoraNode has no offloading input"):
            run_comfyui_peer(_tiny_workload(), 1, 1, offloading=True)
        assert seen == {}
        return
    result = run_comfyui_peer(_tiny_workload(), 1, 1, offloading=True)
    assert seen["offloading"] == [True] and seen["model"][0].offload_device == torch.device("cpu")
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))
    assert "offloading: weights streamed from CPU memory" in result["notes"]


@pytest.mark.skipif(not IS_033, reason=f"needs ComfyUI 0.33's TrainLoraNode inputs; running ComfyUI is "
                                       f"{comfyui_version.__version__}")
def test_comfyui_peer_passes_every_input_of_0_33s_node(monkeypatch):
    """The five inputs 0.3.75's node lacks come from the node's own schema defaults (offloading off)."""
    from bench.peers import run_comfyui_peer

    seen = _spy_on_train_node(monkeypatch)
    result = run_comfyui_peer(_tiny_workload(), 1, 1)
    assert {name: seen[name] for name in ("quantized_backward", "checkpoint_depth", "offloading", "bucket_mode",
                                          "bypass_mode")} == {"quantized_backward": [False], "checkpoint_depth": [1],
                                                              "offloading": [False], "bucket_mode": [False],
                                                              "bypass_mode": [False]}
    assert len(result["losses"]) == 2 and all(torch.isfinite(torch.tensor(result["losses"])))


def test_training_steps_and_probes_run_with_comfyuis_training_switch_on_and_leave_it_as_it_was(comfy_objects,
                                                                                             monkeypatch, tmp_path):
    """0.33's DiT attention takes comfy-kitchen's fused inference kernels, which have no backward, unless
    comfy.model_management.in_training is set (ComfyUI's own trainer sets it around its loop): every training
    forward and backward runs with it set, and the run leaves it as it found it. On 0.3.75, which has no such
    switch, the attribute is put there for the test; the adapter only sets one that exists."""
    import numpy as np
    import tiny_assets as tiny_assets_lib
    from bridge.comfy_adapter import ComfyAdapter
    from trainer.dataset import scan_folder
    from trainer.settings import LoraSettings, MemorySettings, TrainSettings
    from trainer.train_lora import train_lora
    monkeypatch.setattr(comfy.model_management, "in_training", False, raising=False)
    adapter = ComfyAdapter(*comfy_objects)
    seen = []
    predict = adapter.predict

    def spy(*args, **kwargs):
        seen.append(comfy.model_management.in_training)
        return predict(*args, **kwargs)
    monkeypatch.setattr(adapter, "predict", spy)
    dataset = scan_folder(tiny_assets_lib.build_tiny_dataset(tmp_path / "ds", n=2), 64)
    outcome = train_lora(adapter, dataset, MemorySettings("no", True), LoraSettings(rank=4),
                         TrainSettings(2, 1e-3, 0, "switch"), tmp_path, lambda **event: None, lambda: False)
    assert len(outcome.losses) == 2 and all(np.isfinite(outcome.losses))
    assert seen and all(seen), seen  # every training forward (and the checkpointed recompute inside backward)
    assert comfy.model_management.in_training is False
