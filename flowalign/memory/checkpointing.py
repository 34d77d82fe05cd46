"""Selective activation checkpointing per transformer block (``distributed.activation_checkpointing: N``).

Every N-th block of the trained transformer (``flowalign.models.blocks.transformer_blocks``: blocks 0, N, 2N, ...) runs its
forward under ``torch.utils.checkpoint.checkpoint`` (non-reentrant, the RNG state preserved): the block keeps only its
inputs for the backward and recomputes its activations there (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"). ``N = 1`` checkpoints every block, as ``model.gradient_checkpointing`` does through diffusers; ``N = 2``
every other block, keeping half the blocks' activations for half the recompute. Without gradients (rollouts, the
reference pass) the block runs as it is. The recompute is the same computation, so the gradients are bitwise those of
the plain run.

The checkpoint wraps the block's own ``forward`` (an instance attribute), not the module: parameter names, state dicts
and checkpoints are unchanged, and FSDP2's hooks, which run around the module's call, stay outside the checkpoint (the
weights are gathered again for the recompute by FSDP2's pre-backward hook), the order torchtitan applies them in.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["checkpoint_blocks", "checkpointed_blocks"]


def checkpointed_blocks(count: int, every: int) -> list[int]:
    """The indices of the blocks ``every`` checkpoints among ``count`` blocks (0, every, 2 * every, ...; none for 0)."""
    return list(range(0, count, every)) if every > 0 else []


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(transformer: torch.nn.Module, every: int) -> list[int]:
    """Checkpoint every ``every``-th block of ``transformer`` in place (module docstring).

    Args:
        transformer: the trained transformer (or a module with ``sharding_blocks()``, Wan2.2's expert pair).
        every: the stride; 0 changes nothing.

    Returns:
        The indices of the checkpointed blocks.
    """
    from flowalign.models.blocks import transformer_blocks

    blocks = transformer_blocks(transformer)
    chosen = checkpointed_blocks(len(blocks), every)
    for index in chosen:
        block = blocks[index]
        block.forward = functools.partial(_checkpointed_forward, block.forward)
    return chosen
