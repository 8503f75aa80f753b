"""Where GPU memory is: NVML (the driver's view, every process) plus the torch allocator (this process), and
the VRAM timeline of the latest training run. Without an NVIDIA GPU it says so and reports system RAM."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .card import device_memory

GIB = 2 ** 30


def reset_peak(device: torch.device) -> bool:
    """Starts a new peak measurement; False off a GPU or where the allocator keeps no peak statistics. ComfyUI
    switches PyTorch to the cudaMallocAsync backend by default, and not every torch build tracks peaks for it: what
    needs them (estimate probes, peak reports) is skipped rather than failing the run."""
    memory = device_memory(device)
    return memory is not None and memory.reset_peak()


def device_memory_bytes(device: torch.device) -> dict[str, int] | None:
    """This process's allocated / reserved bytes and their peaks; None off a GPU or where the allocator backend
    keeps no such statistics."""
    memory = device_memory(device)
    if memory is None or (not memory.simulated and not torch.cuda.is_available()):
        return None
    try:
        return {"allocated": memory.allocated(), "reserved": memory.reserved(),
                "peak_allocated": memory.peak_allocated(), "peak_reserved": memory.peak_reserved()}
    except RuntimeError:  # an allocator backend without these statistics
        return None


def device_memory_gib(device: torch.device) -> dict[str, float] | None:
    memory = device_memory_bytes(device)
    return None if memory is None else {name: value / GIB for name, value in memory.items()}


@dataclass
class Timeline:
    """Allocated/reserved GiB per training step of a run (empty on CPU). Locked: the run's thread records while
    the host's (ComfyUI's VRAM Monitor node) may read."""
    steps: list[int] = field(default_factory=list)
    allocated: list[float] = field(default_factory=list)
    reserved: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self._lock:
            self.steps, self.allocated, self.reserved = [], [], []

    def record(self, step: int, device: torch.device) -> None:
        memory = device_memory_gib(device)
        if memory is None:
            return
        with self._lock:
            self.steps.append(step)
            self.allocated.append(memory["allocated"])
            self.reserved.append(memory["reserved"])

    def copy(self) -> tuple[list[float], list[float]]:
        with self._lock:
            return list(self.allocated), list(self.reserved)



class DevicePeak:
    """Device-level memory in use on a GPU (NVML: everything on the card, the CUDA context included), sampled by a
    thread while a run trains; its peak is what a card of that size must hold. Inactive without NVML."""

    def __init__(self, device: torch.device, interval_s: float = 0.02):
        self.device, self.interval_s = torch.device(device), interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        handle = self._handle()
        if handle is not None:
            self._thread = threading.Thread(target=self._sample, args=(handle,), daemon=True, name="leanlora-nvml")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        return False

    def _handle(self):
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return None
        try:
            import pynvml
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(self.device)  # by PCI address: CUDA_VISIBLE_DEVICES-proof
            bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus_id.encode())
        except Exception:  # noqa: BLE001 - no NVML, no driver, an older torch: the report leaves the line out
            return None

    def _sample(self, handle) -> None:
        import pynvml
        try:
            while not self._stop.is_set():
                used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
                self.peak = used if self.peak is None else max(self.peak, used)
                self._stop.wait(self.interval_s)
        except Exception:  # noqa: BLE001 - a driver hiccup ends sampling, never the run
            pass


def nvml_devices() -> tuple[list[dict], str | None]:
    """[{index, name, used_gib, total_gib}] from NVML, or ([], why not)."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return [], f"no NVIDIA driver/GPU found ({error})"
    try:
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            devices.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                            "used_gib": info.used / GIB, "total_gib": info.total / GIB})
        return devices, None
    finally:
        pynvml.nvmlShutdown()


def system_ram_gib() -> tuple[float, float]:
    """(used, total) from /proc/meminfo where available, else psutil."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        return (fields["MemTotal"] - fields["MemAvailable"]) / GIB, fields["MemTotal"] / GIB
    except (OSError, KeyError, ValueError):
        import psutil
        memory = psutil.virtual_memory()
        return (memory.total - memory.available) / GIB, memory.total / GIB


def available_ram_bytes() -> int | None:
    """Host RAM a new allocation can get without swapping (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def process_ram_peak_gib() -> float | None:
    """The host process's peak resident memory since it started (the whole ComfyUI server), or None."""
    try:
        import resource
        import sys
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        try:
            import psutil
            info = psutil.Process().memory_info()
            return getattr(info, "peak_wset", info.rss) / GIB  # Windows keeps the peak working set
        except ImportError:
            return None


def snapshot() -> dict:
    devices, why = nvml_devices()
    torch_devices = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch_devices.append({"index": index, **device_memory_gib(torch.device("cuda", index))})
    used, total = system_ram_gib()
    return {"nvml": devices, "nvml_error": why, "torch": torch_devices, "ram_used_gib": used, "ram_total_gib": total}


def format_snapshot(snap: dict) -> str:
    lines = []
    if snap["nvml"]:
        for d in snap["nvml"]:
            lines.append(f"GPU {d['index']} {d['name']}: {d['used_gib']:.2f} / {d['total_gib']:.2f} GiB used (all processes)")
    else:
        lines.append(f"No NVIDIA GPU: {snap['nvml_error']}")
    for d in snap["torch"]:
        lines.append(f"torch cuda:{d['index']}: allocated {d['allocated']:.2f} GiB, reserved {d['reserved']:.2f} GiB, "
                     f"peak allocated {d['peak_allocated']:.2f} GiB, peak reserved {d['peak_reserved']:.2f} GiB")
    lines.append(f"system RAM: {snap['ram_used_gib']:.2f} / {snap['ram_total_gib']:.2f} GiB used")
    return "\n".join(lines)
