"""What ``Trainer.train()`` hands back and prints when a run ends: the metrics of every iteration together with the
final evaluation's report, and the paths a person opens next (the last checkpoint, the before/after table and grids,
the sample grids, the tracker's logs with the command that opens them)."""

from __future__ import annotations

import logging
from pathlib import Path

from flowalign.training.checkpoint_files import latest_checkpoint

__all__ = ["TrainResult", "log_run_summary", "run_paths"]

logger = logging.getLogger(__name__)


class TrainResult(list):
    """The metrics of every iteration run so far, one dict per iteration (a ``list``, as ``train()`` always returned),
    with the end of the run:

    * ``evaluation``: the final evaluation's report (``before_after.json``'s content: ``paired`` toy GenEval per tag,
      ``before``/``after`` summaries, ``rewards``: the run's own rewards' paired statistics, ``samples``, ``seed``),
      or None when the run did not evaluate (``train.eval_at_end=false``, a stopped run, a process other than the
      main one);
    * ``paths``: ``{name: Path}`` of what the run wrote (``run_paths``).
    """

    def __init__(self, history, evaluation: dict | None = None, paths: dict[str, Path] | None = None):
        super().__init__(history)
        self.evaluation = evaluation
        self.paths = paths or {}


def run_paths(out_dir: Path, tracker: str) -> dict[str, Path]:
    """The files and folders of a finished run that exist, by name: ``run``, ``checkpoint`` (the newest whole one),
    ``before_after`` (and ``grid_before``, ``grid_after``), ``samples``, ``tracker`` (the tracker's log folder)."""
    from flowalign.training.callbacks import TRACKER_FOLDER

    candidates = {"run": out_dir, "checkpoint": latest_checkpoint(out_dir) if out_dir.is_dir() else None,
                  "before_after": out_dir / "eval" / "before_after.md", "grid_before": out_dir / "eval" / "grid_before.png",
                  "grid_after": out_dir / "eval" / "grid_after.png", "samples": out_dir / "samples",
                  "tracker": out_dir / TRACKER_FOLDER if tracker != "none" else None}
    return {name: path for name, path in candidates.items() if path is not None and path.exists()}


def tracker_command(tracker: str, folder: Path) -> str:
    """The command that opens a tracker's logs."""
    if tracker == "tensorboard":
        return f"tensorboard --logdir {folder}"
    return f"wandb sync {folder / 'wandb'}/offline-run-*  (an offline run; an online one is on its wandb page)"


def log_run_summary(paths: dict[str, Path], tracker: str) -> None:
    """Log where the run's results are, one line each."""
    lines = [f"run finished: {paths['run']}"] if "run" in paths else []
    if "checkpoint" in paths:
        lines.append(f"  last checkpoint: {paths['checkpoint']}")
    if "before_after" in paths:
        grids = [str(paths[g]) for g in ("grid_before", "grid_after") if g in paths]
        lines.append(f"  before/after:    {paths['before_after']}" + (f" (grids: {', '.join(grids)})" if grids else ""))
    if "samples" in paths:
        lines.append(f"  sample grids:    {paths['samples']}")
    if "tracker" in paths:
        lines.append(f"  {tracker} logs: {paths['tracker']} (open with: {tracker_command(tracker, paths['tracker'])})")
    if lines:
        logger.info("%s", "\n".join(lines))
