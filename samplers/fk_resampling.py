"""FK steering's resampling decision as its reference code makes it, in log space: pure functions on reward tensors.

Reference: Singhal et al. 2025, "A General Framework for Inference-time Scaling and Steering of Diffusion Models"
(arXiv:2501.06848); code ``zacharyhorvitz/Fk-Diffusion-Steering``,
``text_to_image/fkd_diffusers/fkd_class.py::FKD.resample`` (specification: docs/design/math.md#guided-sampling).
``flowalign.samplers.fk`` re-exports these names and runs them in ``fk_steering_reference``.

**Schedule** (``fk_schedule``). Of the loop indices ``i = 0..T-1`` only
``{t_start, t_start + freq, ..., <= t_end} ∪ {T - 1}`` are *active*; the last index always is.

**Carried state** per particle (``FKState``), changed only by an active call: ``pop``, the lineage's "used" reward
(seeded with ``reward_min_value = 0``), and ``log Π``, the log of the product of the potentials it was resampled by
(seeded with 0, i.e. ``Π = 1``). Nothing else: no cumulative importance weight.

**One active call** on the rewards ``r [N]`` of one prompt's particles (``fk_resample_step``):

1. the potential's value ``u`` and log-weight ``ℓ`` (``fk_log_weights``):

   * ``max``:  ``u = max(r, pop)``, ``ℓ = λ u`` (the 0 seed floors the potential: a negative reward counts as 0);
   * ``add``:  ``u = r + pop`` (the lineage's running sum), ``ℓ = λ u``;
   * ``diff``: ``u = r``, ``ℓ = λ (r - pop)`` (against the lineage's previous raw reward, 0 at the first call);
   * ``rt``:   ``u = r``, ``ℓ = λ r``;

2. at the **last index** (``i = T - 1``) ``max``, ``add`` and ``rt`` use ``ℓ - log Π`` (the final correction that
   makes the product of the potentials telescope); ``diff`` does not;
3. a NaN reward (or a NaN reached through ``pop``) gives ``ℓ = -inf``, weight 0; ``w̃ = softmax(ℓ)``,
   ``ESS = 1 / sum w̃²``, threshold ``ess_threshold · N`` (0.5 N);
4. resample iff ``ESS < threshold`` in adaptive mode, and at the last index in either mode; in fixed mode every other
   active index resamples (its ESS is only reported);
5. on resampling, ``idx = draw(w̃)`` (N ancestors; by default multinomial with replacement from the prompt's
   generator), ``pop ← u[idx]``, ``log Π ← log Π[idx] + ℓ[idx]``; otherwise ``pop ← u`` unpermuted, ``log Π``
   unchanged, and this call's weights are discarded (never multiplied into the next call's). If every weight is zero
   (every reward NaN) the particles are kept, the state updates as without resampling, and the decision says
   ``degenerate``.

**Where flowalign differs from the reference, on purpose**: it stays in log space. The reference computes
``w = clamp(exp(λ u), 0, 1e10)`` (and ``Π`` as a product of such weights), so for ``λ u > ln 1e10 ≈ 23`` every
weight saturates at ``1e10``: at ``λ = 10`` PickScore-scale rewards ``[21.5, 22.0, 22.4, 23.1]`` look equal to it
(``ESS = N``, no adaptive resampling; uniform draws in fixed mode), where ``softmax(ℓ)`` puts ≈ 0.999 on the last
particle and resamples. Wherever no weight reaches ``1e10`` and ``Π`` stays finite, the two agree to rounding given the
same ancestors (tests/test_fk_reference.py checks it on cases recorded from the reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["POTENTIALS", "FKDecision", "FKState", "fk_log_weights", "fk_resample_step", "fk_schedule",
           "multinomial_draw"]

POTENTIALS = ("max", "add", "diff", "rt")

# normalised weights [N] -> N ancestor indices in 0..N-1
AncestorDraw = Callable[[Tensor], Tensor]


def check_potential(kind: str) -> None:
    if kind not in POTENTIALS:
        raise ValueError(f"unknown FK potential {kind!r}: expected one of {', '.join(POTENTIALS)}")


def fk_schedule(num_steps: int, start: int = 0, every: int = 1, end: int | None = None) -> list[int]:
    """The active loop indices, ascending: ``{start, start + every, ..., <= end} ∪ {num_steps - 1}`` (``end``
    defaults to the last index ``num_steps - 1``; indices past it are dropped). The reference's
    ``resampling_t_start``, ``resample_frequency``, ``resampling_t_end`` and ``time_steps``."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"the first resampling index must be an integer >= 0, got {start!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"the resampling interval must be an integer >= 1, got {every!r}")
    last = num_steps - 1
    end = last if end is None else min(int(end), last)
    return sorted(set(range(start, end + 1, every)) | {last})


@dataclass(frozen=True)
class FKState:
    """What a prompt's ``N`` particles carry between active calls: ``pop [N]`` (the lineage's used reward) and
    ``log_prod [N]`` (``log Π``, the log of the product of the potentials it was resampled by), float64."""

    pop: Tensor
    log_prod: Tensor

    @classmethod
    def initial(cls, particles: int, reward_min_value: float = 0.0) -> "FKState":
        """The state before the first active call: ``pop = reward_min_value`` (0, the reference's default) and
        ``log Π = 0``."""
        return cls(torch.full((particles,), float(reward_min_value), dtype=torch.float64),
                   torch.zeros(particles, dtype=torch.float64))

    def __len__(self) -> int:
        return int(self.pop.numel())

    def select(self, index: Tensor) -> "FKState":
        """The rows ``index`` (slices of a state over several prompts)."""
        return FKState(self.pop[index], self.log_prod[index])


@dataclass(frozen=True)
class FKDecision:
    """One active call's numbers: ``u`` (the potential's value, the next ``pop`` of each particle), ``log_weights``
    ``ℓ`` (with the last index's ``- log Π``; ``-inf`` for NaN), normalised ``weights`` (zeros when ``degenerate``),
    ``ess`` (0 when ``degenerate``), ``threshold`` (``ess_threshold · N``), ``resampled``, ``degenerate`` (every weight
    zero, or an infinite one, so no normalised weights: particles kept) and ``ancestors`` (the identity when not resampled)."""

    u: Tensor
    log_weights: Tensor
    weights: Tensor
    ess: float
    threshold: float
    resampled: bool
    degenerate: bool
    ancestors: Tensor


def fk_log_weights(rewards: Tensor, state: FKState, *, potential: str, lam: float,
                   last: bool) -> tuple[Tensor, Tensor]:
    """``(u, ℓ)`` for raw ``rewards [N]`` (NaN allowed) and the carried ``state``: steps 1-3 of the module docstring
    (the potential, the last index's ``- log Π`` for max / add / rt, NaN -> ``-inf``). float64."""
    check_potential(potential)
    r = torch.as_tensor(rewards).detach().double().flatten().cpu()
    if r.numel() != len(state):
        raise ValueError(f"got {r.numel()} rewards for a state of {len(state)} particles")
    if potential == "max":
        u = torch.maximum(r, state.pop)  # NaN propagates, as torch.max does in the reference
        log_w = lam * u
    elif potential == "add":
        u = r + state.pop
        log_w = lam * u
    elif potential == "diff":
        u = r
        log_w = lam * (r - state.pop)
    else:
        u = r
        log_w = lam * r
    if last and potential != "diff":
        log_w = log_w - state.log_prod
    return u, torch.nan_to_num(log_w, nan=-math.inf)


def multinomial_draw(generator: torch.Generator | None = None) -> AncestorDraw:
    """The default ancestor draw: ``N`` multinomial draws with replacement from normalised weights ``[N]``, from
    ``generator`` (the prompt's)."""

    def draw(weights: Tensor) -> Tensor:
        return torch.multinomial(weights, weights.numel(), replacement=True, generator=generator)

    return draw


def fk_resample_step(rewards: Tensor, state: FKState, *, potential: str, lam: float, last: bool, adaptive: bool,
                     ess_threshold: float = 0.5, draw: AncestorDraw | None = None,
                     generator: torch.Generator | None = None) -> tuple[Tensor, FKState, FKDecision]:
    """One active call of the reference's ``FKD.resample`` for one prompt's ``N`` particles, in log space (module
    docstring): ``(ancestors [N], new_state, decision)``.

    ``last``: this is the last loop index (``T - 1``): the ``- log Π`` correction, and the ESS test in either mode.
    ``adaptive``: resample only when ``ESS < ess_threshold · N``; otherwise (fixed mode) every non-last active index
    resamples. ``draw`` maps the normalised weights to ``N`` ancestor indices (default ``multinomial_draw(generator)``);
    inject one to replay given ancestors. ``ancestors`` is ``arange(N)`` when the particles are kept.
    """
    if not 0 < ess_threshold <= 1:
        raise ValueError(f"ess_threshold must lie in (0, 1], got {ess_threshold!r}")
    u, log_w = fk_log_weights(rewards, state, potential=potential, lam=lam, last=last)
    n = u.numel()
    threshold = ess_threshold * n
    keep = torch.arange(n)
    if not bool(torch.isfinite(log_w).any()) or bool(torch.isposinf(log_w).any()):
        # every weight zero (the reference's multinomial would fail); +inf (an infinite reward) has no softmax either
        decision = FKDecision(u, log_w, torch.zeros(n, dtype=torch.float64), 0.0, threshold, False, True, keep)
        return keep, FKState(u, state.log_prod), decision
    weights = torch.softmax(log_w, dim=0)
    ess = float(1.0 / (weights**2).sum())
    resample = ess < threshold if (adaptive or last) else True
    if not resample:
        decision = FKDecision(u, log_w, weights, ess, threshold, False, False, keep)
        return keep, FKState(u, state.log_prod), decision
    ancestors = (multinomial_draw(generator) if draw is None else draw)(weights)
    ancestors = torch.as_tensor(ancestors, dtype=torch.long).flatten().cpu()
    if ancestors.numel() != n or bool(((ancestors < 0) | (ancestors >= n)).any()):
        raise ValueError(f"the ancestor draw must return {n} indices in 0..{n - 1}, got {ancestors.tolist()}")
    new_state = FKState(u[ancestors], state.log_prod[ancestors] + log_w[ancestors])
    return ancestors, new_state, FKDecision(u, log_w, weights, ess, threshold, True, False, ancestors)

