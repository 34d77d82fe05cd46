"""A training run's directory: what belongs to a run, and the checks that keep one run from touching another.

A run directory (``train.out_dir``) holds ``config.yaml``, ``metrics.jsonl``, ``checkpoint-<iteration>/``,
``samples/``, ``eval/`` and the tracker's logs. The rules, all checked before any model loads:

* A new run (no ``train.resume``) never writes into a directory that already holds a run. It stops with a message
  naming the directory and the three ways out: resume it (``--resume latest``), choose another ``train.out_dir``, or
  say ``train.overwrite=true``, which deletes that run's files (and only those) first.
* A resumed run continues the run whose checkpoint it loads. Into that checkpoint's own directory it must resume the
  newest checkpoint (an older one would overwrite the later checkpoints); into another directory, that directory
  must not hold a run either. Its ``metrics.jsonl`` keeps only the iterations before the checkpoint, so a resumed run
  writes the same file as an uninterrupted one.
* The checkpoint's config must equal this one except for the keys that do not change the math
  (``resumable_keys()`` of the config: what each section and component declares changes no math), and ``train.iterations`` may change only when nothing depends on the run's progress
  (``TrainConfig.progress_dependent``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from flowalign.training.checkpoint import CHECKPOINT_PATTERN, TEMPORARY_PREFIX, TRASH_PREFIX, latest_checkpoint
from flowalign.config import diff_configs, load_config, to_dict
from flowalign.errors import SetupError

__all__ = ["RUN_FILES", "check_new_run", "clear_run", "holds_run", "resolve_resume",
           "trim_metrics"]

# What a run writes into its directory (besides checkpoint-* and their .tmp-checkpoint-* and .trash-checkpoint-*
# siblings, written and deleted by a save).
RUN_FILES = ("config.yaml", "metrics.jsonl", "samples", "eval", "flowalign")


def _is_checkpoint(path: Path) -> bool:
    name = path.name.removeprefix(TEMPORARY_PREFIX).removeprefix(TRASH_PREFIX)
    return path.is_dir() and bool(CHECKPOINT_PATTERN.match(name))


def holds_run(directory: str | Path) -> bool:
    """True when ``directory`` holds a run's config, metrics or checkpoints."""
    directory = Path(directory)
    if not directory.is_dir():
        return False
    return any((directory / name).exists() for name in RUN_FILES[:2]) or any(
        _is_checkpoint(p) for p in directory.iterdir())


def clear_run(directory: str | Path) -> None:
    """Delete a run's files from ``directory`` (``RUN_FILES`` and checkpoints); anything else there is kept."""
    directory = Path(directory)
    for path in [directory / name for name in RUN_FILES] + [p for p in directory.iterdir() if _is_checkpoint(p)]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _occupied(directory: Path) -> SetupError:
    return SetupError(
        f"{directory} already holds a training run (config.yaml, metrics.jsonl or checkpoints): a new run would mix "
        "its files with that one. Either continue it with --resume latest (train.resume=latest), write the new run "
        "elsewhere with train.out_dir=DIR, or replace it with train.overwrite=true (deletes that run's files)")


def check_new_run(directory: str | Path, *, overwrite: bool) -> bool:
    """Refuse a new run into a directory holding a run unless ``overwrite``; True when there is a run to clear."""
    directory = Path(directory)
    if not holds_run(directory):
        return False
    if not overwrite:
        raise _occupied(directory)
    return True


def resolve_resume(where: str, config, out_dir: str | Path, *, progress_dependent: list[str]) -> Path:
    """The checkpoint ``where`` (a directory, or ``latest``: the newest whole ``checkpoint-N`` of ``out_dir``, never a
    ``.tmp-`` or ``.trash-`` one: ``latest_checkpoint``) names, checked against ``config``."""
    out_dir = Path(out_dir)
    checkpoint = latest_checkpoint(out_dir) if where == "latest" else Path(where)
    if checkpoint is None or not checkpoint.is_dir():
        raise FileNotFoundError(f"no checkpoint to resume from at {where!r} (run directory {out_dir})")
    if not (checkpoint / "config.yaml").is_file() or not (checkpoint / "state.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (it needs config.yaml and state.json)")
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    try:  # through the schema's migration, so a checkpoint written before a key moved compares by meaning
        resolved = to_dict(load_config(type(config), checkpoint / "config.yaml"))
    except SetupError as error:
        raise SetupError(f"checkpoint {checkpoint}: its config.yaml does not load: {error}") from None
    differences = diff_configs(resolved, to_dict(config), ignore=config.resumable_keys())
    if differences:
        raise SetupError(f"checkpoint {checkpoint} was made with a different config: " + "; ".join(differences))
    before = saved.get("train", {}).get("iterations")
    if before != config.train.iterations and progress_dependent:
        raise SetupError(
            f"train.iterations = {config.train.iterations} differs from the checkpoint's {before} ({checkpoint}), but "
            f"{', '.join(progress_dependent)} depend(s) on the run's progress (iteration / train.iterations): the "
            "resumed run would equal no uninterrupted run. Keep train.iterations at its value, or start a new run")
    if checkpoint.parent.resolve() == out_dir.resolve():
        newest = latest_checkpoint(out_dir)
        if newest is not None and newest.resolve() != checkpoint.resolve():
            raise SetupError(
                f"{checkpoint} is not the newest checkpoint of {out_dir} ({newest.name} is): resuming it there would "
                "overwrite the later checkpoints. Resume it into another directory with train.out_dir=DIR")
    elif holds_run(out_dir):
        raise _occupied(out_dir)
    return checkpoint


def trim_metrics(path: str | Path, iteration: int) -> None:
    """Keep the lines of ``metrics.jsonl`` before ``iteration`` (a resumed run rewrites the rest)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and int(json.loads(line)["iteration"]) < iteration]
    path.write_text("".join(line + "\n" for line in kept))
