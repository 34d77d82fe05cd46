"""SatisDive (METHODS.md section 4): the kernel, calibration, cutoff, penalties, update and clone rule on hand-computed
cases; the whole sampler against numbers from the reference implementation; exact NFE counts; the registered
sampler on the toy model.

Reference cases: tests/data/satisdive_reference_cases.json holds numbers computed by running
``UCF-CRCV/SatisDive`` at commit 4497035086015ef946b5799c5f5139aca913302c (``implementation/flux/ours.py::
run_ours_one_prompt`` and ``implementation/flux/sde.py::fk_flow_kernel_mean``) on CPU, float32, with the analytic
world of tests/satisdive_world.py standing in for FLUX, its VAE, the HPSv3 worker and the block-12 feature.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import satisdive_world as world
from flowalign.samplers.satisdive import (
    CLONE_SEED_STRIDE,
    acceptance,
    calibrate,
    clone_donors,
    clone_steps,
    cosine_distances,
    default_scoring_steps,
    diversity_penalty,
    floor_cutoff,
    floor_gradient,
    gated_diversity,
    hopeless_duds,
    lower_median,
    reference_generator,
    reward_ramp,
    satisdive_kernel,
    satisdive_nfe,
    satisdive_sampling,
    satisdive_update,
)
from flowalign.samplers.sde import sde_step

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "assets" / "toy-sd3"
CASES = json.loads((Path(__file__).parent / "data" / "satisdive_reference_cases.json").read_text())


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol,
                          rtol=0)


def symmetric(pairs, k=4):
    """A distance matrix from its pairs in (0,1), (0,2), .., (k-2,k-1) order."""
    d = torch.zeros(k, k)
    i, j = torch.triu_indices(k, k, offset=1)
    d[i, j] = torch.tensor(pairs, dtype=torch.float32)
    return d + d.T


# ------------------------------------------------------------------------------------------------ the kernel


def test_the_kernel_is_plain_euler_at_sigma_one():
    x, v = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]])
    mean, std = satisdive_kernel(x, v, 1.0, 0.9, 0.3)
    assert std == 0.0 and close(mean, [[0.95, 2.1]])


def test_the_kernel_mid_range_by_hand():
    """s = 0.5, s' = 0.4, a = 0.3: eta = 0.15, eta^2/2 = 0.01125, ds = -0.1; x = 1, v = 0.5: score = -(1 + 0.25)/0.5
    = -2.5, mean = 1 - 0.05 - (-0.1)(0.01125)(-2.5) = 0.9471875; x = 2, v = -1: score = -3, mean = 2.096625."""
    x, v = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]])
    mean, std = satisdive_kernel(x, v, 0.5, 0.4, 0.3)
    assert close(mean, [[0.9471875, 2.096625]]) and math.isclose(std, 0.15 * math.sqrt(0.1), rel_tol=1e-6)
    # METHODS.md identity 1: the dance kind at the time-varying level eta(s) = a sqrt(s (1 - s))
    dance = sde_step(x, v, 0.5, 0.4, kind="dance", noise_level=0.15, noise=torch.zeros_like(x))
    assert close(dance.prev_sample, mean) and close(dance.std.flatten()[0], std)


def test_the_kernel_is_plain_euler_below_sigma_1e_3():
    x, v = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, -1.0]])
    mean, std = satisdive_kernel(x, v, 5e-4, 0.0, 0.3)
    assert std == 0.0 and close(mean, [[1.0 - 2.5e-4, 2.0 + 5e-4]])
    assert satisdive_kernel(x, v, 0.5, 0.4, 0.0)[1] == 0.0  # a = 0: no noise, no drift correction


def test_the_kernel_matches_the_reference_cases():
    x, v = (torch.tensor(CASES["kernel_inputs"][key]) for key in ("x", "v"))
    for case in CASES["kernel"]:
        mean, std = satisdive_kernel(x, v, case["sigma"], case["sigma_next"], case["a"])
        assert close(mean, case["mean"], 1e-6) and math.isclose(std, case["std"], rel_tol=1e-6, abs_tol=1e-12)


# ------------------------------------------------------------------------------------------------ calibration


def test_cosine_distances_match_the_reference():
    features = torch.tensor(CASES["cos_dist"]["features"])
    assert close(cosine_distances(features), CASES["cos_dist"]["distances"], 1e-6)
    assert close(cosine_distances(torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 3.0]])),
                 [[0, 2, 1], [2, 0, 1], [1, 1, 0]])


def test_calibration_by_hand_with_the_lower_median():
    rewards = torch.tensor([[1.0, 2.0, 4.0, 5.0], [3.0, 3.0, 3.0, 3.0]])
    distances = torch.stack([symmetric([0.1, 0.5, 0.3, 0.2, 0.6, 0.4]), symmetric([1e-4] * 6)])
    latents = torch.zeros(2, 4, 2)
    latents[0, :, 0] = torch.tensor([3.0, 4.0, 5.0, 8.0])  # norms 3, 4, 5, 8: mean 5
    latents[1, :, 1] = 1.0
    cal = calibrate(rewards, distances, latents, delta_scale=2.0)
    assert close(cal.beta_r, [math.sqrt(10 / 3), 1e-3])  # unbiased std; equal rewards hit the 1e-3 floor
    # the six pairs sorted: 0.1 .. 0.6; the lower middle is 0.3 (not the mean of the two middles, 0.35)
    assert close(lower_median(torch.tensor([0.1, 0.5, 0.3, 0.2, 0.6, 0.4])), 0.3)
    assert close(cal.delta, [0.6, 2e-4]) and close(cal.beta_d, [0.3, 1e-3])
    assert close(cal.max_step, [0.5, 0.1]) and close(cal.latent_norm, [5.0, 1.0])


# ------------------------------------------------------------------------------------------------ cutoff and penalties


def test_cutoff_acceptance_gated_diversity_and_floor_gradient():
    r = torch.tensor([[1.0, 2.0, 4.0, 5.0]])
    tau = floor_cutoff(r, 1.5)
    assert close(tau, [3.5])
    q = acceptance(r, tau, 1.0)
    assert close(q, torch.sigmoid(torch.tensor([[-2.5, -1.5, 0.5, 1.5]])))
    d = symmetric([0.1, 0.5, 0.3, 0.2, 0.6, 0.4])[None]
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    num = sum(float(q[0, a] * q[0, b] * d[0, a, b]) for a, b in pairs)
    den = sum(float(q[0, a] * q[0, b]) for a, b in pairs)
    assert close(gated_diversity(q, d), [num / (den + 1e-6)])
    # two accepted particles: D_q is their distance alone
    q_hard = torch.tensor([[0.0, 0.0, 1.0, 1.0]])
    assert close(gated_diversity(q_hard, d), [0.4 / (1 + 1e-6)])
    # dL/dr = -(lam_r / beta_r) sigmoid((tau - r) / beta_r): -lam/(2 beta) at the cutoff, -lam/beta far below, 0 above
    grad = floor_gradient(torch.tensor([[3.5, -100.0, 100.0]]), 3.5, 0.5, lam_r=2.0)
    assert close(grad, [[-2.0, -4.0, 0.0]])
    assert close(floor_gradient(r, tau, 1.0), -torch.sigmoid(tau[:, None] - r))


def test_diversity_penalty_by_hand_and_its_feature_gradient_against_autograd():
    g = torch.Generator().manual_seed(1)
    phi = F.normalize(torch.randn(1, 4, 5, generator=g), dim=-1)
    live = (phi + 0.1 * torch.randn(1, 4, 5, generator=g)).requires_grad_(True)
    q = torch.tensor([[0.9, 0.2, 0.6, 0.7]])
    d = cosine_distances(phi)
    delta, beta_d = 0.8, 0.3
    penalty = diversity_penalty(live, phi, q, d, delta, beta_d)
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    den = sum(float(q[0, a] * q[0, b]) for a, b in pairs) + 1e-6
    unit_live = F.normalize(live.detach(), dim=-1)
    for k in range(4):
        total = 0.0
        for a, b in pairs:
            if k in (a, b):
                other = b if a == k else a
                dist = max(1 - float(unit_live[0, k] @ phi[0, other]), 0.0)
            else:
                dist = float(d[0, a, b])
            total += float(q[0, a] * q[0, b]) * dist
        assert math.isclose(float(penalty[0, k].detach()), math.log1p(math.exp((delta - total / den) / beta_d)), rel_tol=1e-5)
    # d L_div_k / d live_k by hand: sigmoid((delta - D)/beta_d) (-1/beta_d) dD/dlive_k, with
    # d(1 - cos(live_k, phi_j))/dlive_k = -(phi_j - u_k (u_k . phi_j)) / ||live_k||
    (autograd,) = torch.autograd.grad(penalty.sum(), live)
    for k in range(4):
        lk = live.detach()[0, k]
        u = lk / lk.norm()
        d_k = sum(float(q[0, k] * q[0, j]) * (-(phi[0, j] - u * (u @ phi[0, j])) / lk.norm()) for j in range(4) if j != k)
        big_d = math.log(math.expm1(float(penalty[0, k].detach()))) * -beta_d + delta  # D_q^(k) from the penalty itself
        by_hand = torch.sigmoid(torch.tensor((delta - big_d) / beta_d)) * (-1 / beta_d) * d_k / den
        assert torch.allclose(autograd[0, k], by_hand, atol=1e-5), k
    # each L_div_k depends on its own live feature only
    (cross,) = torch.autograd.grad(diversity_penalty(live, phi, q, d, delta, beta_d)[0, 0], live)
    assert cross[0, 1:].abs().max() == 0


# ------------------------------------------------------------------------------------------------ the update


def _rows(norms, directions):
    return torch.stack([n * direction for n, direction in zip(norms, directions)])


def test_the_update_moves_by_unit_directions_whatever_the_raw_gradient_norms():
    e = torch.eye(8)
    u_rew, u_div = [e[0], e[1], e[2], e[3]], [e[4], e[5], e[6], e[7]]  # orthogonal channels
    x = torch.zeros(4, 8)
    floor = torch.tensor([[-4.0, -2.0, -1.0, 0.0]])  # wf_rel = 1, 0.5, 0.25, 0
    for rew_norms, div_norms in [([0.01, 1, 10, 50], [50, 10, 1, 0.01]), ([50, 50, 50, 50], [0.01] * 4)]:
        moved = satisdive_update(x, _rows(rew_norms, u_rew), _rows(div_norms, u_div), floor, 100.0, 0.5, 0.5)
        w_rew = reward_ramp(0.5)  # 1.25
        expected = -0.5 * (w_rew * torch.tensor([1.0, 0.5, 0.25, 0.0])[:, None] * torch.stack(u_rew)
                           + torch.stack(u_div))
        assert close(moved, expected)
    # parallel channels: the move is step (w_rew wf_rel + 1) long, 1.0 .. 2.25 here (the reference's 1.0-1.9)
    same = satisdive_update(x, _rows([0.01, 1, 10, 50], u_rew), _rows([50, 10, 1, 0.01], u_rew), floor, 100.0, 1.0,
                            0.5)
    assert close(same.norm(dim=1), [2.25, 1.625, 1.3125, 1.0])
    # a binding clip: each channel limited to max_step = 0.4 per particle
    clipped = satisdive_update(x, _rows([0.01, 1, 10, 50], u_rew), _rows([50, 10, 1, 0.01], u_div), floor, 0.4, 1.0,
                               0.0)
    expected = -(0.5 * torch.tensor([0.4, 0.4, 0.25, 0.0])[:, None] * torch.stack(u_rew) + 0.4 * torch.stack(u_div))
    assert close(clipped, expected)
    # a zero gradient stays a zero move (norm clamped at 1e-12), and wf_rel is relative within each prompt
    zero = satisdive_update(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(4, 8), floor, 1.0, 1.0, 0.0)
    assert zero.abs().max() == 0
    two = satisdive_update(torch.zeros(4, 8), torch.stack(u_rew), torch.zeros(4, 8),
                           torch.tensor([[-2.0, -1.0], [-0.1, -0.05]]), 10.0, torch.tensor([1.0, 2.0]), 0.0)
    assert close(two.norm(dim=1), [0.5, 0.25, 1.0, 0.5])  # w_rew 0.5, wf_rel (1, 0.5) in both prompts, steps 1, 2


def _world_state(margin=0.3, sigma=0.6):
    torch.manual_seed(0)
    x = torch.randn(4, *world.SHAPE)
    v, phi = world.velocity_and_feature(x, sigma)
    r = world.reward(world.decode(x - sigma * v))[None]
    d = cosine_distances(phi[None])
    cal = calibrate(r, d, x[None])
    tau = floor_cutoff(r, margin)
    return x, phi, r, d, cal, tau, acceptance(r, tau, cal.beta_r)


def _penalties(x, sigma, phi, d, cal, tau, q):
    v, live = world.velocity_and_feature(x, sigma)
    r = world.reward(world.decode(x - sigma * v))[None]
    floor = F.softplus((tau[:, None] - r) / cal.beta_r[:, None]).sum()
    return float(floor), float(diversity_penalty(live[None], phi[None], q, d, cal.delta, cal.beta_d).sum())


def test_one_update_step_lowers_the_penalties():
    sigma = 0.6
    x, phi, r, d, cal, tau, q = _world_state(sigma=sigma)
    floor_grad = floor_gradient(r, tau, cal.beta_r)
    x_in = x.clone().requires_grad_(True)
    v, live = world.velocity_and_feature(x_in, sigma)
    scores = world.reward(world.decode(x_in - sigma * v))
    (g_rew,) = torch.autograd.grad((floor_grad.reshape(-1) * scores).sum(), x_in, retain_graph=True)
    (g_div,) = torch.autograd.grad(diversity_penalty(live[None], phi[None], q, d, cal.delta, cal.beta_d).sum(), x_in)
    floor0, div0 = _penalties(x, sigma, phi, d, cal, tau, q)
    assert floor0 > 0.5 and div0 > 0.1  # both penalties are active here
    step = lambda lam_r, lam_d: _penalties(satisdive_update(x, g_rew, g_div, floor_grad, 100.0, 0.03, 0.5, lam_r,
                                                            lam_d), sigma, phi, d, cal, tau, q)
    assert step(1, 0)[0] < floor0 and step(0, 1)[1] < div0  # each channel lowers its own penalty
    both = step(1, 1)
    assert both[0] < floor0 and both[1] < div0


# ------------------------------------------------------------------------------------------------ the clone rule


def test_clone_rule_accepted_duds_and_hopeless():
    r_cd = torch.tensor([[5.0, 1.0, 4.9, 2.0]])
    accepted, dud, hopeless = hopeless_duds(r_cd, None, 4.0, 0.1, 2)
    assert accepted.tolist() == [[True, False, True, False]] and dud.tolist() == [[False, True, False, True]]
    assert not hopeless.any()  # the first clone step: the gain is infinite, nothing is hopeless
    previous = torch.tensor([[4.8, 0.9, 4.7, 1.0]])  # gains 0.2, 0.1, 0.2, 1.0
    # two scoring steps left: 1 + 0.1 * 2 = 1.2 < 4 is hopeless; 2 + 1.0 * 2 = 4 is not below the cutoff
    assert hopeless_duds(r_cd, previous, 4.0, 0.1, 2)[2].tolist() == [[False, True, False, False]]
    assert hopeless_duds(r_cd, previous, 4.0, 0.1, 1)[2].tolist() == [[False, True, False, True]]
    # a falling reward counts as no gain; a reward exactly at the cutoff is neither accepted nor a dud
    falling = hopeless_duds(torch.tensor([[5.0, 3.9]]), torch.tensor([[5.0, 4.5]]), 4.0, 0.1, 5)
    assert falling[2].tolist() == [[False, True]]
    at_cutoff = hopeless_duds(torch.tensor([[4.0, 5.0]]), None, 4.0, 0.1, 1)
    assert at_cutoff[0].tolist() == [[False, True]] and at_cutoff[1].tolist() == [[False, False]]


def test_clone_donors_are_drawn_uniformly_among_accepted_peers_with_the_reference_seed():
    generator = reference_generator(7, 9, CLONE_SEED_STRIDE)
    assert generator.initial_seed() == 7 + 104729 * 10
    accepted = torch.tensor([True, False, True, False])
    hopeless = torch.tensor([False, True, False, True])
    replay = reference_generator(7, 9, CLONE_SEED_STRIDE)
    expected = [(w, [0, 2][int(torch.randint(2, (1,), generator=replay))]) for w in (1, 3)]
    assert clone_donors(accepted, hopeless, generator) == expected
    draws = [clone_donors(accepted, torch.tensor([False, True, False, False]), torch.Generator().manual_seed(s))[0][1]
             for s in range(200)]
    assert set(draws) == {0, 2} and 60 < draws.count(0) < 140
    # never onto itself: the only accepted peer other than w
    assert clone_donors(torch.tensor([True, True, False]), torch.tensor([True, False, False]),
                        torch.Generator().manual_seed(0)) == [(0, 1)]
    # no accepted particle, or none but w itself: no clone and no draw
    for acc, hop in [([False] * 3, [True, False, False]), ([True, False, False], [True, False, False])]:
        g = torch.Generator().manual_seed(3)
        assert clone_donors(torch.tensor(acc), torch.tensor(hop), g) == []
        assert torch.equal(torch.randint(100, (3,), generator=g),
                           torch.randint(100, (3,), generator=torch.Generator().manual_seed(3)))


# ------------------------------------------------------------------------------------------------ the reference


# delta and beta_d are lower medians of float32 cosine distances 1 - cos (about 0.008 here): the cancellation leaves
# them an absolute error of a float32 ulp of 1 (1.2e-7), 1.5e-5 relative, which rel_tol alone does not cover. Measured
# on an AMD EPYC (AVX512) under ATEN_CPU_CAPABILITY=default, avx2 and avx512, every run: the largest deviation from the
# reference of delta and beta_d was 1.19e-7 absolute (1.5e-5 relative, seed 3, default; 0 under avx2 and avx512), of
# beta_r 7.5e-7 and of max_step 4.9e-8 relative. 1e-6 is 8 such ulps. The other quantities' largest deviations
# (any capability): rewards 1.9e-6, tau 8.6e-7, q 1.4e-6, diversity 3.0e-7, floor weights 6.2e-6, re-scores 1.2e-6,
# latents 3.6e-7, all at least 5x inside their tolerances; the move is the reference's 4-decimal rounding (5.0e-5).
CALIBRATION_ATOL = 1e-6


@pytest.mark.float_sensitive
@pytest.mark.parametrize("run", CASES["runs"], ids=lambda run: f"seed{run['seed']}")
def test_the_sampler_reproduces_the_reference_run(run):
    """With the reference's options (stale velocity, absolute step) and its seeds, every scoring step's rewards,
    cutoff, acceptance, gated diversity, floor weights, move and clones, the calibration and the final latents agree
    with the reference implementation's, run on the same analytic world."""
    velocity_features, guide = world.sampler_callables()
    seen = []

    def watched(x, sigma, rows):
        seen.append((float(sigma), x.detach().clone()))
        return velocity_features(x, sigma, rows)

    watched.evals_per_sample = 1
    result = satisdive_sampling(
        watched, guide, torch.tensor(run["sigmas"]), world.SHAPE, [torch.Generator().manual_seed(0)],
        run["candidates"], margin=run["margin"], scoring_steps=run["scoring_steps"], step=run["step_size"],
        step_scale="absolute", velocity="stale", reference_seeds=[run["seed"]], initial=torch.tensor(run["initial"]))
    cal = result.info["calibration"]
    for key in ("beta_r", "delta", "beta_d", "max_step"):
        assert math.isclose(cal[key][0], run["calibration"][key], rel_tol=2e-6, abs_tol=CALIBRATION_ATOL), key
    for record, ref in zip(result.info["trace"], run["steps"], strict=True):
        i = record["step"]
        assert i == ref["step"] and math.isclose(record["p"], i / (run["num_steps"] - 1))
        assert close(record["rewards"][0], run["rewards_trace"][i], 1e-5)
        assert close(record["tau"][0], ref["tau"], 1e-5) and close(record["q"][0], ref["q_full"], 1e-5)
        assert close(record["diversity"][0], ref["D_q_full"], 1e-5)
        assert close(record["floor_weights"][0], ref["w_floor_full"], 1e-4)
        assert close(record["moved"][0], ref["applied_step_norm"], 6e-5)  # the reference rounds to 4 decimals
        clone = ref["clone"]
        if clone is None:
            assert record["rescored"] is None and record["clones"] == []
        else:
            assert close(record["rescored"][0], clone["r_cd_full"], 1e-5)
            assert [(w, donor) for _, w, donor in record["clones"]] == [(c["w"], c["donor"]) for c in clone["cloned"]]
            # the re-score's forward sees the updated latents
            after = [x for s, x in seen if math.isclose(s, record["sigma"], rel_tol=1e-7)][-1]
            assert close(after, run["updated_latents"][str(i)], 1e-5)
    assert any(ref["clone"] and ref["clone"]["cloned"] for ref in run["steps"])  # the case exercises a clone
    assert close(result.final[0], run["final"], 1e-5)


# ------------------------------------------------------------------------------------------------ NFEs


class Backwards(torch.autograd.Function):
    """Identity whose backward counts the rows it is run on (a backward pass through the 'transformer')."""

    rows = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        Backwards.rows += grad.shape[0]
        return grad


def test_default_scoring_steps_scale_the_reference_pattern():
    assert default_scoring_steps(28) == [4, 8, 12, 16, 20, 24]  # FLUX's
    assert default_scoring_steps(10) == [1, 3, 4, 6, 7, 9]
    assert default_scoring_steps(20) == [3, 6, 9, 11, 14, 17]
    assert default_scoring_steps(2) == [1] and default_scoring_steps(1) == [0]
    assert clone_steps([4, 8, 12, 16, 20, 24], 28, 0.5) == [16, 20, 24]


@pytest.mark.parametrize("velocity", ["recompute", "stale"])
@pytest.mark.parametrize("gradient", ["full", "x0"])
@pytest.mark.parametrize("evals", [1, 2])
def test_nfes_are_counted_call_by_call_and_match_the_formula(velocity, gradient, evals):
    base, guide = world.sampler_callables()
    forward_rows = [0]

    def counted(x, sigma, rows):
        forward_rows[0] += x.shape[0]
        return base(Backwards.apply(x), sigma, rows)

    counted.evals_per_sample = evals
    Backwards.rows = 0
    prompts, k, steps, scoring = 2, 3, 8, [1, 3, 5, 7]
    sigmas = torch.cat([torch.linspace(1, 1 / steps, steps), torch.zeros(1)])
    generators = [torch.Generator().manual_seed(p) for p in range(prompts)]
    result = satisdive_sampling(counted, guide, sigmas, world.SHAPE, generators, k, margin=0.2,
                                scoring_steps=scoring, velocity=velocity, gradient=gradient,
                                final_reward=lambda x0, rows: guide(x0, rows).detach())
    clones = len(clone_steps(scoring, steps, 0.5))  # steps 5 and 7 (p = 5/7, 1)
    assert clones == 2
    forwards = steps + len(scoring) + (len(scoring) if velocity == "recompute" else clones)
    backwards = len(scoring) * (2 if gradient == "full" else 1)
    assert forward_rows[0] == prompts * k * forwards and Backwards.rows == prompts * k * backwards
    expected = evals * k * (forwards + backwards)
    assert result.nfe.tolist() == [expected] * prompts
    assert expected == satisdive_nfe(steps, scoring, k, velocity=velocity, gradient=gradient, evals_per_sample=evals)
    assert result.final.shape == (prompts, k, *world.SHAPE) and result.reward.shape == (prompts, k)
    with pytest.raises(ValueError, match=f"raise --budget to at least {expected}"):
        satisdive_sampling(counted, guide, sigmas, world.SHAPE, generators, k, margin=0.2, scoring_steps=scoring,
                           velocity=velocity, gradient=gradient, budget=expected - 1)


def test_pass_b_in_chunks_gives_the_same_run():
    base, guide = world.sampler_callables()
    sigmas = torch.cat([torch.linspace(1, 1 / 8, 8), torch.zeros(1)])
    generators = lambda: [torch.Generator().manual_seed(p) for p in range(2)]
    runs = [satisdive_sampling(base, guide, sigmas, world.SHAPE, generators(), 3, margin=0.2, grad_chunk=chunk)
            for chunk in (None, 1, 4)]
    for other in runs[1:]:
        assert torch.allclose(other.final, runs[0].final, atol=1e-5) and torch.equal(other.nfe, runs[0].nfe)


def test_recompute_steps_with_the_velocity_at_the_updated_latents():
    """A run with no scoring step equals plain SDE sampling; with scoring steps the two velocity modes differ, and
    the recompute mode's SDE steps use the forward at the latents they move."""
    base, guide = world.sampler_callables()
    sigmas = torch.cat([torch.linspace(1, 1 / 6, 6), torch.zeros(1)])
    runs = {}
    for mode in ("recompute", "stale"):
        calls = []

        def watched(x, sigma, rows):
            calls.append((round(float(sigma), 6), torch.is_grad_enabled(), x.detach().clone()))
            return base(x, sigma, rows)

        watched.evals_per_sample = 1
        runs[mode] = satisdive_sampling(watched, guide, sigmas, world.SHAPE, [torch.Generator().manual_seed(4)], 4,
                                        margin=0.3, scoring_steps=[2], clone_from=2.0, velocity=mode), calls
    recompute, calls = runs["recompute"]
    assert not torch.equal(recompute.final, runs["stale"][0].final)
    # at the scoring step: pass A, pass B (grad) at x, then the recompute at the updated latents x'
    at_step = [c for c in calls if c[0] == round(float(sigmas[2]), 6)]
    assert [grad for _, grad, _ in at_step] == [False, True, False]
    assert torch.equal(at_step[0][2], at_step[1][2]) and not torch.equal(at_step[0][2], at_step[2][2])
    moved = at_step[2][2]
    assert close((moved - at_step[0][2]).flatten(1).norm(dim=1), recompute.info["trace"][0]["moved"][0], 1e-5)


# ------------------------------------------------------------------------------------------------ the toy model


@pytest.fixture(scope="module")
def toy():
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.models.loading import load_flow_model

    model = load_flow_model(TOY)
    model.transformer.requires_grad_(False)
    metadata = load_metadata(REPO / "assets" / "prompts" / "test.jsonl")[:2]
    return model, metadata


def _config(candidates=4, **kwargs):
    from flowalign.inference.sample import SampleConfig

    return SampleConfig(guidance="satisdive", **({} if candidates is None else {"candidates": candidates}), **kwargs)


def test_block_features_read_the_middle_block_in_the_velocitys_own_forward(toy):
    from flowalign.inference.sample import encode_prompts, prompt_velocity
    from flowalign.inference.satisdive import block_features

    model, metadata = toy
    prompts = [m["prompt"] for m in metadata]
    velocity = prompt_velocity(model, encode_prompts(model, prompts))
    x = torch.randn(2, *model.latent_shape(1)[1:], generator=torch.Generator().manual_seed(0))
    rows, sigma = torch.arange(2), torch.tensor(0.5)
    block = model.transformer.transformer_blocks[2]
    with block_features(velocity, model.transformer) as features:
        assert features.block == 2 and len(block._forward_hooks) == 1  # 4 blocks: the middle one
        with torch.no_grad():
            v, phi = features(x, sigma, rows)
            assert torch.equal(v, velocity(x, sigma, rows))  # the velocity is untouched
        assert phi.shape == (2, 128) and close(phi.norm(dim=1), [1.0, 1.0], 1e-5)
        with torch.enable_grad():
            x_in = x.clone().requires_grad_(True)
            _, live = features(x_in, sigma, rows)
            (grad,) = torch.autograd.grad(live[:, 0].sum(), x_in)
        assert grad.abs().sum() > 0  # pass B differentiates the feature
    assert len(block._forward_hooks) == 0
    with pytest.raises(ValueError, match="out of range: the transformer has 4 blocks"):
        with block_features(velocity, model.transformer, 4):
            pass


def test_satisdive_on_the_toy_model_two_prompts_four_candidates(toy):
    from flowalign.inference.sample import build_guide_reward, run_guided
    from flowalign.toy.reward import ToyGenEvalReward

    model, metadata = toy
    config = _config(rgs_reward="toy_geneval_soft", budget=136, steps=10)
    config.validate()
    rows = [0]
    handle = model.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: rows.__setitem__(0, rows[0] + kwargs["hidden_states"].shape[0]), with_kwargs=True)
    try:
        result = run_guided(model, metadata, config, reward_fn=ToyGenEvalReward(partial_credit=True),
                            guide_reward=build_guide_reward("toy_geneval_soft"))
    finally:
        handle.remove()
    # 10 steps, 6 scoring steps (1, 3, 4, 6, 7, 9): 4 (10 + 6 (pass B + recompute or re-score) + 6 x 2 backwards)
    assert result.nfe.tolist() == [136, 136] and rows[0] == 2 * 4 * (10 + 6 + 6)
    assert result.final.shape == (2, 4, *model.latent_shape(1)[1:]) and result.reward.shape == (2, 4)
    assert ((result.reward >= 0) & (result.reward <= 1)).all()
    assert result.info["feature_block"] == 2 and result.info["scoring_steps"] == [1, 3, 4, 6, 7, 9]
    assert not torch.equal(result.final[0, 0], result.final[0, 1])
    assert len(model.transformer.transformer_blocks[2]._forward_hooks) == 0
    plain = run_guided(model, metadata, _config(rgs_reward="toy_geneval_soft", budget=136, steps=10, seed=0),
                       reward_fn=ToyGenEvalReward(partial_credit=True),
                       guide_reward=build_guide_reward("toy_geneval_soft"))
    assert torch.equal(plain.final, result.final)  # keyed seeds: the same run again
    with pytest.raises(ValueError, match="raise --budget to at least 136"):
        run_guided(model, metadata, _config(rgs_reward="toy_geneval_soft", budget=135, steps=10),
                   reward_fn=ToyGenEvalReward(partial_credit=True), guide_reward=build_guide_reward("toy_geneval_soft"))


@pytest.mark.parametrize(
    "kwargs,candidates,key,message",
    [
        ({}, 4, "reward", "pass --rgs-reward NAME"),
        ({"rgs_reward": "toy_geneval_soft"}, None, "candidates", "pass --candidates K with K >= 2"),
        ({"rgs_reward": "toy_geneval_soft"}, 1, "candidates", "pass --candidates K with K >= 2"),
        ({"rgs_reward": "toy_geneval_soft", "budget": 135}, 4, "budget", "raise --budget to at least 136"),
        # 4 steps: scoring steps 1, 2, 3, clone steps 2, 3; 3 (4 + 3 x 4) = 48
        ({"rgs_reward": "toy_geneval_soft", "budget": 47, "steps": 4}, 3, "budget", "cost 48 NFEs per prompt"),
    ],
)
def test_bad_settings_fail_before_any_model_loads(kwargs, candidates, key, message):
    from flowalign.config import ConfigError

    config = _config(candidates, **{"budget": 400, "steps": 10, **kwargs})
    with pytest.raises(ConfigError, match=message) as error:
        config.validate()
    assert error.value.key == key


@pytest.mark.parametrize(
    "setting,value,key",
    [("delta", float("nan"), "delta"), ("delta", float("inf"), "delta"), ("delta", -0.1, "delta"),
     ("scoring_steps", [2, 2], "scoring_steps"), ("scoring_steps", [12], "sampler.scoring_steps"),
     ("step", 0.0, "step"), ("delta_scale", 0.0, "delta_scale"), ("feature_block", -1, "feature_block"),
     ("grad_chunk", 0, "grad_chunk")],
)
def test_bad_satisdive_settings_name_their_key(setting, value, key):
    from flowalign.config import ConfigError

    config = _config(rgs_reward="toy_geneval_soft", budget=400, steps=10)
    setattr(config.sampler, setting, value)
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert error.value.key.endswith(key)


def test_flowalign_sample_refuses_satisdive_without_a_differentiable_reward(tmp_path, capsys):
    from flowalign.cli import main

    for argv, message in [([], "pass --rgs-reward NAME"),
                          (["--rgs-reward", "toy_geneval_soft", "--delta", "-1"], "delta must be >= 0"),
                          (["--rgs-reward", "toy_geneval_soft", "--delta", ".inf"], "must be a finite number >= 0"),
                          (["--rgs-reward", "toy_geneval_soft"], "pass --candidates K with K >= 2")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["sample", "--guidance", "satisdive", "--model", str(tmp_path / "absent"), "--out",
                  str(tmp_path / "o"), *argv])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, argv
        assert not (tmp_path / "o").exists()


def test_flowalign_sample_satisdive_writes_every_candidate(tmp_path, capsys):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--guidance", "satisdive", "--candidates", "4", "--budget", "136", "--rgs-reward",
              "toy_geneval", "--model",
              str(tmp_path / "absent"), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and "not differentiable" in capsys.readouterr().err
    out = tmp_path / "satisdive"
    assert main(["sample", "--guidance", "satisdive", "--candidates", "4", "--rgs-reward", "toy_geneval_soft",
                 "--budget", "136", "--steps", "10", "--max-prompts", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert len(results["results"]) == 8 and all(r["nfe"] == 136 for r in results["results"])
    assert (out / "images" / "0001_03.png").is_file()
