"""An image reward scored over a video's frames, and which frames of a clip are read.

A video is ``[B, F, 3, H, W]`` in [0, 1] (docs: video conventions). ``FrameAggregation`` says how an image reward
becomes a video reward (the config's ``reward.rewards[i].frames``):

* ``every: k`` (default 1) reads frames ``0, k, 2k, ...``; ``count: n`` reads ``n`` evenly spaced frames, the first and
  the last included (``frame_indices``); at most one of the two.
* ``aggregate``: ``mean`` (the mean over the frames read), ``min`` (the worst frame), or ``weights``: ``sum_j w_j s_j``
  with the listed ``weights`` divided by their sum (non-negative, a positive sum); there must be one weight per frame
  read, else ``RewardInputError`` naming the counts.

``FrameReward(reward, aggregation)`` is that video reward (``modality = "video"``): it scores the frames read of every
video in one call of the image reward (each frame carries its video's prompt and metadata) and aggregates them per
video. A groupwise image reward is called once per frame position with that frame of every video of the group. A
non-finite frame score makes the video's score non-finite (mean, weights) or is taken as the worst (min: NaN
propagates), so the sample is counted invalid, never scored on part of its frames. When the image reward has the
differentiable entry point ``forward``, so has the wrapper (``DifferentiableFrameReward``): the gradient reaches every
frame read (``min`` passes it to the worst frame only).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from flowalign.errors import RewardInputError

__all__ = ["AGGREGATES", "DifferentiableFrameReward", "FrameAggregation", "FrameReward", "frame_indices",
           "over_frames", "parse_frames", "video_batch"]

AGGREGATES = ("mean", "min", "weights")
SETTINGS = ("aggregate", "weights", "every", "count")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class FrameAggregation:
    """How an image reward scores a video (module docstring)."""

    aggregate: str = "mean"
    weights: tuple[float, ...] | None = None
    every: int = 1
    count: int | None = None

    def indices(self, frames: int) -> list[int]:
        """The frames read of a clip of ``frames`` frames."""
        return frame_indices(frames, every=self.every, count=self.count)

    def combine(self, scores: Tensor) -> Tensor:
        """``[B]`` from the per-frame ``scores [B, F']`` of the frames read."""
        if self.aggregate == "mean":
            return scores.mean(dim=1)
        if self.aggregate == "min":
            return scores.amin(dim=1) if not torch.isnan(scores).any() else _nan_min(scores)
        weights = torch.tensor(self.weights, dtype=scores.dtype, device=scores.device)
        if weights.numel() != scores.shape[1]:
            raise RewardInputError(
                f"frames.weights has {weights.numel()} weights but {scores.shape[1]} frames are scored "
                f"(every: {self.every}, count: {self.count}): give one weight per frame read")
        return scores @ (weights / weights.sum())


def _nan_min(scores: Tensor) -> Tensor:
    """The row minimum, NaN where a row holds a NaN (``amin`` would pick either)."""
    return torch.where(torch.isnan(scores).any(dim=1), torch.full_like(scores[:, 0], math.nan),
                       scores.nan_to_num(math.inf).amin(dim=1))


def frame_indices(frames: int, *, every: int = 1, count: int | None = None) -> list[int]:
    """The frames read of a clip of ``frames`` frames: ``0, every, 2 every, ...``; or, with ``count``, ``count``
    evenly spaced frames from the first to the last (``round(j (F - 1) / (count - 1))``; the first frame alone for
    ``count`` 1; every frame when ``count >= F``)."""
    if frames < 1:
        raise RewardInputError(f"a video must hold at least one frame, got {frames}")
    if count is None:
        return list(range(0, frames, every))
    if count >= frames:
        return list(range(frames))
    if count == 1:
        return [0]
    return [round(j * (frames - 1) / (count - 1)) for j in range(count)]


def parse_frames(value: Any, key: str) -> FrameAggregation:
    """A ``frames`` setting (a mapping, as in a config) as a ``FrameAggregation``; a ``ConfigError`` naming ``key``
    (and the sub-key) and the fix for every mistake. Runs before anything is built."""
    from flowalign.config import ConfigError

    if isinstance(value, FrameAggregation):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a mapping such as {{aggregate: mean}} (keys: {', '.join(SETTINGS)}), got "
                          f"{value!r}", key=key)
    unknown = sorted(set(value) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a frames setting; known: {', '.join(SETTINGS)}",
                          key=f"{key}.{unknown[0]}")
    weights = value.get("weights")
    aggregate = value.get("aggregate", "weights" if weights is not None else "mean")
    if aggregate not in AGGREGATES:
        raise ConfigError(f"{key}.aggregate must be one of {', '.join(AGGREGATES)}, got {aggregate!r}",
                          key=f"{key}.aggregate")
    if aggregate == "weights":
        if not isinstance(weights, (list, tuple)) or not weights or not all(
                isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
                for w in weights) or not sum(weights) > 0:
            raise ConfigError(f"{key}.weights must be a non-empty list of finite numbers >= 0 with a positive sum "
                              f"(one per frame read; they are divided by their sum), got {weights!r}",
                              key=f"{key}.weights")
        weights = tuple(float(w) for w in weights)
    elif weights is not None:
        raise ConfigError(f"{key}.weights is set but {key}.aggregate is {aggregate!r}: use aggregate: weights (or "
                          "drop weights)", key=f"{key}.weights")
    every, count = value.get("every", 1), value.get("count")
    if not _positive_int(every):
        raise ConfigError(f"{key}.every must be an integer >= 1 (read every k-th frame), got {every!r}",
                          key=f"{key}.every")
    if count is not None and not _positive_int(count):
        raise ConfigError(f"{key}.count must be an integer >= 1 (read that many evenly spaced frames), got {count!r}",
                          key=f"{key}.count")
    if count is not None and every != 1:
        raise ConfigError(f"{key}.every and {key}.count both choose the frames read: set one of them",
                          key=f"{key}.count")
    if weights is not None and count is not None and len(weights) != count:
        raise ConfigError(f"{key}.weights has {len(weights)} weights for {key}.count = {count} frames: give one "
                          "weight per frame read", key=f"{key}.weights")
    return FrameAggregation(aggregate=aggregate, weights=weights, every=every, count=count)


def video_batch(videos: Any, name: str) -> Tensor:
    """``videos`` as ``[B, F, 3, H, W]`` float in [0, 1]; ``RewardInputError`` naming the reward for another shape."""
    if not isinstance(videos, Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
        raise RewardInputError(f"reward {name!r} scores videos [B, F, 3, H, W] in [0, 1], got {shape}")
    if videos.shape[1] < 1:
        raise RewardInputError(f"reward {name!r}: a video must hold at least one frame")
    return videos.float() if videos.dtype != torch.uint8 else videos.float() / 255.0


class FrameReward:
    """An image reward scored over a video's frames (module docstring); ``name`` and ``score_range`` are the image
    reward's."""

    modality = "video"

    def __init__(self, reward: Any, aggregation: FrameAggregation):
        self.reward, self.aggregation = reward, aggregation
        self.name = getattr(reward, "name", type(reward).__name__)
        self.groupwise = bool(getattr(reward, "groupwise", False))
        if getattr(reward, "score_range", None) is not None:
            self.score_range = reward.score_range

    def __repr__(self) -> str:
        return f"FrameReward({self.reward!r}, {self.aggregation})"

    @property
    def device(self):
        """The image reward's device (``flowalign.rewards.differentiable_score`` moves the videos there)."""
        return getattr(self.reward, "device", None)

    def _score(self, score, videos: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> Tensor:
        videos = video_batch(videos, self.name)
        batch, frames = videos.shape[:2]
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(f"reward {self.name!r}: got {batch} videos, {len(prompts)} prompts and {len(metadata)} "
                             "metadata entries")
        picked = self.aggregation.indices(frames)
        if self.aggregation.weights is not None and len(self.aggregation.weights) != len(picked):
            raise RewardInputError(
                f"frames.weights has {len(self.aggregation.weights)} weights but a video of {frames} frames has "
                f"{len(picked)} frames read (every: {self.aggregation.every}, count: {self.aggregation.count}): give "
                "one weight per frame read")
        chosen = videos[:, picked]  # [B, F', 3, H, W]
        if self.groupwise:  # frame j of every video of the group, together
            columns = [torch.as_tensor(score(chosen[:, j], prompts, metadata), dtype=torch.float32).flatten()
                       for j in range(len(picked))]
            per_frame = torch.stack([c.to(videos.device) for c in columns], dim=1)
        else:
            flat = chosen.reshape(batch * len(picked), *chosen.shape[2:])
            out = score(flat, [p for p in prompts for _ in picked], [m for m in metadata for _ in picked])
            per_frame = torch.as_tensor(out, dtype=torch.float32).flatten().to(videos.device)
            if per_frame.numel() != batch * len(picked):
                raise ValueError(f"reward {self.name!r} returned {per_frame.numel()} scores for "
                                 f"{batch * len(picked)} frames")
            per_frame = per_frame.reshape(batch, len(picked))
        return self.aggregation.combine(per_frame)

    def __call__(self, videos: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` float32 of ``videos [B, F, 3, H, W]``, without gradients."""
        with torch.no_grad():
            return self._score(self.reward, videos, prompts, metadata).float()

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if callable(close):
            close()


class DifferentiableFrameReward(FrameReward):
    """A ``FrameReward`` whose image reward has ``forward``: ``forward(videos, prompts, metadata)`` keeps the graph."""

    def forward(self, videos: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` of ``videos [B, F, 3, H, W]``, differentiable in them."""
        return self._score(self.reward.forward, videos, prompts, metadata)


def over_frames(reward: Any, frames: Any, key: str = "frames") -> FrameReward:
    """``reward`` (an image reward) scored over a video's frames as ``frames`` says (a mapping or a
    ``FrameAggregation``; ConfigError naming ``key`` when malformed); differentiable when ``reward`` is."""
    aggregation = parse_frames(frames, key)
    cls = DifferentiableFrameReward if callable(getattr(reward, "forward", None)) else FrameReward
    return cls(reward, aggregation)
