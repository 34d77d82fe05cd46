"""Pairwise-preference win rates (Pref-GRPO): a judge's verdicts on pairs of images turned into one reward per image.

Pref-GRPO (UnifiedReward team, "Pref-GRPO: Pairwise Preference Reward-based GRPO for Stable Text-to-Image
Reinforcement Learning", arXiv 2508.20751, 2025; code ``CodeGoat24/Pref-GRPO@3e787f6``,
``fastvideo/rewards/unifiedreward_{think,flex}.py``; METHODS-3.md §4). The ``n`` images of a group are judged in every
unordered pair ``i < j`` once, image ``i`` shown first. Each pair gives a verdict ``v``: 1 (``i`` wins), 2 (``j``
wins) or 0 (a tie, or an answer that does not parse: half a win each). Image ``i``'s reward is its win rate

    rate_i = round(wins_i / comparisons_i, 3)        (Python's round: half-even on the exact double)

and 0 for an image in no pair. Position bias is not symmetrised (one order per pair), as released.

Verdict formats. *Think* (UnifiedReward-Think): the text of the first ``<answer>...</answer>`` (across lines,
stripped) containing ``"Image 1 is better"`` gives 1, else ``"Image 2 is better"`` gives 2, else 0 (also with no tag);
videos say ``Video``. *Flex* (UnifiedReward-Flex): a JSON object ``{"winner", "categories": [{"name",
"cat_winner"}]}`` (else the first ``{...}`` block of the answer); a winner string names side 1 or 2 iff exactly one of
``\\b(image|video)\\s*1\\b`` and ``...2\\b`` matches it (lower-cased); the first 3 categories count, each a win rate of
its own; an image's reward is ``(ow overall + dw dim_mean) / (ow + dw)`` with ``dim_mean`` the category-weighted mean of
its category rates (rounded), or ``overall`` when it had no category comparison or ``dw = 0``.

Departures from the released code: a JSON answer that is not an object (a list, a number) parses as no payload
(released: an AttributeError); a category entry that is not an object is skipped, and ``categories`` that is not a
list counts as none.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["FlexRates", "flex_win_rates", "flex_winner", "pairwise_win_rates", "parse_flex_payload",
           "parse_think_verdict", "VERDICTS"]

VERDICTS = (0, 1, 2)  # tie or unparseable, the first image, the second image
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_SIDE = {side: re.compile(rf"\b(?:video|image)\s*{side}\b") for side in (1, 2)}


def parse_think_verdict(text: Any, modality: str = "image") -> int:
    """A UnifiedReward-Think answer's verdict: 1, 2, or 0 (tie, no ``<answer>`` tag, or neither phrase); module
    docstring. ``modality`` ``"image"`` or ``"video"`` picks the phrase (``"Image 1 is better"``)."""
    if modality not in ("image", "video"):
        raise ValueError(f"modality must be 'image' or 'video', got {modality!r}")
    if not isinstance(text, str):
        return 0
    match = _ANSWER.search(text)
    answer = match.group(1).strip() if match else ""
    if not answer:
        return 0
    word = "Image" if modality == "image" else "Video"
    if f"{word} 1 is better" in answer:
        return 1
    if f"{word} 2 is better" in answer:
        return 2
    return 0


def parse_flex_payload(text: Any) -> dict | None:
    """A UnifiedReward-Flex answer's JSON object: the whole (stripped) answer, else its first ``{...}`` block (the
    first ``{`` to the last ``}``); None when neither parses to an object."""
    if not isinstance(text, str) or not text:
        return None
    text = text.strip()
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        match = re.search(r"\{.*\}", text, re.DOTALL)
        if not match:
            return None
        try:
            payload = json.loads(match.group(0))
        except json.JSONDecodeError:
            return None
    return payload if isinstance(payload, dict) else None


def _side(text: Any) -> int | None:
    if not text:
        return None
    lowered = str(text).lower()
    first, second = _SIDE[1].search(lowered), _SIDE[2].search(lowered)
    if first and not second:
        return 1
    if second and not first:
        return 2
    return None


def flex_winner(text: Any) -> int | None:
    """The side a Flex winner names: 1, 2, or None (neither, or both). ``text`` is a winner string (``"Image 1"``),
    or a whole Flex answer, whose payload's ``winner`` is read (an answer that holds a JSON object)."""
    if isinstance(text, str) and "{" in text:
        payload = parse_flex_payload(text)
        if payload is not None:
            return _side(str(payload.get("winner", "")))
    return _side(text)


def _verdict(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or int(value) not in VERDICTS or int(value) != value:
        raise ValueError(f"a verdict is 1 (the first image wins), 2 (the second) or 0 (a tie, or no answer), got "
                         f"{value!r}")
    return int(value)


def _check_pair(n: int, i: Any, j: Any) -> tuple[int, int]:
    if not (0 <= int(i) < n and 0 <= int(j) < n) or int(i) == int(j):
        raise ValueError(f"pair ({i}, {j}) is not two distinct images of 0..{n - 1}")
    return int(i), int(j)


def pairwise_win_rates(n: int, verdicts: Iterable[tuple[int, int, Any]]) -> Tensor:
    """Each image's win rate ``[n]`` (float64), already rounded with Python's ``round(x, 3)``; ``verdicts`` are
    ``(i, j, v)``: image ``i`` shown first, ``v`` 1, 2 or 0 (None counts as 0). An image in no pair scores 0."""
    if isinstance(n, bool) or int(n) != n or n < 0:
        raise ValueError(f"n must be a count of images, got {n!r}")
    wins, counts = defaultdict(float), defaultdict(int)
    for i, j, value in verdicts:
        i, j = _check_pair(n, i, j)
        _tally(wins, counts, i, j, _verdict(value))
    return torch.tensor([round(wins[k] / counts[k], 3) if counts[k] else 0.0 for k in range(n)], dtype=torch.float64)


def _tally(wins: dict, counts: dict, i: int, j: int, verdict: int | None) -> None:
    counts[i] += 1
    counts[j] += 1
    if verdict == 1:
        wins[i] += 1
    elif verdict == 2:
        wins[j] += 1
    else:
        wins[i] += 0.5
        wins[j] += 0.5


@dataclass
class FlexRates:
    """``flex_win_rates``' record: ``rewards`` the blended rates ``[n]``; ``overall`` the overall win rates,
    ``dim_mean`` the category-weighted mean of category rates (0 without one), ``mask`` whether the image had a
    category comparison, ``dims`` each category's rounded rates, and the weights they were blended with."""

    rewards: Tensor
    overall: Tensor
    dim_mean: Tensor
    mask: Tensor
    overall_weight: float
    dim_weight: float
    dims: dict[str, list[float]] = field(default_factory=dict)

    @staticmethod
    def cat(parts: Sequence["FlexRates"]) -> "FlexRates":
        """Several groups' records as one batch's, in order (the weights must agree)."""
        first = parts[0]
        return FlexRates(torch.cat([p.rewards for p in parts]), torch.cat([p.overall for p in parts]),
                         torch.cat([p.dim_mean for p in parts]), torch.cat([p.mask for p in parts]),
                         first.overall_weight, first.dim_weight)


def _categories(payload: dict) -> list[tuple[str, int | None]]:
    categories = payload.get("categories", [])
    if not isinstance(categories, list):
        return []
    out = []
    for category in categories[:3]:
        if not isinstance(category, dict):
            continue
        name = str(category.get("name", "")).strip()
        out.append((name or "category", _side(str(category.get("cat_winner", "")))))
    return out


def flex_win_rates(n: int, responses: Iterable[tuple[int, int, Any]], *, overall_weight: float = 1.0,
                   dim_weight: float = 1.0, category_weights: Sequence[float] | None = None) -> FlexRates:
    """UnifiedReward-Flex rates (module docstring) from ``responses``, ``(i, j, text)`` the judge's raw answer for
    the pair (``i`` shown first). ``category_weights`` weigh the categories in the order they first appear (missing
    ones weigh 1; None: all 1). Returns a ``FlexRates`` whose ``rewards [n]`` are the blended rates."""
    wins: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    order: list[str] = []
    for i, j, text in responses:
        i, j = _check_pair(n, i, j)
        payload = parse_flex_payload(text)
        _tally(wins["overall"], counts["overall"], i, j, _side(str(payload.get("winner", ""))) if payload else None)
        if not payload:
            continue
        for key, winner in _categories(payload):
            if key not in order:
                order.append(key)
            _tally(wins[key], counts[key], i, j, winner)
    overall = [round(wins["overall"][k] / max(counts["overall"][k], 1), 3) for k in range(n)]
    dims = [k for k in order if k != "overall"]
    weights = [float(w) for w in (category_weights or [])][:len(dims)]
    weights += [1.0] * (len(dims) - len(weights))
    dim_mean, mask = [], []
    for k in range(n):
        rates = [(wins[d][k] / counts[d][k], w) for d, w in zip(dims, weights) if counts[d][k] > 0]
        mask.append(bool(rates))
        total = sum(w for _, w in rates)
        if not rates:
            dim_mean.append(0.0)
        elif total > 0:
            dim_mean.append(round(float(sum(r * w for r, w in rates) / total), 3))
        else:
            dim_mean.append(round(float(sum(r for r, _ in rates) / len(rates)), 3))
    rewards = [(overall_weight * o + dim_weight * d) / (overall_weight + dim_weight) if dim_weight > 0 and m else o
               for o, d, m in zip(overall, dim_mean, mask)]
    f64 = torch.float64
    return FlexRates(torch.tensor(rewards, dtype=f64), torch.tensor(overall, dtype=f64),
                     torch.tensor(dim_mean, dtype=f64), torch.tensor(mask, dtype=torch.bool), float(overall_weight),
                     float(dim_weight),
                     {d: [round(wins[d][k] / max(counts[d][k], 1), 3) for k in range(n)] for d in dims})
