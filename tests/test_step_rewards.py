"""Step rewards from scripted reward sequences: DenseGRPO increments, return to go, TP-GRPO turning points,
DenseGRPO's noise calibration, and the intermediate scorer's completions and cache."""

import math

import pytest
import torch

from flowalign.reward_models.intermediate import IntermediateScorer, completion_sigmas
from flowalign.samplers import rollout
from flowalign.credit.step_rewards import calibrate_noise, dense_increments, return_to_go, turning_point_rewards
from gaussian_flow import gaussian_velocity

# R_0 .. R_4 of scripted trajectories (T = 4 transitions).
UP = [0.0, 0.3, 0.1, 0.4, 0.6]  # global trend +0.6; turning points at t = 0 and t = 2
DOWN = [0.5, 0.6, 0.2, 0.3, 0.1]  # global trend -0.4; turning point at t = 1 (t = 3 ends flat: R_T - R_4 = 0)
BIG_UP = [0.0, 0.5, 0.4, 0.9, 1.0]  # global trend +1.0; turning points at t = 0 and t = 2


def close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))


def test_dense_increments_and_return_to_go():
    rewards = torch.tensor([[0.0, 0.2, 0.5, 0.5], [1.0, 0.5, 0.0, 0.25]])
    close(dense_increments(rewards), [[0.2, 0.3, 0.0], [-0.5, -0.5, 0.25]])
    close(return_to_go(rewards), [[0.5, 0.3, 0.0], [-0.75, -0.25, 0.25]])
    with pytest.raises(ValueError, match=r"\[B, T \+ 1\]"):
        dense_increments(torch.zeros(3))


def test_turning_points_on_an_upward_trajectory():
    values, turning = turning_point_rewards(torch.tensor([UP]))
    assert turning.tolist() == [[True, False, True, False]]
    # turning points get R_T - R_t, the others d_t
    close(values, [[0.6, -0.2, 0.5, 0.2]])


def test_turning_points_on_a_downward_trajectory():
    values, turning = turning_point_rewards(torch.tensor([DOWN]))
    assert turning.tolist() == [[False, True, False, False]]
    close(values, [[0.1, -0.5, 0.1, -0.2]])


def test_flat_and_invalid_trajectories_have_no_turning_points():
    values, turning = turning_point_rewards(torch.tensor([[0.3] * 5, [0.0, math.nan, 0.2, 0.3, 0.4]]))
    assert not turning.any()
    close(values[0], [0.0] * 4)
    assert torch.isnan(values[1]).all()


def test_balanced_turning_points_keep_equal_counts_by_largest_trend():
    rewards = torch.tensor([UP, DOWN, BIG_UP])
    values, turning = turning_point_rewards(rewards, balanced=True)
    # 4 positive turning points (UP twice, BIG_UP twice) and 1 negative (DOWN): keep 1 of each sign, the positive
    # one from the trajectory with the largest |R_T - R_0| (BIG_UP), its earliest step first.
    assert turning.tolist() == [[False] * 4, [False, True, False, False], [True, False, False, False]]
    close(values[0], [0.3, -0.2, 0.3, 0.2])  # UP reverts to its increments
    close(values[2], [1.0, -0.1, 0.5, 0.1])
    # Balancing is per pool: with DOWN alone in its pool nothing is dropped.
    _, separate = turning_point_rewards(rewards, balanced=True, pools=torch.tensor([0, 1, 0]))
    assert separate.sum() == 5


def test_calibration_moves_noise_towards_balanced_signs():
    levels = [0.7, 0.7, 0.7, 0.0]
    increments = torch.tensor([
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 1.0, -1.0, 0.0],
        [-1.0, 1.0, -1.0, 0.0],
        [-1.0, 1.0, math.nan, 0.0],
        [-1.0, 1.0, math.nan, 0.0],
        [-1.0, 1.0, math.nan, 0.0],
    ])
    new = calibrate_noise(levels, increments)
    # step 0: 4 vs 4 -> balanced -> +0.01; step 1: 8 vs 0 -> -0.01; step 2: 3 vs 2 (NaNs ignored) -> +0.01;
    # step 3 is an ODE step (level 0) and is left alone.
    close(new, [0.71, 0.69, 0.71, 0.0])
    with pytest.raises(ValueError, match="one per noise level"):
        calibrate_noise(levels, torch.zeros(8, 3))


# ------------------------------------------------------------------------------------------ intermediate scorer
def test_completion_sigmas_full_and_subsampled():
    sigmas = torch.linspace(1, 0, 11)
    assert torch.equal(completion_sigmas(sigmas, 3, None), sigmas[3:])
    assert torch.equal(completion_sigmas(sigmas, 3, 50), sigmas[3:])
    sub = completion_sigmas(sigmas, 2, 2)
    assert sub.tolist() == pytest.approx([0.8, 0.4, 0.0])


def test_full_ode_completion_equals_the_ode_rollout_and_is_cached():
    sigmas = torch.linspace(1, 0, 7)
    x = torch.randn(4, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    calls = []

    def reward(images, rows):
        calls.append(len(rows))
        return images.mean(dim=(1, 2, 3))

    scorer = IntermediateScorer(gaussian_velocity, lambda z: z, reward, sigmas, estimate="ode")
    scores = scorer.score(x, [2] * 4, torch.arange(4), keys=[("a", i) for i in range(4)])
    expected = rollout(lambda z, s: gaussian_velocity(z, s), x, sigmas[2:], torch.zeros(4)).final.mean(dim=(1, 2, 3))
    close(scores, expected.double())
    assert scorer.nfe == 4 * 4
    again = scorer.score(x, [2] * 4, torch.arange(4), keys=[("a", i) for i in range(4)])
    close(again, scores)
    assert calls == [4] and scorer.nfe == 16  # served from the cache
    scorer.reset()
    assert scorer.nfe == 0 and not scorer.cache


def test_x0_projection_costs_one_evaluation():
    sigmas = torch.linspace(1, 0, 5)
    x = torch.randn(3, 1, 1, 1)
    scorer = IntermediateScorer(gaussian_velocity, lambda z: z, lambda im, rows: im.flatten(), sigmas, estimate="x0")
    scores = scorer.score(x, [1, 1, 4], torch.arange(3), keys=[0, 1, 2])
    s = sigmas[1]
    close(scores[:2], (x[:2] - s * gaussian_velocity(x[:2], s)).flatten().double())
    close(scores[2:], x[2].flatten().double())  # at the end of the schedule the state is its own estimate
    assert scorer.nfe == 2
    with pytest.raises(ValueError, match="estimate"):
        IntermediateScorer(gaussian_velocity, lambda z: z, lambda im, r: im, sigmas, estimate="one_step")


def test_calibration_asks_the_parts_what_it_needs_and_refuses_a_shared_trunk_before_the_model_loads(tmp_path):
    """``flowalign prep calibrate`` names no shape and no SDE kind: the rollout shape declares that it grows independent
    trajectories, the SDE kind its largest noise level (the clamp of the calibrated levels)."""
    import dataclasses

    from flowalign.config import load_config
    from flowalign.errors import SetupError
    from flowalign.kernels.sde_kinds import sde_kind
    from flowalign.kernels.sde_reference import SDE_KINDS, check_noise_level
    from flowalign.prep.calibrate import calibrate
    from flowalign.rollout import SHAPES
    from flowalign.training.config import TrainConfig

    assert {name: SHAPES.get(name).independent_trajectories for name in SHAPES.names()} == {
        "group": True, "probe": False, "tree": False}
    assert {kind: sde_kind(kind).max_noise_level for kind in SDE_KINDS} == {"flow_grpo": None, "dance": None, "cps": 1.0}
    with pytest.raises(ValueError, match=r"noise_level for kind 'cps' must lie in \[0, 1\], got 1\.5"):
        check_noise_level(1.5, "cps")
    check_noise_level(1.5, "flow_grpo")
    config = load_config(TrainConfig, None, [f"model.path={tmp_path / 'no-model'}", f"train.out_dir={tmp_path}"])
    probed = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, name="probe"))
    with pytest.raises(SetupError, match=r"independent trajectories: rollout.name must be a shape that grows them "
                                         r"\('group'\), got 'probe'"):
        calibrate(probed, rounds=1)
    assert list(tmp_path.iterdir()) == []
