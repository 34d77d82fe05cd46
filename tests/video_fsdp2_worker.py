"""The worker that trains every video family under FSDP2 in one launch of 2 processes (tests/test_video_distributed.py,
through tests/forked_launch.py): ``train_every_family(ROOT, OUT, RUNS)``.

``ROOT`` is a tests/video_training.py ``SharedVideoRuns`` root that already holds the families' saved pipelines and
the first-frame prompts. For each ``(NAME, FINETUNE)`` of ``RUNS`` (``lora`` or ``full``), every process trains the
family's contract run (the same config as the one-process run, with ``distributed.engine: fsdp2``) into
``OUT/NAME-FINETUNE``. Rank 0 also
writes ``OUT/sharded.json``: for each run, whether every transformer parameter (every expert's) was a DTensor sharded
over all the processes. Starting the processes once for every family is what keeps this cheap: a process's start-up
(the process group, a family's imports) costs more than a family's tiny runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from video_training import SharedVideoRuns


def sharded_over_the_world(module: torch.nn.Module) -> bool:
    """Every parameter of ``module`` is a DTensor on a mesh of all the processes, sharded (not replicated)."""
    from torch.distributed.tensor import DTensor, Shard

    return all(isinstance(p, DTensor) and p.device_mesh.size() == dist.get_world_size()
               and all(isinstance(placement, Shard) for placement in p.placements) for p in module.parameters())


def train_every_family(root: Path, out: Path, runs: list[tuple[str, str]]) -> None:
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    shared = SharedVideoRuns(root)
    sharded = {}
    for name, finetune in runs:
        key = f"{name}-{finetune}"
        values = shared.values(name, out / key, finetune, **{"distributed.engine": "fsdp2"})
        trainer = Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()]))
        sharded[key] = sharded_over_the_world(trainer.model.transformer)
        trainer.train()
    if dist.get_rank() == 0:
        tmp = out / f".tmp-sharded-{os.getpid()}.json"
        tmp.write_text(json.dumps(sharded, indent=1) + "\n")
        os.replace(tmp, out / "sharded.json")
