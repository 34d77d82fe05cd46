"""The SDE step kinds are a registry (flowalign.kernels.sde_kinds, re-exported by flowalign.samplers): a new kind is
one registered function, usable from a config, by the samplers and by the GRPO loss; a kind without a Triton kernel
runs the torch reference and says so."""

from __future__ import annotations

import logging

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.kernels import dispatch, grpo_transition_loss, sde_kinds
from flowalign.samplers import ConstantNoise, gaussian_log_prob, register_sde_kind, registered_sde_kinds, rollout
from flowalign.samplers import sde_kind, sde_mean_std, sde_step
from flowalign.training.config import TrainConfig
from gaussian_flow import gaussian_velocity, sigmas

NAME = "euler_noise"


@pytest.fixture
def euler_noise():
    """A kind registered as one function for the test: the Euler mean plus noise of std ``a sqrt(s - s')``."""

    @register_sde_kind(NAME, max_noise_level=2.0)
    def euler_noise_step(x, v, s, s_next, a):
        return x + (s_next - s) * v, a * torch.sqrt(s - s_next)

    yield euler_noise_step
    sde_kinds._KINDS.pop(NAME)  # leave the registry as the other tests expect it
    dispatch._STATED.discard(NAME)


def test_a_kind_registered_as_one_function_is_usable_from_a_config(euler_noise):
    assert NAME in registered_sde_kinds() and registered_sde_kinds()[:3] == ("flow_grpo", "dance", "cps")
    config = load_config(TrainConfig, None, [f"sampling.kind={NAME}", "sampling.noise_level=1.5"])
    assert config.sampling.kind == NAME
    # the kind's own bound on the noise level is the config's check, as cps's bound of 1 is
    with pytest.raises(ConfigError, match=r"sampling.noise_level.*euler_noise"):
        load_config(TrainConfig, None, [f"sampling.kind={NAME}", "sampling.noise_level=2.5"])


def test_an_unknown_kind_in_a_config_names_the_key_and_the_closest_kind():
    with pytest.raises(ConfigError, match=r"sampling.kind.*unknown SDE kind 'danse'.*did you mean 'dance'"):
        load_config(TrainConfig, None, ["sampling.kind=danse"])


def test_a_registered_kind_samples_the_gaussian_flow_and_scores_its_own_steps(euler_noise):
    """A rollout of the registered kind draws ``x' = mean + std eps`` with the function's mean and std, and its
    log-probs are the exact Gaussian ones; re-scoring a stored step gives the same log-prob (ratio 1 in the loss)."""
    steps = 4
    s = sigmas(steps)
    x = torch.randn(3, 2, 2, generator=torch.Generator().manual_seed(0))
    out = rollout(gaussian_velocity, x, s, ConstantNoise(0.5).levels(steps), kind=NAME,
                  generator=torch.Generator().manual_seed(1))
    t = out.transitions
    stochastic = t.stochastic.bool()
    assert torch.isfinite(out.final).all() and stochastic.sum() == 3 * (steps - 1) and (t.std[stochastic] > 0).all()
    x_t, x_next = t.states[t.src][stochastic], t.states[t.dst][stochastic]
    sigma, sigma_next, level = t.sigma[stochastic], t.sigma_next[stochastic], t.noise_level[stochastic]
    v = gaussian_velocity(x_t, sigma)
    mean, std = sde_mean_std(x_t, v, sigma, sigma_next, kind=NAME, noise_level=level)
    shape = (-1, 1, 1)
    assert torch.equal(mean, x_t + (sigma_next - sigma).reshape(shape) * v)
    assert torch.allclose(std.flatten(), 0.5 * torch.sqrt(sigma - sigma_next))
    scored = sde_step(x_t, v, sigma, sigma_next, kind=NAME, noise_level=level, prev_sample=x_next)
    assert torch.equal(scored.log_prob, gaussian_log_prob(x_next, mean, std))
    assert torch.allclose(scored.log_prob, t.log_prob[stochastic], atol=1e-6)
    policy = v.clone().requires_grad_(True)
    loss = grpo_transition_loss(policy, x_t, x_next, sigma, sigma_next, scored.log_prob, torch.ones(len(x_t)),
                                kind=NAME, noise_level=level, clip_range=1e-4)
    assert torch.equal(loss.log_prob, scored.log_prob)  # the loss's own recomputation: ratio exactly 1
    loss.loss.sum().backward()
    assert torch.isfinite(policy.grad).all() and policy.grad.abs().sum() > 0

def test_a_kind_without_a_triton_kernel_runs_the_reference_and_says_so_once(euler_noise, caplog):
    assert sde_kind("flow_grpo").fused and not sde_kind(NAME).fused
    with caplog.at_level(logging.WARNING, logger="flowalign.kernels.dispatch"):
        assert dispatch.runs_fused("flow_grpo", "triton") and not dispatch.runs_fused("flow_grpo", "torch")
        assert not dispatch.runs_fused(NAME, "triton") and not dispatch.runs_fused(NAME, "triton")
    said = [r.getMessage() for r in caplog.records if NAME in r.getMessage()]
    assert len(said) == 1 and "no Triton kernel" in said[0] and "torch reference" in said[0]


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="'dance' is already registered"):
        register_sde_kind("dance")(lambda x, v, s, s_next, a: (x, a))
    with pytest.raises(ValueError, match="unknown SDE kind 'flowgrpo'.*did you mean 'flow_grpo'"):
        sde_kind("flowgrpo")
