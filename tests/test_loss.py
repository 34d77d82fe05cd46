"""GRPO loss: ratio 1 at the rollout policy, hand-computed clipping, gradient paths, KL terms, step weights.

``grpo_loss`` (from log-probs) is the reference: the trainer's ``transition_grpo_loss`` (from the velocity) is checked
equal to it on the same transitions, so the hand computations here pin the loss training uses."""

from __future__ import annotations

import math

import pytest
import torch

from flowalign.credit.steps import noise_aware_weights
from flowalign.losses.grpo import grpo_loss, kl_std_scale, latent_mean_kl, transition_grpo_loss, velocity_mse_kl
from flowalign.samplers import sde_step


def test_ratio_is_one_when_policy_unchanged():
    gen = torch.Generator().manual_seed(0)
    log_prob = torch.randn(16, generator=gen)
    advantages = torch.randn(16, generator=gen)
    weights = torch.rand(16, generator=gen) + 0.5
    loss, stats = grpo_loss(log_prob.clone().requires_grad_(), log_prob, advantages, clip_range=1e-4, weights=weights)
    assert loss.item() == pytest.approx(-(weights * advantages).mean().item(), abs=1e-7)
    assert stats["clip_frac"] == 0.0 and stats["approx_kl"] == 0.0
    assert stats["ratio_mean"] == 1.0 and stats["ratio_max"] == 1.0
    assert stats["policy_loss"] == stats["loss"] and stats["kl"] == 0.0


def test_ratio_is_one_on_recomputed_sde_log_prob_in_bf16():
    # The rollout stores log-probs of the bf16 sample; recomputing them for that stored sample gives ratio 1.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 4, 8, 8, generator=gen).bfloat16()
    v = torch.randn(4, 4, 8, 8, generator=gen).bfloat16()
    out = sde_step(x, v, 0.8, 0.7, kind="flow_grpo", noise_level=0.7, generator=gen)
    again = sde_step(x, v, 0.8, 0.7, kind="flow_grpo", noise_level=0.7, prev_sample=out.prev_sample)
    loss, stats = grpo_loss(again.log_prob, out.log_prob, torch.ones(4), clip_range=1e-4)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    assert loss.dtype == torch.float32 and loss.item() == -1.0


def test_bf16_inputs_are_computed_in_fp32():
    log_prob = torch.tensor([-1.0, 2.0], dtype=torch.bfloat16)
    loss, _ = grpo_loss(log_prob, log_prob, torch.tensor([1.0, 3.0], dtype=torch.bfloat16), clip_range=0.1)
    assert loss.dtype == torch.float32 and loss.item() == -2.0


def _hand_case():
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    old = torch.tensor([0.3, -0.2, 1.0, 0.0, -1.0])
    log_prob = (old + ratio.log()).requires_grad_()
    return log_prob, old, advantages


def test_hand_computed_clipping():
    log_prob, old, advantages = _hand_case()
    loss, stats = grpo_loss(log_prob, old, advantages, clip_range=0.2)
    # A>0, r=1.5: min(1.5, 1.2) = 1.2    A>0, r=0.5: min(0.5, 0.8) = 0.5
    # A<0, r=1.5: min(-1.5, -1.2) = -1.5  A<0, r=0.5: min(-0.5, -0.8) = -0.8   A=2, r=1.1: inside, 2.2
    per_transition = [-1.2, -0.5, 1.5, 0.8, -2.2]
    assert loss.item() == pytest.approx(sum(per_transition) / 5, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(4 / 5)
    assert stats["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5, abs=1e-6)
    expected_approx_kl = sum(0.5 * math.log(r) ** 2 for r in (1.5, 0.5, 1.5, 0.5, 1.1)) / 5
    assert stats["approx_kl"] == pytest.approx(expected_approx_kl, rel=1e-5)

    loss.backward()
    # d/dlogp of -A*r/N where the unclipped term is the minimum; 0 where the clipped constant is.
    expected_grad = torch.tensor([0.0, -1.0 * 0.5, 1.0 * 1.5, 0.0, -2.0 * 1.1]) / 5
    torch.testing.assert_close(log_prob.grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_weights_scale_each_transition():
    log_prob, old, advantages = _hand_case()
    weights = torch.tensor([2.0, 0.0, 1.0, 1.0, 0.5])
    loss, _ = grpo_loss(log_prob, old, advantages, clip_range=0.2, weights=weights)
    assert loss.item() == pytest.approx((-2.4 + 0 + 1.5 + 0.8 - 1.1) / 5, abs=1e-6)


def test_gradient_flows_only_through_log_prob_and_kl():
    log_prob = torch.tensor([0.1, -0.2, 0.3], requires_grad=True)
    old = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    advantages = torch.tensor([1.0, -1.0, 0.5], requires_grad=True)
    weights = torch.tensor([1.0, 2.0, 1.0], requires_grad=True)
    kl = torch.tensor([0.2, 0.4, 0.6], requires_grad=True)
    loss, stats = grpo_loss(log_prob, old, advantages, clip_range=0.5, weights=weights, kl=kl, beta=0.1)
    loss.backward()
    assert log_prob.grad is not None and log_prob.grad.abs().sum() > 0
    assert old.grad is None and advantages.grad is None and weights.grad is None
    torch.testing.assert_close(kl.grad, torch.full((3,), 0.1 / 3))
    assert stats["kl"] == pytest.approx(0.4)
    assert stats["loss"] == pytest.approx(stats["policy_loss"] + 0.1 * 0.4, abs=1e-6)


def test_kl_is_logged_without_beta_and_required_with_beta():
    lp = torch.zeros(2)
    loss, stats = grpo_loss(lp, lp, torch.ones(2), clip_range=0.1, kl=torch.tensor([1.0, 3.0]))
    assert loss.item() == -1.0 and stats["kl"] == 2.0
    with pytest.raises(ValueError, match="kl"):
        grpo_loss(lp, lp, torch.ones(2), clip_range=0.1, beta=0.01)
    with pytest.raises(ValueError, match="clip_range"):
        grpo_loss(lp, lp, torch.ones(2), clip_range=0.0)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(lp, lp, torch.ones(3), clip_range=0.1)


@pytest.mark.parametrize("kl_std", ["std_t", "transition"])
@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_the_trainers_transition_loss_equals_grpo_loss_on_the_same_transitions(kind, kl_std):
    """``transition_grpo_loss`` (log-prob, latent-mean KL and clipped loss from the velocity in one op, what the
    trainer calls) equals ``grpo_loss`` of the SDE step's log-prob and KL: loss, stats and the gradient to ``v``.
    The KL divides by ``2 s^2``: ``s`` the transition std over ``sqrt(sigma - sigma_next)`` (``std_t``, flow_grpo's
    released code; ``cps`` steps keep their transition std) or the transition std (``transition``)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 8, 8, generator=gen)
    sigma = torch.tensor([0.95, 0.9, 0.8, 0.7, 0.5, 0.3])
    sigma_next = sigma - 0.1
    v_rollout = torch.randn(x.shape, generator=gen)
    step = sde_step(x, v_rollout, sigma, sigma_next, kind=kind, noise_level=0.7, generator=gen)
    moved = torch.tensor([0.0, 0.01, 0.03, 0.1, 0.3, 1.0]).view(-1, 1, 1, 1)  # how far the policy moved per row
    v = v_rollout + moved * torch.randn(x.shape, generator=gen)
    v_ref = v_rollout + 0.05 * torch.randn(x.shape, generator=gen)
    advantages = torch.randn(6, generator=gen)
    weights = torch.rand(6, generator=gen) + 0.5
    settings = {"clip_range": 1e-3, "weights": weights}

    v_fused = v.clone().requires_grad_()
    loss, stats = transition_grpo_loss(v_fused, x, step.prev_sample, sigma, sigma_next, step.log_prob, advantages,
                                       kind=kind, noise_level=0.7, v_ref=v_ref, beta=0.1, kl_std=kl_std, **settings)
    loss.backward()

    v_split = v.clone().requires_grad_()
    policy = sde_step(x, v_split, sigma, sigma_next, kind=kind, noise_level=0.7, prev_sample=step.prev_sample)
    reference = sde_step(x, v_ref, sigma, sigma_next, kind=kind, noise_level=0.7, prev_sample=step.prev_sample)
    s = policy.std if kl_std == "transition" or kind == "cps" else policy.std / (sigma - sigma_next).sqrt()
    kl = latent_mean_kl(policy.mean, reference.mean, s)
    expected, expected_stats = grpo_loss(policy.log_prob, step.log_prob, advantages, kl=kl, beta=0.1, **settings)
    expected.backward()

    assert 0 < stats["clip_frac"] < 1 and stats["kl"] > 0  # both branches of the clip, and a KL, are exercised
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    assert stats.keys() == expected_stats.keys()
    for key, value in stats.items():
        assert value == pytest.approx(expected_stats[key], rel=1e-5, abs=1e-7), key
    torch.testing.assert_close(v_fused.grad, v_split.grad, rtol=1e-5, atol=1e-8)


def test_latent_mean_kl_hand_computed():
    mean = torch.tensor([[1.0, 3.0], [0.0, 2.0], [5.0, 5.0]])
    ref = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    std = torch.tensor([0.5, 2.0, 0.0])
    # row 0: (1, 4) / (2 * 0.25) = (2, 8); row 1: (0, 4) / 8 = (0, 0.5); row 2: std 0 -> ODE step, 0
    torch.testing.assert_close(latent_mean_kl(mean, ref, std), torch.tensor([5.0, 0.25, 0.0]))
    torch.testing.assert_close(latent_mean_kl(mean, ref, std, reduce="sum"), torch.tensor([10.0, 0.5, 0.0]))
    torch.testing.assert_close(latent_mean_kl(mean, ref, std[:, None]), torch.tensor([5.0, 0.25, 0.0]))

    images = mean.reshape(3, 1, 2, 1).expand(3, 4, 2, 3)
    refs = ref.reshape(3, 1, 2, 1).expand(3, 4, 2, 3)
    torch.testing.assert_close(latent_mean_kl(images, refs, std.reshape(3, 1, 1, 1)), torch.tensor([5.0, 0.25, 0.0]))
    with pytest.raises(ValueError, match="rows"):
        latent_mean_kl(mean, ref, torch.ones(2))


def test_the_kl_std_hand_computed_on_a_flow_grpo_step():
    """One flow_grpo step at sigma 0.5 -> 0.4, noise level 0.7, where the policy's and the reference's velocities
    differ by 1 in every element: std_t = 0.7 sqrt(0.5 / 0.5) = 0.7 and the mean's velocity coefficient is
    (1 + 0.49 * 0.5 / 1) * (-0.1) = -0.1245, so mu - mu_ref = -0.1245. flow_grpo's released code divides its square
    by 2 std_t^2 = 0.98; the transition KL by 2 (std_t sqrt(0.1))^2 = 0.098, ten (1/|dt|) times larger."""
    x = torch.zeros(2, 1, 2, 2)
    v_ref = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    v = v_ref + 1.0
    sigma, sigma_next = torch.full((2,), 0.5), torch.full((2,), 0.4)
    common = dict(kind="flow_grpo", noise_level=0.7, clip_range=0.1, v_ref=v_ref, beta=0.5)
    x_next = torch.zeros(x.shape)
    old = torch.zeros(2)
    std_t, released = transition_grpo_loss(v, x, x_next, sigma, sigma_next, old, torch.zeros(2), **common)
    _, exact = transition_grpo_loss(v, x, x_next, sigma, sigma_next, old, torch.zeros(2), kl_std="transition",
                                    **common)
    assert released["kl"] == pytest.approx(0.1245**2 / 0.98, rel=1e-5)
    assert exact["kl"] == pytest.approx(0.1245**2 / 0.098, rel=1e-5)
    assert std_t.item() == pytest.approx(0.5 * 0.1245**2 / 0.98, rel=1e-5)  # zero advantages: the loss is beta KL
    assert kl_std_scale(torch.tensor([0.7 * 0.1**0.5]), 0.5, 0.4, "flow_grpo", "std_t").item() == pytest.approx(0.7)
    assert kl_std_scale(torch.tensor([0.3]), 0.5, 0.4, "cps", "std_t").item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="kl_std 'exact'"):
        kl_std_scale(torch.tensor([0.3]), 0.5, 0.4, "flow_grpo", "exact")


def test_latent_mean_kl_gradient_reaches_policy_mean_only():
    mean = torch.tensor([[1.0, 3.0]], requires_grad=True)
    ref = torch.tensor([[0.0, 1.0]], requires_grad=True)
    latent_mean_kl(mean, ref.detach(), torch.tensor([1.0])).sum().backward()
    # d/dmu of mean((mu - ref)^2 / 2) = (mu - ref) / 2
    torch.testing.assert_close(mean.grad, torch.tensor([[0.5, 1.0]]))


def test_velocity_mse_kl_hand_computed():
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]]).reshape(2, 1, 2, 2)
    v_ref = torch.tensor([[1.0, 0.0, 3.0, 0.0], [1.0, 1.0, 1.0, -1.0]]).reshape(2, 1, 2, 2)
    # row 0: (0 + 4 + 0 + 16) / 4 = 5; row 1: 4 / 4 = 1
    torch.testing.assert_close(velocity_mse_kl(v, v_ref), torch.tensor([5.0, 1.0]))
    assert velocity_mse_kl(v.bfloat16(), v_ref.bfloat16()).dtype == torch.float32


def test_noise_aware_weights_mean_one_over_trained_set():
    std = torch.tensor([0.1, 0.2, 0.3, 0.0, 0.5])
    mask = torch.tensor([True, True, True, False, False])
    weights = noise_aware_weights(std, mask)
    torch.testing.assert_close(weights, torch.tensor([0.5, 1.0, 1.5, 0.0, 0.0]))
    assert weights[mask].mean().item() == pytest.approx(1.0)

    all_trained = noise_aware_weights(std)
    assert all_trained.mean().item() == pytest.approx(1.0)
    torch.testing.assert_close(all_trained, std / std.mean())

    gen = torch.Generator().manual_seed(0)
    random_std = torch.rand(100, generator=gen)
    random_mask = torch.rand(100, generator=gen) > 0.3
    assert noise_aware_weights(random_std, random_mask)[random_mask].mean().item() == pytest.approx(1.0, abs=1e-6)

    with pytest.raises(ValueError, match="std > 0"):
        noise_aware_weights(torch.zeros(3))
    with pytest.raises(ValueError, match="stochastic_mask"):
        noise_aware_weights(std, torch.ones(5))
