"""Tree rollouts (BranchGRPO): trajectories that share their prefixes and branch at chosen steps.

Reference: Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion Models"
(arXiv:2509.06040), and docs/design/math.md#tree-credit. Each root (one per prompt) starts one tree. At a *split step*
every live node
is evaluated once and then draws ``b`` children, each an independent SDE sample around the same mean; at any other
step every live node takes one step (SDE or ODE, by the noise schedule). The leaves are the finished images.

Cost. A step evaluates the velocity once per live node, and the children of a split share their parent's
evaluation, so with splits at steps ``{0, 3, 6, 9}`` of 20 and ``b = 2`` a tree costs
``1 + 2·2 + 2 + 4·2 + 4 + 8·2 + 8 + 16·10 = 203`` NFEs for 16 leaves, against ``16 · 20 = 320`` for 16 independent
trajectories. All live nodes of all trees at one step go through the model in one batched call.

Split noise. A split may widen its draw, ``x' = mu + c·std·eps`` (``split_noise_scale = c``), to spread the siblings
further apart. The recorded std and log-prob are those of ``N(mu, (c·std)^2)``, the density the sample was actually
drawn from; the training-time recomputation gets ``c`` through ``Transitions.noise_scale``.

Node layout. Nodes are numbered level by level (all roots, then every node after step 0, ...) and tree-major within
a level, so the nodes of the last level (the leaves) come last, in tree order; ``parents`` is the forest's parent
list in the format of ``flowalign.credit.tree.tree_advantages``. Noise for tree ``r`` comes from ``generator[r]`` when a
list is given (one per tree), drawn in node order: a tree's samples do not depend on which other trees share its
batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .rollout import Rollout, Transitions, check_rollout_inputs, count_nfe
from .sde import ode_step, sde_step, standard_normal

__all__ = ["TreeSchedule", "TreeRollout", "tree_rollout"]

TreeVelocity = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class TreeSchedule:
    """Where a tree branches: ``split_steps`` (increasing step indices), ``branching`` (children per split, one int
    for all splits or one per split) and the split-noise scale ``c`` (> 0)."""

    split_steps: tuple[int, ...]
    branching: tuple[int, ...] | int = 2
    split_noise_scale: float = 1.0

    def __post_init__(self):
        steps = tuple(int(s) for s in self.split_steps)
        if not steps:
            raise ValueError("tree.split_steps is empty: a tree needs at least one split step")
        if any(b <= a for a, b in zip(steps, steps[1:])) or steps[0] < 0:
            raise ValueError(f"tree.split_steps must be non-negative and strictly increasing, got {list(steps)}")
        factors = (self.branching,) * len(steps) if isinstance(self.branching, int) else tuple(self.branching)
        if len(factors) != len(steps):
            raise ValueError(
                f"tree.branching has {len(factors)} factors for {len(steps)} split steps: give one per split or one int"
            )
        if any(int(b) != b or b < 1 for b in factors):
            raise ValueError(f"tree.branching factors must be integers >= 1, got {list(factors)}")
        if not (self.split_noise_scale > 0 and math.isfinite(self.split_noise_scale)):
            raise ValueError(f"tree.split_noise_scale must be a positive number, got {self.split_noise_scale!r}")
        object.__setattr__(self, "split_steps", steps)
        object.__setattr__(self, "branching", tuple(int(b) for b in factors))

    @property
    def leaves(self) -> int:
        """Leaves per tree: the product of the branching factors."""
        return math.prod(self.branching)

    def factor(self, step: int) -> int:
        """Children per node drawn at ``step`` (1 off the split steps)."""
        return dict(zip(self.split_steps, self.branching)).get(step, 1)

    def width(self, step: int) -> int:
        """Live nodes per tree when ``step`` starts (each is evaluated once at that step)."""
        return math.prod(b for s, b in zip(self.split_steps, self.branching) if s < step)

    def nfe(self, num_steps: int, trees: int = 1) -> int:
        """Velocity evaluations of ``trees`` trees over ``num_steps`` steps (CFG-free)."""
        self.check(num_steps)
        return trees * sum(self.width(i) for i in range(num_steps))

    def check(self, num_steps: int, noise_levels: Tensor | None = None) -> None:
        """Split steps must lie inside the rollout, and be stochastic steps when ``noise_levels`` are given."""
        if self.split_steps[-1] >= num_steps:
            raise ValueError(f"tree.split_steps {list(self.split_steps)} reach past the last step ({num_steps - 1})")
        if noise_levels is not None:
            ode = [s for s in self.split_steps if float(noise_levels[s]) <= 0]
            if ode:
                raise ValueError(
                    f"tree.split_steps {ode} are ODE steps (noise level 0): children of a deterministic step would "
                    "all be equal; split only on stochastic (trained) steps"
                )


@dataclass
class TreeRollout(Rollout):
    """A finished tree rollout. ``final`` holds the leaves (``trees * leaves`` rows, tree-major); ``parents`` is the
    parent list over all nodes, ``tree_of_node`` each node's tree and ``node_step`` the step that produced it
    (-1 for roots). Transition ``k`` goes into node ``transitions.dst[k]``."""

    parents: list[int | None]
    tree_of_node: Tensor
    node_step: Tensor
    leaf_nodes: Tensor


@torch.no_grad()
def tree_rollout(
    velocity: TreeVelocity,
    x_roots: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    schedule: TreeSchedule,
    *,
    kind: str = "flow_grpo",
    reduce: str = "mean",
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    group_ids: Tensor | None = None,
    prompt_ids: Tensor | None = None,
    keep_velocity: bool = False,
) -> TreeRollout:
    """Grow one tree from each row of ``x_roots`` (at ``sigmas[0]``) over ``len(sigmas) - 1`` steps.

    ``velocity(x, sigma, tree)`` sees the live nodes of all trees at once; ``tree[k]`` is the tree (the row of
    ``x_roots``) of node ``k``, so the caller can pick each node's conditioning. ``group_ids`` / ``prompt_ids`` label
    each tree (default: its row). With ``keep_velocity`` each edge stores its source node's velocity
    (``Transitions.velocity``; a split's children share their parent's).
    """
    sigmas, noise_levels = check_rollout_inputs(sigmas, noise_levels, kind, reduce, x_roots.device)
    num_steps = sigmas.numel() - 1
    schedule.check(num_steps, noise_levels)
    trees, device = x_roots.shape[0], x_roots.device
    if isinstance(generator, (list, tuple)) and len(generator) != trees:
        raise ValueError(f"got {len(generator)} generators for {trees} trees: give one per tree")
    rows = torch.arange(trees, device=device)
    group_ids = rows if group_ids is None else torch.as_tensor(group_ids, device=device)
    prompt_ids = rows if prompt_ids is None else torch.as_tensor(prompt_ids, device=device)

    levels = [x_roots]  # live states per level, tree-major
    level_tree = [rows]  # tree of each live node
    parents: list[int | None] = [None] * trees
    node_step = [-1] * trees
    src, dst, step_of, std_of, scale_of, logp_of, v_of = [], [], [], [], [], [], []
    first_id, nfe = 0, 0
    for i in range(num_steps):
        x, tree = levels[-1], level_tree[-1]
        sigma, sigma_next, level = sigmas[i], sigmas[i + 1], float(noise_levels[i])
        v = velocity(x, sigma, tree)
        if v.shape != x.shape:  # an ODE step would broadcast a wrong-sized velocity silently
            raise ValueError(f"the velocity returned shape {tuple(v.shape)} at step {i} for {x.shape[0]} live nodes of "
                             f"shape {tuple(x.shape)}: it must return one velocity per node, shaped like x")
        nfe += count_nfe(velocity, x.shape[0])
        b = schedule.factor(i)
        parent_ids = first_id + torch.arange(x.shape[0], device=device).repeat_interleave(b)
        child_tree = tree.repeat_interleave(b)
        if level > 0:
            scale = schedule.split_noise_scale if b > 1 else 1.0
            noise = standard_normal((x.shape[0] * b, *x.shape[1:]), generator, device, owner=child_tree)
            out = sde_step(x.repeat_interleave(b, 0), v.repeat_interleave(b, 0), sigma, sigma_next, kind=kind,
                           noise_level=level, noise=noise, reduce=reduce, noise_scale=scale)
            x_next, std, log_prob = out.prev_sample, out.std, out.log_prob
        else:
            x_next = ode_step(x, v, sigma, sigma_next)
            std = log_prob = torch.zeros(x.shape[0], device=device)
            scale = 1.0
        first_child = first_id + x.shape[0]
        children = first_child + torch.arange(x_next.shape[0], device=device)
        parents += parent_ids.tolist()
        node_step += [i] * x_next.shape[0]
        src.append(parent_ids)
        dst.append(children)
        step_of.append(torch.full((x_next.shape[0],), i, device=device))
        std_of.append(std.float())
        scale_of.append(torch.full((x_next.shape[0],), float(scale), device=device))
        logp_of.append(log_prob)
        if keep_velocity:
            v_of.append(v.repeat_interleave(b, 0) if level > 0 else v)
        levels.append(x_next)
        level_tree.append(child_tree)
        first_id = first_child

    step = torch.cat(step_of)
    tree_of_edge = torch.cat(level_tree[1:])
    dst_all = torch.cat(dst)
    leaves_per_tree = schedule.leaves
    # A transition's sample_id is the first leaf below it (its own leaf on a chain).
    first_leaf = _first_leaf_below(parents, first_id, levels[-1].shape[0], device)
    transitions = Transitions(
        states=torch.cat(levels),
        src=torch.cat(src),
        dst=dst_all,
        step=step,
        sigma=sigmas[:-1].float()[step],
        sigma_next=sigmas[1:].float()[step],
        noise_level=noise_levels.to(device)[step],
        std=torch.cat(std_of),
        noise_scale=torch.cat(scale_of),
        log_prob=torch.cat(logp_of),
        stochastic=noise_levels.to(device)[step] > 0,
        sample_id=first_leaf[dst_all],
        group_id=group_ids[tree_of_edge],
        prompt_id=prompt_ids[tree_of_edge],
        kind=kind,
        reduce=reduce,
        velocity=torch.cat(v_of) if keep_velocity else None,
    )
    if levels[-1].shape[0] != trees * leaves_per_tree:
        raise RuntimeError(
            f"the tree rollout grew {levels[-1].shape[0]} leaves for {trees} trees, but {schedule} promises "
            f"{leaves_per_tree} per tree: its factor(step) and leaves disagree"
        )
    return TreeRollout(
        transitions=transitions,
        final=levels[-1],
        nfe=nfe,
        parents=parents,
        tree_of_node=torch.cat(level_tree),
        node_step=torch.tensor(node_step, device=device),
        leaf_nodes=first_id + torch.arange(levels[-1].shape[0], device=device),
    )


def _first_leaf_below(parents: list[int | None], first_leaf_id: int, num_leaves: int, device) -> Tensor:
    """For every node, the index (0-based among the leaves) of the first leaf below it."""
    first = torch.full((len(parents),), num_leaves, dtype=torch.long)
    for leaf in range(num_leaves - 1, -1, -1):
        node = first_leaf_id + leaf
        while node is not None and first[node] > leaf:
            first[node] = leaf
            node = parents[node]
    return first.to(device)
