"""The prompts of an iteration: drawn from the training prompts, keyed by the iteration, the same on every process.

``data.prompt_sampling = tag_balanced`` gives every metadata ``tag`` the same total probability: the toy training split
is 77% color_attr captions, and drawn uniformly, RL would spend most of its updates on one of the six tags that
GenEval's overall averages with equal weight.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from flowalign.seeding import Purpose, numpy_rng

__all__ = ["PromptSampler", "prompt_weights"]


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
