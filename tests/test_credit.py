"""Tree credit assignment (BranchGRPO) against hand-computed trees."""

from __future__ import annotations

import math

import pytest
import torch

from flowalign.credit.tree import Tree, depth_prune_mask, sliding_prune_steps, tree_advantages, width_prune_mask

# root 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5, 6}: two levels, factor 2, leaves 3..6.
TWO_LEVEL = [None, 0, 0, 1, 1, 2, 2]
R = 1 / math.sqrt(2)  # two distinct values normalised with the unbiased std are always +-1/sqrt(2)


def test_tree_structure():
    tree = Tree(TWO_LEVEL)
    assert tree.leaves == [3, 4, 5, 6]
    assert tree.depth == [0, 1, 1, 2, 2, 2, 2]
    assert tree.children[0] == [1, 2] and tree.children[3] == []


def test_mean_fusion_and_depthwise_advantages_by_hand():
    rewards, advantages = tree_advantages(TWO_LEVEL, [1.0, 0.0, 0.0, 0.0])
    # r1 = mean(1, 0) = 0.5, r2 = 0, r0 = mean of all four leaves = 0.25
    torch.testing.assert_close(rewards, torch.tensor([0.25, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    # depth 2: mean 0.25, unbiased var (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
    expected = torch.tensor([0.0, R, -R, 1.5, -0.5, -0.5, -0.5], dtype=torch.float64)
    torch.testing.assert_close(advantages, expected, atol=1e-7, rtol=0)


def test_prob_weighted_fusion_by_hand():
    log_probs = [0.0, 0.0, math.log(3.0), math.log(3.0), 0.0, -1.0, -1.0]
    rewards, advantages = tree_advantages(TWO_LEVEL, [1.0, 0.0, 0.0, 0.0], fusion="prob_weighted",
                                          edge_log_probs=log_probs)
    # node 1: softmax(log 3, 0) = (0.75, 0.25) -> 0.75; node 2: 0; root: softmax(0, log 3) = (0.25, 0.75) -> 0.1875
    torch.testing.assert_close(rewards, torch.tensor([0.1875, 0.75, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(advantages[1:3], torch.tensor([R, -R], dtype=torch.float64))
    torch.testing.assert_close(advantages[3:], torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64))
    # equal edge log-probs reduce to the mean of the children
    equal, _ = tree_advantages(TWO_LEVEL, [1.0, 0.0, 0.0, 0.0], fusion="prob_weighted", edge_log_probs=[0.0] * 7)
    torch.testing.assert_close(equal, tree_advantages(TWO_LEVEL, [1.0, 0.0, 0.0, 0.0])[0])


def test_mean_fusion_averages_leaves_not_children_on_uneven_trees():
    # root 0 -> {1, 2}; 1 -> {3, 4, 5}; 2 is a leaf. Leaves in index order: 2, 3, 4, 5.
    rewards, _ = tree_advantages([None, 0, 0, 1, 1, 1], [0.0, 1.0, 1.0, 1.0])
    assert rewards[0].item() == pytest.approx(0.75)  # mean of the 4 leaves, not mean(r1=1, r2=0) = 0.5


def test_single_node_depths_and_flat_depths_get_zero():
    _, advantages = tree_advantages(TWO_LEVEL, [0.3, 0.3, 0.3, 0.3])
    assert torch.equal(advantages, torch.zeros(7, dtype=torch.float64))
    _, chain = tree_advantages([None, 0, 1], [1.0])  # one node per depth
    assert torch.equal(chain, torch.zeros(3, dtype=torch.float64))


def test_forest_normalises_each_tree_separately():
    forest = TWO_LEVEL + [p + 7 if p is not None else None for p in TWO_LEVEL]
    _, advantages = tree_advantages(forest, [1.0, 0.0, 0.0, 0.0, 10.0, 10.0, 10.0, 20.0])
    torch.testing.assert_close(advantages[:7], tree_advantages(TWO_LEVEL, [1.0, 0.0, 0.0, 0.0])[1])
    torch.testing.assert_close(advantages[7:], tree_advantages(TWO_LEVEL, [10.0, 10.0, 10.0, 20.0])[1])


@pytest.mark.parametrize(
    "parents, rewards, kwargs, message",
    [
        ([], [], {}, "empty"),
        ([None, 5], [1.0], {}, "parents\\[1\\] = 5"),
        ([None, 1], [1.0], {}, "own parent"),
        ([None, 2, 1], [1.0], {}, "cycle"),
        (TWO_LEVEL, [1.0, 0.0], {}, "4 leaves but 2"),
        (TWO_LEVEL, [1.0, 0.0, float("nan"), 0.0], {}, "finite"),
        (TWO_LEVEL, [1.0, 0.0, 0.0, 0.0], {"fusion": "max"}, "fusion must be one of"),
        (TWO_LEVEL, [1.0, 0.0, 0.0, 0.0], {"fusion": "prob_weighted"}, "needs edge_log_probs"),
        (TWO_LEVEL, [1.0, 0.0, 0.0, 0.0], {"fusion": "prob_weighted", "edge_log_probs": [0.0] * 3}, "3 entries"),
    ],
)
def test_bad_trees_are_refused(parents, rewards, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tree_advantages(parents, rewards, **kwargs)


# ---------------------------------------------------------------------------------------------------- pruning
# root 0 -> 1, 2 (first split); 1 -> 3, 4 and 2 -> 5, 6 (last split, depth 2); chains 3 -> 7, 4 -> 8, 5 -> 9, 6 -> 10.
PRUNE_PARENTS = [None, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
PRUNE_LEAF_REWARDS = [1.0, 4.0, 2.0, 3.0]


def _kept(mask):
    return [i for i, keep in enumerate(mask.tolist()) if keep]


def test_width_pruning_top_keeps_the_best_child_of_each_last_split_parent():
    _, advantages = tree_advantages(PRUNE_PARENTS, PRUNE_LEAF_REWARDS)
    # Depth 2 rewards 1, 4, 2, 3: node 4 beats 3 under parent 1, node 6 beats 5 under parent 2.
    mask = width_prune_mask(PRUNE_PARENTS, advantages, split_depth=2, mode="top", fraction=0.5)
    assert _kept(mask) == [1, 2, 4, 6, 8, 10]


def test_width_pruning_extremes_keeps_the_best_and_worst_branches_of_a_tree():
    _, advantages = tree_advantages(PRUNE_PARENTS, PRUNE_LEAF_REWARDS)
    mask = width_prune_mask(PRUNE_PARENTS, advantages, split_depth=2, mode="extremes", fraction=0.5)
    assert _kept(mask) == [1, 2, 3, 4, 7, 8]  # best (4 -> 8) and worst (3 -> 7)


def test_width_pruning_fraction_one_keeps_every_edge():
    _, advantages = tree_advantages(PRUNE_PARENTS, PRUNE_LEAF_REWARDS)
    for mode in ("top", "extremes"):
        mask = width_prune_mask(PRUNE_PARENTS, advantages, split_depth=2, mode=mode, fraction=1.0)
        assert _kept(mask) == list(range(1, 11))


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="top", fraction=0.0), r"\(0, 1\]"),
    (dict(mode="top", fraction=1.5), r"\(0, 1\]"),
    (dict(mode="best", fraction=0.5), "mode"),
])
def test_width_pruning_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        width_prune_mask(PRUNE_PARENTS, torch.zeros(11), split_depth=2, **kwargs)


def test_depth_pruning_drops_the_chosen_steps_and_slides():
    node_step = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    assert _kept(depth_prune_mask(node_step, [1])) == [0, 1, 2, 5, 6]
    assert sliding_prune_steps([0, 1], 0.0, last_step=8) == [0, 1]
    assert sliding_prune_steps([0, 1], 0.5, last_step=8) == [4, 5]
    assert sliding_prune_steps([0, 1], 1.0, last_step=8) == [7, 8]
