"""Images and tables in the run's tracker (``train.tracker``), beside its scalars: the sample grid every
``train.sample_every`` iterations (``samples``), and at the end the before/after evaluation (its grids
``eval/grid_before`` and ``eval/grid_after``, and its table ``eval/before_after``: TensorBoard's Text tab shows the
Markdown, wandb gets a ``wandb.Table``). Only the main process has trackers (accelerate's ``init_trackers``).

``tracker_init`` gives ``init_trackers`` its project name and keyword arguments from ``train.project``,
``train.run_name`` and ``train.wandb_entity``: wandb's project, run name and entity, its files under the run's own
``flowalign/`` folder unless ``WANDB_DIR`` says otherwise (never a ``wandb/`` folder in the working directory);
TensorBoard's events in
``flowalign/<run_name>`` (``flowalign/`` without a run name, as before).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["log_image", "log_table", "tracker_init"]


def tracker_init(run, folder: Path) -> tuple[str, dict[str, dict]]:
    """``(project_name, init_kwargs)`` for ``accelerator.init_trackers`` (module docstring); ``run`` is the
    ``RunConfig``, ``folder`` the run's tracker folder (``<run>/flowalign``, the accelerator's project_dir/name)."""
    if run.tracker == "wandb":
        kwargs = {}
        if not os.environ.get("WANDB_DIR"):  # wandb's own setting, when the user gave one, is kept
            folder.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(folder)
        if run.run_name:
            kwargs["name"] = run.run_name
        if run.wandb_entity:
            kwargs["entity"] = run.wandb_entity
        return run.project, {"wandb": kwargs}
    name = folder.name if not run.run_name else f"{folder.name}/{run.run_name}"
    return name, {}


def log_image(accelerator: Any, tag: str, png: Path, step: int) -> None:
    """The image file ``png`` (a grid the run wrote) in every TensorBoard and wandb tracker at ``step``."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            import numpy as np
            from PIL import Image

            with Image.open(png) as image:
                pixels = np.asarray(image.convert("RGB"))
            tracker.writer.add_image(tag, pixels, global_step=step, dataformats="HWC")
            tracker.writer.flush()
        elif tracker.name == "wandb":
            import wandb

            tracker.log({tag: wandb.Image(str(png))}, step=step)


def log_table(accelerator: Any, tag: str, markdown: str, columns: list[str], rows: list[list[Any]],
              step: int) -> None:
    """A table in every TensorBoard (as Markdown text) and wandb (a ``wandb.Table`` of ``columns`` and ``rows``)
    tracker at ``step``."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.writer.add_text(tag, markdown, global_step=step)
            tracker.writer.flush()
        elif tracker.name == "wandb":
            import wandb

            tracker.log({tag: wandb.Table(columns=columns, data=rows)}, step=step)
