"""``flowalign train`` (RL fine-tuning) and ``flowalign calibrate`` (DenseGRPO's per-step noise calibration).

Both take ``[CONFIG] [key=value ...]`` for a ``TrainConfig`` (``--a.b VALUE`` is the override ``a.b=VALUE``);
``train --resume CHECKPOINT|latest`` is ``train.resume``. ``calibrate``'s own options are ``CalibrateOptions``.
``train`` without a CONFIG reads ``configs/default.yaml`` (``DEFAULT_RUN``), the default run: the best method
measured at the toy world's 15-minute budget (``docs/results/default_run.md``). A CONFIG builds on ``TrainConfig``'s
own defaults, which are Flow-GRPO-Fast's settings.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

from flowalign.settings import at_least, finite, option

from .options import ConfigCommand, add_config_command

__all__ = ["DEFAULT_RUN", "CalibrateOptions", "add_calibrate", "add_train"]

DEFAULT_RUN = "configs/default.yaml"  # relative to the working directory, like the toy world's assets/


@dataclass
class CalibrateOptions:
    """``flowalign calibrate``'s own settings (the rest of its command line is the training config)."""

    out: str = option(None, "the calibrated config to write (YAML)")
    rounds: int = option(10, "calibration rounds")
    eps1: float = option(2.0, "sign-balance tolerance")
    eps2: float = option(0.01, "noise-level step per round")

    def validate(self) -> None:
        from flowalign.settings import check

        check(self.out is not None, "out", "is required: give --out FILE")
        at_least("rounds", self.rounds, 1)
        finite("eps1", self.eps1, 0)
        finite("eps2", self.eps2, 0)


def _run_train(config, args: argparse.Namespace) -> None:
    from flowalign.config import set_keys
    from flowalign.training.toy_defaults import check_world_is_named
    from flowalign.training.trainer import Trainer

    from .options import config_and_overrides

    path, overrides = config_and_overrides(args.items, DEFAULT_RUN)
    overrides += getattr(args, "flag_overrides", None) or []  # --reward.rewards VALUE, --resume
    check_world_is_named(config, set_keys(type(config), path, overrides), path)  # before anything loads
    trainer = Trainer(config)  # set-up: its mistakes are SetupErrors (exit 2)
    trainer.train()  # a failure from here on is no user error: it keeps its traceback
    # stopped by SIGINT/SIGTERM, checkpoint saved: the run did not finish, and the exit status says so (128 + signal)
    _leave_process_group(trainer.accelerator, 0 if trainer.stop_signal is None else 128 + trainer.stop_signal)


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


def _run_calibrate(config, args: argparse.Namespace) -> None:
    from flowalign.training.calibrate import calibrate, write_calibrated_config

    from .options import config_and_overrides

    options = args.options
    path, overrides = config_and_overrides(args.items)
    levels, history = calibrate(config, rounds=options.rounds, eps1=options.eps1, eps2=options.eps2)
    from accelerate import PartialState

    state = PartialState()
    if not state.is_main_process:  # every process holds the same levels; the main one writes them
        _leave_process_group(state)
        return
    out = write_calibrated_config(options.out, levels, history, base=path, overrides=overrides, eps1=options.eps1,
                                  eps2=options.eps2)
    print(f"wrote {out}: sampling.noise_table = {levels}")
    _leave_process_group(state)


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


def add_calibrate(commands) -> None:
    add_config_command(
        commands, "calibrate", ConfigCommand("flowalign.training.config:TrainConfig", _run_calibrate, options=CalibrateOptions),
        help="calibrate per-step noise levels (DenseGRPO) and write them as a train config",
        description="Sample trajectories with the training config, score the ODE completion of every state, and "
        "move each stochastic step's noise level up (signs of dR balanced) or down (unbalanced); the result is a "
        "YAML config with sampling.noise_table for `flowalign train`.",
    )
