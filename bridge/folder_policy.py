"""Which folders a workflow may make the server read (issue 34, item 6).

Anyone who can queue a prompt names the Dataset node's folder. On a ComfyUI that listens only on loopback that is
the machine's own user, who may train on any folder. On one reachable from other machines (`--listen 0.0.0.0`,
a LAN address, a cloud box) it could be anyone, so folders must then be inside ComfyUI's input folder (where
ComfyUI's own uploads go), with symlinks resolved: absolute paths and links leading out of it are refused unless
the admin opts in with the environment variable LEANLORA_ALLOW_ANY_FOLDER=1. The same holds for each file in an
allowed folder: an image, caption or metadata.csv that is a link leading out of input/ is refused before it is
opened (trainer/dataset.py Confinement), so a link planted in a dataset folder cannot read /etc or a home folder.

The other paths a workflow names are ComfyUI's own lists, validated by ComfyUI against them: continue_from is a file
of the loras folder (folder_paths.get_full_path, as ComfyUI's LoRA loader reads it) and resume a training state
there (nodes/train.py resolve_resume refuses one whose real path leaves its folder); output_name becomes a plain
file stem (files.sanitize_name) under the loras folder and output/leanlora_samples, so it names no folder."""
from __future__ import annotations

import ipaddress
import os

ALLOW_ANY_FOLDER = "LEANLORA_ALLOW_ANY_FOLDER"
_YES = {"1", "true", "yes", "on"}


def _is_loopback(address: str) -> bool:
    address = address.strip().strip("[]")
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def listen_addresses() -> list[str]:
    """The addresses this ComfyUI listens on (its --listen, comma-separated; 127.0.0.1 by default)."""
    from comfy.cli_args import args
    return [part.strip() for part in str(getattr(args, "listen", None) or "127.0.0.1").split(",") if part.strip()]


def folder_confinement(addresses: list[str] | None = None, environ=None) -> str | None:
    """None when any folder may be read (loopback only, or the admin opted in); else why folders are kept inside
    the input folder and how to change that, for the error message."""
    environ = os.environ if environ is None else environ
    if str(environ.get(ALLOW_ANY_FOLDER, "")).strip().lower() in _YES:
        return None
    addresses = listen_addresses() if addresses is None else addresses
    exposed = [address for address in addresses if not _is_loopback(address)]
    if not exposed:
        return None
    return (f"this ComfyUI listens on {', '.join(exposed)} (other machines can queue prompts), so dataset folders "
            "must be inside its input folder, symlinks included. Copy or upload the images into a folder there; "
            f"or, if everyone who can reach this server may read every folder it can, start ComfyUI with the "
            f"environment variable {ALLOW_ANY_FOLDER}=1")
