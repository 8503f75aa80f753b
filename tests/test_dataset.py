import pytest
from PIL import Image

from trainer.dataset import load_image, scan_folder
from trainer.errors import LeanLoRAError


def _image(path, size=(80, 64), colour=(200, 30, 30)):
    Image.new("RGB", size, colour).save(path)


def test_missing_empty_and_non_image_folders_fail_with_path_and_fix(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(LeanLoRAError, match=f"{missing}.*does not exist.*input folder"):
        scan_folder(missing, 64)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LeanLoRAError, match=f"{empty} is empty.*put images"):
        scan_folder(empty, 64)
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.md").write_text("hello")
    (junk / "fake.png").write_bytes(b"not a png at all")
    with pytest.raises(LeanLoRAError, match=f"{junk} has no usable images.*fake.png: not a readable image"):
        scan_folder(junk, 64)


def test_captions_from_sidecars_then_csv_with_trigger_and_skips(tmp_path):
    for name in ("a.png", "b.jpg", "c.png"):
        _image(tmp_path / name)
    (tmp_path / "a.txt").write_text("a red square\n")
    (tmp_path / "metadata.csv").write_text("file_name,text\na.png,ignored\nb.jpg,from csv\n")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG broken")
    (tmp_path / "clip.gif").write_bytes(b"GIF89a")
    dataset = scan_folder(tmp_path, 64, repeats=3, trigger_word="zxq")
    captions = {s.path.name: s.caption for s in dataset.samples}
    assert captions == {"a.png": "zxq, a red square", "b.jpg": "zxq, from csv", "c.png": "zxq"}
    assert dataset.repeats == 3
    reasons = dict(dataset.skipped)
    assert reasons.keys() == {"broken.png", "clip.gif"}
    assert reasons["clip.gif"] == "extension .gif is not one of .png, .jpg, .jpeg, .webp, .bmp"
    assert "skipped broken.png: not a readable image (" in dataset.summary()
    assert f"skipped clip.gif: {reasons['clip.gif']}" in dataset.summary()


def test_bad_csv_header_names_the_file(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "metadata.csv").write_text("image,caption\na.png,x\n")
    with pytest.raises(LeanLoRAError, match="metadata.csv: the header must be 'file_name,text'"):
        scan_folder(tmp_path, 64)


def test_resolution_must_be_multiple_of_64(tmp_path):
    _image(tmp_path / "a.png")
    with pytest.raises(LeanLoRAError, match="resolution"):
        scan_folder(tmp_path, 100)


def test_load_image_resizes_short_side_and_center_crops(tmp_path):
    image = Image.new("RGB", (200, 100), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 50, 100))  # red band on the left: cropped away by the center crop
    image.save(tmp_path / "wide.png")
    pixels = load_image(tmp_path / "wide.png", 64)
    assert pixels.shape == (64, 64, 3) and 0.0 <= pixels.min() and pixels.max() <= 1.0
    assert pixels[..., 2].mean() > 0.95 and pixels[..., 0].mean() < 0.05


def test_bucket_sizes_keep_aspect_never_upscale_and_fit_the_area():
    from trainer.dataset import bucket_size
    for width, height in [(1024, 512), (512, 1024), (768, 768), (2000, 900), (300, 1200), (640, 480), (200, 130)]:
        bucket_w, bucket_h = bucket_size(width, height, 512)
        assert bucket_w % 64 == 0 and bucket_h % 64 == 0
        assert bucket_w * bucket_h <= 512 * 512
        assert bucket_w <= max(width, 64) and bucket_h <= max(height, 64), "no upscaling"
        assert abs(bucket_w / bucket_h - width / height) / (width / height) < 0.35
    assert bucket_size(1024, 512, 512) == (704, 320)
    assert bucket_size(512, 512, 512) == (512, 512)
    assert bucket_size(200, 130, 512) == (192, 128)  # small image: its own size, rounded down


def test_bucketed_dataset_loads_each_image_at_its_bucket(tmp_path):
    _image(tmp_path / "wide.png", (256, 128))
    _image(tmp_path / "tall.png", (128, 256))
    _image(tmp_path / "square.png", (200, 200))
    dataset = scan_folder(tmp_path, 128, buckets=True)
    sizes = {s.path.name: dataset.target_size(s) for s in dataset.samples}
    assert sizes == {"wide.png": (128, 64), "tall.png": (64, 128), "square.png": (128, 128)}
    for sample in dataset.samples:
        width, height = sizes[sample.path.name]
        assert load_image(sample.path, (width, height)).shape == (height, width, 3)
    assert "buckets: 64x128: 1, 128x64: 1, 128x128: 1" in dataset.summary()
