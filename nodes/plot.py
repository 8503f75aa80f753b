"""Small charts drawn with Pillow (no matplotlib dependency): the loss curve and the VRAM bars."""
from __future__ import annotations

from PIL import Image, ImageDraw

BACKGROUND, AXIS, RAW, SMOOTH = (24, 24, 28), (110, 110, 120), (90, 140, 200), (255, 170, 60)
VALIDATION = (120, 220, 120)


def _smooth(values: list[float], beta: float = 0.9) -> list[float]:
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** (i + 1)))  # bias-corrected, as Adam does for its moments
    return out


def line_chart(series: list[tuple[list[float], tuple[int, int, int]]], title: str,
               width: int = 512, height: int = 320,
               points: tuple[list[tuple[int, float]], tuple[int, int, int]] | None = None) -> Image.Image:
    """series: values at x = 0, 1, 2, ...; points: (x, value) pairs on the same axes, drawn as dots joined by a
    line (validation loss at its steps)."""
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = 48, 24, width - 12, height - 24
    draw.rectangle((left, top, right, bottom), outline=AXIS)
    values = [v for line, _ in series for v in line] + [v for _, v in (points[0] if points else [])]
    draw.text((left, 4), title, fill=(230, 230, 230))
    if not values:
        draw.text((left + 8, top + 8), "no data yet", fill=AXIS)
        return image
    lo, hi = min(values), max(values)
    hi = hi if hi > lo else lo + 1e-9
    draw.text((4, top), f"{hi:.3g}", fill=AXIS)
    draw.text((4, bottom - 10), f"{lo:.3g}", fill=AXIS)
    n = max(max([len(line) for line, _ in series] + [x + 1 for x, _ in (points[0] if points else [])]) - 1, 1)
    place = lambda x, v: (left + (right - left) * x / n, bottom - (bottom - top) * (v - lo) / (hi - lo))  # noqa: E731
    for line, colour in series:
        xy = [place(i, v) for i, v in enumerate(line)]
        if len(xy) == 1:
            xy = xy * 2
        if xy:
            draw.line(xy, fill=colour, width=2 if colour == SMOOTH else 1)
    if points and points[0]:
        xy = [place(x, v) for x, v in points[0]]
        if len(xy) > 1:
            draw.line(xy, fill=points[1], width=1)
        for x, y in xy:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=points[1])
    return image


def loss_chart(losses: list[float], title: str = "loss", validation: list[tuple[int, float]] = ()) -> Image.Image:
    """The training loss per step (raw and smoothed); `validation`: (step, held-out loss) drawn as green dots on
    the same axes, its last value in the title."""
    label = f"{title}  step {len(losses)}" + (f"  last {losses[-1]:.4f}" if losses else "")
    finite = [(step, value) for step, value in validation if value == value]  # a NaN evaluation has no place
    if finite:
        label += f"  validation (green) {finite[-1][1]:.4f}"
    return line_chart([(losses, RAW), (_smooth(losses), SMOOTH)], label,
                      points=([(step - 1, value) for step, value in finite], VALIDATION) if finite else None)


def bar_chart(bars: list[tuple[str, float, float]], title: str, width: int = 512) -> Image.Image:
    """bars: (label, used, total) drawn as filled fractions."""
    height = 36 + 34 * max(len(bars), 1)
    image = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.text((8, 6), title, fill=(230, 230, 230))
    for i, (label, used, total) in enumerate(bars):
        y = 30 + 34 * i
        draw.text((8, y), label, fill=(220, 220, 220))
        draw.rectangle((8, y + 14, width - 8, y + 28), outline=AXIS)
        if total > 0:
            fill = int((width - 16) * min(used / total, 1.0))
            draw.rectangle((8, y + 14, 8 + fill, y + 28), fill=RAW if used / total < 0.9 else (220, 80, 60))
    return image
