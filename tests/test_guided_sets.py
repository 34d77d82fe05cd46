"""Sets of candidates from the guided samplers, image embeddings and a set's diversity, Euphonium-guided sampling.

Unit behaviour on the analytic Gaussian flow (tests/gaussian_flow.py) and hand-computed cases; every method with
``--candidates`` end to end through ``flowalign sample`` on the toy model, NFEs counted at the transformer.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from flowalign.embeddings import EMBEDDINGS, build_embedding, resolve_embedding, set_diversity
from flowalign.reward_models.embeddings import cosine_distances
from flowalign.samplers.dts import diffusion_tree_search
from flowalign.samplers.euphonium import euphonium_sampling
from flowalign.samplers.guided import best_of_n, group_argmax, group_topk
from flowalign.samplers.rgs import reward_guided_sampling, x0_guide
from flowalign.samplers.euphonium import euphonium_guidance
from flowalign.samplers.sde import sde_step, standard_normal
from gaussian_flow import CountingVelocity, gaussian_velocity, generators, mean_reward, sigmas

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "assets" / "toy-sd3"
SHAPE = (6,)


# ------------------------------------------------------------------------------------------------ choosing K


def test_group_topk_keeps_the_k_best_in_order_first_on_ties_and_never_nan():
    values = torch.tensor([0.2, 0.9, 0.9, float("nan"), 0.5, 0.1, float("nan"), 0.3])
    assert group_topk(values, 2, 4, 2).tolist() == [[1, 2], [4, 7]]
    assert group_topk(values, 2, 4, 3).tolist() == [[1, 2, 0], [4, 7, 5]]
    assert group_topk(values, 2, 4, 1)[:, 0].tolist() == group_argmax(values, 2, 4).tolist()
    with pytest.raises(ValueError, match="cannot keep 5 of 4"):
        group_topk(values, 2, 4, 5)


def test_best_of_n_keeps_its_k_best_trajectories_best_first_at_the_same_nfes():
    sig = sigmas(5)
    velocity = CountingVelocity(2)
    one = best_of_n(velocity, mean_reward, sig, SHAPE, generators(2), 20)
    velocity = CountingVelocity(2)
    sets = best_of_n(velocity, mean_reward, sig, SHAPE, generators(2), 20, candidates=3)
    assert velocity.per_prompt == [20, 20] and sets.nfe.tolist() == [20, 20]
    assert sets.final.shape == (2, 3, *SHAPE) and sets.reward.shape == (2, 3)
    everything = sets.info["all_rewards"]  # the same 4 trajectories per prompt as without candidates
    assert torch.equal(everything, one.info["all_rewards"])
    assert torch.equal(sets.reward, everything.sort(dim=1, descending=True).values[:, :3])
    assert torch.equal(sets.reward[:, 0], one.reward) and torch.equal(sets.final[:, 0], one.final)
    assert torch.allclose(mean_reward(sets.final.flatten(0, 1), None).double(), sets.reward.flatten())


@pytest.mark.parametrize("method", ["bon", "rgs", "euphonium"])
def test_more_candidates_than_the_budget_pays_for_is_refused_before_any_work(method):
    velocity = CountingVelocity(1)
    sig = sigmas(4)
    with pytest.raises(ValueError, match="--candidates 3"):
        if method == "bon":
            best_of_n(velocity, mean_reward, sig, SHAPE, generators(1), 8, candidates=3)
        elif method == "rgs":
            reward_guided_sampling(x0_guide(velocity, mean_reward), sig, SHAPE, generators(1), 12,
                                   final_reward=mean_reward, candidates=3)
        else:
            euphonium_sampling(x0_guide(velocity, mean_reward), sig, SHAPE, generators(1), 10,
                               final_reward=mean_reward, start=2, scale=1.0, candidates=3)
    assert velocity.per_prompt == [0]


def test_rgs_keeps_its_k_best_guided_trajectories():
    sig = sigmas(4)
    velocity = CountingVelocity(2)
    guide = x0_guide(velocity, mean_reward)
    result = reward_guided_sampling(guide, sig, SHAPE, generators(2), 26, final_reward=mean_reward, candidates=2)
    # cost = 4 forwards + 4 guided steps (every sigma of 1, 0.75, 0.5, 0.25 is > 0.2) x 1 backward = 8: 3 trajectories
    assert result.info["particles"] == 3 and result.nfe.tolist() == [24, 24]
    assert result.final.shape == (2, 2, *SHAPE)
    assert (result.reward[:, 0] >= result.reward[:, 1]).all()
    assert torch.allclose(mean_reward(result.final.flatten(0, 1), None).double(), result.reward.flatten())


def test_dts_star_keeps_its_k_best_leaves_and_dts_draws_k_leaves():
    sig = sigmas(4)
    star = diffusion_tree_search(CountingVelocity(2), mean_reward, sig, SHAPE, generators(2), 16, candidates=3)
    assert star.final.shape == (2, 3, *SHAPE) and (star.nfe <= 16).all()
    for b, tree in enumerate(star.info["trees"]):
        best = sorted((tree.value[n] for n in tree.leaves()), reverse=True)[:3]
        assert star.reward[b].tolist() == best
    soft = diffusion_tree_search(CountingVelocity(2), mean_reward, sig, SHAPE, generators(2), 16, greedy=False,
                                 candidates=3)
    for b, tree in enumerate(soft.info["trees"]):
        values = {tree.value[n] for n in tree.leaves()}
        assert set(soft.reward[b].tolist()) <= values
    with pytest.raises(ValueError, match="--candidates 50: tree search has"):
        diffusion_tree_search(CountingVelocity(1), mean_reward, sig, SHAPE, generators(1), 8, candidates=50)


# ------------------------------------------------------------------------------------------------ Euphonium


def _unguided_dance(sig, shape, gens, k, noise_level):
    """The dance SDE from the same initial noise and per-step noise draws as euphonium_sampling, no shift."""
    from flowalign.samplers.guided import initial_noise

    rows = torch.arange(len(gens)).repeat_interleave(k)
    x = initial_noise(shape, gens, rows, "cpu")
    for i in range(sig.numel() - 1):
        noise = standard_normal(x.shape, gens, x.device, owner=rows)
        x = sde_step(x, gaussian_velocity(x, sig[i]), sig[i], sig[i + 1], kind="dance", noise_level=noise_level,
                     noise=noise).prev_sample
    return x


def test_euphonium_sampling_at_scale_zero_is_the_plain_dance_sde_bitwise():
    sig = sigmas(5)
    result = euphonium_sampling(x0_guide(CountingVelocity(2), mean_reward), sig, SHAPE, generators(2), 7,
                                final_reward=mean_reward, start=3, scale=0.0, noise_level=0.3)
    plain = _unguided_dance(sig, SHAPE, generators(2), 1, 0.3)
    assert torch.equal(result.final, plain)
    assert result.info["shift_norms"] == [0.0, 0.0]


def test_euphonium_sampling_shifts_the_mean_along_the_reward_gradient_and_counts_its_nfes():
    sig = sigmas(5)
    velocity = CountingVelocity(2)
    scale = 2.0
    result = euphonium_sampling(x0_guide(velocity, mean_reward), sig, SHAPE, generators(2), 14,
                                final_reward=mean_reward, start=3, scale=scale, normalize=True, noise_level=0.3)
    # one trajectory = 5 forwards + 2 guided steps x 1 backward = 7 NFEs; 2 trajectories, the better one kept
    assert result.info["particles"] == 2 and result.nfe.tolist() == [14, 14] and velocity.per_prompt == [10, 10]
    # a normalised shift of norm scale * (s - s') on each guided step
    expected = [scale * float(sig[i] - sig[i + 1]) for i in (3, 4)]
    assert result.info["shift_norms"] == pytest.approx(expected, rel=1e-5)
    plain = _unguided_dance(sig, SHAPE, generators(2), 2, 0.3)
    # the same noise, shifted along the gradient of the mean: every trajectory ends with a higher reward
    guided_all = euphonium_sampling(x0_guide(CountingVelocity(2), mean_reward), sig, SHAPE, generators(2), 14,
                                    final_reward=mean_reward, start=3, scale=scale, noise_level=0.3, candidates=2)
    assert (guided_all.reward.sort(dim=1).values > mean_reward(plain, None).reshape(2, 2).double().sort(dim=1).values).all()


def test_euphonium_guidance_shift_is_the_released_formula():
    gradient = torch.tensor([[3.0, 4.0], [0.0, 0.0]])
    shift = euphonium_guidance(gradient, 0.8, 0.6, noise_level=0.25, scale=0.5, normalize=True, scale_by_dt=True)
    assert torch.allclose(shift, torch.tensor([[0.5 * 0.2 * 0.6, 0.5 * 0.2 * 0.8], [0.0, 0.0]]), atol=1e-7)


# ------------------------------------------------------------------------------------------------ diversity


def test_set_diversity_is_the_mean_pairwise_cosine_distance():
    e = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])  # distances 1, 2, 1
    assert cosine_distances(e)[0].tolist() == [[0.0, 1.0, 2.0], [1.0, 0.0, 1.0], [2.0, 1.0, 0.0]]
    assert set_diversity(e).tolist() == [pytest.approx(4 / 3)]
    copies = torch.tensor([[[0.6, 0.8]] * 4])
    assert set_diversity(copies).tolist() == [pytest.approx(0.0, abs=1e-7)]
    assert set_diversity(torch.rand(3, 1, 5)).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"\[sets, K, D\]"):
        set_diversity(torch.rand(4, 5))


def _render(kind, color, cx):
    from flowalign.toy.scenes import Shape, render

    pixels = render([Shape(kind, color, cx, 16.0, 10.0)], 32)
    return torch.from_numpy(pixels).permute(2, 0, 1).float() / 255.0


def test_toy_scene_embedding_sees_layout_shape_and_colour_but_not_copies():
    red_left, red_right = _render("circle", "red", 8.0), _render("circle", "red", 24.0)
    blue_left, square_left = _render("circle", "blue", 8.0), _render("square", "red", 8.0)
    embedding = build_embedding("toy_scene")
    vectors = embedding.embed(torch.stack([red_left, red_left, red_right, blue_left, square_left]))
    assert torch.allclose(vectors.norm(dim=1), torch.ones(5))
    d = cosine_distances(vectors)
    assert d[0, 1] < 1e-6
    assert d[0, 2] > 0.1 and d[0, 3] > 0.1 and d[0, 4] > 0.02
    four_copies = set_diversity(vectors[[0, 0, 0, 0]][None])
    spread = set_diversity(vectors[[0, 2, 3, 4]][None])
    assert float(four_copies) < 1e-6 < float(spread)


def test_pixel_embedding_and_auto():
    pixels = build_embedding("pixels", grid=4)
    image = torch.rand(2, 3, 16, 16)
    assert pixels.embed(image).shape == (2, 48)
    assert resolve_embedding("auto", str(TOY)) == "toy_scene"
    assert resolve_embedding("auto", "assets/toy-wan/") == "toy_scene"  # the toy video world's frames
    assert resolve_embedding("auto", "/models/stable-diffusion-3.5-medium") == "pixels"
    assert resolve_embedding("clip", str(TOY)) == "clip"
    assert {"toy_scene", "pixels", "clip", "dreamsim"} <= set(EMBEDDINGS.names())


def test_clip_embedding_runs_on_a_tiny_local_open_clip(tmp_path):
    from reward_fixtures import register_tiny_open_clip, tiny_open_clip_checkpoint

    name = register_tiny_open_clip(tmp_path)
    weights = tiny_open_clip_checkpoint(tmp_path)
    embedding = build_embedding("clip", weights=str(weights), model_name=name, quick_gelu=False)
    vectors = embedding.embed(torch.rand(3, 3, 32, 32))
    assert vectors.shape == (3, 16) and torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)


# ------------------------------------------------------------------------------------------------ flowalign sample


SAMPLE_RUNS = {
    "none": [],
    "bon": ["--budget", "40"],
    "dts": ["--budget", "24"],
    "fk": ["--budget", "16"],
    "rgs": ["--budget", "40", "--rgs-reward", "toy_geneval_soft", "--rgs-gradient", "x0"],
    "euphonium": ["--budget", "48", "--rgs-reward", "toy_geneval_soft", "--rgs-gradient", "x0"],
    # 4 steps, scoring steps 1, 2, 3: 4 (4 + 3 x 4) NFEs
    "satisdive": ["--budget", "64", "--rgs-reward", "toy_geneval_soft"],
}


@pytest.mark.parametrize("guidance", sorted(SAMPLE_RUNS))
def test_every_method_writes_a_set_of_candidates_with_its_floor_and_diversity(tmp_path, guidance):
    from flowalign.cli import main

    out = tmp_path / guidance
    assert main(["sample", "--guidance", guidance, "--candidates", "4", "--steps", "4", "--max-prompts", "2",
                 "--out", str(out), *SAMPLE_RUNS[guidance]]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["images_per_prompt"] == 4 and results["diversity_embedding"] == "toy_scene"
    rows = results["results"]
    assert [(r["prompt_id"], r["image_index"]) for r in rows] == [(p, j) for p in range(2) for j in range(4)]
    assert all((out / r["filename"]).is_file() for r in rows)
    budget = 16 if guidance == "none" else int(SAMPLE_RUNS[guidance][1])
    assert all(r["nfe"] <= budget for r in rows)
    for p, entry in enumerate(results["sets"]):
        rewards = [r["reward"] for r in rows if r["prompt_id"] == p]
        assert entry["worst_reward"] == pytest.approx(min(rewards))
        assert entry["mean_reward"] == pytest.approx(sum(rewards) / 4)
        assert 0 <= entry["diversity"] <= 2
    assert results["mean_worst_reward"] == pytest.approx(sum(s["worst_reward"] for s in results["sets"]) / 2)
    summary = (out / "summary.md").read_text()
    assert "4 images per prompt: mean worst-candidate reward" in summary and "toy_scene embedding" in summary
    from flowalign.evaluation.geneval import overall_standard_error

    geneval = results["geneval"]  # the toy verifier's overall with its standard error, in the JSON and the summary
    se = overall_standard_error(rows)
    assert geneval["overall_se"] == pytest.approx(se) and geneval["n_images"] == 8
    assert f"toy GenEval overall {geneval['overall']:.3f} ± {se:.3f} (standard error over 8 images in 1 tag:" in summary


def test_grid_captions_give_each_candidates_reward_and_verdict():
    from flowalign.inference.sample import grid_captions

    rows = [{"prompt": "a photo of a circle", "reward": 0.5, "correct": True},
            {"prompt": "a photo of a circle", "reward": 0.25, "correct": False},
            {"prompt": "a cat", "reward": None}]  # a reward that failed for this image, no toy verdict
    assert grid_captions(rows) == ["a photo of a circle | 0.500 | yes", "a photo of a circle | 0.250 | no",
                                   "a cat | n/a"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--guidance", "bon", "--candidates", "5", "--budget", "40", "--steps", "10"],
         "--candidates 5: bon needs at least 1 trajectory of 10 NFEs per candidate, 50 NFEs per prompt"),
        (["--guidance", "bon", "--candidates", "0"], "candidates must be an integer >= 1"),
        (["--guidance", "bon", "--candidates", "2", "--diversity", "dreamsimm"], "did you mean 'dreamsim'"),
        (["--guidance", "bon", "--candidates", "2", "--diversity", "dreamsim"], "loads from a local directory"),
        (["--guidance", "bon", "--candidates", "2", "--diversity", "dreamsim", "--diversity-kwargs",
          '{"path": "/nowhere/dreamsim"}'], "DreamSim directory /nowhere/dreamsim does not exist"),
        (["--guidance", "euphonium"], "guidance 'euphonium' needs a differentiable reward"),
        (["--guidance", "euphonium", "--rgs-reward", "toy_geneval_soft", "--euphonium-start", "1.0"],
         "start must be < 1"),
        (["--guidance", "euphonium", "--rgs-reward", "toy_geneval_soft", "--euphonium-scale", "-1"], "scale must be"),
        (["--guidance", "euphonium", "--rgs-reward", "toy_geneval_soft", "--candidates", "5", "--budget", "40"],
         "--candidates 5: euphonium needs at least 1 trajectory"),
    ],
)
def test_bad_set_and_diversity_settings_fail_before_loading(tmp_path, capsys, argv, message):
    from flowalign.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--model", str(tmp_path / "absent"), "--out", str(tmp_path / "o"), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
