"""Flow-GRPO's OCR score of recognised text against the text a prompt asks to render (the rule, without the engine).

Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv 2505.05470, 2025), the OCR task; the
released rule is ``yifan123/flow_grpo@ac4c86e flow_grpo/ocr.py::OcrScorer.__call__``. For a prompt and the OCR
engine's lines ``[(text_i, conf_i)]`` in the engine's order:

1. ``target = prompt.split('"')[1]``: the first double-quoted span. A prompt with a single ``"`` gives everything
   after it; a prompt with none crashes the released code (``IndexError``), here a ``ValueError`` naming the prompt.
2. ``text = "".join(text_i for lines with conf_i > 0)``; no line detected gives ``""``.
3. Both are normalised by ``s.replace(" ", "").lower()``: only U+0020 goes (tabs and newlines stay) and ``lower`` is
   Python's Unicode one (``"İ"`` becomes two code points, ``"i̇"``).
4. ``d = 0`` when ``target`` is a substring of ``text`` (extra text is free), else the Levenshtein distance between
   them (unit costs, over code points); ``d = min(d, len(target))``.
5. ``reward = 1 - d / len(target)``, in [0, 1]. An empty normalised target (``""``, or only spaces) divides by zero
   in the released code: a ``ValueError`` naming the prompt here.

An engine error (``lines=None``) scores 0, as released, where the distance is set to the length of the target before
normalisation (an empty one still divides by zero).

``variant="flow_factory"`` is Flow-Factory's port (``rewards/ocr.py``, PP-OCRv5): a prompt without a ``"`` is its own
target (the whole prompt), and every recognised line counts whatever its confidence.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["OCR_VARIANTS", "check_ocr_prompt", "edit_distance", "normalize_ocr_text", "ocr_reward_from_lines",
           "ocr_target"]

OCR_VARIANTS = ("flow_grpo", "flow_factory")


def _check_variant(variant: str) -> None:
    if variant not in OCR_VARIANTS:
        raise ValueError(f"unknown OCR variant {variant!r}: expected one of {', '.join(OCR_VARIANTS)}")


def edit_distance(a: str, b: str) -> int:
    """The Levenshtein distance between ``a`` and ``b``: the fewest insertions, deletions and substitutions (each
    costing 1) of single code points turning one into the other.

    The textbook dynamic programme ``D[i][j] = min(D[i-1][j] + 1, D[i][j-1] + 1, D[i-1][j-1] + [a_i != b_j])`` with
    ``D[i][0] = i`` and ``D[0][j] = j``, kept one row at a time: ``O(len(a) len(b))`` time, ``O(len(b))`` memory.
    """
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def normalize_ocr_text(text: str) -> str:
    """``text`` with every U+0020 space removed, then lower-cased (Python's Unicode ``str.lower``), as released."""
    return text.replace(" ", "").lower()


def ocr_target(prompt: str, *, variant: str = "flow_grpo") -> str:
    """The text ``prompt`` asks to render: its first double-quoted span (``prompt.split('"')[1]``; after a lone ``"``,
    the rest of the prompt), before normalisation.

    ``flow_grpo``: a prompt without ``"`` is a ValueError naming it (the released code's IndexError).
    ``flow_factory``: such a prompt is its own target.
    """
    _check_variant(variant)
    if not isinstance(prompt, str):
        raise TypeError(f"an OCR prompt is a string, got {type(prompt).__name__}")
    parts = prompt.split('"')
    if len(parts) >= 2:
        return parts[1]
    if variant == "flow_factory":
        return prompt
    raise ValueError(f"OCR prompt {prompt!r} has no double-quoted text to render: the OCR reward scores the first "
                     "\"...\" span of the prompt (Flow-GRPO's rule); quote the text, e.g. 'a sign that says \"Open\"'")


def _empty_target(prompt: str) -> ValueError:
    return ValueError(f"OCR prompt {prompt!r} asks to render an empty text (its first \"...\" span holds nothing but "
                      "spaces): the reward divides by the target's length; put the text between the quotes")


def _line(index: int, line: Any) -> tuple[str, float]:
    if not isinstance(line, Sequence) or isinstance(line, str) or len(line) != 2:
        raise ValueError(f"OCR line {index} is {line!r}; expected a (text, confidence) pair")
    text, conf = line
    if not isinstance(text, str) or isinstance(conf, bool) or not isinstance(conf, numbers.Real):
        raise ValueError(f"OCR line {index} is {line!r}; expected a (text: str, confidence: number) pair")
    return text, float(conf)


def ocr_reward_from_lines(prompt: str, lines: Sequence[tuple[str, float]] | None, *,
                          variant: str = "flow_grpo") -> float:
    """Flow-GRPO's OCR reward of one image (module docstring): ``1 - min(d, |t|) / |t|`` with ``t`` the normalised
    quoted target and ``d`` its Levenshtein distance to the recognised text (0 when ``t`` is a substring of it).

    Args:
        prompt: the prompt the image was made for; its first ``"..."`` span is the target.
        lines: the OCR engine's ``(text, confidence)`` lines in its reading order; ``None`` stands for an engine error
            (scores 0, as released).
        variant: ``"flow_grpo"`` (the released rule) or ``"flow_factory"`` (whole-prompt fallback, no confidence
            filter).

    Returns:
        The reward in [0, 1].

    Raises:
        ValueError: naming the prompt where the released code crashes: no ``"`` in it (``flow_grpo``), or an empty
            target.
    """
    target = ocr_target(prompt, variant=variant)
    if lines is None:  # the released except-branch: dist = len(target) before normalisation, so 1 - d/|t| = 0
        if not target:
            raise _empty_target(prompt)
        return 0.0
    pairs = [_line(index, line) for index, line in enumerate(lines)]
    text = "".join(t for t, conf in pairs if variant == "flow_factory" or conf > 0)
    text, goal = normalize_ocr_text(text), normalize_ocr_text(target)
    if not goal:
        raise _empty_target(prompt)
    distance = 0 if goal in text else edit_distance(text, goal)
    distance = min(distance, len(goal))
    return 1 - distance / len(goal)


def check_ocr_prompt(prompt: str, *, variant: str = "flow_grpo") -> None:
    """ValueError naming ``prompt`` when the OCR reward cannot score it (no quoted target under ``flow_grpo``, or an
    empty target): what a run would crash on, found when the prompts load."""
    target = ocr_target(prompt, variant=variant)
    if not normalize_ocr_text(target):
        raise _empty_target(prompt)
