"""A motion score from classical optical flow (OpenCV; no weights): how far a video's content moves per frame.

For consecutive frames ``x_j, x_{j+1}`` of a video ``[F, 3, H, W]`` in [0, 1], each turned to 8-bit grey
(``0.299 R + 0.587 G + 0.114 B``, OpenCV's weights), the dense flow ``u_j [H, W, 2]`` (pixels, x right, y down) comes
from OpenCV's DIS (``method: dis``, Kroeger et al. 2016, its ``medium`` preset by default) or Farneback
(``method: farneback``, Farneback 2003, OpenCV's usual parameters). The score is

    magnitude (direction None):  1 / (F - 1) sum_j mean_pixels ||u_j|| / max(H, W)
    direction d (a 2-vector):    1 / (F - 1) sum_j mean_pixels (u_j . d / ||d||) / max(H, W)

the mean displacement per frame as a fraction of the frame's longer side: 0 for a still clip, ``s / max(H, W)`` for
content that all moves ``s`` pixels a frame; the signed variant rewards motion along ``d`` (``[1, 0]``: to the right,
``[0, -1]``: up) and penalises motion against it. Not differentiable (OpenCV works on numpy arrays); a video needs at
least two frames.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from flowalign.errors import RewardInputError

__all__ = ["METHODS", "MotionScore", "optical_flow"]

METHODS = ("dis", "farneback")
DIS_PRESETS = ("ultrafast", "fast", "medium")


def _grey(frame: Tensor) -> np.ndarray:
    """``[3, H, W]`` in [0, 1] as an 8-bit grey ``[H, W]`` array."""
    weights = torch.tensor([0.299, 0.587, 0.114], dtype=torch.float32).view(3, 1, 1)
    grey = (frame.detach().float().cpu().clamp(0, 1) * weights).sum(0)
    return (grey * 255).round().to(torch.uint8).numpy()


def optical_flow(first: Tensor, second: Tensor, method: str = "dis", preset: str = "medium") -> np.ndarray:
    """The dense flow ``[H, W, 2]`` (pixels; x right, y down) from frame ``first`` to ``second`` (``[3, H, W]`` in
    [0, 1]) by OpenCV's ``method`` (module docstring)."""
    import cv2

    a, b = _grey(first), _grey(second)
    if method == "dis":
        flow = cv2.DISOpticalFlow_create(getattr(cv2, f"DISOPTICAL_FLOW_PRESET_{preset.upper()}")).calc(a, b, None)
    elif method == "farneback":
        flow = cv2.calcOpticalFlowFarneback(a, b, None, pyr_scale=0.5, levels=3, winsize=15, iterations=3, poly_n=5,
                                            poly_sigma=1.2, flags=0)
    else:
        raise ValueError(f"optical flow method must be one of {', '.join(METHODS)}, got {method!r}")
    return flow


class MotionScore:
    """The ``motion`` video reward (module docstring). Settings: ``method`` (``dis`` or ``farneback``), ``preset``
    (DIS's ``ultrafast``, ``fast`` or ``medium``), ``direction`` (None: the magnitude; ``[dx, dy]``: the signed
    motion along it)."""

    name = "motion"
    modality = "video"

    def __init__(self, method: str = "dis", preset: str = "medium", direction: list[float] | None = None):
        if method not in METHODS:
            raise ValueError(f"motion method must be one of {', '.join(METHODS)}, got {method!r}")
        if preset not in DIS_PRESETS:
            raise ValueError(f"motion preset must be one of {', '.join(DIS_PRESETS)} (DIS's), got {preset!r}")
        if direction is not None:
            if (not isinstance(direction, (list, tuple)) or len(direction) != 2 or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in direction)
                    or math.hypot(*direction) == 0):
                raise ValueError(f"motion direction must be a non-zero [dx, dy] (x right, y down), got {direction!r}")
            norm = math.hypot(*direction)
            direction = (direction[0] / norm, direction[1] / norm)
        self.method, self.preset, self.direction = method, preset, direction
        self.score_range = (0.0, math.inf) if direction is None else (-math.inf, math.inf)

    def clip_score(self, video: Tensor) -> float:
        """The score of one video ``[F, 3, H, W]`` (F >= 2)."""
        frames, _, height, width = video.shape
        total = 0.0
        for j in range(frames - 1):
            flow = optical_flow(video[j], video[j + 1], self.method, self.preset).astype(np.float64)
            if self.direction is None:
                per_pixel = np.hypot(flow[..., 0], flow[..., 1])
            else:
                per_pixel = flow[..., 0] * self.direction[0] + flow[..., 1] * self.direction[1]
            total += float(per_pixel.mean())
        return total / (frames - 1) / max(height, width)

    def __call__(self, videos: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` float32 of videos ``[B, F, 3, H, W]`` in [0, 1]."""
        if not isinstance(videos, Tensor) or videos.dim() != 5 or videos.shape[2] != 3:
            shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
            raise RewardInputError(f"reward 'motion' scores videos [B, F, 3, H, W], got {shape}")
        if videos.shape[1] < 2:
            raise RewardInputError(f"reward 'motion' measures motion between frames: a video needs at least two, got "
                                   f"{videos.shape[1]}")
        return torch.tensor([self.clip_score(video) for video in videos], dtype=torch.float32)

    def __repr__(self) -> str:
        return f"MotionScore(method={self.method!r}, direction={self.direction})"
