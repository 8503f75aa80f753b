"""Anima on ComfyUI 0.33 (bridge/families/anima.py): its tiny model (scripts/tiny_dit_assets.py: a 2-block Anima with a
2-block LLM adapter, a 2-layer Qwen3-0.6B, the Wan 2.1 VAE's 5-D latents), loaded by the functions ComfyUI's stock
loaders call, trains a LoRA on the DiT blocks whose file ComfyUI applies key for key; the text conditioning is what
ComfyUI's sampler hands the blocks (the LLM adapter's output); the test-only width patches leave a full-size Anima and
Qwen3-0.6B exactly as ComfyUI detects them. The conformance checks every family runs on 0.33 are in
tests/test_families_033.py."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import comfy.model_base

import tiny_assets
import tiny_dit_assets
from trainer.dataset import scan_folder
from trainer.settings import LoraSettings, LoraTargets, MemorySettings, TrainSettings
from trainer.train_lora import train_lora
from trainer.training_state import STATE_SUFFIX

pytestmark = [pytest.mark.comfy033,
              pytest.mark.skipif(not hasattr(comfy.model_base, "Anima"), reason="Anima is in ComfyUI 0.33, not 0.3.75")]

LORA = LoraSettings(rank=4, alpha=4.0, targets="attention+feed-forward")
FP32_CHECKPOINTED = MemorySettings("no", True)
PROMPT = "lnlr, a red circle on a blue background"


@pytest.fixture(scope="module")
def anima_files(comfy_base):
    return tiny_dit_assets.build_family(comfy_base, "anima")


@pytest.fixture(scope="module")
def anima(anima_files):
    return tiny_dit_assets.load_family(anima_files, "anima")


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    return scan_folder(tiny_assets.build_tiny_dataset(tmp_path_factory.mktemp("anima_ds"), n=2), 64)


def _adapter(objects):
    from bridge.comfy_adapter import ComfyAdapter
    return ComfyAdapter(*objects)


def test_the_tiny_files_load_as_anima_with_their_own_widths(anima):
    model, clip, vae = anima
    base = model.model
    assert type(base) is comfy.model_base.Anima and type(base.model_config).__name__ == "Anima"
    assert base.model_sampling.shift == 3.0 and base.latent_format.latent_dimensions == 3  # Wan 2.1's 5-D latents
    unet = base.diffusion_model
    assert len(unet.blocks) == tiny_dit_assets.ANIMA["num_blocks"] and unet.num_heads == 2  # 128-wide heads
    adapter = tiny_dit_assets.ANIMA_LLM_ADAPTER
    assert len(unet.llm_adapter.blocks) == adapter["num_layers"]
    assert unet.llm_adapter.blocks[0].cross_attn.k_proj.in_features == adapter["source_dim"]
    assert unet.llm_adapter.embed.weight.shape == (32128, adapter["target_dim"])  # T5's vocabulary
    assert type(clip.cond_stage_model).__name__.startswith("AnimaTEModel")
    qwen = clip.cond_stage_model.qwen3_06b.transformer.model
    assert len(qwen.layers) == tiny_dit_assets.QWEN3_06B["num_hidden_layers"]
    assert qwen.embed_tokens.weight.shape[1] == tiny_dit_assets.QWEN3_06B["hidden_size"]


def test_the_width_patches_leave_a_full_size_anima_and_qwen3_06b_as_comfyui_detects_them():
    """A real Anima (Cosmos-Predict2-2B widths, the 1024-wide LLM adapter) and a real Qwen3-0.6B, built on the meta
    device: ComfyUI's own detection and the patched one give the same answers."""
    import comfy.model_detection as md
    import comfy.ops
    import comfy.sd
    import comfy.text_encoders.llama
    import comfy.ldm.anima.model as anima_model
    configs = tiny_dit_assets.import_tiny_configs()
    real = {**tiny_dit_assets.ANIMA, "model_channels": 2048, "num_blocks": 28, "num_heads": 16,
            "crossattn_emb_channels": 1024}
    real.pop("image_model")
    with torch.device("meta"):
        dit = anima_model.Anima(dtype=torch.bfloat16, device="meta", operations=comfy.ops.disable_weight_init, **real)
        qwen = comfy.text_encoders.llama.Qwen3_06B({}, torch.bfloat16, "meta", comfy.ops.disable_weight_init)
    assert dit.llm_adapter.embed.weight.shape == (32128, 1024) and len(dit.llm_adapter.blocks) == 6
    dit_state, qwen_state = dit.state_dict(), qwen.state_dict()
    patched = md.detect_unet_config(dit_state, "")
    assert patched == md.detect_unet_config.__wrapped__(dit_state, "")
    assert patched["image_model"] == "anima" and patched["num_heads"] == 16 and "leanlora_tiny_llm_adapter" not in patched
    assert configs._qwen3_06b_overrides(qwen_state) == {} and configs._te_overrides(qwen_state) == {}
    assert comfy.sd.detect_te_model(qwen_state) == comfy.sd.TEModel.QWEN3_06B


def test_the_conditioning_is_the_llm_adapters_output_as_comfyuis_sampler_builds_it(anima):
    """ComfyUI runs the LLM adapter in extra_conds while sampling (inference mode) and pads its output to 512 tokens;
    the text cache holds exactly that, so training feeds the blocks what sampling feeds them."""
    model, clip, _ = anima
    adapter = _adapter(anima)
    cond = adapter.encode_text(PROMPT, 64, 64)
    assert set(cond) == {"c_crossattn"}  # no T5 ids left: the adapter has run
    assert cond["c_crossattn"].shape == (1, 512, tiny_dit_assets.ANIMA_LLM_ADAPTER["target_dim"])
    with torch.inference_mode():
        encoded = clip.encode_from_tokens(clip.tokenize(PROMPT), return_dict=True)
        unet = model.model.diffusion_model
        expected = unet.preprocess_text_embeds(encoded["cond"].to(unet.dtype), encoded["t5xxl_ids"].unsqueeze(0),
                                               t5xxl_weights=encoded["t5xxl_weights"].reshape(1, -1, 1).to(unet.dtype))
    assert torch.equal(cond["c_crossattn"], expected)
    assert cond["c_crossattn"][:, encoded["t5xxl_ids"].shape[0]:].abs().sum() == 0  # the padding


def test_units_are_the_blocks_and_the_lora_stays_off_the_llm_adapter(anima):
    adapter = _adapter(anima)
    unet = adapter.training_unet()
    assert adapter.checkpoint_blocks(unet) == list(unet.blocks)
    ordered = adapter.checkpoint_blocks(unet, latent_size=(8, 8))
    assert {id(u) for u in ordered} == {id(b) for b in unet.blocks}
    linears = {path for path, m in unet.named_modules() if isinstance(m, torch.nn.Linear)}
    for targets in LoraTargets:
        for suffix in adapter.lora_targets(unet, targets):
            hits = [p for p in linears if p.endswith(f".{suffix}")]
            assert hits and all(p.startswith("blocks.") for p in hits), suffix
    every = adapter.lora_targets(unet, LoraTargets.ATTENTION_FEED_FORWARD)
    in_blocks = {p for p in linears if p.startswith("blocks.") and "adaln_modulation" not in p}
    assert {p for p in linears if any(p.endswith(f".{s}") for s in every)} == in_blocks  # kohya's set
    assert "Anima (2 blocks" in adapter.describe() and "shift 3" in adapter.describe()


def test_anima_trains_resumes_exactly_loads_in_comfyui_and_leaves_the_model(anima, two_images, tmp_path, caplog):
    import comfy.lora
    import comfy.sd
    model = anima[0]
    before = {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}

    def train(folder, steps, **settings):
        return train_lora(_adapter(anima), two_images, FP32_CHECKPOINTED, LORA,
                          TrainSettings(steps, 1e-3, 0, "anima", "cosine", 1, **settings), folder,
                          lambda **event: None, lambda: False)

    straight = train(tmp_path / "straight", 4, save_every_steps=2)
    assert len(straight.losses) == 4 and all(np.isfinite(straight.losses))
    resumed = train(tmp_path / "resumed", 4, resume_from=tmp_path / "straight" / f"anima_step2{STATE_SUFFIX}")
    assert resumed.losses == straight.losses
    assert resumed.lora_path.read_bytes() == straight.lora_path.read_bytes()

    saved = load_file(str(straight.lora_path))
    with safe_open(str(straight.lora_path), "pt") as file:
        metadata = file.metadata()
    assert metadata["ss_base_model_version"] == "anima" and metadata["modelspec.architecture"] == "anima/lora"
    modules = {k.rsplit(".", 2)[0] for k in saved if k.endswith(".lora_down.weight")}
    assert len(modules) == 2 * 10 and all(k.startswith("lora_unet_blocks_") for k in saved)  # kohya's names
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        patched, _ = comfy.sd.load_lora_for_models(model, None, saved, 1.0, 0.0)
        assert "lora key not loaded" not in caplog.text
    assert len(comfy.lora.load_lora(saved, comfy.lora.model_lora_keys_unet(model.model, {}))) == len(modules)
    assert len(patched.patches) == len(modules)
    after = model.model.diffusion_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_samples_render_with_anima_defaults(anima, tmp_path):
    from PIL import Image
    from bridge.samples import SampleRenderer
    from trainer.lora import inject_lora, kohya_state_dict
    from trainer.settings import SampleSettings
    model, clip, vae = anima
    adapter = _adapter(anima)
    renderer = SampleRenderer(model, clip, vae, SampleSettings((PROMPT,), every_steps=0, size=64, steps=2, cfg=4.0,
                                                               seed=1), tmp_path)
    assert (renderer.sampler, renderer.scheduler) == ("er_sde", "simple")
    unet = adapter.training_unet()
    inject = LoraSettings(rank=4, alpha=4.0)
    inject_lora(unet, inject, 0, adapter.lora_targets(unet, inject.targets))
    [path] = renderer(3, kohya_state_dict(unet, inject))
    image = Image.open(path)
    assert image.size == (64, 64) and "er_sde simple" in image.text["parameters"]


def test_the_training_copys_self_attention_computes_what_comfyuis_computes_and_backpropagates(anima):
    """Anima.prepare replaces the blocks' fused RMSNorm + RoPE kernel call (no backward) with the op's eager math:
    on the CPU, where ComfyUI's call runs that eager code, the model's output is the same bit for bit; a LoRA-style
    gradient reaches the first block's query projection."""
    model = anima[0]
    adapter = _adapter(anima)
    unet = adapter.training_unet()
    assert unet.llm_adapter is None  # the conditioning is its output already
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 1, 8, 8, generator=generator)
    context = torch.randn(1, 512, tiny_dit_assets.ANIMA["crossattn_emb_channels"], generator=generator)
    timestep = torch.tensor([0.5])
    with torch.no_grad():
        theirs = model.model.diffusion_model(x, timestep, context)
        ours = unet(x, timestep, context)
    assert torch.equal(ours, theirs)
    query = unet.blocks[0].self_attn.q_proj.weight
    query.requires_grad_(True)
    unet(x, timestep, context).square().mean().backward()
    assert query.grad is not None and query.grad.abs().sum() > 0


def test_an_anima_with_extra_input_channels_is_refused_before_training(anima_files, anima):
    """The tiny file with a patch embedding for one more latent channel (a conditioned variant), loaded as ComfyUI
    loads it: Train says what it cannot build instead of failing inside the first step."""
    import comfy.sd
    from trainer.errors import LeanLoRAError
    state = load_file(str(anima_files["unet_name"]))
    embed = state["x_embedder.proj.1.weight"]  # (width, (16 channels + padding mask) x 2 x 2)
    state["x_embedder.proj.1.weight"] = torch.zeros(embed.shape[0], embed.shape[1] + 4, dtype=embed.dtype)
    with torch.inference_mode():
        model = comfy.sd.load_diffusion_model_state_dict(state)
    assert type(model.model) is comfy.model_base.Anima
    _, clip, vae = anima
    with pytest.raises(LeanLoRAError, match=r"LeanLoRA Train: this Anima model takes 17 input channels and its "
                                            r"latents have 16: a variant with extra input channels is not supported"):
        _adapter((model, clip, vae))


def test_the_text_cache_keys_on_the_llm_adapter_it_ran(anima_files, anima):
    """The cached conditioning is the LLM adapter's output: another adapter (a fine-tune's, or a LoRA on it, as kohya's
    train_llm_adapter writes) encodes captions differently, so it gets other cache entries; a LoRA on the blocks
    alone does not change them. Families without such weights keep the key they had."""
    import comfy.sd
    from bridge.comfy_adapter import weights_fingerprint
    model, clip, vae = anima
    key = _adapter(anima).text_encoder_id()
    assert _adapter(anima).text_encoder_id() == key  # deterministic
    state = load_file(str(anima_files["unet_name"]))
    state["llm_adapter.out_proj.weight"] = state["llm_adapter.out_proj.weight"] * 2
    with torch.inference_mode():
        other = comfy.sd.load_diffusion_model_state_dict(state)
    assert _adapter((other, clip, vae)).text_encoder_id() != key
    adapter_weight = "diffusion_model.llm_adapter.out_proj.weight"
    block_weight = "diffusion_model.blocks.0.self_attn.q_proj.weight"
    for patched_key, changes in ((adapter_weight, True), (block_weight, False)):
        patched = model.clone()
        patched.add_patches({patched_key: ("diff", (torch.full_like(patched.get_model_object(patched_key), 0.01),))})
        assert (_adapter((patched, clip, vae)).text_encoder_id() != key) is changes, patched_key
    plain = weights_fingerprint(clip.patcher, type(model.model).__name__, str(clip.layer_idx),
                                repr(sorted(clip.tokenizer_options.items())))
    assert key != plain  # the adapter is part of Anima's key; a family without conditioning_weights has `plain`
