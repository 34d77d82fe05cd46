"""A diverging run stops: a loss or a trainable weight that is no longer finite ends training before that
iteration is logged or saved, so the run's newest checkpoint is its last finite one.

The loss is every metric named ``loss`` or ``<...>/loss`` (the loss terms' and each objective's); the weights are
the trainable parameters (this process's shards under FSDP2). Every process agrees on the verdict, so all of them
stop together. The error is ``RunFailed``: the command line prints its message, without a traceback, and exits 1.
"""

from __future__ import annotations

import math

import torch

from flowalign.errors import RunFailed
from flowalign.training.checkpoint import latest_checkpoint
from flowalign.training.distributed import agreed

__all__ = ["check_finite", "non_finite"]


def non_finite(metrics: dict[str, float], weights: dict[str, torch.Tensor]) -> list[str]:
    """What is not finite: ``loss = nan``-style entries for the losses, then the first weights holding inf or NaN."""
    found = [f"{key} = {value}" for key, value in metrics.items()
             if (key == "loss" or key.endswith("/loss")) and not math.isfinite(value)]
    bad = [name for name, tensor in weights.items()
           if not bool(torch.isfinite(tensor.to_local() if hasattr(tensor, "to_local") else tensor).all())]
    if bad:
        found.append(f"{len(bad)} trainable weight tensor(s) hold inf or NaN (first: {bad[0]})")
    return found


def check_finite(trainer, iteration: int, metrics: dict[str, float]) -> None:
    """Raise ``RunFailed`` (on every process) when iteration ``iteration`` left a non-finite loss or weight."""
    found = non_finite(metrics, trainer.trainable_state())
    if not agreed(trainer.accelerator, bool(found)):
        return
    last = latest_checkpoint(trainer.out_dir)
    kept = (f"its last finite checkpoint is {last}: resume it with a lower optim.lr (or a smaller "
            "optim.max_grad_norm)" if last is not None else "no checkpoint was saved before it")
    raise RunFailed(f"the run diverged at iteration {iteration}: {'; '.join(found) or 'on another process'}. It "
                    f"stopped without logging or saving that iteration; {kept}")
