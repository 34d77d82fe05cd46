"""Reward-guided sampling: best-of-N, FK steering, DTS / DTS*, RGS.

Unit behaviour runs on the analytic Gaussian flow (tests/gaussian_flow.py); every guidance mode also runs end to end
on the toy model (assets/toy-sd3) with its NFEs counted at the transformer itself.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.samplers.dts import SearchTree, diffusion_tree_search, soft_value
from flowalign.samplers.fk import effective_sample_size, fk_steering, potential, resample
from flowalign.samplers.guided import best_of_n
from flowalign.samplers.rgs import (
    band_scale,
    check_differentiable,
    reward_guided_sampling,
    rgs_correction,
    x0_guide,
)
from gaussian_flow import CountingVelocity, gaussian_velocity, generators, mean_reward, sigmas
from reward_fixtures import image_reward_installed, tiny_zoo_kwargs

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "assets" / "toy-sd3"
# The reward zoo's differentiable scorers (imagereward needs its optional package, see README).
ZOO = ["pickscore", "hps", "clipscore", "aesthetic", "imagereward"]


SHAPE = (6,)


# ------------------------------------------------------------------------------------------------ budgets


@pytest.mark.parametrize("method", ["bon", "fk", "dts", "rgs"])
def test_nfes_are_counted_exactly_and_stay_within_the_budget(method):
    steps, budget, prompts = 6, 27, 3
    velocity = CountingVelocity(prompts)
    s = sigmas(steps)
    if method == "bon":
        result = best_of_n(velocity, mean_reward, s, SHAPE, generators(prompts), budget)
    elif method == "fk":
        result = fk_steering(velocity, mean_reward, s, SHAPE, generators(prompts), budget)
    elif method == "dts":
        result = diffusion_tree_search(velocity, mean_reward, s, SHAPE, generators(prompts), budget)
    else:
        result = reward_guided_sampling(x0_guide(velocity, mean_reward), s, SHAPE, generators(prompts), budget,
                                        final_reward=mean_reward)
    forwards = torch.tensor(velocity.per_prompt)
    if method == "rgs":
        backwards = result.info["particles"] * result.info["guided_steps"]  # one head, backward_nfe = 1
        assert torch.equal(result.nfe, forwards + backwards)
    else:
        assert torch.equal(result.nfe, forwards)
    assert (result.nfe <= budget).all()
    if method in ("bon", "fk"):
        assert (result.nfe == (budget // steps) * steps).all()  # 4 particles x 6 steps
    if method == "dts":
        assert (result.nfe > budget - steps).all()  # stops only when the next rollout would not fit
    assert result.final.shape == (prompts, *SHAPE)


@pytest.mark.parametrize("method", ["bon", "fk", "dts", "rgs"])
def test_a_budget_below_one_trajectory_fails_before_any_work(method):
    velocity = CountingVelocity(2)
    s = sigmas(6)
    with pytest.raises(ValueError, match="smaller than one .*trajectory"):
        if method == "bon":
            best_of_n(velocity, mean_reward, s, SHAPE, generators(2), 5)
        elif method == "fk":
            fk_steering(velocity, mean_reward, s, SHAPE, generators(2), 5)
        elif method == "dts":
            diffusion_tree_search(velocity, mean_reward, s, SHAPE, generators(2), 5)
        else:  # one guided trajectory: 6 forwards + 5 backwards (sigma > 0.2 on 5 of the 6 steps)
            reward_guided_sampling(x0_guide(velocity, mean_reward), s, SHAPE, generators(2), 10)
    assert velocity.per_prompt == [0, 0]


def test_bon_keeps_the_best_of_its_particles():
    result = best_of_n(CountingVelocity(2), mean_reward, sigmas(5), SHAPE, generators(2), 20)
    assert torch.equal(result.reward, result.info["all_rewards"].max(dim=1).values)
    assert torch.allclose(mean_reward(result.final, None).double(), result.reward)


# ------------------------------------------------------------------------------------------------ FK


def test_fk_resampling_fires_exactly_when_ess_is_below_half_the_particles():
    n = 4

    def weights_with_ess(ess):  # w = [a, b, b, b]: ESS = 1 / (a^2 + 3 b^2)
        lo, hi = 0.25, 1.0
        for _ in range(200):  # bisection on a for the wanted ESS
            a = (lo + hi) / 2
            b = (1 - a) / 3
            lo, hi = (a, hi) if 1 / (a * a + 3 * b * b) > ess else (lo, a)
        b = (1 - a) / 3
        return torch.log(torch.tensor([a, b, b, b], dtype=torch.float64))

    log_w = torch.stack([weights_with_ess(2.02), weights_with_ess(1.98), torch.zeros(n), weights_with_ess(1.2)])
    ess = effective_sample_size(log_w)
    assert ess[0] > 2 > ess[1] and ess[2] == pytest.approx(4.0)
    ancestors, fired, _ = resample(log_w, generators(4))
    assert fired.tolist() == [False, True, False, True]
    kept = ancestors.reshape(4, n)
    assert torch.equal(kept[0], torch.arange(0, 4)) and torch.equal(kept[2], torch.arange(8, 12))
    assert ((kept[1] >= 4) & (kept[1] < 8)).all() and ((kept[3] >= 12) & (kept[3] < 16)).all()


def test_fk_steering_resamples_at_every_check_where_ess_is_low():
    result = fk_steering(CountingVelocity(3), mean_reward, sigmas(6), SHAPE, generators(3), 48, lam=30.0)
    events = result.info["events"]
    assert len(events) == 3 * 5  # every step but the last, for each prompt
    assert all(fired == (ess < 8 / 2) for _, _, ess, fired in events)
    assert any(fired for *_, fired in events) and result.info["resamples"] == sum(e[3] for e in events)
    late = fk_steering(CountingVelocity(3), mean_reward, sigmas(6), SHAPE, generators(3), 48, lam=30.0,
                       resample_steps=range(3, 5))
    assert sorted({step for step, *_ in late.info["events"]}) == [3, 4]  # a later start: checks at steps 3 and 4 only


def test_fk_potentials():
    history = torch.tensor([[0.1, 0.5, 0.2], [0.3, 0.3, 0.9]], dtype=torch.float64)
    assert potential(history, "max").tolist() == [0.5, 0.9]
    assert potential(history, "add").tolist() == pytest.approx([0.8, 1.5])
    assert potential(history, "diff").tolist() == pytest.approx([-0.3, 0.6])
    assert potential(history, "rt").tolist() == [0.2, 0.9]
    with pytest.raises(ValueError, match="unknown FK potential 'min'"):
        potential(history, "min")


# ------------------------------------------------------------------------------------------------ DTS


def scripted_tree(lam):
    """root -> a, b; a -> a1, a2 (leaves); b -> b1 (leaf). Depth 2, at most 2 children."""
    tree = SearchTree(max_depth=2, max_children=2, lam=lam)
    root = tree.add(None)
    a, b = tree.add(root), tree.add(root)
    a1, a2, b1 = tree.add(a), tree.add(a), tree.add(b)
    for leaf, r in ((a1, 1.0), (a2, 0.0), (b1, 0.6)):
        tree.backup(leaf, r)
    return tree, (root, a, b, a1, a2, b1)


def test_dts_soft_value_backup_on_a_scripted_tree():
    lam = 2.0
    tree, (root, a, b, *_) = scripted_tree(lam)
    v_a = math.log((math.exp(2 * 1.0) + math.exp(0.0)) / 2) / 2
    assert tree.value[a] == pytest.approx(v_a)
    assert tree.value[b] == pytest.approx(0.6)
    assert tree.value[root] == pytest.approx(math.log((math.exp(2 * v_a) + math.exp(2 * 0.6)) / 2) / 2)
    assert soft_value([1.0, 0.0], math.inf) == 1.0 and soft_value([1.0, 0.0], 0.0) == 0.5
    # a is full and both its children are leaves: closed; b can still take a child
    assert tree.closed[a] and not tree.closed[b] and not tree.closed[root]


def test_dts_selection_on_a_scripted_tree():
    tree, (root, a, b, a1, a2, b1) = scripted_tree(2.0)
    # The root is full; a is closed, so both DTS and DTS* must go to b, which has room for a second child.
    assert tree.select(greedy=True) == b
    assert tree.select(greedy=False, generator=torch.Generator().manual_seed(0)) == b
    # Over all children (the final sample of DTS), Boltzmann selection follows exp(lambda V).
    g = torch.Generator().manual_seed(0)
    picks = [tree.choose_child(root, greedy=False, generator=g, open_only=False) for _ in range(4000)]
    p_a = math.exp(2 * tree.value[a]) / (math.exp(2 * tree.value[a]) + math.exp(2 * tree.value[b]))
    assert picks.count(a) / 4000 == pytest.approx(p_a, abs=0.03)
    assert tree.choose_child(root, greedy=True, open_only=False) == a  # V_a = 0.72 > V_b = 0.6
    assert tree.best_leaf() == a1
    # Fill b: the whole tree closes and selection stops.
    tree.backup(tree.add(b), 0.1)
    assert tree.closed[root] and tree.select(greedy=True) is None


def test_dts_star_returns_the_best_leaf_it_found():
    result = diffusion_tree_search(CountingVelocity(2), mean_reward, sigmas(5), SHAPE, generators(2), 30)
    for tree, chosen in zip(result.info["trees"], result.reward.tolist()):
        assert chosen == max(tree.value[n] for n in tree.leaves())
        assert len(tree.leaves()) > 1


# ------------------------------------------------------------------------------------------------ RGS


def test_rgs_correction_is_magnitude_matched_and_clipped():
    torch.manual_seed(0)
    x, x_base = torch.randn(3, 8), torch.randn(3, 8)
    grads = [torch.randn(3, 8) * 100, torch.randn(3, 8) * 1e-3]
    out = rgs_correction(x, x_base, grads, [1.0, 1.0], 0.3)
    delta, step = out - x_base, x_base - x
    rms = lambda t: t.pow(2).mean(dim=1).sqrt()  # noqa: E731
    assert (rms(delta) <= 0.3 * rms(step) * (1 + 1e-5)).all()
    assert (delta.abs() <= 2 * 0.3 * rms(step)[:, None] + 1e-6).all()
    # both heads count equally after unitRMS, whatever their gradient scale
    g = grads[0] / rms(grads[0])[:, None] + grads[1] / rms(grads[1])[:, None]
    unclipped = g / rms(g)[:, None] * 0.3 * rms(step)[:, None]
    inside = unclipped.abs() < 2 * 0.3 * rms(step)[:, None]
    assert torch.allclose(delta[inside], unclipped[inside], atol=1e-6)
    assert band_scale(0.9) == 0.3 and band_scale(0.5) == 0.05 and band_scale(0.2) == 0.0


def test_rg_opd_target_is_the_velocity_whose_euler_step_lands_on_the_rgs_step():
    from flowalign.samplers import ode_step
    from flowalign.samplers.rgs import rgs_velocity_target

    torch.manual_seed(0)
    x, v, grad = torch.randn(2, 6), torch.randn(2, 6), torch.randn(2, 6)
    target = rgs_velocity_target(x, v, [grad], [1.0], 0.9, 0.7)
    expected = rgs_correction(x, ode_step(x, v, 0.9, 0.7), [grad], [1.0], band_scale(0.9))
    assert torch.allclose(ode_step(x, target, 0.9, 0.7), expected, atol=1e-6)
    assert torch.equal(rgs_velocity_target(x, v, [grad], [1.0], 0.15, 0.05), v)  # no guidance below sigma 0.2


def test_rgs_raises_the_reward_over_plain_sampling_from_the_same_noise():
    s = sigmas(8)
    guided = reward_guided_sampling(x0_guide(CountingVelocity(4), mean_reward), s, SHAPE, generators(4), 15,
                                    final_reward=mean_reward)
    plain = best_of_n(CountingVelocity(4), mean_reward, s, SHAPE, generators(4), 8)
    assert guided.info["particles"] == 1
    assert (guided.reward > plain.reward).all()


def test_rgs_refuses_a_non_differentiable_reward_before_any_work():
    velocity = CountingVelocity(1)

    @torch.no_grad()
    def detached(x0, rows):
        return x0.flatten(1).mean(dim=1)

    with pytest.raises(ValueError, match="without a gradient.*bon, fk or dts"):
        check_differentiable(detached, SHAPE)
    declared = lambda x0, rows: x0.sum()  # noqa: E731
    declared.differentiable = False
    with pytest.raises(ValueError, match="not differentiable"):
        check_differentiable(declared, SHAPE)
    check_differentiable(mean_reward, SHAPE)
    assert velocity.per_prompt == [0]


# ------------------------------------------------------------------------------------------------ the toy model


@pytest.fixture(scope="module")
def toy():
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.models.loading import load_flow_model

    model = load_flow_model(TOY)
    model.transformer.requires_grad_(False)
    metadata = load_metadata(REPO / "assets" / "prompts" / "test.jsonl")[:2]
    return model, metadata


class TransformerCounter:
    """Counts transformer forward rows with a hook on the transformer itself."""

    def __init__(self, transformer):
        self.rows = 0
        self.handle = transformer.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        self.rows += kwargs["hidden_states"].shape[0]


def _counted_toy_run(model, metadata, guidance, budget, cfg=1.0):
    """``run_guided`` on the toy prompts at 3 steps (RGS on seeded registers), counting the transformer's rows."""
    from flowalign.inference.sample import SampleConfig, run_guided
    from flowalign.reward_models.latent_registers import LatentRegisters
    from flowalign.toy.reward import ToyGenEvalReward

    config = SampleConfig(guidance=guidance, budget=budget, steps=3, cfg=cfg,
                          registers="unused" if guidance == "rgs" else None)
    config.validate()
    registers = None
    if guidance == "rgs":
        torch.manual_seed(0)
        registers = LatentRegisters.for_transformer(model.transformer, num_registers=4, width=32)
    counter = TransformerCounter(model.transformer)
    try:
        result = run_guided(model, metadata, config, reward_fn=ToyGenEvalReward(partial_credit=True),
                            registers=registers)
    finally:
        counter.handle.remove()
    return result, counter


@pytest.mark.parametrize("guidance,budget", [("none", 3), ("bon", 7), ("fk", 7), ("dts", 8), ("rgs", 8)])
def test_every_guidance_mode_runs_on_the_toy_model_within_its_budget(toy, guidance, budget):
    model, metadata = toy
    result, counter = _counted_toy_run(model, metadata, guidance, budget)
    assert result.final.shape == (2, *model.latent_shape(1)[1:])
    assert torch.isfinite(result.reward).all() and ((result.reward >= 0) & (result.reward <= 1)).all()
    assert (result.nfe <= budget).all()
    if guidance == "rgs":  # 3 forwards, and backwards on the 2 steps with sigma > 0.2 (sigmas 1, 0.5, 0.001)
        assert int(model.sigmas(3)[:3].gt(0.2).sum()) == 2
        assert result.nfe.tolist() == [5, 5] and counter.rows == 2 * 3
    elif guidance == "dts":
        assert counter.rows == int(result.nfe.sum()) and (result.nfe > budget - 3).all()
    else:
        expected = {"none": 3, "bon": 6, "fk": 6}[guidance]
        assert result.nfe.tolist() == [expected, expected] and counter.rows == 2 * expected


def test_rgs_bands_choose_the_guided_steps_and_their_cost(toy):
    """Only the band above sigma 0.8 guided: of the 3 steps (sigmas 1, 0.5, 0.001) one is, so 3 + 1 NFEs."""
    from flowalign.inference.sample import SampleConfig, run_guided
    from flowalign.reward_models.latent_registers import LatentRegisters
    from flowalign.toy.reward import ToyGenEvalReward

    model, metadata = toy
    config = SampleConfig(guidance="rgs", budget=7, steps=3, registers="unused", rgs_bands=[(0.8, 0.3)])
    config.validate()
    torch.manual_seed(0)
    registers = LatentRegisters.for_transformer(model.transformer, num_registers=4, width=32)
    result = run_guided(model, metadata, config, reward_fn=ToyGenEvalReward(partial_credit=True), registers=registers)
    assert result.nfe.tolist() == [4, 4] and result.info["guided_steps"] == 1


@pytest.mark.parametrize("gradient,nfe", [("full", 5), ("x0", 3)])
def test_rgs_on_a_differentiable_image_reward_runs_within_its_budget(toy, gradient, nfe):
    """toy_geneval_soft on the decoded x0_hat: through the velocity, 3 forwards + 2 guided backwards (sigmas 1 and 0.5
    are above 0.2); on x0_hat alone, the 3 forwards only."""
    from flowalign.inference.sample import SampleConfig, build_guide_reward, run_guided
    from flowalign.toy.reward import ToyGenEvalReward

    model, metadata = toy
    config = SampleConfig(guidance="rgs", budget=nfe, steps=3, rgs_reward="toy_geneval_soft", rgs_gradient=gradient)
    config.validate()
    counter = TransformerCounter(model.transformer)
    try:
        result = run_guided(model, metadata, config, reward_fn=ToyGenEvalReward(partial_credit=True),
                            guide_reward=build_guide_reward("toy_geneval_soft"))
    finally:
        counter.handle.remove()
    assert result.nfe.tolist() == [nfe, nfe] and counter.rows == 2 * 3 and result.info["guided_steps"] == 2
    plain = run_guided(model, metadata, SampleConfig(guidance="none", steps=3),
                       reward_fn=ToyGenEvalReward(partial_credit=True))
    assert not torch.equal(result.final, plain.final)  # the same noise, moved by the gradient


def test_fk_with_rgs_guided_proposals_spends_the_same_nfes_and_moves_the_particles(toy):
    from flowalign.inference.sample import SampleConfig, build_guide_reward, run_guided
    from flowalign.toy.reward import ToyGenEvalReward

    model, metadata = toy
    results = {}
    for guided in (False, True):
        config = SampleConfig(guidance="fk", budget=6, steps=3, rgs_reward="toy_geneval_soft" if guided else None,
                              rgs_gradient="x0" if guided else "full", rgs_bands=[(0.2, 1.0)])
        config.validate()
        counter = TransformerCounter(model.transformer)
        try:
            results[guided] = run_guided(model, metadata, config, reward_fn=ToyGenEvalReward(partial_credit=True),
                                         guide_reward=build_guide_reward("toy_geneval_soft") if guided else None)
        finally:
            counter.handle.remove()
        assert results[guided].nfe.tolist() == [6, 6] and counter.rows == 2 * 6
        assert results[guided].info["guided_proposals"] is guided
    assert not torch.equal(results[True].final, results[False].final)


def test_x0_gradient_correction_moves_only_the_steps_inside_its_bands():
    from flowalign.samplers.rgs import x0_gradient_correction

    correct = x0_gradient_correction(mean_reward, [(0.5, 0.3)])
    x, v, x_base = torch.randn(2, *SHAPE), torch.randn(2, *SHAPE), torch.randn(2, *SHAPE)
    rows = torch.arange(2)
    assert torch.equal(correct(x, v, torch.tensor(0.4), x_base, rows), x_base)
    moved = correct(x, v, torch.tensor(0.9), x_base, rows)
    # mean_reward's gradient is uniform, so the correction is +0.3 RMS(step) on every element
    size = (x_base - x).pow(2).flatten(1).mean(1).sqrt()
    assert torch.allclose(moved - x_base, 0.3 * size[:, None].expand_as(x), atol=1e-5)


def test_an_image_reward_without_a_gradient_is_refused_for_rgs(toy):
    from flowalign.inference.sample import build_guide_reward, latent_reward
    from flowalign.toy.reward import ToyGenEvalReward

    with pytest.raises(ValueError, match="'toy_geneval' is not differentiable"):
        build_guide_reward("toy_geneval")
    model, metadata = toy
    with pytest.raises(ValueError, match="not differentiable"):
        latent_reward(model, ToyGenEvalReward(), ["p"], metadata, differentiable=True)


def test_flowalign_sample_writes_images_rewards_and_nfes(tmp_path, toy):
    from flowalign.cli import main

    out = tmp_path / "bon"
    assert main(["sample", "--guidance", "bon", "--budget", "6", "--steps", "3", "--max-prompts", "2",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["nfe"] for r in results["results"]] == [6, 6]
    assert all(0 <= r["reward"] <= 1 and "correct" in r for r in results["results"])
    assert (out / "images" / "0001.png").is_file() and (out / "grid.png").is_file()
    # a second run into the same folder is refused before the model loads: never two runs' images side by side
    fewer = ["sample", "--guidance", "bon", "--budget", "6", "--steps", "3", "--max-prompts", "1", "--out", str(out)]
    (out / "images" / "mine.txt").write_text("mine")
    with pytest.raises(SystemExit) as refused:
        main(fewer)
    assert refused.value.code == 2
    # --overwrite replaces the earlier run's outputs: no stale images/0001.png beside the new run's one image
    assert main([*fewer, "--overwrite"]) == 0
    assert sorted(p.name for p in (out / "images").iterdir()) == ["0000.png", "mine.txt"]
    assert len(json.loads((out / "results.json").read_text())["results"]) == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--guidance", "bon", "--budget", "5", "--steps", "10"], "smaller than one trajectory"),
        (["--guidance", "rgs", "--budget", "40"], "needs a differentiable reward"),
        (["--guidance", "rgs", "--rgs-reward", "toy_geneval"], "'toy_geneval' is not differentiable"),
        # GenEval would load Mask2Former and CLIP, JPEG has no gradient: both refused before anything is built
        (["--guidance", "rgs", "--rgs-reward", "geneval"], "--rgs-reward 'geneval' is not differentiable"),
        (["--guidance", "rgs", "--rgs-reward", "jpeg_compressibility"], "'jpeg_compressibility' is not differentiable"),
        (["--guidance", "bon", "--cfg", "0.5"], "cfg must be a finite number >= 1"),
        (["--guidance", "rgs", "--registers", "r.pt", "--rgs-reward-kwargs", '{"device": "cpu"}'],
         "pass --rgs-reward NAME too"),
        # a setting the chosen sampler does not have names the samplers that have it
        (["--guidance", "bon", "--rgs-reward-kwargs", '{"device": "cpu"}'], "not 'bon': it has no setting 'reward_kwargs'"),
        (["--guidance", "rgs", "--rgs-reward", "hps", "--rgs-reward-kwargs", "[1]"], "expected a JSON object"),
        (["--guidance", "rgs", "--rgs-reward", "toy_geneval_soft", "--registers", "r.pt"], "not both"),
        (["--guidance", "rgs", "--registers", "r.pt", "--rgs-gradient", "x0"], "applies to --rgs-reward only"),
        (["--guidance", "bon", "--rgs-reward", "toy_geneval_soft"], "not 'bon'"),
        (["--guidance", "fk", "--rgs-reward", "toy_geneval_soft"], "pass --rgs-gradient x0"),
        (["--guidance", "rgs", "--registers", "r.pt", "--rgs-bands", "0.2:0.1", "0.8:0.3"], "strictly decreasing"),
        (["--guidance", "bon", "--rgs-bands", "high"], "expected SIGMA:SCALE"),
        (["--guidance", "fk", "--steps", "10", "--fk-resample-start", "9"], "fk_resample_start must be a step in 0..8"),
    ],
)
def test_flowalign_sample_bad_input_fails_before_loading(tmp_path, capsys, argv, message):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--model", str(tmp_path / "absent"), "--out", str(tmp_path / "o"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_flowalign_sample_refuses_registers_of_another_transformer(tmp_path, capsys, sd3_pipe):
    from flowalign.cli import main
    from flowalign.reward_models.latent_registers import LatentRegisters

    checkpoint = LatentRegisters.for_transformer(sd3_pipe.transformer, num_registers=4, width=32).save(tmp_path / "r.pt")
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--guidance", "rgs", "--registers", str(checkpoint), "--model", str(TOY),
              "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "different transformer config" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_rgs_bands_are_checked_by_the_sampler():
    from flowalign.samplers.rgs import check_bands

    assert check_bands([[0.8, 0.3], (0.2, 0.05)]) == [(0.8, 0.3), (0.2, 0.05)]
    for bad in ([(0.2, 0.1), (0.8, 0.3)], [(1.0, 0.3)], [(0.8, -0.1)], [(0.8,)]):
        with pytest.raises(ValueError, match="strictly decreasing"):
            check_bands(bad)


# ------------------------------------------------------------------------------- the reward zoo as RGS's gradient


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """The tiny zoo scorers' constructor kwargs; BLIP's ViT stays small for the module (imagereward builds with it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield tiny_zoo_kwargs(tmp_path_factory.mktemp("zoo"), monkeypatch)


def _zoo_kwargs(zoo, name):
    if name == "imagereward" and not image_reward_installed():
        pytest.skip("optional extra missing: pip install --no-deps image-reward==1.5")
    return zoo[name]


def _png(path):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path))


@pytest.mark.parametrize("name", ZOO)
def test_flowalign_sample_rgs_runs_on_every_differentiable_zoo_scorer(tmp_path, zoo, name):
    """2 steps (sigmas 1, 0.001): the step at sigma 1 is guided through the velocity, so 2 forwards + 1 backward; the
    gradient moves the sample away from the plain ODE sample of the same noise."""
    from flowalign.cli import main

    common = ["sample", "--steps", "2", "--max-prompts", "1", "--model", str(TOY)]
    out = tmp_path / "rgs"
    assert main([*common, "--guidance", "rgs", "--budget", "3", "--rgs-reward", name,
                 "--rgs-reward-kwargs", json.dumps(_zoo_kwargs(zoo, name)), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["nfe"] for r in results["results"]] == [3]
    assert main([*common, "--guidance", "none", "--out", str(tmp_path / "plain")]) == 0
    assert not (_png(out / "images" / "0000.png") == _png(tmp_path / "plain" / "images" / "0000.png")).all()


def test_flowalign_sample_fk_with_rgs_proposals_from_a_zoo_scorer(tmp_path, zoo):
    """FK's RGS-guided proposals through the same entry point (HPS here): same NFEs, moved particles."""
    from flowalign.cli import main

    common = ["sample", "--guidance", "fk", "--steps", "2", "--budget", "4", "--max-prompts", "1", "--model", str(TOY)]
    guided = ["--rgs-reward", "hps", "--rgs-reward-kwargs", json.dumps(zoo["hps"]), "--rgs-gradient", "x0",
              "--rgs-bands", "0.2:1.0"]
    for name, extra in (("guided", guided), ("plain", [])):
        assert main([*common, *extra, "--out", str(tmp_path / name)]) == 0
        assert [r["nfe"] for r in json.loads((tmp_path / name / "results.json").read_text())["results"]] == [4]
    guided_image, plain_image = (_png(tmp_path / name / "images" / "0000.png") for name in ("guided", "plain"))
    assert not (guided_image == plain_image).all()


@pytest.mark.parametrize("name", ZOO)
def test_rg_opd_target_gets_a_real_gradient_from_every_zoo_scorer(toy, zoo, name):
    """``loss.rg_opd.reward`` with a zoo scorer: the RG-OPD term's own target function (its reward built as the
    trainer builds it, at start-up), against the gradient of the scorer's ``forward`` on the decoded x0_hat by hand."""
    from contextlib import nullcontext

    from flowalign.losses.rg_opd import RGOPDConfig, RGOPDLoss
    from flowalign.samplers.rgs import rgs_velocity_target
    from flowalign.samplers.sde import predict_x0

    model, metadata = toy
    term = RGOPDLoss(RGOPDConfig(name="rg_opd", reward=name, reward_kwargs=_zoo_kwargs(zoo, name), bands=[[0.2, 1.0]]))
    term.start_up()
    term.model, term.autocast, term.guidance_scale = model, nullcontext, 1.0
    reward = term.reward
    prompts = [m["prompt"] for m in metadata]
    cond = model.encode(prompts)
    x = torch.randn(2, *model.latent_shape(1)[1:], generator=torch.Generator().manual_seed(0))
    sigma, sigma_next = torch.full((2,), 0.75), torch.full((2,), 0.5)
    with torch.no_grad():
        v_ref = model.velocity(x, sigma, cond)
    got = term.reward_target(x, sigma, sigma_next, cond, metadata, v_ref)
    x0 = predict_x0(x, v_ref, sigma[0]).requires_grad_(True)
    (grad,) = torch.autograd.grad(reward.forward(model.decode(x0), prompts).sum(), x0)
    assert torch.isfinite(grad).all() and (grad.flatten(1).abs().sum(dim=1) > 0).all()
    expected = rgs_velocity_target(x, v_ref, [grad], [1.0], 0.75, 0.5, [(0.2, 1.0)])
    assert torch.allclose(got, expected, atol=1e-5) and not torch.allclose(got, v_ref.float())


def test_rg_opd_refuses_a_reward_without_a_gradient_before_building_it(tmp_path):
    from flowalign.config import load_config
    from flowalign.errors import SetupError
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    for name in ("geneval", "jpeg_compressibility", "toy_geneval"):  # the model path does not exist: never loaded
        config = load_config(TrainConfig, None, [f"model.path={tmp_path / 'no-model'}", "loss.rg_opd.weight=1",
                                                 f"loss.rg_opd.reward={name}", f"train.out_dir={tmp_path / name}"])
        with pytest.raises(SetupError, match=f"loss.rg_opd.reward '{name}' is not differentiable.*toy_geneval_soft"):
            Trainer(config)


# ------------------------------------------------------------------------------------------------ CFG


def test_bon_with_one_particle_at_cfg_3_is_the_pipelines_own_sample(sd3_pipe):
    """Best-of-N with N = 1 (budget = one CFG trajectory, 2 NFEs per step) at CFG 3 on the tiny SD3 pipeline equals
    ``StableDiffusion3Pipeline(guidance_scale=3)`` from the same initial latents, bit for bit."""
    from flowalign.inference.sample import SampleConfig, run_guided
    from flowalign.models import wrap_pipeline
    from flowalign.rewards import BrightnessReward
    from flowalign.samplers.guided import initial_noise
    from flowalign.seeding import generator as seeded_generator

    model = wrap_pipeline(sd3_pipe)
    model.transformer.requires_grad_(False)
    prompts = ["a photo of a red circle", "two blue squares left of a triangle"]
    steps, seed = 4, 3
    config = SampleConfig(guidance="bon", budget=2 * steps, steps=steps, seed=seed, cfg=3.0)
    config.validate()
    counter = TransformerCounter(model.transformer)
    try:
        result = run_guided(model, [{"prompt": p} for p in prompts], config, reward_fn=BrightnessReward())
    finally:
        counter.handle.remove()
    assert result.info["particles"] == 1
    assert result.nfe.tolist() == [2 * steps, 2 * steps] and counter.rows == 2 * 2 * steps

    # the sampler's own initial noise: prompt p's generator keyed (seed, p)
    latents = initial_noise(model.latent_shape(1)[1:], [seeded_generator(seed, p) for p in range(2)],
                            torch.arange(2), model.device)
    expected = sd3_pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=3.0, latents=latents.clone(),
                        output_type="latent", max_sequence_length=model.max_sequence_length).images
    assert torch.equal(result.final, expected)
    plain = run_guided(model, [{"prompt": p} for p in prompts], SampleConfig(guidance="bon", budget=steps,
                                                                             steps=steps, seed=seed),
                       reward_fn=BrightnessReward())
    assert plain.nfe.tolist() == [steps, steps] and not torch.equal(plain.final, expected)  # CFG changed the sample


@pytest.mark.parametrize("guidance,budget,nfe", [("none", 1, 6), ("bon", 12, 12), ("fk", 12, 12), ("dts", 16, None),
                                                 ("rgs", 12, 10)])
def test_every_guidance_mode_counts_two_nfes_per_cfg_step(toy, guidance, budget, nfe):
    """3 steps at CFG 3 on the toy model: every transformer pass doubles its batch (counted at the transformer) and
    every method reports exactly those NFEs; RGS on registers also counts 2 per backward (2 guided steps): 6 + 4."""
    model, metadata = toy
    result, counter = _counted_toy_run(model, metadata, guidance, budget, cfg=3.0)
    if guidance == "rgs":
        assert result.nfe.tolist() == [nfe, nfe] and counter.rows == 2 * 2 * 3 and result.info["guided_steps"] == 2
    elif guidance == "dts":
        assert counter.rows == int(result.nfe.sum()) and (result.nfe <= budget).all() and (result.nfe % 2 == 0).all()
        assert (result.nfe > budget - 2 * 3).all()
    else:
        assert result.nfe.tolist() == [nfe, nfe] and counter.rows == 2 * nfe
    if guidance == "none":
        plain, _ = _counted_toy_run(model, metadata, "none", 3)
        assert not torch.equal(result.final, plain.final)


def test_flowalign_sample_cfg_counts_and_refuses_a_budget_below_one_cfg_trajectory(tmp_path, capsys, toy):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--guidance", "bon", "--cfg", "3", "--budget", "5", "--steps", "3", "--model", str(TOY),
              "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "smaller than one trajectory of 3 steps (6 NFEs with --cfg)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    out = tmp_path / "cfg"
    assert main(["sample", "--guidance", "bon", "--cfg", "3", "--budget", "12", "--steps", "3", "--max-prompts", "2",
                 "--model", str(TOY), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["nfe"] for r in results["results"]] == [12, 12] and results["config"]["cfg"] == 3.0
