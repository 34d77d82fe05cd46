"""Images of known text, drawn with PIL in a TrueType font: the ground truth the OCR reward is measured against
(``bench/ocr_agreement.py``, the OCR tests).

``render_text(text, size=512, font_px=48)`` draws ``text`` in black on a white ``size x size`` square, centred and
wrapped greedily at spaces to 90% of the width, and returns ``[3, size, size]`` float32 in [0, 1], the layout of the
images a reward scores. The font is DejaVu Sans (``dejavu_font()``): matplotlib's copy (``mpl-data/fonts/ttf``, the
bench extra), else the system's (``/usr/share/fonts``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["SYSTEM_FONT_DIRS", "dejavu_font", "render_text"]

SYSTEM_FONT_DIRS = ("/usr/share/fonts/truetype/dejavu", "/usr/share/fonts/TTF", "/usr/share/fonts/dejavu")


def dejavu_font(name: str = "DejaVuSans.ttf") -> Path:
    """The path of the DejaVu font ``name``: matplotlib's copy (found without importing it), else the system's; a
    FileNotFoundError naming both places otherwise."""
    places = []
    spec = importlib.util.find_spec("matplotlib")
    if spec is not None and spec.origin is not None:
        places.append(Path(spec.origin).parent / "mpl-data" / "fonts" / "ttf")
    places.extend(Path(folder) for folder in SYSTEM_FONT_DIRS)
    for folder in places:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"font {name} not found in {', '.join(map(str, places))}: install matplotlib (pip install "
                            "-e '.[bench]') or the DejaVu fonts")


def _wrap(text: str, font, width: float) -> list[str]:
    lines: list[str] = []
    for word in text.split(" "):
        candidate = f"{lines[-1]} {word}" if lines else word
        if lines and font.getlength(candidate) <= width:
            lines[-1] = candidate
        else:
            lines.append(word)
    return lines


def render_text(text: str, *, size: int = 512, font_px: int = 48, font: str | Path | None = None) -> Tensor:
    """``text`` drawn black on white, centred, wrapped at spaces to 90% of ``size``: ``[3, size, size]`` in [0, 1].

    Args:
        text: what to draw (one line per ``\\n``-free paragraph; wrapped at spaces).
        size: the square image's side in pixels.
        font_px: the font size in pixels (PIL's ``truetype`` size).
        font: a TrueType file; default DejaVu Sans (``dejavu_font``).

    Returns:
        A float32 tensor ``[3, size, size]`` with values in [0, 1].
    """
    from PIL import Image, ImageDraw, ImageFont

    face = ImageFont.truetype(str(font or dejavu_font()), font_px)
    lines = _wrap(text, face, 0.9 * size)
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    ascent, descent = face.getmetrics()
    step = int(1.2 * (ascent + descent))
    top = (size - step * len(lines)) // 2
    for index, line in enumerate(lines):
        draw.text(((size - face.getlength(line)) / 2, top + index * step), line, fill=(0, 0, 0), font=face)
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
