"""The toy video world's exact verifier (registered as the video reward ``toy_video``).

``judge_clip(metadata, frames)`` reads a clip ``[F, 3, H, W]`` in [0, 1] against a toy video prompt
(``flowalign.toy.video_prompts``: GenEval metadata with one include clause ``{class, count, color}``, its exclude
``count + 1``, and a ``direction``). Four checks, each in [0, 1]:

* ``object``: on each frame the image world's detector (``flowalign.toy.detector``) keeps at least one object of the
  class; the check is the share of frames where that holds.
* ``count``: the share of frames with exactly ``count`` kept objects of the class.
* ``color``: the share of frames whose top ``count`` objects of the class all have the colour.
  All three are GenEval's own verdicts (``flowalign.evaluation.geneval.judge``) on one frame, for sub-prompts of the
  entry: ``include [{class, 1}]``; ``include [{class, count}]`` with ``exclude [{class, count + 1}]``;
  ``include [{class, count, color}]``. The entry's tag sets the score threshold (0.9 for counting, else 0.3).
* ``direction`` (0 or 1): the direction of motion from the tracked positions. On every frame the top ``count``
  objects of the class (GenEval's choice: by score) are taken, and linked from frame to frame by the assignment of
  least total distance between box centres (``scipy.optimize.linear_sum_assignment``), giving ``count`` tracks of box
  centres over time. A frame with fewer than ``count`` of them leaves nothing to track: the check fails. A direction
  ``u`` holds when every track travels at least ``MIN_TRAVEL`` px along ``u`` from the first frame to the last, drifts
  across ``u`` by at most half of that, and never steps back along ``u`` by more than ``MAX_STEP_BACK`` px between
  two frames. ``still`` holds when every centre of every frame stays within ``STILL_RADIUS`` px of the track's first
  centre on both axes. The rendered clips travel 8-12 px (``flowalign.toy.clips.TRAVEL_RANGE``), twice
  ``MIN_TRAVEL``; a clip that travels 2-3.5 px is neither still nor moving.

The verdict: ``correct`` when all four checks are 1 (the binary score, and what the evaluations count); ``partial``
= their mean, which is 1 exactly when ``correct``. A rendered clip of the prompt scores 1 (pinned by the tests).

``motion`` (in [0, 1]) grades the direction check (``direction_progress``): for a direction ``u``, each track scores
``clip(along / MIN_TRAVEL) * clip(1 - excess_drift / MIN_TRAVEL) * clip(1 - excess_back / MIN_TRAVEL)``, where the
excesses are how far the drift passes half the travel and the largest step back passes ``MAX_STEP_BACK``; for
``still``, ``clip(2 - spread / STILL_RADIUS)``; the clip takes its worst track, and 0 when nothing can be tracked. It
is 1 exactly when ``direction`` is. ``partial_motion`` is the mean of the three frame checks and ``motion``: a partial
credit whose motion term rises with each pixel travelled the right way, where the binary direction gives no signal
until a clip moves the whole way (the reward's ``motion="graded"``).

The mean pays for each check alone, so a clip whose frames hold a crowd of blobs of the prompt's colour earns the
object and colour checks without a single right frame. ``frames_correct`` is the share of frames on which the three
frame checks hold together; ``joint`` = ``frames_correct * direction`` and ``joint_motion`` = ``frames_correct *
motion`` are partial credits that pay only for right frames, scaled by the motion (the reward's ``credit="joint"``).
Each is 1 exactly when ``correct``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from flowalign.errors import RewardInputError
from flowalign.evaluation.geneval import (COUNTING_SCORE_THRESHOLD, SCORE_THRESHOLD, judge, validate_metadata)
from flowalign.toy.clips import DIRECTIONS
from flowalign.toy.detector import detect_batch

__all__ = ["CHECKS", "CREDITS", "MAX_STEP_BACK", "MIN_TRAVEL", "MOTION_TERMS", "STILL_RADIUS", "ToyVideoReward",
           "judge_clip", "track", "validate_video_metadata", "direction_holds", "direction_progress"]

CHECKS = ("object", "count", "color", "direction")
MIN_TRAVEL = 4.0
MAX_STEP_BACK = 1.0
STILL_RADIUS = 1.5
MOTION_TERMS = ("binary", "graded")  # the partial credit's direction term: the check, or direction_progress
CREDITS = ("mean", "joint")  # the partial credit: the mean of the four checks, or right frames times the motion


def validate_video_metadata(entry: Any, where: str = "<metadata>") -> None:
    """A toy video prompt: valid GenEval metadata with exactly one include clause naming ``class``, ``count`` and
    ``color``, and a ``direction`` in ``DIRECTIONS`` (and, when given, ``motion`` equal to its signs). Raises
    ``RewardInputError`` naming the field."""
    validate_metadata(entry, where)
    include = entry["include"]
    if len(include) != 1 or "color" not in include[0] or "position" in include[0]:
        raise RewardInputError(f"{where}: field 'include': a toy video prompt has one clause {{class, count, color}} "
                               f"(all its objects move together), got {include!r}")
    direction = entry.get("direction")
    if direction not in DIRECTIONS:
        raise RewardInputError(f"{where}: field 'direction': got {direction!r} (expected one of "
                               f"{', '.join(DIRECTIONS)}; the toy video prompts in assets/prompts/video_*.jsonl "
                               "have it)")
    if "motion" in entry and list(entry["motion"]) != list(DIRECTIONS[direction]):
        raise RewardInputError(f"{where}: field 'motion': got {entry['motion']!r}, but direction {direction!r} "
                               f"means {list(DIRECTIONS[direction])}")


def _sub_prompts(metadata: Mapping[str, Any]) -> dict[str, dict]:
    """GenEval sub-metadata whose per-frame verdicts are the checks ``object``, ``count`` and ``color``."""
    clause = metadata["include"][0]
    kind, count = clause["class"], clause["count"]
    base = {"tag": metadata["tag"], "prompt": metadata["prompt"]}
    return {
        "object": {**base, "include": [{"class": kind, "count": 1}]},
        "count": {**base, "include": [{"class": kind, "count": count}],
                  "exclude": [{"class": kind, "count": count + 1}]},
        "color": {**base, "include": [{"class": kind, "count": count, "color": clause["color"]}]},
    }


def _centres(detections: Mapping[str, Sequence[Mapping[str, Any]]], kind: str, count: int,
             threshold: float) -> np.ndarray | None:
    """Box centres ``[count, 2]`` of the top ``count`` kept objects of ``kind`` (GenEval's choice), or None."""
    kept = [d for d in detections.get(kind, []) if d["score"] > threshold]
    kept = sorted(kept, key=lambda d: d["score"], reverse=True)[:count]
    if len(kept) < count:
        return None
    return np.asarray([((d["box"][0] + d["box"][2]) / 2.0, (d["box"][1] + d["box"][3]) / 2.0) for d in kept])


def track(frames_centres: Sequence[np.ndarray]) -> np.ndarray:
    """Tracks ``[N, F, 2]`` from each frame's centres ``[N, 2]``: frame ``t + 1``'s centres are assigned to frame
    ``t``'s tracks by the matching of least total Euclidean distance."""
    tracks = [np.asarray(frames_centres[0], dtype=np.float64)]
    for centres in frames_centres[1:]:
        previous = tracks[-1]
        cost = np.linalg.norm(previous[:, None, :] - np.asarray(centres, dtype=np.float64)[None, :, :], axis=-1)
        rows, cols = linear_sum_assignment(cost)
        tracks.append(np.asarray(centres, dtype=np.float64)[cols[np.argsort(rows)]])
    return np.stack(tracks, axis=1)


def _travel(path: np.ndarray, direction: str) -> tuple[float, float, float]:
    """One track ``[F, 2]``'s ``(along, drift, back)`` for a moving ``direction``: the travel along it from the first
    frame to the last, the distance across it, and the largest step back against it between two frames."""
    u = np.asarray(DIRECTIONS[direction], dtype=np.float64)
    shift = path[-1] - path[0]
    return float(shift @ u), abs(float(shift @ np.asarray([u[1], u[0]]))), float(-(np.diff(path, axis=0) @ u).min())


def _spread(path: np.ndarray) -> float:
    """How far a track ``[F, 2]`` strays from its first centre, on either axis (the ``still`` check)."""
    return float(np.abs(path - path[0]).max())


def direction_holds(tracks: np.ndarray, direction: str) -> tuple[bool, str]:
    """Whether every track ``[F, 2]`` of ``tracks [N, F, 2]`` moves in ``direction`` (module docstring), with the
    reason when not."""
    for index, path in enumerate(tracks):
        if direction == "still":
            spread = _spread(path)
            if spread > STILL_RADIUS:
                return False, f"object {index} moved {spread:.1f} px (still allows {STILL_RADIUS})"
            continue
        along, drift, back = _travel(path, direction)
        if along < MIN_TRAVEL:
            return False, f"object {index} travelled {along:.1f} px {direction} (at least {MIN_TRAVEL} needed)"
        if drift > along / 2:
            return False, f"object {index} drifted {drift:.1f} px across its {along:.1f} px {direction}"
        if back > MAX_STEP_BACK:
            return False, f"object {index} stepped back {back:.1f} px against {direction}"
    return True, ""


def direction_progress(tracks: np.ndarray, direction: str) -> float:
    """How far the tracks ``[N, F, 2]`` go toward moving in ``direction``, in [0, 1] (module docstring): 1 exactly when
    ``direction_holds``; the worst track's score."""
    scores = []
    for path in tracks:
        if direction == "still":
            scores.append(2.0 - _spread(path) / STILL_RADIUS)
            continue
        along, drift, back = _travel(path, direction)
        factors = (along / MIN_TRAVEL, 1.0 - max(0.0, drift - max(along, 0.0) / 2) / MIN_TRAVEL,
                   1.0 - max(0.0, back - MAX_STEP_BACK) / MIN_TRAVEL)
        scores.append(float(np.prod(np.clip(factors, 0.0, 1.0))))
    return float(np.clip(min(scores), 0.0, 1.0))


def judge_clip(metadata: Mapping[str, Any], frame_detections: Sequence[Mapping[str, Sequence[Mapping[str, Any]]]],
               frame_size: tuple[int, int]) -> dict[str, Any]:
    """The verdict of one clip from its frames' detections (module docstring): ``{correct, partial, checks: {object,
    count, color, direction}, motion, partial_motion, frames_correct, joint, joint_motion, tracks: [[[x, y], ...]
    per frame] per object, or None, reason}``; ``frame_size`` is ``(width, height)``."""
    validate_video_metadata(metadata)
    clause = metadata["include"][0]
    threshold = COUNTING_SCORE_THRESHOLD if metadata["tag"] == "counting" else SCORE_THRESHOLD
    reasons = []
    checks: dict[str, float] = {}
    frame_ok = [True] * len(frame_detections)
    for name, sub in _sub_prompts(metadata).items():
        held = [judge(sub, found, frame_size) for found in frame_detections]
        frame_ok = [all_ok and ok for all_ok, (ok, _) in zip(frame_ok, held)]
        checks[name] = sum(ok for ok, _ in held) / len(held)
        failed = [t for t, (ok, _) in enumerate(held) if not ok]
        if failed:
            reasons.append(f"{name} fails on frame(s) {failed}: {held[failed[0]][1]}")
    centres = [_centres(found, clause["class"], clause["count"], threshold) for found in frame_detections]
    tracks, motion = None, 0.0
    if any(c is None for c in centres):
        missing = [t for t, c in enumerate(centres) if c is None]
        checks["direction"] = 0.0
        reasons.append(f"direction: fewer than {clause['count']} {clause['class']} to track on frame(s) {missing}")
    else:
        paths = track(centres)
        tracks = paths.tolist()
        ok, why = direction_holds(paths, metadata["direction"])
        checks["direction"] = float(ok)
        motion = direction_progress(paths, metadata["direction"])
        if not ok:
            reasons.append(f"direction: {why}")
    partial = sum(checks.values()) / len(checks)
    partial_motion = (checks["object"] + checks["count"] + checks["color"] + motion) / len(checks)
    frames_correct = sum(frame_ok) / len(frame_ok)
    return {"correct": partial == 1.0, "partial": partial, "checks": checks, "motion": motion,
            "partial_motion": partial_motion, "frames_correct": frames_correct,
            "joint": frames_correct * checks["direction"], "joint_motion": frames_correct * motion, "tracks": tracks,
            "reason": "\n".join(reasons)}


def _check_videos(videos: Tensor) -> None:
    if not isinstance(videos, Tensor) or videos.ndim != 5 or videos.shape[2] != 3 or videos.shape[1] < 2:
        shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
        raise ValueError(f"toy_video scores videos [B, F, 3, H, W] with F >= 2 frames, got {shape}")


class ToyVideoReward:
    """The toy video verifier as a reward: binary (``correct``) or with partial credit: ``credit="mean"`` the mean of
    the checks (``partial``, with ``motion="graded"`` ``partial_motion``: the direction term graded by
    ``direction_progress``), ``credit="joint"`` the share of right frames times the motion term (``joint``,
    ``joint_motion``)."""

    modality = "video"  # scores decoded videos [B, F, 3, H, W]
    reads_geneval_metadata = True  # scores a prompt by its metadata (tag, include, direction)

    def __init__(self, partial_credit: bool = False, motion: str = "binary", credit: str = "mean") -> None:
        for key, value, allowed in (("motion", motion, MOTION_TERMS), ("credit", credit, CREDITS)):
            if value not in allowed:
                raise RewardInputError(f"toy_video: kwarg {key!r} must be one of {', '.join(allowed)}, got {value!r}")
        if (motion, credit) != ("binary", "mean") and not partial_credit:
            raise RewardInputError(f"toy_video: kwargs 'motion: {motion}' and 'credit: {credit}' shape the partial "
                                   "credit; set 'partial_credit: true' with them (the binary score has no terms)")
        self.partial_credit = bool(partial_credit)
        self.motion = motion
        self.credit = credit
        self.name = "toy_video"

    def __repr__(self) -> str:
        return f"ToyVideoReward(partial_credit={self.partial_credit}, motion={self.motion!r}, credit={self.credit!r})"

    def check_inputs(self, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> None:
        """Every video needs its toy video prompt's metadata; a bad entry is a ``RewardInputError`` naming
        ``metadata[i]`` and the field."""
        if not isinstance(metadata, Sequence) or isinstance(metadata, (str, bytes)):
            raise RewardInputError(f"metadata: expected a list of toy video entries, got {type(metadata).__name__}")
        for index, entry in enumerate(metadata):
            validate_video_metadata(entry, f"metadata[{index}]")

    def __call__(self, videos: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """Scores ``[B]`` float32 (on CPU) for ``videos [B, F, 3, H, W]`` in [0, 1]."""
        key = "correct"
        if self.partial_credit:
            key = {"mean": "partial", "joint": "joint"}[self.credit] + ("_motion" if self.motion == "graded" else "")
        return torch.tensor([float(v[key]) for v in self.verdicts(videos, metadata)], dtype=torch.float32)

    def verdicts(self, videos: Tensor, metadata: Sequence[Mapping[str, Any]]) -> list[dict]:
        """One :func:`judge_clip` verdict per video."""
        _check_videos(videos)
        if len(metadata) != videos.shape[0]:
            raise ValueError(f"got {videos.shape[0]} videos but {len(metadata)} metadata entries")
        self.check_inputs([], metadata)
        batch, frames = videos.shape[:2]
        detections = detect_batch(videos.reshape(batch * frames, *videos.shape[2:]))
        size = (int(videos.shape[4]), int(videos.shape[3]))
        return [judge_clip(entry, detections[b * frames:(b + 1) * frames], size) for b, entry in enumerate(metadata)]
