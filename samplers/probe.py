"""Branch-at-step probes (TempFlow-GRPO): an ODE trunk, SDE children at chosen steps, each ODE-completed.

Reference: He et al. 2025, "TempFlow-GRPO: When Timing Matters for GRPO in Flow Models" (arXiv:2508.04324), and
docs/design/math.md#step-rewards. For each prompt a deterministic ODE trunk runs from its initial noise. At every *probe
step* ``j`` the
trunk state ``x_j`` branches into ``K`` SDE children ``x_{j+1}^k ~ N(mu(x_j), std_j^2)``, and each child is
completed to an image by the ODE. The reward of that completion is the *process reward* of the one stochastic
transition ``x_j -> x_{j+1}^k``: everything else on its path is deterministic, so the reward difference between
siblings is credited to exactly one step. The trainer normalises it over the ``K`` siblings (one group per prompt
and probe step).

Cost. The trunk evaluates the velocity once per prompt at steps ``0..max(probe_steps)`` (the children reuse the
trunk's evaluation at their probe step), and each child costs one evaluation per remaining step:
``P (max_j + 1) + P K sum_j (T - j - 1)``. All children alive at a step, from every probe and prompt, go through the
model in one batched call; the trunk has its own call, at the batch size the trainer's recomputation uses.

Layout. Completions (``final``) are ordered prompt-major, then probe step, then child: row
``(p * len(probe_steps) + b) * K + k``. ``velocity(x, sigma, prompt)`` receives each row's prompt index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .rollout import Rollout, Transitions, check_rollout_inputs, count_nfe
from .sde import ode_step, sde_step, standard_normal

__all__ = ["ProbeRollout", "probe_nfe", "probe_rollout"]

PromptVelocity = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass
class ProbeRollout(Rollout):
    """A finished probe rollout: ``transitions`` holds only the probe edges (one per completion, in ``final``'s
    order); ``probe_steps`` and ``children`` describe the layout."""

    probe_steps: tuple[int, ...]
    children: int


def probe_nfe(num_steps: int, probe_steps: Sequence[int], children: int, prompts: int = 1) -> int:
    """Velocity evaluations of a probe rollout (CFG-free); see the module docstring."""
    steps = _check_probe_steps(probe_steps, num_steps)
    return prompts * (steps[-1] + 1) + prompts * children * sum(num_steps - j - 1 for j in steps)


def _check_probe_steps(probe_steps: Sequence[int], num_steps: int) -> tuple[int, ...]:
    steps = tuple(int(s) for s in probe_steps)
    if not steps:
        raise ValueError("probe_steps is empty: give at least one step to branch at")
    if steps[0] < 0 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"probe_steps must be non-negative and strictly increasing, got {list(steps)}")
    if steps[-1] >= num_steps:
        raise ValueError(f"probe_steps {list(steps)} reach past the last step ({num_steps - 1})")
    return steps


@torch.no_grad()
def probe_rollout(
    velocity: PromptVelocity,
    x_init: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    probe_steps: Sequence[int],
    children: int,
    *,
    kind: str = "flow_grpo",
    reduce: str = "mean",
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    prompt_ids: Tensor | None = None,
    keep_velocity: bool = False,
) -> ProbeRollout:
    """Run the trunks from ``x_init`` (one row per prompt) and probe them at ``probe_steps``.

    ``noise_levels[j]`` is the SDE level of the children drawn at step ``j`` (it must be > 0 there; the trunk and the
    completions are ODE whatever the table says elsewhere). With a list of generators, prompt ``p``'s children draw
    from ``generator[p]``. ``group_id`` of a probe edge is ``p * len(probe_steps) + b``. With ``keep_velocity`` each
    probe edge stores the trunk's velocity at its source (``Transitions.velocity``).
    """
    sigmas, noise_levels = check_rollout_inputs(sigmas, noise_levels, kind, reduce, x_init.device)
    num_steps = sigmas.numel() - 1
    steps = _check_probe_steps(probe_steps, num_steps)
    if children < 1:
        raise ValueError(f"children must be >= 1, got {children}")
    ode = [j for j in steps if float(noise_levels[j]) <= 0]
    if ode:
        raise ValueError(f"probe steps {ode} have noise level 0: their children would all equal the trunk")
    prompts, device = x_init.shape[0], x_init.device
    if isinstance(generator, (list, tuple)) and len(generator) != prompts:
        raise ValueError(f"got {len(generator)} generators for {prompts} prompts: give one per prompt")
    prompt_ids = torch.arange(prompts, device=device) if prompt_ids is None else torch.as_tensor(prompt_ids, device=device)
    rows = torch.arange(prompts, device=device)
    n_probe = len(steps)

    # Storage: the trunk states x_j at the probe steps (P per probe), then the children (P * K per probe), both
    # probe-major. The trunk is evaluated in its own call at the prompts' batch size, the same composition the
    # trainer's recomputation uses, so the first log-prob ratio is exactly 1.
    trunk_states, child_states, step_of, std_of, logp_of, v_of = [], [], [], [], [], []
    alive: list[tuple[Tensor, Tensor]] = []  # (states, prompt of each row), one entry per probe so far
    x, nfe = x_init, 0
    for i in range(num_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        if alive:  # complete every child drawn so far, all probes and prompts in one call
            states, owners = torch.cat([a for a, _ in alive]), torch.cat([o for _, o in alive])
            x_next = ode_step(states, velocity(states, sigma, owners), sigma, sigma_next)
            nfe += count_nfe(velocity, states.shape[0])
            alive = [(part, owner) for part, (_, owner) in zip(x_next.split([a.shape[0] for a, _ in alive]), alive)]
        if i > steps[-1]:
            continue
        v = velocity(x, sigma, rows)
        nfe += count_nfe(velocity, prompts)
        if i in steps:
            owner = rows.repeat_interleave(children)
            noise = standard_normal((x.shape[0] * children, *x.shape[1:]), generator, device, owner=owner)
            out = sde_step(x.repeat_interleave(children, 0), v.repeat_interleave(children, 0), sigma, sigma_next,
                           kind=kind, noise_level=float(noise_levels[i]), noise=noise, reduce=reduce)
            child = out.prev_sample
            trunk_states.append(x)
            child_states.append(child)
            step_of.append(torch.full((child.shape[0],), i, device=device))
            std_of.append(out.std.float())
            logp_of.append(out.log_prob)
            if keep_velocity:
                v_of.append(v.repeat_interleave(children, 0))
            alive.append((child, owner))
        x = ode_step(x, v, sigma, sigma_next)

    # Storage position (probe b, prompt p, child k) -> completion index (p * n_probe + b) * K + k.
    k = torch.arange(children, device=device).repeat(prompts * n_probe)
    owner = rows.repeat_interleave(children).repeat(n_probe)
    probe = torch.arange(n_probe, device=device).repeat_interleave(prompts * children)
    order = torch.argsort((owner * n_probe + probe) * children + k)  # storage positions in completion order
    kids = torch.cat(child_states)
    num_trunk = prompts * n_probe
    step = torch.cat(step_of)[order]
    transitions = Transitions(
        states=torch.cat([*trunk_states, kids]),
        src=(probe * prompts + owner)[order],
        dst=num_trunk + order,
        step=step,
        sigma=sigmas[:-1].float()[step],
        sigma_next=sigmas[1:].float()[step],
        noise_level=noise_levels.to(device)[step],
        std=torch.cat(std_of)[order],
        noise_scale=torch.ones(kids.shape[0], device=device),
        log_prob=torch.cat(logp_of)[order],
        stochastic=torch.ones(kids.shape[0], dtype=torch.bool, device=device),
        sample_id=torch.arange(kids.shape[0], device=device),
        group_id=(prompt_ids[owner] * n_probe + probe)[order],
        prompt_id=owner[order],
        kind=kind,
        reduce=reduce,
        velocity=torch.cat(v_of)[order] if keep_velocity else None,
    )
    final = torch.cat([a for a, _ in alive])[order]
    return ProbeRollout(transitions=transitions, final=final, nfe=nfe, probe_steps=steps, children=children)
