"""Reward callables, their registry, scoring a batch with several rewards, and combining the scores.

The protocol (trl-style plain callables): a reward is

    reward(images: Tensor [B, 3, H, W] in [0, 1], prompts: list[str], metadata: list[dict]) -> Tensor [B] | list[float]

with a ``name`` attribute. Rewards are scored without gradients (GRPO only needs their values).

``score_all`` runs every reward on one batch and keeps the raw scores ``[R, B]``. A non-finite score (a reward that
returns NaN for an image it cannot judge) is not an error: the sample is marked invalid (``valid[b]`` is False when
any reward of sample ``b`` is non-finite), counted, and left out of every later mean, std and advantage.

``combine_rewards`` turns ``[R, B]`` scores into one reward per sample. Two modes:

* ``sum_then_normalize``: ``r_b = sum_k w_k s_kb``; the group normalisation happens once, in the advantages. A reward
  with a larger scale then dominates the ranking inside a group.
* ``normalize_then_sum``: ``r_b = sum_k w_k (s_kb - mean_g(s_k)) / (std(s_k) + eps)``, each reward first normalised
  within its group with the same group/global std rule and eps as the advantages (``advantages.group_normalize``), so
  the weights, not the scales, set each reward's influence. (The advantages then normalise the sum once more.)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from flowalign.advantages import STD_MODES, group_normalize

__all__ = [
    "COMBINE_MODES",
    "REWARDS",
    "Reward",
    "RewardScores",
    "build_reward",
    "combine_rewards",
    "register_reward",
    "require_differentiable",
    "score_all",
]

COMBINE_MODES = ("sum_then_normalize", "normalize_then_sum")


@runtime_checkable
class Reward(Protocol):
    """A named callable scoring a batch of images against their prompts and metadata."""

    name: str

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor | list[float]: ...


def _toy_geneval(**kwargs: Any) -> Reward:
    from flowalign.toy.reward import ToyGenEvalReward  # imported lazily: it pulls in scipy and the toy world

    return ToyGenEvalReward(**kwargs)


def _toy_geneval_soft(**kwargs: Any) -> Reward:
    from flowalign.toy.soft_reward import SoftToyGenEval  # a differentiable surrogate, for reward-gradient guidance

    return SoftToyGenEval(**kwargs)


class BrightnessReward:
    """Mean pixel intensity in [0, 1] (optionally of one channel): a cheap, dense, prompt-free smoke-test reward.

    In the spirit of DDPO's prompt-independent rewards (Black et al. 2023): it has variance on any model, random ones
    included, so it exercises the whole GRPO path where a verifier reward would score every sample 0.
    """

    name = "brightness"

    def __init__(self, channel: int | None = None):
        if channel not in (None, 0, 1, 2):
            raise ValueError(f"brightness channel must be 0, 1, 2 or None (all), got {channel!r}")
        self.channel = channel

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        pixels = images.float() if self.channel is None else images[:, self.channel].float()
        return pixels.flatten(1).mean(dim=1)


def _lazy(module: str, attribute: str, **fixed: Any) -> Callable[..., Reward]:
    """A factory importing ``flowalign.reward_models.<module>.<attribute>`` only when the reward is built.

    Real reward models pull in transformers/open_clip and load weights, so nothing is imported at registry time.
    """

    def factory(**kwargs: Any) -> Reward:
        import importlib

        cls = getattr(importlib.import_module(f"flowalign.reward_models.{module}"), attribute)
        return cls(**fixed, **kwargs)

    factory.__name__ = f"build_{attribute}"
    factory.__doc__ = f"Build flowalign.reward_models.{module}.{attribute} (kwargs: its constructor's)."
    return factory


REWARDS: dict[str, Callable[..., Reward]] = {
    "toy_geneval": _toy_geneval,
    "toy_geneval_soft": _toy_geneval_soft,
    "brightness": BrightnessReward,
    # The reward model zoo (reward_models/); README "Using real models offline" lists the files each one needs.
    "pickscore": _lazy("pickscore", "PickScore"),
    "hps": _lazy("hps", "HPSv2"),
    "imagereward": _lazy("imagereward", "ImageRewardModel"),
    "clipscore": _lazy("clipscore", "CLIPScore"),
    "aesthetic": _lazy("aesthetic", "LaionAesthetic"),
    "jpeg_compressibility": _lazy("jpeg", "JpegCompressibility"),
    "jpeg_incompressibility": _lazy("jpeg", "JpegCompressibility", incompressible=True),
    "geneval": _lazy("geneval", "GenEvalReward"),
}


def register_reward(name: str, factory: Callable[..., Reward], *, overwrite: bool = False) -> None:
    """Add a reward factory to ``REWARDS`` under ``name``."""
    if name in REWARDS and not overwrite:
        raise ValueError(f"reward {name!r} is already registered (pass overwrite=True to replace it)")
    REWARDS[name] = factory


def require_differentiable(reward: Reward, key: str) -> Reward:
    """``reward`` itself; ValueError naming ``key`` unless it declares ``differentiable = True`` (a reward whose score
    keeps its gradient to the images, as reward-gradient guidance and RG-OPD need)."""
    if getattr(reward, "differentiable", False) is not True:
        raise ValueError(f"{key} {getattr(reward, 'name', reward)!r} is not differentiable (it scores images without "
                         "gradients; a differentiable reward declares differentiable = True): use e.g. "
                         "toy_geneval_soft, or --registers for RGS")
    return reward


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Build the registered reward ``name`` with ``kwargs``; an unknown name is a ValueError listing the known ones."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}: known rewards are {', '.join(sorted(REWARDS)) or '(none)'}")
    return REWARDS[name](**kwargs)


@dataclass
class RewardScores:
    """The scores of one batch under several rewards.

    ``raw [R, B]`` float32 holds the values as the rewards returned them (non-finite ones included, for inspection);
    ``valid [B]`` is False where any reward is non-finite and ``num_invalid`` counts those samples. Use
    ``combine_rewards`` for the math: it never lets an invalid score through.
    """

    names: list[str]
    weights: Tensor
    raw: Tensor
    valid: Tensor
    num_invalid: int


RewardSpec = tuple[str, float, Callable[..., Any]]


@torch.no_grad()
def score_all(
    rewards: Sequence[RewardSpec], images: Tensor, prompts: Sequence[str], metadata: Sequence[dict]
) -> RewardScores:
    """Run each ``(name, weight, fn)`` on the batch; see the module docstring for invalid scores.

    A reward that raises is re-raised as RuntimeError naming the reward and the batch's first prompt (the original
    exception is chained). A reward that returns the wrong number of scores or a non-numeric value is a ValueError
    naming the reward.
    """
    if not rewards:
        raise ValueError("score_all needs at least one (name, weight, fn) reward")
    batch = int(images.shape[0])
    if len(prompts) != batch or len(metadata) != batch:
        raise ValueError(f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata entries")
    names = [spec[0] for spec in rewards]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique (they key the logs), got {names}")

    rows, weights = [], []
    for name, weight, fn in rewards:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
        first = repr(prompts[0]) if batch else "(empty batch)"
        try:
            out = fn(images, list(prompts), list(metadata))
        except Exception as error:
            raise RuntimeError(
                f"reward {name!r} failed on a batch of {batch} images (first prompt: {first}): "
                f"{type(error).__name__}: {error}"
            ) from error
        rows.append(_as_scores(name, out, batch).to(images.device))
        weights.append(float(weight))

    raw = torch.stack(rows)
    valid = torch.isfinite(raw).all(dim=0)
    return RewardScores(
        names=names,
        weights=torch.tensor(weights, dtype=torch.float32, device=images.device),
        raw=raw,
        valid=valid,
        num_invalid=int((~valid).sum()),
    )


def combine_rewards(
    scores: Tensor,
    weights: Tensor | Sequence[float],
    valid: Tensor,
    group_ids: Tensor,
    *,
    mode: str = "sum_then_normalize",
    std: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """One reward per sample from ``scores [R, B]`` and ``weights [R]`` (modes in the module docstring).

    Invalid samples (``valid`` False, or any non-finite score) get 0 and are excluded from the per-group means and
    stds of ``normalize_then_sum``. Returns ``[B]`` float32.
    """
    if mode not in COMBINE_MODES:
        raise ValueError(f"unknown combine mode {mode!r}: expected one of {', '.join(COMBINE_MODES)}")
    if std not in STD_MODES:
        raise ValueError(f"unknown std mode {std!r}: expected one of {', '.join(STD_MODES)}")
    scores = torch.as_tensor(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [n_rewards, B], got shape {tuple(scores.shape)}")
    weights = torch.as_tensor(weights, dtype=torch.float32, device=scores.device)
    if weights.shape != (scores.shape[0],) or not torch.isfinite(weights).all():
        raise ValueError(f"weights must be {scores.shape[0]} finite numbers, got {weights.tolist()}")
    valid = torch.as_tensor(valid, device=scores.device)
    if valid.shape != (scores.shape[1],) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor of shape ({scores.shape[1]},), got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    valid = valid & torch.isfinite(scores).all(dim=0)
    scores = torch.where(valid, scores.float(), torch.zeros((), device=scores.device))

    if mode == "normalize_then_sum":
        scores = torch.stack([group_normalize(row, group_ids, valid, std=std, eps=eps)[0] for row in scores])
    combined = (weights[:, None] * scores).sum(dim=0)
    return torch.where(valid, combined, torch.zeros_like(combined))


def _as_scores(name: str, out: Any, batch: int) -> Tensor:
    """A reward's output as a float32 ``[batch]`` tensor, or a ValueError naming the reward."""
    if isinstance(out, Tensor):
        if out.is_complex():
            raise ValueError(f"reward {name!r} returned a tensor of dtype {out.dtype}; expected real numbers")
        scores = out.detach().float().cpu()
    elif isinstance(out, np.ndarray):
        if out.dtype.kind not in "biuf":
            raise ValueError(f"reward {name!r} returned an array of dtype {out.dtype}; expected real numbers")
        scores = torch.from_numpy(out.astype(np.float32))
    elif isinstance(out, (list, tuple)):
        values = []
        for index, value in enumerate(out):
            if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
                value = value.item()
            if isinstance(value, np.bool_):
                value = bool(value)
            if not isinstance(value, numbers.Real):
                raise ValueError(
                    f"reward {name!r} returned a non-numeric score at index {index}: {value!r} "
                    f"({type(value).__name__}); expected a real number"
                )
            values.append(float(value))
        scores = torch.tensor(values, dtype=torch.float32)
    else:
        raise ValueError(
            f"reward {name!r} returned {type(out).__name__}; expected a Tensor [B] or a list of B numbers"
        )
    if scores.ndim != 1 or scores.shape[0] != batch:
        raise ValueError(
            f"reward {name!r} returned scores of shape {tuple(scores.shape)} for a batch of {batch} images; "
            f"expected ({batch},)"
        )
    return scores
