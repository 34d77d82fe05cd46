"""DGPO's pure loss against an independent float64 computation (value and d loss / d v by autograd), its schedule,
units and settings (docs/methods/dgpo.md; METHODS-3 §1)."""

import math

import pytest
import torch

from flowalign.advantages import group_advantages
from flowalign.config import ConfigError
from flowalign.objectives.dgpo import dgpo_decay, dgpo_loss, dgpo_timestep_indices

from float64_cases import D, grad_of, mse, tensors


# ------------------------------------------------------------------------------------------------ DGPO, by hand
def sigmoid(x):
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def dgpo_reference(v, u, v_ref, A, ids, *, beta, K, v_old=None, c=None, clip_dsm=True, clip_kl=False,
                   ema_ref=False, kl_beta=0.0, amax=5.0):
    """The released loss written out per sample and per group, with Python loops (detaches by hand)."""
    B = len(v)
    A = [min(max(float(a), -amax), amax) for a in A]
    dsm = [((u[i] - v[i]) ** 2).mean() for i in range(B)]
    ref = [((u[i] - (v_old if ema_ref else v_ref)[i]) ** 2).mean().item() for i in range(B)]
    clipped = [False] * B
    if v_old is not None and (clip_dsm or clip_kl):
        for i in range(B):
            ratio = math.exp(((u[i] - v_old[i]) ** 2).mean().item() - dsm[i].item())
            clipped[i] = ratio > 1 + c if A[i] > 0 else ratio < 1 - c
    sums = {}
    for i in range(B):
        sums[int(ids[i])] = sums.get(int(ids[i]), 0.0) + A[i] * beta * (dsm[i].item() - ref[i]) / K
    loss = 0
    for i in range(B):
        d = dsm[i].detach() if (clip_dsm and clipped[i]) else dsm[i]
        loss = loss + sigmoid(sums[int(ids[i])]) * A[i] * d / B
    if kl_beta > 0:
        kl = 0
        for i in range(B):
            k = ((v[i] - v_ref[i]) ** 2).mean()
            kl = kl + (k.detach() if (clip_kl and clipped[i]) else k) / B
        loss = loss + kl_beta * kl
    return loss, [sums[k] for k in sorted(sums)], clipped


def check_dgpo(v, u, v_ref, A, ids, **kw):
    ref_kw = dict(beta=kw["beta_dpo"], K=kw["group_size"], v_old=kw.get("v_old"), c=kw.get("clip_range"),
                  clip_dsm=kw.get("clip_dsm", True), clip_kl=kw.get("clip_kl", False),
                  ema_ref=kw.get("use_ema_ref", False), kl_beta=kw.get("kl_beta", 0.0),
                  amax=kw.get("adv_clip_max", 5.0))
    value, grad = grad_of(lambda x: dgpo_loss(x, u, v_ref, A, ids, **kw)[0], v)
    expected, expected_grad = grad_of(lambda x: dgpo_reference(x, u, v_ref, A, ids, **ref_kw)[0], v)
    assert value.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(grad, expected_grad, rtol=1e-10, atol=1e-15)
    _, stats = dgpo_loss(v, u, v_ref, A, ids, **kw)
    _, sums, clipped = dgpo_reference(v, u, v_ref, A, ids, **ref_kw)
    assert torch.allclose(stats["group_sums"], torch.tensor(sums, dtype=D), rtol=1e-12, atol=1e-15)
    if "should_clip" in stats:
        assert stats["should_clip"].tolist() == clipped
    return value, grad, stats


def test_dgpo_from_rewards_through_the_tracker_gradient_is_the_group_dpo_gradient():
    """Rewards -> flowalign's tracker (population std + 1e-4) -> loss: value, and d loss / d v equal to
    K / (beta B) times the gradient of sum_g -log sigmoid(-S_g) without the stop-gradients (METHODS-3 §1 step 6)."""
    v, u, v_ref, _ = tensors(6, 0)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([0.2, 0.9, 0.4, 0.1, 0.1, 0.7], dtype=D)
    A, _ = group_advantages(rewards, ids, std="group", clip=None)
    A = A.double()
    beta, K = 10.0, 3
    value, grad, stats = check_dgpo(v, u, v_ref, A, ids, beta_dpo=beta, group_size=K)

    def dpo(x):
        dsm, ref = mse(u, x), mse(u, v_ref)
        S = torch.stack([(beta / K) * (A[ids == g] * (dsm - ref)[ids == g]).sum() for g in (0, 1)])
        return -torch.nn.functional.logsigmoid(-S).sum()

    _, dpo_grad = grad_of(dpo, v)
    assert torch.allclose(grad, K / (beta * 6) * dpo_grad, rtol=1e-10, atol=1e-15)
    assert torch.allclose(stats["sample_weights"], torch.sigmoid(stats["group_sums"])[ids])
    assert stats["kl_loss"].item() == 0.0 and "should_clip" not in stats
    # the surrogate's value, not the DPO loss: mean_i sigmoid(S_g) A_i dsm_i
    expected = (torch.sigmoid(stats["group_sums"])[ids] * A * mse(u, v)).mean()
    assert value.item() == pytest.approx(expected.item(), rel=1e-13)


def test_dgpo_at_the_reference_weights_half_and_log_two():
    """v = v_ref: S_g = 0, every weight 1/2, the loss mean(A dsm) / 2, the logged DPO loss log 2."""
    v, u, _, _ = tensors(4, 1)
    A = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=D)
    ids = torch.tensor([0, 0, 1, 1])
    loss, stats = dgpo_loss(v, u, v.clone(), A, ids, beta_dpo=100.0, group_size=2)
    assert torch.equal(stats["group_sums"], torch.zeros(2, dtype=D))
    assert torch.equal(stats["sample_weights"], torch.full((4,), 0.5, dtype=D))
    assert loss.item() == pytest.approx((0.5 * A * mse(u, v)).mean().item(), rel=1e-14)
    assert stats["dpo_loss"].item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("ema_ref", [False, True], ids=["frozen_reference", "ema_reference"])
def test_dgpo_frozen_and_ema_reference(ema_ref):
    v, u, v_ref, v_old = tensors(4, 2)
    A = torch.tensor([1.3, -1.3, 0.7, -0.7], dtype=D)
    ids = torch.tensor([5, 5, 9, 9])
    _, _, stats = check_dgpo(v, u, v_ref, A, ids, beta_dpo=50.0, group_size=2, v_old=v_old, clip_range=0.05,
                             use_ema_ref=ema_ref, kl_beta=0.1)
    assert torch.allclose(stats["dsm_ref"], mse(u, v_old if ema_ref else v_ref))


@pytest.mark.parametrize("clip_dsm, clip_kl", [(True, False), (False, True), (True, True)])
def test_dgpo_clips(clip_dsm, clip_kl):
    """The clip: A > 0 clipped iff ratio > 1 + c, A <= 0 (A = 0 included) iff ratio < 1 - c; a clipped sample's dsm
    (clip_dsm) or KL (clip_kl) keeps its value and loses its gradient."""
    v, u, v_ref, _ = tensors(6, 3)
    # v_old near v: dsm_old - dsm set per sample so that ratios straddle 1 +- c
    shift = torch.tensor([0.3, -0.3, 0.3, -0.3, 0.3, -0.3], dtype=D).view(-1, 1, 1, 1)
    v_old = v + shift * (u - v)  # dsm_old = (1 - shift)^2 dsm
    A = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0], dtype=D)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    value, grad, stats = check_dgpo(v, u, v_ref, A, ids, beta_dpo=20.0, group_size=2, v_old=v_old,
                                    clip_range=0.01, clip_dsm=clip_dsm, clip_kl=clip_kl, kl_beta=0.05)
    ratio = torch.exp(mse(u, v_old) - mse(u, v))
    assert stats["should_clip"].tolist() == [bool(ratio[0] > 1.01), bool(ratio[1] > 1.01), bool(ratio[2] < 0.99),
                                             bool(ratio[3] < 0.99), bool(ratio[4] < 0.99), bool(ratio[5] < 0.99)]
    assert stats["should_clip"].any() and not stats["should_clip"].all()
    if clip_dsm and clip_kl:  # a clipped sample gets no gradient at all
        for i in torch.nonzero(stats["should_clip"]).flatten():
            assert torch.equal(grad[i], torch.zeros_like(grad[i]))


def test_dgpo_clip_without_v_old_or_with_both_clips_off_does_nothing():
    v, u, v_ref, v_old = tensors(4, 4)
    A = torch.tensor([2.0, -2.0, 1.0, -1.0], dtype=D)
    ids = torch.tensor([0, 0, 1, 1])
    base, _ = dgpo_loss(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2)
    off, stats = dgpo_loss(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2, v_old=v_old, clip_range=0.01,
                           clip_dsm=False, clip_kl=False)
    assert torch.equal(base, off) and "should_clip" not in stats
    with pytest.raises(ValueError, match="clip_range"):
        dgpo_loss(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2, v_old=v_old)
    with pytest.raises(ValueError, match="v_old"):
        dgpo_loss(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2, use_ema_ref=True)


def test_dgpo_kl_term():
    v, u, v_ref, _ = tensors(4, 5)
    A = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=D)
    ids = torch.tensor([0, 0, 1, 1])
    with_kl, stats = dgpo_loss(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2, kl_beta=0.02)
    without, _ = dgpo_loss(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2)
    assert stats["kl_loss"].item() == pytest.approx(mse(v, v_ref).mean().item(), rel=1e-14)
    assert (with_kl - without).item() == pytest.approx(0.02 * mse(v, v_ref).mean().item(), rel=1e-12)
    check_dgpo(v, u, v_ref, A, ids, beta_dpo=5.0, group_size=2, kl_beta=0.02)


def test_dgpo_groups_of_two_equal_rewards_and_clamped_advantages():
    """A group of equal rewards has A = 0: weight 1/2, no gradient from it; |A| > 5 is clamped (so the group's sum is
    no longer 0, as released)."""
    v, u, v_ref, _ = tensors(6, 6)
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.3, 0.8], dtype=D)
    A, _ = group_advantages(rewards, ids, std="global", clip=None)
    A = A.double()
    _, grad, stats = check_dgpo(v, u, v_ref, A, ids, beta_dpo=100.0, group_size=2)
    assert torch.equal(grad[:2], torch.zeros_like(grad[:2])) and stats["group_sums"][0] == 0
    big = torch.tensor([7.0, -3.0, 0.5, -0.5, 12.0, -12.0], dtype=D)
    _, grad, stats = check_dgpo(v, u, v_ref, big, ids, beta_dpo=100.0, group_size=2)
    clamped = big.clamp(-5, 5)
    assert stats["group_sums"][0].item() == pytest.approx(
        (100.0 / 2 * clamped[:2] * (mse(u, v) - mse(u, v_ref))[:2]).sum().item(), rel=1e-12)


def test_dgpo_interleaved_ids_sorted_order_and_k_above_the_members_present():
    """Group ids in any order: S_g comes back in sorted-id order; K is the configured group size, not the count."""
    v, u, v_ref, _ = tensors(6, 7)
    ids = torch.tensor([30, 10, 30, 20, 10, 20])
    A = torch.tensor([1.0, -0.5, -1.0, 0.25, 0.5, -0.25], dtype=D)
    _, _, stats = check_dgpo(v, u, v_ref, A, ids, beta_dpo=40.0, group_size=16)
    delta = mse(u, v) - mse(u, v_ref)
    expected = [(40.0 / 16 * A[ids == g] * delta[ids == g]).sum().item() for g in (10, 20, 30)]
    assert stats["group_sums"].tolist() == pytest.approx(expected, rel=1e-12)


def test_dgpo_saturated_sigmoids():
    """A huge beta saturates sigmoid(S_g) to 0 or 1 without NaNs in the loss, its gradient or the logged DPO loss."""
    v, u, v_ref, _ = tensors(4, 8)
    ids = torch.tensor([0, 0, 1, 1])
    A = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=D)
    value, grad, stats = check_dgpo(v, u, v_ref, A, ids, beta_dpo=1e6, group_size=2)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    assert all(min(w, 1 - w) < 1e-12 for w in stats["sample_weights"].tolist())
    assert torch.isfinite(stats["dpo_loss"])


def test_dgpo_schedule_and_timestep_draw():
    assert [dgpo_decay(k) for k in (0, 1, 2, 11, 301, 302, 10_000)] == pytest.approx(
        [0.0, 0.0, 0.001, 0.01, 0.3, 0.3, 0.3])
    g = torch.Generator().manual_seed(0)
    draw = dgpo_timestep_indices(g, 4, 6)
    assert len(set(draw.tolist())) == 4 and all(0 <= i <= 6 for i in draw.tolist())
    assert sorted(dgpo_timestep_indices(g, 7, 6).tolist()) == list(range(7))
    with pytest.raises(ValueError):
        dgpo_timestep_indices(g, 8, 6)


# ------------------------------------------------------------------------------------------------ the settings
def test_dgpo_both_clips_off_with_the_ema_reference_is_refused_before_any_model_loads():
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from pathlib import Path

    preset = Path(__file__).resolve().parents[1] / "configs/methods/dgpo.yaml"
    with pytest.raises(ConfigError, match="use_ema_ref.*clip_dsm.*clip_kl"):
        load_config(TrainConfig, preset, ["objectives.dgpo.use_ema_ref=true", "objectives.dgpo.clip_dsm=false"])
    with pytest.raises(ConfigError, match="num_train_timesteps"):
        load_config(TrainConfig, preset, ["objectives.dgpo.num_train_timesteps=8"])
    with pytest.raises(ConfigError, match="trunc_steps"):
        load_config(TrainConfig, preset, ["objectives.dgpo.trunc_steps=12", "objectives.dgpo.num_train_timesteps=4"])
    with pytest.raises(ConfigError, match="kl_cfg"):
        load_config(TrainConfig, preset, ["objectives.dgpo.kl_cfg=4.5"])
    config = load_config(TrainConfig, preset, ["objectives.dgpo.use_ema_ref=true"])
    assert config.objectives["dgpo"].use_ema_ref


# --------------------------------------------------------------------------------------------------- the units
@pytest.mark.parametrize("noise", ["per_timestep", "per_iteration", "independent"])
def test_dgpo_units_share_noise_within_a_group_and_levels_across_groups(noise):
    """Every unit holds one whole group; a slot's level is the same for every sample; per_timestep (released) gives
    each group one noise redrawn at every level, per_iteration (Flow-Factory) one noise for all levels, independent
    one per sample."""
    from test_forward_objectives import CONFIG, _rollout
    from flowalign.objectives import OBJECTIVES, ObjectiveContext

    rollout = _rollout()
    objective = OBJECTIVES.build("dgpo", num_train_timesteps=3, trunc_steps=3, noise=noise)
    units = objective.units(2, ObjectiveContext(model=None, config=CONFIG, seed=3, iteration=2, rollout=rollout))
    assert len(units) == 3 * 2 and all(len(u) == 4 and len(set(u.data["group_ids"].tolist())) == 1 for u in units)
    indices = [u.data["index"] for u in units]
    assert len({indices[0], indices[2], indices[4]}) == 3 and indices[0::2] == indices[1::2]
    eps = [u.data["target"] + rollout.x0[4 * (k % 2):4 * (k % 2) + 4] for k, u in enumerate(units)]
    same = lambda a, b: torch.allclose(a, b, atol=1e-6)  # noqa: E731  (eps - x0 + x0 rounds)
    for e in eps:
        assert all(same(e[0], e[k]) for k in (1, 2, 3)) != (noise == "independent")
    assert same(eps[0], eps[2]) == (noise == "per_iteration")
    assert not same(eps[0][0], eps[1][0])  # two groups never share
    torch.testing.assert_close(units[0].sigma, rollout.sigmas[indices[0]].expand(4))

