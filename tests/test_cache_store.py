"""Latent/text cache: a hit skips the encoder, a changed image or encoder invalidates exactly its entries, the disk
layer persists and survives corrupt files, and the real adapter's encoder identities follow the weights."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from trainer.cache import PREPROCESS, CacheStats, build_cache
from trainer.cache_store import LatentTextStore, RamCache, image_key, text_key
from trainer.dataset import scan_folder


class CountingEncoders:
    """Deterministic stand-ins for the VAE and CLIP that count their calls."""

    def __init__(self):
        self.image_calls = self.text_calls = 0

    def image(self, pixels):
        self.image_calls += 1
        rgb = pixels.permute(0, 3, 1, 2)[:, :, ::8, ::8]
        return torch.cat([rgb, rgb.mean(1, keepdim=True)], 1)

    def text(self, caption, width, height):
        self.text_calls += 1
        codes = torch.tensor([float(ord(c)) for c in caption[:77]]).reshape(1, -1, 1)
        return {"c_crossattn": codes.expand(1, -1, 8).clone(), "y": torch.tensor([[float(width), float(height)]])}


def _build(dataset, store, image_id="vae-a", text_id="clip-a"):
    encoders, stats = CountingEncoders(), CacheStats()
    cache = build_cache(dataset, encoders.image, encoders.text, store=store, image_encoder_id=image_id,
                        text_encoder_id=text_id, stats=stats)
    return cache, encoders, stats


def _same(a, b) -> bool:
    return torch.equal(a.latent, b.latent) and a.cond.keys() == b.cond.keys() and all(
        torch.equal(a.cond[k], b.cond[k]) for k in a.cond)


@pytest.fixture()
def folder(tmp_path):
    import tiny_assets
    return tiny_assets.build_tiny_dataset(tmp_path / "ds", n=3)


@pytest.fixture()
def store():
    return LatentTextStore(ram=RamCache(1 << 20))  # private RAM layer: tests must not share the process-wide one


def test_second_build_is_all_hits_and_equal(folder, store):
    dataset = scan_folder(folder, 64)
    first, encoders, stats = _build(dataset, store)
    assert (encoders.image_calls, encoders.text_calls) == (3, 3)
    assert stats == CacheStats(image_hits=0, image_misses=3, text_hits=0, text_misses=3)

    second, encoders, stats = _build(dataset, store)
    assert (encoders.image_calls, encoders.text_calls) == (0, 0)
    assert stats.describe() == "cache: latents 3 hits, 0 encoded; text 3 hits, 0 encoded"
    assert all(_same(a, b) for a, b in zip(first, second))


def test_changed_image_invalidates_only_its_entry(folder, store):
    first, _, _ = _build(scan_folder(folder, 64), store)
    changed = folder / "img_001.png"
    with Image.open(changed) as image:
        Image.new("RGB", image.size, (10, 200, 30)).save(changed)

    second, encoders, stats = _build(scan_folder(folder, 64), store)
    assert (encoders.image_calls, encoders.text_calls) == (1, 0)
    assert (stats.image_hits, stats.image_misses) == (2, 1)
    assert _same(first[0], second[0]) and _same(first[2], second[2])
    assert not torch.equal(first[1].latent, second[1].latent)


def test_other_image_encoder_misses_every_image_but_no_caption(folder, store):
    dataset = scan_folder(folder, 64)
    _build(dataset, store)
    _, encoders, _ = _build(dataset, store, image_id="vae-b")
    assert (encoders.image_calls, encoders.text_calls) == (3, 0)


def test_repeated_caption_is_encoded_once_without_a_store(folder):
    for name in ("img_000.txt", "img_001.txt", "img_002.txt"):
        (folder / name).write_text("same caption")
    _, encoders, stats = _build(scan_folder(folder, 64), store=None)
    assert (encoders.image_calls, encoders.text_calls) == (3, 1)
    assert (stats.text_hits, stats.text_misses) == (2, 1)


def test_disk_layer_persists_and_replaces_corrupt_entries(folder, tmp_path):
    dataset = scan_folder(folder, 64)
    disk = tmp_path / "cache"
    first, _, _ = _build(dataset, LatentTextStore(disk, ram=RamCache(1 << 20)))
    files = sorted(disk.iterdir())
    assert len(files) == 6 and all(f.suffix == ".safetensors" for f in files)

    second, encoders, _ = _build(dataset, LatentTextStore(disk, ram=RamCache(1 << 20)))  # a new process, say
    assert (encoders.image_calls, encoders.text_calls) == (0, 0)
    assert all(_same(a, b) for a, b in zip(first, second))

    corrupt = disk / f"{image_key(dataset.samples[0].path, f'{PREPROCESS} 64x64', 'vae-a')}.safetensors"
    corrupt.write_bytes(corrupt.read_bytes()[:40])  # truncated, as after a crash mid-copy
    _, encoders, _ = _build(dataset, LatentTextStore(disk, ram=RamCache(1 << 20)))
    assert (encoders.image_calls, encoders.text_calls) == (1, 0)
    assert torch.equal(load_file(corrupt)["latent"], first[0].latent)  # rewritten


def test_keys_follow_content_not_objects_paths_or_processes(folder, tmp_path):
    path = next(folder.glob("*.png"))
    assert len({text_key("a cat", 1024, 1024, "clip"), text_key("a cat", 1024, 768, "clip"),
                text_key("a cat", 768, 1024, "clip"), text_key("a dog", 1024, 1024, "clip"),
                text_key("a cat", 1024, 1024, "clip2")}) == 5
    assert len({image_key(path, "crop 64x64", "vae"), image_key(path, "crop 64x128", "vae"),
                image_key(path, "crop 64x64", "vae2")}) == 3

    # Same bytes under another name and folder: the same entry (a renamed or copied dataset reuses its cache).
    copy = tmp_path / "elsewhere" / "renamed.png"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert image_key(copy, "crop 64x64", "vae") == image_key(path, "crop 64x64", "vae")
    changed = bytearray(path.read_bytes())
    changed[-13] ^= 1  # one bit inside the file (before IEND): a new key
    copy.write_bytes(bytes(changed))
    assert image_key(copy, "crop 64x64", "vae") != image_key(path, "crop 64x64", "vae")

    # A caption built at run time (another str object) and another process with another hash seed: same key.
    caption = " ".join(["a", "cat"])
    here = text_key(caption, 1024, 1024, "clip")
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from trainer.cache_store import text_key, image_key; "
              "print(text_key('a cat', 1024, 1024, 'clip')); print(image_key(sys.argv[2], 'crop 64x64', 'vae'))")
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script, str(repo), str(path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True, timeout=120)
    assert result.stdout.split() == [here, image_key(path, "crop 64x64", "vae")]


def test_ram_layer_is_bounded_least_recently_used():
    entry = lambda: {"t": torch.zeros(256)}  # noqa: E731  (1 KiB)
    ram = RamCache(max_bytes=2048)
    ram.put("a", entry())
    ram.put("b", entry())
    ram.get("a")
    ram.put("c", entry())
    assert (ram.get("a") is not None, ram.get("b"), ram.get("c") is not None) == (True, None, True)
    assert len(ram) == 2


def _clip_lora(clip, strength):
    """A clone of clip with a rank-4 LoRA on one layer, loaded the way LoraLoader does."""
    import comfy.lora
    import comfy.sd
    lora_name, key = next((n, k) for n, k in comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {}).items()
                          if k.endswith("mlp.fc1.weight"))
    out_features, in_features = clip.cond_stage_model.state_dict()[key].shape
    generator = torch.Generator().manual_seed(0)
    lora = {f"{lora_name}.lora_up.weight": torch.randn(out_features, 4, generator=generator),
            f"{lora_name}.lora_down.weight": torch.randn(4, in_features, generator=generator),
            f"{lora_name}.alpha": torch.tensor(4.0)}
    return comfy.sd.load_lora_for_models(None, clip, lora, 0.0, strength)[1]


def test_encoder_ids_follow_weights_and_clip_patches(comfy_objects, tiny_assets):
    import comfy.sd
    from bridge.comfy_adapter import ComfyAdapter
    model, clip, vae = comfy_objects
    plain = ComfyAdapter(model, clip, vae)
    image_id, text_id = plain.image_encoder_id(), plain.text_encoder_id()
    assert image_id != text_id

    # The same checkpoint loaded again (new objects, same weights): the same ids, so its cache entries are found.
    with torch.inference_mode():
        model2, clip2, vae2, _ = comfy.sd.load_checkpoint_guess_config(
            str(tiny_assets["checkpoint"]), output_vae=True, output_clip=True, embedding_directory=None)
    assert ComfyAdapter(model2, clip2, vae2).image_encoder_id() == image_id
    assert ComfyAdapter(model2, clip2, vae2).text_encoder_id() == text_id
    # One VAE weight changed in that copy: a new image id, the text id untouched; then one CLIP weight.
    with torch.inference_mode():
        next(vae2.patcher.model.parameters()).view(-1)[0] += 1.0
    vae_changed = ComfyAdapter(model2, clip2, vae2)
    assert vae_changed.image_encoder_id() != image_id and vae_changed.text_encoder_id() == text_id
    with torch.inference_mode():
        next(clip2.patcher.model.parameters()).view(-1)[0] += 1.0
    clip_changed = ComfyAdapter(model2, clip2, vae2)
    assert clip_changed.text_encoder_id() != text_id
    assert clip_changed.image_encoder_id() == vae_changed.image_encoder_id()

    patched = ComfyAdapter(model, _clip_lora(clip, 1.0), vae)
    assert patched.image_encoder_id() == image_id
    assert patched.text_encoder_id() != text_id
    assert ComfyAdapter(model, _clip_lora(clip, 0.5), vae).text_encoder_id() not in (text_id, patched.text_encoder_id())

    # Encoding loads the LoRA into the shared CLIP weights in place; identities must see through that.
    patched.encode_text("a red circle", 64, 64)
    assert ComfyAdapter(model, patched.clip, vae).text_encoder_id() == patched.text_encoder_id()
    assert ComfyAdapter(model, clip, vae).text_encoder_id() == text_id
