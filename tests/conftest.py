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


def module_from_file(name: str, path: Path):
    """A script outside the package (bench/, docs/) imported from its file as ``name``, without putting its folder on
    ``sys.path``: there bench/crash_matrix.py would shadow tests/crash_matrix.py, in this process and in the fork
    server that starts from its path (tests/forked_launch.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


# The modules whose tests run for 15 s or more (most start processes), with what the whole module cost in a full
# `make test` (pytest --durations=0, 2 idle cores, 2026-12-06, after tests/forked_launch.py). pytest-xdist's worksteal scheduler first deals the
# collection to its workers in equal contiguous chunks, then lets an idle worker steal the tail half of a busy one's
# queue: a long test that starts late runs alone at the end while the other core idles. So these modules open the
# chunks, shared between the chunks by their cost (the longest first, each to the chunk with the least so far), and
# the rest fill each chunk to its size: the run ends on short tests, which stealing spreads. Only the order changes;
# a module missing here, or a cost gone stale, costs time, never a test.
LONG_MODULES = {
    "test_trainer.py": 212, "test_fsdp2.py": 126, "test_crash_matrix.py": 117, "test_video_distributed.py": 75,
    "test_launch_configs.py": 50, "test_golden.py": 57, "test_remote_rewards.py": 54, "test_export.py": 48,
    "test_reward_server_hostile.py": 46, "test_full_finetune.py": 38, "test_context_parallel.py": 37,
    "test_untrusted_checkpoints.py": 36, "test_kernels_interpreter.py": 35, "test_video_wan.py": 27,
    "test_user_code.py": 25, "test_toy_video_model.py": 24, "test_notebook.py": 20, "test_memory_options.py": 18,
    "test_memory_plan.py": 16,
}


def pytest_collection_modifyitems(config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))  # set in the workers, which collect
    if workers < 2:
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.path.name, []).append(item)
    chunks, loads = [[] for _ in range(workers)], [0.0] * workers
    for name in sorted((m for m in modules if m in LONG_MODULES), key=lambda m: -LONG_MODULES[m]):
        least = loads.index(min(loads))
        chunks[least] += modules[name]
        loads[least] += LONG_MODULES[name]
    rest = iter(item for name, module in modules.items() if name not in LONG_MODULES for item in module)
    left = len(items)
    for index, chunk in enumerate(chunks):  # worksteal's first split: len(pending) // workers_left each
        size = left // (workers - index)
        left -= size
        chunk += [item for _, item in zip(range(size - len(chunk)), rest)]
    chunks[-1] += list(rest)
    items[:] = [item for chunk in chunks for item in chunk]
