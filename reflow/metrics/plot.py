"""Small PNG charts for the simulator's reports, drawn with Pillow (already installed with vLLM)."""

from __future__ import annotations

from PIL import Image, ImageDraw

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _frame(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], title: str) -> None:
    x0, y0, x1, y1 = box
    draw.rectangle(box, outline=(0, 0, 0))
    draw.text((x0, y0 - 14), title, fill=(0, 0, 0))


def bars(draw: ImageDraw.ImageDraw, box, title: str, groups: dict[str, dict[str, float]], top: float) -> None:
    """Grouped bars: groups[group][series] = value, on a 0..top axis."""
    _frame(draw, box, title)
    x0, y0, x1, y1 = box
    names = list(groups)
    series = list(next(iter(groups.values()))) if groups else []
    slot = (x1 - x0) / max(len(names), 1)
    width = slot * 0.8 / max(len(series), 1)
    for g, name in enumerate(names):
        for k, label in enumerate(series):
            value = groups[name][label]
            left = x0 + g * slot + slot * 0.1 + k * width
            height = (y1 - y0 - 4) * min(value / top, 1.0) if top > 0 else 0
            draw.rectangle((left, y1 - height, left + width - 1, y1), fill=COLORS[k % len(COLORS)])
        draw.text((x0 + g * slot + 4, y1 + 4), name, fill=(0, 0, 0))
    for k, label in enumerate(series):
        draw.rectangle((x1 + 8, y0 + 14 * k, x1 + 18, y0 + 14 * k + 10), fill=COLORS[k % len(COLORS)])
        draw.text((x1 + 22, y0 + 14 * k - 1), label, fill=(0, 0, 0))


def steps_line(draw: ImageDraw.ImageDraw, box, title: str, lines: dict[str, list[tuple[float, float]]], top: float) -> None:
    """Step lines: lines[label] = [(x, y)], x in 0..1 of the box, y on 0..top."""
    _frame(draw, box, title)
    x0, y0, x1, y1 = box
    for k, (label, points) in enumerate(lines.items()):
        color = COLORS[k % len(COLORS)]
        previous = None
        for x, y in points:
            px = x0 + x * (x1 - x0)
            py = y1 - (y1 - y0 - 4) * min(y / top, 1.0)
            if previous is not None:
                draw.line((previous[0], previous[1], px, previous[1]), fill=color, width=2)
                draw.line((px, previous[1], px, py), fill=color, width=2)
            previous = (px, py)
        draw.text((x1 + 8, y0 + 14 * k), label, fill=color)


def new_canvas(width: int, height: int) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (width, height), (255, 255, 255))
    return image, ImageDraw.Draw(image)
