"""An iteration's rewards: decode this process's final images, score them (a latent reward reads the final latents),
gather across processes, combine and group-normalise (Flow-GRPO's advantages, ``flowalign.advantages``).

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
from flowalign.advantages import group_advantages
from flowalign.rewards import RewardScores, combine_rewards, score_all

__all__ = ["ChunkScoring", "Scores", "check_invalid_fraction", "gdpo_iteration_advantages", "score_iteration",
           "skip_reason", "state_reward"]


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
def _score_chunk(trainer, batch) -> tuple[Tensor, RewardScores]:
    """One rollout chunk decoded and scored: what ``ChunkScoring`` runs on its worker thread."""
    images = trainer.model.decode(batch.rollout.final).float()
    metadata = batch.sample_metadata
    return images, score_all(trainer.rewards, images, [m["prompt"] for m in metadata], metadata,
                             group_ids=batch.sample_ids // trainer.config.data.group_size,
                             latents=batch.rollout.final.float())


class ChunkScoring:
    """``reward.overlap``: each rollout chunk is decoded and scored on one worker thread as soon as it is grown, while
    the next chunk rolls out; ``score_iteration`` then only joins the chunks' scores. Decoding is per chunk either
    way, so the images are the same; a reward is called once per chunk instead of once per iteration, which gives
    the same scores, bit for bit, for every reward that scores each image on its own (the toy rewards, a reward
    server's, a judge's), and whole groups to a groupwise reward when chunks hold whole groups (checked at
    start-up). The worker runs without gradients and without the rollout's autocast (both are per thread), like
    the sequential scoring after the rollout. No draw of the rollout depends on it: the algorithm is unchanged."""

    def __init__(self, trainer):
        from concurrent.futures import ThreadPoolExecutor

        self.trainer, self.pending = trainer, []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-scoring")

    def __call__(self, batch) -> None:
        """Start decoding and scoring ``batch`` (a grown chunk with its ``sample_metadata``)."""
        self.pending.append(self.pool.submit(_score_chunk, self.trainer, batch))

    def results(self) -> list[tuple[Tensor, RewardScores]]:
        """Every chunk's ``(images, scores)``, in order (waits for the last); a chunk's error is raised here."""
        try:
            return [future.result() for future in self.pending]
        finally:
            self.pool.shutdown(wait=True)

    def __enter__(self) -> "ChunkScoring":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:  # the rollout failed: drop the chunks not started, wait for the one running
            for future in self.pending:
                future.cancel()
            self.pool.shutdown(wait=True)


def _joined(chunks: list[tuple[Tensor, RewardScores]]) -> tuple[Tensor, RewardScores]:
    """The chunks' images and scores as one batch's (``score_all`` on the whole batch returns the same layout)."""
    first = chunks[0][1]
    valid = torch.cat([scores.valid for _, scores in chunks])
    return torch.cat([images for images, _ in chunks]), RewardScores(
        names=first.names, weights=first.weights, raw=torch.cat([scores.raw for _, scores in chunks], dim=1),
        valid=valid, num_invalid=int((~valid).sum()))


@torch.no_grad()
def score_iteration(trainer, batches, overlap: ChunkScoring | None = None) -> Scores:
    """Decode, score, gather across processes, combine and group-normalise; with ``overlap``, join the scores its
    worker computed during the rollout instead. More than ``reward.max_invalid_fraction`` of the iteration's samples
    invalid (over all processes) is a RuntimeError."""
    config, accelerator = trainer.config, trainer.accelerator
    ids = torch.cat([b.sample_ids for b in batches])
    if overlap is not None:
        images, scores = _joined(overlap.results())
    else:
        finals = torch.cat([b.rollout.final for b in batches])
        images = torch.cat([trainer.model.decode(b.rollout.final).float() for b in batches])
        metadata = [m for b in batches for m in b.sample_metadata]
        scores = score_all(trainer.rewards, images, [m["prompt"] for m in metadata], metadata,
                           group_ids=ids // config.data.group_size, latents=finals.float())
    device = accelerator.device
    raw = accelerator.gather(scores.raw.T.contiguous().to(device)).T.cpu()
    valid = accelerator.gather(scores.valid.to(device)).cpu()
    check_invalid_fraction(valid, config.reward.max_invalid_fraction, scores.names)
    group_ids = torch.arange(trainer.layout.global_samples) // config.data.group_size
    if config.reward.combine == "gdpo":
        combined = combine_rewards(raw, scores.weights.cpu(), valid, group_ids)  # the weighted sum, for the logs
        advantages, adv_stats = gdpo_iteration_advantages(raw, scores.weights.cpu(), valid, group_ids, config)
    else:
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


def gdpo_iteration_advantages(raw: Tensor, weights: Tensor, valid: Tensor, group_ids: Tensor,
                              config) -> tuple[Tensor, dict]:
    """``reward.combine: gdpo``: ``flowalign.gdpo.gdpo_advantages`` over the valid samples (invalid ones get 0 and are
    left out of every mean and std: flowalign's rule, where ``nvlabs`` maps NaN to 0), then only the clip to
    ``advantage.clip``. A NaN advantage (an unbiased std of a group with one valid member) is 0. ``zero_std_frac`` is
    the fraction of groups in which every reward is constant."""
    from flowalign.advantages import ZERO_STD
    from flowalign.gdpo import gdpo_advantages

    reward = config.reward
    advantages = torch.zeros(raw.shape[1], dtype=torch.float64)
    kept = valid.nonzero().flatten()
    if len(kept):
        advantages[kept] = gdpo_advantages(
            raw[:, kept].double(), weights.double(), group_ids[kept], variant=reward.gdpo_variant,
            aggregation=reward.gdpo_aggregation, scale_rewards=reward.gdpo_scale_rewards,
            global_std=reward.gdpo_global_std)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    clipped = advantages.abs() > config.advantage.clip
    advantages = advantages.clamp(-config.advantage.clip, config.advantage.clip).float()
    groups = torch.unique(group_ids)
    flat = [bool((raw[:, (group_ids == g) & valid].double().std(dim=1, unbiased=False) < ZERO_STD).all())
            if int(((group_ids == g) & valid).sum()) > 1 else True for g in groups]
    return advantages, {"zero_std_frac": sum(flat) / len(flat), "num_groups": len(flat),
                        "clip_frac": float(clipped[valid].double().mean()) if len(kept) else 0.0}


def check_invalid_fraction(valid: Tensor, limit: float, names) -> None:
    """RuntimeError when more than ``limit`` of the iteration's samples (``valid`` over all processes) are invalid."""
    invalid = int((~valid).sum())
    if invalid > limit * len(valid):
        raise RuntimeError(
            f"{invalid} of the iteration's {len(valid)} samples ({invalid / len(valid):.0%}) have an invalid reward "
            f"(NaN from {', '.join(names)}), more than reward.max_invalid_fraction = {limit:g}: the reward cannot be "
            "trusted to train on. Look at the reward's warnings above (a reward server down or refusing, a judge "
            "whose answers do not parse), fix it, and resume from the last checkpoint (train.resume=latest)")


def skip_reason(config, parts, scores: Scores, global_samples: int) -> str | None:
    """Why the iteration's rewards skip its update (no optimizer step, logged as skipped), or None: more invalid
    rewards than ``reward.skip_invalid_fraction``, or every group with zero reward variance when the parts that train
    then say a batch without signal skips (``Components.skip_without_signal``)."""
    invalid, limit = scores.stats["reward_invalid"] / global_samples, config.reward.skip_invalid_fraction
    if invalid > limit:
        return (f"{invalid:.0%} of the samples have an invalid reward, more than reward.skip_invalid_fraction = "
                f"{limit:g}")
    if scores.stats["zero_std_frac"] >= 1.0 and parts.skip_without_signal():
        return "every group has zero reward variance"
    return None


def state_reward(rewards):
    """``reward(images, metadata, group_ids=None, latents=None)``: the weighted sum of the raw rewards (float64, NaN
    where invalid), how credit estimators score intermediate states (a latent reward needs their ``latents``)."""

    def reward(images: Tensor, metadata: list[dict], group_ids=None, latents: Tensor | None = None) -> Tensor:
        out = score_all(rewards, images.float(), [m["prompt"] for m in metadata], metadata, group_ids=group_ids,
                        latents=None if latents is None else latents.float())
        total = (out.weights[:, None] * out.raw).sum(0).double()
        return torch.where(out.valid, total, torch.full_like(total, math.nan))

    return reward
