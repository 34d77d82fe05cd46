"""A differentiable surrogate of the toy verifier's partial-credit reward (registered as ``toy_geneval_soft``).

The verifier (``flowalign.toy.reward``) detects connected components and applies GenEval's rules: exact, but without
a gradient. Guidance by reward gradients (RGS on ``x0_hat``, docs/design/math.md#guided-sampling) needs a reward whose
gradient says which
pixels to change, so this one replaces each discrete step by a smooth one:

* **Shape per pixel**: ``p_s(u)``, the probability that pixel ``u`` belongs to a shape of class ``s``, from the
  ``ShapeSegmenter`` (``flowalign.toy.segmenter``).
* **Colour per pixel**: ``q_k(u) = softmax_k(-|rgb(u) - palette_k|^2 / (2 tau^2))`` over the six palette colours
  (RGB in 0-255, ``tau`` = 30).
* **Soft counts**: the mass of a clause's class (and colour) divided by the mean pixel area ``A_s`` of one shape of
  that class at the sampled sizes, ``n(s, k) = sum_u p_s(u) q_k(u) / A_s`` (``q`` left out when the clause names no
  colour).

One unit per clause, as in the verifier's partial credit (each include and exclude clause counts once):

* include ``(s, count c, colour k?)``: ``min(n(s, k) / c, 1)``;
* include with ``position (rel, g)``: that, times group ``g``'s own include unit, times
  ``sigmoid((d - m) / w)`` where ``d`` is the offset of the clause's mass centroid from group ``g``'s along the
  relation's direction (x for left/right, y for above/below, positive when the relation holds), ``m`` = 2 px and
  ``w`` = 1 px;
* exclude ``(s, count c)``: ``clamp(c + 1/2 - n(s), 0, 1)``, 1 up to ``c - 1/2`` objects' worth of mass, 0 from
  ``c + 1/2``.

The reward is the mean of the units, in [0, 1], like the verifier's partial credit, which it approximates (it counts
mass, not separated objects, and has no detector confidence). It is meant for guidance: the final choice among
samples, and every reported accuracy, still come from the exact verifier.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from flowalign.evaluation.geneval import validate_metadata, validate_metadata_batch

from .scenes import COLORS, MAX_SHAPE_SIZE, MIN_SHAPE_SIZE, PALETTE, SHAPES, Shape, shape_mask
from .segmenter import ShapeSegmenter, load_segmenter

__all__ = ["SoftToyGenEval", "shape_area"]

COLOR_TEMPERATURE = 30.0
POSITION_MARGIN_PX = 2.0
POSITION_WIDTH_PX = 1.0
_PALETTE = torch.tensor([PALETTE[c] for c in COLORS], dtype=torch.float32)  # [6, 3] in 0-255
# Direction of each relation: (axis, sign); axis 0 = x, 1 = y (y grows downward).
_DIRECTIONS = {"left of": (0, -1.0), "right of": (0, 1.0), "above": (1, -1.0), "below": (1, 1.0)}


@lru_cache(maxsize=None)
def shape_area(kind: str) -> float:
    """Mean pixel area of a rendered ``kind`` over the sampled sizes (pixel-aligned, as ``scene_for`` draws them)."""
    areas = [shape_mask(Shape(kind, COLORS[0], 16.0 if s % 2 == 0 else 16.5, 16.0 if s % 2 == 0 else 16.5,
                              float(s))).sum() for s in range(MIN_SHAPE_SIZE, MAX_SHAPE_SIZE + 1)]
    return float(np.mean(areas))


class SoftToyGenEval:
    """``reward(images [B, 3, H, W] in [0, 1], prompts, metadata) -> [B]``, differentiable in ``images``."""

    reads_geneval_metadata = True  # scores a prompt by its GenEval metadata (tag, include clauses)
    differentiable = True

    def __init__(self, segmenter: ShapeSegmenter | str | None = None, color_temperature: float = COLOR_TEMPERATURE):
        self.segmenter = segmenter if isinstance(segmenter, ShapeSegmenter) else load_segmenter(segmenter)
        self.segmenter.requires_grad_(False).eval()
        self.color_temperature = float(color_temperature)
        self.name = "toy_geneval_soft"

    def check_inputs(self, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> None:
        """The reward protocol's input check (``flowalign.rewards``): every image needs its prompt's GenEval
        metadata; a bad entry is a ``RewardInputError`` naming ``metadata[i]`` and the field."""
        validate_metadata_batch(metadata)

    def __repr__(self) -> str:
        return f"SoftToyGenEval(color_temperature={self.color_temperature:g})"

    def maps(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Per-pixel shape probabilities ``[B, 3, H, W]`` (order ``SHAPES``) and colour probabilities ``[B, 6, H, W]``
        (order ``COLORS``)."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got shape {tuple(images.shape)}")
        device = self.device
        images = images.float().to(device)
        shapes = self.segmenter.probabilities(images)[:, 1:]  # channel 0 is the background
        rgb = images * 255.0
        palette = _PALETTE.to(device)[None, :, :, None, None]  # [1, 6, 3, 1, 1]
        dist2 = (rgb[:, None] - palette).pow(2).sum(dim=2)  # [B, 6, H, W]
        colors = (-dist2 / (2 * self.color_temperature**2)).softmax(dim=1)
        return shapes, colors

    @property
    def device(self) -> torch.device:
        """Where the segmenter runs (``flowalign.rewards.differentiable_score`` moves images here)."""
        return next(self.segmenter.parameters()).device

    def forward(self, images: Tensor, prompts: Sequence[str] | None, metadata: Sequence[dict]) -> Tensor:
        """The differentiable entry point of ``flowalign.rewards``: scores ``[B]`` keeping the graph to ``images``."""
        if metadata is None or len(metadata) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {0 if metadata is None else len(metadata)} metadata "
                             "entries (toy_geneval_soft scores each image against its prompt's GenEval metadata)")
        shapes, colors = self.maps(images)
        return torch.stack([self.units(shapes[b], colors[b], entry).mean() for b, entry in enumerate(metadata)])

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict]) -> Tensor:
        """The same scores; differentiable too when gradients are enabled (``score_all`` disables them)."""
        return self.forward(images, prompts, metadata)

    def units(self, shapes: Tensor, colors: Tensor, entry: dict) -> Tensor:
        """The clause units of one image (module docstring): ``[n_include + n_exclude]``."""
        validate_metadata(entry)
        height, width = shapes.shape[-2:]
        ys = torch.arange(height, device=shapes.device, dtype=shapes.dtype)[:, None] + 0.5
        xs = torch.arange(width, device=shapes.device, dtype=shapes.dtype)[None, :] + 0.5

        def weights(clause: dict) -> Tensor:
            mass = shapes[SHAPES.index(clause["class"])]
            return mass * colors[COLORS.index(clause["color"])] if "color" in clause else mass

        include_units, centroids = [], []
        for clause in entry["include"]:
            w = weights(clause)
            count = w.sum() / shape_area(clause["class"])
            include_units.append((count / clause["count"]).clamp(max=1.0))
            total = w.sum().clamp_min(1e-6)
            centroids.append(torch.stack([(w * xs).sum() / total, (w * ys).sum() / total]))
        units = []
        for index, clause in enumerate(entry["include"]):
            unit = include_units[index]
            if "position" in clause:
                relation, target = clause["position"]
                axis, sign = _DIRECTIONS[relation]
                offset = sign * (centroids[index][axis] - centroids[target][axis])
                unit = unit * include_units[target] * torch.sigmoid((offset - POSITION_MARGIN_PX) / POSITION_WIDTH_PX)
            units.append(unit)
        for clause in entry.get("exclude", []):
            count = shapes[SHAPES.index(clause["class"])].sum() / shape_area(clause["class"])
            units.append((clause["count"] + 0.5 - count).clamp(0.0, 1.0))
        return torch.stack(units)

