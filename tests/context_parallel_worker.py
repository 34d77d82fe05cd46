"""The worker that trains the context-parallel runs of tests/test_context_parallel.py in one launch of N processes:
``train_runs(ROOT, OUT, NAMES)``, through tests/forked_launch.py on CPU, or as a script on GPUs
(bench/context_parallel.py):

    torchrun --standalone --nproc_per_node N tests/context_parallel_worker.py ROOT OUT NAME [NAME ...]

``ROOT`` holds the tiny models (tests/context_parallel_runs.py). For each run NAME every process trains one iteration
(``one_iteration``) into ``OUT/NAME``, and the main process writes its figures to ``OUT/NAME.safetensors`` together
with ``layout/parallel``: whether diffusers' parallel config is on every transformer (each expert of a pair, a full
fine-tune's reference). A run of two iterations then saves its first checkpoint, trains the second (checkpointed,
then its end-of-run evaluation when the run asks for one), and is resumed from its first checkpoint at the same layout
into ``OUT/NAME-resumed``; the job ``ring`` runs diffusers' ring attention over the processes
(tests/ring_attention.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from flowalign.cli.train import _leave_process_group
from flowalign.training.context_parallel import split_transformers

from context_parallel_runs import one_iteration, trainer_for
from ring_attention import ring_check


def save(figures: dict[str, torch.Tensor], out: Path, name: str) -> None:
    """The main process writes ``OUT/NAME.safetensors``."""
    if dist.get_rank() == 0:
        tmp = out / f".tmp-{name}-{os.getpid()}.safetensors"
        save_file({k: v.contiguous() for k, v in figures.items()}, str(tmp))
        os.replace(tmp, out / f"{name}.safetensors")


def train_runs(root: Path, out: Path, names: list[str]) -> None:
    for name in names:
        if name == "ring":
            save(ring_check(), out, name)
            continue
        trainer = trainer_for(root, name, out / name)
        figures = one_iteration(trainer)
        model = trainer.model  # every transformer split (each expert of a pair), a full fine-tune's reference too
        split = [t for top in [model.transformer] + ([model.reference_transformer] if model.full_finetune else [])
                 for t in split_transformers(top)]
        figures["layout/parallel"] = torch.tensor([all(t._parallel_config is not None for t in split)])
        save(figures, out, name)
        if trainer.config.train.iterations > 1:  # checkpointed, trained on, and resumed from its first checkpoint
            trainer.checkpointer.save()
            trainer.train()
            trainer_for(root, name, out / f"{name}-resumed",
                        **{"train.resume": str(out / name / "checkpoint-000001")}).train()


if __name__ == "__main__":
    train_runs(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
    # as flowalign.cli.train leaves a multi-process run: wait, tear the group down, exit without meeting gloo's threads
    _leave_process_group(SimpleNamespace(wait_for_everyone=dist.barrier))
