"""Multi-process runs for the tests, started by torchrun's own launcher with workers forked from a preloaded server.

``launch(nproc, function, *args)`` is ``torchrun --standalone --nproc_per_node NPROC`` for a function of a test
module: torch's elastic agent (``torch.distributed.launcher.api.elastic_launch``, which is what ``torchrun`` runs),
a c10d rendezvous on the loopback, the agent's store, the same environment per worker (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` ...), and real processes that train on gloo. What differs is how a worker starts: torchrun starts
a fresh interpreter per worker, which imports torch, diffusers, transformers and the trainer (7.7 s of CPU per
process, measured: more than a tiny run's two iterations), while these workers are forked from multiprocessing's
fork server, which imported them once for the whole pytest process (``fork_server``).

A fork of the pytest process itself would inherit what earlier tests left there; two such states broke a child (both
seen in the suite): a gloo process group, which the child's garbage collector finalised and whose destructor then
waited forever on a thread that exists only in the parent, and autograd's worker threads after a backward pass in the
parent ("Unable to handle autograd's threading in combination with fork-based multiprocessing"). The fork server is
single-threaded and has only imported modules, so every child starts from that clean state.

The agent runs in a thread of the pytest process (it then installs no signal handlers there: it only does so on the
main thread), so the test can train its one-process references meanwhile (``in_the_background``). Each worker runs
with one intra-op thread (two processes share the machine's two cores) and ``ACCELERATE_USE_CPU=1``, as the tests'
torchrun launches set them; its stdout and stderr go to files under ``LOG_DIR/agent`` (torch's
``DefaultLogsSpecs``), and a failure raises with every rank's last lines. The command line's own launch keeps its
tests with the real launchers, ``torchrun -m flowalign.cli`` and ``accelerate launch`` (tests/test_fsdp2.py,
tests/test_trainer.py, tests/test_crash_matrix.py, tests/test_launch_configs.py).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path

# What a worker would otherwise import itself (seconds each): the trainer, its command line's launch helpers and the
# tiny SD3 pipeline's classes. Only imports: a model loaded in the server would start threads (transformers loads
# weights in a thread pool).
PRELOAD = ["forked_launch", "crash_matrix", "flowalign.training.trainer", "flowalign.cli.train", "flowalign.models.sd3",
           "peft", "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",
           "transformers.models.clip.modeling_clip", "transformers.models.t5.modeling_t5"]


def fork_server():
    """multiprocessing's fork server for this process, preloading ``PRELOAD`` when it starts (once per process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _worker(function, args) -> None:
    """One worker: ``function(*args)`` in one intra-op thread, then every process leaves the process group together.
    It returns (the agent collects each worker's return value), so the worker does not end with
    ``flowalign.cli.train``'s ``os._exit``: multiprocessing ends a forked child with ``os._exit`` itself."""
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a crash's Python stack into the rank's log
    os.environ.update({"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    function(*args)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(nproc: int, function, *args, log_dir: Path) -> None:
    """``function(*args)`` on ``nproc`` processes, as ``torchrun --standalone`` would run it (module docstring).

    Args:
        nproc: the processes.
        function: a module-level function of an importable module (the workers unpickle it by name).
        args: its arguments (picklable).
        log_dir: where each rank's output goes (under ``log_dir/agent``, ``rank_logs`` reads it).

    Raises:
        AssertionError: a worker failed, with the tail of every rank's output and the agent's error.
    """
    failure = []
    thread = threading.Thread(target=_run_agent, args=(nproc, function, args, log_dir, failure))
    thread.start()
    thread.join()
    _check(failure, log_dir)


@contextmanager
def in_the_background(nproc: int, function, *args, log_dir: Path):
    """``launch`` while the ``with`` block runs (the one-process references, say); the block's end waits for it."""
    failure = []
    thread = threading.Thread(target=_run_agent, args=(nproc, function, args, log_dir, failure), daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    _check(failure, log_dir)


def _run_agent(nproc: int, function, args, log_dir: Path, failure: list) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    log_dir.mkdir(parents=True, exist_ok=True)
    fork_server()
    run_id = uuid.uuid4().hex
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id, rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", max_restarts=0, start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir / "agent"), redirects=Std.ALL))
    signals = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    try:
        elastic_launch(config, _worker)(function, args)
    except BaseException as error:  # noqa: BLE001 - reported by the caller, with the workers' output
        failure.append(error)
    finally:  # elastic_launch sets this in the launching process's environment; leave it as it was
        if signals is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals


def rank_logs(log_dir: Path) -> dict[int, str]:
    """Each rank's output (stdout then stderr) of the launch that wrote ``log_dir``."""
    logs = {}
    for path in sorted((log_dir / "agent").glob("*/attempt_0/*/std*.log")):
        rank = int(path.parent.name)
        logs[rank] = logs.get(rank, "") + path.read_text(errors="replace")
    return logs


def _check(failure: list, log_dir: Path) -> None:
    if failure:
        tails = "\n".join(f"--- rank {rank}:\n{text[-2500:]}" for rank, text in rank_logs(log_dir).items())
        raise AssertionError(f"the forked launch failed: {failure[0]}\n{tails}")
