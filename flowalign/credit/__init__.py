"""Credit estimators: how an iteration's rewards become one advantage (and a weight) per transition.

A ``CreditEstimator`` is registered in ``CREDIT`` with its settings (``credit: {name: tree, fusion: mean}``). It
declares which rollout shapes it accepts (``shapes``), whether a rollout chunk and a process must hold whole prompts
(``whole_prompts``: step rewards are normalised per group from the states of one chunk), the rollout hooks it needs
(``rollout_hooks``), and ``assign(batch, scores, context) -> Credit``: per-transition advantages, per-transition weights
that multiply the step weighting's (``None``: all 1), the NFEs it spent (ODE completions, register reads) and stats.

Built in: ``group`` (the terminal group advantage on every transition, Flow-GRPO), ``tree`` (BranchGRPO's depth-wise
tree advantages with fusion and pruning), ``dense``, ``return_to_go`` and ``turning_point`` (step rewards from
ODE-completed states: DenseGRPO, TP-GRPO), ``registers`` (step rewards from latent reward registers) and ``vgpo``
(VGPO's value-anchored advantages from the instant rewards of one-step clean estimates;
``value_anchored_advantages`` is its math for one group) and ``euphonium`` (Euphonium's process-reward-guided rollouts
and outcome plus process advantages; ``euphonium_advantages`` is its math) and ``diversity`` (GARDO's
diversity-aware advantages from image embeddings within a group; ``diversity_advantages`` is its math).

The protocol (registry, base class, dataclasses) is ``flowalign.credit.base``; this package re-exports it and imports
the built-in modules so they register.
"""

from flowalign.credit.base import (CREDIT, BatchScores, Credit, CreditContext, CreditEstimator, register_credit,
                                   trained_mask)
# The built-in estimators and step components register themselves on import.
from flowalign.credit import diversity, euphonium, group, register_grpo, steps, step_credit, tree, vgpo  # noqa: F401
from flowalign.credit.diversity import diversity_advantages
from flowalign.credit.euphonium import euphonium_advantages
from flowalign.credit.value_anchored import value_anchored_advantages

__all__ = ["CREDIT", "BatchScores", "Credit", "CreditContext", "CreditEstimator", "diversity_advantages",
           "euphonium_advantages", "register_credit", "trained_mask", "value_anchored_advantages"]
