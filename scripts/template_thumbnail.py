"""Draw the template browser's thumbnails, one small JPEG beside each example_workflows/leanlora_*.json.

    .venv/bin/python scripts/template_thumbnail.py      # writes example_workflows/leanlora_*.jpg

ComfyUI's frontend shows a custom node's template with /api/workflow_templates/<pack>/<name>.jpg beside it.
"""
from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FOLDER = Path(__file__).resolve().parents[1] / "example_workflows"
SIZE = (512, 384)
BACKGROUND, BOX, ACCENT, TEXT = (24, 26, 32), (52, 58, 72), (120, 200, 120), (230, 232, 236)


def _box(draw: ImageDraw.ImageDraw, xy: tuple[int, int, int, int], label: str, font, colour=BOX) -> None:
    draw.rounded_rectangle(xy, radius=8, fill=colour)
    x0, y0, x1, y1 = xy
    draw.multiline_text(((x0 + x1) / 2, (y0 + y1) / 2), label, fill=TEXT, font=font, anchor="mm", align="center")


def _arrow(draw: ImageDraw.ImageDraw, start: tuple[int, int], end: tuple[int, int]) -> None:
    draw.line([start, end], fill=ACCENT, width=3)
    angle = math.atan2(end[1] - start[1], end[0] - start[0])
    head = [(end[0] - 10 * math.cos(angle + s), end[1] - 10 * math.sin(angle + s)) for s in (0.5, -0.5)]
    draw.polygon([end, *head], fill=ACCENT)


# template name -> (title, the three input boxes, the two output boxes)
TEMPLATES = {
    "leanlora_train_then_generate": ("LeanLoRA: train, then generate",
                                     ("your checkpoint", "your images\n+ captions", "card: auto\n+ LoRA shape"),
                                     ("with LoRA", "without")),
    "leanlora_train_with_samples": ("LeanLoRA: train with samples",
                                    ("your checkpoint", "your images\n+ captions", "sample prompts\nevery N steps"),
                                    ("samples\nby step", "with LoRA")),
    "leanlora_continue_training": ("LeanLoRA: continue a LoRA",
                                   ("your checkpoint", "new images\n+ captions", "your LoRA\n(continue from)"),
                                   ("LoRA, more\nsteps", "with LoRA")),
    **{f"leanlora_{family}_train_then_generate": (f"LeanLoRA: {title}, train + generate",
                                                  (f"your {title}\nfiles", "your images\n+ captions",
                                                   "card: auto\n+ LoRA shape"), ("with LoRA", "models/loras"))
       for family, title in (("z_image", "Z-Image"), ("flux_dev", "FLUX.1-dev"), ("chroma", "Chroma"),
                             ("flux2_klein", "FLUX.2 klein"), ("qwen_image", "Qwen-Image"), ("wan", "Wan 2.1"),
                             ("anima", "Anima"), ("krea2", "Krea 2"))},
    # its name is too long for the families' title above (the image is 512 wide)
    "leanlora_hunyuan_image_train_then_generate": ("LeanLoRA: HunyuanImage 2.1",
                                                   ("your HunyuanImage\nfiles", "your images\n+ captions",
                                                    "card: auto\n+ LoRA shape"), ("with LoRA", "models/loras")),
    "leanlora_qwen_image_edit_train_then_edit": ("LeanLoRA: Qwen-Image-Edit, pairs",
                                                 ("your Qwen-Image-\nEdit files", "before/after\npairs",
                                                  "card: auto\n+ LoRA shape"), ("your image,\nedited", "models/loras")),
}


def render(title_text: str = "LeanLoRA: train, then generate",
           inputs=("your checkpoint", "your images\n+ captions", "card: auto\n+ LoRA shape"),
           outputs=("with LoRA", "without")) -> Image.Image:
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    title, body = ImageFont.load_default(28), ImageFont.load_default(17)
    draw.text((24, 20), title_text, fill=TEXT, font=title)
    for y, label in zip((80, 160, 240), inputs):
        _box(draw, (24, y, 184, y + 60), label, body)
    _box(draw, (230, 150, 350, 230), "LeanLoRA\nTrain", body, colour=(60, 110, 70))
    _box(draw, (392, 90, 496, 150), outputs[0], body)
    _box(draw, (392, 230, 496, 290), outputs[1], body)
    for y in (110, 190, 270):
        _arrow(draw, (184, y), (228, 190))
    _arrow(draw, (350, 180), (390, 120))
    draw.line([(150, 80), (150, 66), (372, 66), (372, 260)], fill=ACCENT, width=3)  # the base model, around Train
    _arrow(draw, (372, 260), (390, 260))
    # a falling loss curve under the Train box
    points = [(230 + i * 6, 340 - 40 * math.exp(-i / 5) + 4 * math.sin(i * 1.7)) for i in range(21)]
    draw.line(points, fill=ACCENT, width=2)
    draw.text((230, 352), "loss", fill=TEXT, font=body)
    return image


def main() -> None:
    for name, (title, inputs, outputs) in TEMPLATES.items():
        out = FOLDER / f"{name}.jpg"
        render(title, inputs, outputs).save(out, quality=85, optimize=True)
        print(f"{out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
