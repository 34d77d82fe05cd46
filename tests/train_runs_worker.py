"""A torchrun worker that trains several runs, one after the other, in one launch of its processes.

    torchrun --standalone --nproc_per_node N tests/train_runs_worker.py RUNS.json

``RUNS.json`` is a list of ``{"config": PATH or null, "overrides": ["key=value", ...]}``; each is what
``flowalign train CONFIG key=value ...`` trains (``Trainer(load_config(TrainConfig, CONFIG, overrides)).train()``), in
the listed order, so a run may resume from a checkpoint an earlier one wrote. A process's start-up (torchrun, the
imports, the process group) costs more than a tiny run's two iterations, so the multi-process tests that compare
several configurations against one process start their processes once (``runs_in_the_background``) instead of once
a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

TESTS = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


@contextmanager
def runs_in_the_background(runs: list[tuple[str | None, list[str]]], workdir: Path, *, nproc: int = 2,
                           timeout: float = 900):
    """Train ``runs`` (``(config, overrides)`` pairs) on ``nproc`` CPU processes (gloo) in one torchrun launch while
    the ``with`` block runs (the one-process references, say); at its end, wait for the launch and fail with the tail
    of its output (``workdir/torchrun.log``) if it failed. A failure in the block kills the launch."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "runs.json"
    spec.write_text(json.dumps([{"config": config, "overrides": list(overrides)} for config, overrides in runs]))
    log = workdir / "torchrun.log"
    with open(log, "w") as output:
        launch = subprocess.Popen(
            [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), str(TESTS / "train_runs_worker.py"),
             str(spec)], env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}, stdout=output,
            stderr=subprocess.STDOUT)
        try:
            yield
            launch.wait(timeout=timeout)
        finally:
            if launch.poll() is None:
                launch.kill()
                launch.wait()
    assert launch.returncode == 0, log.read_text()[-4000:]


def main(spec: Path) -> None:
    from flowalign.cli.train import _leave_process_group
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.evaluation import eval_images_per_tag
    from flowalign.training.trainer import Trainer

    trainer = None
    for run in json.loads(spec.read_text()):
        config = load_config(TrainConfig, run["config"], run["overrides"])
        config.train.eval_images_per_tag = eval_images_per_tag(config, command_line=True)  # as the command line sizes it
        trainer = Trainer(config)
        trainer.train()
    # as flowalign.cli.train leaves a multi-process run: wait for the others, tear the group down, exit without the
    # interpreter's C++ destructors meeting a gloo thread
    _leave_process_group(trainer.accelerator)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
