"""Run a real ComfyUI server headless, with this repo loaded as its only custom-node pack.

Used by the tests and by scripts/demo.py:

    with ComfyServer(base_dir) as server:
        entry = server.run(prompt)            # API-format prompt -> /history entry
        assert entry["status"]["status_str"] == "success", execution_error(entry)

ComfyUI's --base-directory relocates models/, custom_nodes/, input/, output/, temp/ and user/, so every run gets
its own folder and never touches the ComfyUI checkout.
"""
from __future__ import annotations

import atexit
import os
import socket
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
PACK_NAME = "LeanLoRA"
BASE_SUBDIRS = ("models/checkpoints", "models/loras", "input", "output", "temp", "user", "custom_nodes")


def comfyui_path() -> Path:
    """The ComfyUI checkout to run: $COMFYUI_PATH, else the copy scripts/setup_env.sh puts in .cache/."""
    path = Path(os.environ.get("COMFYUI_PATH") or REPO / ".cache" / "comfyui")
    if not (path / "main.py").is_file():
        raise FileNotFoundError(f"no ComfyUI at {path} (main.py missing): run scripts/setup_env.sh")
    return path


def venv_python() -> str:
    """The repo's venv (where setup_env.sh installs ComfyUI's deps), else the running interpreter."""
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def execution_error(history_entry: dict) -> dict | None:
    """Data of the run's `execution_error` message (exception_message, exception_type, node_id, node_type,
    traceback, ...), or None if the run raised nothing."""
    for event, data in history_entry.get("status", {}).get("messages", []):
        if event == "execution_error":
            return data
    return None


class PromptRejected(RuntimeError):
    """POST /prompt refused (part of) the prompt; `body` is ComfyUI's JSON answer with `error` and `node_errors`."""

    def __init__(self, body: dict):
        self.body = body
        lines = [f"node {node_id} ({node.get('class_type')}): {err.get('message')}: {err.get('details')}"
                 for node_id, node in body.get("node_errors", {}).items() for err in node.get("errors", [])]
        error = body.get("error") or {}
        super().__init__("ComfyUI rejected the prompt: " + "\n  ".join(
            lines or [f"{error.get('message')}: {error.get('details')}"]))


class ComfyServer:
    def __init__(self, base_dir: Path, port: int | None = None, extra_args=(), require_pack: bool = True,
                 memory_limit: int | None = None, extra_packs: tuple[Path, ...] = (), cpu: bool = True):
        """require_pack: fail start() when ComfyUI could not import this pack (it only logs that and goes on).
        memory_limit: address-space limit in bytes for the server process (fault tests feed absurd sizes: on a
        shared machine an unguarded allocation must fail with MemoryError, not take the machine's RAM).
        extra_packs: more custom-node folders to load beside the pack (tests/tiny_dit_configs: the tiny DiT
        models' widths, see there). cpu=False: ComfyUI on its GPUs (bench/node_gpus.py on a GPU machine)."""
        self.cpu = cpu
        self.extra_packs = tuple(Path(p).resolve() for p in extra_packs)
        self.base_dir = Path(base_dir).resolve()
        self.require_pack = require_pack
        self.port = port
        self.extra_args = list(extra_args)
        self.memory_limit = memory_limit
        self.client_id = uuid.uuid4().hex
        self.log_path = self.base_dir / "comfyui.log"
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ComfyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def prepare_base_dir(self) -> None:
        for sub in BASE_SUBDIRS:
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        example = comfyui_path() / "input" / "example.png"  # in every ComfyUI's input/: the edit template's LoadImage
        if example.is_file() and not (self.base_dir / "input" / example.name).exists():
            shutil.copyfile(example, self.base_dir / "input" / example.name)
        link = self.base_dir / "custom_nodes" / PACK_NAME
        if link.is_symlink() and link.resolve() != REPO:
            link.unlink()
        if not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        for pack in self.extra_packs:  # ComfyUI loads packages from the top of custom_nodes/ only
            extra = self.base_dir / "custom_nodes" / pack.name
            if extra.is_symlink() and extra.resolve() != pack:
                extra.unlink()
            if not extra.exists():
                extra.symlink_to(pack, target_is_directory=True)

    def start(self, timeout: float = 600) -> None:  # ~15 s idle; minutes on a loaded 2-core machine
        self.prepare_base_dir()
        self.port = self.port or free_port()
        cmd = [venv_python(), "main.py", *(["--cpu"] if self.cpu else []), "--listen", "127.0.0.1",
               "--port", str(self.port),
               "--base-directory", str(self.base_dir),
               # one flag for every name: a second --whitelist-custom-nodes would replace the first list
               "--disable-all-custom-nodes", "--whitelist-custom-nodes", PACK_NAME, *(p.name for p in self.extra_packs),
               # the asset database is not needed and a file DB would be shared by runs
               "--database-url", "sqlite:///:memory:", *self.extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(cmd, cwd=comfyui_path(), env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=self._limit_memory if self.memory_limit else None)
        atexit.register(self.stop)
        self._wait_ready(timeout)
        if self.require_pack and self.pack_import_failed():
            self.stop()
            raise RuntimeError(f"ComfyUI could not import {PACK_NAME}; log:\n{self.log_text()}")

    def _limit_memory(self) -> None:  # runs in the child, before ComfyUI starts
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_limit, self.memory_limit))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if requests.get(f"{self.url}/system_stats", timeout=2).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"ComfyUI did not answer within {timeout:g} s; log tail:\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            code = None if self._proc is None else self._proc.returncode
            raise RuntimeError(f"ComfyUI is not running (exit code {code}); log tail:\n{self.log_tail()}")

    def pack_import_failed(self) -> bool:
        # nodes.py logs "  0.0 seconds (IMPORT FAILED): <base>/custom_nodes/LeanLoRA" and keeps running
        return any("(IMPORT FAILED)" in line and line.rstrip().endswith(f"/custom_nodes/{PACK_NAME}")
                   for line in self.log_text().splitlines())

    def object_info(self) -> dict:
        return self._get("/object_info")

    def queue(self, prompt: dict) -> str:
        r = requests.post(f"{self.url}/prompt", json={"prompt": prompt, "client_id": self.client_id}, timeout=60)
        if r.status_code == 400:
            raise PromptRejected(r.json())
        r.raise_for_status()
        body = r.json()
        # ComfyUI still queues a prompt when only some of its outputs are invalid; the rest are dropped
        # silently. Treat that as a rejection so a broken workflow never half-runs.
        if body.get("node_errors"):
            raise PromptRejected(body)
        return body["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = 600) -> dict:
        """Poll /history until the prompt finished (success or error) and return its entry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self._get(f"/history/{prompt_id}").get(prompt_id)
            if entry is not None:
                return entry
            self._check_alive()
            time.sleep(0.25)
        raise TimeoutError(f"prompt {prompt_id} not finished after {timeout:g} s; log tail:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 600) -> dict:
        return self.wait(self.queue(prompt), timeout)

    def interrupt(self) -> None:
        requests.post(f"{self.url}/interrupt", timeout=10).raise_for_status()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self) -> None:
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _get(self, path: str) -> dict:
        r = requests.get(f"{self.url}{path}", timeout=60)
        r.raise_for_status()
        return r.json()
