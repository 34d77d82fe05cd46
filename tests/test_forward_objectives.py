"""The forward-process objectives (DiffusionNFT, AWM, online DPO): their math on hand-computed cases, their keyed units
on any process layout, the policy copies the trainer keeps for them, and the bad settings refused before any model
loads. The runs of their presets are in tests/test_presets.py, the 2-process run in tests/test_trainer.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from flowalign.components import PolicyCopy
from flowalign.config import ConfigError, load_config
from flowalign.models.base import Cond
from flowalign.objectives import OBJECTIVES, ObjectiveContext, RolloutSamples
from flowalign.objectives.awm import awm_log_likelihood, awm_policy_loss, awm_strata, elbo_std
from flowalign.objectives.diffusion_nft import nft_decay, nft_loss, optimality
from flowalign.objectives.dpo import dpo_loss, dpo_pairs, dpo_sigmas
from flowalign.training.config import TrainConfig
from flowalign.training.copies import PolicyCopies


# ----------------------------------------------------------------------------------------------- DiffusionNFT
def test_optimality_maps_clipped_advantages_onto_zero_one():
    a = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])
    assert optimality(a).tolist() == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert optimality(a, mode="positive_only").tolist() == [0.5, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0]
    assert optimality(a, mode="negative_only").tolist() == [0.0, 0.0, 0.25, 0.5, 0.5, 0.5, 0.5]
    assert optimality(a, mode="one_only").tolist() == pytest.approx([0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6])
    assert optimality(a, mode="binary").tolist() == pytest.approx([0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6])
    assert optimality(a, adv_clip_max=2.0).tolist() == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]


def test_old_policy_decay_follows_the_released_schedules():
    assert [nft_decay(k) for k in (0, 10, 499, 500, 10_000)] == pytest.approx([0.0, 0.01, 0.499, 0.5, 0.5])
    type2 = dict(delay=75, rate=0.0075, maximum=0.999)
    assert [nft_decay(k, **type2) for k in (0, 74, 75, 76, 100, 10_000)] == pytest.approx(
        [0.0, 0.0, 0.0, 0.0075, 0.1875, 0.999])
    assert nft_decay(40, rate=0.0, maximum=0.0) == 0.0  # decay_type 0: theta_old = theta


# One sample with two latent elements at s = 0.5: x0 = [1, -1], eps = [0, 2], so x_s = [0.5, 0.5] and u = [-1, 3].
X0, EPS, S = torch.tensor([[1.0, -1.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([0.5])
X = (1 - S[:, None]) * X0 + S[:, None] * EPS


def test_nft_loss_and_the_sign_of_the_implicit_negative_policy_by_hand():
    """v_old = [0, 1], v = [1, 1], beta = 1/2: v+ = beta v + (1 - beta) v_old = [0.5, 1] and v- = (1 + beta) v_old -
    beta v = [-0.5, 1], so v+ - v_old = +beta (v - v_old) and v- - v_old = -beta (v - v_old). Their x0 errors
    e = x_s - s v -+ - x0 are [-0.75, 1] and [-0.25, 1]: L+ = (0.5625 + 1) / 2 = 0.78125, L- = (0.0625 + 1) / 2 =
    0.53125, and with r = 0.8, A_max = 5: (5 / 0.5)(0.8 L+ + 0.2 L-) = 7.3125. Adaptively weighted by the mean
    absolute errors 0.875 and 0.625: 10 (0.8 * 0.892857 + 0.2 * 0.85) = 8.842857."""
    v_old, v = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.0, 1.0]])
    r = torch.tensor([0.8])
    plain, parts = nft_loss(v, v_old, X, X0, S, r, beta=0.5, adaptive=False)
    assert parts["positive"].item() == pytest.approx(0.78125) and parts["negative"].item() == pytest.approx(0.53125)
    assert plain.item() == pytest.approx(7.3125)
    weighted, parts = nft_loss(v, v_old, X, X0, S, r, beta=0.5)
    assert parts["positive"].item() == pytest.approx(0.78125 / 0.875)
    assert parts["negative"].item() == pytest.approx(0.53125 / 0.625)
    assert weighted.item() == pytest.approx(10 * (0.8 * 0.78125 / 0.875 + 0.2 * 0.53125 / 0.625))
    # the negative policy is the positive one mirrored about v_old: swapping the roles of r and 1 - r is the same as
    # mirroring v about v_old
    mirrored, _ = nft_loss(2 * v_old - v, v_old, X, X0, S, 1 - r, beta=0.5, adaptive=False)
    assert mirrored.item() == pytest.approx(plain.item())


def _gradient(v_old, r, **options):
    v = v_old.clone().requires_grad_(True)
    loss, _ = nft_loss(v, v_old, X, X0, S, torch.tensor([r]), beta=options.pop("beta", 1.0), **options)
    loss.sum().backward()
    return v.grad


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_gradient_is_zero_at_r_half_and_plain_flow_matching_at_r_one(beta):
    """At theta = theta_old: r = 1/2 gives exactly no gradient; r = 1 (unweighted) gives A_max s^2 times the plain
    flow-matching gradient 2 (v - u) / D whatever beta; r = 0 the opposite."""
    v_old = torch.tensor([[0.3, -0.7]])
    assert torch.equal(_gradient(v_old, 0.5, beta=beta), torch.zeros_like(v_old))
    u = EPS - X0
    flow_matching = 2 * (v_old - u) / u.numel()
    pull = _gradient(v_old, 1.0, beta=beta, adaptive=False)
    torch.testing.assert_close(pull, 5.0 * 0.25 * flow_matching)
    torch.testing.assert_close(_gradient(v_old, 0.0, beta=beta, adaptive=False), -pull)
    weighted = _gradient(v_old, 1.0, beta=beta)  # the adaptive weight rescales, never turns, the gradient
    assert torch.nn.functional.cosine_similarity(weighted.flatten(), pull.flatten(), dim=0) > 0.9999


def test_nft_rounds_raise_the_share_of_samples_above_the_mean_on_the_gaussian_flow():
    """On 1-D data N(M, C^2) (the exact flow plus a small MLP correction, zero at first) with reward 1[x0 > M], each
    round samples 256 images from theta_old with the Euler ODE, maps the rewards to r and takes 20 Adam steps of the
    NFT loss at random grid levels; theta_old then becomes theta. The share of ODE samples above M rises every round."""
    import copy

    from gaussian_flow import M, gaussian_velocity, sigmas
    from flowalign.samplers import rollout

    torch.manual_seed(0)

    class Velocity(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.f = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.SiLU(), torch.nn.Linear(32, 1))
            torch.nn.init.zeros_(self.f[2].weight)
            torch.nn.init.zeros_(self.f[2].bias)

        def forward(self, x, s):
            s = s.reshape(-1, 1).expand(len(x), 1) if torch.is_tensor(s) else torch.full((len(x), 1), float(s))
            return gaussian_velocity(x, s[:, 0]) + self.f(torch.cat([x, s], dim=1))

    grid = sigmas(10)

    @torch.no_grad()
    def sample(model, count, generator):
        return rollout(model, torch.randn(count, 1, generator=generator), grid, torch.zeros(10)).final

    def share(model):
        return float((sample(model, 2000, torch.Generator().manual_seed(1)) > M).float().mean())

    policy = Velocity()
    old = copy.deepcopy(policy)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    shares = [share(policy)]
    for round_ in range(3):
        g = torch.Generator().manual_seed(100 + round_)
        x0 = sample(old, 256, g)
        rewards = (x0[:, 0] > M).float()
        r = optimality((rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-4))
        for _ in range(20):
            s = grid[torch.randint(0, 10, (256,), generator=g)]
            x = (1 - s[:, None]) * x0 + s[:, None] * torch.randn(256, 1, generator=g)
            with torch.no_grad():
                v_old = old(x, s)
            loss, _ = nft_loss(policy(x, s), v_old, x, x0, s, r, beta=1.0)
            optimizer.zero_grad()
            loss.mean().backward()
            optimizer.step()
        old.load_state_dict(policy.state_dict())
        shares.append(share(policy))
    assert abs(shares[0] - 0.5) < 0.03
    assert all(b > a + 0.03 for a, b in zip(shares, shares[1:])), shares


# -------------------------------------------------------------------------------------------------------- AWM
def test_awm_surrogate_log_likelihoods_by_hand():
    l, s = torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.6], dtype=torch.float64)
    assert awm_log_likelihood(l, s, "uniform").item() == pytest.approx(-0.5)
    assert awm_log_likelihood(l, s, "t").item() == pytest.approx(-0.3)
    assert awm_log_likelihood(l, s, "t2").item() == pytest.approx(-0.18)
    assert awm_log_likelihood(l, s, "huber").item() == pytest.approx(-(math.sqrt(0.5 + 1e-10) - 1e-5) * 0.6)
    expected = -((0.5 + 1e-10) ** 0.25 - 1e-10 ** 0.25) * 0.6 / 0.25
    assert awm_log_likelihood(l, s, "ghuber", 0.25).item() == pytest.approx(expected, rel=1e-12)
    assert awm_log_likelihood(l, s, "ghuber").dtype == torch.float64


def test_awm_ratio_is_one_and_its_gradient_is_advantage_weighted_flow_matching():
    """rho = exp(g - sg(g)) is exactly 1, so the clipped term is worth -a; its gradient is a s l^(p - 1) grad l for
    ghuber, and a grad l for p = 1 with uniform weighting."""
    u = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]], dtype=torch.float64)
    v0 = torch.tensor([[0.1, 0.2, 0.3], [-0.4, 0.5, 0.6]], dtype=torch.float64)
    a, s = torch.tensor([0.8, -0.3]), torch.tensor([0.7, 0.4])
    for weighting, power in (("ghuber", 0.25), ("uniform", 1.0)):
        v = v0.clone().requires_grad_(True)
        l = (v - u).pow(2).mean(dim=1)
        loss, ratio = awm_policy_loss(awm_log_likelihood(l, s, weighting, power), a, clip_range=1.0)
        assert torch.equal(ratio, torch.ones_like(ratio)) and loss.item() == pytest.approx(-a.double().mean().item())
        loss.backward()
        grad_l = 2 * (v0 - u) / 3
        factor = s.double() * (l.detach() + 1e-10) ** (power - 1) if weighting == "ghuber" else torch.ones(2).double()
        torch.testing.assert_close(v.grad, (a.double() * factor)[:, None] * grad_l / 2)  # mean over the 2 rows


def test_awm_strata_of_the_released_grids():
    lower, upper = awm_strata(14, 0.9, 6)
    assert lower.tolist() == [1, 2, 4, 6, 8, 10] and upper.tolist() == [2, 4, 6, 8, 10, 12]  # {1}, {2,3}, ..., {10,11}
    lower, upper = awm_strata(10, 0.9, 6)
    assert lower.tolist() == [1, 2, 3, 5, 6, 7] and upper.tolist() == [2, 3, 5, 6, 7, 9]
    assert elbo_std(torch.tensor([0.5])).item() == pytest.approx(0.7)


# -------------------------------------------------------------------------------------------------------- DPO
def test_dpo_pairs_best_worst_ranked_and_ties():
    rewards = torch.tensor([0.2, 0.9, 0.1, 0.9])
    w, l, trained = dpo_pairs(rewards)
    assert (w.tolist(), l.tolist(), trained.tolist()) == ([1], [2], [True])  # first occurrence of the max
    w, l, trained = dpo_pairs(rewards, pairs="ranked")
    assert (w.tolist(), l.tolist(), trained.tolist()) == ([1, 3], [2, 0], [True, True])
    equal = torch.tensor([0.5, 0.5, 0.5])
    assert dpo_pairs(equal)[2].tolist() == [False]  # skipped
    w, l, trained = dpo_pairs(equal, ties="train")  # the released tie-break: sample 1 over sample 0
    assert (w.tolist(), l.tolist(), trained.tolist()) == ([1], [0], [True])
    w, l, trained = dpo_pairs(torch.tensor([1.0, 1.0, 1.0, 0.0]), pairs="ranked")
    assert (w.tolist(), l.tolist(), trained.tolist()) == ([0, 1], [3, 2], [True, False])
    w, l, trained = dpo_pairs(torch.tensor([0.3, float("nan"), 0.1]), torch.tensor([True, False, True]))
    assert (w.tolist(), l.tolist(), trained.tolist()) == ([0], [2], [True])  # an invalid sample never pairs first


def test_dpo_loss_by_hand_log_two_at_the_reference_and_a_step_prefers_the_winner():
    value, inside = dpo_loss(torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([1.5]), torch.tensor([1.5]), 2.0)
    assert inside.item() == pytest.approx(1.0) and value.item() == pytest.approx(math.log(1 + math.exp(-1)))
    errors = torch.tensor([0.7, 1.3])
    value, inside = dpo_loss(errors[:1], errors[1:], errors[:1], errors[1:], 100.0)
    assert value.item() == pytest.approx(math.log(2)) and inside.item() == 0.0
    # one gradient step on free velocities lowers the winner's error relative to the loser's
    u = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    v = torch.zeros(2, 2, requires_grad=True)
    ref = (torch.zeros(2, 2) - u).pow(2).mean(dim=1)
    error = (v - u).pow(2).mean(dim=1)
    loss, _ = dpo_loss(error[:1], error[1:], ref[:1], ref[1:], 10.0)
    loss.sum().backward()
    with torch.no_grad():
        after = (v - 0.01 * v.grad - u).pow(2).mean(dim=1)
    assert (after[0] - after[1]) < (ref[0] - ref[1])
    assert -(10.0 / 2) * ((after[0] - ref[0]) - (after[1] - ref[1])) > 0  # the implicit accuracy's argument


def test_dpo_noise_levels_index_the_training_table():
    n = torch.tensor([0.0, -20.0, 20.0])
    assert dpo_sigmas(n, shift=1.0).tolist() == pytest.approx([0.5, 1.0, 0.001])
    assert dpo_sigmas(n[:1], shift=3.0).item() == pytest.approx(0.75)


# -------------------------------------------------------------------------------------------- units and copies
def _rollout(n=8, group=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(n)
    return RolloutSamples(x0=torch.randn(n, 2, 3, 3, generator=g), sample_ids=ids, group_ids=ids // group,
                          advantages=torch.randn(n, generator=g), rewards=torch.rand(n, generator=g),
                          valid=torch.ones(n, dtype=torch.bool), cond=Cond(embeds=torch.randn(n // group, 5, 4)),
                          prompt_index=ids // group, sigmas=torch.linspace(1, 0, 5))


def _slice(rollout, part, parts):
    n = len(rollout) // parts
    rows = slice(part * n, (part + 1) * n)
    return RolloutSamples(rollout.x0[rows], rollout.sample_ids[rows], rollout.group_ids[rows], rollout.advantages[rows],
                          rollout.rewards[rows], rollout.valid[rows], rollout.cond, rollout.prompt_index[rows],
                          rollout.sigmas)


CONFIG = SimpleNamespace(sampling=SimpleNamespace(num_steps=4, batch_size=2), data=SimpleNamespace(group_size=4))
SETTINGS = {"diffusion_nft": {"batch_size": 2}, "awm": {"batch_size": 2, "train_sigmas": 3},
            "dpo": {"timestep_fraction": 0.99}, "dgpo": {"num_train_timesteps": 3, "trunc_steps": 3},
            "crd": {"kl_cfg": 1.0}}


def _units(name, rollout, part=0, parts=1):
    objective = OBJECTIVES.build(name, **SETTINGS[name])
    context = ObjectiveContext(model=None, config=CONFIG, seed=3, iteration=2, process_index=part, num_processes=parts,
                               rollout=rollout)
    return objective.units(2, context)


def _by_slot(units):
    return {slot: [u for u in units if u.data["slot"] == slot] for slot in sorted({u.data["slot"] for u in units})}


@pytest.mark.parametrize("name", ["diffusion_nft", "awm", "dpo", "dgpo", "crd"])
def test_units_are_keyed_by_sample_and_the_same_on_two_processes(name):
    """Each process makes the units of its own samples; slot by slot, its units are the 1-process units of those
    samples (the noise, the noise levels, the targets and the weights), whatever the layout."""
    rollout = _rollout()
    single = _by_slot(_units(name, rollout))
    split = [_by_slot(_units(name, _slice(rollout, p, 2), p, 2)) for p in range(2)]
    assert all(set(s) == set(single) for s in split) and len(single) == 3
    for slot, units in single.items():
        joined = split[0][slot] + split[1][slot]
        assert len(joined) == len(units)
        for a, b in zip(units, joined):
            assert torch.equal(a.x, b.x) and torch.equal(a.sigma, b.sigma)
            assert torch.equal(a.cond.embeds, b.cond.embeds)
            assert a.data.keys() == b.data.keys()
            for key, value in a.data.items():
                assert torch.equal(value, b.data[key]) if torch.is_tensor(value) else value == b.data[key]
    again = _by_slot(_units(name, rollout))
    assert all(torch.equal(a.x, b.x) for s in single for a, b in zip(single[s], again[s]))  # deterministic


def test_nft_units_noise_each_sample_at_distinct_grid_levels():
    units = _units("diffusion_nft", _rollout())
    grid = torch.linspace(1, 0, 5)[:-1]
    per_sample = torch.stack([torch.cat([u.sigma for u in units if u.data["slot"] == k]) for k in range(3)], dim=1)
    assert all(len(set(row.tolist())) == 3 for row in per_sample)  # a permutation's first 3: no level twice
    assert all(float(s) in grid.tolist() for s in per_sample.flatten())
    rollout = _rollout()
    first = units[0]
    torch.testing.assert_close(first.data["x0"], rollout.x0[:2])
    torch.testing.assert_close(first.data["r"], optimality(rollout.advantages[:2]))


def test_dpo_units_put_winners_before_losers_with_shared_noise_and_levels():
    rollout = _rollout()
    units = _units("dpo", rollout)
    assert len(units) == 3 * 2  # 3 draws x 2 groups of 4 (one pair each)
    for unit in units:
        assert len(unit) == 2 and unit.sigma[0] == unit.sigma[1]
    w, l, _ = dpo_pairs(rollout.rewards[:4])
    first = units[0]
    eps = first.data["target"] + torch.stack([rollout.x0[int(w)], rollout.x0[int(l)]])
    torch.testing.assert_close(eps[0], eps[1])  # the winner and the loser share the noise


def test_policy_copies_follow_their_schedule_swap_in_and_save():
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    copies = PolicyCopies({"w": weight}, [PolicyCopy("old", lambda k: 0.25), PolicyCopy("ref", lambda k: 1.0)])
    with torch.no_grad():
        weight.copy_(torch.tensor([5.0, 6.0]))
    assert copies.end_iteration(7) == {"old": 0.25, "ref": 1.0}
    state = copies.state_dict()
    torch.testing.assert_close(state["old/w"], torch.tensor([4.0, 5.0]))  # 0.25 [1, 2] + 0.75 [5, 6]
    assert torch.equal(state["ref/w"], torch.tensor([1.0, 2.0]))  # eta 1 keeps the initial weights
    with copies.swapped_in("old"):
        assert torch.equal(weight.detach(), torch.tensor([4.0, 5.0]))
    assert torch.equal(weight.detach(), torch.tensor([5.0, 6.0]))  # restored bitwise
    other = PolicyCopies({"w": weight}, [PolicyCopy("old", lambda k: 0.0), PolicyCopy("ref", lambda k: 0.0)])
    other.load_state_dict(state)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="is not in"):
        PolicyCopies({"w": weight}, [PolicyCopy("bad", lambda k: 1.5)]).end_iteration(1)


# ------------------------------------------------------------------------------------- bad input, before any model
def _error(*overrides, preset=None):
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, preset, list(overrides))
    return str(info.value)


NFT = "objectives.diffusion_nft"
OFF = "loss.grpo=null"


@pytest.mark.parametrize("overrides, message", [
    ([OFF, f"{NFT}.optimality=reward", "reward.rewards=[{name: pickscore}]"],
     f"{NFT}.optimality = 'reward' reads the combined reward as a probability in [0, 1], but reward.rewards[0] = "
     "'pickscore' declares no scores in [0, 1]"),
    ([OFF, f"{NFT}.optimality=reward", "reward.rewards=[{name: brightness, weight: 2.0}]"],
     f"{NFT}.optimality = 'reward' needs the reward weights to sum to at most 1"),
    ([OFF, f"{NFT}.optimality=reward", "reward.combine=normalize_then_sum"], "set reward.combine=sum_then_normalize"),
    ([OFF, f"{NFT}.beta=0"], f"{NFT}.beta must be > 0, got 0"),
    ([OFF, f"{NFT}.old_decay_max=1.5"], f"{NFT}.old_decay_max must be in [0, 1], got 1.5"),
    ([OFF, f"{NFT}.timestep_fraction=0.05"], f"{NFT}.timestep_fraction gives 0 trained noise levels per sample"),
    ([OFF, f"{NFT}.timestep_fraction=0.99", "optim.minibatches=2"],
     "optim.minibatches = 2 does not divide the 9 trained slots per sample of objectives.diffusion_nft"),
    ([f"{NFT}.sample_with_old=true"], f"{NFT}.sample_with_old rolls out with the 'old' policy, but loss terms (grpo)"),
    ([OFF, f"{NFT}.batch_size=5"], "objectives.diffusion_nft.batch_size makes units of 5 consecutive samples"),
    ([OFF, "objectives.dpo.beta=100", "data.group_size=1"], "data.group_size must be >= 2"),
    ([OFF, "objectives.dpo.ref_update_steps=40", "optim.minibatches=3", "objectives.dpo.timestep_fraction=0.3"],
     "objectives.dpo.ref_update_steps = 40 is not a multiple of the 3 optimizer steps of an iteration"),
    ([OFF, "objectives.dpo.ties=maybe"], "objectives.dpo.ties: expected one of 'skip', 'train'"),
    ([OFF, "objectives.dpo.groups_per_unit=3"], "objectives.dpo.groups_per_unit makes units of 48 consecutive samples"),
    ([OFF, "objectives.awm.batch_size=3"], "objectives.awm.batch_size makes units of 3 consecutive samples"),
    ([OFF, "objectives.awm.timestep_fraction=1.0"], "objectives.awm.timestep_fraction must be < 1"),
    ([OFF, "objectives.awm.ghuber_power=0"], "objectives.awm.ghuber_power must be > 0"),
    ([OFF, "objectives.awm.train_sigmas=4"], None),  # valid: the strata may repeat a grid index
    ([OFF, f"{NFT}.beta=1", "objectives.dpo.beta=100"], "objectives name different sampling policies (old, reference)"),
])
def test_bad_settings_are_refused_before_any_model_loads_naming_the_key(overrides, message):
    if message is None:  # a valid setting
        load_config(TrainConfig, None, overrides)
        return
    assert message in _error(*overrides)


def test_an_ode_rollout_serves_objectives_but_not_loss_terms():
    config = load_config(TrainConfig, None, [OFF, "sampling.noise_level=0", "objectives.awm.batch_size=4"])
    assert config.sampling.stochastic_steps() == 0 and config.check_batch(2).trained_steps == 0
    assert "sampling.noise_level leaves no stochastic step" in _error("sampling.noise_level=0")


def test_a_run_without_loss_terms_writes_a_config_that_loads_back_as_itself(tmp_path):
    """A default loss term switched off is written as null: ``loss: {}`` would load with loss.grpo on again (and a
    resumed objective-only run would refuse its own checkpoint)."""
    from flowalign.config import save_config, to_dict

    config = load_config(TrainConfig, None, [OFF, "sampling.noise_level=0", "objectives.awm.batch_size=4"])
    save_config(config, tmp_path / "config.yaml")
    assert "grpo: null" in (tmp_path / "config.yaml").read_text()
    again = load_config(TrainConfig, tmp_path / "config.yaml", [])
    assert not again.loss and to_dict(again) == to_dict(config)
