"""Rewards: registry, score_all errors and NaN masking, combine modes, and the toy GenEval reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowalign.rewards import RewardScores, build_reward, combine_rewards, register_reward, score_all
from flowalign.toy import prompts as P
from flowalign.toy.reward import ToyGenEvalReward, clause_credit, sub_metadata
from flowalign.toy.scenes import COLORS, Shape, render, scene_for

EPS = 1e-4


def constant(values):
    def reward(images, prompts, metadata):
        return values

    return reward


def batch(n=4):
    return torch.zeros(n, 3, 8, 8), [f"prompt {i}" for i in range(n)], [{} for _ in range(n)]


# ---------------------------------------------------------------------------------------------- registry


def test_registry_builds_a_working_reward_with_its_arguments():
    meta = P.color_attr("red", "circle", "blue", "square")
    half_right = as_batch([shape("circle", "red", 8.5, 16.5), shape("square", "green", 23.5, 16.5)])
    partial, binary = build_reward("toy_geneval", partial_credit=True), build_reward("toy_geneval")
    assert isinstance(partial, ToyGenEvalReward) and partial.name == "toy_geneval"
    # the keyword reaches the scorer: one of two clauses holds, worth 1/2 with partial credit and 0 without
    assert partial(half_right, [meta["prompt"]], [meta]).tolist() == [0.5]
    assert binary(half_right, [meta["prompt"]], [meta]).tolist() == [0.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'.*toy_geneval"):
        build_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("toy_geneval", ToyGenEvalReward)


# ----------------------------------------------------------------------------------- differentiable entry point


def test_require_differentiable_checks_the_entry_point_not_the_flag():
    from flowalign.rewards import require_differentiable

    class Flagged:  # the old contract: a flag, and scores without a graph
        name = "flagged"
        differentiable = True

        @torch.no_grad()
        def __call__(self, images, prompts, metadata):
            return images.mean(dim=(1, 2, 3))

    with pytest.raises(ValueError) as error:
        require_differentiable(Flagged(), "--rgs-reward")
    message = str(error.value)
    assert "--rgs-reward 'flagged' is not differentiable" in message and "forward(images, prompts, metadata)" in message
    assert "toy_geneval_soft" in message and "pickscore" in message and "--registers" in message  # the ways out
    brightness = build_reward("brightness")
    assert require_differentiable(brightness, "--rgs-reward") is brightness


def test_non_differentiable_rewards_are_refused_before_they_are_built():
    from flowalign.rewards import build_differentiable_reward

    # geneval would load Mask2Former from this (absent) directory first, were it built
    with pytest.raises(ValueError, match="loss.rg_opd_reward 'geneval' is not differentiable"):
        build_differentiable_reward("geneval", "loss.rg_opd_reward", detector_model="/absent/mask2former")
    for name in ("toy_geneval", "jpeg_compressibility", "jpeg_incompressibility"):
        with pytest.raises(ValueError, match=f"--rgs-reward '{name}' is not differentiable"):
            build_differentiable_reward(name, "--rgs-reward")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_differentiable_reward("nope", "--rgs-reward")


def test_differentiable_score_gradient_of_brightness_by_hand():
    from flowalign.rewards import differentiable_score

    images = torch.rand(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    scores = differentiable_score(build_reward("brightness"), images, ["a", "b"], [{}, {}])
    assert torch.allclose(scores, images.detach().mean(dim=(1, 2, 3)))
    (grad,) = torch.autograd.grad(scores.sum(), images)
    assert torch.allclose(grad, torch.full_like(grad, 1 / 60))  # d mean / d pixel = 1 / (3 * 4 * 5)
    (grad,) = torch.autograd.grad(differentiable_score(build_reward("brightness", channel=1), images, ["a", "b"]).sum(),
                                  images)
    assert torch.allclose(grad[:, 1], torch.full_like(grad[:, 1], 1 / 20)) and torch.all(grad[:, [0, 2]] == 0)


def test_differentiable_score_refuses_scores_without_a_graph_or_of_the_wrong_shape():
    from flowalign.rewards import differentiable_score

    class Detached:
        name = "detached"

        def forward(self, images, prompts, metadata=None):
            return images.detach().mean(dim=(1, 2, 3))

    class Pooled:
        name = "pooled"

        def forward(self, images, prompts, metadata=None):
            return images.mean()

    images = torch.rand(2, 3, 4, 4).requires_grad_(True)
    with pytest.raises(ValueError, match="'detached': forward returned scores without a gradient"):
        differentiable_score(Detached(), images, ["a", "b"])
    with pytest.raises(ValueError, match=r"'pooled': forward returned \(\) for 2 images"):
        differentiable_score(Pooled(), images, ["a", "b"])
    with pytest.raises(ValueError, match="got 2 images, 1 prompts"):
        differentiable_score(build_reward("brightness"), images, ["a"])


# --------------------------------------------------------------------------------------------- score_all


def test_score_all_stacks_scores_and_weights():
    images, prompts, metadata = batch(3)
    scores = score_all(
        [("a", 1.0, constant([1, 2, 3])), ("b", 0.5, constant(torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)))],
        images, prompts, metadata,
    )
    assert isinstance(scores, RewardScores) and scores.names == ["a", "b"]
    assert scores.raw.dtype == torch.float32 and scores.raw.shape == (2, 3)
    torch.testing.assert_close(scores.raw, torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.0, 1.0]]))
    torch.testing.assert_close(scores.weights, torch.tensor([1.0, 0.5]))
    assert scores.valid.all() and scores.num_invalid == 0


def test_score_all_masks_and_counts_non_finite_scores():
    images, prompts, metadata = batch(4)
    scores = score_all(
        [("a", 1.0, constant([1.0, float("nan"), 2.0, 3.0])), ("b", 1.0, constant([0.0, 1.0, float("inf"), 1.0]))],
        images, prompts, metadata,
    )
    assert scores.valid.tolist() == [True, False, False, True] and scores.num_invalid == 2
    assert torch.isnan(scores.raw[0, 1]) and torch.isinf(scores.raw[1, 2])  # kept as returned, for inspection
    group = torch.tensor([0, 0, 0, 0])
    combined = combine_rewards(scores.raw, scores.weights, scores.valid, group)
    assert torch.isfinite(combined).all()
    torch.testing.assert_close(combined, torch.tensor([1.0, 0.0, 0.0, 4.0]))
    normalized = combine_rewards(scores.raw, scores.weights, scores.valid, group, mode="normalize_then_sum")
    # valid samples 0 and 3: a = (1, 3) -> (-1, 1), b = (0, 1) -> (-1, 1), each divided by (std + eps)
    expected = [-1 / (1 + EPS) - 0.5 / (0.5 + EPS), 0.0, 0.0, 1 / (1 + EPS) + 0.5 / (0.5 + EPS)]
    torch.testing.assert_close(normalized, torch.tensor(expected))


def test_raising_reward_names_reward_and_first_prompt():
    def broken(images, prompts, metadata):
        raise KeyError("missing weights")

    images, prompts, metadata = batch(2)
    with pytest.raises(RuntimeError, match="reward 'clip_score'.*'prompt 0'") as info:
        score_all([("ok", 1.0, constant([0, 0])), ("clip_score", 1.0, broken)], images, prompts, metadata)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize(
    "output, match",
    [
        ([1.0, 2.0, 3.0], r"reward 'bad'.*shape \(3,\) for a batch of 2"),
        (torch.zeros(2, 1), r"reward 'bad'.*shape \(2, 1\)"),
        (["good", 1.0], r"reward 'bad'.*non-numeric score at index 0"),
        ([None, 1.0], r"reward 'bad'.*non-numeric"),
        ("0.5", r"reward 'bad' returned str"),
        (torch.zeros(2, dtype=torch.complex64), r"reward 'bad'.*complex"),
    ],
)
def test_malformed_reward_output(output, match):
    images, prompts, metadata = batch(2)
    with pytest.raises(ValueError, match=match):
        score_all([("bad", 1.0, constant(output))], images, prompts, metadata)


def test_score_all_input_errors():
    images, prompts, metadata = batch(2)
    with pytest.raises(ValueError, match="unique"):
        score_all([("a", 1.0, constant([0, 0])), ("a", 1.0, constant([0, 0]))], images, prompts, metadata)
    with pytest.raises(ValueError, match="weight"):
        score_all([("a", float("nan"), constant([0, 0]))], images, prompts, metadata)
    with pytest.raises(ValueError, match="2 images, 1 prompts"):
        score_all([("a", 1.0, constant([0, 0]))], images, prompts[:1], metadata)


# ---------------------------------------------------------------------------------------------- combine

# Two groups of four. Reward a is a 0/1 verdict; reward b is on a 100x larger scale and disagrees with a.
SCORES = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 100.0, 0.0, 100.0, 0.0, 200.0, 0.0, 200.0]])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
WEIGHTS = torch.tensor([1.0, 0.5])
ALL_VALID = torch.ones(8, dtype=torch.bool)


def test_sum_then_normalize_is_the_weighted_sum():
    combined = combine_rewards(SCORES, WEIGHTS, ALL_VALID, GROUPS, mode="sum_then_normalize")
    torch.testing.assert_close(combined, torch.tensor([1.0, 50.0, 1.0, 50.0, 1.0, 101.0, 0.0, 100.0]))
    # The large-scale reward decides the ranking: the samples reward a prefers come last in group 0.
    assert combined[1] > combined[0]


def test_normalize_then_sum_group_std():
    combined = combine_rewards(SCORES, WEIGHTS, ALL_VALID, GROUPS, mode="normalize_then_sum", std="group")
    # group 0: a -> (+-0.5)/(0.5+eps), b -> (-+50)/(50+eps); group 1: a and b -> (+-0.5)/(0.5+eps), (+-100)/(100+eps)
    a = 0.5 / (0.5 + EPS)
    b0, b1 = 50 / (50 + EPS), 100 / (100 + EPS)
    expected = [a - 0.5 * b0, -a + 0.5 * b0, a - 0.5 * b0, -a + 0.5 * b0,
                a - 0.5 * b1, a + 0.5 * b1, -a - 0.5 * b1, -a + 0.5 * b1]  # fmt: skip
    torch.testing.assert_close(combined, torch.tensor(expected))
    # Now the weights set the influence: reward a (weight 1) wins the ranking in group 0.
    assert combined[0] > combined[1]


def test_normalize_then_sum_global_std():
    combined = combine_rewards(SCORES, WEIGHTS, ALL_VALID, GROUPS, mode="normalize_then_sum", std="global")
    std_a, std_b = float(np.std(SCORES[0].numpy())), float(np.std(SCORES[1].numpy()))
    means_a = torch.tensor([0.5] * 4 + [0.5] * 4)
    means_b = torch.tensor([50.0] * 4 + [100.0] * 4)
    expected = (SCORES[0] - means_a) / (std_a + EPS) + 0.5 * (SCORES[1] - means_b) / (std_b + EPS)
    torch.testing.assert_close(combined, expected)


def test_combine_invalid_samples_contribute_nothing():
    scores = SCORES.clone()
    scores[1, 3] = float("nan")
    valid = ALL_VALID.clone()
    valid[5] = False  # flagged by the caller although finite
    for mode in ("sum_then_normalize", "normalize_then_sum"):
        combined = combine_rewards(scores, WEIGHTS, valid, GROUPS, mode=mode)
        assert torch.isfinite(combined).all() and combined[3] == 0 and combined[5] == 0
    combined = combine_rewards(scores, WEIGHTS, valid, GROUPS, mode="normalize_then_sum")
    # group 0 over samples 0-2: a = (1, 0, 1) mean 2/3, std sqrt(2)/3; b = (0, 100, 0) mean 100/3, std 100 sqrt(2)/3
    s = np.sqrt(2) / 3
    assert combined[0].item() == pytest.approx((1 / 3) / (s + EPS) + 0.5 * (-100 / 3) / (100 * s + EPS), rel=1e-5)


def test_combine_errors():
    with pytest.raises(ValueError, match="combine mode"):
        combine_rewards(SCORES, WEIGHTS, ALL_VALID, GROUPS, mode="product")
    with pytest.raises(ValueError, match="weights"):
        combine_rewards(SCORES, torch.tensor([1.0]), ALL_VALID, GROUPS)
    with pytest.raises(ValueError, match="std mode"):
        combine_rewards(SCORES, WEIGHTS, ALL_VALID, GROUPS, std="batch")


# ------------------------------------------------------------------------------------------- toy reward


def as_batch(*scenes):
    """Rendered scenes as a float [B, 3, H, W] batch in [0, 1]."""
    return torch.from_numpy(np.stack([render(scene) for scene in scenes])).permute(0, 3, 1, 2).float() / 255


def shape(kind, color, cx, cy, size=9):
    return Shape(kind, color, cx, cy, float(size))


def score(metadata, *scenes):
    images = as_batch(*scenes)
    prompts = [metadata["prompt"]] * len(scenes)
    binary = ToyGenEvalReward()(images, prompts, [metadata] * len(scenes))
    partial = ToyGenEvalReward(partial_credit=True)(images, prompts, [metadata] * len(scenes))
    return binary.tolist(), partial.tolist()


def test_toy_reward_color_attr():
    meta = P.color_attr("red", "circle", "blue", "square")
    correct = [shape("circle", "red", 8.5, 16.5), shape("square", "blue", 23.5, 16.5)]
    half = [shape("circle", "red", 8.5, 16.5), shape("square", "green", 23.5, 16.5)]
    wrong = [shape("circle", "blue", 8.5, 16.5), shape("square", "red", 23.5, 16.5)]
    binary, partial = score(meta, correct, half, wrong, [])
    assert binary == [1.0, 0.0, 0.0, 0.0]
    assert partial == [1.0, 0.5, 0.0, 0.0]


def test_toy_reward_position_counts_only_the_position_clause_outcome():
    meta = P.position("circle", "left of", "square")  # include[0] = square (reference), include[1] = circle
    left = [shape("circle", "red", 8.5, 16.5), shape("square", "blue", 23.5, 16.5)]
    swapped = [shape("circle", "red", 23.5, 16.5), shape("square", "blue", 8.5, 16.5)]
    only_square = [shape("square", "blue", 23.5, 16.5)]
    only_circle = [shape("circle", "red", 8.5, 16.5)]
    binary, partial = score(meta, left, swapped, only_square, only_circle)
    assert binary == [1.0, 0.0, 0.0, 0.0]
    # swapped: the square clause holds, the circle's relation fails; a lone circle has no target.
    assert partial == [1.0, 0.5, 0.5, 0.0]


def test_toy_reward_counting_with_exclude():
    meta = P.counting("circle", 2)  # include circle >= 2, exclude circle >= 3
    circles = [shape("circle", c, x, y) for c, (x, y) in zip(COLORS, [(6.5, 6.5), (25.5, 6.5), (6.5, 25.5)])]
    square = shape("square", "white", 25.5, 25.5)
    binary, partial = score(meta, circles[:2], circles[:2] + [square], circles, circles[:1], [square], [])
    assert binary == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # three circles: include holds, exclude fails; one circle or only a square: include fails, exclude holds;
    # an empty canvas has nothing detected and scores 0, not the exclude's 1/2.
    assert partial == [1.0, 1.0, 0.5, 0.5, 0.5, 0.0]


def test_toy_reward_single_clause_partial_equals_binary():
    meta = P.colors("green", "triangle")
    binary, partial = score(
        meta, [shape("triangle", "green", 16.5, 16.5)], [shape("triangle", "red", 16.5, 16.5)],
        [shape("square", "green", 16.5, 16.5)],
    )
    assert binary == partial == [1.0, 0.0, 0.0]


def test_clause_credit_follows_position_chains_and_thresholds():
    meta = {
        "tag": "position",
        "prompt": "chain",
        "include": [
            {"class": "square", "count": 1},
            {"class": "circle", "count": 1, "position": ["left of", 0]},
            {"class": "triangle", "count": 1, "position": ["above", 1]},
        ],
    }
    assert sub_metadata(meta, 2)["include"] == meta["include"]
    assert sub_metadata(meta, 0)["include"] == meta["include"][:1]
    above_square = {**meta["include"][2], "position": ["above", 0]}
    skip = dict(meta, include=[meta["include"][0], meta["include"][1], above_square])
    assert sub_metadata(skip, 2)["include"] == [meta["include"][0], above_square]

    square = {"box": (20, 12, 28, 20), "score": 1.0}
    circle_left = {"box": (2, 12, 10, 20), "score": 1.0}
    circle_below = {"box": (20, 24, 28, 32), "score": 1.0}
    triangle_above_left = {"box": (2, 0, 10, 8), "score": 1.0}
    size = (32, 32)
    good = {"square": [square], "circle": [circle_left], "triangle": [triangle_above_left]}
    assert clause_credit(meta, good, size) == (3, 3)
    # The circle's relation fails, so the triangle has no target either (as in the full judgement).
    broken = {"square": [square], "circle": [circle_below], "triangle": [triangle_above_left]}
    assert clause_credit(meta, broken, size) == (1, 3)

    two = P.two_object("circle", "square")
    weak = {"circle": [{"box": (2, 2, 10, 10), "score": 0.5}], "square": []}
    assert clause_credit(two, weak, size) == (1, 2)  # 0.5 > 0.3
    count = P.counting("circle", 2)
    assert clause_credit(count, weak, size) == (0, 2)  # nothing above the counting threshold 0.9


def test_toy_reward_partial_is_one_iff_binary_on_random_scenes():
    rng = np.random.default_rng(0)
    all_meta = P.all_prompts()
    metas, scenes = [], []
    for index in rng.choice(len(all_meta), size=24, replace=False):
        meta = all_meta[int(index)]
        scene = scene_for(meta, rng)
        dropped = [s for i, s in enumerate(scene) if i != int(rng.integers(len(scene)))]
        recolored = [Shape(s.kind, COLORS[int(rng.integers(len(COLORS)))], s.cx, s.cy, s.size) for s in scene]
        moved = [Shape(s.kind, s.color, 32 - s.cx, 32 - s.cy, s.size) for s in scene]
        for variant in (scene, dropped, recolored, moved):
            metas.append(meta)
            scenes.append(variant)
    images = as_batch(*scenes)
    verdicts = ToyGenEvalReward(partial_credit=True).verdicts(images, metas)
    assert all(v["correct"] for v in verdicts[::4])  # scene_for's scenes are correct
    for v in verdicts:
        assert (v["partial"] == 1.0) == v["correct"]
        assert (v["satisfied"] == v["total"]) == v["correct"]
    assert any(0 < v["partial"] < 1 for v in verdicts)


def test_toy_reward_through_score_all():
    meta = P.single_object("square")
    images = as_batch([shape("square", "red", 16.5, 16.5)], [])
    scores = score_all([("toy", 1.0, build_reward("toy_geneval"))], images, [meta["prompt"]] * 2, [meta] * 2)
    torch.testing.assert_close(scores.raw, torch.tensor([[1.0, 0.0]]))
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        ToyGenEvalReward()(images[0], [meta["prompt"]], [meta])
