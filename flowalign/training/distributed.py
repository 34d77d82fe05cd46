"""The process layouts the trainer runs on, and the collectives of its loop.

accelerate's distributed types the trainer runs on: one process, or data parallelism over processes (CPU, GPU or
XPU). FSDP and DeepSpeed need the model and optimizer prepared together and sharded checkpoints: not supported yet.
"""

from __future__ import annotations

import torch

from flowalign.errors import SetupError

__all__ = ["SUPPORTED_DISTRIBUTED_TYPES", "agreed", "check_distributed_type", "summed"]

SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU")


def check_distributed_type(accelerator) -> None:
    """Refuse, before any model loads, an accelerate launch config the trainer cannot run (FSDP, DeepSpeed, ...)."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in SUPPORTED_DISTRIBUTED_TYPES:
        raise SetupError(
            f"accelerate distributed_type {kind} is not supported by flowalign train yet: it runs on one process or "
            "with data parallelism (DDP) over processes, on CPU (gloo) or GPU. Launch with "
            "configs/accelerate/ddp.yaml or configs/accelerate/multi_node.yaml, or torchrun")


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
