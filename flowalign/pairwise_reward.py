"""The ``pairwise_preference`` reward: Pref-GRPO's win rates from a pairwise judge, a groupwise reward.

Pref-GRPO (arXiv 2508.20751; METHODS-3.md §4): every unordered pair ``i < j`` of a group is judged once, image ``i``
shown first, by a *pairwise judge*; each image's reward is its win rate, ties and unparseable answers counting half
(``flowalign.reward_models.pairwise``). ``G(G - 1) / 2`` judge calls per group of ``G``.

A pairwise judge is a callable ``judge(first [P, 3, H, W], second [P, 3, H, W], prompts [P], metadata [P])`` that
returns one answer per pair: a verdict (1: the first image is better, 2: the second, 0: a tie), a text the reward
parses (``format``: ``think`` or ``flex``), or None (no answer: a tie, counted in ``failed``). Judges are registered
in ``PAIRWISE_JUDGES`` (``register_pairwise_judge``): ``vlm`` is a VLM over an OpenAI-compatible chat-completions
endpoint (``flowalign.remote.pairwise_judge``, e.g. UnifiedReward-Think behind vLLM); ``score`` is a local stand-in
that compares two images by a pointwise reward of the registry (``toy_geneval_soft`` by default) and says which
scores higher: it lets the whole Pref-GRPO path run on the toy world, and is not a preference model.

Pairing. ``pairing: group`` (the default) pairs only within a group: the reward is groupwise (``score_all`` hands
it one group a call). ``pairing: rank`` is the released code's behaviour: every image one call receives (all of a
process's samples, or a rollout chunk with ``reward.overlap``) is paired with every other, across groups; the
paper's win rate is over the group. A call in which no pair got an answer (a judge server down) scores NaN, which the
trainer masks and counts, instead of training on ties.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from flowalign.registry import Registry
from flowalign.reward_models.pairwise import flex_win_rates, pairwise_win_rates, parse_think_verdict

__all__ = ["PAIRWISE_JUDGES", "PairwisePreference", "ScoreJudge", "register_pairwise_judge"]

logger = logging.getLogger(__name__)

FORMATS = ("think", "flex")
PAIRINGS = ("group", "rank")


class ScoreJudge:
    """A local stand-in pairwise judge: verdict 1 when the first image's pointwise ``reward`` score exceeds the
    second's by more than ``margin``, 2 the other way, else 0 (a tie). Built on a registered reward (``reward``,
    ``reward_kwargs``); for the toy world and tests, not a model of preference."""

    name = "score"

    def __init__(self, reward: str = "toy_geneval_soft", reward_kwargs: Mapping[str, Any] | None = None,
                 margin: float = 0.0):
        from flowalign.rewards import build_reward

        if not (isinstance(margin, (int, float)) and margin >= 0 and math.isfinite(margin)):
            raise ValueError(f"judge_kwargs.margin must be a finite number >= 0, got {margin!r}")
        self.reward, self.margin = build_reward(reward, **dict(reward_kwargs or {})), float(margin)

    def __call__(self, first: Tensor, second: Tensor, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> list[int]:
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        scores = torch.as_tensor(self.reward(torch.cat([first, second]), list(prompts) * 2, metadata * 2),
                                 dtype=torch.float64).flatten()
        a, b = scores[:len(prompts)], scores[len(prompts):]
        return [1 if x > y + self.margin else 2 if y > x + self.margin else 0 for x, y in zip(a.tolist(), b.tolist())]


def _vlm_class() -> type:
    from flowalign.remote.pairwise_judge import PairwiseVLMJudge

    return PairwiseVLMJudge


def _vlm(**kwargs: Any) -> Callable:
    return _vlm_class()(**kwargs)


_vlm.judge_class = _vlm_class

# name -> factory of a pairwise judge (module docstring); add with register_pairwise_judge.
PAIRWISE_JUDGES: Registry[Callable] = Registry("pairwise judge")
PAIRWISE_JUDGES.register("vlm", _vlm)
PAIRWISE_JUDGES.register("score", ScoreJudge)


def register_pairwise_judge(name: str, factory: Callable[..., Callable], *, overwrite: bool = False) -> None:
    """Register a local pairwise model: ``factory(**judge_kwargs)`` returns ``judge(first, second, prompts, metadata)
    -> [verdict | text | None]`` (module docstring); ``reward.rewards[i].kwargs.judge`` then names it."""
    PAIRWISE_JUDGES.register(name, factory, overwrite=overwrite)


class PairwisePreference:
    """Pref-GRPO's win-rate reward (module docstring). Settings: ``judge`` (a registered pairwise judge: ``vlm``,
    ``score``, or one of your own), ``judge_kwargs`` (its settings), ``format`` (how a text answer is read: ``think``
    or ``flex``), ``modality`` (``image``; the Think phrase), ``pairing`` (``group`` or the released ``rank``), and
    for ``flex`` ``overall_weight``, ``dim_weight``, ``category_weights`` (the released defaults 1, 1, all 1)."""

    name = "pairwise_preference"
    groupwise = True
    pairwise = True  # needs two images per group (checked against data.group_size before anything loads)
    score_range = (0.0, 1.0)

    def __init__(self, judge: str = "vlm", judge_kwargs: dict[str, Any] | None = None, format: str = "think",
                 pairing: str = "group", overall_weight: float = 1.0, dim_weight: float = 1.0,
                 category_weights: list[float] | None = None):
        self.check_settings(dict(judge=judge, format=format, pairing=pairing, overall_weight=overall_weight,
                                 dim_weight=dim_weight), "kwargs")
        self.judge = PAIRWISE_JUDGES.build(judge, **dict(judge_kwargs or {}))
        self.format, self.pairing = format, pairing
        self.groupwise = pairing == "group"
        self.overall_weight, self.dim_weight = float(overall_weight), float(dim_weight)
        self.category_weights = None if category_weights is None else [float(w) for w in category_weights]
        self.pairs = 0  # pairs judged so far
        self.failed = 0  # pairs without an answer (ties)
        self.unparsed = 0  # text answers without a verdict (ties)

    @staticmethod
    def check_settings(kwargs: Mapping[str, Any], key: str) -> None:
        """ValueError naming ``key.<setting>`` for a format, pairing or weight that cannot be."""
        if kwargs.get("format", "think") not in FORMATS:
            raise ValueError(f"{key}.format must be one of {', '.join(FORMATS)}, got {kwargs['format']!r}")
        if kwargs.get("pairing", "group") not in PAIRINGS:
            raise ValueError(f"{key}.pairing must be 'group' (pairs within a prompt's group) or 'rank' (the released "
                             f"code's pairs across every image of a call), got {kwargs['pairing']!r}")
        for name in ("overall_weight", "dim_weight"):
            value = kwargs.get(name, 1.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{key}.{name} must be a number >= 0, got {value!r}")
        if kwargs.get("overall_weight", 1.0) + kwargs.get("dim_weight", 1.0) <= 0:
            raise ValueError(f"{key}.overall_weight + {key}.dim_weight must be > 0")

    @classmethod
    def check_run(cls, kwargs: Mapping[str, Any], *, key: str, model: str | None, image_size: Any) -> None:
        """Before anything is built or loaded: the settings, the judge's name, and the ``vlm`` judge's settings and
        server (``PairwiseVLMJudge.check_run``)."""
        from flowalign.rewards import check_reward_kwargs

        cls.check_settings(kwargs, key)
        judge = kwargs.get("judge", "vlm")
        factory = PAIRWISE_JUDGES.get(judge)  # an unknown name: a ValueError listing the known ones
        judge_class = factory if isinstance(factory, type) else getattr(factory, "judge_class", lambda: None)()
        if judge_class is not None:  # its settings against its constructor (a misspelt one: did you mean)
            check_reward_kwargs(judge_class, dict(kwargs.get("judge_kwargs") or {}), f"{key}.judge_kwargs", judge)
        if judge == "vlm":
            _vlm_class().check_run(dict(kwargs.get("judge_kwargs") or {}), f"{key}.judge_kwargs")

    def _verdict(self, answer: Any) -> int:
        if answer is None:
            self.failed += 1
            return 0
        if isinstance(answer, str):
            verdict = parse_think_verdict(answer)
            self.unparsed += verdict == 0 and "<answer>" not in answer
            return verdict
        return int(answer)

    def __call__(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Win rates ``[n]`` float64 for the ``n`` images of one group (``pairing: group``) or one call (``rank``)."""
        n = int(images.shape[0])
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if n < 2:
            raise ValueError(f"pairwise_preference needs at least two images to compare, got {n}: a group of one has "
                             "no pair (data.group_size must be >= 2)")
        pairs = list(itertools.combinations(range(n), 2))
        first = torch.tensor([i for i, _ in pairs], device=images.device)
        second = torch.tensor([j for _, j in pairs], device=images.device)
        answers = list(self.judge(images[first], images[second], [prompts[i] for i, _ in pairs],
                                  [metadata[i] for i, _ in pairs]))
        if len(answers) != len(pairs):
            raise ValueError(f"pairwise judge returned {len(answers)} answers for {len(pairs)} pairs")
        self.pairs += len(pairs)
        if all(answer is None for answer in answers):
            self.failed += len(pairs)
            logger.warning("pairwise_preference: no pair of this call got an answer; its %d images score NaN "
                           "(invalid)", n)
            return torch.full((n,), math.nan, dtype=torch.float64)
        if self.format == "flex":
            self.failed += sum(answer is None for answer in answers)
            return flex_win_rates(n, [(i, j, a) for (i, j), a in zip(pairs, answers)],
                                  overall_weight=self.overall_weight, dim_weight=self.dim_weight,
                                  category_weights=self.category_weights).rewards
        return pairwise_win_rates(n, [(i, j, self._verdict(a)) for (i, j), a in zip(pairs, answers)])

    def close(self) -> None:
        close = getattr(self.judge, "close", None)
        if callable(close):
            close()
