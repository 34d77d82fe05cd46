"""Diffusion tree search (DTS, DTS*): a search tree over denoising steps with soft-value backups.

Reference: Jain et al. 2025, "Diffusion Tree Sampling: Scalable inference-time alignment of diffusion models"
(arXiv:2506.20701), and docs/design/math.md#guided-sampling.

A node at depth ``d`` holds a state ``x_d`` at ``sigmas[d]``; the root is the initial noise, a node at depth ``T`` is
a finished sample (a leaf) whose value is its reward, ``V = r``. An internal node's value is the soft value of its
children,

    V = (1 / lambda) log mean_children exp(lambda V_child),

which tends to the max as ``lambda -> inf`` and to the mean as ``lambda -> 0``. One search iteration:

1. **Select**: from the root, while the node has its maximum number of children, move to a child with probability
   ``∝ exp(lambda V_child)`` (DTS) or to the child of largest value (DTS*), among children that can still grow.
2. **Expand**: draw a new child with one SDE step. A node's velocity is computed once and cached, so siblings share
   it (a new child of a node that was stepped before costs no NFE).
3. **Roll out** the child to depth ``T`` with the SDE sampler; every state on the way becomes a node (one child each),
   so later iterations can branch anywhere along it.
4. **Back up**: the leaf's reward, then the soft values of its ancestors.

An iteration that expands a node at depth ``d`` costs ``T - d - 1`` NFEs (plus 1 if the node's velocity is not cached:
only the root's, on the first iteration). A tree stops when its next iteration would exceed the budget, so a prompt
never spends more than ``budget``. The result is, for DTS*, the leaf with the highest reward found; for DTS, a leaf
drawn by descending from the root with the Boltzmann selection rule (a sample from the reward-tilted distribution
that the tree approximates). All trees of a batch advance in lockstep: one velocity call per depth serves every
prompt whose rollout is at that depth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from .guided import (
    GuidedResult,
    GuidedVelocity,
    LatentReward,
    as_scores,
    check_budget,
    check_candidates,
    check_sampling,
    initial_noise,
    step,
    trajectory_nfe,
)
from .rollout import count_nfe

__all__ = ["SearchTree", "diffusion_tree_search", "soft_value"]


def soft_value(values: Sequence[float] | Tensor, lam: float) -> float:
    """``(1 / lam) log mean exp(lam v)``; the max for ``lam = inf``, the mean for ``lam = 0``."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    if values.numel() == 0:
        raise ValueError("soft_value needs at least one child value")
    if math.isinf(lam):
        return float(values.max())
    if lam == 0:
        return float(values.mean())
    return float((torch.logsumexp(lam * values, dim=0) - math.log(values.numel())) / lam)


@dataclass
class SearchTree:
    """One prompt's search tree. Node ``0`` is the root at depth 0; ``depth == max_depth`` marks a leaf.

    Per node: ``parent``, ``depth``, ``children``, ``value`` (NaN until backed up), ``state`` and the cached
    ``velocity`` (None until computed). ``max_children`` caps the children of every node.
    """

    max_depth: int
    max_children: int
    lam: float
    parent: list = field(default_factory=list)
    depth: list = field(default_factory=list)
    children: list = field(default_factory=list)
    value: list = field(default_factory=list)
    state: list = field(default_factory=list)
    velocity: list = field(default_factory=list)
    closed: list = field(default_factory=list)

    def __post_init__(self):
        if self.max_children < 1:
            raise ValueError(f"max_children must be >= 1, got {self.max_children}")
        if not (self.lam >= 0):
            raise ValueError(f"DTS lambda must be >= 0 (inf for a hard max), got {self.lam!r}")

    def add(self, parent: int | None, state: Tensor | None = None) -> int:
        node = len(self.parent)
        self.parent.append(parent)
        self.depth.append(0 if parent is None else self.depth[parent] + 1)
        self.children.append([])
        self.value.append(math.nan)
        self.state.append(state)
        self.velocity.append(None)
        self.closed.append(False)
        if parent is not None:
            if len(self.children[parent]) >= self.max_children:
                raise ValueError(f"node {parent} already has its {self.max_children} children")
            self.children[parent].append(node)
        return node

    def is_leaf(self, node: int) -> bool:
        return self.depth[node] >= self.max_depth

    def backup(self, leaf: int, reward: float) -> None:
        """Set the leaf's value to ``reward`` and recompute the soft value of every ancestor from its valued children;
        close nodes that can no longer grow (a leaf, or a full node whose children are all closed)."""
        self.value[leaf] = float(reward)
        self.closed[leaf] = True
        node = self.parent[leaf]
        while node is not None:
            valued = [self.value[c] for c in self.children[node] if not math.isnan(self.value[c])]
            self.value[node] = soft_value(valued, self.lam)
            kids = self.children[node]
            self.closed[node] = len(kids) >= self.max_children and all(self.closed[c] for c in kids)
            node = self.parent[node]

    def choose_child(self, node: int, *, greedy: bool, generator: torch.Generator | None = None,
                     open_only: bool = True) -> int | None:
        """A child by ``exp(lam V)`` (or the argmax when ``greedy``); only children that can still grow when
        ``open_only``. None when there is no candidate."""
        kids = [c for c in self.children[node] if not (open_only and self.closed[c]) and not math.isnan(self.value[c])]
        if not kids:
            return None
        values = torch.tensor([self.value[c] for c in kids], dtype=torch.float64)
        if greedy or math.isinf(self.lam):
            return kids[int(values.argmax())]
        weights = torch.softmax(self.lam * values, dim=0)
        return kids[int(torch.multinomial(weights, 1, generator=generator))]

    def select(self, *, greedy: bool, generator: torch.Generator | None = None) -> int | None:
        """The node to expand next (step 1 of the module docstring), or None when the tree is closed."""
        node = 0
        if self.closed[node]:
            return None
        while len(self.children[node]) >= self.max_children:
            node = self.choose_child(node, greedy=greedy, generator=generator)
            if node is None:
                return None
        return node

    def leaves(self) -> list[int]:
        return [n for n in range(len(self.parent)) if self.is_leaf(n)]

    def best_leaf(self) -> int:
        return max(self.leaves(), key=lambda n: self.value[n])

    def best_leaves(self, k: int) -> list[int]:
        """The ``k`` leaves of highest value, best first (the earlier leaf first on ties, as ``best_leaf``; NaN last)."""
        return sorted(self.leaves(), key=lambda n: (math.isnan(self.value[n]), -self.value[n]))[:k]

    def sample_leaf(self, generator: torch.Generator | None = None) -> int:
        """Descend from the root by the Boltzmann rule over all valued children down to a leaf."""
        node = 0
        while not self.is_leaf(node):
            node = self.choose_child(node, greedy=False, generator=generator, open_only=False)
        return node

    def expansion_cost(self, node: int, evals_per_sample: int = 1) -> int:
        """NFEs of an iteration expanding ``node``: its velocity if not cached, then ``T - d - 1`` rollout steps."""
        uncached = 1 if self.velocity[node] is None else 0
        return (uncached + self.max_depth - self.depth[node] - 1) * evals_per_sample


@torch.no_grad()
def diffusion_tree_search(
    velocity: GuidedVelocity,
    reward: LatentReward,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    budget: int,
    *,
    greedy: bool = True,
    lam: float = 10.0,
    max_children: int = 3,
    noise_level: float = 0.7,
    kind: str = "flow_grpo",
    candidates: int = 1,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """DTS* (``greedy=True``) or DTS (``greedy=False``) for every prompt, within ``budget`` NFEs per prompt.

    ``candidates = K > 1`` returns a set per prompt: DTS*'s ``K`` best leaves (best first); DTS's ``K`` leaves drawn
    by ``K`` independent descents (Boltzmann selection; a leaf may be drawn twice, as sampling from the tilted
    distribution can repeat). A tree with fewer than ``K`` leaves within the budget is a ValueError naming
    ``--candidates``.

    ``info`` holds ``iterations [B]`` (rollouts per tree), ``trees`` (the ``SearchTree``s, states included) and the
    number of distinct leaves.
    """
    sigmas = check_sampling(sigmas, kind, noise_level, generators)
    if noise_level <= 0:
        raise ValueError("tree search needs noise_level > 0: an ODE step from one node gives identical children")
    if max_children < 2:
        raise ValueError(f"max_children must be >= 2 for a tree to branch, got {max_children}")
    num_steps = sigmas.numel() - 1
    evals = count_nfe(velocity, 1)
    check_budget(budget, trajectory_nfe(velocity, num_steps), "tree-search")
    prompts = len(generators)
    roots = initial_noise(shape, generators, torch.arange(prompts), device)
    trees = [SearchTree(num_steps, max_children, lam) for _ in range(prompts)]
    for tree, root in zip(trees, roots):
        tree.add(None, root)
    spent, iterations = [0] * prompts, [0] * prompts

    while True:
        starts = {}
        for b, tree in enumerate(trees):
            node = tree.select(greedy=greedy, generator=generators[b])
            if node is not None and spent[b] + tree.expansion_cost(node, evals) <= budget:
                starts[b] = node
        if not starts:
            break
        _grow(trees, starts, velocity, reward, sigmas, kind, noise_level, generators, spent, device)
        for b in starts:
            iterations[b] += 1

    if candidates > 1:
        check_candidates(candidates, min(len(tree.leaves()) for tree in trees), "tree search", "leaves")
        chosen = [tree.best_leaves(candidates) if greedy else
                  [tree.sample_leaf(generators[b]) for _ in range(candidates)] for b, tree in enumerate(trees)]
        return GuidedResult(
            final=torch.stack([torch.stack([tree.state[n] for n in nodes]) for tree, nodes in zip(trees, chosen)]),
            reward=torch.tensor([[tree.value[n] for n in nodes] for tree, nodes in zip(trees, chosen)],
                                dtype=torch.float64),
            nfe=torch.tensor(spent, dtype=torch.long),
            info={"iterations": iterations, "trees": trees, "leaves": [len(t.leaves()) for t in trees]},
        )
    if greedy:
        chosen = [tree.best_leaf() for tree in trees]
    else:
        chosen = [tree.sample_leaf(generators[b]) for b, tree in enumerate(trees)]
    return GuidedResult(
        final=torch.stack([tree.state[n] for tree, n in zip(trees, chosen)]),
        reward=torch.tensor([tree.value[n] for tree, n in zip(trees, chosen)], dtype=torch.float64),
        nfe=torch.tensor(spent, dtype=torch.long),
        info={"iterations": iterations, "trees": trees, "leaves": [len(t.leaves()) for t in trees]},
    )


def _grow(trees, starts, velocity, reward, sigmas, kind, noise_level, generators, spent, device) -> None:
    """Expand the selected node of every tree in ``starts`` and roll each new child out to a leaf, in lockstep by
    depth; then score the leaves and back up their values."""
    num_steps = sigmas.numel() - 1
    frontier = dict(starts)  # tree -> node being stepped
    for depth in range(min(trees[b].depth[n] for b, n in frontier.items()), num_steps):
        active = [b for b, n in frontier.items() if trees[b].depth[n] == depth]
        if not active:
            continue
        rows = torch.tensor(active, device=device)
        missing = [b for b in active if trees[b].velocity[frontier[b]] is None]
        if missing:
            x = torch.stack([trees[b].state[frontier[b]] for b in missing])
            v = velocity(x, sigmas[depth], torch.tensor(missing, device=device))
            for b, row in zip(missing, v):
                trees[b].velocity[frontier[b]] = row
                spent[b] += count_nfe(velocity, 1)
        x = torch.stack([trees[b].state[frontier[b]] for b in active])
        v = torch.stack([trees[b].velocity[frontier[b]] for b in active])
        x_next = step(x, v, sigmas[depth], sigmas[depth + 1], kind=kind, noise_level=noise_level,
                      generators=generators, rows=rows)
        for b, state in zip(active, x_next):
            frontier[b] = trees[b].add(frontier[b], state)
    order = sorted(frontier)
    finals = torch.stack([trees[b].state[frontier[b]] for b in order])
    scores = as_scores(reward(finals, torch.tensor(order, device=device)), len(order))
    for b, score in zip(order, scores.tolist()):
        trees[b].backup(frontier[b], score)
