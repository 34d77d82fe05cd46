"""One line plot for the benchmarks, drawn with PIL alone (no plotting library in the dependencies).

``line_plot(series, path, x_label=..., y_label=...)``: ``series`` maps a name to its points ``(x, y)`` or
``(x, y, label)``; each series is a polyline in x order with its points marked (and labelled), in ``colors[name]``.
"""

from __future__ import annotations

from pathlib import Path


def line_plot(series: dict[str, list[tuple]], path: Path, *, x_label: str, y_label: str,
              colors: dict[str, tuple[int, int, int]], x_range: tuple[float, float] | None = None,
              y_range: tuple[float, float] | None = None, width: int = 680, height: int = 440) -> None:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = 60, width - 120, 20, height - 50
    xs = [p[0] for points in series.values() for p in points]
    ys = [p[1] for points in series.values() for p in points]
    x_lo, x_hi = x_range or (min(xs) - 0.05 * (max(xs) - min(xs) or 1), max(xs) + 0.05 * (max(xs) - min(xs) or 1))
    y_lo, y_hi = y_range or (min(ys) - 0.05 * (max(ys) - min(ys) or 1), max(ys) + 0.05 * (max(ys) - min(ys) or 1))

    def at(x, y):
        return (left + (x - x_lo) / (x_hi - x_lo) * (right - left), bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top))

    draw.rectangle([left, top, right, bottom], outline=(0, 0, 0))
    for i in range(5):
        y = y_lo + i * (y_hi - y_lo) / 4
        draw.text((5, at(x_lo, y)[1] - 6), f"{y:.2f}", fill=(0, 0, 0))
        x = x_lo + i * (x_hi - x_lo) / 4
        draw.text((at(x, y_lo)[0] - 12, bottom + 5), f"{x:.2f}" if x_hi - x_lo < 10 else f"{x:.0f}", fill=(0, 0, 0))
    draw.text(((left + right) / 2 - 4 * len(x_label), height - 25), x_label, fill=(0, 0, 0))
    draw.text((5, 2), y_label, fill=(0, 0, 0))
    for index, (name, points) in enumerate(series.items()):
        color = colors.get(name, (0, 0, 0))
        ordered = sorted(points, key=lambda p: p[0])
        pixels = [at(p[0], p[1]) for p in ordered]
        if len(pixels) > 1:
            draw.line(pixels, fill=color, width=2)
        for (px, py), point in zip(pixels, ordered):
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=color)
            if len(point) > 2 and point[2]:
                draw.text((px + 4, py - 12), str(point[2]), fill=color)
        draw.line([right + 10, top + 12 + 18 * index, right + 30, top + 12 + 18 * index], fill=color, width=3)
        draw.text((right + 35, top + 6 + 18 * index), name, fill=(0, 0, 0))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
