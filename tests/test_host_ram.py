"""Host RAM is a card too (issue 44 item 5): the training copy of the diffusion model shares ComfyUI's host
memory for every frozen tensor training does not convert, instead of holding the model a second time (a 20 GiB
Qwen-Image file was held twice: 64 GiB of host RAM peaked at 8 GiB on the GPU machine, 6 Dec)."""
import gc

import psutil
import pytest
import torch

from bridge.comfy_adapter import _plain_copy


def _inference_module(width: int, depth: int) -> torch.nn.Module:
    """Weights created as ComfyUI's executor creates them: under inference mode (inference tensors)."""
    with torch.inference_mode():
        torch.manual_seed(0)
        module = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
        module.register_buffer("table", torch.arange(8.0))
    return module


def test_the_copy_shares_the_host_memory_of_every_frozen_tensor_and_trains_through_it():
    original = _inference_module(64, 3)
    assert original[0].weight.is_inference()
    copied = _plain_copy(original)
    pairs = list(zip([*original.parameters(), *original.buffers()], [*copied.parameters(), *copied.buffers()]))
    for mine, theirs in pairs:
        assert theirs is not mine and theirs.data_ptr() == mine.data_ptr(), "a frozen tensor was copied"
        assert not theirs.is_inference()
    copied.requires_grad_(False)
    x = torch.randn(4, 64, requires_grad=True)
    copied(x).square().sum().backward()  # autograd saves the aliased weights for backward
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_what_training_assigns_to_the_copy_never_reaches_comfyuis_model():
    original = _inference_module(32, 2)
    before = {name: tensor.clone() for name, tensor in original.state_dict().items()}
    copied = _plain_copy(original)
    copied[0].weight.data = copied[0].weight.data.to(torch.bfloat16)  # what fp8 / compute-dtype casts do
    copied[1].weight.data = torch.zeros_like(copied[1].weight.data)
    copied.table = copied.table + 1
    for name, tensor in original.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed in ComfyUI's model"
        assert tensor.dtype == before[name].dtype


def test_copying_a_large_model_costs_no_second_copy_of_host_ram():
    original = _inference_module(2048, 12)  # 12 x 16 MiB of fp32 weights: 192 MiB
    size = sum(t.numel() * t.element_size() for t in original.state_dict().values())
    gc.collect()
    before = psutil.Process().memory_info().rss
    copied = _plain_copy(original)
    grown = psutil.Process().memory_info().rss - before
    assert grown < size / 8, f"the copy took {grown / 2 ** 20:.0f} MiB of host RAM for a {size / 2 ** 20:.0f} MiB model"
    assert copied[5].weight.data_ptr() == original[5].weight.data_ptr()


def test_the_training_copy_of_a_comfyui_model_shares_its_host_weights(comfy_objects):
    """Through ComfyUI's own loader and the adapter's training_unet: the frozen weights the copy trains on are
    ComfyUI's memory (on the CPU, where unload_all_models leaves them), yet normal tensors."""
    from bridge.comfy_adapter import ComfyAdapter
    model, clip, vae = comfy_objects
    adapter = ComfyAdapter(model, clip, vae)
    unet = adapter.training_unet()
    try:
        theirs = {name: t for name, t in model.model.diffusion_model.state_dict().items() if t.device.type == "cpu"}
        assert theirs, "ComfyUI's weights are expected in host RAM after unloading"
        shared = [name for name, t in unet.state_dict().items()
                  if name in theirs and t.data_ptr() == theirs[name].data_ptr()]
        assert len(shared) >= 0.9 * len(theirs), f"{len(shared)} of {len(theirs)} frozen tensors shared"
        assert not any(t.is_inference() for t in unet.state_dict().values())
    finally:
        adapter.free(unet)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking host memory needs CUDA")
def test_streaming_pins_comfyuis_pages_where_they_lie_and_gives_them_back():
    """A streamed weight the copy shares with ComfyUI is page-locked in place (cudaHostRegister), not copied to a
    pinned second buffer; its host-to-device copies are asynchronous and exact; free gives the pages back."""
    from trainer.device.card import _PINNED_IN_PLACE, pin_in_place, unpin_in_place
    with torch.inference_mode():
        weight = torch.randn(1024, 1024)  # ComfyUI's host weight
    shared = _plain_copy(torch.nn.ParameterList([torch.nn.Parameter(weight, requires_grad=False)]))[0].data
    pinned = pin_in_place(shared)
    try:
        assert pinned.data_ptr() == weight.data_ptr() and pinned.is_pinned()
        assert pin_in_place(shared) is shared  # the storage is registered once
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            on_device = pinned.to("cuda", non_blocking=True)
        stream.synchronize()
        assert torch.equal(on_device.cpu(), weight)
        small = torch.randn(64)  # may share a page with other small storages: copied, and nothing left failing
        assert pin_in_place(small).data_ptr() != small.data_ptr()
        assert torch.ones(8, device="cuda").sum().item() == 8  # no sticky CUDA error reaches the next kernel
    finally:
        released = unpin_in_place()
    assert released >= weight.numel() * 4 and not _PINNED_IN_PLACE
    assert not weight.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking host memory needs CUDA")
def test_fp8_copies_of_a_bf16_file_are_page_locked_where_they_lie():
    """Converted in a training thread of a process whose malloc puts mid-size tensors side by side (after a 30 MiB
    free), each fp8 copy of 1 MiB or more is on pages of its own (cast_weights._fp8_tensor), so pin_in_place
    registers it where it lies instead of pinning a copy rounded up to a power of two."""
    import threading

    import comfy.ops
    from bridge.cast_weights import store_weights_fp8
    from trainer.device.card import _PINNED_IN_PLACE, pin_in_place, unpin_in_place
    found = {}

    def convert():
        freed = torch.empty(30 * 2 ** 20, dtype=torch.uint8)
        del freed
        layers = [comfy.ops.disable_weight_init.Linear(3072, rows, bias=False, dtype=torch.bfloat16)
                  for rows in (3072, 1536, 3072, 4608)]  # 9, 4.5, 9, 13.5 MiB in fp8
        module = torch.nn.Sequential(*layers).requires_grad_(False)
        for layer in layers:
            layer.weight.data.normal_(0, 0.02)
        store_weights_fp8(module)
        found["weights"] = [layer.weight.data for layer in layers]
    worker = threading.Thread(target=convert)
    worker.start()
    worker.join()
    try:
        for weight in found["weights"]:
            pinned = pin_in_place(weight)
            assert pinned.data_ptr() == weight.data_ptr() and pinned.is_pinned(), "a pinned copy was made"
            with torch.cuda.stream(torch.cuda.Stream()):
                on_device = pinned.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(on_device.cpu().view(torch.uint8), weight.view(torch.uint8))
    finally:
        unpin_in_place()
    assert not _PINNED_IN_PLACE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_the_capture_reuses_the_eager_warm_ups_pinned_offload_buffers():
    """Activation offload under CUDA graphs: the buffers the capture takes (ActivationOffload.capturing, entered after
    a synchronize and before the capture, as micro_steps does) are the warm-up's cached pinned blocks, so PyTorch's
    pinned pool holds one set, not two (host_ram counts OFFLOAD_COPIES_WITH_GRAPHS = 2: an upper bound); each block is
    the buffer rounded up to a power of two (3 MiB saved tensors take 4 MiB)."""
    from trainer.step.activation_offload import ActivationOffload
    torch.cuda.synchronize()
    torch._C._host_emptyCache()

    def stats() -> int:  # pinned blocks PyTorch's pool owns, active and cached, at their rounded sizes
        return torch.cuda.host_memory_stats()["allocated_bytes.current"]
    start = stats()
    offload = ActivationOffload()
    x = torch.randn(768, 1024, device="cuda", requires_grad=True)  # 3 MiB
    with offload.saving(record=True):
        h = x
        for _ in range(3):
            h = h.sin()  # saves its input: x and two 3 MiB activations
    h.sum().backward()
    offload.finish()
    torch.cuda.synchronize()
    saved = len(offload.recorded)
    warmed = stats() - start
    assert saved == 3 and warmed == saved * 4 * 2 ** 20, f"{warmed} bytes pinned for {saved} saved tensors of 3 MiB"
    with offload.capturing() as buffers:
        assert len(buffers) == saved
        assert stats() - start == warmed, "the capture's buffers are new pinned blocks beside the warm-up's"
