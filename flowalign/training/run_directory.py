"""A training run's directory: what belongs to a run, and the checks that keep one run from touching another.

A run directory (``train.out_dir``) holds ``config.yaml``, ``metrics.jsonl``, ``checkpoint-<iteration>/``,
``samples/``, ``eval/`` and the tracker's logs. The rules, all checked before any model loads:

* A new run (no ``train.resume``) never writes into a directory that already holds a run. It stops with a message
  naming the directory and the three ways out: resume it (``--resume latest``), choose another ``train.out_dir``, or
  say ``train.overwrite=true``, which deletes that run's files (and only those: its checkpoints and the files it
  recorded as written, ``flowalign.training.run_files``), after every input of the new run has been checked, just
  before the new run writes its first file.
* ``train.out_dir`` is a folder that can be written and no source tree or repository root (``check_out_dir``).
* A resumed run continues the run whose checkpoint it loads. Into that checkpoint's own directory it must resume the
  newest checkpoint (an older one would overwrite the later checkpoints); into another directory, that directory
  must not hold a run either. Its ``metrics.jsonl`` keeps only the iterations before the checkpoint, so a resumed run
  writes the same file as an uninterrupted one (rewritten whole; a torn last line is dropped with a warning, a corrupt
  line elsewhere refused naming the file and line).
* The checkpoint's config must equal this one except for the keys that do not change the math
  (``resumable_keys()`` of the config: what each section and component declares changes no math), and
  ``train.iterations`` may change only when nothing depends on the run's progress
  (``TrainConfig.progress_dependent``), and never to less than the checkpoint's iteration: such a run has nothing
  to train, and its ``config.yaml`` would no longer describe the iterations its metrics and checkpoints hold.
* The checkpoint's files that can be checked without a model are: ``state.json`` reads, a sharded checkpoint's
  ``.metadata`` passes the allow-list (``flowalign.sharded_reading``), and a run with EMA finds the checkpoint's EMA
  (``ema.safetensors``, or the ``ema`` part of ``sharded/``) unless ``train.restart_ema`` asks for a fresh one.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import yaml

from flowalign.training.checkpoint_files import (CHECKPOINT_PATTERN, EMA_FILE, TEMPORARY_PREFIX, TRASH_PREFIX,
                                                 holds_ema, latest_checkpoint, read_run_state)
from flowalign.config import diff_configs, load_config, to_dict
from flowalign.errors import SetupError
from flowalign.outputs import check_writable_dir, write_atomically
from flowalign.training.run_files import RECORD, RunFiles

logger = logging.getLogger(__name__)

__all__ = ["RUN_FILES", "SOURCE_MARKERS", "check_new_run", "check_out_dir", "clear_run", "holds_run", "metric_lines",
           "read_metrics", "resolve_resume", "trim_metrics"]

# The files whose presence marks a directory as holding a run (besides checkpoint-* and their .tmp-checkpoint-* and
# .trash-checkpoint-* siblings, written and deleted by a save).
RUN_FILES = ("config.yaml", "metrics.jsonl", RECORD)

# What marks a directory as a source tree or a repository root, which a run never writes into.
SOURCE_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg", "__init__.py")


def _is_checkpoint(path: Path) -> bool:
    name = path.name.removeprefix(TEMPORARY_PREFIX).removeprefix(TRASH_PREFIX)
    return path.is_dir() and bool(CHECKPOINT_PATTERN.match(name))


def holds_run(directory: str | Path) -> bool:
    """True when ``directory`` holds a run's config, metrics, record of files or checkpoints."""
    directory = Path(directory)
    if not directory.is_dir():
        return False
    return any((directory / name).exists() for name in RUN_FILES) or any(
        _is_checkpoint(p) for p in directory.iterdir())


def clear_run(directory: str | Path) -> None:
    """Delete a run's files from ``directory``: its checkpoints and the files it recorded as written
    (``flowalign.training.run_files``); anything else there is kept."""
    directory = Path(directory)
    for path in [p for p in directory.iterdir() if _is_checkpoint(p)]:
        shutil.rmtree(path)
    RunFiles(directory).delete()


def check_out_dir(directory: str | Path) -> None:
    """Refuse, before anything loads, a ``train.out_dir`` that cannot take a run: a file, a path under a file, a
    folder that cannot be written, or a source tree: a directory holding ``.git``, ``pyproject.toml``, ``setup.py``,
    ``setup.cfg`` or ``__init__.py``, or a Python package (a subfolder with ``__init__.py``). A run writes
    ``config.yaml``, ``samples/``, ``eval/`` and the tracker's ``flowalign/`` there, which in a repository's root are
    its own files."""
    directory = Path(directory)
    check_writable_dir(directory, key="train.out_dir")
    if not directory.is_dir():
        return
    found = [name for name in SOURCE_MARKERS if (directory / name).exists()]
    found += sorted(f"{p.name}/ (a Python package)" for p in directory.iterdir()
                    if p.is_dir() and (p / "__init__.py").is_file())[:3]
    if found:
        raise SetupError(
            f"train.out_dir = {str(directory)!r} is a source tree or a repository root (it holds {', '.join(found)}): "
            "a run writes config.yaml, samples/, eval/ and the tracker's flowalign/ into its directory, so it never "
            "runs there. Choose a run directory of its own, e.g. train.out_dir=outputs/train")


def _occupied(directory: Path) -> SetupError:
    from flowalign.console import callers_words

    ways = callers_words(
        "Either continue it with --resume latest (train.resume=latest), write the new run elsewhere with "
        "train.out_dir=DIR, or replace it with train.overwrite=true (deletes that run's files)",
        "Either continue it with config.train.resume = \"latest\", write the new run elsewhere with "
        "config.train.out_dir = \"DIR\", or replace it with config.train.overwrite = True (deletes that run's files); "
        "then build the Trainer again")
    return SetupError(f"{directory} already holds a training run (config.yaml, metrics.jsonl or checkpoints): a new "
                      f"run would mix its files with that one. {ways}")


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
    done = int(read_run_state(checkpoint, require=("history",))["iteration"])  # a corrupt one named before loading
    if (checkpoint / "sharded").is_dir():  # and a .metadata outside the allow-list (flowalign.sharded_reading)
        from flowalign.sharded_reading import read_sharded_metadata

        read_sharded_metadata(checkpoint / "sharded" / ".metadata")
    check_ema(checkpoint, config)
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
    if done > config.train.iterations:
        raise SetupError(
            f"{checkpoint} is at iteration {done}, past train.iterations = {config.train.iterations}: there is "
            f"nothing to train, and the run's config.yaml would no longer describe its {done} iterations. Resume "
            f"with train.iterations >= {done}, or evaluate or export the checkpoint as it is")
    if checkpoint.parent.resolve() == out_dir.resolve():
        metric_lines(out_dir / "metrics.jsonl", warn=False)  # a corrupt line is refused here, before the model loads
        newest = latest_checkpoint(out_dir)
        if newest is not None and newest.resolve() != checkpoint.resolve():
            raise SetupError(
                f"{checkpoint} is not the newest checkpoint of {out_dir} ({newest.name} is): resuming it there would "
                "overwrite the later checkpoints. Resume it into another directory with train.out_dir=DIR")
    elif holds_run(out_dir):
        raise _occupied(out_dir)
    return checkpoint


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl`` (``metric_lines``)."""
    return [row for _, row in metric_lines(path)]


def metric_lines(path: str | Path, *, warn: bool = True) -> list[tuple[str, dict]]:
    """``(line, row)`` of a run's ``metrics.jsonl``. A torn last line (a crash while it was appended) is dropped with
    a warning; a line that is no JSON object with an ``iteration`` anywhere else is a SetupError naming the file and
    the line: the file is no longer the run's record, and resuming would build on it."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            int(row["iteration"])
        except (ValueError, KeyError, TypeError) as error:
            if number == len(lines):
                if warn:
                    logger.warning("%s: dropping its torn last line %d (%s): a crash while it was written", path,
                                   number, error)
                break
            raise SetupError(f"{path}, line {number}, is corrupt ({error}): only a torn last line is dropped on "
                             "resume; repair or remove that line, or start a new run") from None
        rows.append((line, row))
    return rows


def check_ema(checkpoint: Path, config) -> None:
    """A run with EMA resumes the checkpoint's EMA: refuse a checkpoint without one (``holds_ema``; a sharded
    checkpoint's ``.metadata`` is read through the allow-list here), unless ``train.restart_ema``."""
    if not config.optim.ema_decay > 0 or holds_ema(checkpoint) or config.train.restart_ema:
        return
    missing = (f"{str(checkpoint / 'sharded' / '.metadata')!r} lists no EMA (ema.*)" if (checkpoint / "sharded").is_dir()
               else f"{str(checkpoint / EMA_FILE)!r} is missing")
    raise SetupError(
        f"{missing}, but this run keeps an EMA (optim.ema_decay = {config.optim.ema_decay}): resuming would restart "
        "the EMA silently, and eval and export would read that restart as the run's EMA. Restore the file, resume "
        "another checkpoint, or say train.restart_ema=true to start a fresh EMA from the resumed weights")


def trim_metrics(path: str | Path, iteration: int) -> None:
    """Keep the lines of ``metrics.jsonl`` before ``iteration`` (a resumed run rewrites the rest); the file is
    rewritten whole, through a temporary file renamed into place (``metric_lines``: a torn last line)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [line for line, row in metric_lines(path) if int(row["iteration"]) < iteration]
    with write_atomically(path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))
