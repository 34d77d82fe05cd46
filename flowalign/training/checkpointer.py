"""A run's directory and checkpoints, for the trainer: refuse to write into another run, resume a checkpoint
(checked against the config, through the config migration for checkpoints written before it), save atomically.

The checkpoint format is ``flowalign.training.checkpoint_files``'s; the rules for run directories are
``flowalign.training.run_directory``'s.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import yaml

from flowalign.config import to_saved_dict
from flowalign.training.checkpoint_files import (begin_checkpoint, checkpoint_paths, finish_checkpoint, holds_ema,
                                                 load_checkpoint, load_component_tensors, load_copies, load_run_state,
                                                 rng_rekeying, save_process_rng, saved_processes,
                                                 write_checkpoint_files, write_run_files)
from flowalign.training.collectives import together, world_of
from flowalign.training.kill_points import kill_point
from flowalign.training.run_directory import check_new_run, check_out_dir, clear_run, resolve_resume

__all__ = ["Checkpointer"]

logger = logging.getLogger(__name__)


def _optimizer(optimizer):
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer  # accelerate's wrapper


class Checkpointer:
    """The checkpoints of ``trainer``'s run directory ``train.out_dir``."""

    def __init__(self, trainer):
        self.trainer = trainer

    def check_run_directory(self) -> Path | None:
        """The checkpoint ``train.resume`` names (checked against this config), or None for a new run, which may not
        write into a directory holding another run; ``train.overwrite`` marks it to be cleared by
        ``clear_replaced_run``, once every input has been checked."""
        trainer = self.trainer
        cfg = trainer.config.train
        check_out_dir(trainer.out_dir)
        self.replaces_run = False
        if cfg.resume:
            return resolve_resume(cfg.resume, trainer.config, trainer.out_dir,
                                  progress_dependent=trainer.config.progress_dependent())
        self.replaces_run = check_new_run(trainer.out_dir, overwrite=cfg.overwrite)
        return None

    def clear_replaced_run(self) -> None:
        """Delete the run ``train.overwrite`` replaces (its checkpoints and recorded files), just before the new run
        writes its first file: a mistake found at set-up leaves the old run whole."""
        trainer = self.trainer
        if getattr(self, "replaces_run", False):
            if trainer.is_main:
                clear_run(trainer.out_dir)
            self.replaces_run = False
            trainer.accelerator.wait_for_everyone()

    def run_state(self) -> tuple[dict, str]:
        trainer = self.trainer
        last = trainer.last_advantages
        state = {"history": trainer.history, "last_advantages": None if last is None else last.tolist(),
                 "optimizer_steps": trainer.optimizer_steps, "processes": world_of(trainer.accelerator).num_processes}
        values, _ = self.component_state()
        if values:
            state["components"] = values
        return state, yaml.safe_dump(to_saved_dict(trainer.config), sort_keys=False)

    def component_state(self) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
        """The components' ``state_dict()``s: ``(JSON values by section, tensors keyed <section>/<key>)``."""
        values, tensors = {}, {}
        for section, part in self.trainer.parts.named().items():
            for key, value in part.state_dict().items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{section}/{key}"] = value
                else:
                    values.setdefault(section, {})[key] = value
        return values, tensors

    def load_component_state(self, checkpoint, state: dict) -> None:
        """Give each component back what it saved (``state.json``'s ``components`` and ``components.safetensors``)."""
        values, tensors = state.get("components", {}), load_component_tensors(checkpoint)
        for section, part in self.trainer.parts.named().items():
            saved = dict(values.get(section, {}))
            saved.update({key[len(section) + 1:]: tensor for key, tensor in tensors.items()
                          if key.startswith(section + "/")})
            if saved or part.state_dict():
                if not saved:
                    raise ValueError(f"checkpoint {checkpoint} holds no state for {section} (written before it kept "
                                     "any?): it cannot resume this run")
                part.load_state_dict(saved)

    def save(self) -> Path | None:
        """Write ``checkpoint-<iteration>``; returns its path on the main process.

        The protocol (docs/concepts/reliability.md): the main process creates ``.tmp-checkpoint-N``; every process
        writes its files into it (the main process the weights, optimizer and run files, every process its
        ``rng-<rank>.pt``; a sharded run first its shards); the processes agree that every write succeeded; only
        then does the main process rename it to ``checkpoint-N`` and prune the old ones; they agree again. A
        failure on any process (``together``) ends every process with the error."""
        trainer = self.trainer
        accelerator, iteration, rank = trainer.accelerator, trainer.iteration, world_of(trainer.accelerator).process_index
        final, tmp = checkpoint_paths(trainer.out_dir, iteration)
        what = f"saving {final}"
        with together(accelerator, what):
            if trainer.is_main:
                begin_checkpoint(tmp)
        try:
            if trainer.engine.sharded:  # collectives first: torch.distributed.checkpoint reports its own failures
                trainer.engine.save(trainer, tmp / "sharded")
                kill_point("sharded", iteration, rank)
                exported = trainer.engine.export_state(trainer)  # gathered onto the main process
                kill_point("exported", iteration, rank)
            with together(accelerator, what):
                if trainer.engine.sharded:
                    save_process_rng(tmp, rank, iteration)
                    if trainer.is_main:
                        state, config_yaml = self.run_state()
                        write_run_files(tmp, iteration, state, config_yaml, self.component_state()[1])
                        trainer.model.save_trained(tmp, state_dict=exported)
                        kill_point("model", iteration)
                elif trainer.is_main:
                    state, config_yaml = self.run_state()
                    write_checkpoint_files(
                        tmp, iteration, trainable=trainer.trainable_state(), optimizer=_optimizer(trainer.optimizer),
                        state=state, config_yaml=config_yaml,
                        ema=trainer.ema.state_dict() if trainer.ema is not None else None,
                        write_model=trainer.model.save_trained, copies=trainer.copies.state_dict() or None,
                        component_tensors=self.component_state()[1])
                else:
                    save_process_rng(tmp, rank, iteration)
        except BaseException:
            if trainer.is_main:  # free what it holds (a full disk); a later save starts it afresh anyway
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        kill_point("written", iteration, rank)
        with together(accelerator, what):
            if trainer.is_main:
                finish_checkpoint(tmp, final, trainer.config.train.keep_checkpoints)
        kill_point("saved", iteration, rank)
        return final if trainer.is_main else None

    def rng_layout(self, checkpoint: str | Path) -> dict:
        """What ``restore_process_rng`` needs of this run; logs, once, how the RNG streams are re-keyed when the
        checkpoint was saved at another process count."""
        trainer = self.trainer
        processes, checkpoint = world_of(trainer.accelerator).num_processes, Path(checkpoint)
        saved = saved_processes(checkpoint, json.loads((checkpoint / "state.json").read_text()))
        if saved != processes and trainer.is_main:
            logger.warning(rng_rekeying(checkpoint, saved, processes))
        return {"processes": processes, "seed": trainer.config.train.seed}

    def resume(self, checkpoint: str | Path) -> None:
        """Load the trainable weights, EMA, optimizer, RNG and history of ``checkpoint`` (checked at set-up)."""
        trainer = self.trainer
        if trainer.engine.sharded:
            checkpoint = Path(checkpoint)
            if not (checkpoint / "sharded").is_dir():
                raise ValueError(f"{checkpoint} was written by distributed.engine: ddp (no sharded/ folder): resume "
                                 "it with distributed.engine: ddp")
            has_ema = holds_ema(checkpoint)
            trainer.engine.load(trainer, checkpoint / "sharded", ema=has_ema)
            if trainer.ema is not None and not has_ema:
                restart_ema(trainer, checkpoint)
            state = load_run_state(checkpoint, world_of(trainer.accelerator).process_index, **self.rng_layout(checkpoint))
            trainer.iteration, trainer.history = int(state["iteration"]), state["history"]
            trainer.optimizer_steps = optimizer_steps(state, trainer.config)
            self.load_component_state(checkpoint, state)
            return
        state, ema = load_checkpoint(checkpoint, trainable=trainer.trainable_state(),
                                     optimizer=_optimizer(trainer.optimizer), rank=world_of(trainer.accelerator).process_index,
                                     **self.rng_layout(checkpoint))
        if trainer.ema is not None and ema is not None:  # onto each parameter's device and dtype (CUDA runs)
            trainer.ema.load_state_dict(ema)
        elif trainer.ema is not None:
            restart_ema(trainer, checkpoint)
        if trainer.copies:
            copies = load_copies(checkpoint)
            if copies is None:
                raise ValueError(f"{checkpoint} holds no policy copies, which this run's components keep")
            trainer.copies.load_state_dict(copies)
        trainer.iteration = int(state["iteration"])
        trainer.history = state["history"]
        trainer.optimizer_steps = optimizer_steps(state, trainer.config)
        self.load_component_state(checkpoint, state)


def restart_ema(trainer, checkpoint) -> None:
    """A fresh EMA from the resumed weights, for a checkpoint without one (``train.restart_ema``: the set-up refused
    such a checkpoint otherwise)."""
    if not trainer.config.train.restart_ema:  # the set-up's check (run_directory.check_ema) was bypassed
        raise ValueError(f"{checkpoint} holds no EMA, which this run keeps: say train.restart_ema=true to start a "
                         "fresh one from the resumed weights")
    logger.warning("%s holds no EMA: train.restart_ema starts a fresh one from the resumed weights", checkpoint)
    trainer.ema.load_state_dict(trainer.trainable_state())


def optimizer_steps(state: dict, config) -> int:
    """The optimizer steps a checkpoint's run took: recorded since policy copies need them, else counted from its
    history (``optim.inner_epochs * optim.minibatches`` per iteration that was not skipped)."""
    if "optimizer_steps" in state:
        return int(state["optimizer_steps"])
    per_iteration = config.optim.inner_epochs * config.optim.minibatches
    return sum(per_iteration for metrics in state["history"] if not metrics.get("skipped", 0.0))
