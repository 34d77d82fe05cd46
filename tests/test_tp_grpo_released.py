"""TP-GRPO as its released code runs (flowalign.credit.tp_grpo.tp_grpo_process_rewards), against hand-computed cases,
and the turning_point estimator's released semantics, settings and window mapping."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.credit.step_credit import TurningPointConfig, TurningPointCredit
from flowalign.credit.step_rewards import turning_point_rewards
from flowalign.credit.tp_grpo import RELEASED_OPTIONS, tp_grpo_process_rewards
from flowalign.training.config import TrainConfig

# R_0 .. R_4 (R_4 = R_sde, as the released code reuses the final image for R_n), as in tests/test_step_rewards.py.
UP = [0.0, 0.3, 0.1, 0.4, 0.6]  # D = +0.6, d = [0.3, -0.2, 0.3, 0.2], s = [+, -, +, +]
DOWN = [0.5, 0.6, 0.2, 0.3, 0.1]  # D = -0.4, d = [0.1, -0.4, 0.1, -0.2], s = [-, +, -, +]
BIG_UP = [0.0, 0.5, 0.4, 0.9, 1.0]  # D = +1.0, d = [0.5, -0.1, 0.5, 0.1], s = [+, -, +, +]


def run(trajectories, prompts=None, **options):
    r = torch.tensor(trajectories, dtype=torch.float64)
    prompts = prompts if prompts is not None else [str(i) for i in range(len(trajectories))]
    return tp_grpo_process_rewards(r[:, -1], r[:, 0], r[:, 1:], prompts, **options)


def close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))


def test_released_defaults_are_the_op3_configurations():
    assert RELEASED_OPTIONS == {
        "take_delta_global_as_main": True, "use_delta_global": True, "use_sde_minus_rt": False, "eta": 1.0,
        "apply_first_step_bonus": True, "select_first_step_only_from_consistent_trajectory": False,
        "select_only_positive_intermediate_step": False, "select_inter_step_only_from_consistent_trajectory": False,
        "indicator_wo_delta_global_constraint": False, "use_balanced_bonus": False,
        "drop_original_reward_when_having_bonus": False, "propagate_bonus_to_future_steps": False,
        "turn_on_bonus_global_step": 0}


def test_every_step_gets_the_global_gain_and_turning_points_add_their_local_gain():
    out = run([UP, DOWN, BIG_UP])
    close(out["delta_global"], [0.6, -0.4, 1.0])
    close(out["d"][0], [0.3, -0.2, 0.3, 0.2])
    assert out["s"].tolist() == [[1, -1, 1, 1], [-1, 1, -1, 1], [1, -1, 1, 1]]
    # I_1 = [s_1 > 0]; I_i = [s_{i-1} < 0 and s_i > 0]; no consistency filter, so DOWN's last step counts
    assert out["indicators"].tolist() == [[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 1, 0]]
    close(out["main"], [[0.6] * 4, [-0.4] * 4, [1.0] * 4])
    close(out["process_rewards"], [[0.9, 0.6, 0.9, 0.6], [-0.4, -0.8, -0.4, -0.6], [1.5, 1.0, 1.5, 1.0]])
    close(run([UP], eta=2.0)["process_rewards"], [[1.2, 0.6, 1.2, 0.6]])
    close(run([UP], use_delta_global=False)["process_rewards"], [[0.9, 0.6, 0.9, 0.6]])  # R_sde = 0.6 = D here


def test_selection_flags():
    close(run([DOWN], select_inter_step_only_from_consistent_trajectory=True)["indicators"], [[0, 1, 0, 0]])
    close(run([UP, DOWN], select_only_positive_intermediate_step=True)["indicators"], [[1, 0, 1, 0], [0, 0, 0, 0]])
    close(run([UP], apply_first_step_bonus=False)["indicators"], [[0, 0, 1, 0]])
    # first step from consistent trajectories: sign(d_1) sign(R_sde - R_1) = (+)(+) for UP, (+)(-) for DOWN
    close(run([UP, DOWN], select_first_step_only_from_consistent_trajectory=True)["indicators"][:, 0], [1, 0])
    # without the global constraint any sign change of d: UP's d = [+, -, +, +] flips at steps 2 and 3
    close(run([UP], indicator_wo_delta_global_constraint=True)["indicators"], [[1, 1, 1, 0]])


def test_paper_style_add_and_replace():
    # take_delta_global_as_main false: main d_i; use_sde_minus_rt: bonus R_sde - R_{i-1} = [0.6, 0.3, 0.5, 0.2]
    add = run([UP], take_delta_global_as_main=False, use_sde_minus_rt=True)
    close(add["process_rewards"], [[0.9, -0.2, 0.8, 0.2]])
    close(run([UP], take_delta_global_as_main=False)["process_rewards"], [[0.9, -0.2, 0.9, 0.2]])  # bonus D = 0.6
    replace = run([UP], take_delta_global_as_main=False, use_sde_minus_rt=True,
                  drop_original_reward_when_having_bonus=True)
    close(replace["process_rewards"], [[0.6, -0.2, 0.5, 0.2]])


def test_drop_original_keeps_only_the_bonus_at_turning_points():
    close(run([UP], drop_original_reward_when_having_bonus=True)["process_rewards"], [[0.3, 0.6, 0.3, 0.6]])


def test_paper_style_replace_with_both_filters_is_flowalign_paper_reading():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(64, 7, generator=generator, dtype=torch.float64).cumsum(dim=1)
    rewards[:8] = (rewards[:8] > 0).double()  # binary rewards: ties and zero signs
    out = tp_grpo_process_rewards(rewards[:, -1], rewards[:, 0], rewards[:, 1:], ["p"] * 64,
                                  take_delta_global_as_main=False, use_sde_minus_rt=True,
                                  drop_original_reward_when_having_bonus=True,
                                  select_first_step_only_from_consistent_trajectory=True,
                                  select_inter_step_only_from_consistent_trajectory=True)
    values, turning = turning_point_rewards(rewards)
    assert torch.equal(out["indicators"] > 0, turning)
    close(out["process_rewards"], values)


def test_balanced_bonus_keeps_the_largest_local_gains_of_the_commoner_sign():
    out = run([UP, DOWN, BIG_UP], use_balanced_bonus=True)
    # turning points with V = d: UP 0.3, 0.3; DOWN -0.4, -0.2; BIG_UP 0.5, 0.5 -> keep 2 of each sign: BIG_UP's
    assert out["indicators"].tolist() == [[0, 0, 0, 0], [0, 1, 0, 1], [1, 0, 1, 0]]
    close(out["process_rewards"][0], [0.6] * 4)
    # one pool per label: UP and BIG_UP only positive, DOWN only negative -> nothing dropped
    pooled = tp_grpo_process_rewards(*_split([UP, DOWN, BIG_UP]), ["a", "b", "a"], use_balanced_bonus=True,
                                     pools=torch.tensor([0, 1, 0]))
    assert pooled["indicators"].sum() == 6
    # ranked by D when the global gain is the bonus: DOWN's D = -0.4 against UP's 0.6 and BIG_UP's 1.0
    by_delta = run([UP, DOWN, BIG_UP], use_balanced_bonus=True, take_delta_global_as_main=False)
    assert by_delta["indicators"].tolist() == [[0, 0, 0, 0], [0, 1, 0, 1], [1, 0, 1, 0]]


def _split(trajectories):
    r = torch.tensor(trajectories, dtype=torch.float64)
    return r[:, -1], r[:, 0], r[:, 1:]


def test_propagation_spreads_the_gain_to_go_after_positive_and_before_negative_turning_points():
    out = run([UP, DOWN], propagate_bonus_to_future_steps=True)
    # UP: g = R_sde - R_{i-1} = [0.6, 0.3, 0.5, 0.2], turning points 1 and 3 (positive sweep): c = 1, 1, 2, 2
    # DOWN: g = [-0.4, -0.5, -0.1, -0.2], turning points 4 and 2 (negative sweep from the end): c = 2, 2, 1, 1
    close(out["bonus"], [[0.6, 0.3, 1.0, 0.4], [-0.8, -1.0, -0.1, -0.2]])
    close(out["process_rewards"], [[1.2, 0.9, 1.6, 1.0], [-1.2, -1.4, -0.5, -0.6]])
    assert out["indicators"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_no_bonus_before_the_turn_on_step():
    before = run([UP, DOWN], global_step=4, turn_on_bonus_global_step=5, use_balanced_bonus=True,
                 propagate_bonus_to_future_steps=True)
    assert not before["indicators"].any()
    close(before["process_rewards"], [[0.6] * 4, [-0.4] * 4])
    close(run([UP], global_step=5, turn_on_bonus_global_step=5)["process_rewards"], [[0.9, 0.6, 0.9, 0.6]])


def test_degenerate_trajectories():
    # no turning point: s = [-, 0, +, +] (a zero sign is neither < 0 nor > 0)
    none = run([[0.0, -0.1, -0.1, 0.3, 0.4]])
    assert not none["indicators"].any()
    close(none["process_rewards"], [[0.4] * 4])
    # all rewards equal: every gain is 0, and so is every advantage
    flat = run([[0.3] * 5, [0.3] * 5], prompts=["a", "a"])
    close(flat["process_rewards"], torch.zeros(2, 4))
    close(flat["advantages"], torch.zeros(2, 4))
    # binary rewards with ties: d = [0, 1, 0, 0] -> s_1 = 0, no turning point
    close(run([[0.0, 0.0, 1.0, 1.0, 1.0]])["process_rewards"], [[1.0] * 4])


def test_advantages_per_timestep_and_prompt_with_population_std():
    out = run([UP, BIG_UP, DOWN, [0.5, 0.6, 0.2, 0.3, 0.3]], prompts=["a", "a", "b", "b"])
    # prompt a, column 0: P = [0.9, 1.5] -> mean 1.2, population std 0.3
    close(out["advantages"][:2, 0], [-0.3 / 0.3001, 0.3 / 0.3001])
    close(out["advantages"][:2, 1], [-0.2 / 0.2001, 0.2 / 0.2001])  # P = [0.6, 1.0]
    column = out["process_rewards"][:, 0]
    whole = run([UP, BIG_UP, DOWN, [0.5, 0.6, 0.2, 0.3, 0.3]], prompts=["a", "a", "b", "b"], global_std=True)
    close(whole["advantages"][:2, 0], torch.tensor([-0.3, 0.3]) / (column.std(unbiased=False) + 1e-4))
    pooled = run([UP, BIG_UP, DOWN, [0.5, 0.6, 0.2, 0.3, 0.3]], prompts=["a", "a", "b", "b"],
                 per_prompt_stat_tracking=False)
    close(pooled["advantages"][:, 0], (column - column.mean()) / (column.std(unbiased=False) + 1e-4))


def test_unknown_options_and_bad_input_are_named():
    with pytest.raises(TypeError, match=r"'take_delta_global'.*take_delta_global_as_main"):
        run([UP], take_delta_global=True)
    with pytest.raises(ValueError, match="eta must be a finite number"):
        run([UP], eta=math.nan)
    with pytest.raises(ValueError, match="use_balanced_bonus must be true or false"):
        run([UP], use_balanced_bonus=1)
    with pytest.raises(ValueError, match="intermediate_rewards must be"):
        tp_grpo_process_rewards([0.6], [0.0], [0.3, 0.1], ["a"])
    with pytest.raises(ValueError, match="prompts must have one entry per trajectory"):
        tp_grpo_process_rewards([0.6, 0.1], [0.0, 0.5], [[0.3], [0.2]], ["a"])


# ------------------------------------------------------------------------------------------------ the estimator
def test_every_released_option_is_a_credit_setting_of_the_same_name_and_default():
    defaults = TurningPointConfig()
    assert defaults.process_rewards == "released_code"
    assert {key: getattr(defaults, key) for key in RELEASED_OPTIONS} == RELEASED_OPTIONS
    released = {"take_delta_global_as_main": False, "use_delta_global": False, "use_sde_minus_rt": True, "eta": 0.5,
                "apply_first_step_bonus": False, "select_first_step_only_from_consistent_trajectory": True,
                "select_only_positive_intermediate_step": True,
                "select_inter_step_only_from_consistent_trajectory": True,
                "indicator_wo_delta_global_constraint": True, "use_balanced_bonus": True,
                "drop_original_reward_when_having_bonus": True, "propagate_bonus_to_future_steps": True,
                "turn_on_bonus_global_step": 3}
    assert set(released) == set(RELEASED_OPTIONS)
    config = load_config(TrainConfig, None, ["credit.name=turning_point"] + [
        f"credit.{k}={str(v).lower()}" for k, v in released.items()])
    assert {key: getattr(config.credit, key) for key in RELEASED_OPTIONS} == released


@pytest.mark.parametrize("overrides, key", [
    (["credit.balanced=true"], "credit.balanced"),
    (["credit.process_rewards=paper", "credit.use_balanced_bonus=true"], "credit.use_balanced_bonus"),
    (["credit.eta=.inf"], "credit.eta"),
    (["credit.turn_on_bonus_global_step=-1"], "credit.turn_on_bonus_global_step"),
])
def test_settings_of_the_other_semantics_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TrainConfig, None, ["credit.name=turning_point", *overrides])


def test_the_estimator_maps_the_sde_window_to_the_released_columns():
    # T = 5 steps, SDE window = transitions 1..3 (x_1 -> x_4), the last step ODE; R_0 is R(x_1), R_3 is R_T.
    rewards = torch.tensor([[9.0, 0.0, 0.3, 0.1, 7.0, 0.6], [9.0, 0.5, 0.6, 0.2, 7.0, 0.1]], dtype=torch.float64)
    credit = TurningPointCredit(TurningPointConfig())
    batch = SimpleNamespace(sample_ids=torch.tensor([0, 1]))
    context = SimpleNamespace(iteration=0, config=SimpleNamespace(data=SimpleNamespace(group_size=2)))
    values = credit.released_values(rewards, 1, 4, batch, context)
    expected = run([[0.0, 0.3, 0.1, 0.6], [0.5, 0.6, 0.2, 0.1]])["process_rewards"]
    assert torch.isnan(values[:, [0, 4]]).all()
    close(values[:, 1:4], expected)
    rewards[1, 2] = math.nan  # an invalid reward: that trajectory gets no step reward, the other keeps its own
    values = credit.released_values(rewards, 1, 4, batch, context)
    assert torch.isnan(values[1]).all()
    close(values[0, 1:4], expected[0])


RELEASED_CASES = json.loads((Path(__file__).parent / "data" / "tp_grpo_released_cases.json").read_text())


# Recorded floats: .ci/run runs these under a second CPU capability. Measured on an AMD EPYC (AVX512) under
# ATEN_CPU_CAPABILITY=default, avx2 and avx512: the largest deviation was 10.3% of the tolerance (9.6e-6 relative),
# the same under every capability.
@pytest.mark.float_sensitive
@pytest.mark.parametrize("case", sorted(RELEASED_CASES["cases"]))
def test_process_rewards_and_advantages_match_the_released_code(case):
    """Expected values from running the released code itself on these inputs: the "Process Reward Computation" block
    of YunzeTong/TurningPoint-GRPO ``scripts/my_train_sd3_fast_with_op3.py`` (float32, one call per per-process
    sampling batch of 6) and ``flow_grpo/stat_tracking.py::PerPromptStatTracker.update`` per window step. Two
    random-walk reward sets and a binary one with ties, under the op3 default, the paper-style add, replace and
    propagation, balancing (op3 and paper-style), the consistency filters, no global constraint, positive-only,
    drop-main, propagation and the bonus off before its turn-on step (recipe in the file)."""
    spec = RELEASED_CASES["cases"][case]
    rewards = torch.tensor(RELEASED_CASES["sets"][spec["set"]], dtype=torch.float32).double()  # float32 inputs
    pools = torch.arange(rewards.shape[0]) // RELEASED_CASES["pool_size"]
    out = tp_grpo_process_rewards(rewards[:, -1], rewards[:, 0], rewards[:, 1:], RELEASED_CASES["prompts"],
                                  global_step=spec["global_step"], pools=pools, **spec["options"])
    # the released code computes the process rewards in float32; flowalign in float64
    torch.testing.assert_close(out["process_rewards"], torch.tensor(spec["process_rewards"], dtype=torch.float64),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(out["advantages"], torch.tensor(spec["advantages"], dtype=torch.float64),
                               rtol=0, atol=1e-5)
