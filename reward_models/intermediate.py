"""Rewards of intermediate states: map ``x_t`` to a clean estimate, decode it and score it (DenseGRPO, TP-GRPO).

Two clean estimates of a state ``x`` at sigma ``s = sigmas[k]`` (docs/design/math.md#step-rewards):

* ``"x0"``: the one-step projection ``x0_hat = x - s v(x, s)`` (1 NFE).
* ``"ode"``: an Euler ODE completion. With ``ode_steps=None`` (or at least the ``T - k`` steps left) it follows the
  rollout's own remaining schedule ``sigmas[k:]``, so it reproduces exactly what an ODE rollout from ``x`` would give
  (DenseGRPO: ``R_t = R(decode(ODE(x_t)))``); with ``n`` steps it uses ``n`` steps on the sigmas of the remaining
  schedule picked at evenly spaced indices (TP-GRPO's and the cheaper variants).

A state already at the end of the schedule (``k = T``) is its own clean estimate.

States are batched per schedule position ``k`` (one model call per ODE sub-step for all states at that ``k``), and
scores are cached by a caller-given key (a node id of the iteration's rollout), so a completion computed for one
purpose (say, ``R_{t+1}`` of one transition) is reused for another (``R_t`` of the next). Call ``reset`` at the start
of every iteration. ``nfe`` counts the velocity evaluations spent, through ``samplers.count_nfe``: a velocity that
declares ``evals_per_sample = 2`` (classifier-free guidance) costs two per state.

This module sits below the flowalign core: it takes plain callables, ``velocity(x, sigma, rows)``,
``decode(latents) -> images`` and ``reward(images, rows) -> scores``, where ``rows`` indexes each state's prompt.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch
from torch import Tensor

from flowalign.samplers import count_nfe, ode_step, predict_x0

__all__ = ["CLEAN_ESTIMATES", "IntermediateScorer", "completion_sigmas"]

CLEAN_ESTIMATES = ("x0", "ode")


def completion_sigmas(sigmas: Tensor, k: int, ode_steps: int | None) -> Tensor:
    """The sigmas an ODE completion from ``sigmas[k]`` visits: the remaining schedule, or ``ode_steps`` of it."""
    remaining = sigmas[k:]
    left = remaining.numel() - 1
    if ode_steps is None or ode_steps >= left:
        return remaining
    if ode_steps < 1:
        raise ValueError(f"ode_steps must be >= 1 (or None for the full remaining schedule), got {ode_steps}")
    index = torch.linspace(0, left, ode_steps + 1).round().long()
    return remaining[index]


class IntermediateScorer:
    """Scores of clean estimates of intermediate states, batched per schedule position and cached per key."""

    def __init__(
        self,
        velocity: Callable[[Tensor, Tensor, Tensor], Tensor],
        decode: Callable[[Tensor], Tensor],
        reward: Callable[[Tensor, Tensor], Tensor],
        sigmas: Tensor,
        *,
        estimate: str = "ode",
        ode_steps: int | None = None,
    ):
        if estimate not in CLEAN_ESTIMATES:
            raise ValueError(f"estimate must be one of {CLEAN_ESTIMATES}, got {estimate!r}")
        if ode_steps is not None and ode_steps < 1:
            raise ValueError(f"ode_steps must be >= 1 or None (the full remaining schedule), got {ode_steps}")
        self.velocity, self.decode, self.reward = velocity, decode, reward
        self.sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
        self.estimate, self.ode_steps = estimate, ode_steps
        self.cache: dict[Hashable, float] = {}
        self.nfe = 0

    def reset(self) -> None:
        """Forget the cached scores (a new iteration, a new policy)."""
        self.cache.clear()
        self.nfe = 0

    @torch.no_grad()
    def clean(self, x: Tensor, k: int, rows: Tensor) -> Tensor:
        """Clean estimate of states ``x`` that all sit at ``sigmas[k]``."""
        last = self.sigmas.numel() - 1
        if not 0 <= k <= last:
            raise ValueError(f"schedule position {k} is outside 0..{last}")
        if k == last:
            return x
        sigma = self.sigmas[k]
        if self.estimate == "x0":
            v = self.velocity(x, sigma.expand(x.shape[0]), rows)
            self.nfe += count_nfe(self.velocity, x.shape[0])
            return predict_x0(x, v, sigma).to(x.dtype)
        path = completion_sigmas(self.sigmas, k, self.ode_steps)
        for s, s_next in zip(path[:-1], path[1:]):
            v = self.velocity(x, s.expand(x.shape[0]), rows)
            self.nfe += count_nfe(self.velocity, x.shape[0])
            x = ode_step(x, v, s, s_next)
        return x

    @torch.no_grad()
    def score(self, states: Tensor, positions: Sequence[int] | Tensor, rows: Tensor, keys: Sequence[Hashable]) -> Tensor:
        """Rewards ``[N]`` (float64) of ``states[i]`` at schedule position ``positions[i]`` for prompt row ``rows[i]``;
        cached under ``keys[i]``."""
        positions = [int(p) for p in torch.as_tensor(positions).tolist()]
        rows = torch.as_tensor(rows)
        if not (len(positions) == len(keys) == states.shape[0] == rows.shape[0]):
            raise ValueError("states, positions, rows and keys must have one entry per state")
        out = torch.empty(len(keys), dtype=torch.float64)
        todo: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            if key in self.cache:
                out[i] = self.cache[key]
            else:
                todo.setdefault(positions[i], []).append(i)
        for k, index in sorted(todo.items()):
            pick = torch.tensor(index)
            images = self.decode(self.clean(states[pick], k, rows[pick]))
            scores = torch.as_tensor(self.reward(images, rows[pick]), dtype=torch.float64).flatten()
            for i, value in zip(index, scores.tolist()):
                out[i] = value
                self.cache[keys[i]] = value
        return out
