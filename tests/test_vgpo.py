"""VGPO (``credit.name = vgpo``): the value-anchored advantages against hand-computed groups, its degenerate cases, the
refusal of rewards that can go below 0, and the instant rewards read off the rollout at no NFE."""

import dataclasses
from pathlib import Path

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.credit import value_anchored_advantages
from flowalign.training.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs/methods/vgpo.yaml"
R = torch.tensor([[0.2, 0.4, 1.0], [0.1, 0.3, 0.5]], dtype=torch.float64)


def vgpo(rewards, variant="reconstruction", **options):
    settings = {"gamma": 1.0, "k": 0.5, "alpha_steps": 2, "eps": 1e-4, **options}
    return value_anchored_advantages(torch.as_tensor(rewards, dtype=torch.float64), variant=variant, **settings)


def close(actual, expected):
    assert torch.allclose(actual, torch.as_tensor(expected, dtype=torch.float64), rtol=0, atol=1e-9), actual


def test_values_weights_and_both_advantages_of_a_two_by_three_group_by_hand():
    out = vgpo(R)
    close(out["Q"], [[1.6, 1.4, 1.0], [0.9, 0.8, 0.5]])  # Q_i = R_i + Q_{i+1}
    close(out["omega"], [[1.6 / (4 / 3), 1.4 / (4 / 3), 1.0 / (4 / 3)],
                         [0.9 / (2.2 / 3), 0.8 / (2.2 / 3), 0.5 / (2.2 / 3)]])  # Q over the trajectory's mean Q
    close(out["mu"], [1.25, 1.1, 0.75])
    close(out["std"], [0.35, 0.3, 0.25])  # population std: |Q_a - Q_b| / 2
    close(out["alpha"], [0.5 * 0.35, 0.5 * 0.3, 0.0])  # k std on the first alpha_steps = 2 steps
    omega, eps = out["omega"], 1e-4
    close(out["advantages"], [
        [omega[0, 0] * (0.35 + 0.175 * 1.6) / (0.35 + eps), omega[0, 1] * (0.3 + 0.15 * 1.4) / (0.3 + eps),
         omega[0, 2] * 0.25 / (0.25 + eps)],
        [omega[1, 0] * (-0.35 + 0.175 * 0.9) / (0.35 + eps), omega[1, 1] * (-0.3 + 0.15 * 0.8) / (0.3 + eps),
         omega[1, 2] * -0.25 / (0.25 + eps)]])
    close(out["relative"], [[0.35 / (0.35 + eps), 0.3 / (0.3 + eps), 0.25 / (0.25 + eps)],
                            [-0.35 / (0.35 + eps), -0.3 / (0.3 + eps), -0.25 / (0.25 + eps)]])
    free = vgpo(R, "std_free")
    close(free["alpha"], [0.5, 0.5, 0.0])
    close(free["advantages"], omega * (out["relative"] + torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64) * out["Q"]))


def test_the_discount_and_the_unbiased_std():
    out = vgpo(R, gamma=0.9, std_unbiased=True)
    close(out["Q"], [[0.2 + 0.9 * (0.4 + 0.9 * 1.0), 0.4 + 0.9 * 1.0, 1.0], [0.1 + 0.9 * (0.3 + 0.9 * 0.5),
                                                                             0.3 + 0.9 * 0.5, 0.5]])
    q = out["Q"]
    close(out["std"], (q[0] - q[1]).abs() / 2 ** 0.5)  # two values: |a - b| / sqrt(2) with G - 1
    assert vgpo(R, gamma=0.0)["Q"].equal(R)


def test_identical_rewards_give_zero_under_the_reconstruction_and_k_q_without_the_std():
    rewards = [[0.1, 0.1, 0.1]] * 3  # the group mean of 0.1s is not 0.1 in floating point: still exactly 0
    out = vgpo(rewards)
    assert out["advantages"].eq(0).all() and out["std"].eq(0).all() and out["relative"].eq(0).all()
    free = vgpo(rewards, "std_free")
    q = torch.tensor([0.3, 0.2, 0.1], dtype=torch.float64)
    omega = q / q.mean()
    close(free["advantages"], (omega * torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64) * q).expand(3, 3))


def test_one_trajectory_has_no_spread():
    out = vgpo([[0.5, 1.0]])
    assert out["std"].eq(0).all() and out["advantages"].eq(0).all()
    close(vgpo([[0.5, 1.0]], "std_free")["advantages"], [[1.5 / 1.25 * 0.5 * 1.5, 1.0 / 1.25 * 0.5 * 1.0]])
    assert vgpo([[0.5, 1.0]], std_unbiased=True)["std"].eq(0).all()  # no NaN from G - 1 = 0


def test_one_step_is_grpo_plus_the_absolute_term():
    out = vgpo([[1.0], [0.0], [0.5]], alpha_steps=1)
    close(out["omega"], [[1.0], [1.0], [1.0]])  # Q / mean Q over one step; the zero trajectory gets 1
    std = (1 / 6) ** 0.5
    close(out["advantages"], [[(0.5 + 0.5 * std * 1.0) / (std + 1e-4)], [-0.5 / (std + 1e-4)],
                              [0.5 * std * 0.5 / (std + 1e-4)]])
    close(vgpo([[1.0], [0.0], [0.5]], alpha_steps=0)["advantages"], [[0.5 / (std + 1e-4)], [-0.5 / (std + 1e-4)],
                                                                     [0.0]])


def test_a_converged_group_keeps_a_signal_only_where_the_values_differ_or_without_the_std():
    # every trajectory ends at 1 (a solved prompt: Flow-GRPO's advantage is 0) ...
    paths = [[0.2, 0.9, 1.0], [0.6, 0.9, 1.0], [0.4, 0.9, 1.0]]
    out = vgpo(paths)
    assert out["advantages"][:, 1:].eq(0).all()  # ... the later values agree: nothing there
    assert out["advantages"][:, 0].ne(0).all()  # the first step's values differ: a relative signal
    assert vgpo(paths, "std_free")["advantages"][:, :2].ne(0).all()  # the absolute term on the first two steps
    # a group converged on every step: only the std-free variant has a signal
    solved = [[0.9, 0.9, 1.0]] * 4
    assert vgpo(solved)["advantages"].eq(0).all()
    assert vgpo(solved, "std_free")["advantages"][:, :2].gt(0).all()


def test_a_trajectory_of_zero_rewards_is_weighted_uniformly():
    out = vgpo([[0.0, 0.0], [0.5, 1.0]])
    close(out["omega"][0], [1.0, 1.0])
    assert torch.isfinite(out["advantages"]).all() and out["advantages"][0].lt(0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(rewards=[[0.5, -0.1]]), "instant_rewards must be >= 0"),
    (dict(rewards=[[0.5, float("nan")]]), "instant_rewards must be finite"),
    (dict(rewards=[0.5, 1.0]), r"must be \[G, T\]"),
    (dict(gamma=1.5), "gamma must be in"),
    (dict(k=-1.0), "k must be >= 0"),
    (dict(alpha_steps=-1), "alpha_steps must be an integer"),
    (dict(eps=0.0), "eps must be > 0"),
    (dict(variant="paper"), "variant must be one of"),
])
def test_bad_input_to_the_pure_function_is_named(bad, match):
    rewards = bad.pop("rewards", R)
    with pytest.raises(ValueError, match=match):
        vgpo(rewards, **bad)


@pytest.mark.parametrize("override, key", [
    ("reward.rewards=[{name: imagereward}]", "reward.rewards[0].name"),
    ("reward.rewards=[{name: toy_geneval}, {name: jpeg_compressibility}]", "reward.rewards[1].name"),
    ("reward.rewards=[{name: brightness, weight: -1.0}]", "reward.rewards[0].weight"),
    ("credit.gamma=1.5", "credit.gamma"),
    ("credit.eps=0", "credit.eps"),
    ("credit.variant=paper", "credit.variant"),
    ("reward.combine=normalize_then_sum", "reward.combine"),
])
def test_rewards_that_can_go_negative_and_bad_settings_are_refused_when_the_config_loads(override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")) as error:
        load_config(TrainConfig, PRESET, [override])
    assert error.value.key == key
    if "name" in key:
        assert "bounded below by 0" in str(error.value)


def test_instant_rewards_come_from_the_rollout_at_no_nfe_and_equal_a_recomputed_pass(tiny_paths, tmp_path):
    """x0_pass = rollout keeps x0_hat of the rollout's own passes: the same instant rewards as evaluating the velocity
    again (recompute), for 0 NFEs instead of T - 1 per sample; a negative one met at first use is an error."""
    from flowalign.training.scoring import score_iteration
    from flowalign.training.trainer import Trainer
    from test_presets import small_run

    rewards, nfes = {}, {}
    for x0_pass in ("rollout", "recompute"):
        config = load_config(TrainConfig, PRESET, small_run(tiny_paths["sd3"], tmp_path / x0_pass, **{
            "credit.x0_pass": x0_pass, "sampling.batch_size": 4}))
        trainer = Trainer(config)
        batches = trainer.rollout(0, trainer.prompts.prompts_for(0))
        assert ("x0_hat" in batches[0].extras) == (x0_pass == "rollout")
        (share,) = score_iteration(trainer, batches).slices(batches)
        context = trainer.credit_context(0, [0, 1, 2])
        rewards[x0_pass], nfes[x0_pass] = trainer.parts.credit.instant_rewards(batches[0], share, context)
        credit = trainer.parts.credit.assign(batches[0], share, context)
        assert credit.nfe == nfes[x0_pass] and credit.stats["vgpo/decodes"] == 4 * 9
        assert credit.weights.sum() == 4 * 3  # the trained steps 0..2 of 4 trajectories
    assert nfes == {"rollout": 0, "recompute": 4 * 9}
    assert rewards["rollout"].shape == (4, 10) and torch.isfinite(rewards["rollout"]).all()
    assert torch.allclose(rewards["rollout"], rewards["recompute"], atol=1e-6, rtol=0)
    assert rewards["rollout"].std() > 0
    negative = dataclasses.replace(context, state_reward=lambda images, metadata, groups: -torch.ones(len(images),
                                                                                                    dtype=torch.float64))
    with pytest.raises(ValueError, match=r"credit.name = 'vgpo' needs rewards >= 0.*reward.rewards \(brightness\)"):
        trainer.parts.credit.instant_rewards(batches[0], share, negative)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from test_presets import words

    root = tmp_path_factory.mktemp("tiny")
    tiny_sd3_pipeline(words(), seed=0).save_pretrained(root / "sd3")
    return {"sd3": root / "sd3"}


def test_a_registered_reward_that_declares_negative_scores_is_refused(tmp_path):
    """The refusal reads what a reward declares (``negative_scores`` on its factory or class), so a user's reward
    joins the check by saying so; nothing is built."""
    from flowalign.rewards import REWARDS, negative_scores_reason, register_reward

    class Centred:
        name = "centred_brightness"
        negative_scores = "brightness minus one half"

        def __call__(self, images, prompts, metadata):
            return images.mean(dim=(1, 2, 3)) - 0.5

    assert negative_scores_reason("imagereward") and negative_scores_reason("jpeg_compressibility")
    assert negative_scores_reason("jpeg_incompressibility") is None and negative_scores_reason("pickscore") is None
    register_reward("centred_brightness", Centred)
    try:
        with pytest.raises(ConfigError, match=r"'centred_brightness' can score below 0 \(brightness minus one half\)"):
            load_config(TrainConfig, PRESET, ["reward.rewards=[{name: centred_brightness}]"])
    finally:
        REWARDS.unregister("centred_brightness")
