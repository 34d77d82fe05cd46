"""Classical object detector for the toy world, with GenEval-format output.

``detect(image)`` finds flat palette-coloured shapes on a grey canvas and returns
``{class_name: [{"box": (x1, y1, x2, y2), "score": s, "color": name}, ...]}`` for the classes in
:data:`flowalign.toy.scenes.SHAPES`, ready for :func:`flowalign.evaluation.geneval.judge`.

Recipe
------
1. Colour quantisation: every pixel goes to its nearest palette colour when the RGB (Euclidean)
   distance is below ``COLOR_RADIUS`` = 90 *and* the pixel is nearer to that colour than to the
   grey background, otherwise to the background. The background competes as a class of its own:
   a decoded image blends each shape's edge into the grey, and without that test the blend pixels
   of a colour close to grey (purple is 116 from it) join the shape as a ragged fringe that turns
   squares into "circles".
2. Blobs: 8-connected components of each colour's mask (``scipy.ndimage.label``), holes filled,
   blobs smaller than ``max(4 px, 0.4 % of the canvas)`` dropped.
3. Class from the fill ratio ``f = area / bbox area`` and the top-half mass share ``t`` (share of
   the blob's pixels in the upper half of its box; the middle row of an odd box counts half):
   ``f > 0.88`` square; ``f < 0.62``, or ``f < 0.72`` with ``t < 0.38``, triangle (apex up puts
   only a quarter of the mass in the top half); otherwise circle. Clean renders: squares 1.0,
   circles 0.75-0.81 with ``t = 0.5``, triangles 0.50-0.57 with ``t`` 0.25-0.31.
4. Box ``(x1, y1, x2 + 1, y2 + 1)`` in pixels (exclusive ends); colour = the majority palette colour
   of the blob's pixels.

Score (confidence in (0, 1]) is the product of five factors, each 1 for a clean render:

* ``shape``  = ``0.5 + 0.5 * min(1, m / 0.04)``, with ``m`` the distance of ``(f, t)`` from the
  nearest decision boundary of step 3 (Euclidean in the (f, t) plane). A blob on a boundary is a
  coin flip (0.5); clean shapes sit at least 0.068 away.
* ``size``   = ``min(1, area / A_full)`` with ``A_full = max(16, 2 % of the canvas)`` px (20.5 px at
  32x32; the smallest sampled toy shape, a 7 px triangle, has 25 px), so specks of a few pixels,
  as noise produces, stay below GenEval's 0.3 threshold.
* ``solid``  = raw pixels / filled area: 1 minus the share of the blob that was a hole.
* ``colour`` = 1 while the blob's mean distance to its exact palette colour is at most 40, then
  falling linearly to 0.5 at the edge of the colour radius (90). Generated images never hit the
  palette exactly: a soft but unambiguous colour is not a reason for doubt.
* ``ragged`` = ``min(1, 1.6 / r)`` with ``r = boundary edges / (4 * sqrt(area))`` (1.0 for a
  square, about 1.1 for a disc and 1.3-1.5 for a clean triangle); frayed outlines raise ``r``.

Clean renders therefore score 1.0, above GenEval's 0.9 counting threshold, while blotchy or noisy
generated blobs get proportionally lower scores.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import ndimage

from flowalign.toy.scenes import BACKGROUND, PALETTE, SHAPES

__all__ = ["COLOR_RADIUS", "detect", "detect_batch", "quantize", "classify"]

COLOR_RADIUS = 90.0
MIN_AREA_PX = 4
MIN_AREA_FRACTION = 0.004
SQUARE_ABOVE = 0.88
TRIANGLE_BELOW = 0.62
TRIANGLE_BELOW_IF_BOTTOM_HEAVY = 0.72
TOP_SHARE_BELOW = 0.38
SHAPE_MARGIN_FULL = 0.04
COLOR_DISTANCE_FULL = 40.0
FULL_AREA_PX = 16
FULL_AREA_FRACTION = 0.02
RAGGED_FULL = 1.6

_COLOR_NAMES = tuple(PALETTE)
_PALETTE_RGB = np.asarray([PALETTE[c] for c in _COLOR_NAMES], dtype=np.float32)  # (K, 3)
_BACKGROUND_RGB = np.asarray(BACKGROUND, dtype=np.float32)
_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)


def quantize(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest-palette assignment of an (H, W, 3) uint8 image.

    Returns ``(labels, distance)``: ``labels`` (H, W) int with the palette index (order of
    ``PALETTE``) or -1 for background, and the RGB distance to that palette colour. A pixel is
    background when it is at least ``COLOR_RADIUS`` from every palette colour or no farther from the
    background grey than from its nearest palette colour.
    """
    pixels = image.astype(np.float32)
    dist = np.linalg.norm(pixels[:, :, None, :] - _PALETTE_RGB[None, None], axis=-1)  # (H, W, K)
    nearest = dist.argmin(axis=-1)
    nearest_dist = np.take_along_axis(dist, nearest[..., None], axis=-1)[..., 0]
    to_background = np.linalg.norm(pixels - _BACKGROUND_RGB, axis=-1)
    labels = np.where((nearest_dist < COLOR_RADIUS) & (nearest_dist < to_background), nearest, -1)
    return labels, nearest_dist


def _top_share(mask: np.ndarray) -> float:
    """Share of the mask's pixels in the upper half of its (tight) box; a middle row counts half."""
    h = mask.shape[0]
    row_mass = mask.sum(axis=1).astype(np.float64)
    centres = np.arange(h) + 0.5
    weight = np.where(centres < h / 2.0, 1.0, np.where(centres == h / 2.0, 0.5, 0.0))
    total = row_mass.sum()
    return float((row_mass * weight).sum() / total) if total else 0.5


def classify(fill: float, top: float) -> tuple[str, float]:
    """Class of a blob from fill ratio and top-half share, with the distance to the nearest boundary.

    The decision regions in the (fill, top) plane are:
    square ``fill > 0.88``; triangle ``fill < 0.62`` or (``fill < 0.72`` and ``top < 0.38``);
    circle otherwise. The margin is the Euclidean distance to the other regions.
    """
    if fill > SQUARE_ABOVE:
        return "square", fill - SQUARE_ABOVE
    if fill < TRIANGLE_BELOW or (fill < TRIANGLE_BELOW_IF_BOTTOM_HEAVY and top < TOP_SHARE_BELOW):
        # Distance to the circle region {fill >= 0.72} U {fill >= 0.62 and top >= 0.38}.
        to_wide = TRIANGLE_BELOW_IF_BOTTOM_HEAVY - fill
        to_corner = math.hypot(max(TRIANGLE_BELOW - fill, 0.0), max(TOP_SHARE_BELOW - top, 0.0))
        return "triangle", min(to_wide, to_corner)
    # Circle: distance to the square region and to the triangle region.
    to_square = SQUARE_ABOVE - fill
    to_low = fill - TRIANGLE_BELOW
    to_notch = math.hypot(
        max(fill - TRIANGLE_BELOW_IF_BOTTOM_HEAVY, 0.0), max(top - TOP_SHARE_BELOW, 0.0)
    )
    return "circle", min(to_square, to_low, to_notch)


def _boundary_ratio(mask: np.ndarray, area: int) -> float:
    """4-neighbour boundary edges over ``4 * sqrt(area)`` (1.0 for a perfect square)."""
    padded = np.pad(mask, 1)
    edges = np.count_nonzero(padded[1:, :] != padded[:-1, :]) + np.count_nonzero(
        padded[:, 1:] != padded[:, :-1]
    )
    return edges / (4.0 * math.sqrt(area))


def detect(image: np.ndarray) -> dict[str, list[dict[str, Any]]]:
    """Detect toy shapes in an (H, W, 3) uint8 RGB image; GenEval-format detections.

    Every class of ``SHAPES`` is a key (possibly with an empty list); each class's detections are
    sorted by descending score. See the module docstring for the recipe and the score.
    """
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"detect expects an (H, W, 3) image, got shape {image.shape}")
    if image.dtype != np.uint8:
        raise ValueError(f"detect expects uint8 pixels, got {image.dtype}; use detect_batch for floats")
    height, width = image.shape[:2]
    canvas = height * width
    min_area = max(MIN_AREA_PX, MIN_AREA_FRACTION * canvas)
    full_area = max(FULL_AREA_PX, FULL_AREA_FRACTION * canvas)
    labels, distance = quantize(image)

    found: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SHAPES}
    for color_index in range(len(_COLOR_NAMES)):
        color_mask = labels == color_index
        if not color_mask.any():
            continue
        components, _ = ndimage.label(color_mask, structure=_EIGHT_CONNECTED)
        for comp_id, slc in enumerate(ndimage.find_objects(components), start=1):
            if slc is None:
                continue
            raw = components[slc] == comp_id
            filled = ndimage.binary_fill_holes(raw)
            area = int(filled.sum())
            if area < min_area:
                continue
            # Box of the filled blob (equal to the crop: filling never extends the box).
            rows = np.flatnonzero(filled.any(axis=1))
            cols = np.flatnonzero(filled.any(axis=0))
            y1, y2 = slc[0].start + int(rows[0]), slc[0].start + int(rows[-1])
            x1, x2 = slc[1].start + int(cols[0]), slc[1].start + int(cols[-1])
            tight = filled[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
            fill = area / float(tight.size)
            top = _top_share(tight)
            kind, margin = classify(fill, top)

            # Colour: majority palette colour over the blob's pixels (holes included).
            blob_labels = labels[slc][filled]
            blob_labels = blob_labels[blob_labels >= 0]
            majority = int(np.bincount(blob_labels, minlength=len(_COLOR_NAMES)).argmax())
            mean_dist = float(distance[slc][raw].mean())

            c_shape = 0.5 + 0.5 * min(1.0, margin / SHAPE_MARGIN_FULL)
            c_size = min(1.0, area / full_area)
            c_solid = float(raw.sum()) / area
            excess = max(0.0, min(mean_dist, COLOR_RADIUS) - COLOR_DISTANCE_FULL)
            c_color = 1.0 - 0.5 * excess / (COLOR_RADIUS - COLOR_DISTANCE_FULL)
            c_ragged = min(1.0, RAGGED_FULL / _boundary_ratio(tight, area))
            score = float(np.clip(c_shape * c_size * c_solid * c_color * c_ragged, 0.0, 1.0))

            found[kind].append(
                {
                    "box": (x1, y1, x2 + 1, y2 + 1),
                    "score": score,
                    "color": _COLOR_NAMES[majority],
                }
            )
    for kind in found:
        found[kind].sort(key=lambda d: d["score"], reverse=True)
    return found


def _to_uint8_hwc(images: Any) -> np.ndarray:
    """(B, 3, H, W) or (B, H, W, 3) floats in [0, 1] (numpy or torch) -> (B, H, W, 3) uint8."""
    if hasattr(images, "detach"):  # torch tensor, without importing torch here
        images = images.detach().float().cpu().numpy()
    arr = np.asarray(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ValueError(f"detect_batch expects (B, 3, H, W) or (B, H, W, 3), got shape {arr.shape}")
    if arr.shape[1] == 3 and arr.shape[-1] != 3:
        arr = np.transpose(arr, (0, 2, 3, 1))
    elif arr.shape[-1] != 3:
        raise ValueError(f"detect_batch expects 3 colour channels, got shape {arr.shape}")
    if arr.dtype == np.uint8:
        return arr
    arr = np.nan_to_num(arr.astype(np.float32), nan=0.0)
    return np.clip(np.rint(arr * 255.0), 0, 255).astype(np.uint8)


def detect_batch(images: Any) -> list[dict[str, list[dict[str, Any]]]]:
    """Run :func:`detect` on a batch of float images in [0, 1].

    Accepts numpy arrays or torch tensors shaped (B, 3, H, W) or (B, H, W, 3) (channels-first is
    assumed when both the second and last dimensions are 3); uint8 batches are used as they are.
    """
    return [detect(image) for image in _to_uint8_hwc(images)]
