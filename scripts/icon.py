"""Draw the pack's icon (the registry's and ComfyUI-Manager's picture of it): docs/icon.png, 256 x 256.

    .venv/bin/python scripts/icon.py

A falling loss curve over the two thin matrices of a LoRA (B x A), in the live panel's colours (web/leanlora.js)."""
from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "docs" / "icon.png"
SIZE = 256
SCALE = 4  # drawn large, then downsampled: smooth edges without an antialiasing library
BACKGROUND, PANEL, BLUE, GREEN = (27, 27, 31), (44, 48, 60), (74, 158, 255), (127, 211, 127)


def render() -> Image.Image:
    s = SIZE * SCALE
    image = Image.new("RGBA", (s, s), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, s - 1, s - 1), radius=s // 6, fill=BACKGROUND)
    unit = s / 16
    # B (tall, thin) and A (wide, thin): the low-rank pair a LoRA trains
    draw.rounded_rectangle((2.5 * unit, 3 * unit, 4 * unit, 13 * unit), radius=unit / 3, fill=PANEL)
    draw.rounded_rectangle((5 * unit, 11.5 * unit, 13.5 * unit, 13 * unit), radius=unit / 3, fill=PANEL)
    # the loss falling, as the panel's smoothed line draws it
    points = []
    for i in range(61):
        t = i / 60
        y = 3.0 + 7.0 * (1 - math.exp(-4.0 * t)) + 0.3 * math.sin(9 * t) * (1 - t)  # y grows downwards
        points.append(((5 + 8.5 * t) * unit, y * unit))
    draw.line(points, fill=BLUE, width=int(0.9 * unit), joint="curve")
    x, y = points[-1]
    draw.ellipse((x - 0.8 * unit, y - 0.8 * unit, x + 0.8 * unit, y + 0.8 * unit), fill=GREEN)
    return image.resize((SIZE, SIZE), Image.Resampling.LANCZOS)


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    render().save(OUT, optimize=True)
    print(f"{OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
