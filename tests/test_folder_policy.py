"""Which dataset folders, and files in them, a workflow may name (issue 34, item 6): any on a ComfyUI that listens
only on loopback or whose admin opted in (LEANLORA_ALLOW_ANY_FOLDER=1); else only folders inside ComfyUI's input
folder, symlinks resolved, holding no link that leads out of it. The server-level cases are in
tests/test_hostile_server.py (loopback) and test_a_server_reachable_from_other_machines_reads_only_input_folders
below."""
import os
import shutil
from pathlib import Path

import pytest
import requests

import torch
from PIL import Image

from bridge.folder_policy import ALLOW_ANY_FOLDER, folder_confinement
from trainer.cache import CacheStats, build_cache
from trainer.dataset import Confinement, folder_fingerprint, resolve_folder, scan_folder
from trainer.errors import LeanLoRAError

WHY = "listening on 0.0.0.0: set LEANLORA_ALLOW_ANY_FOLDER=1"


@pytest.mark.parametrize("addresses", [["127.0.0.1"], ["::1"], ["localhost"], ["127.0.0.1", "::1"], ["127.0.0.2"]])
def test_loopback_only_allows_any_folder(addresses):
    assert folder_confinement(addresses, environ={}) is None


@pytest.mark.parametrize("addresses", [["0.0.0.0"], ["0.0.0.0", "::"], ["127.0.0.1", "192.168.1.5"], ["myhost"]])
def test_a_reachable_server_confines_folders_unless_the_admin_opts_in(addresses):
    why = folder_confinement(addresses, environ={})
    assert why is not None and ALLOW_ANY_FOLDER in why and addresses[-1] in why
    assert folder_confinement(addresses, environ={ALLOW_ANY_FOLDER: "1"}) is None
    assert folder_confinement(addresses, environ={ALLOW_ANY_FOLDER: "0"}) is not None


def test_the_default_reads_comfyuis_listen_argument(monkeypatch):
    from comfy.cli_args import args
    monkeypatch.delenv(ALLOW_ANY_FOLDER, raising=False)
    monkeypatch.setattr(args, "listen", "127.0.0.1")
    assert folder_confinement() is None
    monkeypatch.setattr(args, "listen", "0.0.0.0,::")  # what a bare --listen means
    assert "0.0.0.0, ::" in folder_confinement()


def test_confined_folders_stay_inside_input_symlinks_resolved(tmp_path):
    input_dir, outside = tmp_path / "input", tmp_path / "private"
    (input_dir / "mine").mkdir(parents=True)
    outside.mkdir()
    (input_dir / "sneaky").symlink_to(outside, target_is_directory=True)
    why = "listening on 0.0.0.0: set LEANLORA_ALLOW_ANY_FOLDER=1"
    assert resolve_folder("mine", input_dir, why) == input_dir / "mine"
    assert resolve_folder(str(input_dir / "mine"), input_dir, why) == input_dir / "mine"  # absolute, but inside
    with pytest.raises(LeanLoRAError, match=rf"folder '{outside}' is outside ComfyUI's input folder .*: {why}"):
        resolve_folder(str(outside), input_dir, why)
    with pytest.raises(LeanLoRAError, match=rf"folder 'sneaky' \(a link to {outside}\) is outside .*LEANLORA_ALLOW"):
        resolve_folder("sneaky", input_dir, why)
    with pytest.raises(LeanLoRAError, match="folder 'mi\\\\x00ne' holds a NUL character"):  # not a ValueError
        resolve_folder("mi\x00ne", input_dir, why)
    assert resolve_folder(str(outside), input_dir) == outside  # not confined: as before
    assert resolve_folder("sneaky", input_dir) == input_dir / "sneaky"


def _planted(tmp_path):
    """input/ds with an image of its own, and private/ outside input/ holding an image and a 'secret' text."""
    input_dir, private = tmp_path / "input", tmp_path / "private"
    (input_dir / "ds").mkdir(parents=True)
    private.mkdir()
    Image.new("RGB", (64, 64), "red").save(input_dir / "ds" / "own.png")
    Image.new("RGB", (64, 64), "blue").save(private / "holiday.png")
    (private / "secret.txt").write_text("SECRET-TOKEN=hunter2")
    return input_dir, input_dir / "ds", private


@pytest.mark.parametrize("name, target", [("stolen.png", "holiday.png"), ("own.txt", "secret.txt"),
                                          ("metadata.csv", "secret.txt"), ("gone.png", "no_such_file.png")])
def test_a_confined_scan_refuses_a_file_linked_out_of_input_before_reading_it(tmp_path, name, target):
    """A link planted in an allowed folder (an image, a caption, metadata.csv, even a dangling one) leading out
    of input/ is an error naming the file and the setting, before any file is opened."""
    input_dir, folder, private = _planted(tmp_path)
    (folder / name).symlink_to(private / target)
    confined = Confinement(input_dir, WHY)
    with pytest.raises(LeanLoRAError, match=rf"dataset folder {folder}: {name} is a link to a file outside "
                                            rf"ComfyUI's input folder \({input_dir}\).*copy of the file. Why: {WHY}"):
        scan_folder(folder, 64, confinement=confined)
    # loopback or opted in: the link is read, as before (which is what a shared server must not do)
    if name == "stolen.png":
        assert [s.path.name for s in scan_folder(folder, 64).samples] == ["own.png", "stolen.png"]
    elif name == "own.txt":
        assert [s.caption for s in scan_folder(folder, 64).samples] == ["SECRET-TOKEN=hunter2"]
    elif name == "metadata.csv":
        with pytest.raises(LeanLoRAError, match="hunter2"):  # its text comes back in the header's error
            scan_folder(folder, 64)
    else:
        assert ("gone.png", "a link to a file that does not exist") in scan_folder(folder, 64).skipped


def test_links_that_stay_inside_input_are_read_when_confined(tmp_path):
    input_dir, folder, _ = _planted(tmp_path)
    (input_dir / "shared").mkdir()
    Image.new("RGB", (64, 64), "green").save(input_dir / "shared" / "common.png")
    (input_dir / "shared" / "common.txt").write_text("a green square")
    (folder / "common.png").symlink_to(input_dir / "shared" / "common.png")
    (folder / "common.txt").symlink_to(Path("..") / "shared" / "common.txt")  # relative links too
    dataset = scan_folder(folder, 64, confinement=Confinement(input_dir, WHY))
    assert [(s.path.name, s.caption) for s in dataset.samples] == [("common.png", "a green square"), ("own.png", "")]


def test_an_image_made_a_link_out_of_input_after_the_scan_is_skipped_when_caching(tmp_path):
    input_dir, folder, private = _planted(tmp_path)
    Image.new("RGB", (64, 64), "yellow").save(folder / "later.png")
    dataset = scan_folder(folder, 64, confinement=Confinement(input_dir, WHY))
    (folder / "later.png").unlink()
    (folder / "later.png").symlink_to(private / "holiday.png")
    encoded = []
    stats = CacheStats()
    cache = build_cache(dataset, lambda pixels: encoded.append(pixels) or pixels[:, ::8, ::8].permute(0, 3, 1, 2),
                        lambda caption, w, h: {"c_crossattn": torch.zeros(1, 77, 4)}, stats=stats)
    assert [entry.name for entry in cache] == ["own.png"] and len(encoded) == 1
    [(name, reason)] = stats.skipped
    assert name == "later.png" and WHY in reason
    assert reason.startswith("a link to a file outside ComfyUI's input folder")


def test_a_confined_fingerprint_does_not_read_through_a_link_out_of_input(tmp_path):
    input_dir, folder, private = _planted(tmp_path)
    (folder / "own.txt").symlink_to(private / "secret.txt")
    confined = Confinement(input_dir, WHY)
    before, before_open = folder_fingerprint(folder, confined), folder_fingerprint(folder)
    (private / "secret.txt").write_text("SECRET-TOKEN=changed!")  # same size; the mtime may not change
    os.utime(private / "secret.txt", ns=(0, 0))
    assert folder_fingerprint(folder, confined) == before
    assert folder_fingerprint(folder) != before_open  # unconfined: the caption's text counts, as before


@pytest.mark.comfy
def test_a_server_reachable_from_other_machines_reads_only_input_folders(tmp_path, tiny_assets):
    """A real ComfyUI started with --listen 0.0.0.0: the Dataset node's validation refuses a folder outside input/
    (absolute or a symlink leading out), and a folder inside it holding a caption that is a link out of input/,
    naming the setting (and the file); the node reads a folder inside; the preview route shows no thumbnail of
    the planted folder."""
    from comfy_headless import ComfyServer, PromptRejected, execution_error
    base = tmp_path / "shared_base"
    shutil.copytree(tiny_assets["dataset"], base / "input" / "inside")
    shutil.copytree(tiny_assets["dataset"], tmp_path / "private")
    (base / "input" / "link_out").symlink_to(tmp_path / "private", target_is_directory=True)
    shutil.copytree(tiny_assets["dataset"], base / "input" / "planted")
    caption = sorted((base / "input" / "planted").glob("*.txt"))[0]
    caption.unlink()
    (tmp_path / "private" / "secret.txt").write_text("SECRET-TOKEN=hunter2")
    caption.symlink_to(tmp_path / "private" / "secret.txt")
    server = ComfyServer(base, extra_args=["--listen", "0.0.0.0"])
    env_before = os.environ.pop(ALLOW_ANY_FOLDER, None)
    try:
        server.start(timeout=600)
        assert requests.get(f"{server.url}/system_stats", timeout=10).ok
        for folder, ok in ((str(tmp_path / "private"), False), ("link_out", False), ("planted", False),
                           ("inside", True), (str(base / "input" / "inside"), True)):
            prompt = {"1": {"class_type": "LeanLoRADataset", "inputs": {
                          "folder": folder, "resolution": 64, "repeats": 1, "trigger_word": "",
                          "framing": "center crop (square)"}},
                      "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
            if ok:
                entry = server.run(prompt, timeout=300)
                assert execution_error(entry) is None, execution_error(entry)
                continue
            with pytest.raises(PromptRejected) as rejected:  # ComfyUI's validation, before anything runs
                server.queue(prompt)
            [error] = rejected.value.body["node_errors"]["1"]["errors"]
            message = error["details"]
            assert "outside ComfyUI's input folder" in message and ALLOW_ANY_FOLDER in message, message
            assert "0.0.0.0" in message
            assert folder != "planted" or f"{caption.name} is a link to a file outside" in message, message
        answer = requests.get(f"{server.url}/leanlora/dataset_preview", params={"folder": "planted"}, timeout=60)
        assert answer.status_code != 200 and not answer.json().get("thumbnails"), answer.text
        assert caption.name in answer.json()["error"] and ALLOW_ANY_FOLDER in answer.json()["error"]
    finally:
        server.stop()
        if env_before is not None:
            os.environ[ALLOW_ANY_FOLDER] = env_before


def test_continue_from_and_resume_stay_in_the_loras_folder_whatever_the_policy(tmp_path, monkeypatch):
    """The other paths a workflow names (through a link, which skips ComfyUI's list check) are confined to the
    loras folder on any server: an absolute path, '..' out of it, or a link in it leading out are refused naming
    the field, and the file outside is never read."""
    import importlib
    import importlib.util
    import sys
    import folder_paths
    repo = Path(__file__).resolve().parents[1]
    name = "leanlora_pack_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, repo / "__init__.py",
                                                      submodule_search_locations=[str(repo)])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    train, settings = (importlib.import_module(f"{name}.nodes.{sub}") for sub in ("train", "settings"))
    pack_error = importlib.import_module(f"{name}.trainer.errors").LeanLoRAError  # the pack's own class
    loras, private = tmp_path / "models" / "loras", tmp_path / "private"
    loras.mkdir(parents=True)
    private.mkdir()
    for stem in ("stolen", "elsewhere"):
        (private / f"{stem}.leanlora-state").write_bytes(b"not read")
        (private / f"{stem}.safetensors").write_bytes(b"not read")
    (loras / "linked.leanlora-state").symlink_to(private / "stolen.leanlora-state")
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "loras", ([str(loras)], {".safetensors"}))
    monkeypatch.setenv(ALLOW_ANY_FOLDER, "1")  # the opt-in is for dataset folders only
    for choice in (str(private / "elsewhere.leanlora-state"), "../../private/elsewhere.leanlora-state"):
        with pytest.raises(pack_error, match=r"^resume: the training state .* is not in the loras folder"):
            train.resolve_resume(choice, "my_lora")
    # issue 45: a link in loras/ is named as what it is, not as a file gone from the folder
    with pytest.raises(pack_error, match=rf"^resume: the training state 'linked.leanlora-state' in {loras} is a link "
                                         r"leading out of the loras folder \(to .*stolen.leanlora-state\).*copy the"):
        train.resolve_resume("linked.leanlora-state", "my_lora")
    with pytest.raises(pack_error, match=r"^resume: the training state .* is not in the loras folder"):
        train.resolve_resume("x" * 5000, "my_lora")  # a name too long for the file system: not there
    config = settings.LeanLoRALoraConfig()
    for choice in (str(private / "elsewhere.safetensors"), "../../private/elsewhere.safetensors"):
        with pytest.raises(pack_error, match=r"^continue_from: .* is not in the loras folder"):
            config.execute(16, 16.0, 0.0, "attention", continue_from=choice)
