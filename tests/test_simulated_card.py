"""The paths that otherwise run only on CUDA, on the CPU against a simulated card (trainer/device/card.py): a GPU of
N GiB made of host RAM that counts the bytes each path places or allocates and raises torch's own
OutOfMemoryError past N. Every family's tiny model, at its real latent rank (5-D for Qwen-Image and Wan), goes
through auto-fit at several simulated card sizes: the static plan, placement, the memory probes, fit_to_card, the
ladder walk, training and release on return.

Two failures the GPU machine found (H100, real ComfyUI server, 6 Dec 2026), each reproduced here:
- the memory probe resized Qwen-Image's and Wan's 5-D latents as if they were 4-D (ValueError before step 1);
- the static plan counted an fp8 file's layers as streamable, placement left them on the device, and an 8 or 12 GiB
  card ran out of memory while placing the training copy (Qwen-Image, Wan)."""
from __future__ import annotations

import gc
import re
import weakref

import numpy as np
import pytest
import torch

import tiny_assets
import tiny_dit_assets
from trainer.dataset import scan_folder
from trainer.device.card import GIB, SimulatedCard, device_memory, is_gpu
from trainer.memory.estimate import resize_latent
from trainer.settings import AutoFit, BaseWeights, LoraSettings, MemorySettings, TrainSettings
from trainer.train_lora import train_lora

MIB = 2 ** 20
DIT = ("z_image", "flux_dev", "chroma", "qwen_image", "wan")
LORA = LoraSettings(rank=4, alpha=4.0, targets="attention+feed-forward")


# --- the card itself -------------------------------------------------------------------------------------------
def test_the_card_counts_what_is_placed_and_allocated_until_freed_and_raises_torchs_own_error():
    card = SimulatedCard(gib=64 * MIB / GIB, context_gib=8 * MIB / GIB)
    host = torch.zeros(4 * MIB // 4)  # 4 MiB of fp32 in host RAM
    with card.installed():
        assert is_gpu("cpu") and device_memory("cpu") is card
        placed = card.place(host)
        assert placed is not host and card.allocated() == 4 * MIB
        assert card.place(placed) is placed and card.allocated() == 4 * MIB  # already there
        with card.computing():
            transient = placed * 2  # a new 4 MiB storage
            view = transient.view(-1)[:10]  # a view: no new storage
            assert card.allocated() == 8 * MIB
            del transient
            assert card.allocated() == 8 * MIB  # the view keeps the storage
            del view
        gc.collect()
        assert card.allocated() == 4 * MIB and card.peak_allocated() == 8 * MIB
        assert card.free_and_total() == (64 * MIB - 8 * MIB - 4 * MIB, 64 * MIB)  # the context is not PyTorch's
        back = card.to_host(placed)
        del placed
        gc.collect()
        assert card.allocated() == 0 and torch.equal(back, host)
        with card.computing(), pytest.raises(torch.OutOfMemoryError, match="simulated card"):
            torch.empty(60 * MIB // 4).add_(1)  # 60 MiB > 64 - 8 of context
        card.set_fraction(16 * MIB / (64 * MIB))  # the process's cap binds before the card does
        with pytest.raises(torch.OutOfMemoryError):
            card.place(torch.zeros(20 * MIB // 4))
        assert card.log[-1][0] == "oom"
    assert device_memory("cpu") is None and not is_gpu("cpu")


@pytest.mark.parametrize("shape", [(2, 16, 32, 48), (2, 16, 1, 32, 48), (1, 16, 3, 32, 48)],
                         ids=["image", "one-frame video", "three frames"])
def test_a_latent_of_any_rank_is_resized_on_its_last_two_sides_only(shape):
    latent = torch.randn(shape)
    small = resize_latent(latent, 16, 24)
    assert small.shape == (*shape[:-2], 16, 24)
    assert torch.equal(small, latent[..., ::2, ::2])  # nearest: every second row and column


# --- the tiny families on simulated cards ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    base = tmp_path_factory.mktemp("simulated_card_models")
    files = {family: tiny_dit_assets.build_family(base, family) for family in DIT}
    files["sd15"] = {"checkpoint": tiny_assets.build_tiny_sd15_checkpoint(base / "tiny_sd15.safetensors")}
    return files


def _load(files: dict, family: str, fp8: bool):
    from bridge.comfy_adapter import ComfyAdapter
    options = {"dtype": torch.float8_e4m3fn} if fp8 else {}  # fp8: UNETLoader's weight_dtype fp8_e4m3fn
    if family == "sd15":  # a checkpoint (CheckpointLoaderSimple), 4-D latents
        import comfy.sd
        with torch.inference_mode():
            model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(
                str(files["checkpoint"]), output_vae=True, output_clip=True, embedding_directory=None,
                model_options=options)
        return ComfyAdapter(model, clip, vae)
    return ComfyAdapter(*tiny_dit_assets.load_family(files, family, options))


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    return scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("simulated_card_ds"), n=2), 64)


@pytest.mark.parametrize("family", ("sd15", *DIT))
@pytest.mark.parametrize("base_weights, share", [(BaseWeights.AS_LOADED, 1.0), (BaseWeights.FP8, 1.0),
                                                 (BaseWeights.FP8_STREAMED, 0.4), (BaseWeights.FP8_STREAMED, 1.0)],
                         ids=["as-loaded", "fp8", "streamed-40%", "streamed-all"])
def test_the_static_plan_counts_every_byte_placement_puts_on_the_card_for_fp8_files(tiny_files, family, base_weights,
                                                                                    share):
    """What plan_static projects before anything is converted (adapter.projected_weight_bytes) is what placement
    then puts on the card, byte for byte, for the fp8 file users load (UNETLoader fp8_e4m3fn). Before the fix the
    file's own fp8 layers counted as streamed and stayed on the device (the OOM while placing on 8/12 GiB)."""
    from trainer.step.frozen_weights import place_on_device
    adapter = _load(tiny_files[family], family, fp8=True)
    unet = adapter.training_unet()
    adapter.set_compute_dtype(unet, torch.bfloat16)
    projected = adapter.projected_weight_bytes(unet, torch.bfloat16, base_weights, share)
    if base_weights.fp8:
        adapter.store_weights_fp8(unet)
    if base_weights.streamed:
        adapter.stream_weights_from_cpu(unet, share)
    card = SimulatedCard(gib=1.0, context_gib=0.0)
    with card.installed():
        place_on_device(unet, torch.device("cpu"))
        assert card.allocated() == projected
    if base_weights.streamed:
        as_loaded = adapter.projected_weight_bytes(_load(tiny_files[family], family, fp8=True).training_unet(),
                                                   torch.bfloat16, BaseWeights.AS_LOADED)
        assert projected < as_loaded * (1 - share) + 0.15 * as_loaded  # the largest layers left: most of the rest


def _weights_as_loaded(files, family) -> int:
    adapter = _load(files, family, fp8=True)
    return adapter.projected_weight_bytes(adapter.training_unet(), torch.bfloat16, BaseWeights.AS_LOADED)


def _train_on(card: SimulatedCard, files, family, images, folder, steps=2):
    adapter = _load(files, family, fp8=True)
    memory = MemorySettings("bf16", False, auto_fit=AutoFit(card_gib=card.capacity / GIB))
    with card.installed():
        outcome = train_lora(adapter, images, memory, LORA, TrainSettings(steps, 1e-3, 0, f"card_{family}"),
                             folder, lambda **event: None, lambda: False)
        gc.collect()
        left = card.allocated()
    assert len(outcome.losses) == steps and all(np.isfinite(outcome.losses)) and outcome.lora_path.is_file()
    assert card.peak_allocated() <= card.limit(), outcome.report
    assert left == 0, f"{left} bytes left on the card after the run"
    return outcome


@pytest.mark.parametrize("family", ("sd15", *DIT))
def test_each_family_trains_through_auto_fit_on_a_roomy_and_a_tight_simulated_card(tiny_files, two_images, family,
                                                                                   tmp_path):
    """The fp8 file, Memory Settings with only `card` set: the static plan, placement, the probes at the family's
    latent rank, fit_to_card and the ladder walk, training and release all run against the card's bytes. On a roomy
    card nothing is traded; on a card half the weights short of what that run peaked at, the weights must leave
    the card (streamed) or activations go (checkpointing). Either way the whole run stays inside the card (its
    measured peak, not only the estimate) and the card is empty again afterwards."""
    context = 4 * MIB
    roomy = SimulatedCard(gib=(64 * MIB + context) / GIB, context_gib=context / GIB)
    outcome = _train_on(roomy, tiny_files[family], family, two_images, tmp_path / "roomy")
    assert "with no recompute" in _fitted(outcome.report)
    needed = roomy.peak_allocated()
    weights = _weights_as_loaded(tiny_files[family], family)
    tight = SimulatedCard(gib=(needed - weights // 2 + context) / GIB, context_gib=context / GIB)
    outcome = _train_on(tight, tiny_files[family], family, two_images, tmp_path / "tight")
    fitted = _fitted(outcome.report)
    assert "streamed" in fitted or "gradient checkpointing on" in fitted, outcome.report


def _fitted(report: str) -> str:
    """The auto-fit line that says which settings fit."""
    return next(line for line in report.split("\n") if line.startswith("auto-fit:") and " fits " in line)


@pytest.mark.parametrize("card_setting, advice", [
    (AutoFit(card_gib=0.004), "card is 0.004 GiB and even the leanest plan"),
    (None, "card is manual, so nothing was traded for memory: set card to auto")],
    ids=["a-card-too-small", "manual"])
def test_out_of_memory_before_step_1_advises_on_the_card_setting_the_user_has(tiny_files, two_images, card_setting,
                                                                            advice, tmp_path):
    """A card too small for even the leanest plan, and manual settings on a card the model does not fit: the error
    names the setting the user has and what to change (it once told a user who had picked a card to pick 'free
    VRAM')."""
    card = SimulatedCard(gib=4 * MIB / GIB, context_gib=MIB / GIB)
    adapter = _load(tiny_files["qwen_image"], "qwen_image", fp8=True)
    memory = MemorySettings("bf16", False, **({"auto_fit": card_setting} if card_setting else {}))
    from trainer.errors import LeanLoRAError
    with card.installed(), pytest.raises(LeanLoRAError, match="before step 1") as raised:
        train_lora(adapter, two_images, memory, LORA, TrainSettings(2, 1e-3, 0, "too_small"), tmp_path,
                   lambda **event: None, lambda: False)
    assert advice in str(raised.value)
    raised.value.__cause__ = raised.value.__context__ = raised.value.__traceback__ = None  # as ComfyUI drops it
    del raised
    gc.collect()
    assert card.allocated() == 0  # nothing left behind by the failed run


def test_a_forward_that_fails_under_activation_offload_leaves_no_activation_behind():
    """Out of memory in the middle of a forward (a probe, a step) while activation offload's hooks are on: what the
    partial graph saved is freed with the error. Found on the simulated card (SD1.5, a probe that ran out of
    memory left 1.6 MB of activations for good): the hook handed autograd a node's own output back, a cycle
    through C++ that Python's garbage collector cannot see."""
    from trainer.step.activation_offload import ActivationOffload
    layer = torch.nn.Linear(64, 64)
    alive = []

    class Failed(Exception):
        pass

    def forward(x):
        hidden = torch.nn.functional.gelu(layer(x))  # gelu saves its input, sigmoid its own output
        squashed = torch.sigmoid(hidden)
        alive.extend(weakref.ref(t) for t in (hidden, squashed))
        raise Failed

    offload = ActivationOffload()
    with pytest.raises(Failed), offload.saving():
        forward(torch.randn(8, 64, requires_grad=True))
    gc.collect()
    assert alive and all(ref() is None for ref in alive)


def test_a_card_short_of_the_weights_streams_the_hundredth_it_needs_at_the_familys_latent_rank(
        tiny_files, two_images, tmp_path):
    """A card that holds only part of the fp8 weights beside the step: auto-fit streams the largest layers, sized to
    the hundredth from the static plan and the probes (fit.sized_stream_rung), not every weight and not the
    ladder's next fifth, and the run stays inside the card (Qwen-Image's 5-D latents; its 8 GiB row streamed every
    weight before). Tiny Wan's weights are too small beside its activations for a card that needs streaming to
    leave its probes room, so it is not here."""
    family, short = "qwen_image", 0.8
    context = 4 * MIB
    roomy = SimulatedCard(gib=(64 * MIB + context) / GIB, context_gib=context / GIB)
    _train_on(roomy, tiny_files[family], family, two_images, tmp_path / "roomy")
    weights = _weights_as_loaded(tiny_files[family], family)
    tight = SimulatedCard(gib=(roomy.peak_allocated() - weights * short + context) / GIB, context_gib=context / GIB)
    outcome = _train_on(tight, tiny_files[family], family, two_images, tmp_path / "tight")
    fitted = _fitted(outcome.report)
    share = re.search(r"fp8 streamed from CPU \((\d+)% of them\)", fitted)
    assert share is not None, outcome.report
    assert 0 < int(share.group(1)) < 100 and int(share.group(1)) % 20, outcome.report
    # the weights auto-fit streams are fetched a layer ahead (planner.relaxed), and that run stays inside the card
    assert "fetched a layer ahead" in fitted, outcome.report
    # each streaming rung says what the planner's streaming model costs it (the family's ranking reached the run)
    assert re.search(r"streamed from CPU memory[^\n]* \(by the streaming model ~\+\d+\.\d\dx the step's time\)",
                     outcome.report), outcome.report
