from PIL import Image

from .plot import RAW, SMOOTH, bar_chart, line_chart
from ..trainer.device.vram import Timeline, format_snapshot, snapshot
from .common import CATEGORY, pil_to_image


# The latest Train node run's device memory per step: LeanLoRATrain passes it to train_lora, this node reads it.
LATEST_TRAINING = Timeline()


class AnyType(str):
    """Accepts a connection of any type (used only to order this node after another)."""

    def __ne__(self, other):
        return False


class LeanLoRAVRAMMonitor:
    @classmethod
    def INPUT_TYPES(cls):
        return {"optional": {"after": (AnyType("*"), {"tooltip":
                    "Optional: connect any output to read memory after that node has run (e.g. after training)."})}}

    RETURN_TYPES = ("STRING", "IMAGE")
    RETURN_NAMES = ("report", "chart")
    FUNCTION = "execute"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    DESCRIPTION = "GPU memory per device (NVML, all processes) and this process's torch allocator, plus the " \
                  "VRAM timeline of the latest LeanLoRA training. Without an NVIDIA GPU it reports system RAM."

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # memory changes between runs: never serve a cached reading

    def execute(self, after=None):
        snap = snapshot()
        if snap["nvml"]:
            bars = [(f"GPU {d['index']} {d['name']}: {d['used_gib']:.1f}/{d['total_gib']:.1f} GiB",
                     d["used_gib"], d["total_gib"]) for d in snap["nvml"]]
        else:
            bars = [(f"system RAM (no NVIDIA GPU): {snap['ram_used_gib']:.1f}/{snap['ram_total_gib']:.1f} GiB",
                     snap["ram_used_gib"], snap["ram_total_gib"])]
        charts = [bar_chart(bars, "memory now")]
        allocated, reserved = LATEST_TRAINING.copy()
        if allocated:
            charts.append(line_chart([(reserved, SMOOTH), (allocated, RAW)],
                                     "last training: GiB allocated (blue) / reserved (orange) per step"))
        width = max(c.width for c in charts)
        canvas = Image.new("RGB", (width, sum(c.height for c in charts)))
        y = 0
        for chart in charts:
            canvas.paste(chart, (0, y))
            y += chart.height
        text = format_snapshot(snap)
        if allocated:
            text += f"\nlast training: peak {max(allocated):.2f} GiB allocated, {max(reserved):.2f} GiB reserved"
        return {"ui": {"text": [text]}, "result": (text, pil_to_image(canvas))}
