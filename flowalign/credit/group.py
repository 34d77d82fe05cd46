"""The ``group`` credit estimator: every transition of a trajectory gets its terminal group advantage (Flow-GRPO,
Liu et al. 2025, eq. 5). The normalisation itself is ``flowalign.advantages.group_advantages``, computed once over
the gathered batch before credit is assigned."""

from __future__ import annotations

from flowalign.components import ComponentConfig
from flowalign.credit.base import BatchScores, Credit, CreditContext, CreditEstimator, register_credit

__all__ = ["GroupCredit"]


@register_credit("group", config=ComponentConfig)
class GroupCredit(CreditEstimator):
    """every transition of a trajectory gets its terminal group advantage (Flow-GRPO)."""

    shapes = ("group", "probe")

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        t = batch.rollout.transitions
        return Credit(scores.advantages.to(t.step.device)[t.sample_id])
