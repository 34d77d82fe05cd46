"""Seeds that depend only on what a random draw is for, never on batch layout or process count.

Every random draw of a run is keyed by integers, e.g. ``(seed, iteration, sample, purpose)``; ``mixed_seed`` hashes the
key with ``numpy.random.SeedSequence`` (nearby keys give unrelated seeds). Sample ``j`` then gets the same noise
whether it is rolled out alone, in a batch of 64, or on process 3 of 8: that is what makes a 2-process run equal a
1-process run, and a resumed run equal an uninterrupted one.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


def mixed_seed(*key: int) -> int:
    """A 63-bit seed for ``torch.Generator().manual_seed`` from a tuple of non-negative integers."""
    state = np.random.SeedSequence([int(k) for k in key]).generate_state(1, np.uint64)
    return int(state[0]) & (2**63 - 1)


def generator(*key: int) -> torch.Generator:
    """A CPU generator seeded with ``mixed_seed(*key)``."""
    return torch.Generator("cpu").manual_seed(mixed_seed(*key))


def numpy_rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(mixed_seed(*key))


class Purpose(IntEnum):
    """What a random draw is for: the last element of its key. The numbers are part of every recorded run."""

    PROMPTS = 0  # the iteration's prompts
    WINDOW = 1  # where the SDE window sits
    INIT_NOISE = 2  # a trajectory's (tree's, trunk's) initial noise
    SDE_NOISE = 3  # the noise of its stochastic steps
    STEP_SUBSET = 4  # DanceGRPO's subset of trained steps
    SHUFFLE = 5  # the order of the trained steps in each inner epoch
    OBJECTIVE = 6  # an objective's data units (noise levels, noise, picks)
    FORWARD = 7  # a forward-process objective's noise levels and noise at the rollout's final samples
    MINIBATCH_SHARES = 8  # which rollout chunks each minibatch trains (optim.minibatch_split: samples)
    PROCESS_RNG = 9  # a process's global python/numpy/torch RNGs, re-seeded on a resume at another process count
