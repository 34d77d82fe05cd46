"""Tree rollouts (BranchGRPO): NFE accounting, split-noise log-probs, structure, determinism and marginals."""

import math

import pytest
import torch
from scipy import stats

from flowalign.credit.tree import Tree, tree_advantages
from flowalign.samplers import TreeSchedule, rollout, sde_mean_std, sde_step, tree_rollout

from gaussian_flow import C, M, Counting, gaussian_velocity, levels, sigmas


def test_reference_schedule_costs_203_nfes_against_320_for_independent_trajectories():
    schedule = TreeSchedule(split_steps=(0, 3, 6, 9), branching=2)
    assert schedule.leaves == 16
    assert schedule.nfe(20) == 203
    tree_velocity, chain_velocity = Counting(), Counting()
    result = tree_rollout(tree_velocity, torch.randn(1, 1, 2, 2), sigmas(20), levels(20), schedule)
    assert result.nfe == sum(tree_velocity.batches) == 203
    assert result.final.shape[0] == 16
    independent = rollout(chain_velocity, torch.randn(16, 1, 2, 2), sigmas(20), levels(20))
    assert independent.nfe == sum(chain_velocity.batches) == 320
    # Batched per step: one call per step, with every live node of the tree.
    assert tree_velocity.batches == [1, 2, 2, 2, 4, 4, 4, 8, 8, 8] + [16] * 10


def test_tree_structure_matches_the_schedule():
    schedule = TreeSchedule(split_steps=(0, 2), branching=(3, 2))
    result = tree_rollout(Counting(), torch.randn(2, 1, 2, 2), sigmas(4), levels(4), schedule)
    tree = Tree(result.parents)
    # 2 roots; per tree 3 + 3 + 6 + 6 nodes after steps 0..3.
    assert len(tree) == 2 + 2 * (3 + 3 + 6 + 6)
    assert tree.leaves == result.leaf_nodes.tolist()
    assert [len(tree.children[r]) for r in (0, 1)] == [3, 3]
    t = result.transitions
    assert len(t) == len(tree) - 2
    assert torch.equal(t.src, torch.tensor([result.parents[int(d)] for d in t.dst]))
    # Leaves are tree-major: the first 6 belong to tree 0.
    assert result.tree_of_node[result.leaf_nodes].tolist() == [0] * 6 + [1] * 6
    # Every transition of tree 1 carries its prompt/group; sample_id is the first leaf below the edge.
    assert set(t.group_id[t.sample_id >= 6].tolist()) == {1}
    chain_edges = t.step == 3
    assert torch.equal(t.sample_id[chain_edges], torch.arange(12))


def test_split_edges_are_scored_with_the_std_that_drew_them():
    scale = 4.0
    schedule = TreeSchedule(split_steps=(1,), branching=2, split_noise_scale=scale)
    s = sigmas(5)
    result = tree_rollout(Counting(), torch.randn(3, 2, 3, 3), s, levels(5), schedule,
                          generator=torch.Generator().manual_seed(0))
    t = result.transitions
    split = t.step == 1
    assert torch.all(t.noise_scale[split] == scale) and torch.all(t.noise_scale[~split] == 1.0)
    x, x_next = t.x_t[split], t.x_next[split]
    mean, std = sde_mean_std(x, gaussian_velocity(x, s[1]), s[1], s[2], kind="flow_grpo", noise_level=0.7)
    expected = torch.distributions.Normal(mean, scale * std).log_prob(x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(t.log_prob[split], expected)
    torch.testing.assert_close(t.std[split], scale * std.reshape(-1))
    # The training-time recomputation with the recorded noise_scale gives ratio exactly 1 ...
    again = sde_step(x, gaussian_velocity(x, s[1]), s[1], s[2], kind="flow_grpo", noise_level=0.7,
                     prev_sample=x_next, noise_scale=t.noise_scale[split])
    assert torch.equal(again.log_prob, t.log_prob[split])
    # ... while the unscaled std (BranchGRPO's public code) scores a different density.
    unscaled = sde_step(x, gaussian_velocity(x, s[1]), s[1], s[2], kind="flow_grpo", noise_level=0.7,
                        prev_sample=x_next)
    assert (unscaled.log_prob - t.log_prob[split]).abs().min() > 0.1


def test_split_children_spread_with_the_scaled_std():
    """Many children of one parent: their empirical std around the parent's mean is c * std."""
    scale = 2.5
    schedule = TreeSchedule(split_steps=(0,), branching=4000, split_noise_scale=scale)
    s = torch.tensor([0.8, 0.5])
    result = tree_rollout(Counting(), torch.full((1, 1, 1, 1), 0.3), s, torch.tensor([0.7]), schedule,
                          generator=torch.Generator().manual_seed(1))
    mean, std = sde_mean_std(torch.full((1, 1, 1, 1), 0.3), gaussian_velocity(torch.tensor(0.3), 0.8), 0.8, 0.5,
                             kind="flow_grpo", noise_level=0.7)
    z = ((result.final.flatten() - mean.flatten()) / (scale * std.flatten())).double().numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3


def test_unscaled_tree_leaves_keep_the_flow_marginal():
    """With split_noise_scale 1 every root-to-leaf path is an ordinary SDE path: leaves ~ N(M, C^2)."""
    schedule = TreeSchedule(split_steps=(0, 10, 20, 30), branching=2)
    result = tree_rollout(gaussian_velocity, torch.randn(2000, 1, 1, 1, generator=torch.Generator().manual_seed(2)),
                          sigmas(50), levels(50), schedule, generator=torch.Generator().manual_seed(3))
    leaves = result.final.flatten().double()
    assert abs(leaves.mean().item() - M) < 0.02
    assert abs(leaves.std().item() - C) < 0.02


def test_a_tree_does_not_depend_on_the_other_trees_in_its_batch():
    schedule = TreeSchedule(split_steps=(0, 2), branching=2)
    roots = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(4))
    gens = lambda keys: [torch.Generator().manual_seed(100 + k) for k in keys]  # noqa: E731
    together = tree_rollout(Counting(), roots, sigmas(4), levels(4), schedule, generator=gens([0, 1, 2]))
    alone = tree_rollout(Counting(), roots[1:2], sigmas(4), levels(4), schedule, generator=gens([1]))
    assert torch.equal(together.final[4:8], alone.final)


def test_velocity_sees_each_nodes_tree():
    seen = []

    def velocity(x, s, tree):
        seen.append(tree.tolist())
        return torch.zeros_like(x)

    tree_rollout(velocity, torch.zeros(2, 1, 1, 1), sigmas(3), levels(3), TreeSchedule((0, 1), 2))
    assert seen == [[0, 1], [0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]]


def test_tree_advantages_run_on_a_rollout_tree():
    schedule = TreeSchedule(split_steps=(0, 1), branching=2)
    result = tree_rollout(Counting(), torch.randn(2, 1, 1, 1), sigmas(3), levels(3), schedule)
    rewards, advantages = tree_advantages(result.parents, torch.arange(8.0))
    # Depth 1 of tree 0 holds the two halves of leaves {0,1} and {2,3}: means 0.5 and 2.5, unbiased std sqrt(2).
    first_children = [i for i, p in enumerate(result.parents) if p == 0]
    torch.testing.assert_close(rewards[first_children], torch.tensor([0.5, 2.5], dtype=torch.float64))
    expected = torch.tensor([-1.0, 1.0], dtype=torch.float64) / (math.sqrt(2) + 1e-8)
    torch.testing.assert_close(advantages[first_children], expected)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(split_steps=()), "empty"),
        (dict(split_steps=(3, 3)), "strictly increasing"),
        (dict(split_steps=(4, 1)), "strictly increasing"),
        (dict(split_steps=(-1, 2)), "non-negative"),
        (dict(split_steps=(0, 1), branching=0), ">= 1"),
        (dict(split_steps=(0, 1), branching=(2,)), "one per split"),
        (dict(split_steps=(0,), split_noise_scale=0.0), "positive"),
    ],
)
def test_bad_tree_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TreeSchedule(**kwargs)


def test_split_steps_must_be_inside_the_rollout_and_stochastic():
    with pytest.raises(ValueError, match="reach past the last step"):
        TreeSchedule((0, 5)).nfe(5)
    with pytest.raises(ValueError, match="ODE steps"):
        tree_rollout(Counting(), torch.zeros(1, 1, 1, 1), sigmas(4), levels(4), TreeSchedule((0, 3)))


def test_a_velocity_of_the_wrong_shape_is_refused_even_on_an_ode_step():
    """On the last (ODE) step a one-row velocity would broadcast over every node silently."""

    def one_row_late(x, s, tree):
        return gaussian_velocity(x if float(s) > 0.3 else x[:1], s)

    with pytest.raises(ValueError, match=r"velocity returned shape \(1, 1, 2, 2\) at step 3 for 4 live nodes"):
        tree_rollout(one_row_late, torch.randn(2, 1, 2, 2), sigmas(4), levels(4), TreeSchedule((0,)))


def test_a_schedule_whose_leaves_disagree_with_its_factors_is_an_error():
    class Inconsistent(TreeSchedule):
        @property
        def leaves(self) -> int:
            return 3

    with pytest.raises(RuntimeError, match=r"grew 4 leaves for 2 trees, but .* promises 3 per tree"):
        tree_rollout(Counting(), torch.randn(2, 1, 2, 2), sigmas(4), levels(4), Inconsistent((0,)))
