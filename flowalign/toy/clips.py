"""The toy video world's clips: the toy world's shapes moving across the grey canvas, frame by frame.

A clip is a scene of :class:`~flowalign.toy.scenes.Shape` objects at frame 0 and one pixel offset per frame that every
object of the clip shares (they move together, so objects apart at frame 0 stay apart). Each frame is rendered by the
image world's :func:`~flowalign.toy.scenes.render`, so a frame of a clip is exactly a toy image: the detector and
GenEval's rules read it as they read the image world's renders.

Motion
------
``DIRECTIONS`` maps a direction to the sign of the displacement per frame, ``(x, y)`` in pixels with x to the right
and y downwards (the image world's convention): ``left (-1, 0)``, ``right (1, 0)``, ``up (0, -1)``, ``down (0, 1)``,
``still (0, 0)``. A moving clip travels ``travel`` whole pixels between its first and last frame, ``TRAVEL_RANGE`` =
8-12 px, and frame ``t`` of ``F`` sits at ``round(t * travel / (F - 1))`` pixels along the direction: positions stay
on whole pixels (the image world's shapes are pixel-aligned, so every frame rasterises the same shape) and never move
back. At 5 frames that is 2-3 px a frame.

Scene sampling (:func:`clip_for`) draws what the prompt asks (class, count, colour) at the image world's sizes
(``MIN_SHAPE_SIZE``-``MAX_SHAPE_SIZE``) so that the whole path of every object stays ``BORDER`` px inside the canvas
and the objects' boxes stay ``OBJECT_GAP`` px apart, by rejection sampling as :func:`~flowalign.toy.scenes.scene_for`
does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flowalign.toy.scenes import (BORDER, COLORS, IMAGE_SIZE, MAX_SHAPE_SIZE, MIN_SHAPE_SIZE, OBJECT_GAP, PALETTE,
                                  SHAPES, SceneError, Shape, _aligned_extent, _separated, render)

__all__ = [
    "DIRECTIONS",
    "NUM_FRAMES",
    "TRAVEL_RANGE",
    "Clip",
    "clip_for",
    "clips_tensor",
    "motion_offsets",
    "render_clip",
]

DIRECTIONS: dict[str, tuple[int, int]] = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
    "still": (0, 0),
}
# Pixel frames of a toy clip: 4k + 1 for the causal video VAEs that compress time 4x (Wan: 5 frames = 2 latent frames).
NUM_FRAMES = 5
# Whole pixels a moving clip travels from its first to its last frame (inclusive range).
TRAVEL_RANGE = (8, 12)
MAX_TRIES = 2000
PLACEMENT_TRIES = 30


def _check_frames(num_frames: int) -> None:
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 2:
        raise ValueError(f"a toy clip needs num_frames >= 2 (motion is read between frames), got {num_frames!r}")


def motion_offsets(direction: str, travel: int, num_frames: int = NUM_FRAMES) -> tuple[tuple[int, int], ...]:
    """Per-frame ``(dx, dy)`` pixel offsets from frame 0: ``round(t * travel / (F - 1))`` along ``direction``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {tuple(DIRECTIONS)}")
    _check_frames(num_frames)
    ux, uy = DIRECTIONS[direction]
    steps = [round(t * travel / (num_frames - 1)) for t in range(num_frames)]
    return tuple((ux * s, uy * s) for s in steps)


@dataclass(frozen=True)
class Clip:
    """Shapes at frame 0 and the offset ``(dx, dy)`` of every shape at each frame (``offsets[0] == (0, 0)``)."""

    shapes: tuple[Shape, ...]
    offsets: tuple[tuple[int, int], ...]
    direction: str

    @property
    def num_frames(self) -> int:
        return len(self.offsets)

    def frame(self, t: int) -> list[Shape]:
        """The shapes of frame ``t``."""
        dx, dy = self.offsets[t]
        return [Shape(s.kind, s.color, s.cx + dx, s.cy + dy, s.size) for s in self.shapes]


def render_clip(clip: Clip, size: int = IMAGE_SIZE) -> np.ndarray:
    """The clip's frames ``(F, size, size, 3)`` uint8, each one :func:`~flowalign.toy.scenes.render` of its shapes."""
    return np.stack([render(clip.frame(t), size) for t in range(clip.num_frames)])


def clips_tensor(clips: list[Clip] | tuple[Clip, ...], size: int = IMAGE_SIZE) -> torch.Tensor:
    """Decoded-video layout of rendered clips: float32 ``[B, F, 3, H, W]`` in [0, 1]."""
    frames = np.stack([render_clip(clip, size) for clip in clips])
    return torch.from_numpy(frames).permute(0, 1, 4, 2, 3).float() / 255.0


def _objects(metadata: dict, rng: np.random.Generator) -> list[tuple[str, str]]:
    """(kind, colour) of every object the metadata's include clauses ask for (random colours where none is named)."""
    objects = []
    for clause in metadata.get("include") or []:
        kind, color = clause["class"], clause.get("color")
        if kind not in SHAPES:
            raise SceneError(f"class {kind!r} is not a toy shape {SHAPES}")
        if color is not None and color not in PALETTE:
            raise SceneError(f"colour {color!r} is not in the toy palette {COLORS}")
        for _ in range(int(clause.get("count", 1))):
            objects.append((kind, color if color is not None else COLORS[int(rng.integers(len(COLORS)))]))
    if not objects:
        raise SceneError(f"metadata has no include clause: {metadata!r}")
    return objects


def clip_for(metadata: dict, rng: np.random.Generator, num_frames: int = NUM_FRAMES,
             size: int = IMAGE_SIZE) -> Clip:
    """A random clip of ``num_frames`` frames that satisfies a toy video prompt's metadata (module docstring).

    ``metadata["direction"]`` (one of ``DIRECTIONS``) is the motion of every object; the include clauses give the
    objects. Raises :class:`~flowalign.toy.scenes.SceneError` when nothing fits in ``MAX_TRIES`` tries.
    """
    direction = metadata.get("direction")
    if direction not in DIRECTIONS:
        raise SceneError(f"metadata needs a direction in {tuple(DIRECTIONS)}, got {direction!r}")
    _check_frames(num_frames)
    objects = _objects(metadata, rng)
    n = len(objects)
    per_row = math.ceil(math.sqrt(n))
    cap = (size - 2 * BORDER - (per_row - 1) * OBJECT_GAP) / per_row - 1.0
    hi = int(max(MIN_SHAPE_SIZE, min(MAX_SHAPE_SIZE, math.floor(cap))))
    for _ in range(MAX_TRIES):
        travel = 0 if direction == "still" else int(rng.integers(TRAVEL_RANGE[0], TRAVEL_RANGE[1] + 1))
        offsets = motion_offsets(direction, travel, num_frames)
        low = (min(dx for dx, _ in offsets), min(dy for _, dy in offsets))
        high = (max(dx for dx, _ in offsets), max(dy for _, dy in offsets))
        shapes: list[Shape] = []
        boxes: list[tuple[int, int, int, int]] = []
        for kind, color in objects:
            for _ in range(PLACEMENT_TRIES):
                s = int(rng.integers(MIN_SHAPE_SIZE, hi + 1))
                # Top-left corners whose whole path keeps BORDER px inside the canvas.
                x_range = (BORDER - low[0], size - BORDER - s - high[0])
                y_range = (BORDER - low[1], size - BORDER - s - high[1])
                if x_range[1] < x_range[0] or y_range[1] < y_range[0]:
                    break
                x0 = int(rng.integers(x_range[0], x_range[1] + 1))
                y0 = int(rng.integers(y_range[0], y_range[1] + 1))
                ex1, ey1, ex2, ey2 = _aligned_extent(kind, s)
                box = (x0 + ex1, y0 + ey1, x0 + ex2, y0 + ey2)
                if all(_separated(box, other, OBJECT_GAP) for other in boxes):
                    shapes.append(Shape(kind, color, x0 + s / 2.0, y0 + s / 2.0, float(s)))
                    boxes.append(box)
                    break
            else:
                break
        if len(shapes) == n:
            return Clip(tuple(shapes), offsets, direction)
    raise SceneError(
        f"could not place a clip for {metadata.get('prompt', metadata)!r} ({n} objects moving {direction}) on a "
        f"{size}x{size} canvas in {MAX_TRIES} tries"
    )
