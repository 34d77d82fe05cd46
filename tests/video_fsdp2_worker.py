"""A torchrun worker that trains every video family under FSDP2 in one launch (tests/test_video_distributed.py).

    torchrun --standalone --nproc_per_node 2 tests/video_fsdp2_worker.py ROOT OUT FAMILY [FAMILY ...]

``ROOT`` is a tests/video_training.py ``SharedVideoRuns`` root that already holds the families' saved pipelines and
the first-frame prompts. For each family, LoRA then full fine-tuning, every process trains the family's contract run
(the same config as the one-process run, with ``distributed.engine: fsdp2``) into ``OUT/NAME-FINETUNE``. Rank 0 also
writes ``OUT/sharded.json``: for each run, whether every transformer parameter (every expert's) was a DTensor sharded
over all the processes. Starting the processes once for every family is what keeps this cheap: a process's start-up
(imports, the process group) costs more than a family's two tiny runs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from video_training import FINETUNES, SharedVideoRuns


def sharded_over_the_world(module: torch.nn.Module) -> bool:
    """Every parameter of ``module`` is a DTensor on a mesh of all the processes, sharded (not replicated)."""
    from torch.distributed.tensor import DTensor, Shard

    return all(isinstance(p, DTensor) and p.device_mesh.size() == dist.get_world_size()
               and all(isinstance(placement, Shard) for placement in p.placements) for p in module.parameters())


def main(root: Path, out: Path, names: list[str]) -> None:
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    runs = SharedVideoRuns(root)
    sharded = {}
    trainer = None
    for name in names:
        for finetune in FINETUNES:
            key = f"{name}-{finetune}"
            values = runs.values(name, out / key, finetune, **{"distributed.engine": "fsdp2"})
            trainer = Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()]))
            sharded[key] = sharded_over_the_world(trainer.model.transformer)
            trainer.train()
    if dist.get_rank() == 0:
        tmp = out / f".tmp-sharded-{os.getpid()}.json"
        tmp.write_text(json.dumps(sharded, indent=1) + "\n")
        os.replace(tmp, out / "sharded.json")
    # as flowalign.cli.train leaves a multi-process run: wait for the others, tear the group down, and exit without
    # the interpreter's C++ destructors meeting a gloo thread
    trainer.accelerator.wait_for_everyone()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
