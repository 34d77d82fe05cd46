"""Shared fixtures: tiny real diffusers pipelines built in-process (no hub, no downloads)."""

import os
from pathlib import Path

# Under pytest-xdist (`make test` runs `-n auto`) every worker is one process per core: one intra-op thread each, for
# the workers and for the CLI runs they start, or the cores are oversubscribed and torch slows down many times over.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest

from flowalign.models.tiny import tiny_flux_pipeline, tiny_sd3_pipeline

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
WORDS = "a photo of an the red green blue yellow purple white circle square triangle circles squares triangles and two three four left right above below".split()


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_xdist_worker():
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def words():
    return WORDS


@pytest.fixture
def sd3_pipe():
    return tiny_sd3_pipeline(WORDS, seed=0)


@pytest.fixture
def flux_pipe():
    return tiny_flux_pipeline(WORDS, seed=0)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one global state per process; tests build several trainers with different precisions."""
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
