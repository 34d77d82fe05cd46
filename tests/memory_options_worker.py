"""The worker of tests/test_memory_options.py: several FSDP2 runs of the tiny SD3 in one launch of 4 processes
(tests/forked_launch.py), ``train_runs(MODEL, OUT, RUNS)``.

Each ``NAME=k1:v1,k2:v2`` trains the tests' FSDP2 settings (tests/test_fsdp2.py ``settings``) with those overrides
into ``OUT/NAME``, one after another in the same processes: starting the processes once is what keeps it cheap.
"""

from __future__ import annotations

from pathlib import Path

from test_fsdp2 import settings


def train_runs(model: Path, out: Path, runs: list[str]) -> None:
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    for run in runs:
        name, _, overrides = run.partition("=")
        extra = dict(item.split(":", 1) for item in overrides.split(",") if item)
        Trainer(load_config(TrainConfig, None, settings(model, out / name, **extra))).train()
