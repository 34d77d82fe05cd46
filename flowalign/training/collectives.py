"""The process layouts the trainer runs on, and the collectives of its loop.

accelerate's distributed types the trainer launches on: one process, or processes over CPU (gloo), GPU or XPU. How the
model is laid out over them is the trainer's engine (``distributed.engine``: DDP or FSDP2,
``flowalign.training.parallel_engines``), not accelerate's: an accelerate config with its own FSDP or DeepSpeed plugin
is refused. Before anything loads, every process checks that all of them run the same config (a node launched with
other overrides would train another run in lockstep, or hang).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from flowalign.errors import SetupError

__all__ = ["SUPPORTED_DISTRIBUTED_TYPES", "agreed", "check_distributed_type", "check_ranks_agree", "gather_objects",
           "launched_without_accelerator", "process_state", "summed", "together", "world_of"]

SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU")


def world_of(accelerator):
    """The accelerator of every process: the real one behind a context-parallel run's data-parallel view
    (``flowalign.training.context_parallel.DataParallelView``), else ``accelerator`` itself."""
    return getattr(accelerator, "world", accelerator)


def gather_objects(accelerator, items: list) -> list:
    """``items`` of every data-parallel process, concatenated in process order; the processes of a context-parallel
    group hold the same items, which are taken once (from the group's first process)."""
    from accelerate.utils import gather_object

    degree = getattr(accelerator, "context_degree", 1)
    if degree == 1:
        return gather_object(items)
    import torch.distributed as dist

    per_process = [None] * world_of(accelerator).num_processes
    dist.all_gather_object(per_process, list(items))
    return [item for rank, part in enumerate(per_process) if rank % degree == 0 for item in part]


def launched_without_accelerator() -> bool:
    """A launch of several processes (``WORLD_SIZE`` > 1, as torchrun and accelerate set it) on a machine without an
    accelerator. accelerate then starts a process group only when told the run is on the CPU (``Accelerator(cpu=
    True)``, or ``ACCELERATE_USE_CPU=1``); without it each process would train the whole run alone, all of them
    writing into the same ``train.out_dir``. The trainer passes ``cpu=True`` then: gloo, as the tests launch."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available()


def process_state():
    """accelerate's state of this process (``PartialState``), made as the trainer makes its ``Accelerator``: on the
    CPU's process group where ``launched_without_accelerator``. accelerate keeps the first state a process makes for
    its whole life (an ``Accelerator`` made later shares it), so code that runs before the trainer makes it here:
    a plain ``PartialState()`` ignores ``ACCELERATE_USE_CPU`` and leaves a CPU launch's processes on their own."""
    from accelerate import PartialState

    return PartialState(cpu=launched_without_accelerator())


def check_distributed_type(accelerator) -> None:
    """Refuse, before any model loads, an accelerate launch config the trainer cannot run (FSDP, DeepSpeed, ...), and
    a launch of several processes that accelerate left as independent single-process runs."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise SetupError(
            f"this process was launched as one of WORLD_SIZE={launched}, but accelerate started no process group: each "
            "process would train the whole run alone, into the same train.out_dir. On a machine without a GPU set "
            "ACCELERATE_USE_CPU=1 (gloo); with GPUs, check that every process sees one (CUDA_VISIBLE_DEVICES)")
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in SUPPORTED_DISTRIBUTED_TYPES:
        raise SetupError(
            f"accelerate distributed_type {kind} is not how flowalign train shards: launch with "
            "configs/accelerate/ddp.yaml or configs/accelerate/multi_node.yaml (or torchrun) and set "
            "distributed.engine: fsdp2 to shard the model with FSDP2 (or ddp, the default, for data parallelism)")


def check_ranks_agree(accelerator, config_dict: dict) -> None:
    """Refuse, on every process, a launch whose processes hold different configs, naming the keys and the values
    each process holds (the config's resolved dict, ``flowalign.config.to_dict``)."""
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    from flowalign.config import diff_configs

    configs = gather_object([config_dict])
    differences = {rank: diff_configs(configs[0], other) for rank, other in enumerate(configs) if rank}
    differences = {rank: lines for rank, lines in differences.items() if lines}
    if differences:
        shown = "; ".join(f"process {rank}: {', '.join(lines[:3])}" for rank, lines in differences.items())
        raise SetupError(f"the processes of this launch do not run the same config (process 0 != process k): "
                         f"{shown}. Launch every node with the same config file and overrides")


def agreed(accelerator, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (a stop requested by a signal on one rank)."""
    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(value, "max").item() > 0)


def summed(accelerator, count: int) -> int:
    """``count`` summed over the processes."""
    if accelerator.num_processes == 1:
        return count
    value = torch.tensor([float(count)], device=accelerator.device)
    return int(accelerator.reduce(value, "sum").item())


@contextmanager
def together(accelerator, what: str) -> Iterator[None]:
    """Run the block on every process, then agree (a collective, so also a barrier) on whether it failed anywhere:
    if it did, every process raises, instead of the others waiting in their next collective for a process that
    stopped until it times out. The process that failed raises its own error; the others a ``RuntimeError`` naming
    ``what``, the process(es) that failed and their errors."""
    error = None
    try:
        yield
    except Exception as caught:  # noqa: BLE001 - every error is re-raised below, after the processes agree
        error = caught
    if accelerator.num_processes > 1 and agreed(accelerator, error is not None):
        from accelerate.utils import gather_object

        reports = gather_object([None if error is None else
                                 f"process {accelerator.process_index}: {type(error).__name__}: {error}"])
        if error is None:
            raise RuntimeError(f"{what} failed on another process: " + "; ".join(r for r in reports if r))
    if error is not None:
        raise error
