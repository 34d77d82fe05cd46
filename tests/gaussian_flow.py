"""An analytic Gaussian flow for sampler tests: data ``x0 ~ N(M, C^2)`` per dimension, ``x_s = (1 - s) x0 + s eps``.

The exact rectified-flow velocity is ``v(x, s) = (s - (1 - s) C^2) / V_s * (x - (1 - s) M) - M`` with
``V_s = (1 - s)^2 C^2 + s^2`` (see test_samplers_analytic for the derivation).
"""

import torch

M, C = 0.7, 0.4


def gaussian_velocity(x, s, *owner):
    """The exact velocity; ``s`` a scalar or a ``[batch]`` tensor. Extra arguments (a tree or prompt index) are
    ignored, so it serves chain, tree and probe rollouts alike."""
    if torch.is_tensor(s) and s.ndim:
        s = s.reshape(-1, *[1] * (x.ndim - 1)).float()
    else:
        s = float(s)
    var = (1 - s) ** 2 * C**2 + s**2
    return (s - (1 - s) * C**2) / var * (x - (1 - s) * M) - M


class Counting:
    """The Gaussian velocity, recording each call's ``(sigma, batch rows, owner indices)``: the NFEs."""

    def __init__(self):
        self.calls = []

    def __call__(self, x, s, owner=None):
        self.calls.append((round(float(s), 4), x.shape[0], None if owner is None else owner.tolist()))
        return gaussian_velocity(x, s)

    @property
    def batches(self):
        return [rows for _, rows, _ in self.calls]


def sigmas(num_steps):
    """Uniform sigmas from 1 to 1/num_steps, then 0."""
    return torch.cat([torch.linspace(1, 1 / num_steps, num_steps), torch.zeros(1)])


def levels(num_steps, level=0.7):
    """A constant noise level with the last step ODE."""
    out = torch.full((num_steps,), level)
    out[-1] = 0.0
    return out


# The guided samplers' callables on this flow: velocity(x, sigma, rows), reward(x0, rows), one generator a prompt.


class CountingVelocity:
    """The Gaussian flow's velocity with ``(x, sigma, rows)``, counting rows per prompt (the NFEs)."""

    def __init__(self, prompts):
        self.per_prompt = [0] * prompts

    def __call__(self, x, sigma, rows):
        for r in rows.tolist():
            self.per_prompt[r] += 1
        return gaussian_velocity(x, sigma)


def mean_reward(x0, rows):
    return x0.flatten(1).mean(dim=1)


def generators(n, seed=0):
    return [torch.Generator().manual_seed(seed * 100 + i) for i in range(n)]
