"""An iteration's rewards: decode this process's final images, score them (a latent reward reads the final latents),
gather across processes, combine and group-normalise (Flow-GRPO's advantages, ``flowalign.normalization``).

A group may span processes (its ``K`` images are sampled on different ranks), so normalising per process would use
a partial group's mean and std: the raw rewards and validity are gathered first, normalised once over the global
batch, and each process keeps its own slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flowalign.credit import BatchScores
from flowalign.normalization import group_advantages
from flowalign.rewards import combine_rewards, score_all

__all__ = ["Scores", "score_iteration", "state_reward"]


@dataclass
class Scores:
    """The rewards of an iteration, for this process's samples in batch order."""

    advantages: Tensor  # group-normalised
    combined: Tensor  # the combined reward before normalisation
    valid: Tensor
    stats: dict[str, float]
    images: Tensor  # decoded images
    display: Tensor  # weighted reward sums for the sample grids
    global_advantages: Tensor  # every process's samples (saved in checkpoints)
    names: list[str] | None = None  # the rewards, in the order of raw_all's rows
    raw_all: Tensor | None = None  # [rewards, every process's samples]: each reward's raw score, gathered
    valid_all: Tensor | None = None  # [every process's samples]

    def slices(self, batches) -> list[BatchScores]:
        """Each batch's share, in order."""
        out, offset = [], 0
        for batch in batches:
            count = len(batch.sample_ids)
            part = slice(offset, offset + count)
            out.append(BatchScores(self.advantages[part], self.combined[part], self.valid[part], self.images[part]))
            offset += count
        return out


@torch.no_grad()
def score_iteration(trainer, batches) -> Scores:
    """Decode, score, gather across processes, combine and group-normalise."""
    config, accelerator = trainer.config, trainer.accelerator
    finals = torch.cat([b.rollout.final for b in batches])
    images = torch.cat([trainer.model.decode(b.rollout.final).float() for b in batches])
    ids = torch.cat([b.sample_ids for b in batches])
    metadata = [m for b in batches for m in b.sample_metadata]
    scores = score_all(trainer.rewards, images, [m["prompt"] for m in metadata], metadata,
                       group_ids=ids // config.data.group_size, latents=finals.float())
    device = accelerator.device
    raw = accelerator.gather(scores.raw.T.contiguous().to(device)).T.cpu()
    valid = accelerator.gather(scores.valid.to(device)).cpu()
    group_ids = torch.arange(trainer.layout.global_samples) // config.data.group_size
    combined = combine_rewards(raw, scores.weights.cpu(), valid, group_ids, mode=config.reward.combine,
                               std=config.advantage.std)
    advantages, adv_stats = group_advantages(combined, group_ids, valid, std=config.advantage.std,
                                             clip=config.advantage.clip)
    kept = combined[valid]
    stats = {
        "reward": float(kept.mean()) if len(kept) else math.nan,
        "reward_std": float(kept.std(unbiased=False)) if len(kept) else math.nan,
        "reward_invalid": float((~valid).sum()),
        "zero_std_frac": float(adv_stats["zero_std_frac"]),
    }
    for name, row in zip(scores.names, raw):
        stats[f"rewards/{name}/mean"] = float(row[valid].mean()) if valid.any() else math.nan
    display = (scores.weights[:, None] * scores.raw).sum(0).cpu()
    return Scores(advantages[ids], combined[ids], valid[ids], stats, images.cpu(), display, advantages,
                  names=list(scores.names), raw_all=raw, valid_all=valid)


def state_reward(rewards):
    """``reward(images, metadata, group_ids=None, latents=None)``: the weighted sum of the raw rewards (float64, NaN
    where invalid), how credit estimators score intermediate states (a latent reward needs their ``latents``)."""

    def reward(images: Tensor, metadata: list[dict], group_ids=None, latents: Tensor | None = None) -> Tensor:
        out = score_all(rewards, images.float(), [m["prompt"] for m in metadata], metadata, group_ids=group_ids,
                        latents=None if latents is None else latents.float())
        total = (out.weights[:, None] * out.raw).sum(0).double()
        return torch.where(out.valid, total, torch.full_like(total, math.nan))

    return reward
