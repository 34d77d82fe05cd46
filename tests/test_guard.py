"""GRPO-Guard (loss.grpo.ratio_norm, loss.grpo.step_reweight): RatioNorm on scripted ratios, the 1/(-dt) reweighting
by hand, the rollout's kept velocities, and the first ratio of exactly 1 on every rollout shape."""

import math

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.kernels.sde_reference import gaussian_log_prob, sde_mean_std
from flowalign.losses.grpo import guard_log_ratio, guard_transition_loss, step_reweight
from flowalign.samplers import probe_rollout, rollout, tree_rollout
from flowalign.samplers.tree import TreeSchedule
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from test_trainer import overrides, tiny_model  # noqa: F401  (the module-scoped tiny SD3 fixture)

# A scripted micro-batch of 3 transitions over 2 latent dimensions: d = x' - mu_old, Delta = mu_theta - mu_old.
D = torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 0.0]])
DELTA = torch.tensor([[0.5, 0.5], [0.1, -0.1], [0.2, 0.0]])
SIGMA = torch.tensor([2.0, 2.0, 2.0])


def test_ratio_norm_on_a_scripted_ratio_distribution():
    """By hand: cross = mean(d Delta) = [0, 0.1, 0], square = mean(Delta^2) = [0.25, 0.01, 0.02], sigma = 2.
    plain = (2 cross - square) / (2 sigma^2) = [-0.03125, 0.02375, -0.0025] (= log p_theta - log p_old);
    sample bias: cross / sigma = [0, 0.05, 0];
    batch bias (the code's): 2 (plain + mean(square) / 8) = [-0.0391667, 0.0708333, 0.0183333]."""
    old = torch.full((3, 2), 0.3)
    mean, sample = old + DELTA, old + D
    log_ratio, plain = guard_log_ratio(mean, old, sample, SIGMA, bias="sample")
    torch.testing.assert_close(plain, torch.tensor([-0.03125, 0.02375, -0.0025]), rtol=0, atol=1e-7)
    torch.testing.assert_close(log_ratio, torch.tensor([0.0, 0.05, 0.0]), rtol=0, atol=1e-7)
    # the plain log-ratio is the Gaussian log-prob difference the rollout and Flow-GRPO compute
    std = SIGMA.reshape(3, 1)
    torch.testing.assert_close(plain, gaussian_log_prob(sample, mean, std) - gaussian_log_prob(sample, old, std),
                               rtol=0, atol=1e-6)
    batch, _ = guard_log_ratio(mean, old, sample, SIGMA, bias="batch")
    b = (0.25 + 0.01 + 0.02) / 3 / 8
    expected = torch.tensor([2 * (-0.03125 + b), 2 * (0.02375 + b), 2 * (-0.0025 + b)])
    torch.testing.assert_close(batch, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(batch, torch.tensor([-0.0391667, 0.0708333, 0.0183333]), rtol=0, atol=1e-6)
    # nothing changed: exactly 0 for both readings, however the rest looks
    for bias in ("sample", "batch"):
        zero, plain_zero = guard_log_ratio(old, old, sample, SIGMA, bias=bias)
        assert torch.equal(zero, torch.zeros(3)) and torch.equal(plain_zero, torch.zeros(3))


def test_ratio_norm_removes_the_bias_and_the_step_dependence_of_the_spread():
    """The spec's analytic toy: perturb the velocity by a fixed delta, draw x' from the old step, at a high- and a
    low-noise step. The plain log-ratio's mean is -|Delta mu|^2_m / (2 sigma^2) (ratio below 1, far more at low
    noise); the normalised one has mean 0 and, with delta scaled to give the same |Delta mu|, the same spread."""
    g = torch.Generator().manual_seed(0)
    n, dims, target = 20000, 16, 0.05
    spreads = []
    for sigma, sigma_next in ((0.9, 0.8), (0.2, 0.1)):
        x = torch.randn(n, dims, generator=g)
        v_old = torch.randn(n, dims, generator=g)
        unit, _ = sde_mean_std(x[:1], torch.ones(1, dims), sigma, sigma_next, kind="flow_grpo", noise_level=0.7)
        base, _ = sde_mean_std(x[:1], torch.zeros(1, dims), sigma, sigma_next, kind="flow_grpo", noise_level=0.7)
        coefficient = float((unit - base)[0, 0])  # d mu / d v
        delta = target / coefficient  # |Delta mu| = target at both steps
        old, std = sde_mean_std(x, v_old, sigma, sigma_next, kind="flow_grpo", noise_level=0.7)
        new, _ = sde_mean_std(x, v_old + delta, sigma, sigma_next, kind="flow_grpo", noise_level=0.7)
        sample = old + std * torch.randn(n, dims, generator=g)
        normalised, plain = guard_log_ratio(new, old, sample, std.reshape(-1), bias="sample")
        s = float(std[0, 0])
        bias = target**2 / (2 * s**2)
        assert float(plain.mean()) == pytest.approx(-bias, rel=0.05)  # the deterministic negative shift
        assert float(torch.exp(plain).mean()) < 1
        assert abs(float(normalised.mean())) < 4 * float(normalised.std()) / math.sqrt(n)  # zero-mean
        spreads.append(float(normalised.std()))
    assert spreads[0] == pytest.approx(spreads[1], rel=0.05)  # step-independent spread


def test_step_reweighting_by_hand():
    """1 / (sigma - sigma_next): [1 / 0.25, 1 / 0.05] = [4, 20]; ``none`` is 1."""
    sigma, sigma_next = torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.45])
    torch.testing.assert_close(step_reweight(sigma, sigma_next), torch.tensor([4.0, 20.0]))
    assert torch.equal(step_reweight(sigma, sigma_next, "none"), torch.ones(2))
    with pytest.raises(ValueError, match="unknown step reweighting"):
        step_reweight(sigma, sigma_next, "dt")


def test_guard_loss_and_its_gradient_at_the_first_ratio_by_hand():
    """At v = v_old: rho_hat = 1, so the loss is mean_n(-A_n w_n) = mean(-1 * 4, 2 * 20) = 18, and its gradient
    is -A_n w_n d(log rho_hat_n)/dv / N, with d(log rho_hat)/dv = (x' - mu_old) c / (sigma D) (sample bias; c =
    d mu / d v, the flow_grpo SDE's (1 + std_t^2 (1 - s) / (2 s)) dt)."""
    g = torch.Generator().manual_seed(1)
    x, v_old = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    sigma, sigma_next, level = torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.45]), torch.tensor([0.7, 0.7])
    old, std = sde_mean_std(x, v_old, sigma, sigma_next, kind="flow_grpo", noise_level=level)
    x_next = old + std * torch.randn(2, 3, generator=g)
    advantages, weights = torch.tensor([1.0, -2.0]), step_reweight(sigma, sigma_next)
    v = v_old.clone().requires_grad_(True)
    loss, stats = guard_transition_loss(v, v_old, x, x_next, sigma, sigma_next, advantages, kind="flow_grpo",
                                        noise_level=level, clip_range=2e-6, bias="sample", weights=weights)
    assert float(loss.detach()) == pytest.approx(18.0) and stats["ratio_max"] == 1.0 and stats["clip_frac"] == 0.0
    loss.backward()
    s, dt = sigma.reshape(2, 1), (sigma_next - sigma).reshape(2, 1)
    std_t = 0.7 * torch.sqrt(s / torch.where(s >= 1, 1 - sigma_next.reshape(2, 1), 1 - s))
    c = (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    expected = -(advantages * weights).reshape(2, 1) * (x_next - old) * c / (std * 3) / 2
    torch.testing.assert_close(v.grad, expected, rtol=1e-5, atol=1e-7)


def test_rollouts_keep_the_velocity_of_each_transition_source_when_asked():
    """Chains, trees and probes store, per transition, the velocity at its source (v = 0.5 x here)."""
    velocity = lambda x, sigma, *rest: 0.5 * x  # noqa: E731
    sigmas, levels = torch.linspace(1, 0, 5), torch.tensor([0.7, 0.7, 0.7, 0.0])
    x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    plain = rollout(velocity, x, sigmas, levels, generator=torch.Generator().manual_seed(0))
    assert plain.transitions.velocity is None
    results = [rollout(velocity, x, sigmas, levels, generator=torch.Generator().manual_seed(0), keep_velocity=True),
               tree_rollout(velocity, x, sigmas, levels, TreeSchedule((0, 2), (2, 2), 1.0), keep_velocity=True,
                            generator=torch.Generator().manual_seed(0)),
               probe_rollout(velocity, x, sigmas, levels, (0, 2), 2, keep_velocity=True,
                             generator=torch.Generator().manual_seed(0))]
    for result in results:
        t = result.transitions
        assert t.velocity.shape == t.x_t.shape and torch.equal(t.velocity, 0.5 * t.x_t)
        assert torch.equal(t.select(t.step == 2).velocity, 0.5 * t.select(t.step == 2).x_t)
    assert torch.equal(results[0].final, plain.final)  # keeping them changes nothing else


SHAPES = {
    "group": {},
    "tree": {"rollout.name": "tree", "credit.name": "tree", "rollout.split_steps": "[0, 1]",
             "rollout.branching": "[2]"},
    "probe": {"rollout.name": "probe", "rollout.probe_steps": "[0, 1, 2]", "sampling.batch_size": 12},
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_ratio_norm_keeps_the_first_ratio_at_exactly_one_on_every_shape(tiny_model, tmp_path, shape):  # noqa: F811
    """Several optimizer steps per iteration (3 minibatches, 2 inner epochs): later ratios move off 1 and some are
    clipped, the first is exactly 1."""
    guard = {"loss.grpo.ratio_norm": "true", "loss.grpo.step_reweight": "inverse_dt", "loss.grpo.clip_range": 2e-6,
             "optim.minibatches": 3, "optim.inner_epochs": 2, "train.iterations": 2, "collapse.enabled": "false"}
    config = load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "run", **{**SHAPES[shape], **guard}))
    history = Trainer(config).train()
    for metrics in history:
        assert metrics["first_ratio_max"] == 1.0 and metrics["first_approx_kl"] == 0.0
        assert metrics["ratio_max"] > 1.0 and metrics["clip_frac"] > 0
        assert metrics["guard/log_ratio_std"] > 0 and "guard/plain_ratio_mean" in metrics


def test_guard_settings_are_checked_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="loss.grpo.ratio_norm_bias"):
        load_config(TrainConfig, None, ["loss.grpo.ratio_norm_bias=sample"])
    with pytest.raises(ConfigError, match="loss.grpo.step_reweight"):
        load_config(TrainConfig, None, ["loss.grpo.step_reweight=dt"])
    config = load_config(TrainConfig, None, ["loss.grpo.ratio_norm=true", "loss.grpo.ratio_norm_bias=sample"])
    assert config.components().losses["grpo"].rollout_fields() == {"velocity"}
    assert load_config(TrainConfig, None, []).components().losses["grpo"].rollout_fields() == frozenset()
