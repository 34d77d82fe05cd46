"""A diverging run stops: a loss, a trainable weight or a rollout sample that is no longer finite ends training
before that iteration is logged or saved, so the run's newest checkpoint is its last finite one.

The loss is every metric named ``loss`` or ``<...>/loss`` (the loss terms' and each objective's); the weights are
the trainable parameters (this process's shards under FSDP2); the samples are the rollout's final latents (weights
that grew huge but finite, ``optim.lr=1e30``, show first there: the policy's outputs overflow, and the update of that
iteration is skipped, so no loss is computed). Every process agrees on the verdict, so all of them
stop together. The error is ``RunStopped``: the command line prints its message, without a traceback, and exits 1.
"""

from __future__ import annotations

import math

import torch

from flowalign.errors import RunStopped
from flowalign.training.checkpoint_files import latest_checkpoint
from flowalign.training.collectives import agreed

__all__ = ["check_finite", "non_finite"]


def non_finite(metrics: dict[str, float], weights: dict[str, torch.Tensor], batches=()) -> list[str]:
    """What is not finite: the losses (``loss = nan``), the weights (how many tensors hold inf or NaN, the first
    one's name) and the rollout's final samples (the policy's outputs overflowed: the images are broken)."""
    found = [f"{key} = {value}" for key, value in metrics.items()
             if (key == "loss" or key.endswith("/loss")) and not math.isfinite(value)]
    local = {name: tensor.to_local() if hasattr(tensor, "to_local") else tensor for name, tensor in weights.items()}
    bad = [name for name, tensor in local.items() if not bool(torch.isfinite(tensor).all())]
    if bad:
        found.append(f"{len(bad)} trainable weight tensor(s) hold inf or NaN (first: {bad[0]})")
    samples = sum(int((~torch.isfinite(b.rollout.final.flatten(1))).any(1).sum()) for b in batches)
    if samples:
        largest = max((float(t.detach().abs().max()) for t in local.values() if t.numel()), default=float("nan"))
        found.append(f"{samples} of this process's rollout samples hold inf or NaN (the largest trainable weight "
                     f"is {largest:.3g})")
    return found


def check_finite(trainer, iteration: int, metrics: dict[str, float], batches=()) -> None:
    """Raise ``RunStopped`` (on every process) when iteration ``iteration`` left a non-finite loss, weight or sample."""
    found = non_finite(metrics, trainer.trainable_state(), batches)
    if not agreed(trainer.accelerator, bool(found)):
        return
    last = latest_checkpoint(trainer.out_dir)
    kept = (f"its last finite checkpoint is {last}: resume it with a lower optim.lr (or a smaller "
            "optim.max_grad_norm)" if last is not None else "no checkpoint was saved before it")
    raise RunStopped(f"the run diverged at iteration {iteration}: {'; '.join(found) or 'on another process'}. It "
                    f"stopped without logging or saving that iteration; {kept}")
