"""Toy world: 32x32 RGB images of flat coloured shapes on a grey canvas.

The toy world is the CPU stand-in for a text-to-image model's output space. A scene is a list of
:class:`Shape` objects; :func:`render` rasterises it with hard edges (a pixel belongs to a shape when
its centre lies inside the shape), and :func:`scene_for` draws a random scene that satisfies a
GenEval metadata entry, so that ``judge(metadata, detect(render(scene)))`` holds.

Geometry conventions
--------------------
* Coordinates are in pixels, x to the right, y downwards (pixel ``(row, col)`` has its centre at
  ``(col + 0.5, row + 0.5)``).
* ``Shape.size`` is the diameter of a circle, the side of a square, and both the base width and the
  height of a triangle. Triangles are upright: apex at the top centre, base at the bottom.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flowalign.evaluation.geneval import relative_position

__all__ = [
    "PALETTE",
    "COLORS",
    "BACKGROUND",
    "SHAPES",
    "IMAGE_SIZE",
    "MIN_SHAPE_SIZE",
    "MAX_SHAPE_SIZE",
    "Shape",
    "shape_mask",
    "shape_box",
    "render",
    "scene_for",
    "SceneError",
]

# Six colours far apart in RGB (every pair is more than 140 apart, and every colour more than 110
# from the background), so nearest-colour assignment with a 90 radius is unambiguous.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (170, 40, 190),
    "white": (245, 245, 245),
}
COLORS: tuple[str, ...] = tuple(PALETTE)
BACKGROUND: tuple[int, int, int] = (128, 128, 128)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
IMAGE_SIZE = 32

# Shape sizes (whole pixels) for sampled scenes. Sampled shapes sit on pixel-aligned boxes
# (``cx - size/2`` is an integer), where every size in 9-13 px has a fill ratio far inside its class
# band: squares 1.0, circles 0.75-0.80, triangles 0.50-0.56 (see the detector). Free sub-pixel
# placement makes small discs look octagonal or square-ish, so it is not used for sampling.
# Shapes of 9-13 px span 2-3 of the toy transformer's 4x4-pixel patches: at 7-11 px the pre-trained
# model drew squares and triangles as rounded blobs (a requested shape was right in 41% of held-out
# color_attr images against 69% for a requested colour).
MIN_SHAPE_SIZE = 9
MAX_SHAPE_SIZE = 13
CIRCLE_INSET = 0.1

# Smallest empty gap between the bounding boxes of two objects, in pixels (at least 1 px is needed
# for 8-connected components not to merge; 2 keeps a margin).
OBJECT_GAP = 2
# Objects keep at least this many pixels from the image border.
BORDER = 1
# Tries for one scene: each try resamples sizes and positions of all objects, and each object gets
# up to PLACEMENT_TRIES random positions that keep clear of the objects already placed.
MAX_TRIES = 2000
PLACEMENT_TRIES = 30


class SceneError(RuntimeError):
    """Raised when no scene satisfying the metadata could be placed."""


@dataclass
class Shape:
    """One flat shape. ``cx, cy`` is the centre of its bounding square, ``size`` its extent in px."""

    kind: str
    color: str
    cx: float
    cy: float
    size: float

    def __post_init__(self) -> None:
        if self.kind not in SHAPES:
            raise ValueError(f"unknown shape kind {self.kind!r}; expected one of {SHAPES}")
        if self.color not in PALETTE:
            raise ValueError(f"unknown colour {self.color!r}; expected one of {COLORS}")
        if not self.size > 0:
            raise ValueError(f"shape size must be positive, got {self.size}")


def shape_mask(shape: Shape, size: int = IMAGE_SIZE) -> np.ndarray:
    """Boolean (size, size) mask of the pixels whose centres lie inside ``shape``."""
    coords = np.arange(size, dtype=np.float64) + 0.5
    x = coords[None, :]
    y = coords[:, None]
    half = shape.size / 2.0
    dx = x - shape.cx
    dy = y - shape.cy
    if shape.kind == "circle":
        # Radius inset by 0.1 px: at integer diameters on a pixel-aligned box this keeps the four
        # extreme pixels while rounding off the corners, so discs of 7-12 px have fill ratios of
        # 0.75-0.82 (a plain d/2 radius gives 0.85-0.89 at some diameters, too close to squares).
        r = max(half - CIRCLE_INSET, 0.0)
        return dx * dx + dy * dy <= r * r
    if shape.kind == "square":
        return (np.abs(dx) < half) & (np.abs(dy) < half)
    # Upright triangle: apex (cx, cy - half), base corners (cx -/+ half, cy + half). At height
    # t in [0, 1] below the apex the half-width is t * half.
    t = (dy + half) / shape.size
    return (t >= 0.0) & (t < 1.0) & (np.abs(dx) <= t * half)


def _mask_box(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    if rows.size == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def shape_box(shape: Shape, size: int = IMAGE_SIZE) -> tuple[int, int, int, int] | None:
    """Pixel box ``(x1, y1, x2, y2)`` (exclusive ends) of the rendered shape, None if it is empty."""
    return _mask_box(shape_mask(shape, size))


def render(shapes: list[Shape] | tuple[Shape, ...], size: int = IMAGE_SIZE) -> np.ndarray:
    """Rasterise ``shapes`` in order (later ones on top) onto the grey background.

    Returns a ``(size, size, 3)`` uint8 array. No anti-aliasing: every pixel is either the
    background or exactly one palette colour.
    """
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[...] = np.asarray(BACKGROUND, dtype=np.uint8)
    for shape in shapes:
        image[shape_mask(shape, size)] = np.asarray(PALETTE[shape.color], dtype=np.uint8)
    return image


# --------------------------------------------------------------------------------------------------
# Scene sampling
# --------------------------------------------------------------------------------------------------


def _relation_holds_with_margin(rel: str, box_a, box_b) -> bool:
    """True when GenEval's ``rel`` (A relative to B) holds robustly for these pixel boxes.

    Robustness: the relation must hold under GenEval's own ``relative_position`` for every shift of
    box A by up to 1 px along each axis combined with growing or shrinking either box by 1 px on
    every side, so a detector whose boxes are off by a pixel still agrees.
    """
    ax1, ay1, ax2, ay2 = box_a
    bx1, by1, bx2, by2 = box_b
    for sx in (-1, 0, 1):
        for sy in (-1, 0, 1):
            for ga in (-1, 0, 1):
                a = (ax1 + sx - ga, ay1 + sy - ga, ax2 + sx + ga, ay2 + sy + ga)
                for gb in (-1, 0, 1):
                    b = (bx1 - gb, by1 - gb, bx2 + gb, by2 + gb)
                    if rel not in relative_position(a, b):
                        return False
    return True


def _plan_objects(metadata: dict, rng: np.random.Generator) -> tuple[list[tuple[str, str]], list]:
    """Objects to draw (kind, colour) and position constraints (rel, idx_a list, idx_b list)."""
    include = metadata.get("include") or []
    if not include:
        raise SceneError(f"metadata has no include clause: {metadata!r}")
    objects: list[tuple[str, str]] = []
    groups: list[list[int]] = []
    for req in include:
        kind = req["class"]
        if kind not in SHAPES:
            raise SceneError(f"class {kind!r} is not a toy shape {SHAPES}")
        count = int(req.get("count", 1))
        if count < 1:
            raise SceneError(f"include count must be >= 1, got {count}")
        color = req.get("color")
        if color is not None and color not in PALETTE:
            raise SceneError(f"colour {color!r} is not in the toy palette {COLORS}")
        idx = []
        for _ in range(count):
            c = color if color is not None else COLORS[int(rng.integers(len(COLORS)))]
            idx.append(len(objects))
            objects.append((kind, c))
        groups.append(idx)
    # Excludes: the plan draws exactly the included counts, so an exclude is only violated when it
    # asks for fewer objects of a class than the include clause needs.
    for req in metadata.get("exclude") or []:
        have = sum(1 for kind, _ in objects if kind == req["class"])
        if have >= int(req["count"]):
            raise SceneError(f"include and exclude clauses contradict each other: {metadata!r}")
    relations = []
    for gi, req in enumerate(include):
        if req.get("position"):
            rel, target = req["position"]
            if not 0 <= int(target) < len(groups) or int(target) == gi:
                raise SceneError(f"bad position target {target!r} in {metadata!r}")
            relations.append((rel, groups[gi], groups[int(target)]))
    return objects, relations


@lru_cache(maxsize=None)
def _aligned_extent(kind: str, s: int) -> tuple[int, int, int, int]:
    """Rendered box of a ``kind`` of whole-pixel size ``s`` whose square starts at pixel (0, 0).

    Pixel-aligned shapes rasterise the same wherever they sit, so one render gives the box offsets.
    """
    box = shape_box(Shape(kind, COLORS[0], s / 2.0, s / 2.0, float(s)), size=s)
    assert box is not None
    return box


def _separated(box_a, box_b, gap: int) -> bool:
    return (
        box_a[2] + gap <= box_b[0]
        or box_b[2] + gap <= box_a[0]
        or box_a[3] + gap <= box_b[1]
        or box_b[3] + gap <= box_a[1]
    )


def scene_for(metadata: dict, rng: np.random.Generator, size: int = IMAGE_SIZE) -> list[Shape]:
    """A random scene of ``size`` x ``size`` pixels that satisfies the GenEval ``metadata``.

    Draws exactly the included objects (the right classes, counts and colours; random palette
    colours where the metadata names none), with random whole-pixel sizes in
    ``[MIN_SHAPE_SIZE, MAX_SHAPE_SIZE]`` (the upper end shrinks for crowded scenes), at random
    pixel-aligned positions, with bounding boxes at least ``OBJECT_GAP`` px apart and ``BORDER`` px from
    the edge. Position clauses must hold under GenEval's rule with a 1 px margin. Rejection
    sampling with ``MAX_TRIES`` tries; raises :class:`SceneError` when nothing fits.
    """
    objects, relations = _plan_objects(metadata, rng)
    n = len(objects)
    usable = size - 2 * BORDER
    # Quick infeasibility check: n boxes of the smallest size plus gaps cannot cover more area
    # than the usable canvas (plus one gap).
    if n * (MIN_SHAPE_SIZE + OBJECT_GAP) ** 2 > (usable + OBJECT_GAP) ** 2:
        raise SceneError(
            f"{n} objects of at least {MIN_SHAPE_SIZE} px cannot fit on a {size}x{size} canvas "
            f"({metadata.get('prompt', metadata)!r})"
        )
    # Crowded scenes: cap the size so that n objects fit in a grid with gaps.
    per_row = math.ceil(math.sqrt(n))
    cap = (usable - (per_row - 1) * OBJECT_GAP) / per_row - 1.0
    hi = int(max(MIN_SHAPE_SIZE, min(MAX_SHAPE_SIZE, math.floor(cap))))
    for _ in range(MAX_TRIES):
        shapes: list[Shape] = []
        boxes: list[tuple[int, int, int, int]] = []
        for kind, color in objects:
            for _ in range(PLACEMENT_TRIES):
                s = int(rng.integers(MIN_SHAPE_SIZE, hi + 1))
                top_left_max = size - BORDER - s
                if top_left_max < BORDER:
                    break
                x0 = int(rng.integers(BORDER, top_left_max + 1))
                y0 = int(rng.integers(BORDER, top_left_max + 1))
                ex1, ey1, ex2, ey2 = _aligned_extent(kind, s)
                box = (x0 + ex1, y0 + ey1, x0 + ex2, y0 + ey2)
                if all(_separated(box, other, OBJECT_GAP) for other in boxes):
                    shapes.append(Shape(kind, color, x0 + s / 2.0, y0 + s / 2.0, float(s)))
                    boxes.append(box)
                    break
            else:
                break
        if len(shapes) < n:
            continue
        if all(
            _relation_holds_with_margin(rel, boxes[i], boxes[j])
            for rel, group_a, group_b in relations
            for i in group_a
            for j in group_b
        ):
            return shapes
    raise SceneError(
        f"could not place a scene for {metadata.get('prompt', metadata)!r} on a {size}x{size} canvas "
        f"in {MAX_TRIES} tries ({n} objects, sizes {MIN_SHAPE_SIZE}-{hi} px)"
    )
