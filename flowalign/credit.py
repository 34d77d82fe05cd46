"""Credit assignment on rollout trees (BranchGRPO).

Reference: Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion Models"
(arXiv:2509.06040), and DESIGN.md §4. A tree of denoising trajectories shares its prefixes: node ``i`` is a latent
state, the edge into it is the transition ``x_parent -> x_i``, and the leaves are finished images with rewards.

Reward fusion (bottom up):

* ``"mean"``: a node's reward is the mean of the rewards of the leaves below it (a leaf keeps its own).
* ``"prob_weighted"``: ``r(n) = sum_c softmax_c(log p(edge into c)) r(c)`` over the children ``c`` of ``n``: the
  children a node actually tends to produce weigh more (BranchGRPO's path-probability fusion).

Depth-wise advantages: within one tree, the nodes at the same depth are normalised together,

    A_i = (r_i - mean_d) / (std_d + 1e-8),        std_d unbiased (ddof 1),

and ``A_i = 0`` where depth ``d`` holds a single node or ``std_d < 1e-6``. The root (depth 0, alone) gets 0. The edge
into node ``i`` is trained with ``A_i``.

Trees are given as parent lists: ``parents[i]`` is the index of node ``i``'s parent or ``None`` for a root. Several
roots make a forest; normalisation never mixes trees. Leaves are the nodes without children, in index order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .advantages import ZERO_STD

__all__ = ["FUSIONS", "Tree", "tree_advantages"]

FUSIONS = ("mean", "prob_weighted")

_EPS = 1e-8

class Tree:
    """The structure of a forest given by a parent list, checked: depths, roots, children, leaves."""

    def __init__(self, parents: Sequence[int | None]):
        parents = list(parents)
        n = len(parents)
        if n == 0:
            raise ValueError("parents is empty: a tree needs at least a root")
        for i, p in enumerate(parents):
            if p is None:
                continue
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < n:
                raise ValueError(f"parents[{i}] = {p!r} is not None or a node index in [0, {n})")
            if p == i:
                raise ValueError(f"parents[{i}] = {i}: a node cannot be its own parent")
        self.parents = parents
        self.children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(parents):
            if p is not None:
                self.children[p].append(i)
        self.depth = [-1] * n
        self.root = [-1] * n
        self.order: list[int] = []  # parents before children
        for start in (i for i, p in enumerate(parents) if p is None):
            self.depth[start], self.root[start] = 0, start
            stack = [start]
            while stack:
                node = stack.pop()
                self.order.append(node)
                for child in self.children[node]:
                    self.depth[child], self.root[child] = self.depth[node] + 1, start
                    stack.append(child)
        unreached = [i for i in range(n) if self.depth[i] < 0]
        if unreached:
            raise ValueError(f"nodes {unreached[:8]} are not below any root: parents has a cycle")
        self.leaves = [i for i in range(n) if not self.children[i]]

    def __len__(self) -> int:
        return len(self.parents)

def _fuse(tree: Tree, leaf_rewards: Tensor, fusion: str, edge_log_probs: Tensor | None) -> Tensor:
    """Node rewards, leaves up: mean of the leaves below, or the softmax(edge log-prob) average of the children."""
    if fusion == "mean":
        total = torch.zeros(len(tree), dtype=torch.float64)
        count = torch.zeros(len(tree), dtype=torch.float64)
        total[tree.leaves] = leaf_rewards
        count[tree.leaves] = 1.0
        for node in reversed(tree.order):
            parent = tree.parents[node]
            if parent is not None:
                total[parent] += total[node]
                count[parent] += count[node]
        return total / count
    rewards = torch.zeros(len(tree), dtype=torch.float64)
    rewards[tree.leaves] = leaf_rewards
    for node in reversed(tree.order):
        children = tree.children[node]
        if children:
            weights = torch.softmax(edge_log_probs[children], dim=0)
            rewards[node] = (weights * rewards[children]).sum()
    return rewards

def tree_advantages(
    parents: Sequence[int | None],
    leaf_rewards: Tensor | Sequence[float],
    *,
    fusion: str = "mean",
    edge_log_probs: Tensor | Sequence[float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-node rewards and depth-wise advantages ``([N], [N])`` float64 of a tree (see the module docstring).

    ``leaf_rewards[k]`` is the reward of the k-th leaf in index order. ``edge_log_probs[i]`` is the log-prob of the
    transition into node ``i`` (a root's entry is ignored); it is required for ``fusion="prob_weighted"``.
    """
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    tree = Tree(parents)
    leaf_rewards = torch.as_tensor(leaf_rewards, dtype=torch.float64).flatten()
    if leaf_rewards.numel() != len(tree.leaves):
        raise ValueError(f"the tree has {len(tree.leaves)} leaves but {leaf_rewards.numel()} leaf rewards were given")
    if not torch.isfinite(leaf_rewards).all():
        raise ValueError(f"leaf_rewards must be finite, got {leaf_rewards.tolist()}")
    if fusion == "prob_weighted":
        if edge_log_probs is None:
            raise ValueError('fusion="prob_weighted" needs edge_log_probs, one per node')
        edge_log_probs = torch.as_tensor(edge_log_probs, dtype=torch.float64).flatten()
        if edge_log_probs.numel() != len(tree):
            raise ValueError(f"edge_log_probs has {edge_log_probs.numel()} entries for {len(tree)} nodes")
        non_root = torch.tensor([p is not None for p in tree.parents])
        if not torch.isfinite(edge_log_probs[non_root]).all():
            raise ValueError("edge_log_probs must be finite on every non-root node")
    rewards = _fuse(tree, leaf_rewards, fusion, edge_log_probs)
    advantages = torch.zeros(len(tree), dtype=torch.float64)
    levels: dict[tuple[int, int], list[int]] = {}
    for node in range(len(tree)):
        levels.setdefault((tree.root[node], tree.depth[node]), []).append(node)
    for nodes in levels.values():
        if len(nodes) < 2:
            continue
        values = rewards[nodes]
        std = values.std(unbiased=True)
        if std < ZERO_STD:
            continue
        advantages[nodes] = (values - values.mean()) / (std + _EPS)
    return rewards, advantages
