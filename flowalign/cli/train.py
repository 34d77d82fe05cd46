"""``flowalign train`` (RL fine-tuning).

It takes ``[CONFIG] [key=value ...]`` for a ``TrainConfig`` (``--a.b VALUE`` is the override ``a.b=VALUE``);
``train --resume CHECKPOINT|latest`` is ``train.resume``. DenseGRPO's calibration, which takes a ``TrainConfig`` too,
is ``flowalign prep calibrate`` (``flowalign.cli.prep``).
``train`` without a CONFIG reads ``configs/default.yaml`` (``DEFAULT_RUN``), the default run: the best method
measured at the toy world's 15-minute budget (``docs/results/default_run.md``). A CONFIG builds on ``TrainConfig``'s
own defaults, which are Flow-GRPO-Fast's settings.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from flowalign.deprecation import moved_names
from .options import ConfigCommand, add_config_command

__all__ = ["DEFAULT_RUN", "add_train"]

logger = logging.getLogger(__name__)

DEFAULT_RUN = "configs/default.yaml"  # relative to the working directory, like the toy world's assets/


def _run_train(config, args: argparse.Namespace) -> None:
    from flowalign.config import set_keys
    from flowalign.training.evaluation import eval_images_per_tag
    from flowalign.training.toy_defaults import check_world_is_named
    from flowalign.training.trainer import Trainer

    from .options import config_and_overrides

    path, overrides = config_and_overrides(args.items, DEFAULT_RUN)
    overrides += getattr(args, "flag_overrides", None) or []  # --reward.rewards VALUE, --resume
    check_world_is_named(config, set_keys(type(config), path, overrides), path)  # before anything loads
    # the final evaluation's size follows the run (flowalign.training.evaluation): a long command-line run's is full
    config.train.eval_images_per_tag = eval_images_per_tag(config, command_line=True)
    if int(os.environ.get("RANK", "0")) == 0:  # one process says it
        _show_changed_settings(config, path)
    trainer = Trainer(config)  # set-up: its mistakes are SetupErrors (exit 2)
    trainer.train()  # a failure from here on is no user error: it keeps its traceback
    # stopped by SIGINT/SIGTERM, checkpoint saved: the run did not finish, and the exit status says so (128 + signal)
    _leave_process_group(trainer.accelerator, 0 if trainer.stop_signal is None else 128 + trainer.stop_signal)


def _show_changed_settings(config, path: str | None) -> None:
    """Log the settings that differ from ``TrainConfig``'s defaults (Flow-GRPO-Fast's), before anything loads."""
    from flowalign.config import changed_settings, load_config

    lines = changed_settings(config, load_config(type(config), None, []))
    source = f"{path} and the command line" if path else "the command line"
    logger.info("%s", "\n".join([f"settings from {source} that differ from the defaults ({len(lines)}; all of them: "
                                  "--print-config):", *(f"  {line}" for line in lines)]))


def _leave_process_group(accelerator, status: int = 0) -> None:
    """Every process waits for the others, then the process group is torn down and a process of a multi-process run
    ends here with ``status``. A process that exits while another is still in a collective, or while gloo's threads
    are alive, aborts (SIGABRT, "terminate called without an active exception") instead of exiting 0; and even after
    ``destroy_process_group`` the interpreter's own exit (its C++ static destructors) sometimes still met a gloo
    thread and aborted a finished run. So, once its output and logs are flushed, such a process leaves with
    ``os._exit``: everything it wrote is closed by then (the trainer ended its tracker, every file is renamed into
    place), and the destructors have nothing left to do."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if status:
            raise SystemExit(status)
        return
    several = dist.get_world_size() > 1
    accelerator.wait_for_everyone()
    dist.destroy_process_group()
    if several:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if status:
        raise SystemExit(status)


def add_train(commands) -> None:
    add_config_command(
        commands, "train", ConfigCommand("flowalign.training.config:TrainConfig", _run_train, flags=False,
                                         aliases={"--resume": ("train.resume", "continue a run: a checkpoint or "
                                                                               "'latest'")},
                                         default_config=DEFAULT_RUN),
        help="RL fine-tuning; with no config, the toy-world default run (configs/default.yaml)",
        description="Fine-tune with a method preset. CONFIG is a YAML file (optional: without one, "
        f"{DEFAULT_RUN}, the default run); KEY=VALUE overrides use dotted keys, e.g. optim.lr=3e-4 "
        "train.seed=1.",
    )


# CalibrateOptions and add_calibrate moved to flowalign.cli.prep in 0.2: one release with a warning.
__getattr__ = moved_names(__name__, {name: f"flowalign.cli.prep:{name}" for name in ("CalibrateOptions",
                                                                                   "add_calibrate")})
