"""Which dataset folders a workflow may name (issue 34, item 6): any folder on a ComfyUI that listens only on
loopback or whose admin opted in (LEANLORA_ALLOW_ANY_FOLDER=1); else only folders inside ComfyUI's input folder,
symlinks resolved. The server-level cases are in tests/test_hostile_server.py (loopback) and
test_a_server_reachable_from_other_machines_reads_only_input_folders below."""
import os
import shutil

import pytest
import requests

from bridge.folder_policy import ALLOW_ANY_FOLDER, folder_confinement
from trainer.dataset import resolve_folder
from trainer.errors import LeanLoRAError


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


@pytest.mark.comfy
def test_a_server_reachable_from_other_machines_reads_only_input_folders(tmp_path, tiny_assets):
    """A real ComfyUI started with --listen 0.0.0.0: the Dataset node's validation refuses a folder outside input/
    (absolute or a symlink leading out) naming the setting, and the node reads one inside."""
    from comfy_headless import ComfyServer, PromptRejected, execution_error
    base = tmp_path / "shared_base"
    shutil.copytree(tiny_assets["dataset"], base / "input" / "inside")
    shutil.copytree(tiny_assets["dataset"], tmp_path / "private")
    (base / "input" / "link_out").symlink_to(tmp_path / "private", target_is_directory=True)
    server = ComfyServer(base, extra_args=["--listen", "0.0.0.0"])
    env_before = os.environ.pop(ALLOW_ANY_FOLDER, None)
    try:
        server.start(timeout=600)
        assert requests.get(f"{server.url}/system_stats", timeout=10).ok
        for folder, ok in ((str(tmp_path / "private"), False), ("link_out", False), ("inside", True),
                           (str(base / "input" / "inside"), True)):
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
    finally:
        server.stop()
        if env_before is not None:
            os.environ[ALLOW_ANY_FOLDER] = env_before
