"""Credit assignment on rollout trees (BranchGRPO).

Reference: Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion Models"
(arXiv:2509.06040), and docs/design/math.md#tree-credit. A tree of denoising trajectories shares its prefixes: node
``i`` is a latent
state, the edge into it is the transition ``x_parent -> x_i``, and the leaves are finished images with rewards.

Reward fusion (bottom up):

* ``"mean"``: a node's reward is the mean of the rewards of the leaves below it (a leaf keeps its own).
* ``"prob_weighted"``: ``r(n) = sum_c softmax_c(log p(edge into c)) r(c)`` over the children ``c`` of ``n``: the
  children a node actually tends to produce weigh more (BranchGRPO's path-probability fusion).

Depth-wise advantages: within one tree, the nodes at the same depth are normalised together,

    A_i = (r_i - mean_d) / (std_d + 1e-8),        std_d unbiased (ddof 1),

and ``A_i = 0`` where depth ``d`` holds a single node or ``std_d < 1e-6``. The root (depth 0, alone) gets 0. The edge
into node ``i`` is trained with ``A_i``.

Pruning (BranchGRPO §3.3) never changes the rollout or the advantages, only which edges get gradients:

* **Width pruning** after the last split: the subtrees born at the last split (a *branch* is the chain from a child of
  the last split down to its leaf) are ranked by the advantage of their first node. ``"top"`` keeps the best
  ``ceil(fraction * b)`` of each parent's ``b`` children; ``"extremes"`` keeps the best and the worst
  ``ceil(fraction * n / 2)`` of a tree's ``n`` branches. Edges above the last split are always kept.
* **Depth pruning** drops the edges produced at chosen steps; ``sliding_prune_steps`` moves that set from high noise
  towards low noise as training progresses.

Trees are given as parent lists: ``parents[i]`` is the index of node ``i``'s parent or ``None`` for a root. Several
roots make a forest; normalisation never mixes trees. Leaves are the nodes without children, in index order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.credit.base import BatchScores, Credit, CreditContext, CreditEstimator, register_credit
from flowalign.advantages import ZERO_STD
from flowalign.settings import at_least, check, finite, option

__all__ = [
    "FUSIONS",
    "WIDTH_PRUNE_MODES",
    "Tree",
    "depth_prune_mask",
    "leaf_mean",
    "sliding_prune_steps",
    "tree_advantages",
    "width_prune_mask",
]

FUSIONS = ("mean", "prob_weighted")
WIDTH_PRUNE_MODES = ("top", "extremes")

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

    def ancestor_at(self, node: int, depth: int) -> int | None:
        """The ancestor of ``node`` at ``depth`` (the node itself at its own depth; None when it is shallower)."""
        if self.depth[node] < depth:
            return None
        while self.depth[node] > depth:
            node = self.parents[node]
        return node


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

def leaf_mean(tree: Tree, leaf_values: Tensor | Sequence[float]) -> Tensor:
    """Per node, the mean of ``leaf_values`` over the leaves below it (float64 ``[N]``)."""
    leaf_values = torch.as_tensor(leaf_values, dtype=torch.float64).flatten()
    if leaf_values.numel() != len(tree.leaves):
        raise ValueError(f"the tree has {len(tree.leaves)} leaves but {leaf_values.numel()} leaf values were given")
    return _fuse(tree, leaf_values, "mean", None)


def tree_advantages(
    parents: Sequence[int | None] | Tree,
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
    tree = parents if isinstance(parents, Tree) else Tree(parents)
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


def width_prune_mask(
    parents: Sequence[int | None] | Tree,
    advantages: Tensor | Sequence[float],
    *,
    split_depth: int,
    mode: str = "top",
    fraction: float = 0.5,
) -> Tensor:
    """Boolean ``[N]``: does the edge *into* node ``i`` keep its gradient (False for roots)?

    ``split_depth`` is the depth of the nodes the last split created (``last split step + 1`` for a rollout tree,
    whose roots have depth 0). See the module docstring for the two modes.
    """
    tree = parents if isinstance(parents, Tree) else Tree(parents)
    if mode not in WIDTH_PRUNE_MODES:
        raise ValueError(f"width pruning mode must be one of {WIDTH_PRUNE_MODES}, got {mode!r}")
    if not 0 < fraction <= 1:
        raise ValueError(f"width pruning fraction must lie in (0, 1], got {fraction!r}")
    if split_depth < 1:
        raise ValueError(f"split_depth must be >= 1 (the depth of the last split's children), got {split_depth}")
    advantages = torch.as_tensor(advantages, dtype=torch.float64).flatten()
    if advantages.numel() != len(tree):
        raise ValueError(f"advantages has {advantages.numel()} entries for {len(tree)} nodes")
    branches = [i for i in range(len(tree)) if tree.depth[i] == split_depth]
    if mode == "top":
        pools: dict[int, list[int]] = {}
        for node in branches:
            pools.setdefault(tree.parents[node], []).append(node)
        quota = {key: math.ceil(fraction * len(pool)) for key, pool in pools.items()}
        kept = {n for key, pool in pools.items() for n in _ranked(pool, advantages)[: quota[key]]}
    else:
        pools = {}
        for node in branches:
            pools.setdefault(tree.root[node], []).append(node)
        kept = set()
        for pool in pools.values():
            ranked = _ranked(pool, advantages)
            half = math.ceil(fraction * len(pool) / 2)
            kept |= set(ranked[:half]) | set(ranked[len(ranked) - half:])
    mask = torch.tensor([p is not None for p in tree.parents])
    for node in range(len(tree)):
        if tree.depth[node] >= split_depth and tree.ancestor_at(node, split_depth) not in kept:
            mask[node] = False
    return mask


def _ranked(nodes: list[int], advantages: Tensor) -> list[int]:
    """``nodes`` by decreasing advantage (ties by index, so the choice is deterministic)."""
    return sorted(nodes, key=lambda n: (-float(advantages[n]), n))


def depth_prune_mask(node_step: Tensor | Sequence[int], drop_steps: Sequence[int]) -> Tensor:
    """Boolean ``[N]``: False for nodes produced at one of ``drop_steps`` (their incoming edge gets no gradient)."""
    node_step = torch.as_tensor(node_step)
    return ~torch.isin(node_step, torch.as_tensor(list(drop_steps), dtype=node_step.dtype))


def sliding_prune_steps(drop_steps: Sequence[int], progress: float, last_step: int) -> list[int]:
    """``drop_steps`` shifted towards ``last_step`` by ``round(progress * (last_step - max(drop_steps)))``.

    At the start of training the given (early, high-noise) steps are dropped; by the end the same-sized set sits at
    the last trained steps.
    """
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"training progress must lie in [0, 1], got {progress!r}")
    drop = sorted(int(s) for s in drop_steps)
    if not drop:
        return []
    shift = round(progress * max(0, last_step - drop[-1]))
    return [s + shift for s in drop]


# ------------------------------------------------------------------------------------------------ the estimator


@dataclass
class TreeCreditConfig(ComponentConfig):
    fusion: Literal["mean", "prob_weighted"] = option(
        "mean", "a node's reward is the mean of its leaves, or the softmax(edge log-prob) mix of its children")
    width_prune: Literal["none", "top", "extremes"] = option(
        "none", "after the last split train only the best children of each parent (top) or the best and worst "
        "branches of each tree (extremes)")
    width_prune_fraction: float = option(0.5, "the fraction of branches width pruning keeps, in (0, 1]")
    depth_prune_steps: list[int] = option([], "steps whose edges get no gradient (depth pruning)")
    depth_prune_sliding: bool = option(
        False, "slide the depth-pruned steps from where they are towards the last trained step over training")

    def validate(self) -> None:
        finite("width_prune_fraction", self.width_prune_fraction, 0.0, strict=True, high=1.0)
        for i, step in enumerate(self.depth_prune_steps):
            at_least(f"depth_prune_steps[{i}]", step, 0)


@register_credit("tree", config=TreeCreditConfig)
class TreeCredit(CreditEstimator):
    """BranchGRPO: an edge gets the depth-wise advantage of the node it leads to; pruning zeroes some edges."""

    shapes = ("tree",)
    whole_prompts = True

    def check(self, config) -> None:
        num_steps = config.sampling.num_steps
        late = [s for s in self.config.depth_prune_steps if s >= num_steps]
        check(not late, "credit.depth_prune_steps", f"{late} are past the last step ({num_steps - 1})")

    def progress_dependent(self) -> list[str]:
        if self.config.depth_prune_steps and self.config.depth_prune_sliding:
            return ["credit.depth_prune_sliding (BranchGRPO's sliding depth pruning)"]
        return []

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        t = batch.rollout.transitions
        device = t.step.device
        advantages, keep = self.node_credit(batch.rollout, scores.combined, scores.valid, context)
        return Credit(advantages.to(device)[t.dst].float(), keep.to(device)[t.dst].float())

    def node_credit(self, result, combined: Tensor, valid: Tensor, context: CreditContext) -> tuple[Tensor, Tensor]:
        """Per-node advantages (clipped) and per-node 'the edge into it is trained' masks of a chunk's trees.

        A leaf with an invalid reward takes its tree's mean valid reward (so it ranks nowhere) and the edges that
        lead only to invalid leaves are not trained; a tree without a valid leaf trains nothing.
        """
        cfg, config = self.config, context.config
        tree = Tree(result.parents)
        leaf_tree = result.tree_of_node[result.leaf_nodes].cpu()
        rewards = combined.double().clone()
        for r in leaf_tree.unique():
            members = leaf_tree == r
            good = members & valid
            rewards[members & ~valid] = rewards[good].mean() if good.any() else 0.0
        edge_log_probs = torch.zeros(len(tree), dtype=torch.float64)
        edge_log_probs[result.transitions.dst.cpu()] = result.transitions.log_prob.double().cpu()
        _, advantages = tree_advantages(tree, rewards, fusion=cfg.fusion, edge_log_probs=edge_log_probs)
        advantages = advantages.clamp(-config.advantage.clip, config.advantage.clip)
        keep = torch.tensor([p is not None for p in tree.parents])
        keep &= leaf_mean(tree, valid.double()) > 0
        if cfg.width_prune != "none":
            keep &= width_prune_mask(tree, advantages, split_depth=config.rollout.split_steps[-1] + 1,
                                     mode=cfg.width_prune, fraction=cfg.width_prune_fraction)
        if cfg.depth_prune_steps:
            drop = cfg.depth_prune_steps
            if cfg.depth_prune_sliding:
                drop = sliding_prune_steps(drop, context.progress, last_step=config.sampling.num_steps - 2)
            keep &= depth_prune_mask(result.node_step.cpu(), drop)
        return advantages, keep
