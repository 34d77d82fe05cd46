"""Which micro-batches each optimizer step of an inner epoch trains (``optim.minibatches``, ``optim.minibatch_split``).

A micro-batch is one rollout chunk (``sampling.batch_size`` samples) at one trained step: the rollout's own batch
composition, so the first recomputed ratio is exactly 1 (``flowalign.training.policy``). Each inner epoch shuffles
the trained steps (the same order on every process) and cuts the (chunk, step) pairs into ``M = optim.minibatches``
minibatches, one optimizer step each, the gradient averaged over the minibatch's micro-batches:

* ``steps`` (flowalign's reading): minibatch ``m`` trains the ``m``-th share of the shuffled steps, at every chunk.
  ``M`` must divide the trained steps (9 of a 10-step flow_grpo rollout: ``M`` is 1, 3 or 9).
* ``samples`` (flow_grpo's released ``train_sd3.py``): minibatch ``m`` trains every trained step of a share of the
  samples. flow_grpo cuts each process's samples into ``num_batches_per_epoch`` batches and accumulates gradients over
  ``gradient_accumulation_steps`` batches, all their trained steps, so it takes ``num_batches_per_epoch /
  gradient_accumulation_steps`` optimizer steps per epoch (2 in its SD3.5 configs: 4 batches, accumulation 2).
  Here the share is of rollout chunks, so each process's chunks must be a multiple of ``M``. The chunks are numbered
  globally (process ``p``'s ``j``-th chunk is ``p C + j`` with ``C`` chunks per process) and taken ``M`` at a time; a
  permutation drawn for each such block and inner epoch from the run's seed (the same on every process) deals one
  chunk of the block to each minibatch. So every process trains ``C / M`` chunks in every minibatch, and which
  minibatch trains a sample does not depend on the number of processes. flow_grpo reshuffles single samples between
  its batches instead; a chunk here keeps the rollout's batch.

Within a minibatch the micro-batches run step by step in the shuffled order, chunk by chunk within a step, so with
``M = 1`` both readings train the same micro-batches in the same order.
"""

from __future__ import annotations

import torch

__all__ = ["MINIBATCH_SPLITS", "minibatch_units"]

MINIBATCH_SPLITS = ("steps", "samples")


def minibatch_units(split: str, steps: list[int], chunks: int, first_chunk: int, count: int,
                    generator: torch.Generator | None = None) -> list[list[tuple[int, int]]]:
    """The ``(chunk, step)`` micro-batches of each of ``count`` minibatches (module docstring): ``steps`` is the
    inner epoch's shuffled order of trained steps, ``chunks`` this process's rollout chunks, ``first_chunk`` the global
    number of its first, ``generator`` the inner epoch's draw of the chunks' shares (``samples`` only)."""
    if split not in MINIBATCH_SPLITS:
        raise ValueError(f"unknown minibatch split {split!r}: expected one of {', '.join(MINIBATCH_SPLITS)}")
    if split == "steps":
        if len(steps) % count:
            raise ValueError(f"{count} minibatches do not divide the {len(steps)} trained steps")
        per = len(steps) // count
        return [[(j, step) for step in steps[m * per:(m + 1) * per] for j in range(chunks)] for m in range(count)]
    if not steps:  # nothing trained on the rollouts (an objective-only run): empty minibatches
        return [[] for _ in range(count)]
    if chunks % count or first_chunk % count:
        raise ValueError(f"{count} minibatches do not divide the {chunks} rollout chunks of this process")
    if generator is None:
        raise ValueError("the samples split draws each chunk's minibatch: give a generator")
    blocks = (first_chunk + chunks) // count  # every global block up to this process's last, drawn in order
    deals = [torch.randperm(count, generator=generator).tolist() for _ in range(blocks)]
    owner = [deals[(first_chunk + j) // count][(first_chunk + j) % count] for j in range(chunks)]
    return [[(j, step) for step in steps for j in range(chunks) if owner[j] == m] for m in range(count)]
