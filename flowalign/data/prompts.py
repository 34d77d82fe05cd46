"""The prompts of an iteration: drawn from the training prompts, keyed by the iteration, the same on every process.

``data.prompt_sampling = tag_balanced`` gives every metadata ``tag`` the same total probability: the toy training split
is 77% color_attr captions, and drawn uniformly, RL would spend most of its updates on one of the six tags that
GenEval's overall averages with equal weight.
"""

from __future__ import annotations

import json
from collections import Counter
from os import PathLike
from pathlib import Path

import numpy as np

from flowalign.data.condition_images import resolve_entry_images
from flowalign.evaluation.geneval import GenEvalError, located_lines, validate_metadata
from flowalign.seeding import Purpose, numpy_rng

__all__ = ["PromptSampler", "is_geneval_entry", "load_prompts", "prompt_weights"]

GENEVAL_FIELDS = ("tag", "include")


def is_geneval_entry(entry: dict) -> bool:
    """Whether a prompt entry carries GenEval's fields (``tag``, ``include``), which the GenEval rewards read."""
    return any(field in entry for field in GENEVAL_FIELDS)


def load_prompts(path: str | PathLike[str], key: str | None = None) -> list[dict]:
    """Training prompts as ``{"prompt": ..., ...}`` entries, from a ``.txt`` file (one prompt a line) or JSONL (one
    object a line with a non-empty string ``prompt``; other keys travel with it as the prompt's metadata). Entries
    with GenEval's fields are checked as GenEval metadata (``flowalign.evaluation.geneval.validate_metadata``); an
    editing prompt's ``images`` (condition-image paths relative to the file) become absolute paths, each checked to
    exist (``flowalign.data.condition_images``). Blank lines are skipped; a bad line raises ``GenEvalError`` naming
    the file and line; a missing file, one naming ``key`` (the config key that gave the path) when there is one."""
    path = Path(path)
    if not path.exists():
        given = f"{key} = {str(path)!r}" if key else str(path)
        raise GenEvalError(f"{given}: no such file (a relative path is read from the working directory, {Path.cwd()}); "
                           "give a prompt file: .txt with one prompt a line, or .jsonl with one {\"prompt\": ...} "
                           "object a line")
    entries = []
    for where, line in located_lines(path):
        if path.suffix == ".txt":
            entries.append({"prompt": line.strip()})
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise GenEvalError(f"{where}: not valid JSON ({error.msg} at column {error.colno}); a .jsonl prompt "
                               "file holds one object a line, a .txt file one prompt a line") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise GenEvalError(f"{where}: expected an object with a non-empty string 'prompt', "
                               f"got {line.strip()[:80]}")
        if is_geneval_entry(entry):
            validate_metadata(entry, where)
        try:
            resolve_entry_images(entry, path.parent, where)
        except ValueError as error:
            raise GenEvalError(str(error)) from None
        entries.append(entry)
    if not entries:
        raise GenEvalError(f"{path}: holds no prompts")
    return entries


def prompt_weights(prompts: list[dict], sampling: str) -> np.ndarray | None:
    """Sampling probabilities of the training prompts: ``None`` (uniform) or equal total mass per ``tag``."""
    if sampling == "uniform":
        return None
    tags = [str(entry.get("tag", "")) for entry in prompts]
    counts = Counter(tags)
    weights = np.array([1.0 / (len(counts) * counts[tag]) for tag in tags])
    return weights / weights.sum()


class PromptSampler:
    """``prompts_for(iteration)``: ``count`` entries of ``prompts`` drawn with ``numpy_rng(seed, iteration, PROMPTS)``
    (with replacement only when there are fewer prompts than ``count``)."""

    def __init__(self, prompts: list[dict], *, count: int, seed: int, sampling: str = "uniform"):
        self.prompts, self.count, self.seed = prompts, count, seed
        self.weights = prompt_weights(prompts, sampling)

    def prompts_for(self, iteration: int) -> list[dict]:
        rng = numpy_rng(self.seed, iteration, Purpose.PROMPTS)
        index = rng.choice(len(self.prompts), size=self.count, replace=self.count > len(self.prompts), p=self.weights)
        return [self.prompts[i] for i in index]
