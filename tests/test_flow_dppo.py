"""Flow-DPPO (loss.grpo.trust_region: dppo; flowalign.losses.flow_dppo): the divergence mask on small float64 tensors
worked out by hand (value and autograd gradient), the released >= and [B, S] layout, the masked-overflow gradient, the
term at the rollout's own weights, and the settings refused before anything loads. The preset's runs: the golden run
(tests/test_golden.py), bitwise resume (tests/test_presets.py), 2 processes (tests/test_trainer.py, the dense entry)."""

import math

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.kernels.loss_reference import grpo_transition_loss_reference
from flowalign.kernels.sde_reference import gaussian_log_prob, sde_mean_std
from flowalign.losses.flow_dppo import dppo_transition_loss, flow_dppo_loss, unirl_sigma
from flowalign.training.config import TrainConfig

F64 = torch.float64
E = math.exp


def t(values):
    return torch.tensor(values, dtype=F64)


def run(log_ratio, advantages, mean_shift, sigma, **options):
    """``flow_dppo_loss`` with ``old_log_prob = 0`` (so ``log_prob`` is the log-ratio), ``old_mean = 0`` and
    ``mean = mean_shift``; returns the loss, the gradient by ``log_prob`` and the stats."""
    log_prob = t(log_ratio).requires_grad_(True)
    shift = t(mean_shift)
    loss, stats = flow_dppo_loss(log_prob, torch.zeros_like(log_prob), t(advantages), shift, torch.zeros_like(shift),
                                 sigma, **options)
    loss.backward()
    return loss.detach(), log_prob.grad, stats


# Four transitions of 2 latent dims, all shifted by (0.1, 0.3) with sigma 0.5: D = mean(0.01, 0.09) / (2 * 0.25) = 0.1.
QUADRANTS = ([0.5, -0.5, 0.5, -0.5], [2.0, -1.0, -3.0, 1.0], [[0.1, 0.3]] * 4)


def test_the_four_quadrants_at_high_divergence():
    """D = 0.1 >= 1e-5 everywhere: (rho > 1, A > 0) and (rho < 1, A < 0) are dropped, the corrective two train.
    loss = (0 + 0 + 3 e^0.5 - e^-0.5) / 4; gradient -A rho / 4 where kept, 0 where dropped."""
    loss, grad, stats = run(*QUADRANTS, t(0.5))
    assert torch.allclose(stats["kl"], t([0.1] * 4), rtol=1e-13, atol=0)
    assert stats["pos_masked"].tolist() == [True, False, False, False]
    assert stats["neg_masked"].tolist() == [False, True, False, False]
    assert stats["keep"].tolist() == [False, False, True, True]
    assert torch.allclose(stats["ratio"], t([E(0.5), E(-0.5), E(0.5), E(-0.5)]), rtol=1e-15, atol=0)
    assert float(loss) == pytest.approx((3 * E(0.5) - E(-0.5)) / 4, rel=1e-13)
    assert torch.allclose(grad, t([0.0, 0.0, 3 * E(0.5) / 4, -E(-0.5) / 4]), rtol=1e-13, atol=0)


def test_all_low_divergence_trains_everything_unclipped():
    """delta = 1 > D: nothing dropped, no clip: loss = mean(-A rho) = (-2 e^.5 + e^-.5 + 3 e^.5 - e^-.5) / 4."""
    loss, grad, stats = run(*QUADRANTS, t(0.5), kl_mask_threshold=1.0)
    assert stats["keep"].all() and not stats["pos_masked"].any()
    assert float(loss) == pytest.approx(E(0.5) / 4, rel=1e-13)
    assert torch.allclose(grad, t([-2 * E(0.5), E(-0.5), 3 * E(0.5), -E(-0.5)]) / 4, rtol=1e-13, atol=0)


def test_the_threshold_is_inclusive_as_released():
    """A shift of 0.5 with sigma 0.5: D = 0.25 / (2 * 0.25) = 0.5 exactly. delta = 0.5 drops (>=), the next float up
    keeps; the docs' '>' is not the code."""
    args = ([0.2], [1.0], [[0.5, 0.5]], t(0.5))
    _, _, at = run(*args, kl_mask_threshold=0.5)
    assert float(at["kl"][0]) == 0.5 and at["pos_masked"].tolist() == [True]
    loss, grad, above = run(*args, kl_mask_threshold=math.nextafter(0.5, 1.0))
    assert above["keep"].tolist() == [True] and float(loss) == pytest.approx(-E(0.2), rel=1e-14)
    assert float(grad[0]) == pytest.approx(-E(0.2), rel=1e-14)


def test_large_advantages_rho_one_and_zero_advantages():
    """No advantage clamp: A = 7 and -8 enter as they are. rho == 1 is never masked (neither > 1 nor < 1), nor is
    A = 0 (its loss and gradient are 0). All at high divergence (D = 0.1)."""
    loss, grad, stats = run([0.1, 0.1, 0.0, 0.0, 0.3], [7.0, -8.0, 2.0, -2.0, 0.0], [[0.1, 0.3]] * 5, t(0.5))
    assert stats["keep"].tolist() == [False, True, True, True, True]
    assert float(loss) == pytest.approx((0 + 8 * E(0.1) - 2 + 2 + 0) / 5, rel=1e-13)
    assert torch.allclose(grad, t([0.0, 8 * E(0.1), -2.0, 2.0, 0.0]) / 5, rtol=1e-13, atol=0)


def test_per_sample_sigma_no_sigma_and_the_sum_reduction():
    """Shift 0.5 in both dims: sigma = [0.5, 1.0] gives D = [0.5, 0.125], so delta = 0.25 drops the first only.
    Without the coefficient D = mean(0.25) / 2 = 0.125 (sigma unused, may be None); kl_reduction: sum doubles D."""
    shift = [[0.5, 0.5], [0.5, 0.5]]
    _, _, per_sample = run([0.2, 0.2], [1.0, 1.0], shift, t([0.5, 1.0]), kl_mask_threshold=0.25)
    assert torch.allclose(per_sample["kl"], t([0.5, 0.125]), rtol=1e-14, atol=0)
    assert per_sample["keep"].tolist() == [False, True]
    for sigma in (None, t(123.0)):
        _, _, plain = run([0.2, 0.2], [1.0, 1.0], shift, sigma, add_kl_coefficient=False, kl_mask_threshold=0.25)
        assert torch.allclose(plain["kl"], t([0.125, 0.125]), rtol=1e-14, atol=0) and plain["keep"].all()
    _, _, summed = run([0.2, 0.2], [1.0, 1.0], shift, t([0.5, 1.0]), kl_reduction="sum", kl_mask_threshold=0.25)
    assert torch.allclose(summed["kl"], t([1.0, 0.25]), rtol=1e-14, atol=0) and not summed["keep"].any()


def test_a_masked_overflowing_ratio_has_a_finite_loss_and_a_zero_gradient():
    """log-ratio 1000: rho = inf, A > 0, high D: dropped. The loss is (0 - e^0.1) / 2 and the gradient [0, -e^0.1/2];
    the released where(keep, -A rho, 0) gives the same loss but a NaN gradient (0 * inf in where's backward)."""
    loss, grad, stats = run([1000.0, 0.1], [1.0, 1.0], [[0.1, 0.3]] * 2, t(0.5))
    assert math.isinf(float(stats["ratio"][0])) and stats["pos_masked"].tolist() == [True, True]
    assert float(loss) == 0.0 and torch.equal(grad, t([0.0, 0.0]))
    loss, grad, stats = run([1000.0, -0.1], [1.0, 1.0], [[0.1, 0.3]] * 2, t(0.5))
    assert float(loss) == pytest.approx(-E(-0.1) / 2, rel=1e-14)
    assert torch.allclose(grad, t([0.0, -E(-0.1) / 2]), rtol=1e-14, atol=0)
    released = t([1000.0, -0.1]).requires_grad_(True)  # the pitfall the option avoids
    keep = t([0.0, 1.0]).bool()
    torch.where(keep, -torch.exp(released), torch.zeros((), dtype=F64)).mean().backward()
    assert math.isnan(float(released.grad[0]))


def test_unirls_multi_step_layout_with_its_sigma_table():
    """[B, S] = [2, 2], advantages [B] broadcast over the steps, means [2, 2, 2, 1, 1] all shifted by 0.01. UniRL's
    sigma at s = 1 -> 0.75 with eta 0.7: 0.7 sqrt(1 / 0.01) sqrt(0.25) = 3.5; at 0.75 -> 0.5: 0.7 sqrt(3) 0.5. So
    D = 1e-4 / (2 sigma^2) = [4.08e-6, 1.36e-4]: step 0 is low (kept), step 1 high, where sample 0 (A = 1, rho > 1)
    and sample 1 (A = -1, rho < 1) are dropped. loss = (-e^0.2 + e^-0.2) / 4."""
    table = unirl_sigma(t([1.0, 0.75]), t([0.75, 0.5]), 0.7).double()
    assert torch.allclose(table, t([3.5, 0.7 * math.sqrt(3) * 0.5]), rtol=1e-6, atol=0)
    sigma = t([3.5, 0.7 * math.sqrt(3) * 0.5])
    log_prob = t([[0.2, 0.2], [-0.2, -0.2]]).requires_grad_(True)
    mean = torch.full((2, 2, 2, 1, 1), 0.01, dtype=F64)
    for layout in (sigma.reshape(1, 2, 1, 1, 1), sigma, sigma.reshape(1, 2)):
        log_prob.grad = None
        loss, stats = flow_dppo_loss(log_prob, torch.zeros_like(log_prob), t([1.0, -1.0]), mean,
                                     torch.zeros_like(mean), layout)
        loss.backward()
        loss = loss.detach()
        expected_kl = [1e-4 / (2 * 3.5**2), 1e-4 / (2 * (0.7 * math.sqrt(3) * 0.5) ** 2)]
        assert torch.allclose(stats["kl"], t([expected_kl, expected_kl]), rtol=1e-12, atol=0)
        assert stats["keep"].tolist() == [[True, False], [True, False]]
        assert float(loss) == pytest.approx((-E(0.2) + E(-0.2)) / 4, rel=1e-13)
        assert torch.allclose(log_prob.grad, t([[-E(0.2), 0.0], [E(-0.2), 0.0]]) / 4, rtol=1e-13, atol=0)
    # flowalign's sampler std at s = 1 uses 1 - s_next: 0.7 sqrt(1 / 0.25) sqrt(0.25) = 0.7, a 25x larger D
    _, std = sde_mean_std(torch.zeros(1, 1), torch.zeros(1, 1), 1.0, 0.75, kind="flow_grpo", noise_level=0.7)
    assert float(std) == pytest.approx(0.7, rel=1e-6)


def test_bad_inputs_are_refused():
    one = t([0.0])
    with pytest.raises(ValueError, match="kl_reduction"):
        flow_dppo_loss(one, one, one, t([[0.0]]), t([[0.0]]), 1.0, kl_reduction="max")
    with pytest.raises(ValueError, match="needs sigma"):
        flow_dppo_loss(one, one, one, t([[0.0]]), t([[0.0]]), None)
    with pytest.raises(ValueError, match="advantages"):
        flow_dppo_loss(one, one, t([0.0, 1.0]), t([[0.0]]), t([[0.0]]), 1.0)
    with pytest.raises(ValueError, match="broadcast"):
        flow_dppo_loss(t([0.0, 0.0]), t([0.0, 0.0]), t([0.0, 0.0]), t([[0.0], [0.0]]), t([[0.0], [0.0]]),
                       t([1.0, 1.0, 1.0]))


def test_the_term_at_the_rollouts_weights_has_ratio_one_and_grpos_gradient():
    """At v = v_old (the first micro-batch) rho = 1 and D = 0 exactly, nothing is dropped, and inside the clip the
    gradient is the clipped loss's: the same as Flow-GRPO's on the same transitions (the torch reference)."""
    g = torch.Generator().manual_seed(0)
    x, v_old = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    sigma, sigma_next, level = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.8, 0.45, 0.2]), torch.full((3,), 0.7)
    old, std = sde_mean_std(x, v_old, sigma, sigma_next, kind="flow_grpo", noise_level=level)
    x_next = old + std * torch.randn(3, 2, 4, 4, generator=g)
    advantages, weights = torch.tensor([1.5, -0.5, 0.25]), torch.tensor([1.0, 0.5, 2.0])
    v = v_old.clone().requires_grad_(True)
    loss, stats = dppo_transition_loss(v, v_old, x, x_next, sigma, sigma_next, advantages, kind="flow_grpo",
                                       noise_level=level, weights=weights)
    assert stats["ratio_max"] == 1.0 and stats["ratio_mean"] == 1.0 and stats["approx_kl"] == 0.0
    assert stats["dppo/divergence_max"] == 0.0 and stats["clip_frac"] == 0.0
    assert float(loss.detach()) == pytest.approx(float(-(advantages * weights).mean()), rel=1e-6)
    loss.backward()
    v2 = v_old.clone().requires_grad_(True)
    old_log_prob = gaussian_log_prob(x_next, old, std)
    rows = grpo_transition_loss_reference(v2, x, x_next, sigma, sigma_next, old_log_prob, advantages,
                                          kind="flow_grpo", noise_level=level, clip_range=1e-4, weights=weights)
    rows.loss.mean().backward()
    torch.testing.assert_close(v.grad, v2.grad, rtol=1e-5, atol=1e-9)
    # a moved policy: D > 0, and with delta = 0 the steps that moved with their advantage are dropped
    v3 = (v_old + 0.3 * torch.randn(3, 2, 4, 4, generator=g)).requires_grad_(True)
    _, moved = dppo_transition_loss(v3, v_old, x, x_next, sigma, sigma_next, advantages, kind="flow_grpo",
                                    noise_level=level, kl_mask_threshold=0.0)
    assert moved["dppo/divergence_max"] > 0 and moved["dppo/high_divergence_frac"] == 1.0
    assert moved["clip_frac"] == moved["dppo/pos_masked_frac"] + moved["dppo/neg_masked_frac"]


def test_settings_are_checked_before_anything_loads(monkeypatch):
    dppo = ["loss.grpo.trust_region=dppo"]
    config = load_config(TrainConfig, None, dppo)
    assert config.components().losses["grpo"].rollout_fields() == {"velocity"}
    for setting in ("loss.grpo.kl_mask_threshold=1e-4", "loss.grpo.kl_reduction=sum",
                    "loss.grpo.sigma_at_one=clamp_0.99", "loss.grpo.add_kl_coefficient=false"):
        with pytest.raises(ConfigError, match=setting.split("=")[0] + ".*set trust_region: dppo"):
            load_config(TrainConfig, None, [setting])
    with pytest.raises(ConfigError, match="loss.grpo.trust_region.*ratio_norm"):
        load_config(TrainConfig, None, [*dppo, "loss.grpo.ratio_norm=true"])
    with pytest.raises(ConfigError, match="loss.grpo.sigma_at_one.*sampling.kind = 'dance'"):
        load_config(TrainConfig, None, [*dppo, "loss.grpo.sigma_at_one=clamp_0.99", "sampling.kind=dance"])
    with pytest.raises(ConfigError, match="loss.grpo.kl_reduction"):
        load_config(TrainConfig, None, [*dppo, "loss.grpo.kl_reduction=max"])
    # Flow-DPPO without stored rollout means: a rollout shape that keeps no velocities is refused, naming the key
    from flowalign.rollout.chains import Chains

    monkeypatch.setattr(Chains, "fields", frozenset())
    with pytest.raises(ConfigError, match="loss.grpo.trust_region = 'dppo' needs the rollout's step means"):
        load_config(TrainConfig, None, dppo)
