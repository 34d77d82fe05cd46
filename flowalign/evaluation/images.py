"""Image helpers for evaluation outputs: uint8 conversion and captioned PNG grids.

``save_grid`` lays images out row-major, ``columns`` per row. Every cell is the image upscaled ``scale`` times with
nearest-neighbour resampling (so toy 32x32 renders stay crisp), framed by ``PAD`` pixels, with its caption under it in
PIL's default bitmap font, wrapped to the cell width and cut to at most ``CAPTION_LINES`` lines.
"""

from __future__ import annotations

import math
from os import PathLike
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

__all__ = ["CAPTION_LINES", "PAD", "cell_size", "frame_strips", "save_grid", "to_uint8", "wrap_caption"]

PAD = 2
CAPTION_LINES = 3
LINE_SPACING = 1
BACKGROUND = (255, 255, 255)
TEXT_COLOR = (0, 0, 0)
ELLIPSIS = "..."


def to_uint8(images: Any) -> np.ndarray:
    """Images ``[B, 3, H, W]`` (or one ``[3, H, W]``) with values in [0, 1], torch or numpy -> ``[B, H, W, 3]`` uint8.

    Values are clipped to [0, 1] and rounded to the nearest level (NaN -> 0), as the toy detector converts them.
    """
    if hasattr(images, "detach"):  # a torch tensor
        images = images.detach().float().cpu().numpy()
    arr = np.asarray(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[1] != 3:
        raise ValueError(f"expected images shaped [B, 3, H, W] (or [3, H, W]), got shape {arr.shape}")
    arr = np.transpose(arr, (0, 2, 3, 1))
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    arr = np.nan_to_num(arr.astype(np.float32), nan=0.0)
    return np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)


def _font() -> ImageFont.ImageFont:
    """PIL's built-in bitmap font (no FreeType, no font files)."""
    loader = getattr(ImageFont, "load_default_imagefont", None)  # Pillow >= 10.1; load_default() may be FreeType
    return loader() if loader is not None else ImageFont.load_default()


def _line_height(font) -> int:
    left, top, right, bottom = font.getbbox("Ag|y")
    return int(bottom) + LINE_SPACING


def _text_width(font, text: str) -> float:
    return float(font.getlength(text))


def _split_long_word(word: str, width: float, font) -> list[str]:
    """Break one word that is wider than ``width`` into pieces that fit (at least one character each)."""
    pieces, current = [], ""
    for char in word:
        if current and _text_width(font, current + char) > width:
            pieces.append(current)
            current = char
        else:
            current += char
    if current:
        pieces.append(current)
    return pieces


def wrap_caption(text: str, width: float, font=None, max_lines: int = CAPTION_LINES) -> list[str]:
    """Greedy word wrap of ``text`` to ``width`` pixels; beyond ``max_lines`` the last line ends with "..."."""
    font = font or _font()
    lines: list[str] = []
    for paragraph in str(text).splitlines() or [""]:
        current = ""
        for word in paragraph.split():
            pieces = _split_long_word(word, width, font) if _text_width(font, word) > width else [word]
            for piece in pieces:
                candidate = f"{current} {piece}" if current else piece
                if current and _text_width(font, candidate) > width:
                    lines.append(current)
                    current = piece
                else:
                    current = candidate
        lines.append(current)
    if len(lines) <= max_lines:
        return lines
    last = lines[max_lines - 1]
    while last and _text_width(font, last + ELLIPSIS) > width:
        last = last[:-1]
    return lines[: max_lines - 1] + [last.rstrip() + ELLIPSIS]


def cell_size(image_height: int, image_width: int, scale: int = 4) -> tuple[int, int]:
    """``(width, height)`` in pixels of one grid cell: padded upscaled image plus the caption area."""
    caption_height = CAPTION_LINES * _line_height(_font())
    return image_width * scale + 2 * PAD, PAD + image_height * scale + PAD + caption_height + PAD


def frame_strips(videos: Any) -> Any:
    """Videos ``[B, F, 3, H, W]`` (a torch tensor) as images ``[B, 3, H, F W]``: each video's frames side by side,
    left to right."""
    if videos.ndim != 5:
        raise ValueError(f"frame_strips takes videos [B, F, 3, H, W], got shape {tuple(videos.shape)}")
    return videos.permute(0, 2, 3, 1, 4).flatten(3)


def save_grid(
    images: Any,
    captions: Sequence[str],
    path: str | PathLike[str],
    *,
    columns: int = 8,
    scale: int = 4,
) -> Path:
    """Write a PNG grid of ``images`` ``[B, 3, H, W]`` in [0, 1], each captioned underneath; returns the path.

    The grid has ``min(columns, B)`` columns and ``ceil(B / columns)`` rows of ``cell_size(H, W, scale)`` cells.
    """
    pixels = to_uint8(images)
    count = pixels.shape[0]
    if count == 0:
        raise ValueError("save_grid needs at least one image")
    if len(captions) != count:
        raise ValueError(f"save_grid got {count} images but {len(captions)} captions")
    if columns < 1 or scale < 1:
        raise ValueError(f"columns and scale must be >= 1, got columns={columns}, scale={scale}")
    height, width = pixels.shape[1:3]
    cell_w, cell_h = cell_size(height, width, scale)
    ncols = min(columns, count)
    nrows = math.ceil(count / ncols)
    font = _font()
    line_height = _line_height(font)
    text_width = width * scale

    grid = Image.new("RGB", (ncols * cell_w, nrows * cell_h), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    for index in range(count):
        row, col = divmod(index, ncols)
        x0, y0 = col * cell_w + PAD, row * cell_h + PAD
        tile = Image.fromarray(pixels[index])
        if scale != 1:
            tile = tile.resize((width * scale, height * scale), resample=Image.Resampling.NEAREST)
        grid.paste(tile, (x0, y0))
        y_text = y0 + height * scale + PAD
        for line_index, line in enumerate(wrap_caption(captions[index], text_width, font)):
            draw.text((x0, y_text + line_index * line_height), line, fill=TEXT_COLOR, font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path, format="PNG")
    return path
