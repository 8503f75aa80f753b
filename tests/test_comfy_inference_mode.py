"""Training runs in its own thread, in normal (autograd) mode, but ComfyUI's model management must only ever run
in inference mode, as ComfyUI's executor runs it: loading or unloading its models in normal mode leaves tensors
without a version counter that are not inference tensors, and later uses fail, ComfyUI's own CLIPTextEncode too
("Inference tensors do not track version counter", seen on an H200 server after low-VRAM runs and cancels)."""

import pytest
import torch

import comfy.model_management
from bridge.comfy_adapter import ComfyAdapter
from helpers import in_a_training_thread




@pytest.fixture
def model_management_calls(monkeypatch):
    """Records, for every call into ComfyUI's model management, whether inference mode was on."""
    calls = []
    for name in ("unload_all_models", "soft_empty_cache", "load_models_gpu"):
        real = getattr(comfy.model_management, name)

        def recorder(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, torch.is_inference_mode_enabled()))
            return _real(*args, **kwargs)
        monkeypatch.setattr(comfy.model_management, name, recorder)
    return calls


def test_comfyuis_model_management_runs_in_inference_mode_from_the_training_thread(comfy_objects,
                                                                                     model_management_calls):
    model, clip, vae = comfy_objects
    adapter = ComfyAdapter(model, clip, vae)

    def work():
        assert not torch.is_inference_mode_enabled()  # the thread itself is a training thread
        latent = adapter.encode_image(torch.rand(1, 64, 64, 3))
        conds = adapter.encode_text("a photo", 64, 64)
        adapter.image_encoder_id(), adapter.text_encoder_id()
        adapter.release_encoders()
        unet = adapter.training_unet()
        adapter.free(unet)
        return latent, conds, unet

    latent, conds, unet = in_a_training_thread(work)
    names = {name for name, _ in model_management_calls}
    assert {"load_models_gpu", "unload_all_models", "soft_empty_cache"} <= names, model_management_calls
    assert all(inference for _, inference in model_management_calls), model_management_calls
    # what training uses is made of normal tensors: inference tensors cannot be saved for backward
    assert not latent.is_inference() and not any(c.is_inference() for c in conds.values())
    assert not any(p.is_inference() for p in unet.parameters())
