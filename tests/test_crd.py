"""CRD's pure loss against an independent float64 computation (value and d loss / d v by autograd), its decay
tables, strata and settings (docs/methods/crd.md; METHODS-3 §3)."""

import math

import pytest
import torch

from flowalign.config import ConfigError
from flowalign.objectives.crd import DECAY_PRESETS, crd_decay, crd_loss, crd_strata

from float64_cases import D, grad_of, mse, tensors


# ------------------------------------------------------------------------------------------------- CRD, by hand
def crd_reference(v, v_old, v_ref, u, A, *, beta=1.0, loss_type="mse", adaptive=True, T=-1.0, kl_beta=0.1,
                  adaptive_kl=True, amax=5.0, pools=None):
    """The port's loss with explicit per-sample loops: weights, centring pools and directions by hand."""
    B = len(v)
    r = []
    for i in range(B):
        e, e_old = v[i] - u[i], v_old[i] - u[i]
        w = max(e.detach().abs().mean().item(), 1e-5) if adaptive else 1.0
        w_old = max(e_old.abs().mean().item(), 1e-5) if adaptive else 1.0
        r.append(-((e ** 2).mean() / w - (e_old ** 2).mean().item() / w_old))
    a = [min(max(min(max(float(x), -amax), amax) / amax / 2 + 0.5, 0.0), 1.0) for x in A]
    pools = pools or [list(range(B))]

    def weights(idx):
        vals = [a[i] for i in idx]
        if T < 0:
            return [[1 / len(idx)] * len(idx)]
        if T > 0:
            out = []
            for sign in (1, -1):
                ex = [math.exp(sign * x / T) for x in vals]
                out.append([e / sum(ex) for e in ex])
            return out
        out = []
        for keep in (lambda x: x > 0, lambda x: x < 0):
            chosen = [x for x in vals if keep(x)]
            if not chosen:
                out.append([1 / len(idx)] * len(idx))
            else:
                z = sum(math.exp(x) for x in chosen)
                out.append([math.exp(x) / z if keep(x) else 0.0 for x in vals])
        return out

    per_direction = None
    terms = {}
    for idx in pools:
        ws = weights(idx)
        per_direction = len(ws)
        for d, p in enumerate(ws):
            a_bar = sum(pi * a[i] for pi, i in zip(p, idx))
            r_bar = sum(pi * r[i].item() for pi, i in zip(p, idx))
            for i in idx:
                x, y = beta * (r[i] - r_bar), a[i] - a_bar
                if loss_type == "mse":
                    term = (x - y) ** 2
                else:
                    q = 1 / (1 + math.exp(-y))
                    term = -(q * torch.nn.functional.logsigmoid(x) + (1 - q) * torch.nn.functional.logsigmoid(-x))
                terms.setdefault(d, []).append(term)
    unweighted = sum(sum(t) / len(t) for t in terms.values()) / per_direction
    loss = unweighted * amax / beta
    kl = [((v[i] - v_ref[i]) ** 2).mean() for i in range(B)]
    if adaptive_kl:
        m = 1e-4 / kl_beta if kl_beta > 0 else 1e4
        loss = loss + kl_beta * sum((m + a[i] * (1 - m)) * kl[i] for i in range(B)) / B
    else:
        loss = loss + kl_beta * sum(kl) / B
    return loss, torch.stack([x.detach() for x in r]), torch.tensor(a, dtype=D)


def check_crd(v, v_old, v_ref, u, A, pools=None, **kw):
    names = dict(crd_beta="beta", loss_type="loss_type", adaptive_logp="adaptive", weight_temp="T", kl_beta="kl_beta",
                 reward_adaptive_kl="adaptive_kl", adv_clip_max="amax")
    ref_kw = {names[k]: val for k, val in kw.items() if k in names}
    value, grad = grad_of(lambda x: crd_loss(x, v_old, v_ref, u, A, **kw)[0], v)
    expected, expected_grad = grad_of(lambda x: crd_reference(x, v_old, v_ref, u, A, pools=pools, **ref_kw)[0], v)
    assert value.item() == pytest.approx(expected.item(), rel=1e-11, abs=1e-14)
    assert torch.allclose(grad, expected_grad, rtol=1e-9, atol=1e-14)
    _, stats = crd_loss(v, v_old, v_ref, u, A, **kw)
    _, r, a = crd_reference(v, v_old, v_ref, u, A, pools=pools, **ref_kw)
    assert torch.allclose(stats["r_theta"], r, rtol=1e-12, atol=1e-15) and torch.allclose(stats["a"], a)
    assert torch.allclose(stats["kl"], mse(v, v_ref), rtol=1e-13)
    return value, grad, stats


ADVANTAGES = torch.tensor([1.5, -0.5, 7.0, -2.0, 0.0, -6.0], dtype=D)


@pytest.mark.parametrize("loss_type", ["mse", "bce"])
@pytest.mark.parametrize("temperature", [-1.0, 0.5, 0.0], ids=["uniform", "dual_softmax", "hard"])
def test_crd_every_mode_and_loss_type(loss_type, temperature):
    v, v_old, v_ref, u = tensors(6, 10)
    check_crd(v, v_old, v_ref, u, ADVANTAGES, loss_type=loss_type, weight_temp=temperature)


def test_crd_hard_split_runs_on_a_not_on_the_advantage():
    """T = 0 as released: the negative pool {a < 0} is empty (uniform fallback); the positive one is every sample
    with A > -5, weighted softmax(a) at temperature 1."""
    v, v_old, v_ref, u = tensors(3, 11)
    A = torch.tensor([2.0, -1.0, -5.0], dtype=D)  # a = 0.7, 0.4, 0
    _, _, stats = check_crd(v, v_old, v_ref, u, A, weight_temp=0.0, kl_beta=0.0)
    a, r = torch.tensor([0.7, 0.4, 0.0], dtype=D), stats["r_theta"]
    p = torch.softmax(torch.tensor([0.7, 0.4], dtype=D), 0)
    plus = ((r - (p * r[:2]).sum()) - (a - (p * a[:2]).sum())) ** 2
    minus = ((r - r.mean()) - (a - a.mean())) ** 2
    assert stats["unweighted_policy_loss"].item() == pytest.approx(0.5 * plus.mean().item() + 0.5 * minus.mean().item(),
                                                                   rel=1e-12)


def test_crd_without_adaptive_weights_and_beta_half():
    v, v_old, v_ref, u = tensors(6, 12)
    _, _, stats = check_crd(v, v_old, v_ref, u, ADVANTAGES, adaptive_logp=False, crd_beta=0.5)
    assert torch.allclose(stats["r_theta"], -(mse(v, u) - mse(v_old, u)), rtol=1e-13)
    assert stats["policy_loss"].item() == pytest.approx(stats["unweighted_policy_loss"].item() * 5 / 0.5, rel=1e-14)


@pytest.mark.parametrize("kl_beta, adaptive", [(0.1, True), (0.1, False), (0.0, True), (1e-4, True)])
def test_crd_kl_variants(kl_beta, adaptive):
    """Reward-adaptive KL: weight m + a (1 - m), m = 1e-4 / kl_beta (so at kl_beta = 1e-4 every weight is 1 and the
    plain KL comes back); strongest on the best samples."""
    v, v_old, v_ref, u = tensors(6, 13)
    _, _, stats = check_crd(v, v_old, v_ref, u, ADVANTAGES, kl_beta=kl_beta, reward_adaptive_kl=adaptive)
    kl, a = mse(v, v_ref), stats["a"]
    if kl_beta == 0:
        assert stats["kl_loss"].item() == 0.0
    elif adaptive:
        m = 1e-4 / kl_beta
        assert stats["kl_loss"].item() == pytest.approx(kl_beta * ((m + a * (1 - m)) * kl).mean().item(), rel=1e-13)
    else:
        assert stats["kl_loss"].item() == pytest.approx(kl_beta * kl.mean().item(), rel=1e-13)


def test_crd_equal_rewards_still_pull_the_centred_implicit_reward_to_zero():
    v, v_old, v_ref, u = tensors(4, 14)
    A = torch.zeros(4, dtype=D)
    _, grad, stats = check_crd(v, v_old, v_ref, u, A, kl_beta=0.0)
    r = stats["r_theta"]
    assert stats["unweighted_policy_loss"].item() == pytest.approx(((r - r.mean()) ** 2).mean().item(), rel=1e-12)
    assert stats["policy_loss"].item() > 0 and grad.abs().sum() > 0


def test_crd_clamped_advantages_batch_of_two_and_v_equal_to_v_old():
    v, _, v_ref, u = tensors(2, 15)
    A = torch.tensor([9.0, -9.0], dtype=D)  # a = 1, 0
    value, grad, stats = check_crd(v, v.clone(), v_ref, u, A, kl_beta=0.1)
    assert stats["a"].tolist() == [1.0, 0.0]
    assert torch.equal(stats["r_theta"], torch.zeros(2, dtype=D))
    # r = 0: the MSE is mean((a - mean a)^2) = 1/4, scaled by 5 / beta
    assert stats["policy_loss"].item() == pytest.approx(0.25 * 5, rel=1e-14)
    # at v = v_old the gradient of r_b is -2 (v - u) / (w D) per element: the policy part pulls sample 1 (centred
    # a = +1/2) toward u and pushes sample 2 away
    _, policy_grad = grad_of(lambda x: crd_loss(x, v, v_ref, u, A, kl_beta=0.0)[0], v)
    w = (v - u).abs().reshape(2, -1).mean(1).view(-1, 1, 1, 1)
    n = v[0].numel()
    dr = -2 * (v - u) / (w * n)
    centred = torch.tensor([0.5, -0.5], dtype=D).view(-1, 1, 1, 1)
    # d/dv_b of mean_c (beta (r_c - mean r) - R_c)^2 at r = 0, centred R: -R_b dr_b (the mean's term cancels)
    expected = 5 * (-centred) * dr * (2 / 2)
    assert torch.allclose(policy_grad, expected, rtol=1e-12)


def test_crd_group_centring_matches_the_batch_loss_of_each_group():
    """centering='group' centres within each group; the loss is the mean over all samples (interleaved ids)."""
    v, v_old, v_ref, u = tensors(6, 16)
    ids = torch.tensor([1, 0, 1, 0, 1, 0])
    for temperature in (-1.0, 0.5):
        check_crd(v, v_old, v_ref, u, ADVANTAGES, pools=[[1, 3, 5], [0, 2, 4]], weight_temp=temperature,
                  group_ids=ids, centering="group")


def test_crd_decay_tables():
    """The port's presets by number and name and the 'start-start_value-slope-end' spec."""
    table = {0: [0, 0, 0], 1: [0.0, 0.1, 0.5], 2: [0.0, 0.1875, 0.999], 3: [1.0, 1.0, 1.0], 4: [0.0, 0.99, 0.99],
             5: [0.0, 0.5, 0.5], 6: [0.0, 0.75, 0.999]}
    for key, values in table.items():
        assert [crd_decay(k, key) for k in (0, 100, 1000)] == pytest.approx(values)
        assert [crd_decay(k, str(key)) for k in (0, 100, 1000)] == pytest.approx(values)
    for name, number in {"none": 0, "slow": 1, "medium": 2, "offline": 3, "fast": 4, "moderate": 5}.items():
        assert DECAY_PRESETS[name] == DECAY_PRESETS[number]
    assert [crd_decay(k, "medium") for k in (74, 75, 76, 208)] == pytest.approx([0.0, 0.0, 0.0075, 0.9975])
    assert [crd_decay(k, "0-0.25-0.005-0.999") for k in (0, 1, 100, 150, 1000)] == pytest.approx(
        [0.25, 0.255, 0.75, 0.999, 0.999])
    assert [crd_decay(k, "10-0.5-0.1-0.9") for k in (0, 9, 10, 12, 20)] == pytest.approx([0.5, 0.5, 0.5, 0.7, 0.9])
    for bad in ("fastest", "1-2-3", "a-b-c-d", 9):
        with pytest.raises(ValueError):
            crd_decay(0, bad)


def test_crd_strata_cover_the_grid_but_the_last_level():
    sigmas = torch.linspace(1, 0, 11)[:-1]  # the 10 levels a 10-step rollout starts its steps at
    lower, upper = crd_strata(sigmas, 9, 0.99)
    assert lower.tolist() == list(range(9)) and upper.tolist() == list(range(1, 10))
    lower, upper = crd_strata(sigmas, 3, 0.5)  # s >= 0.5: indices 0..5
    assert lower.tolist() == [0, 1, 3] and upper.tolist() == [1, 3, 5]


# ------------------------------------------------------------------------------------------------ the settings
def test_crd_settings_are_checked():
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from pathlib import Path

    preset = Path(__file__).resolve().parents[1] / "configs/methods/crd.yaml"
    with pytest.raises(ConfigError, match="old_model_decay"):
        load_config(TrainConfig, preset, ["objectives.crd.old_model_decay=quick"])
    with pytest.raises(ConfigError, match="kl_cfg"):
        load_config(TrainConfig, preset, ["objectives.crd.kl_cfg=4.5"])
    with pytest.raises(ConfigError, match="loss_type"):
        load_config(TrainConfig, preset, ["objectives.crd.loss_type=hinge"])
    assert load_config(TrainConfig, preset, ["objectives.crd.old_model_decay=medium"]).objectives["crd"]
