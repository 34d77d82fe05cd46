"""Rollouts that return transitions, not just images.

Everything the trainer trains is a transition ``x_t -> x_{t+1}`` (docs/design/math.md#iteration). States are stored
once, as nodes;
a transition points at its source and destination node. A group of independent trajectories is a forest of chains,
and a tree (later) is the same structure with shared source nodes, so one loss path serves every rollout shape.

``rollout`` takes a plain ``velocity(x, sigma) -> v`` callable: samplers never know what a model is, and an optional
``guidance(x, v, sigma, sigma_next, step) -> mean shift or None`` that moves the mean of the SDE steps
(``sde_step(..., mean_shift=...)``; Euphonium's process-reward guidance is one).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
from torch import Tensor

from .sde import check_kind, check_log_prob_under, check_noise_level, check_reduce, check_sigmas, ode_step, sde_step

Velocity = Callable[[Tensor, Tensor], Tensor]
MeanShift = Callable[[Tensor, Tensor, Tensor, Tensor, int], "Tensor | None"]


@dataclass
class Transitions:
    """A set of transitions over shared state storage. Per-transition fields have shape ``[N]``.

    ``states[src]`` is ``x_t`` and ``states[dst]`` is ``x_{t+1}``. ``std`` is the transition std actually used to draw
    the sample (0 for ODE steps) and ``log_prob`` its log-density under the rollout policy (0 for ODE steps);
    ``noise_scale`` is the factor by which that std exceeds the SDE's own (1 except on a tree's split edges), so a
    recomputed log-prob uses the same density.
    ``sample_id`` is the trajectory (final image) a transition belongs to; ``group_id`` and ``prompt_id`` index the
    GRPO group and the prompt (the row of the conditioning batch).
    ``log_prob_shift`` (``[N, ...]`` like the states, or None) is the mean shift the log-prob was taken under, for
    rollouts guided with ``log_prob_under="guided"``: the recomputed log-prob is then that of ``x_next - shift``
    under the policy's unguided mean (``flowalign.samplers.sde.guided_log_prob_sample``).
    ``velocity`` (``[N, ...]`` like the states, in the velocity's dtype, or None) is the rollout policy's velocity at
    each transition's source, kept only when asked (``keep_velocity``): what a loss needs to rebuild the old policy's
    transition mean exactly (GRPO-Guard's RatioNorm).
    """

    states: Tensor
    src: Tensor
    dst: Tensor
    step: Tensor
    sigma: Tensor
    sigma_next: Tensor
    noise_level: Tensor
    std: Tensor
    noise_scale: Tensor
    log_prob: Tensor
    stochastic: Tensor
    sample_id: Tensor
    group_id: Tensor
    prompt_id: Tensor
    kind: str = "flow_grpo"
    reduce: str = "mean"
    log_prob_shift: Tensor | None = None
    velocity: Tensor | None = None

    @property
    def x_t(self) -> Tensor:
        return self.states[self.src]

    @property
    def x_next(self) -> Tensor:
        return self.states[self.dst]

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def per_transition_fields(self) -> list[str]:
        return [f.name for f in fields(self)
                if f.name not in ("states", "kind", "reduce") and getattr(self, f.name) is not None]

    def select(self, index: Tensor) -> "Transitions":
        """The transitions picked by a boolean mask or an index tensor; the state storage is shared."""
        return replace(self, **{name: getattr(self, name)[index] for name in self.per_transition_fields()})

    def to(self, device: torch.device | str) -> "Transitions":
        moved = {name: getattr(self, name).to(device) for name in self.per_transition_fields()}
        return replace(self, states=self.states.to(device), **moved)


@dataclass
class Rollout:
    """A finished rollout: all its transitions, the final latents (one per trajectory) and its cost in NFEs."""

    transitions: Transitions
    final: Tensor
    nfe: int


def count_nfe(velocity: Velocity, batch: int) -> int:
    """Transformer evaluations of one call: batch rows times ``velocity.evals_per_sample`` (2 with CFG)."""
    return batch * int(getattr(velocity, "evals_per_sample", 1))


def check_rollout_inputs(sigmas: Tensor, noise_levels: Tensor, kind: str, reduce: str, device) -> tuple[Tensor, Tensor]:
    """Checked ``(sigmas on device, fp32 noise_levels [T])`` for a rollout of ``len(sigmas) - 1`` steps."""
    sigmas = check_sigmas(sigmas).to(device)
    check_kind(kind)
    check_reduce(reduce)
    num_steps = sigmas.numel() - 1
    noise_levels = torch.as_tensor(noise_levels, dtype=torch.float32)
    if noise_levels.shape != (num_steps,):
        raise ValueError(f"noise_levels must have one entry per step ({num_steps}), got shape {tuple(noise_levels.shape)}")
    check_noise_level(noise_levels, kind)
    return sigmas, noise_levels


@torch.no_grad()
def rollout(
    velocity: Velocity,
    x_init: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    *,
    kind: str = "flow_grpo",
    reduce: str = "mean",
    generator: torch.Generator | list[torch.Generator] | None = None,
    group_ids: Tensor | None = None,
    prompt_ids: Tensor | None = None,
    guidance: MeanShift | None = None,
    log_prob_under: str = "unguided",
    keep_velocity: bool = False,
) -> Rollout:
    """Integrate from ``x_init`` (at ``sigmas[0]``) over ``len(sigmas) - 1`` steps.

    Step ``i`` is an SDE step of ``kind`` when ``noise_levels[i] > 0`` and an ODE step otherwise. ``group_ids`` and
    ``prompt_ids`` default to one group/prompt per row. Noise comes from ``generator`` (or one generator per row);
    states keep ``x_init``'s dtype.

    ``guidance(x, v, sigma, sigma_next, step)``, called on every step after the velocity (so it may record what it
    reads at every state), returns the shift of an SDE step's mean (``[B, ...]``) or None (always None on ODE steps); the log-prob is taken under the unguided or the guided mean
    (``log_prob_under``, ``sde_step``). With ``"guided"`` the shifts are stored in ``Transitions.log_prob_shift``.
    With ``keep_velocity`` every step's velocity is stored in ``Transitions.velocity``.
    """
    check_log_prob_under(log_prob_under)
    sigmas, noise_levels = check_rollout_inputs(sigmas, noise_levels, kind, reduce, x_init.device)
    num_steps = sigmas.numel() - 1
    batch, device = x_init.shape[0], x_init.device
    rows = torch.arange(batch, device=device)
    group_ids = rows if group_ids is None else torch.as_tensor(group_ids, device=device)
    prompt_ids = rows if prompt_ids is None else torch.as_tensor(prompt_ids, device=device)

    states, stds, log_probs, shifts, velocities, nfe = [x_init], [], [], [], [], 0
    x = x_init
    for i in range(num_steps):
        sigma, sigma_next, level = sigmas[i], sigmas[i + 1], float(noise_levels[i])
        v = velocity(x, sigma)
        nfe += count_nfe(velocity, batch)
        if keep_velocity:
            velocities.append(v)
        shift = None if guidance is None else guidance(x, v, sigma, sigma_next, i)
        if shift is not None and level == 0:
            raise ValueError(f"guidance returned a mean shift for step {i}, an ODE step (noise level 0): only SDE "
                             "steps have a mean to shift")
        if level > 0:
            out = sde_step(x, v, sigma, sigma_next, kind=kind, noise_level=level, reduce=reduce, generator=generator,
                           mean_shift=shift, log_prob_under=log_prob_under)
            x, std, log_prob = out.prev_sample, out.std, out.log_prob
            shifts.append(shift)
        else:
            shifts.append(None)
            x = ode_step(x, v, sigma, sigma_next)
            std = log_prob = torch.zeros(batch, device=device)
        states.append(x)
        stds.append(std.float())
        log_probs.append(log_prob)

    steps = torch.arange(num_steps, device=device).repeat_interleave(batch)
    per_step = lambda values: torch.as_tensor(values, device=device).float().repeat_interleave(batch)  # noqa: E731
    transitions = Transitions(
        states=torch.stack(states).flatten(0, 1),  # node id = step * batch + row
        src=steps * batch + rows.repeat(num_steps),
        dst=(steps + 1) * batch + rows.repeat(num_steps),
        step=steps,
        sigma=per_step(sigmas[:-1]),
        sigma_next=per_step(sigmas[1:]),
        noise_level=per_step(noise_levels),
        std=torch.cat(stds),
        noise_scale=torch.ones(num_steps * batch, device=device),
        log_prob=torch.cat(log_probs),
        stochastic=per_step(noise_levels) > 0,
        sample_id=rows.repeat(num_steps),
        group_id=group_ids.repeat(num_steps),
        prompt_id=prompt_ids.repeat(num_steps),
        kind=kind,
        reduce=reduce,
        log_prob_shift=stored_shifts(shifts, x_init) if log_prob_under == "guided" else None,
        velocity=torch.cat(velocities) if keep_velocity else None,
    )
    return Rollout(transitions=transitions, final=x, nfe=nfe)


def stored_shifts(shifts: list, like: Tensor) -> Tensor | None:
    """The per-step shifts as one fp32 ``[T * B, ...]`` tensor (zeros for unguided steps), None when none was given."""
    if all(shift is None for shift in shifts):
        return None
    zero = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    return torch.cat([zero if shift is None else shift.float() for shift in shifts])
