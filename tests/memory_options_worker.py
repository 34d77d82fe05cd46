"""A torchrun worker for tests/test_memory_options.py: several FSDP2 runs of the tiny SD3 in one launch.

    torchrun --standalone --nproc_per_node 4 tests/memory_options_worker.py MODEL OUT NAME=OVERRIDES ...

Each ``NAME=k1:v1,k2:v2`` trains the tests' FSDP2 settings (tests/test_fsdp2.py ``settings``) with those overrides
into ``OUT/NAME``, one after another in the same processes: starting the processes once is what keeps it cheap.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flowalign.cli.train import _leave_process_group
from test_fsdp2 import settings


def main(model: Path, out: Path, runs: list[str]) -> None:
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    trainer = None
    for run in runs:
        name, _, overrides = run.partition("=")
        extra = dict(item.split(":", 1) for item in overrides.split(",") if item)
        trainer = Trainer(load_config(TrainConfig, None, settings(model, out / name, **extra)))
        trainer.train()
    _leave_process_group(trainer.accelerator)  # as flowalign train leaves a multi-process run


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
