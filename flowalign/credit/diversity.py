"""The ``diversity`` credit estimator: GARDO's diversity-aware advantages within a group.

He et al. 2025, "GARDO: Reinforcing Diffusion Models without Reward Hacking" (arXiv 2512.24138); the reference code is
``PerPromptStatTracker.update(..., type='gardo')`` in ``flow_grpo/stat_tracking.py`` of tinnerhrhe/GARDO (and
yifan123/flow_grpo). For the ``K`` images of one group, with unit embeddings ``f_i`` (DINOv3 there; any registered
image embedding here, ``flowalign.embeddings``: ``toy_scene`` on the toy world):

    d_i = min_{j != i} (1 - clip(cos(f_i, f_j), -1, 1))             the nearest neighbour's cosine distance
    w_i = d_i / mean_group(d)    if R_i >= mean_group(R),   else 1
    A_i = (R_i - mean_group(R)) w_i                                   (std: none, the reference code: no division)
    A_i = Ahat_i w_i                                                  (std: advantage: the run's normalised advantage)

clipped to ``advantage.clip``. An image that duplicates another of its group gets ``d = 0``: a high reward earns it
nothing, while a distinct one with the same reward earns more than its plain advantage. A group whose distances are all
0 keeps ``w = 1``. Invalid samples (a non-finite reward) get 0 and are left out of the group's mean, distances and
weights. Groups are whole in a rollout chunk (``whole_prompts``), so a 2-process run equals a 1-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.credit.base import BatchScores, Credit, CreditContext, CreditEstimator, register_credit
from flowalign.settings import option

__all__ = ["DiversityCredit", "DiversityCreditConfig", "diversity_advantages", "nearest_neighbour_distances"]


def nearest_neighbour_distances(embeddings: Tensor) -> Tensor:
    """``d_i = min_{j != i} (1 - clip(cos(f_i, f_j), -1, 1))`` of ``embeddings [K, D]`` (L2-normalised here);
    float64 ``[K]`` (0 for ``K = 1``)."""
    f = embeddings.double()
    f = f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)
    k = f.shape[0]
    if k < 2:
        return torch.zeros(k, dtype=torch.float64)
    distance = 1.0 - (f @ f.T).clamp(-1.0, 1.0)
    distance.fill_diagonal_(float("inf"))
    return distance.min(dim=1).values


def diversity_advantages(rewards: Tensor, embeddings: Tensor, group_ids: Tensor, valid: Tensor | None = None, *,
                         base: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """GARDO's ``(advantages, weights)`` (module docstring), float64 ``[n]`` each, for ``rewards [n]`` and
    ``embeddings [n, D]`` of samples in groups ``group_ids``. ``base`` (``[n]``) replaces ``R - mean_group(R)`` (the
    ``std: advantage`` reading); unclipped."""
    n = rewards.shape[0]
    valid = torch.ones(n, dtype=torch.bool) if valid is None else valid.bool().cpu()
    valid = valid & torch.isfinite(rewards.cpu())
    advantages = torch.zeros(n, dtype=torch.float64)
    weights = torch.ones(n, dtype=torch.float64)
    r = rewards.double().cpu()
    for g in torch.unique(group_ids.cpu()):
        members = ((group_ids.cpu() == g) & valid).nonzero().flatten()
        if len(members) == 0:
            continue
        mean = r[members].mean()
        d = nearest_neighbour_distances(embeddings[members])
        scale = d.mean()
        w = torch.where((r[members] >= mean) & (scale > 0), d / scale.clamp_min(1e-300),
                        torch.ones_like(d))
        centred = r[members] - mean if base is None else base.double().cpu()[members]
        advantages[members] = centred * w
        weights[members] = w
    return advantages, weights


@dataclass
class DiversityCreditConfig(ComponentConfig):
    embedding: str = option("auto", "image embedding of the nearest-neighbour distance (flowalign.embeddings: auto = "
                            "toy_scene on the toy world, pixels elsewhere; clip, dreamsim)")
    embedding_kwargs: dict[str, Any] = option({}, "constructor arguments of the embedding (dreamsim: {path: DIR})")
    std: Literal["none", "advantage"] = option(
        "none", "the advantage the weight multiplies: R - mean_group(R), no std (the reference code), or the run's "
        "group-normalised advantage (advantage.std)")

    def validate(self) -> None:
        from flowalign.embeddings import check_embedding

        check_embedding(self.embedding, self.embedding_kwargs, key="embedding")


@register_credit("diversity", config=DiversityCreditConfig)
class DiversityCredit(CreditEstimator):
    """GARDO's diversity-aware advantage: above-mean samples' advantages times their normalised nearest-neighbour
    embedding distance within the group."""

    shapes = ("group",)
    whole_prompts = True

    def set_up(self, parts) -> None:
        from flowalign.embeddings import build_embedding, resolve_embedding

        name = resolve_embedding(self.config.embedding, parts.config.model.path)
        self.embedding = build_embedding(name, **self.config.embedding_kwargs)
        self.clip = parts.config.advantage.clip

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        from flowalign.embeddings import embed_samples

        if scores.images is None:
            raise RuntimeError("credit.name = diversity needs the batch's decoded images (BatchScores.images)")
        t = batch.rollout.transitions
        group_ids = batch.sample_ids // context.config.data.group_size
        embeddings = embed_samples(self.embedding, scores.images)  # a video: its frames' mean
        base = scores.advantages if self.config.std == "advantage" else None
        advantages, weights = diversity_advantages(scores.combined, embeddings, group_ids, scores.valid, base=base)
        advantages = advantages.clamp(-self.clip, self.clip).float()
        stats = {"credit/diversity_weight_max": float(weights.max()),
                 "credit/diversity_weight_min": float(weights.min())}
        return Credit(advantages.to(t.step.device)[t.sample_id], stats=stats)
