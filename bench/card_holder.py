"""A card of N GiB on a bigger GPU, as a real card behaves: a separate process takes the rest of the device with
plain device allocations before the ComfyUI server starts, and holds them for the whole run.

    python -m bench.card_holder --card-gib 8            # holds total - 8 GiB; one JSON line; sleeps until killed
    python -m bench.card_holder --card-gib 8 --dry-run --free-gib 79.1 --total-gib 79.6   # the arithmetic only
    python -m bench.card_holder --probe                 # what a fresh process sees: {"free", "total"} (one line)

Why (../shared/DESIGN.md, "A card that behaves like a real card"): a per-process memory fraction caps PyTorch's
allocations only (the CUDA context and libraries sit outside it), and ComfyUI still sees the whole device's free
memory (text-encoder placement, model loading). With the rest of the device held by another process the server's
cudaMemGetInfo returns what the card would have free, and running out of it is a real out-of-memory error.

Sizing: the holder creates its own context first (~0.3-0.5 GiB: it counts, like anything else on the device),
then reads the device's free memory F and allocates F - N GiB (2 MiB steps: a first chunk that stops FIRST_MARGIN
short, then what cudaMemGetInfo says is still over the card, in up to MAX_ROUNDS chunks: the driver may take page
tables for what it maps), so that the device has N GiB free before the server starts. A fresh
process then sees N GiB less its own context, as on a real card of N GiB with nothing else on it; the holder
measures that with a child (--probe) and prints it. Peaks: NVML's device-level used memory less what was used
before the server (idle + the holder: bench/server_matrix.py measures its baseline after the holder is up).

The allocations: the CUDA driver API (libcuda.so.1's cuMemAlloc, no caching allocator, no torch import: the
holder's context is the driver's minimum), or torch.empty(uint8) where libcuda cannot be loaded. The holder dies
with its parent: PR_SET_PDEATHSIG(SIGKILL) on Linux, a check of its parent every second, and with --stdin-pipe
(CardHolder's) when its stdin reaches end of file (the parent keeps the pipe open; its death closes it); it also
exits on SIGTERM/SIGINT, or after --max-s seconds.

--simulate: no CUDA at all (the CPU tests): the arithmetic on --free-gib/--total-gib, no allocation, and the same
lifecycle (report, hold until released or the parent dies). Everything with a device is CUDA-only.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import time

GIB = 2 ** 30
MIB = 2 ** 20
GRANULARITY = 2 * MIB  # the driver maps device memory in 2 MiB pages
MAX_ROUNDS = 6
FIRST_MARGIN = 256 * MIB  # the first chunk leaves this much over the card: the driver's own share shows first
READY = "[holder] "  # the line the parent waits for: READY + JSON


def hold_plan(free: int, card: int, granularity: int = GRANULARITY) -> int:
    """Bytes to allocate next so that `card` bytes stay free: free - card rounded down to the granularity; 0 when
    the device has no more than the card free (nothing to hold: the card is the device, or bigger)."""
    if free <= card:
        return 0
    return (free - card) // granularity * granularity


def plan_rounds(free_before: int, card: int, overhead: float = 0.0, granularity: int = GRANULARITY,
                rounds: int = MAX_ROUNDS) -> list[int]:
    """The chunks `hold` allocates where the driver takes `overhead` (a fraction) of each chunk beside it (page
    tables): the first chunk stops FIRST_MARGIN above the card, the next ones allocate what is then left over the
    card, so the overhead of the big chunk is measured before the hold ends. The pure arithmetic of `hold`."""
    free, chunks = free_before, []
    for round_ in range(rounds):
        size = hold_plan(free, card + (FIRST_MARGIN if round_ == 0 else 0), granularity)
        if size < granularity:
            if round_ == 0:
                continue
            break
        chunks.append(size)
        free -= size + int(size * overhead)
    return chunks


# --- the device: CUDA driver API, or torch --------------------------------------------------------------------

class DriverApi:
    """libcuda.so.1 through ctypes: a primary context on one device, cuMemGetInfo, cuMemAlloc. No torch."""

    def __init__(self, ordinal: int = 0):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.pointers: list[ctypes.c_uint64] = []
        self.name = "CUDA driver API (cuMemAlloc)"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(text))
            raise RuntimeError(f"{what}: CUDA error {code} ({(text.value or b'?').decode()})")

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value, total.value

    def allocate(self, size: int) -> None:
        pointer = ctypes.c_uint64()
        self._check(self.lib.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(size)), f"cuMemAlloc({size})")
        self.pointers.append(pointer)


class TorchApi:
    """torch's allocator where libcuda cannot be loaded through ctypes (a chunk this large is its own segment)."""

    def __init__(self, ordinal: int = 0):
        import torch
        self.torch, self.device = torch, torch.device("cuda", ordinal)
        torch.cuda.init()
        torch.empty(1, device=self.device)  # the context
        self.tensors = []
        self.name = "torch.empty(uint8)"

    def mem_info(self) -> tuple[int, int]:
        return self.torch.cuda.mem_get_info(self.device)

    def allocate(self, size: int) -> None:
        self.tensors.append(self.torch.empty(size, dtype=self.torch.uint8, device=self.device))


def open_device(ordinal: int = 0):
    try:
        return DriverApi(ordinal)
    except (OSError, AttributeError) as error:  # no libcuda.so.1 to load: torch's way
        print(f"[holder] CUDA driver API unavailable ({error}); using torch", file=sys.stderr, flush=True)
        return TorchApi(ordinal)


def hold(api, card: int) -> dict:
    """Allocates until `card` bytes of the device are free (MAX_ROUNDS chunks at most); returns the record."""
    free_before, total = api.mem_info()
    chunks, free = [], free_before
    for round_ in range(MAX_ROUNDS):
        size = hold_plan(free, card + (FIRST_MARGIN if round_ == 0 else 0))
        if size < GRANULARITY:
            if round_ == 0:
                continue
            break
        try:
            api.allocate(size)
        except RuntimeError as error:  # the driver needs room for its own mappings: a bit less, once more
            if size <= 64 * MIB:
                print(f"[holder] {error}; stopping at {sum(chunks)} bytes", file=sys.stderr, flush=True)
                break
            size -= 64 * MIB
            api.allocate(size)
        chunks.append(size)
        free, _ = api.mem_info()
    return {"total": total, "free_before": free_before, "held": sum(chunks), "chunks": chunks, "free_after": free}


def probe_fresh_process(ordinal: int, timeout: float = 60) -> dict:
    """What a new process sees on the device (its own context created): {"free", "total"}, or {"error"}."""
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", "--device", str(ordinal)],
                              capture_output=True, text=True, timeout=timeout)
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith(READY)), None)
        return json.loads(line[len(READY):]) if line else {"error": (done.stderr or done.stdout)[-400:]}
    except Exception as error:  # noqa: BLE001 - a probe failing is recorded, the hold stands
        return {"error": f"{type(error).__name__}: {error}"}


# --- lifecycle -------------------------------------------------------------------------------------------------

def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG); elsewhere the stdin pipe ends it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def wait_until_released(parent: int, max_s: float | None, stdin_pipe: bool) -> str:
    """Blocks until the parent is gone, max_s passed, or (stdin_pipe) stdin ends: the parent closed the pipe."""
    deadline = None if max_s is None else time.monotonic() + max_s
    while True:
        if os.getppid() != parent:
            return "parent gone"
        if deadline is not None and time.monotonic() > deadline:
            return "max-s reached"
        if not stdin_pipe:
            time.sleep(1.0)
            continue
        try:
            ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        except (ValueError, OSError):  # no stdin at all: poll the parent only
            time.sleep(1.0)
            continue
        if ready and not sys.stdin.buffer.read1(4096):
            return "stdin closed"


def report(record: dict) -> None:
    gib = {k: round(v / GIB, 3) for k, v in record.items() if isinstance(v, int) and k != "pid"}
    print(READY + json.dumps({**record, "gib": gib}), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card-gib", type=float)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--probe", action="store_true", help="print what this fresh process sees, then exit")
    parser.add_argument("--no-probe", action="store_true", help="do not measure a fresh process after holding")
    parser.add_argument("--dry-run", action="store_true", help="the arithmetic on --free-gib/--total-gib only")
    parser.add_argument("--simulate", action="store_true", help="no CUDA: the arithmetic, then hold nothing")
    parser.add_argument("--free-gib", type=float, help="--dry-run/--simulate: the device's free memory")
    parser.add_argument("--total-gib", type=float, help="--dry-run/--simulate: the device's total memory")
    parser.add_argument("--max-s", type=float, default=None, help="release after this many seconds at most")
    parser.add_argument("--stdin-pipe", action="store_true",
                        help="release when stdin ends (CardHolder keeps a pipe open; a shell's /dev/null would end it)")
    args = parser.parse_args(argv)
    if args.probe:
        api = open_device(args.device)
        free, total = api.mem_info()
        print(READY + json.dumps({"free": free, "total": total, "api": api.name}), flush=True)
        return
    if args.card_gib is None:
        parser.error("--card-gib is required")
    card = int(args.card_gib * GIB)
    if args.dry_run or args.simulate:
        if args.free_gib is None or args.total_gib is None:
            parser.error("--dry-run/--simulate need --free-gib and --total-gib")
        free, total = int(args.free_gib * GIB), int(args.total_gib * GIB)
        chunks = plan_rounds(free, card)
        record = {"card": card, "total": total, "free_before": free, "held": sum(chunks), "chunks": chunks,
                  "free_after": free - sum(chunks), "api": "simulated (no CUDA)", "pid": os.getpid()}
        if args.dry_run:
            report(record)
            return
    else:
        parent = os.getppid()
        die_with_parent()
        api = open_device(args.device)
        record = {"card": card, **hold(api, card), "api": api.name, "pid": os.getpid()}
        if not args.no_probe:
            fresh = probe_fresh_process(args.device)
            record["fresh_process_free"] = fresh.get("free")
            record["fresh_process_context"] = (record["free_after"] - fresh["free"]) if "free" in fresh else None
            if "error" in fresh:
                record["fresh_process_error"] = fresh["error"]
    if args.simulate:
        parent = os.getppid()
        die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    report(record)
    why = wait_until_released(parent, args.max_s, args.stdin_pipe)
    print(f"[holder] released ({why})", file=sys.stderr, flush=True)


class CardHolder:
    """The parent's side: starts the holder process for a card of `card_gib` GiB, waits for its report, stops it.

        with CardHolder(8) as holder:   # holder.info: the holder's record (bytes; "gib": the same in GiB)
            ... start the server ...
    """

    def __init__(self, card_gib: float, device: int = 0, extra: tuple[str, ...] = (), timeout: float = 120):
        self.card_gib, self.device, self.extra, self.timeout = card_gib, device, extra, timeout
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self.stderr_path: str | None = None

    def start(self) -> dict:
        import tempfile
        err = tempfile.NamedTemporaryFile("w+b", prefix="card_holder_", suffix=".log", delete=False)
        self.stderr_path = err.name
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--card-gib", f"{self.card_gib:g}",
                                      "--device", str(self.device), "--stdin-pipe", *self.extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        err.close()
        deadline = time.monotonic() + self.timeout
        line = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith(READY.encode()) or not line:
                    break
            elif self.proc.poll() is not None:
                break
        if not line.startswith(READY.encode()):
            self.stop()
            raise RuntimeError(f"the card holder did not report (exit {self.proc.returncode if self.proc else '?'}): "
                               f"{self.stderr_tail()}")
        self.info = json.loads(line[len(READY):])
        return self.info

    def stderr_tail(self, chars: int = 1500) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return f.read()[-chars:]
        except (OSError, TypeError):
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 15) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.stdin.close()  # the holder's signal to let go
            except OSError:
                pass
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except (OSError, AttributeError):
                pass

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


if __name__ == "__main__":
    main()
