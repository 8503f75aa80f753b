"""bench/card_holder.py, the holder process that makes a card of N GiB on a bigger GPU, on the CPU: its sizing
arithmetic and its lifecycle (start, report, release; dies with its parent), and the launcher's card total.

The allocations themselves (cuMemAlloc through libcuda.so.1, or torch.empty), the fresh-process probe and what
ComfyUI then sees are CUDA-only: the GPU machine runs them (bench/gpu_matrix.sh). Here `--simulate` stands in for
the device: the same arithmetic on a given free/total, no allocation, the real process lifecycle."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# conftest has the repo on sys.path already, after ComfyUI's folder: putting it first would make ComfyUI's own
# `import nodes` find this pack's nodes/ package for the rest of the session
from bench import card_holder  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20


def test_the_hold_leaves_the_card_free_in_whole_pages():
    # an H100 after the holder's own context: 79.1 GiB free; an 8 GiB card leaves 8 GiB (+ < 2 MiB of rounding)
    free = int(79.1 * GIB)
    held = card_holder.hold_plan(free, 8 * GIB)
    assert held % (2 * MIB) == 0 and 0 <= free - held - 8 * GIB < 2 * MIB
    assert card_holder.hold_plan(free, 100 * GIB) == 0  # a card bigger than the device: nothing held
    assert card_holder.hold_plan(8 * GIB + MIB, 8 * GIB) == 0  # less than a page over: nothing


def test_rounds_absorb_what_the_driver_takes_beside_each_chunk():
    """Where the driver maps each chunk with some overhead, the first chunk stops short of the card and the next
    ones top up: the card is what stays free, never much less."""
    free, card = int(139.3 * GIB), 24 * GIB
    chunks = card_holder.plan_rounds(free, card)
    assert len(chunks) == 2 and free - sum(chunks) - card < 2 * MIB  # no overhead: a chunk, then the margin
    overhead = 0.002  # 2 MiB per GiB
    chunks = card_holder.plan_rounds(free, card, overhead=overhead)
    left = free - sum(chunks) - sum(int(c * overhead) for c in chunks)
    assert 2 <= len(chunks) <= card_holder.MAX_ROUNDS and card - 2 * MIB <= left <= card + 2 * MIB
    assert card_holder.plan_rounds(card + 100 * MIB, card) == [100 * MIB]  # less than the margin over: topped up


def test_dry_run_prints_one_json_line_of_the_arithmetic():
    done = subprocess.run([sys.executable, str(REPO / "bench" / "card_holder.py"), "--card-gib", "6", "--dry-run",
                           "--free-gib", "79.1", "--total-gib", "79.6"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().removeprefix(card_holder.READY))
    assert record["gib"]["free_after"] == pytest.approx(6.0, abs=0.002)
    assert record["gib"]["held"] == pytest.approx(73.1, abs=0.01)
    assert record["free_after"] + record["held"] == record["free_before"]


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # our own child: reap it
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def test_the_parent_starts_reads_and_releases_the_holder():
    holder = card_holder.CardHolder(8, extra=("--simulate", "--free-gib", "79.1", "--total-gib", "79.6"))
    info = holder.start()
    assert info["gib"]["free_after"] == pytest.approx(8.0, abs=0.002) and info["pid"] == holder.proc.pid and holder.alive()
    pid = holder.proc.pid
    holder.stop()  # closes the holder's stdin: it lets go
    assert _gone(pid) and not holder.alive()


def test_the_holder_dies_with_its_parent(tmp_path):
    """A parent killed with SIGKILL (no cleanup of its own) takes the holder with it."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from bench.card_holder import CardHolder
        holder = CardHolder(8, extra=("--simulate", "--free-gib", "79.1", "--total-gib", "79.6"))
        print(holder.start()["pid"], flush=True)
        time.sleep(600)
        """))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        holder_pid = int(parent.stdout.readline())
        os.kill(holder_pid, 0)  # holding
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _gone(holder_pid), "the holder outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_holder_that_cannot_report_is_an_error_not_a_hang():
    holder = card_holder.CardHolder(8, extra=("--simulate",), timeout=30)  # no --free-gib: argparse exits 2
    with pytest.raises(RuntimeError, match="did not report"):
        holder.start()
    assert not holder.alive()


def test_the_launcher_reports_the_cards_total_only_with_a_holder(tmp_path):
    """comfy_launcher.py --emulation holder: torch.cuda.mem_get_info's total is the card's. On the CPU the launcher
    leaves torch alone (no device to emulate); the shim's arithmetic is checked on a stand-in module here."""
    from bench import comfy_launcher
    assert comfy_launcher.launcher_options(["--card-gib", "8", "--emulation", "holder", "--families", "generic",
                                            "--listen", "x"]) == (
        {"card_gib": "8", "emulation": "holder", "families": "generic"}, ["--listen", "x"])
    calls = []

    class Memory:
        @staticmethod
        def mem_get_info(device=None):
            calls.append(device)
            return 7 * GIB, 80 * GIB

    class Torch:
        class cuda:
            memory = Memory
            mem_get_info = Memory.mem_get_info
    comfy_launcher._card_total(Torch, 8)
    assert Torch.cuda.mem_get_info(0) == (7 * GIB, 8 * GIB) and Torch.cuda.memory.mem_get_info() == (7 * GIB, 8 * GIB)


    class Roomy(Torch):  # a holder that left more than the card free: free never above the card's total
        class cuda:
            class memory:
                mem_get_info = staticmethod(lambda device=None: (9 * GIB, 80 * GIB))
    comfy_launcher._card_total(Roomy, 8)
    assert Roomy.cuda.mem_get_info() == (8 * GIB, 8 * GIB)


def test_servers_record_their_cards_emulation_and_fall_back_without_nvml(tmp_path):
    """MatrixServer.prepare_card: uncapped rows have no emulation; a capped row without NVML (this machine) cannot
    measure a holder and says so, falling back to the fraction cap; the launcher's arguments follow."""
    from bench import server_matrix as sm
    nvml = sm.NvmlSampler(enabled=False, reason="no NVML here")
    (tmp_path / "assets").mkdir()
    for card, expected in ((None, None), (8, "fraction")):
        spec = sm.Server("s", "sd15", [], card_gib=card)
        server = sm.MatrixServer(spec, tmp_path, tmp_path / "servers", tmp_path / "assets", tmp_path, False, nvml)
        server.prepare_card("holder")
        record = server.card_record()
        assert record["card_emulation"] == expected
        if card:
            assert "no NVML" in record["holder_error"] and server.holder is None
