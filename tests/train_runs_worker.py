"""Several training runs, one after the other, in one launch of their processes (tests/forked_launch.py).

``runs_in_the_background(runs, workdir)`` trains each ``(config, overrides)`` pair as ``flowalign train CONFIG
key=value ...`` trains it (``Trainer(load_config(TrainConfig, CONFIG, overrides)).train()``, its evaluation sized as
the command line sizes it), in the listed order, so a run may resume from a checkpoint an earlier one wrote. A
process's start-up (the imports, the process group) costs more than a tiny run's two iterations, so the
multi-process tests that compare several configurations against one process start their processes once, instead of
once a run.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from forked_launch import in_the_background


@contextmanager
def runs_in_the_background(runs: list[tuple[str | None, list[str]]], workdir: Path, *, nproc: int = 2):
    """Train ``runs`` (``(config, overrides)`` pairs) on ``nproc`` CPU processes (gloo) in one launch while the
    ``with`` block runs (the one-process references, say); at its end, wait for the launch and fail with the tail of
    each process's output if it failed."""
    with in_the_background(nproc, train_runs, [(config, list(overrides)) for config, overrides in runs],
                           log_dir=workdir):
        yield


def train_runs(runs: list[tuple[str | None, list[str]]]) -> None:
    """A worker of ``runs_in_the_background``: every run, in order."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.evaluation import eval_images_per_tag
    from flowalign.training.trainer import Trainer

    for config_path, overrides in runs:
        config = load_config(TrainConfig, config_path, overrides)
        # the evaluation sized as the command line sizes it
        config.train.eval_images_per_tag = eval_images_per_tag(config, command_line=True)
        Trainer(config).train()
