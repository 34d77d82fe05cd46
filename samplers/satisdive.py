"""SatisDive: K candidates per prompt steered to clear a batch-relative reward floor while keeping feature diversity.

Reference: Zhai et al., "Traversing the Satisfaction-Diversity Frontier in Text-to-Image Diffusion" (UCF, arXiv
2610.02372); public code ``UCF-CRCV/SatisDive`` at 4497035 (``implementation/flux/ours.py::run_ours_one_prompt``,
``implementation/flux/sde.py::fk_flow_kernel_mean``); the specification is METHODS.md section 4 and
docs/methods/satisdive.md.

Notation (docs/design/math.md#notation): sigma ``s`` falls from 1 to 0, ``ds = s' - s < 0``, ``x0_hat = x - s v``,
``score = -(x + (1 - s) v) / s``. Each prompt runs ``K`` particles (the candidates, rows ``b K .. b K + K - 1``);
step ``i`` has progress ``p = i / (T - 1)``.

Every step is the SDE kernel (``satisdive_kernel``). At a *scoring step* ``i`` in ``S``, before it:

1. **Pass A** (no gradient): ``v_k`` and the generator's feature ``phi_k`` from one forward; ``x0_k = x_k - s v_use``
   with ``v_use = (v_k + v_prev_k) / 2`` (``v_prev``: the velocity of the previous step, when there is one);
   ``r_k = r(x0_k)`` with the differentiable guide reward; ``d_ij = max(1 - cos(phi_i, phi_j), 0)``.
2. **Calibration** at the first scoring step (``calibrate``): ``beta_r``, ``delta``, ``beta_d``, ``max_step``.
3. **Cutoff and penalties**: ``tau = max_k r_k - Delta``, ``q_k = sigmoid((r_k - tau) / beta_r)``, the gated
   diversity ``D_q``, the floor's ``dL/dr_k`` (``floor_gradient``).
4. **Pass B** (gradient): a forward at ``x_k`` with a live feature; ``g_rew = d(dL/dr_k r_k)/dx_k`` (through the
   velocity, or on ``x0_hat`` alone) and ``g_div = dL_div_k/dx_k`` (``diversity_penalty``).
5. **Update** (``satisdive_update``): unit directions, the floor weights ``wf_rel``, per-channel clips at
   ``max_step``, the reward ramp ``0.5 + 1.5 p``, a step of size ``step``.
6. **Clone** when ``p >= clone_from``: re-score after the update, replace each hopeless dud by a copy of an accepted
   peer (``hopeless_duds``, ``clone_donors``).

Two departures from the reference code, each a named option with the reference kept:

* ``velocity``: the reference's SDE step at a scoring step applies pass A's ``v`` (at the pre-update latents) to
  the updated latents, and a cloned particle moves on the donor's latents with its own old velocity (``stale``).
  ``recompute`` (the default) steps with the velocity at the updated (cloned) latents: the clone re-score's forward
  is exactly that velocity (a clone copies the donor's, as its latents are the donor's), so only the scoring steps
  before ``clone_from`` pay one more forward per particle.
* ``step_scale``: the reference moves by ``step`` latent units (``absolute``, ``step`` 1), so its relative step
  depends on the latent size (about ``1 / 512`` of ``||x||`` on FLUX at 1024^2, ``1 / 32`` on the toy model).
  ``relative`` (the default) moves by ``step * mean_k ||x_k||`` at the calibration step (``step`` 0.03).

NFEs per prompt, counted call by call (``e`` = ``evals_per_sample``, 2 with CFG; a backward pass through the
transformer costs what its forward did; ``C`` = the clone steps, those of ``S`` with ``p >= clone_from``)::

    e K (T + |S| (2 + b) + |C| + (|S| - |C|) [velocity == recompute])       b = 1 (gradient full) or 0 (x0)

(``satisdive_nfe``): one forward per step (pass A is the step's own), per scoring step a pass-B forward, the reward
backward (full) and the diversity backward (through the blocks up to the feature block, counted as a whole one), one
re-score forward per clone step and one recompute forward per other scoring step.

Randomness: the initial noise, the SDE noise and the clone donors of prompt ``b`` come from ``generators[b]``;
``reference_seeds`` reproduces the reference's per-step generators instead (``seed + 7919 (i + 1)`` for the noise,
``seed + 104729 (i + 1)`` for the donors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .guided import BudgetTooSmall, GuidedResult, as_scores, check_sampling, initial_noise
from .rgs import x0_hat_gradient
from .rollout import count_nfe
from .sde import predict_x0, sde_mean_std, standard_normal

__all__ = [
    "CLONE_SEED_STRIDE",
    "NOISE_SEED_STRIDE",
    "REWARD_GRADIENTS",
    "STEP_SCALES",
    "VELOCITY_MODES",
    "Calibration",
    "acceptance",
    "calibrate",
    "clip_rows",
    "clone_donors",
    "clone_steps",
    "cosine_distances",
    "default_scoring_steps",
    "diversity_penalty",
    "floor_cutoff",
    "floor_gradient",
    "gated_diversity",
    "hopeless_duds",
    "kernel_noise_level",
    "lower_median",
    "pair_values",
    "reference_generator",
    "reward_ramp",
    "satisdive_kernel",
    "satisdive_nfe",
    "satisdive_sampling",
    "satisdive_update",
    "unit_rows",
]

VELOCITY_MODES = ("recompute", "stale")
STEP_SCALES = ("relative", "absolute")
REWARD_GRADIENTS = ("full", "x0")
# The reference's per-step seed strides (seed + stride * (i + 1)).
NOISE_SEED_STRIDE = 7919
CLONE_SEED_STRIDE = 104729
# Plain Euler (no drift correction, no noise) within this distance of sigma 1 and 0.
KERNEL_EDGE = 1e-3
DEFAULT_STEP = {"relative": 0.03, "absolute": 1.0}

VelocityFeatures = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
LatentReward = Callable[[Tensor, Tensor], Tensor]


# ------------------------------------------------------------------------------------------------ the kernel


def kernel_noise_level(sigma: float, a: float) -> float:
    """``eta(s) = a sqrt(s (1 - s))``: the kernel's diffusion coefficient (0 outside ``[0, 1]``)."""
    s = float(sigma)
    return float(a) * math.sqrt(max(s * (1.0 - s), 0.0))


def satisdive_kernel(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor,
                     a: float) -> tuple[Tensor, float]:
    """The SDE step's ``(mean fp32, std)`` (``fk_flow_kernel_mean`` of the reference)::

        mean = x + ds v - ds (eta^2 / 2) score,   score = -(x + (1 - s) v) / s,   eta = a sqrt(s (1 - s))
        std  = eta sqrt(|ds|)

    which is ``flowalign.samplers.sde``'s ``dance`` kind at the time-varying level ``eta(s)`` (METHODS.md section 0,
    identity 1). Plain Euler, ``mean = x + ds v`` and ``std = 0``, when ``s >= 1 - 1e-3``, ``s <= 1e-3`` or
    ``eta = 0``."""
    s, s_next = float(sigma), float(sigma_next)
    eta = kernel_noise_level(s, a)
    if eta <= 0.0 or s <= KERNEL_EDGE or s >= 1.0 - KERNEL_EDGE:
        return x.float() + (s_next - s) * v.float(), 0.0
    mean, std = sde_mean_std(x, v, s, s_next, kind="dance", noise_level=eta)
    return mean, eta * math.sqrt(abs(s_next - s))


# ------------------------------------------------------------------------------------------------ schedule and cost


def default_scoring_steps(num_steps: int) -> list[int]:
    """The reference's scoring pattern scaled to ``T`` steps: ``round(j T / 7)`` for ``j = 1..6`` (FLUX's 28 steps
    give 4, 8, .., 24; SANA's 20 give 3, 6, 9, 11, 14, 17 against the reference's 3, 6, .., 18), distinct and in
    ``1..T-1``."""
    steps = sorted({int(math.floor(j * num_steps / 7 + 0.5)) for j in range(1, 7)})
    return [i for i in steps if 1 <= i <= num_steps - 1] or [0]


def _progress(i: int, num_steps: int) -> float:
    return i / max(num_steps - 1, 1)


def clone_steps(scoring_steps: Sequence[int], num_steps: int, clone_from: float) -> list[int]:
    """The scoring steps with ``p = i / (T - 1) >= clone_from``, where the clone rule runs."""
    return [i for i in sorted(scoring_steps) if _progress(i, num_steps) >= clone_from]


def satisdive_nfe(num_steps: int, scoring_steps: Sequence[int], candidates: int, *, clone_from: float = 0.5,
                  velocity: str = "recompute", gradient: str = "full", evals_per_sample: int = 1) -> int:
    """NFEs per prompt of one SatisDive run (module docstring); the sampler counts the same call by call."""
    scoring = len(set(scoring_steps))
    clones = len(clone_steps(set(scoring_steps), num_steps, clone_from))
    backward = 1 if gradient == "full" else 0
    recompute = scoring - clones if velocity == "recompute" else 0
    return evals_per_sample * candidates * (num_steps + scoring * (2 + backward) + clones + recompute)


# ------------------------------------------------------------------------------------------------ calibration


def cosine_distances(features: Tensor) -> Tensor:
    """``d_ij = max(1 - cos(phi_i, phi_j), 0)`` for features ``[..., K, d]`` -> ``[..., K, K]`` (fp32)."""
    unit = F.normalize(features.float(), dim=-1)
    return (1.0 - unit @ unit.transpose(-1, -2)).clamp_min(0.0)


def pair_values(matrix: Tensor) -> Tensor:
    """The pairs ``i < j`` of ``[..., K, K]`` in ``torch.triu_indices`` order (row-major) -> ``[..., K (K - 1) / 2]``."""
    k = matrix.shape[-1]
    i, j = torch.triu_indices(k, k, offset=1, device=matrix.device)
    return matrix[..., i, j]


def lower_median(values: Tensor) -> Tensor:
    """The median over the last dimension, the *lower* middle value for an even count (``torch.median``'s, as the
    reference: of K = 4's six pairs, the third smallest)."""
    return values.median(dim=-1).values


@dataclass
class Calibration:
    """Per-prompt constants fixed at the first scoring step (each ``[B]``)::

        beta_r   = max(std_k r_k, 1e-3)                  (unbiased std)
        delta    = lower_median_{i<j} d_ij * delta_scale (the diversity cutoff)
        beta_d   = max(delta / 2, 1e-3)
        max_step = 0.1 mean_k ||x_k||                    (latent_norm = mean_k ||x_k||)
    """

    beta_r: Tensor
    delta: Tensor
    beta_d: Tensor
    max_step: Tensor
    latent_norm: Tensor

    def as_lists(self) -> dict[str, list[float]]:
        return {name: getattr(self, name).tolist() for name in ("beta_r", "delta", "beta_d", "max_step",
                                                                "latent_norm")}


def calibrate(rewards: Tensor, distances: Tensor, latents: Tensor, delta_scale: float = 1.0) -> Calibration:
    """``Calibration`` from rewards ``[B, K]``, feature distances ``[B, K, K]`` and latents ``[B, K, ...]``."""
    r = rewards.float()
    beta_r = r.std(dim=1, unbiased=True).clamp_min(1e-3)
    delta = lower_median(pair_values(distances.float())) * float(delta_scale)
    beta_d = (0.5 * delta).clamp_min(1e-3)
    norm = latents.float().flatten(2).norm(dim=2).mean(dim=1)
    return Calibration(beta_r=beta_r, delta=delta, beta_d=beta_d, max_step=0.1 * norm, latent_norm=norm)


# ------------------------------------------------------------------------------------------------ cutoff and penalties


def floor_cutoff(rewards: Tensor, margin: float) -> Tensor:
    """``tau = max_k r_k - Delta`` per prompt: rewards ``[B, K]`` -> ``[B]``."""
    return rewards.float().max(dim=1).values - float(margin)


def _col(value: Tensor | float, like: Tensor) -> Tensor:
    """A scalar or ``[B]`` value as ``[B, 1]`` against ``like [B, K]``."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    return value.reshape(-1, 1) if value.ndim else value


def acceptance(rewards: Tensor, tau: Tensor | float, beta_r: Tensor | float) -> Tensor:
    """``q_k = sigmoid((r_k - tau) / beta_r)``, the soft acceptance ``[B, K]``."""
    r = rewards.float()
    return torch.sigmoid((r - _col(tau, r)) / _col(beta_r, r))


def gated_diversity(q: Tensor, distances: Tensor) -> Tensor:
    """``D_q = sum_{i<j} q_i q_j d_ij / (sum_{i<j} q_i q_j + 1e-6)`` per prompt: ``q [B, K]``, ``d [B, K, K]`` ->
    ``[B]``."""
    k = q.shape[-1]
    i, j = torch.triu_indices(k, k, offset=1, device=q.device)
    qq = q.float()[:, i] * q.float()[:, j]
    return (qq * pair_values(distances.float())).sum(dim=1) / (qq.sum(dim=1) + 1e-6)


def floor_gradient(rewards: Tensor, tau: Tensor | float, beta_r: Tensor | float, lam_r: float = 1.0) -> Tensor:
    """``dL/dr_k = -(lam_r / beta_r) sigmoid((tau - r_k) / beta_r)``, the derivative of the reward floor
    ``L_r = lam_r softplus((tau - r) / beta_r)``: ``[B, K]``."""
    r = rewards.float()
    beta = _col(beta_r, r)
    return -(float(lam_r) / beta) * torch.sigmoid((_col(tau, r) - r) / beta)


def diversity_penalty(live: Tensor, features: Tensor, q: Tensor, distances: Tensor, delta: Tensor | float,
                      beta_d: Tensor | float) -> Tensor:
    """``L_div_k = softplus((delta - D_q^(k)) / beta_d)`` for every particle ``k``: ``[B, K]``.

    ``D_q^(k)`` is ``D_q`` with the distances of the pairs involving ``k`` replaced by live ones,
    ``max(1 - cos(live_k, phi_j), 0)`` (``live [B, K, d]``: row ``k`` the feature of particle ``k`` from a forward
    that keeps the graph), while the ``q`` products, the other features ``phi [B, K, d]``, the other distances and
    the denominator stay those of pass A (detached). So ``L_div_k`` depends on particle ``k``'s latents only and one
    backward of ``sum L_div`` gives every particle its own gradient."""
    k = q.shape[-1]
    i, j = torch.triu_indices(k, k, offset=1, device=q.device)
    qd, fixed = q.detach().float(), features.detach().float()
    qq = qd[:, i] * qd[:, j]  # [B, P]
    denominator = qq.sum(dim=1) + 1e-6
    d_fixed = pair_values(distances.detach().float())  # [B, P]
    unit_live, unit_fixed = F.normalize(live.float(), dim=-1), F.normalize(fixed, dim=-1)
    d_live = (1.0 - unit_live @ unit_fixed.transpose(-1, -2)).clamp_min(0.0)  # [B, K(live), K(fixed)]
    owner = torch.arange(k, device=q.device)[:, None]  # [K, 1]
    involves = (i[None] == owner) | (j[None] == owner)  # [K, P]
    other = torch.where(i[None] == owner, j[None], i[None])  # [K, P]
    live_pairs = torch.gather(d_live, 2, other[None].expand(d_live.shape[0], k, -1))  # [B, K, P]
    pairs = torch.where(involves[None], live_pairs, d_fixed[:, None, :])
    d_q = (qq[:, None, :] * pairs).sum(dim=2) / denominator[:, None]
    delta, beta_d = _col(delta, q), _col(beta_d, q)
    return F.softplus((delta - d_q) / beta_d)


# ------------------------------------------------------------------------------------------------ the update


def _row_norm(g: Tensor) -> Tensor:
    return g.float().flatten(1).norm(dim=1).reshape(-1, *([1] * (g.ndim - 1)))


def unit_rows(g: Tensor, eps: float = 1e-12) -> Tensor:
    """``g / max(||g||, eps)`` per row (a particle): fp32."""
    return g.float() / _row_norm(g).clamp_min(eps)


def clip_rows(g: Tensor, max_norm: Tensor | float, eps: float = 1e-12) -> Tensor:
    """``g min(max_norm / ||g||, 1)`` per row (``||g||`` clamped at ``eps``); ``max_norm`` a scalar or ``[rows]``."""
    size = _row_norm(g).clamp_min(eps)
    limit = torch.as_tensor(max_norm, dtype=torch.float32, device=g.device)
    limit = limit.reshape(-1, *([1] * (g.ndim - 1))) if limit.ndim else limit
    return g.float() * (limit / size).clamp(max=1.0)


def reward_ramp(p: float) -> float:
    """The reward channel's weight ``w_rew = 0.5 + 1.5 p`` (0.5 at the start, 2 at the end)."""
    return 0.5 + 1.5 * float(p)


def satisdive_update(x: Tensor, g_rew: Tensor, g_div: Tensor, floor_grad: Tensor, max_step: Tensor | float,
                     step: Tensor | float, p: float, lam_r: float = 1.0, lam_d: float = 1.0) -> Tensor:
    """One update of the latents ``x [B K, ...]`` (prompt-major rows) from the raw gradients of the two penalties::

        u_rew, u_div = g_rew / ||g_rew||, g_div / ||g_div||                  (per particle, norms clamped at 1e-12)
        wf_rel_k     = |dL/dr_k| / max(max_k' |dL/dr_k'|, 1e-12)            (within the prompt)
        x           <- x - step [w_rew clip(lam_r wf_rel u_rew) + clip(lam_d u_div)],   w_rew = 0.5 + 1.5 p

    ``clip(g) = g min(max_step / ||g||, 1)`` per particle and channel. ``floor_grad [B, K]`` is ``dL/dr``;
    ``max_step`` and ``step`` are scalars or ``[B]``. Returns fp32. Both channels are unit directions, so the move is
    ``step (w_rew wf_rel + 1)`` long whatever the raw gradients' sizes (while ``max_step`` exceeds ``lam``)."""
    groups, k = floor_grad.shape
    if x.shape[0] != groups * k:
        raise ValueError(f"x has {x.shape[0]} rows for {groups} prompts of {k} particles")
    weights = floor_grad.float().abs()
    relative = (weights / weights.max(dim=1, keepdim=True).values.clamp_min(1e-12)).reshape(-1)
    shape = (-1, *([1] * (x.ndim - 1)))
    limit = _per_row(max_step, groups, k, x.device)
    rew = clip_rows(float(lam_r) * relative.reshape(shape) * unit_rows(g_rew), limit)
    div = clip_rows(float(lam_d) * unit_rows(g_div), limit)
    size = _per_row(step, groups, k, x.device).reshape(shape)
    return x.float() - size * (reward_ramp(p) * rew + div)


def _per_row(value: Tensor | float, groups: int, k: int, device) -> Tensor:
    """A scalar or per-prompt ``[B]`` value as ``[B K]`` (one per particle row)."""
    value = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    return value.expand(groups).repeat_interleave(k) if value.numel() in (1, groups) else value


# ------------------------------------------------------------------------------------------------ the clone rule


def hopeless_duds(rescored: Tensor, previous: Tensor | None, tau: Tensor | float, beta_r: Tensor | float,
                  remaining: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(accepted, dud, hopeless)`` masks ``[B, K]`` from the rewards re-scored after the update ``r_cd [B, K]``::

        accepted = sigmoid((r_cd - tau) / beta_r) > 0.5      (tau of pass A)
        dud      = r_cd < tau
        hopeless = dud and r_cd + max(r_cd - r_prev, 0) n_remaining < tau

    ``r_prev`` (``previous``) is ``r_cd`` at the previous clone step; at the first (``None``) the gain is infinite, so
    nothing is hopeless there (as in the reference, where ``inf * 0`` at a last step gives NaN, never below
    ``tau``). ``remaining`` counts the scoring steps after this one."""
    r = rescored.float()
    t = _col(tau, r)
    accepted = acceptance(r, tau, beta_r) > 0.5
    dud = r < t
    if previous is None:
        return accepted, dud, torch.zeros_like(dud)
    projected = r + (r - previous.float()).clamp_min(0.0) * int(remaining)
    return accepted, dud, dud & (projected < t)


def clone_donors(accepted: Tensor, hopeless: Tensor, generator: torch.Generator) -> list[tuple[int, int]]:
    """``[(w, donor), ...]`` for one prompt's masks ``[K]``: each hopeless ``w`` in index order gets a donor drawn
    uniformly among the accepted particles other than ``w`` (one ``torch.randint(n, (1,))`` from ``generator`` per
    hopeless particle with a donor; none is drawn when no particle is accepted)."""
    pool = torch.nonzero(accepted.cpu()).flatten()
    pairs: list[tuple[int, int]] = []
    if pool.numel() == 0:
        return pairs
    for w in torch.nonzero(hopeless.cpu()).flatten().tolist():
        donors = pool[pool != w]
        if donors.numel() == 0:
            continue
        pick = int(torch.randint(donors.numel(), (1,), generator=generator, device=generator.device))
        pairs.append((w, int(donors[pick])))
    return pairs


def reference_generator(seed: int, step: int, stride: int) -> torch.Generator:
    """The reference's per-step CPU generator ``manual_seed(seed + stride (step + 1))`` (``NOISE_SEED_STRIDE`` for the
    SDE noise, ``CLONE_SEED_STRIDE`` for the clone donors)."""
    return torch.Generator().manual_seed(int(seed) + int(stride) * (int(step) + 1))


# ------------------------------------------------------------------------------------------------ the sampler


def _check_settings(num_steps: int, scoring: Sequence[int], candidates: int, margin: float, velocity: str,
                    step_scale: str, gradient: str) -> list[int]:
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 2:
        raise ValueError(f"SatisDive needs at least 2 candidates per prompt (its floor and diversity are set-"
                         f"relative), got {candidates!r}")
    if not (math.isfinite(margin) and margin >= 0):
        raise ValueError(f"SatisDive's floor margin Delta must be a finite number >= 0, got {margin!r}")
    for name, value, allowed in (("velocity", velocity, VELOCITY_MODES), ("step_scale", step_scale, STEP_SCALES),
                                 ("gradient", gradient, REWARD_GRADIENTS)):
        if value not in allowed:
            raise ValueError(f"unknown SatisDive {name} {value!r}: expected one of {', '.join(allowed)}")
    steps = sorted({int(i) for i in scoring})
    if not steps or steps[0] < 0 or steps[-1] > num_steps - 1:
        raise ValueError(f"SatisDive's scoring steps must be at least one step in 0..{num_steps - 1}, got "
                         f"{list(scoring)!r}")
    return steps


def _pass_b(velocity_features, guide_reward, x, sigma, rows, v_prev, features, q, distances, cal, floor_grad,
            through_velocity: bool, chunk: int | None) -> tuple[Tensor, Tensor, int]:
    """Pass B: ``(g_rew, g_div, rows passed)`` with every candidate's live feature and, ``through_velocity``, the reward
    gradient through its velocity (else ``g_rew`` is zero here). ``chunk`` rows at a time (default: all): each
    candidate's penalties depend on its own latents only, so chunks give the same gradients with less memory. The
    rows passed count one forward, one diversity backward and (``through_velocity``) one reward backward each."""
    n, s = x.shape[0], float(sigma)
    prompts, k = q.shape
    g_rew = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    g_div = torch.zeros_like(g_rew)
    fixed = features.detach().reshape(n, -1)
    passes = 0
    size = n if chunk is None else int(chunk)
    for start in range(0, n, size):
        part = slice(start, min(start + size, n))
        count = part.stop - part.start
        with torch.enable_grad():
            x_in = x[part].detach().requires_grad_(True)
            v_live, phi_live = velocity_features(x_in, sigma, rows[part])
            passes += count
            live = fixed.clone()
            live[part] = phi_live.float()
            penalty = diversity_penalty(live.reshape(prompts, k, -1), features, q, distances, cal.delta,
                                        cal.beta_d).reshape(n)[part]
            if through_velocity:
                v_use = v_live.float() if v_prev is None else 0.5 * (v_live.float() + v_prev[part])
                scores = guide_reward(predict_x0(x_in, v_use, s), rows[part]).reshape(count)
                (grad,) = torch.autograd.grad((floor_grad.reshape(n)[part] * scores).sum(), x_in, retain_graph=True)
                g_rew[part] = grad.float()
                passes += count
            (grad,) = torch.autograd.grad(penalty.sum(), x_in, allow_unused=True)
            passes += count
        if grad is not None:
            g_div[part] = grad.float()
    return g_rew, g_div, passes


def satisdive_sampling(
    velocity_features: VelocityFeatures,
    guide_reward: LatentReward,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    candidates: int,
    *,
    margin: float,
    final_reward: LatentReward | None = None,
    budget: int | None = None,
    scoring_steps: Sequence[int] | None = None,
    clone_from: float = 0.5,
    sde_a: float = 0.3,
    lam_r: float = 1.0,
    lam_d: float = 1.0,
    delta_scale: float = 1.0,
    step: float | None = None,
    step_scale: str = "relative",
    velocity: str = "recompute",
    gradient: str = "full",
    grad_chunk: int | None = None,
    reference_seeds: Sequence[int] | None = None,
    initial: Tensor | None = None,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """SatisDive over ``B = len(generators)`` prompts with ``K = candidates`` particles each (module docstring).

    ``velocity_features(x, sigma, rows) -> (v, phi [n, d])`` gives the velocity and the generator's feature from one
    forward (with the graph when called under grad); ``guide_reward(x0, rows)`` is the differentiable reward that
    steers (its values set ``tau``); ``final_reward`` scores the returned candidates (NaN without one). ``margin``
    is the floor ``Delta`` in the guide reward's units. ``step`` defaults to 0.03 (``relative``: of the mean latent
    norm at calibration) or 1 (``absolute``, the reference). ``scoring_steps`` default to
    ``default_scoring_steps(T)``. ``budget`` (per prompt), when given, must cover ``satisdive_nfe`` (else
    ``BudgetTooSmall``); the run spends exactly that. ``grad_chunk`` rows go through pass B at a time (default: all
    ``B K``; 1 holds one candidate's graph at a time, as the reference). ``initial`` (``[B K, ...]``) replaces the
    initial noise.

    Returns ``final [B, K, ...]`` in trajectory order (the set is the output: nothing is sorted or dropped),
    ``reward [B, K]`` (``final_reward`` of the final latents), ``nfe [B]`` and ``info`` (the calibration, the
    scoring steps' trace and the clones)."""
    sigmas = check_sampling(sigmas, "dance", 0.0, generators)
    num_steps = sigmas.numel() - 1
    scoring = _check_settings(num_steps, default_scoring_steps(num_steps) if scoring_steps is None
                              else scoring_steps, candidates, margin, velocity, step_scale, gradient)
    if reference_seeds is not None and len(reference_seeds) != len(generators):
        raise ValueError(f"reference_seeds needs one seed per prompt ({len(generators)}), got {len(reference_seeds)}")
    step = DEFAULT_STEP[step_scale] if step is None else float(step)
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"SatisDive's step must be a finite number > 0, got {step!r}")
    if grad_chunk is not None and (isinstance(grad_chunk, bool) or not isinstance(grad_chunk, int) or grad_chunk < 1):
        raise ValueError(f"grad_chunk must be a number of rows >= 1, got {grad_chunk!r}")
    cloning = set(clone_steps(scoring, num_steps, clone_from))
    evals = count_nfe(velocity_features, 1)
    cost = satisdive_nfe(num_steps, scoring, candidates, clone_from=clone_from, velocity=velocity, gradient=gradient,
                         evals_per_sample=evals)
    if budget is not None and budget < cost:
        raise BudgetTooSmall(
            f"budget={budget} NFEs per prompt cannot pay for SatisDive's {candidates} candidates over {num_steps} "
            f"steps with {len(scoring)} scoring steps: that costs {cost} NFEs; raise --budget to at least {cost}")

    prompts, k = len(generators), candidates
    rows = torch.arange(prompts, device=device).repeat_interleave(k)
    n = rows.numel()
    if initial is not None:
        if tuple(initial.shape) != (n, *shape):
            raise ValueError(f"initial latents must be [{n}, {', '.join(map(str, shape))}], got "
                             f"{tuple(initial.shape)}")
        x = initial.to(device).float()
    else:
        x = initial_noise(shape, generators, rows, device)
    spent = 0
    v_prev: Tensor | None = None
    cal: Calibration | None = None
    size: Tensor | None = None  # the step per prompt
    previous_rescore: Tensor | None = None
    trace, clones = [], []

    def grouped(t: Tensor) -> Tensor:
        return t.reshape(prompts, k, *t.shape[1:])

    for i in range(num_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        s = float(sigma)
        with torch.no_grad():
            v, phi = velocity_features(x, sigma, rows)
        spent += n * evals
        v, phi = v.detach().float(), phi.detach().float()
        if i in scoring:
            p = _progress(i, num_steps)
            v_use = v if v_prev is None else 0.5 * (v + v_prev)
            x0 = predict_x0(x, v_use, s)
            with torch.no_grad():
                r = grouped(guide_reward(x0, rows).detach().float().reshape(n))
            d = cosine_distances(grouped(phi))
            if cal is None:
                cal = calibrate(r, d, grouped(x), delta_scale)
                size = cal.latent_norm * step if step_scale == "relative" else torch.full((prompts,), step)
            tau = floor_cutoff(r, margin)
            q = acceptance(r, tau, cal.beta_r)
            floor_grad = floor_gradient(r, tau, cal.beta_r, lam_r)
            g_rew, g_div, passes = _pass_b(velocity_features, guide_reward, x, sigma, rows, v_prev, grouped(phi), q, d,
                                           cal, floor_grad, gradient == "full", grad_chunk)
            spent += passes * evals
            if gradient == "x0":
                g_rew = floor_grad.reshape(n, *([1] * len(shape))) * x0_hat_gradient(guide_reward, x, v_use, s, rows)
            g_rew, g_div = torch.nan_to_num(g_rew.float()), torch.nan_to_num(g_div.float())
            x_new = satisdive_update(x, g_rew, g_div, floor_grad, cal.max_step, size, p, lam_r, lam_d)
            record = {"step": i, "sigma": s, "p": p, "rewards": r.tolist(), "tau": tau.tolist(), "q": q.tolist(),
                      "diversity": gated_diversity(q, d).tolist(), "floor_weights": floor_grad.abs().tolist(),
                      "moved": grouped((x_new.float() - x.float()).flatten(1).norm(dim=1)).tolist(),
                      "rescored": None, "clones": []}
            x = x_new
            v_step = v
            if i in cloning:
                with torch.no_grad():
                    v_cd, _ = velocity_features(x, sigma, rows)
                spent += n * evals
                v_cd = v_cd.detach().float()
                # the reference's x0 of the re-score averages the fresh velocity with this step's pass-A one
                with torch.no_grad():
                    r_cd = grouped(guide_reward(x - s * 0.5 * (v_cd + v), rows).detach().float().reshape(n))
                remaining = sum(1 for c in scoring if c > i)
                accepted, _, hopeless = hopeless_duds(r_cd, previous_rescore, tau, cal.beta_r, remaining)
                v_step = v_cd if velocity == "recompute" else v
                for b in range(prompts):
                    if not (accepted[b].any() and hopeless[b].any()):
                        continue
                    generator = (reference_generator(reference_seeds[b], i, CLONE_SEED_STRIDE)
                                 if reference_seeds is not None else generators[b])
                    for w, donor in clone_donors(accepted[b], hopeless[b], generator):
                        x[b * k + w] = x[b * k + donor]
                        if velocity == "recompute":
                            v_step[b * k + w] = v_cd[b * k + donor]
                        clones.append((i, b, w, donor))
                        record["clones"].append((b, w, donor))
                previous_rescore = r_cd
                record["rescored"] = r_cd.tolist()
            elif velocity == "recompute":
                with torch.no_grad():
                    v_step, _ = velocity_features(x, sigma, rows)
                spent += n * evals
                v_step = v_step.detach().float()
            v = v_step
            trace.append(record)
        v_prev = v
        with torch.no_grad():
            mean, std = satisdive_kernel(x, v, sigma, sigma_next, sde_a)
            if std > 0:
                if reference_seeds is not None:
                    noise = torch.cat([torch.randn((k, *shape), generator=reference_generator(seed, i,
                                       NOISE_SEED_STRIDE), dtype=torch.float32) for seed in reference_seeds])
                    noise = noise.to(x.device)
                else:
                    noise = standard_normal(tuple(x.shape), generators, x.device, owner=rows)
                mean = mean + std * noise
            x = mean.float()
    x = x.detach()
    if final_reward is None:
        scores = torch.full((prompts, k), float("nan"), dtype=torch.float64)
    else:
        with torch.no_grad():
            scores = as_scores(final_reward(x, rows), n).reshape(prompts, k)
    if spent != cost * prompts:  # counted call by call; the formula must agree
        raise RuntimeError(f"SatisDive spent {spent} NFEs for {prompts} prompts, expected {cost * prompts}")
    return GuidedResult(
        final=x.reshape(prompts, k, *shape),
        reward=scores,
        nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
        info={"candidates": k, "scoring_steps": scoring, "clone_steps": sorted(cloning), "trajectory_nfe": cost,
              "calibration": None if cal is None else cal.as_lists(),
              "step_size": None if size is None else size.tolist(), "trace": trace, "clones": clones},
    )
