"""FLUX.2 beyond the family conformance checks (tests/test_families_033.py runs those on its tiny klein set): which
FLUX.2 a file is from its weights, the conditioning as ComfyUI builds it, the out-of-place blocks under the shared
modulation, and the noise levels at the shift ComfyUI's Flux2Scheduler samples each size with. ComfyUI 0.33 (0.3.75
loads FLUX.2 dev but not klein, whose tiny set is what these tests train)."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import comfy.model_base
import comfyui_version
import tiny_dit_assets
from family_checks import PROMPT, adapter

pytestmark = pytest.mark.comfy033
COMFYUI_033 = tuple(int(part) for part in comfyui_version.__version__.split(".")[:2]) >= (0, 33)
needs_033 = pytest.mark.skipif(not COMFYUI_033, reason="FLUX.2 needs ComfyUI 0.33 (scripts/test.sh runs this file on it)")
if COMFYUI_033:  # the harness's session fixtures: the tiny sets, built and loaded once
    from test_families_033 import files_033, objects_033  # noqa: F401


def test_flux1_stays_flux1s(comfy_base):
    """FLUX.2's family takes ComfyUI's Flux2 models only, never FLUX.1's Flux (its parent class), on either
    ComfyUI."""
    from bridge.families import family_for
    from bridge.families.flux2 import Flux2
    flux1 = tiny_dit_assets.load_family(tiny_dit_assets.build_family(comfy_base, "flux_dev"), "flux_dev")[0].model
    assert not Flux2().matches(flux1) and type(family_for(flux1)).__name__ == "Flux"


def _variant(files, context: int, guidance: bool):
    """The tiny klein file with the text width (txt_in) of a real FLUX.2 and, for dev, its guidance embedding:
    loaded as UNETLoader loads it."""
    import comfy.sd
    state = load_file(str(files["unet_name"]))
    hidden = state["img_in.weight"].shape[0]
    state["txt_in.weight"] = torch.zeros(hidden, context, dtype=torch.bfloat16)
    if guidance:
        state["guidance_in.in_layer.weight"] = torch.zeros(hidden, 256, dtype=torch.bfloat16)
        state["guidance_in.out_layer.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
    with torch.inference_mode():
        return comfy.sd.load_diffusion_model_state_dict(state)


@needs_033
@pytest.mark.parametrize("context, guidance, name, architecture", [
    (3 * 5120, True, "FLUX.2 dev", "Flux.2-dev"),  # Mistral-Small-3.1-24B's three hidden states
    (3 * 2560, False, "FLUX.2 klein 4B", "Flux.2-klein-4b"),  # Qwen3-4B's
    (3 * 4096, False, "FLUX.2 klein 9B", "Flux.2-klein-9b"),  # Qwen3-8B's
    (3 * 64, False, "FLUX.2 klein", "Flux.2-klein"),  # the tiny text encoder's: no size to name
], ids=["dev", "klein-4b", "klein-9b", "tiny"])
def test_dev_and_each_klein_are_told_apart_by_their_weights(files_033, objects_033, context, guidance, name,
                                                            architecture):
    _, clip, vae = objects_033["flux2_klein"]
    model = _variant(files_033["flux2_klein"], context, guidance)
    assert type(model.model) is comfy.model_base.Flux2 and model.model.diffusion_model.params.guidance_embed == guidance
    trainer = adapter((model, clip, vae))
    identity = trainer.identity()
    assert (identity.name, identity.architecture, identity.base_model_version) == (name, architecture, "flux2")
    assert identity.recognises("Flux.2-klein-9b") and identity.recognises("flux2") and not identity.recognises("flux1")
    assert trainer.describe().startswith(f"{name} (2 double + 2 single blocks") and f"text {context} wide" in \
        trainer.describe()


@needs_033
def test_the_conditioning_is_comfyuis_padded_text_and_dev_guidance_at_1(objects_033):
    """ComfyUI's Flux2 extra_conds: the three stacked hidden states padded to 512 tokens, the guidance LeanLoRA
    trains dev at (1.0, as FLUX.1-dev's; klein has no guidance embedding and ignores it)."""
    trainer = adapter(objects_033["flux2_klein"])
    cond = trainer.encode_text(PROMPT, 64, 64)
    assert set(cond) == {"c_crossattn", "guidance"}
    assert tuple(cond["c_crossattn"].shape) == (1, 512, 3 * tiny_dit_assets.QWEN3_4B_KLEIN["hidden_size"])
    assert cond["guidance"].tolist() == [1.0]


@needs_033
def test_the_out_of_place_blocks_compute_exactly_what_comfyuis_blocks_compute(objects_033):
    """Flux.prepare's out-of-place block forwards on FLUX.2's blocks (no per-block modulation: each takes the
    stream's shared one, SiLU-gated MLPs): every block's output, bit for bit, is what ComfyUI's own forward gives."""
    trainer = adapter(objects_033["flux2_klein"])
    unet = trainer.training_unet()
    blocks = trainer.family.blocks(unet)
    calls = {}
    hooks = [block.register_forward_hook(lambda m, args, kwargs, out: calls.setdefault(m, (args, kwargs, out)) and None,
                                         with_kwargs=True) for block in blocks]
    generator = torch.Generator().manual_seed(0)
    config = tiny_dit_assets.FLUX2_KLEIN
    with torch.no_grad():
        unet(torch.randn(1, config["in_channels"], 8, 8, generator=generator), torch.tensor([0.5]),
             context=torch.randn(1, 512, config["context_in_dim"], generator=generator))
    for hook in hooks:
        hook.remove()
    assert len(calls) == len(blocks) == 4
    copy = lambda value: value.clone() if torch.is_tensor(value) else value  # noqa: E731 - theirs add in place
    for block, (args, kwargs, ours) in calls.items():
        with torch.no_grad():
            theirs = type(block).forward(block, *map(copy, args), **{k: copy(v) for k, v in kwargs.items()})
        for mine, original in zip(ours if isinstance(ours, tuple) else (ours,),
                                  theirs if isinstance(theirs, tuple) else (theirs,)):
            assert torch.equal(mine, original), type(block).__name__


@needs_033
def test_each_size_trains_at_the_shift_comfyuis_flux2_scheduler_samples_it_with(objects_033):
    """The model's own table is mu 2.02; ComfyUI's templates sample with Flux2Scheduler (20 steps), whose mu grows
    with the image's latent positions. The family moves each size's draws there, with ComfyUI's own formula."""
    import comfy.model_sampling
    from comfy_extras.nodes_flux import compute_empirical_mu, get_schedule
    from bridge.families.flux2 import TEMPLATE_STEPS, flux2_scheduler_mu
    from trainer.objective import TimestepSampling, sample_sigmas
    for tokens in (256, 1024, 4096, 4300, 6000):
        for steps in (4, 20, 50):
            assert flux2_scheduler_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), abs=1e-9)
    trainer = adapter(objects_033["flux2_klein"])
    schedule = trainer.model_sampling
    assert isinstance(schedule, comfy.model_sampling.ModelSamplingFlux) and schedule.shift == pytest.approx(2.02)
    for pixels in (512, 1024):
        latent = pixels // 16
        mu = compute_empirical_mu(latent * latent, TEMPLATE_STEPS)
        assert trainer.resolution_shift((latent, latent)) == pytest.approx(math.exp(mu - 2.02))
        # the draws at logit-normal positions are the scheduler's sigma at those positions
        draws = sample_sigmas(schedule, 4096, torch.Generator().manual_seed(0), TimestepSampling.LOGIT_NORMAL,
                              resolution_shift=trainer.resolution_shift((latent, latent)))
        position = torch.sigmoid(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
        node = comfy.model_sampling.ModelSamplingFlux()
        node.set_parameters(shift=mu)
        assert torch.allclose(draws, node.sigma(position), atol=1e-3)
        # ... whose 20 steps are the scheduler's own
        assert torch.allclose(node.sigma(torch.linspace(1, 0, TEMPLATE_STEPS + 1)[:-1]),
                              get_schedule(TEMPLATE_STEPS, latent * latent)[:-1].float(), atol=1e-6)
    assert trainer.resolution_shift((32, 32)) < 1.0 < trainer.resolution_shift((64, 64))  # 512²: less noise
    patched = comfy.model_sampling.ModelSamplingFlux()  # a schedule the user set is trained as it is
    patched.set_parameters(shift=1.5)
    assert trainer.family.resolution_shift(patched, (64, 64)) == 1.0
