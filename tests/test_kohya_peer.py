"""bench/kohya_peer.py's FLUX.1 peer on the CPU, without kohya's code (fetched at bench time, never committed): the
recipe against kohya's docs/flux_train_network.md, the offline tokenizer cache from ComfyUI's files, our files found
in the matrix's assets folder, and the step clock's arithmetic. kohya's own parser, loaders and dataset on our
files: python -m bench.kohya_peer --family flux --kohya SD_SCRIPTS --dry-run (bench/kohya_dry_run.py)."""
import json
from pathlib import Path

import pytest

from bench import dit_assets, kohya_peer
from comfy_headless import comfyui_path


def test_flux_recipe_is_kohyas_small_card_recipe_with_the_vram_tables_block_swap():
    assert kohya_peer.flux_blocks_to_swap(8) == 28 and kohya_peer.flux_blocks_to_swap(12) == 16
    with pytest.raises(SystemExit, match="--blocks-to-swap"):
        kohya_peer.flux_blocks_to_swap(16)  # the docs give no number for 16 GB
    argv = kohya_peer.recipe("flux", {"--blocks_to_swap": 28, "--max_train_steps": 60})
    options = dict(zip(argv, argv[1:]))
    assert options["--network_module"] == "networks.lora_flux" and options["--network_dim"] == "16"
    assert options["--timestep_sampling"] == "flux_shift" and options["--model_prediction_type"] == "raw"
    assert options["--guidance_scale"] == "1.0" and options["--optimizer_type"] == "AdamW8bit"
    assert options["--resolution"] == "1024,1024" and options["--train_batch_size"] == "1"
    assert options["--blocks_to_swap"] == "28" and options["--max_train_steps"] == "60"
    for flag in ("--fp8_base", "--cache_latents", "--cache_text_encoder_outputs", "--network_train_unet_only",
                 "--gradient_checkpointing", "--sdpa"):
        assert flag in argv, flag
    assert "--full_bf16" not in argv and "--full_bf16" in kohya_peer.recipe("sdxl", {})


def test_flux_tokenizer_cache_loads_offline_from_comfyuis_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import CLIPTokenizer, T5TokenizerFast
    cache = kohya_peer.tokenizer_cache(tmp_path, comfyui_path(), "flux")
    assert sorted(p.name for p in cache.iterdir()) == ["google_t5-v1_1-xxl", "openai_clip-vit-large-patch14"]
    caption = "a red circle on a blue background"
    # kohya's FluxTokenizeStrategy: CLIP-L 77 tokens, T5 512 (dev), both padded to the length
    clip = CLIPTokenizer.from_pretrained(str(cache / "openai_clip-vit-large-patch14"))
    l_ids = clip([caption], max_length=77, padding="max_length", truncation=True)["input_ids"][0]
    t5 = T5TokenizerFast.from_pretrained(str(cache / "google_t5-v1_1-xxl"))
    t5_out = t5([caption], max_length=512, padding="max_length", truncation=True)
    t5_ids, mask = t5_out["input_ids"][0], t5_out["attention_mask"][0]
    assert len(l_ids) == 77 and l_ids[0] == clip.bos_token_id and clip.eos_token_id in l_ids
    assert len(t5_ids) == 512 and t5_ids[sum(mask) - 1] == t5.eos_token_id == 1 and t5_ids[sum(mask)] == 0
    assert t5.unk_token_id not in t5_ids[:sum(mask)]


def test_flux_files_are_found_in_the_matrix_assets_folder_and_linked_in_kohyas_layout(tmp_path):
    loaders = dit_assets.names("flux_dev")
    names = [("diffusion_models", loaders["UNETLoader"]["unet_name"]),
             ("text_encoders", loaders["DualCLIPLoader"]["clip_name1"]),
             ("text_encoders", loaders["DualCLIPLoader"]["clip_name2"]), ("vae", loaders["VAELoader"]["vae_name"])]
    dataset = tmp_path / "data" / "dit"
    dataset.mkdir(parents=True)
    for stem in ("img_000", "img_001"):
        (dataset / f"{stem}.png").write_bytes(b"\x89PNG")
        (dataset / f"{stem}.txt").write_text("a caption\n")
    (tmp_path / "assets.json").write_text(json.dumps({"flux_dev": {"dataset": str(dataset)}}))
    for folder, name in names[:-1]:
        (tmp_path / "models" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / folder / name).write_bytes(b"")
    assert kohya_peer.flux_files(tmp_path) is None  # the ae is missing: the peer builds its own files
    (tmp_path / "models" / "vae").mkdir()
    (tmp_path / "models" / "vae" / names[-1][1]).write_bytes(b"")
    files = kohya_peer.flux_files(tmp_path)
    assert [Path(files[k]).name for k in ("pretrained_model_name_or_path", "clip_l", "t5xxl", "ae")] == \
        [name for _, name in names] and files["dataset"] == str(dataset)
    train_dir = kohya_peer.kohya_dataset(dataset, tmp_path / "kohya")
    linked = sorted((train_dir / "1_shapes").iterdir())
    assert [p.name for p in linked] == ["img_000.png", "img_000.txt", "img_001.png", "img_001.txt"]
    assert all(p.is_symlink() and p.resolve().parent == dataset.resolve() for p in linked)


def test_step_clock_leaves_out_the_warmup_and_keeps_a_stopped_cards_whole_steps(tmp_path):
    stamps = tmp_path / "card_8.steps"
    times = [0.0, 5.0, 6.5, 9.0] + [10.0 + 3.0 * i for i in range(8)]  # 4 warm-up steps, then 3 s each
    stamps.write_text("".join(f"{t:.6f}\n" for t in times) + "41.5")  # the last line cut by a kill
    assert kohya_peer.step_times(stamps, 4) == {"optimizer_steps": 12, "warmup_steps": 4, "steady_steps": 7,
                                                "s_per_step": 3.0}
    assert kohya_peer.step_times(tmp_path / "none.steps", 4)["s_per_step"] is None
    stamps.write_text("1.0\n2.0\n")
    assert kohya_peer.step_times(stamps, 4) == {"optimizer_steps": 2, "warmup_steps": 4, "steady_steps": 0,
                                                "s_per_step": None}
