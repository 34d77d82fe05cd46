"""The samplers against an analytic Gaussian flow.

Data ``x0 ~ N(m, c^2)`` per dimension and ``x_s = (1 - s) x0 + s eps`` make every quantity closed-form:
``x_s ~ N((1 - s) m, V_s)`` with ``V_s = (1 - s)^2 c^2 + s^2``, and the exact rectified-flow velocity
``v(x, s) = E[eps - x0 | x_s = x] = (s - (1 - s) c^2) / V_s * (x - (1 - s) m) - m``.

Two checks per SDE kind and noise level:

1. **Continuous limit.** An SDE with the flow's marginals, integrated with exact velocities, must reproduce the
   data distribution as steps grow. The ODE, ``flow_grpo`` and ``dance`` must match N(m, c^2) after 50 steps.
2. **Exact discrete chain.** With a linear velocity every step is affine-Gaussian, ``x' = alpha x + beta + std z``,
   so the output distribution of the *discrete* chain is Gaussian with mean and variance propagated in closed form.
   The prediction below is written from the papers' formulas independently of ``flowalign.samplers``; the sampled
   output must match it (mean, std and a KS test) at 10 and 50 steps, for every kind including ``cps``.

``cps`` is not marginal-preserving at a fixed noise level: it renoises the posterior *mean* ``x0_hat`` with O(1) noise
per step, and the posterior variance of x0 it drops does not vanish as steps grow (DDIM with eta=O(1)). Its output
std is therefore below ``c`` by the amount the closed-form chain predicts, and check 2 is what pins its formula.
"""

import math

import pytest
import torch
from scipy import stats

from flowalign.samplers import ConstantNoise, rollout, sde_mean_std

M, C = 0.7, 0.4
N_SAMPLES = 20_000
LEVELS = (0.3, 0.7, 1.0)


def cases(*kinds):
    """(kind, level) pairs; the ODE has no noise level, so it runs once."""
    return [(kind, 0.0) if kind == "ode" else (kind, level) for kind in kinds for level in LEVELS if kind != "ode" or level == LEVELS[0]]


def velocity(x, s):
    s = float(s)
    var = (1 - s) ** 2 * C**2 + s**2
    return (s - (1 - s) * C**2) / var * (x - (1 - s) * M) - M


def linear_sigmas(num_steps):
    return torch.cat([torch.linspace(1, 1 / num_steps, num_steps), torch.zeros(1)])


# --- hand-written reference of each step as an affine-Gaussian map (independent of flowalign.samplers) ---------


def reference_step(kind, level, s, s_next):
    """(mu(x) as a python function of scalar x, std) from docs/design/math.md#sde-steps, for the analytic velocity."""
    dt = s_next - s

    def v(x):
        return velocity(torch.tensor(x, dtype=torch.float64), s).item()

    if kind == "ode" or level == 0:
        return (lambda x: x + dt * v(x)), 0.0
    if kind == "flow_grpo":
        std_t = level * math.sqrt(s / (1 - (s_next if s >= 1 else s)))
        return (
            lambda x: x * (1 + std_t**2 * dt / (2 * s)) + v(x) * (1 + std_t**2 * (1 - s) / (2 * s)) * dt,
            std_t * math.sqrt(-dt),
        )
    if kind == "dance":
        def mu(x):
            score = -(x - (x - s * v(x)) * (1 - s)) / s**2
            return x + dt * v(x) - 0.5 * level**2 * score * dt
        return mu, level * math.sqrt(-dt)
    if kind == "cps":
        std = s_next * math.sin(level * math.pi / 2)
        return (lambda x: (x - s * v(x)) * (1 - s_next) + (x + (1 - s) * v(x)) * math.sqrt(s_next**2 - std**2)), std
    raise AssertionError(kind)


def predicted_output(kind, level, num_steps):
    """Mean and std of the discrete chain's output: propagate N(mean, var) through x' = alpha x + beta + std z."""
    sigmas = linear_sigmas(num_steps).double().tolist()
    levels = ConstantNoise(level).levels(num_steps).tolist()
    mean, var = 0.0, 1.0
    for i in range(num_steps):
        mu, std = reference_step(kind, levels[i], sigmas[i], sigmas[i + 1])
        beta = mu(0.0)
        alpha = mu(1.0) - beta
        mean, var = alpha * mean + beta, alpha**2 * var + std**2
    return mean, math.sqrt(var)


def sample_output(kind, level, num_steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, 1, dtype=torch.float64, generator=g).float()
    sde_kind = "flow_grpo" if kind == "ode" else kind
    levels = ConstantNoise(0.0 if kind == "ode" else level).levels(num_steps)
    return rollout(velocity, x, linear_sigmas(num_steps), levels, kind=sde_kind, generator=g).final.flatten().double()


def distribution_mismatch(samples, mean, std, *, mean_tol, std_rel_tol, ks_tol):
    """Empty list when ``samples`` look like N(mean, std^2) within tolerances; else the failed checks."""
    failures = []
    if abs(samples.mean().item() - mean) > mean_tol:
        failures.append(f"mean {samples.mean().item():.4f} vs {mean:.4f}")
    if abs(samples.std().item() / std - 1) > std_rel_tol:
        failures.append(f"std {samples.std().item():.4f} vs {std:.4f}")
    ks = stats.kstest(samples.numpy(), "norm", args=(mean, std)).statistic
    if ks > ks_tol:
        failures.append(f"KS {ks:.4f} > {ks_tol}")
    return failures


# Tolerances. Sampling noise at 20k samples: mean SE 0.003, std SE 0.5%, KS 99th percentile 0.0115.
EXACT = dict(mean_tol=0.012, std_rel_tol=0.025, ks_tol=0.015)
# The continuous-limit check also absorbs Euler's O(1/N) bias at 50 steps (measured <= 2.7% in std).
LIMIT = dict(mean_tol=0.012, std_rel_tol=0.04, ks_tol=0.02)


@pytest.mark.parametrize("kind,level", cases("ode", "flow_grpo", "dance"))
def test_sde_reproduces_data_distribution(kind, level):
    samples = sample_output(kind, level, num_steps=50)
    assert distribution_mismatch(samples, M, C, **LIMIT) == []


@pytest.mark.parametrize("num_steps", [10, 50])
@pytest.mark.parametrize("kind,level", cases("ode", "flow_grpo", "dance", "cps"))
def test_sampler_matches_exact_discrete_chain(kind, level, num_steps):
    mean, std = predicted_output(kind, level, num_steps)
    samples = sample_output(kind, level, num_steps, seed=num_steps)
    assert distribution_mismatch(samples, mean, std, **EXACT) == []


def test_cps_bias_is_the_method_not_the_code():
    """cps keeps the data mean but loses variance, by exactly what the closed-form chain predicts."""
    mean, std = predicted_output("cps", 1.0, 50)
    assert abs(mean - M) < 1e-3 and std < 0.8 * C
    samples = sample_output("cps", 1.0, 50)
    assert distribution_mismatch(samples, M, C, **LIMIT) != []  # not the data distribution...
    assert distribution_mismatch(samples, mean, std, **EXACT) == []  # ...but exactly the predicted one


def wrong_flow_grpo_rollout(level, num_steps, seed=0):
    """flow_grpo with a plausible bug: the drift correction on v misses its (1 - s) factor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, 1, dtype=torch.float64, generator=g).float()
    sigmas = linear_sigmas(num_steps)
    levels = ConstantNoise(level).levels(num_steps)
    for i in range(num_steps):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        v = velocity(x, s)
        if levels[i] == 0:
            x = x + (s_next - s) * v
            continue
        dt = s_next - s
        std_t = level * math.sqrt(s / (1 - (s_next if s >= 1 else s)))
        mean = x * (1 + std_t**2 * dt / (2 * s)) + v * (1 + std_t**2 / (2 * s)) * dt  # bug: no (1 - s)
        x = mean + std_t * math.sqrt(-dt) * torch.randn(x.shape, generator=g)
    return x.flatten().double()


def test_a_wrong_formula_fails_both_checks():
    samples = wrong_flow_grpo_rollout(0.7, 50)
    assert distribution_mismatch(samples, M, C, **LIMIT) != []
    mean, std = predicted_output("flow_grpo", 0.7, 50)
    assert distribution_mismatch(samples, mean, std, **EXACT) != []


def test_implementation_means_agree_with_reference_formulas():
    """Pointwise: sde_mean_std equals the hand-written formulas at a few (s, s', level), s = 1 included."""
    x = torch.tensor([[-1.3], [0.2], [2.0]])
    for kind in ("flow_grpo", "dance", "cps"):
        for s, s_next in [(1.0, 0.9), (0.63, 0.5), (0.2, 0.1), (0.1, 0.0)]:
            if kind == "cps" and s_next == 0.0:
                continue
            v = velocity(x, s)
            mean, std = sde_mean_std(x, v, s, s_next, kind=kind, noise_level=0.7)
            mu, ref_std = reference_step(kind, 0.7, s, s_next)
            expected = torch.tensor([[mu(float(xi))] for xi in x.flatten()])
            torch.testing.assert_close(mean, expected, rtol=1e-5, atol=1e-5)
            assert std.flatten()[0].item() == pytest.approx(ref_std, rel=1e-5)
