"""Bad and odd dataset files (issue 15, items 3-7 and 16): each is used correctly, or skipped and listed with its
reason, or a clear error naming the file and line; one bad file never stops the scan or the caching."""
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from trainer.cache import CacheStats, batches, build_cache, CachedSample
from trainer.cache_store import LatentTextStore, RamCache
from trainer.dataset import (MAX_IMAGE_PIXELS, Dataset, folder_fingerprint, load_image, resolve_folder,
                             scan_folder)
from trainer.errors import LeanLoRAError


def _image(path, size=(64, 64), colour=(200, 30, 30)):
    Image.new("RGB", size, colour).save(path)
    return path


def _png_header_only(path, width, height):
    """A tiny PNG whose header claims width x height (what a decompression bomb looks like to a scanner)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))
    return path


def _truncated_jpeg(path):
    noise = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    Image.fromarray(noise).save(path, "JPEG")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


class Encoders:
    def __init__(self):
        self.image_calls = self.text_calls = 0

    def image(self, pixels):
        self.image_calls += 1
        return pixels.permute(0, 3, 1, 2)[:, :, ::8, ::8].contiguous()

    def text(self, caption, width, height):
        self.text_calls += 1
        return {"c_crossattn": torch.full((1, 77, 4), float(len(caption)))}


def _cache(dataset, store=None):
    encoders, stats = Encoders(), CacheStats()
    cache = build_cache(dataset, encoders.image, encoders.text, store=store, stats=stats,
                        image_encoder_id="vae", text_encoder_id="clip")
    return cache, encoders, stats


# --- item 3: changes are seen; an image deleted after the scan ------------------------------------------------

def test_fingerprint_sees_edited_caption_added_and_deleted_image(tmp_path):
    _image(tmp_path / "a.png")
    _image(tmp_path / "b.png")
    caption = tmp_path / "a.txt"
    caption.write_text("a red cat")
    first = folder_fingerprint(tmp_path)
    assert folder_fingerprint(tmp_path) == first  # unchanged folder: ComfyUI may reuse the old scan

    stat = caption.stat()
    caption.write_text("a red dog")  # same size; put the old mtime back: only the text changed
    os.utime(caption, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    edited = folder_fingerprint(tmp_path)
    assert edited != first
    _image(tmp_path / "c.png")
    added = folder_fingerprint(tmp_path)
    assert added != edited
    (tmp_path / "b.png").unlink()
    assert folder_fingerprint(tmp_path) not in (first, edited, added)


@pytest.mark.parametrize("with_store", [True, False])
def test_image_deleted_after_the_scan_is_skipped_and_listed_when_caching(tmp_path, with_store):
    for shade, name in enumerate(("a.png", "b.png", "c.png")):
        _image(tmp_path / name, colour=(shade * 100, 30, 30))  # distinct bytes: distinct cache entries
    dataset = scan_folder(tmp_path, 64)
    (tmp_path / "b.png").unlink()
    store = LatentTextStore(ram=RamCache(1 << 20)) if with_store else None
    cache, encoders, stats = _cache(dataset, store)
    assert len(cache) == 2 and encoders.image_calls == 2
    assert stats.skipped == [("b.png", "no longer exists (deleted or moved after the folder was scanned)")]
    assert "skipped b.png while caching: no longer exists" in stats.describe()


def test_every_image_gone_when_caching_is_an_error_naming_the_folder(tmp_path):
    _image(tmp_path / "a.png")
    dataset = scan_folder(tmp_path, 64)
    (tmp_path / "a.png").unlink()
    with pytest.raises(LeanLoRAError, match=f"no image of {tmp_path} could be used.*a.png: no longer exists"):
        _cache(dataset, LatentTextStore(ram=RamCache(1 << 20)))


# --- item 4: one bad file is skipped and listed -----------------------------------------------------------------

def test_decompression_bomb_headers_are_skipped_with_their_size(tmp_path, monkeypatch):
    _image(tmp_path / "good.png")
    _png_header_only(tmp_path / "bomb.png", 30000, 30000)  # over PIL's own error limit
    _png_header_only(tmp_path / "huge.png", 13000, 12000)  # 156 MP: only PIL's warning, our limit decides
    dataset = scan_folder(tmp_path, 64)
    reasons = dict(dataset.skipped)
    assert [s.path.name for s in dataset.samples] == ["good.png"]
    assert reasons["bomb.png"].startswith("too large") and "900000000 pixels" in reasons["bomb.png"]
    assert reasons["huge.png"].startswith("too large (13000x12000 = 156 megapixels; the limit is 150")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)  # another node switched PIL's guard off
    assert dict(scan_folder(tmp_path, 64).skipped)["bomb.png"].startswith("too large (30000x30000")
    with pytest.raises(LeanLoRAError, match="bomb.png: too large"):
        load_image(tmp_path / "bomb.png", 64)
    assert MAX_IMAGE_PIXELS == 150_000_000


def test_caption_txt_that_is_not_utf8_is_read_as_windows_1252_and_noted(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes("un caf\u00e9 cr\u00e8me \u2013 Stra\u00dfe".encode("cp1252"))
    dataset = scan_folder(tmp_path, 64)
    assert dataset.samples[0].caption == "un caf\u00e9 cr\u00e8me \u2013 Stra\u00dfe"
    assert dataset.notes == (("a.txt", "not UTF-8 (byte 0xe9 on line 1), read as Windows-1252; save it as "
                                       "UTF-8 if accented letters look wrong"),)
    assert "a.txt: not UTF-8" in dataset.summary()


def test_latin1_metadata_csv_is_decoded_and_noted(tmp_path):
    _image(tmp_path / "a.png")
    _image(tmp_path / "b.png")
    (tmp_path / "metadata.csv").write_bytes("file_name,text\na.png,plain\nb.png,na\u00efve fa\u00e7ade\n".encode("latin-1"))
    dataset = scan_folder(tmp_path, 64)
    assert {s.path.name: s.caption for s in dataset.samples} == {"a.png": "plain", "b.png": "na\u00efve fa\u00e7ade"}
    assert dataset.notes[0][0] == "metadata.csv" and "not UTF-8 (byte 0xef on line 3)" in dataset.notes[0][1]


def test_metadata_csv_field_over_the_csv_limit_skips_that_row_only(tmp_path):
    for name in ("a.png", "b.png", "c.png"):
        _image(tmp_path / name)
    (tmp_path / "metadata.csv").write_text(f"file_name,text\na.png,first\nb.png,{'x' * 140_000}\nc.png,third\n")
    dataset = scan_folder(tmp_path, 64)
    assert {s.path.name: s.caption for s in dataset.samples} == {"a.png": "first", "b.png": "", "c.png": "third"}
    assert ("metadata.csv line 3", "a field is over 131,072 characters; row ignored") in dataset.notes


def test_unreadable_image_and_wrong_extension_are_listed_with_their_reasons(tmp_path):
    _image(tmp_path / "good.png")
    (tmp_path / "fake.png").write_bytes(b"\x89PNG not really")
    (tmp_path / "notes.md").write_text("hello")
    _image(tmp_path / "tiny.png", size=(4, 4))
    skipped = dict(scan_folder(tmp_path, 64).skipped)
    assert skipped.keys() == {"fake.png", "notes.md", "tiny.png"}
    assert skipped["fake.png"].startswith("not a readable image (UnidentifiedImageError")
    assert skipped["notes.md"] == "extension .md is not one of .png, .jpg, .jpeg, .webp, .bmp"
    assert skipped["tiny.png"] == "too small (4x4)"


# --- item 5: 16-bit greyscale and transparency --------------------------------------------------------------

def test_16_bit_greyscale_png_is_scaled_not_clipped_to_white(tmp_path):
    values = np.linspace(0, 65535, 64, dtype=np.float64).round().astype(np.uint16)
    Image.fromarray(np.tile(values, (64, 1))).save(tmp_path / "grey16.png")
    with Image.open(tmp_path / "grey16.png") as image:
        assert image.mode == "I;16"
    pixels = load_image(tmp_path / "grey16.png", 64)
    expected = torch.tensor(np.round(values / 257) / 255, dtype=torch.float32)
    assert torch.allclose(pixels[32, :, 0], expected, atol=1.5 / 255)  # Lanczos at the same size: ~identity
    assert abs(pixels.mean().item() - 0.5) < 0.01  # PIL's own convert("RGB") gives ~0.98: nearly all white
    assert torch.equal(pixels[..., 0], pixels[..., 2])
    notes = scan_folder(tmp_path, 64).notes
    assert notes == (("grey16.png", "16-bit greyscale, scaled to 8 bits"),)


@pytest.mark.parametrize("mode", ["RGBA", "P", "LA"])
def test_transparent_pixels_are_composited_onto_white_and_noted(tmp_path, mode):
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))  # hidden red under alpha 0 on the left
    rgba.paste((0, 0, 255, 255), (32, 0, 64, 64))       # opaque blue on the right
    if mode == "RGBA":
        image = rgba
    elif mode == "P":
        image = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
        image.info["transparency"] = image.getpixel((0, 0))
    else:
        image = Image.merge("LA", (rgba.convert("L"), rgba.getchannel("A")))
    image.save(tmp_path / "cutout.png")
    pixels = load_image(tmp_path / "cutout.png", 64)
    assert torch.allclose(pixels[:, :30], torch.ones(64, 30, 3), atol=0.02), "transparent -> white, not hidden red"
    right = pixels[:, 34:]
    if mode == "LA":
        assert right.max() < 0.2  # blue in greyscale is dark
    else:
        assert right[..., 2].min() > 0.98 and right[..., 0].max() < 0.02
    dataset = scan_folder(tmp_path, 64)
    assert dataset.notes == (("cutout.png", "transparent pixels composited onto white"),)
    assert "cutout.png: transparent pixels composited onto white" in dataset.summary()


def test_opaque_rgb_has_no_conversion_note(tmp_path):
    _image(tmp_path / "plain.png")
    Image.new("L", (64, 64), 90).save(tmp_path / "grey8.png")
    dataset = scan_folder(tmp_path, 64)
    assert dataset.notes == () and "notes" not in dataset.summary()
    assert abs(load_image(tmp_path / "grey8.png", 64).mean().item() - 90 / 255) < 1e-6


# --- item 6: captions lost silently; the folder string ------------------------------------------------------

@pytest.mark.parametrize("csv_text, line", [
    ('file_name,text\na.png,"a cat\nb.png,a dog\n', 2),              # never closed: swallows the rest
    ('file_name,text\na.png,fine\nb.png,"ok"x\nc.png,z\n', 3),       # text after the closing quote
])
def test_broken_quote_in_metadata_csv_is_an_error_naming_the_line(tmp_path, csv_text, line):
    for name in ("a.png", "b.png", "c.png"):
        _image(tmp_path / name)
    (tmp_path / "metadata.csv").write_text(csv_text)
    with pytest.raises(LeanLoRAError, match=f"metadata.csv line {line}: .*quote"):
        scan_folder(tmp_path, 64)


def test_quote_closing_rows_later_is_an_error_naming_the_swallowed_row(tmp_path):
    for name in ("a.png", "b.png", "c.png"):
        _image(tmp_path / name)
    (tmp_path / "metadata.csv").write_text('file_name,text\na.png,"a cat\nb.png,a dog"\nc.png,a bird\n')
    with pytest.raises(LeanLoRAError, match="metadata.csv line 2: the caption of a.png runs over into the row of b.png"):
        scan_folder(tmp_path, 64)


def test_quotes_inside_a_caption_and_unquoted_commas_are_kept(tmp_path):
    _image(tmp_path / "a.png")
    _image(tmp_path / "b.png")
    (tmp_path / "metadata.csv").write_text('file_name,text\na.png,a "big" cat\nb.png,1girl, solo, smile\n')
    dataset = scan_folder(tmp_path, 64)
    assert {s.path.name: s.caption for s in dataset.samples} == {"a.png": 'a "big" cat', "b.png": "1girl, solo, smile"}
    assert dataset.notes == (("metadata.csv line 3", "unquoted commas kept as part of the caption"),)


def test_caption_names_matching_no_file_are_listed(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "metadata.csv").write_text("file_name,text\na.png,ok\nmissing.png,lost\n")
    (tmp_path / "orphan.txt").write_text("no image for me")
    notes = scan_folder(tmp_path, 64).notes
    assert ("metadata.csv line 3 (missing.png)", "file_name matches no image in the folder; not used") in notes
    assert ("orphan.txt", "caption file matches no image; not used") in notes


def test_caption_names_differing_in_case_match_when_unambiguous(tmp_path):
    _image(tmp_path / "img_000.png")
    _image(tmp_path / "img_001.png")
    _image(tmp_path / "Pic.png")
    _image(tmp_path / "pic.PNG")  # two images that differ only in case: a caption "PIC.PNG" is ambiguous
    (tmp_path / "metadata.csv").write_text("file_name,text\nIMG_000.PNG,from csv\nPIC.PNG,which one?\n")
    (tmp_path / "IMG_001.TXT").write_text("from txt")
    dataset = scan_folder(tmp_path, 64)
    captions = {s.path.name: s.caption for s in dataset.samples}
    assert captions == {"img_000.png": "from csv", "img_001.png": "from txt", "Pic.png": "", "pic.PNG": ""}
    assert ("metadata.csv line 2 (IMG_000.PNG)", "caption matched ignoring case") in dataset.notes
    assert ("IMG_001.TXT", "caption matched ignoring case") in dataset.notes
    assert ("metadata.csv line 3 (PIC.PNG)", "file_name matches no image in the folder; not used") in dataset.notes


def test_folder_string_empty_or_leaving_the_input_folder_is_an_error(tmp_path):
    input_dir = tmp_path / "input"
    for text in ("", "   ", "."):
        with pytest.raises(LeanLoRAError, match="folder .*ComfyUI's input folder"):
            resolve_folder(text, input_dir)
    for text in ("../../../../etc", "../input_sibling", "sub/../../x"):
        with pytest.raises(LeanLoRAError, match=f"folder '{text}' leads out of ComfyUI's input folder"):
            resolve_folder(text, input_dir)
    assert resolve_folder(" my_set ", input_dir) == input_dir / "my_set"
    assert resolve_folder("a/../b/c", input_dir) == input_dir / "b" / "c"
    assert str(resolve_folder("/etc", input_dir)) == "/etc"  # absolute paths are allowed by design


# --- item 7: absurd numbers; long captions in one batch; RAM + disk --------------------------------------------

def test_absurd_repeats_or_resolution_through_a_link_is_a_clear_error(tmp_path):
    _image(tmp_path / "a.png")
    with pytest.raises(LeanLoRAError, match="repeats: got 1000000000; use 1 to 1000"):
        scan_folder(tmp_path, 64, repeats=10 ** 9)
    with pytest.raises(LeanLoRAError, match="resolution: got 1048576"):
        scan_folder(tmp_path, 1 << 20)
    with pytest.raises(LeanLoRAError, match="repeats"):
        Dataset(tmp_path, (), 64, repeats=10 ** 9)


def test_batches_never_stack_contexts_of_different_lengths():
    """77x7 and 77x8 token contexts stacked by repetition would need 77x56 tokens per sample (8x the cost)."""
    cache = [CachedSample(torch.full((1, 4, 2, 2), float(i)), {"c_crossattn": torch.zeros(1, 77 * (7 + i % 2), 8)})
             for i in range(4)]
    stream = batches(cache, batch_size=4, repeats=3, generator=torch.Generator().manual_seed(0))
    seen = []
    for _ in range(4):  # one epoch: 12 items in two groups of 6 -> batches of 4 + 2 each
        latents, cond = next(stream)
        ids = latents[:, 0, 0, 0].int().tolist()
        assert cond["c_crossattn"].shape == (len(ids), 77 * (7 + ids[0] % 2), 8)
        assert len({i % 2 for i in ids}) == 1
        seen += ids
    assert sorted(seen) == sorted([0, 1, 2, 3] * 3)


def test_ram_plus_disk_writes_entries_that_came_from_the_ram_cache(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    for shade, name in enumerate(("a.png", "b.png")):
        _image(folder / name, colour=(shade * 100, 30, 30))
    dataset, ram, disk = scan_folder(folder, 64), RamCache(1 << 20), tmp_path / "cache"
    _cache(dataset, LatentTextStore(None, ram))                   # a run with latent_cache "RAM"
    _, encoders, _ = _cache(dataset, LatentTextStore(disk, ram))  # then "RAM + disk": all hits from RAM
    assert encoders.image_calls == 0 and len(list(disk.glob("*.safetensors"))) == 3  # 2 latents + 1 caption
    _, encoders, _ = _cache(dataset, LatentTextStore(disk, RamCache(1 << 20)))  # restarted ComfyUI
    assert (encoders.image_calls, encoders.text_calls) == (0, 0)


def test_cache_folder_that_cannot_be_written_warns_and_trains_on(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    _image(folder / "a.png")
    blocked = tmp_path / "not_a_folder"
    blocked.write_text("a file where the cache folder should be")
    cache, _, stats = _cache(scan_folder(folder, 64), LatentTextStore(blocked, RamCache(1 << 20)))
    assert len(cache) == 1
    assert f"latent cache folder {blocked} cannot be written" in stats.describe()


# --- item 16: truncated JPEG ----------------------------------------------------------------------------------

def test_truncated_jpeg_is_skipped_at_scan_with_its_reason(tmp_path):
    _image(tmp_path / "good.jpg")
    _truncated_jpeg(tmp_path / "cut.jpg")
    dataset = scan_folder(tmp_path, 64)
    assert [s.path.name for s in dataset.samples] == ["good.jpg"]
    assert dict(dataset.skipped)["cut.jpg"].startswith("not a readable image (OSError: image file is truncated")


def test_jpeg_truncated_after_the_scan_is_skipped_when_caching(tmp_path):
    _image(tmp_path / "good.jpg")
    full = tmp_path / "later.jpg"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (96, 128, 3), dtype=np.uint8)).save(full, "JPEG")
    dataset = scan_folder(tmp_path, 64)
    full.write_bytes(full.read_bytes()[:800])
    cache, _, stats = _cache(dataset)
    assert len(cache) == 1
    assert stats.skipped[0][0] == "later.jpg" and stats.skipped[0][1].startswith("cannot decode image")


# --- the same through a real ComfyUI server -------------------------------------------------------------------

def _preview_dataset(folder):
    """Dataset -> PreviewAny: the scan alone (its repr lists every sample with its caption), no training."""
    return {"2": {"class_type": "LeanLoRADataset", "inputs": {"folder": folder, "resolution": 64, "repeats": 1,
                                                             "trigger_word": "", "framing": "center crop (square)"}},
            "9": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}


def _run_ok(server, prompt):
    from comfy_headless import execution_error
    entry = server.run(prompt, timeout=300)
    assert entry["status"]["status_str"] == "success", execution_error(entry)
    return entry


def _cached(entry) -> set[str]:
    return {n for event, data in entry["status"]["messages"] if event == "execution_cached" for n in data["nodes"]}


@pytest.mark.comfy
def test_server_rescans_after_an_edited_caption_an_added_and_a_deleted_image(comfy_server):
    folder = comfy_server.base_dir / "input" / "changing_dataset"
    folder.mkdir()
    for shade, name in enumerate(("a.png", "b.png")):
        _image(folder / name, colour=(shade * 90, 40, 40))
        (folder / name).with_suffix(".txt").write_text(f"caption of {name}")
    prompt = _preview_dataset("changing_dataset")
    first = _run_ok(comfy_server, prompt)
    assert "caption='caption of a.png'" in first["outputs"]["9"]["text"][0]
    assert "2" in _cached(_run_ok(comfy_server, prompt))  # nothing changed: ComfyUI reuses the scan

    (folder / "a.txt").write_text("an edited caption")
    entry = _run_ok(comfy_server, prompt)
    assert "2" not in _cached(entry) and "caption='an edited caption'" in entry["outputs"]["9"]["text"][0]
    _image(folder / "c.png", colour=(250, 250, 0))
    assert "c.png" in _run_ok(comfy_server, prompt)["outputs"]["9"]["text"][0]
    (folder / "b.png").unlink()
    text = _run_ok(comfy_server, prompt)["outputs"]["9"]["text"][0]
    assert "b.png" not in text and "a.png" in text and "c.png" in text


@pytest.mark.comfy
def test_server_retrains_with_an_edited_caption(comfy_server):
    """The same Train prompt after a caption edit trains again with the new text (not ComfyUI's old result)."""
    from test_comfy_e2e import training_prompt
    import tiny_assets
    folder = tiny_assets.build_tiny_dataset(comfy_server.base_dir / "input" / "recaption_dataset", n=3)
    for caption in sorted(Path(folder).glob("*.txt")):  # captions no earlier test in this server has cached
        caption.write_text(f"recaption test, {caption.stem}")
    prompt = training_prompt(folder="recaption_dataset", steps=2, output_name="recaption")
    prompt["3"]["inputs"]["latent_cache"] = "RAM"
    first = _run_ok(comfy_server, prompt)["outputs"]["17"]["text"][0]
    assert "text 0 hits, 3 encoded" in first, first
    (comfy_server.base_dir / "input" / "recaption_dataset" / "img_001.txt").write_text("a brand new caption")
    entry = _run_ok(comfy_server, prompt)
    assert "5" not in _cached(entry)
    report = entry["outputs"]["17"]["text"][0]
    assert "latents 3 hits, 0 encoded; text 2 hits, 1 encoded" in report, report


@pytest.mark.comfy
def test_server_skips_and_lists_bad_files_and_trains_on_the_rest(comfy_server):
    from test_comfy_e2e import training_prompt
    folder = comfy_server.base_dir / "input" / "hostile_dataset"
    folder.mkdir()
    for shade, name in enumerate(("a.png", "b.png", "c.jpg")):
        _image(folder / name, colour=(shade * 90, 120, 40))
    _png_header_only(folder / "bomb.png", 30000, 30000)
    _truncated_jpeg(folder / "cut.jpg")
    (folder / "a.txt").write_bytes("caf\u00e9".encode("cp1252"))
    (folder / "metadata.csv").write_bytes(f"file_name,text\nb.png,na\u00efve\nC.JPG,{'x' * 140_000}\n"
                                          "gone.png,nobody\n".encode("latin-1"))
    rgba = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    rgba.save(folder / "cutout.png")
    Image.fromarray(np.full((64, 64), 40000, dtype=np.uint16)).save(folder / "grey16.png")

    prompt = training_prompt(folder="hostile_dataset", steps=2, output_name="hostile")
    report = _run_ok(comfy_server, prompt)["outputs"]["17"]["text"][0]
    assert "5 images x 2 repeats" in report, report
    assert "skipped bomb.png: too large (Image size (900000000 pixels)" in report
    assert "skipped cut.jpg: not a readable image (OSError: image file is truncated" in report
    assert "a.txt: not UTF-8 (byte 0xe9 on line 1), read as Windows-1252" in report
    assert "metadata.csv: not UTF-8" in report
    assert "metadata.csv line 3: a field is over 131,072 characters; row ignored" in report
    assert "metadata.csv line 4 (gone.png): file_name matches no image in the folder" in report
    assert "cutout.png: transparent pixels composited onto white" in report
    assert "grey16.png: 16-bit greyscale, scaled to 8 bits" in report
    assert (comfy_server.base_dir / "models" / "loras" / "hostile.safetensors").is_file()


@pytest.mark.comfy
@pytest.mark.parametrize("folder, expected", [("", "folder is empty"), ("   ", "folder is empty"),
                                              ("../../../../etc", "leads out of ComfyUI's input folder")])
def test_server_rejects_an_empty_or_escaping_folder_with_a_clear_error(comfy_server, folder, expected):
    """Refused by the Dataset node's validation when queued, before anything runs."""
    import requests
    from comfy_headless import PromptRejected
    with pytest.raises(PromptRejected) as rejected:
        comfy_server.queue(_preview_dataset(folder))
    [node] = rejected.value.body["node_errors"].values()
    [error] = node["errors"]
    assert node["class_type"] == "LeanLoRADataset" and error["extra_info"]["input_name"] == "folder"
    assert expected in error["details"] and "input folder" in error["details"]
    assert requests.get(f"{comfy_server.url}/system_stats", timeout=10).ok
