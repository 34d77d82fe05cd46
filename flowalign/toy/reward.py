"""The toy world's verifier reward: the toy detector plus GenEval's rules (registered as ``toy_geneval``).

``ToyGenEvalReward()(images, prompts, metadata)`` detects shapes with :func:`flowalign.toy.detector.detect_batch` and
judges each image against its GenEval metadata with :func:`flowalign.evaluation.geneval.judge`.

* Binary (default): 1.0 when ``judge`` says the image is correct, else 0.0 (GenEval's per-image verdict).
* Partial credit: the fraction of satisfied clauses. Every ``include`` clause and every ``exclude`` clause is one unit
  of equal weight; the count, colour and position checks inside one include clause are not split further. Each unit
  is decided by ``judge`` itself, on sub-metadata with the same ``tag`` (so the same score threshold and top-16 rule
  apply), which gives exactly the clause's outcome inside the full judgement:

  - an include clause without ``position``: ``include = [clause]``. Its outcome in GenEval depends only on the top
    ``count`` detections of its class (and their colours), never on the other clauses.
  - an include clause with ``position = [rel, g]``: ``include`` = the reference clause ``g`` (and, recursively, the
    clauses it refers to) followed by the clause, with the group indices renumbered. Only the position clause's
    outcome is counted; it equals the sub-metadata's verdict, because the clause can only pass when its reference
    group passed (a failed group leaves "no target").
  - an exclude clause ``(class, count)``: satisfied iff ``judge`` *fails* ``include = [(class, count)]``; both test
    "at least ``count`` kept detections of the class" (kept = above the threshold, at most 16).

  So the partial score is 1.0 exactly when the binary verdict is 1.0. An image on which the detector keeps nothing
  (no detection above the prompt's score threshold) scores 0, so an empty canvas cannot collect exclude credit.
  Caveats of clause-level credit: a position prompt gives 1/2 for its reference object alone but 0 for the
  positioned object alone (it has no target), and a counting prompt gives 1/2 for any image with some confident shape
  and too few of the counted one (its exclude clause holds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowalign.evaluation.geneval import (COUNTING_SCORE_THRESHOLD, SCORE_THRESHOLD, judge, validate_metadata,
                                          validate_metadata_batch)
from flowalign.toy.detector import detect_batch

__all__ = ["ToyGenEvalReward", "clause_credit", "sub_metadata"]


class ToyGenEvalReward:
    """GenEval correctness of toy images, binary or with partial credit (see the module docstring)."""

    reads_geneval_metadata = True  # scores a prompt by its GenEval metadata (tag, include clauses)

    def __init__(self, partial_credit: bool = False) -> None:
        self.partial_credit = bool(partial_credit)
        self.name = "toy_geneval"

    def check_inputs(self, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]) -> None:
        """The reward protocol's input check (``flowalign.rewards``): every image needs its prompt's GenEval
        metadata; a bad entry is a ``RewardInputError`` naming ``metadata[i]`` and the field."""
        validate_metadata_batch(metadata)

    def __repr__(self) -> str:
        return f"ToyGenEvalReward(partial_credit={self.partial_credit})"

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """Scores ``[B]`` float32 (on CPU) for ``images [B, 3, H, W]`` in [0, 1]."""
        key = "partial" if self.partial_credit else "correct"
        return torch.tensor([float(v[key]) for v in self.verdicts(images, metadata)], dtype=torch.float32)

    def verdicts(self, images: Tensor, metadata: Sequence[Mapping[str, Any]]) -> list[dict]:
        """Per image: ``correct`` (bool), ``partial`` (float), ``satisfied`` and ``total`` units, ``reason``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got shape {tuple(images.shape)}")
        if len(metadata) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {len(metadata)} metadata entries")
        self.check_inputs([], metadata)
        size = (int(images.shape[3]), int(images.shape[2]))  # GenEval wants (width, height)
        results = []
        for entry, detections in zip(metadata, detect_batch(images)):
            correct, reason = judge(entry, detections, size)
            satisfied, total = clause_credit(entry, detections, size)
            results.append(
                {
                    "correct": bool(correct),
                    "partial": 1.0 if correct else satisfied / total,
                    "satisfied": satisfied,
                    "total": total,
                    "reason": reason,
                }
            )
        return results


def clause_credit(
    metadata: Mapping[str, Any], detections: Mapping[str, Sequence[Mapping[str, Any]]], image_size: tuple[float, float]
) -> tuple[int, int]:
    """``(satisfied units, total units)`` of one image; every include and exclude clause is one unit.

    Each unit is decided by ``judge`` on ``sub_metadata``; nothing confident detected means no unit is satisfied.
    """
    validate_metadata(metadata)
    includes, excludes = metadata["include"], metadata.get("exclude", [])
    total = len(includes) + len(excludes)
    if not _anything_kept(metadata["tag"], detections):
        return 0, total
    satisfied = 0
    for index in range(len(includes)):
        satisfied += judge(sub_metadata(metadata, index), detections, image_size)[0]
    for clause in excludes:
        as_include = {"class": clause["class"], "count": clause["count"]}
        probe = {"tag": metadata["tag"], "prompt": metadata["prompt"], "include": [as_include]}
        satisfied += not judge(probe, detections, image_size)[0]
    return satisfied, total


def sub_metadata(metadata: Mapping[str, Any], index: int) -> dict:
    """Metadata whose verdict is include clause ``index``'s outcome: the clause after the clauses it refers to.

    A position clause's reference group (followed recursively) comes first, in the original order, with group
    indices renumbered; excludes are dropped.
    """
    includes = metadata["include"]
    needed, stack = set(), [index]
    while stack:
        i = stack.pop()
        if i not in needed:
            needed.add(i)
            if "position" in includes[i]:
                stack.append(includes[i]["position"][1])
    order = sorted(needed)  # references always point to earlier clauses, so ``index`` ends up last
    renumber = {old: new for new, old in enumerate(order)}
    clauses = []
    for old in order:
        clause = dict(includes[old])
        if "position" in clause:
            relation, group = clause["position"]
            clause["position"] = [relation, renumber[group]]
        clauses.append(clause)
    return {"tag": metadata["tag"], "prompt": metadata["prompt"], "include": clauses}


def _anything_kept(tag: str, detections: Mapping[str, Sequence[Mapping[str, Any]]]) -> bool:
    """Whether any detection passes GenEval's score threshold for ``tag`` (rule 1)."""
    threshold = COUNTING_SCORE_THRESHOLD if tag == "counting" else SCORE_THRESHOLD
    return any(obj["score"] > threshold for objects in detections.values() for obj in objects)
