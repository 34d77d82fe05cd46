"""FK steering as its reference code defines it (flowalign.samplers.fk: fk_resample_step, fk_schedule,
fk_steering_reference), against hand-computed cases and cases recorded from the reference implementation.

tests/data/fk_reference_cases.json holds numbers recorded from ``FKD.resample`` in
``zacharyhorvitz/Fk-Diffusion-Steering`` (``text_to_image/fkd_diffusers/fkd_class.py``, commit 9413005dee1e, the file
last changed in 2a0e76191318), run unmodified in a scratch folder on fixed float32 rewards with its multinomial draws
recorded (the JSON's ``source`` and ``recipe``). Given the same ancestors, flowalign's log-space numbers must match to
rounding, except in the overflow cases, where flowalign must differ.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.samplers.fk import (
    FKState,
    fk_log_weights,
    fk_resample_step,
    fk_schedule,
    fk_steering,
    fk_steering_reference,
    multinomial_draw,
)
from flowalign.samplers.guided import best_of_n, group_argmax, group_topk
from gaussian_flow import CountingVelocity, gaussian_velocity, generators, mean_reward, sigmas

REPO = Path(__file__).resolve().parents[1]
CASES = json.loads((REPO / "tests" / "data" / "fk_reference_cases.json").read_text())
SHAPE = (6,)


def tensor(values):
    """float32 inputs as the reference saw them (null = NaN), in float64."""
    return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32).double()


def state(pop, log_prod):
    return FKState(torch.tensor(pop, dtype=torch.float64), torch.tensor(log_prod, dtype=torch.float64))


def fixed(indices):
    """An injected ancestor draw returning ``indices``; records the weights it was given."""

    def draw(weights):
        draw.weights = weights.clone()
        return torch.tensor(indices)

    draw.weights = None
    return draw


# ------------------------------------------------------------------------------------------------ hand-computed


def test_potentials_and_the_last_index_correction():
    r = torch.tensor([-0.5, 0.2, 0.1], dtype=torch.float64)
    fresh = FKState.initial(3)
    assert fresh.pop.tolist() == [0.0, 0.0, 0.0] and fresh.log_prod.tolist() == [0.0, 0.0, 0.0]
    u, log_w = fk_log_weights(r, fresh, potential="max", lam=10.0, last=False)
    assert u.tolist() == [0.0, 0.2, 0.1] and log_w.tolist() == pytest.approx([0.0, 2.0, 1.0])  # floored at 0
    carried = state([0.1, 0.2, 0.3], [math.log(2.0), 0.0, -1.0])
    u, log_w = fk_log_weights(r, carried, potential="max", lam=2.0, last=False)
    assert u.tolist() == [0.1, 0.2, 0.3] and log_w.tolist() == pytest.approx([0.2, 0.4, 0.6])
    u, log_w = fk_log_weights(r, carried, potential="add", lam=2.0, last=False)
    assert u.tolist() == pytest.approx([-0.4, 0.4, 0.4]) and log_w.tolist() == pytest.approx([-0.8, 0.8, 0.8])
    u, log_w = fk_log_weights(r, carried, potential="diff", lam=2.0, last=False)
    assert u.tolist() == [-0.5, 0.2, 0.1] and log_w.tolist() == pytest.approx([-1.2, 0.0, -0.4])
    u, log_w = fk_log_weights(r, carried, potential="rt", lam=2.0, last=False)
    assert u.tolist() == [-0.5, 0.2, 0.1] and log_w.tolist() == pytest.approx([-1.0, 0.4, 0.2])
    # the last index divides by the product of potentials (minus log Pi) for max, add, rt; never for diff
    log_pi = torch.tensor([math.log(2.0), 0.0, -1.0])
    for kind in ("max", "add", "rt"):
        _, plain = fk_log_weights(r, carried, potential=kind, lam=2.0, last=False)
        _, final = fk_log_weights(r, carried, potential=kind, lam=2.0, last=True)
        assert torch.allclose(final, plain - log_pi.double())
    assert torch.equal(fk_log_weights(r, carried, potential="diff", lam=2.0, last=True)[1],
                       fk_log_weights(r, carried, potential="diff", lam=2.0, last=False)[1])
    with pytest.raises(ValueError, match="unknown FK potential 'min'"):
        fk_log_weights(r, fresh, potential="min", lam=1.0, last=False)
    with pytest.raises(ValueError, match="2 rewards for a state of 3"):
        fk_log_weights(r[:2], fresh, potential="rt", lam=1.0, last=False)


def test_nan_rewards_weigh_zero_and_propagate_through_pop():
    r = torch.tensor([math.nan, 0.0, 0.0, 0.0], dtype=torch.float64)
    ancestors, new, d = fk_resample_step(r, FKState.initial(4), potential="rt", lam=1.0, last=False, adaptive=True)
    assert d.log_weights[0] == -math.inf and d.weights.tolist() == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3])
    assert d.ess == pytest.approx(3.0) and not d.resampled and ancestors.tolist() == [0, 1, 2, 3]
    assert math.isnan(new.pop[0]) and new.pop[1:].tolist() == [0, 0, 0]  # pop <- u unpermuted: the NaN is carried
    _, log_w = fk_log_weights(torch.zeros(4), new, potential="max", lam=1.0, last=False)
    assert log_w[0] == -math.inf  # max(r, NaN) is NaN, as torch.max in the reference
    # every weight zero: the particles are kept (the reference's multinomial would fail) and it is reported
    nan = torch.full((4,), math.nan, dtype=torch.float64)
    ancestors, new, d = fk_resample_step(nan, state([0.5] * 4, [1.0] * 4), potential="add", lam=1.0, last=False,
                                         adaptive=False, draw=fixed([0, 0, 0, 0]))
    assert d.degenerate and not d.resampled and d.ess == 0.0 and d.weights.tolist() == [0.0] * 4
    assert ancestors.tolist() == [0, 1, 2, 3] and new.log_prod.tolist() == [1.0] * 4 and new.pop.isnan().all()


def test_resampling_decisions_and_state_updates():
    equal = torch.zeros(4, dtype=torch.float64)
    start = state([0.1, 0.2, 0.3, 0.4], [0.0, 1.0, 2.0, 3.0])
    soft = torch.softmax(torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64), 0)  # add: u = r + pop = pop
    ess = float(1 / (soft**2).sum())
    # adaptive, ESS >= N/2: kept; pop <- u, log Pi unchanged, the weights discarded
    ancestors, new, d = fk_resample_step(equal, start, potential="add", lam=1.0, last=False, adaptive=True,
                                         draw=fixed([0, 0, 0, 0]))
    assert not d.resampled and d.ess == pytest.approx(ess) and ess > 3.9 and d.threshold == 2.0
    assert ancestors.tolist() == [0, 1, 2, 3] and torch.allclose(d.weights, soft)
    assert new.pop.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4]) and torch.equal(new.log_prod, start.log_prod)
    # fixed mode: a non-last active index always resamples, whatever the ESS
    draw = fixed([3, 3, 1, 0])
    ancestors, new, d = fk_resample_step(equal, start, potential="add", lam=1.0, last=False, adaptive=False, draw=draw)
    assert d.resampled and d.ess == pytest.approx(ess) and ancestors.tolist() == [3, 3, 1, 0]
    assert torch.equal(draw.weights, d.weights) and torch.allclose(d.weights, soft)  # the normalised weights
    # pop <- u[idx] = (r + pop)[idx]; log Pi <- log Pi[idx] + l[idx] with l = lam u
    assert new.pop.tolist() == pytest.approx([0.4, 0.4, 0.2, 0.1])
    assert new.log_prod.tolist() == pytest.approx([3.4, 3.4, 1.2, 0.1])
    # the last index tests the ESS in fixed mode too: after the - log Pi correction the weights are
    # softmax(u - log Pi) = softmax([0.1, -1.8, -3.7, -5.6]) here, ESS < 2: resampled; with log Pi = [0, 1, 2, 3]
    # (softmax([0.1, -0.8, -1.7, -2.6]), ESS 2.24) kept
    _, _, d = fk_resample_step(equal, start, potential="add", lam=1.0, last=True, adaptive=False)
    assert d.ess == pytest.approx(2.2441532) and not d.resampled
    steep = state([0.1, 0.2, 0.3, 0.4], [0.0, 2.0, 4.0, 6.0])
    ancestors, _, d = fk_resample_step(equal, steep, potential="add", lam=1.0, last=True, adaptive=False,
                                       draw=fixed([0, 0, 0, 1]))
    expected = torch.softmax(torch.tensor([0.1, -1.8, -3.7, -5.6], dtype=torch.float64), 0)
    assert torch.allclose(d.weights, expected) and d.ess == pytest.approx(float(1 / (expected**2).sum()))
    assert d.ess < 2 and d.resampled and ancestors.tolist() == [0, 0, 0, 1]
    _, _, d = fk_resample_step(equal, FKState.initial(4), potential="rt", lam=1.0, last=True, adaptive=False)
    assert not d.resampled  # ESS = N at the last index: kept even in fixed mode
    # ESS exactly at the threshold does not resample (strictly below): w = [1/2, 1/2, 0, 0] gives ESS 2 = N/2
    half = torch.tensor([0.0, 0.0, -math.inf, -math.inf])
    _, _, d = fk_resample_step(half, FKState.initial(4), potential="rt", lam=1.0, last=False, adaptive=True)
    assert d.ess == pytest.approx(2.0) and not d.resampled
    with pytest.raises(ValueError, match="must return 4 indices in 0..3"):
        fk_resample_step(equal, start, potential="rt", lam=1.0, last=False, adaptive=False, draw=fixed([0, 4, 0, 0]))


def test_the_default_draw_is_multinomial_from_the_prompts_generator():
    r = torch.tensor([0.0, 0.3, 0.1, 0.2, 0.9, 0.5], dtype=torch.float64)
    runs = [fk_resample_step(r, FKState.initial(6), potential="rt", lam=5.0, last=False, adaptive=False,
                             generator=torch.Generator().manual_seed(7))[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    weights = torch.softmax(5.0 * r, 0)
    expected = multinomial_draw(torch.Generator().manual_seed(7))(weights)
    assert torch.equal(runs[0], expected)


def test_the_schedule_is_every_freq_steps_in_the_window_and_always_the_last():
    assert fk_schedule(10, 2, 2, 6) == [2, 4, 6, 9]
    assert fk_schedule(100, 20, 20, 80) == [20, 40, 60, 80, 99]  # launch.sh
    assert fk_schedule(100, 5, 5, 30) == [5, 10, 15, 20, 25, 30, 99]  # the reference's argparse defaults
    assert fk_schedule(10) == list(range(10)) and fk_schedule(10, 3) == list(range(3, 10))
    assert fk_schedule(10, 5, 5, 30) == [5, 9]  # a window past the end is cut at the last index
    assert fk_schedule(10, 6, 1, 4) == [9]  # an empty window: the last index only
    assert fk_schedule(1) == [0]
    for bad in [dict(num_steps=0), dict(num_steps=10, start=-1), dict(num_steps=10, every=0)]:
        with pytest.raises(ValueError):
            fk_schedule(**bad)


def test_group_topk_sorts_descending_with_first_index_ties_and_nan_last():
    values = torch.tensor([0.2, math.nan, 0.9, 0.2, -math.inf, 0.5, math.nan, 0.1])
    assert group_topk(values, 2, 4, 4).tolist() == [[2, 0, 3, 1], [5, 7, 4, 6]]
    assert group_topk(values, 2, 4, 2).tolist() == [[2, 0], [5, 7]]
    assert group_topk(values, 2, 4, 1).flatten().tolist() == group_argmax(values, 2, 4).tolist()
    assert group_topk(torch.full((3,), math.nan), 1, 3, 2).tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        group_topk(values, 2, 4, 5)


# ------------------------------------------------------------------------------------------------ the reference


# Measured on an AMD EPYC (AVX512) under ATEN_CPU_CAPABILITY=default, avx2 and avx512: the largest deviation from the
# recorded cases was 3.5% of the tolerance (1.3e-6 relative), the same under every capability.
def close(actual, expected, *, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(actual.double(), tensor(expected), rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.float_sensitive  # recorded floats: .ci/run runs these under a second CPU capability
@pytest.mark.parametrize("case", [c for c in CASES["cases"] if not c["name"].startswith("overflow")],
                         ids=lambda c: c["name"])
def test_matches_the_reference_given_its_ancestors(case):
    T, n, lam = case["T"], case["particles"], case["lam"]
    schedule = fk_schedule(T, case["t_start"], case["freq"], case["t_end"])
    assert schedule == [s["index"] for s in case["steps"]] == [2, 4, 6, 9]  # it acted exactly there
    current = FKState.initial(n)
    for recorded in case["steps"]:
        i = recorded["index"]
        close(current.pop, recorded["pop_before"])
        close(current.log_prod, [math.log(p) for p in recorded["prod_before"]])
        draw = fixed(recorded["ancestors"] or [])
        assert recorded["rewards"] == case["rewards"][i]
        ancestors, current, d = fk_resample_step(tensor(recorded["rewards"]), current, potential=case["potential"],
                                                 lam=lam, last=i == T - 1, adaptive=case["adaptive"], draw=draw)
        close(d.u, recorded["u"])
        close(d.weights, recorded["weights"])
        assert d.ess == pytest.approx(recorded["ess"], rel=1e-5) and d.threshold == n / 2
        assert d.resampled is recorded["resampled"] and not d.degenerate
        assert (draw.weights is not None) is recorded["resampled"]  # drawn exactly when the reference drew
        if recorded["resampled"]:
            assert ancestors.tolist() == recorded["ancestors"]
            close(draw.weights, recorded["weights"])
        close(current.pop, recorded["pop_after"])
        close(current.log_prod, [math.log(p) for p in recorded["prod_after"]], atol=1e-5)


def test_the_reference_cases_cover_both_decisions_and_nan():
    steps = [(c, s) for c in CASES["cases"] for s in c["steps"]]
    fixed_mode = [s for c, s in steps if not c["adaptive"] and s["index"] != 9]
    assert fixed_mode and all(s["resampled"] for s in fixed_mode)
    adaptive = [s["resampled"] for c, s in steps if c["adaptive"] and not c["name"].startswith("overflow")]
    last = [s["resampled"] for c, s in steps if s["index"] == 9]
    assert True in adaptive and False in adaptive and True in last and False in last
    assert sum(c["name"].startswith("nan_") for c in CASES["cases"]) == 8
    assert len({(c["potential"], c["adaptive"], c["lam"]) for c in CASES["cases"] if "scale" in c["name"]}) == 16


@pytest.mark.float_sensitive  # recorded floats: .ci/run runs these under a second CPU capability
@pytest.mark.parametrize("case", [c for c in CASES["cases"] if c["name"].startswith("overflow")],
                         ids=lambda c: c["name"])
def test_flowalign_differs_where_the_reference_saturates(case):
    """Rewards [21.5, 22.0, 22.4, 23.1] at lambda 10: the reference clamps every exp(lambda u) to 1e10, sees ESS = N and
    keeps the particles; in log space the last particle weighs ~0.999 and the particles are resampled."""
    (recorded,) = case["steps"]
    assert recorded["rewards"] == [21.5, 22.0, 22.4, 23.1] and recorded["w"] == [1e10] * 4
    assert recorded["ess"] == 4.0 and not recorded["resampled"]
    _, new, d = fk_resample_step(tensor(recorded["rewards"]), FKState.initial(4), potential=case["potential"],
                                 lam=case["lam"], last=False, adaptive=True, draw=fixed([3, 3, 3, 3]))
    close(d.u, recorded["u"])  # the potentials agree; only the weights saturate in the reference
    assert d.weights[3] == pytest.approx(0.99908, abs=1e-5) and d.ess < 1.01 and d.resampled
    assert new.pop.tolist() == pytest.approx([23.1] * 4, abs=1e-5) and new.log_prod.tolist() == pytest.approx([231] * 4)


# ------------------------------------------------------------------------------------------------ the sampler


@pytest.mark.parametrize("semantics", ["reference", "flowalign"])
@pytest.mark.parametrize("candidates", [1, 3])
def test_k_candidates_cost_exactly_n_t_nfes_and_come_sorted(semantics, candidates):
    steps, budget, prompts = 5, 24, 2  # N = 4
    velocity = CountingVelocity(prompts)
    sampler = fk_steering_reference if semantics == "reference" else fk_steering
    result = sampler(velocity, mean_reward, sigmas(steps), SHAPE, generators(prompts), budget, lam=20.0,
                     candidates=candidates)
    assert velocity.per_prompt == [20, 20] and result.nfe.tolist() == [20, 20]
    assert result.info["semantics"] == semantics and result.info["particles"] == 4
    if candidates == 1:
        assert result.final.shape == (prompts, *SHAPE) and result.reward.shape == (prompts,)
        return
    assert result.final.shape == (prompts, 3, *SHAPE) and result.reward.shape == (prompts, 3)
    assert result.images_per_prompt == 3
    assert (result.reward[:, :-1] >= result.reward[:, 1:]).all()
    torch.testing.assert_close(mean_reward(result.final.flatten(0, 1), None).double(), result.reward.flatten())


@pytest.mark.parametrize("sampler", [fk_steering_reference, fk_steering])
def test_more_candidates_than_particles_are_refused_before_any_work(sampler):
    velocity = CountingVelocity(2)
    with pytest.raises(ValueError, match=r"--candidates 5: FK steering has 4 particles of 5 NFEs per prompt within "
                                         r"its budget; raise --budget to at least 25"):
        sampler(velocity, mean_reward, sigmas(5), SHAPE, generators(2), 24, candidates=5)
    assert velocity.per_prompt == [0, 0]


def test_reference_semantics_resample_the_post_step_particles_on_its_schedule():
    steps, prompts = 6, 2
    result = fk_steering_reference(CountingVelocity(prompts), mean_reward, sigmas(steps), SHAPE,
                                   generators(prompts), 6 * 6, lam=50.0, resample_start=1, resample_every=2,
                                   resample_end=3, candidates=6)
    events = result.info["events"]
    assert result.info["schedule"] == [1, 3, 5]
    assert [(i, g) for i, g, *_ in events] == [(i, g) for i in (1, 3, 5) for g in range(prompts)]
    assert all(resampled for i, _, _, resampled, _ in events if i != 5)  # fixed mode: always before the last
    assert all(resampled == (ess < 3) for i, _, ess, resampled, _ in events if i == 5)
    # the last index resampled the final, post-step particles: duplicates are exact copies of one x_T
    for g, (i, _, _, resampled, _) in enumerate(e for e in events if e[0] == 5):
        if resampled:
            assert len(torch.unique(result.final[g], dim=0)) < 6
    assert any(e[3] for e in events if e[0] == 5)
    # flowalign's semantics resample the pre-step state and step it with fresh noise: no exact duplicates at the end
    earlier = fk_steering(CountingVelocity(prompts), mean_reward, sigmas(steps), SHAPE, generators(prompts), 36,
                          lam=50.0, candidates=6)
    assert earlier.info["resamples"] > 0
    assert all(len(torch.unique(earlier.final[g], dim=0)) == 6 for g in range(prompts))


def test_adaptive_reference_semantics_without_resampling_is_plain_sde_sampling():
    """lam = 0: every weight equal, ESS = N, so the adaptive sampler never draws; its particles are best-of-N's SDE
    particles, noise for noise."""
    steps, budget, prompts = 5, 20, 3
    fk = fk_steering_reference(CountingVelocity(prompts), mean_reward, sigmas(steps), SHAPE, generators(prompts),
                               budget, lam=0.0, adaptive=True)
    plain = best_of_n(CountingVelocity(prompts), mean_reward, sigmas(steps), SHAPE, generators(prompts), budget,
                      noise_level=0.7)
    assert fk.info["resamples"] == 0 and len(fk.info["events"]) == steps * prompts
    assert torch.equal(fk.final, plain.final) and torch.equal(fk.reward, plain.reward)


def test_all_nan_rewards_keep_the_particles_and_are_reported(caplog):
    def nan_reward(x0, rows):
        return torch.full((x0.shape[0],), math.nan)

    with caplog.at_level("WARNING"):
        result = fk_steering_reference(CountingVelocity(2), nan_reward, sigmas(3), SHAPE, generators(2), 9)
    assert result.info["degenerate"] == 2 * 3 and result.info["resamples"] == 0
    assert "every weight of prompt 0 is zero at step 0" in caplog.text
    assert result.final.shape == (2, *SHAPE) and result.reward.isnan().all()


# ------------------------------------------------------------------------------------------------ flowalign sample


@pytest.fixture(scope="module")
def toy():
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.models.loading import load_flow_model

    model = load_flow_model(REPO / "assets" / "toy-sd3")
    model.transformer.requires_grad_(False)
    return model, load_metadata(REPO / "assets" / "prompts" / "test.jsonl")[:2]


@pytest.mark.parametrize("semantics", ["reference", "flowalign"])
def test_the_fk_sampler_runs_both_resampling_schemes_on_the_tiny_sd3(toy, semantics):
    from dataclasses import replace

    from flowalign.inference.sample import SampleConfig, run_guided
    from flowalign.toy.reward import ToyGenEvalReward

    model, metadata = toy
    config = SampleConfig(guidance="fk", budget=9, steps=3)  # N = 3 particles
    assert config.sampler.resampling == "reference" and config.sampler.adaptive is False  # the defaults
    config.sampler = replace(config.sampler, resampling=semantics)
    config.validate()
    reward = ToyGenEvalReward(partial_credit=True)
    result = run_guided(model, metadata, config, reward_fn=reward)
    assert result.info["semantics"] == semantics and result.nfe.tolist() == [9, 9]
    assert result.final.shape == (2, *model.latent_shape(1)[1:]) and torch.isfinite(result.reward).all()
    if semantics == "reference":
        assert result.info["schedule"] == [0, 1, 2] and len(result.info["events"]) == 2 * 3
    config.candidates = 2  # flowalign sample --candidates 2
    pair = run_guided(model, metadata, config, reward_fn=reward)
    assert pair.final.shape == (2, 2, *model.latent_shape(1)[1:]) and pair.nfe.tolist() == [9, 9]
    assert (pair.reward[:, 0] >= pair.reward[:, 1]).all()
    assert torch.equal(pair.final[:, 0], result.final) and torch.equal(pair.reward[:, 0], result.reward)
    config.candidates = 4
    with pytest.raises(Exception, match="--candidates 4"):
        config.validate()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--fk-resampling", "flowalign", "--fk-resample-every", "2"], "applies to --fk-resampling reference only"),
        (["--fk-resampling", "flowalign", "--fk-resample-end", "5"], "applies to --fk-resampling reference only"),
        (["--fk-resample-start", "4", "--fk-resample-end", "2"], "must be >= resample_start (4), got 2"),
        (["--steps", "10", "--fk-resample-end", "10"], "fk_resample_end must be a step in 0..9"),
        (["--fk-resample-every", "0"], "resample_every must be >= 1"),
        (["--fk-resampling", "paper"], "fk"),
        (["--fk-semantics", "paper"], "fk"),
        (["--fk-semantics", "flowalign", "--fk-resampling", "flowalign", "--fk-resample-every", "2"],
         "applies to --fk-resampling reference only"),
    ],
)
def test_bad_fk_settings_fail_before_loading(tmp_path, capsys, argv, message):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--guidance", "fk", "--model", str(tmp_path / "absent"), "--out", str(tmp_path / "o"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_old_fk_option_semantics_still_sets_the_resampling_scheme_with_a_warning():
    """``semantics`` is the old name of ``resampling`` (one release): it warns and sets the new field; both at once
    must agree."""
    from flowalign.config import ConfigError
    from flowalign.inference import FKSettings

    with pytest.warns(DeprecationWarning, match="renamed resampling"):
        settings = FKSettings(name="fk", semantics="flowalign")
    assert settings.resampling == "flowalign" and settings.semantics is None
    with pytest.raises(ConfigError, match="give only resampling"):
        FKSettings(name="fk", resampling="flowalign", semantics="reference")


def test_the_old_fk_flag_builds_the_settings_of_the_new_one_and_warns():
    """``flowalign sample --fk-semantics flowalign`` (and ``sampler.semantics=flowalign``) build the settings
    ``--fk-resampling flowalign`` builds, with a DeprecationWarning naming the new option."""
    import argparse
    import warnings

    from flowalign.cli.options import ConfigCommand, add_command_flags, add_config_command, load_from_args

    command = ConfigCommand("flowalign.inference.sample:SampleConfig", lambda config, args: None)
    parser = argparse.ArgumentParser()
    add_config_command(parser.add_subparsers(), "sample", command, help="", description="")
    add_command_flags(parser)  # the generated options (--guidance, --fk-resampling, ...)

    def settings(*argv):
        return load_from_args(command, parser.parse_args(["sample", "--guidance", "fk", *argv])).sampler

    for old in (["--fk-semantics", "flowalign"], ["sampler.semantics=flowalign"]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = settings(*old)
        assert any(issubclass(w.category, DeprecationWarning) and "--fk-resampling" in str(w.message)
                   for w in caught), old
        assert built == settings("--fk-resampling", "flowalign") and built.resampling == "flowalign"
