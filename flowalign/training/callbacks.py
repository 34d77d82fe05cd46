"""What a run reports as it goes: the progress bar, ``metrics.jsonl`` and the tracker, and the sample grids.

``RunLog`` is called by the trainer's loop at the start of the run, after every iteration and at the end; everything
it writes goes into the run's own directory, and only the main process writes. Every file is recorded before it
is written (``flowalign.training.run_files``: what ``train.overwrite`` may delete later); the tracker's files just
after it writes them.
"""

from __future__ import annotations

import json
from typing import Any


from flowalign.config import save_config, to_dict
from flowalign.outputs import write_atomically
from flowalign.training.run_directory import trim_metrics
from flowalign.training.run_files import RunFiles, TrackedFolder

# The folder under the run directory the tracker writes into (accelerate's project_dir / run name).
TRACKER_FOLDER = "flowalign"

__all__ = ["RunLog", "collapse_postfix", "flat_config", "summarize_records"]


class RunLog:
    """Progress bar, metrics (``train.log_every``, ``train.tracker``) and sample grids (``train.sample_every``)."""

    def __init__(self, trainer):
        self.trainer, self.config = trainer, trainer.config
        self.tracking = self.config.train.tracker != "none"
        self.bar, self.tracked = None, None
        self.files = RunFiles(trainer.out_dir)  # what train.overwrite may delete later: recorded before it is written

    def start(self) -> None:
        """Open the run's logs; where nobody configured logging (a notebook) the library's lines go to stdout, as on
        the command line (``flowalign.console``)."""
        from tqdm import tqdm

        from flowalign.console import show_library_logs

        show_library_logs(unless_configured=True)
        trainer, cfg = self.trainer, self.config
        trainer.checkpointer.clear_replaced_run()  # train.overwrite: the old run goes just before the first write
        if trainer.is_main:
            trainer.out_dir.mkdir(parents=True, exist_ok=True)
            self.files.record("config.yaml", "metrics.jsonl")
            with write_atomically(trainer.out_dir / "config.yaml") as tmp:
                save_config(cfg, tmp)
            trim_metrics(trainer.out_dir / "metrics.jsonl", trainer.iteration)
            self.tracked = TrackedFolder(self.files, trainer.out_dir / TRACKER_FOLDER)
        if self.tracking:
            from flowalign.training.tracker_media import tracker_init

            name, init_kwargs = tracker_init(cfg.train, trainer.out_dir / TRACKER_FOLDER)
            trainer.accelerator.init_trackers(name, config=flat_config(to_dict(cfg)), init_kwargs=init_kwargs)
            self.record_tracker_files()
        self.bar = tqdm(total=cfg.train.iterations, initial=trainer.iteration, desc="train",
                        disable=not trainer.is_main, dynamic_ncols=True)

    def iteration(self, metrics: dict[str, float], prompts: list[dict], batches, scores) -> None:
        trainer, cfg = self.trainer, self.config
        iteration = int(metrics["iteration"])
        if self.tracking:
            trainer.accelerator.log({k: v for k, v in metrics.items() if k != "iteration"}, step=iteration)
            self.record_tracker_files()
        if trainer.is_main and iteration % max(1, cfg.train.log_every) == 0:
            with open(trainer.out_dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(metrics) + "\n")
        if trainer.is_main and cfg.train.sample_every and iteration % cfg.train.sample_every == 0 and batches:
            self.save_samples(iteration, batches, scores)
        postfix = {"reward": f"{metrics['reward']:.3f}"} if "reward" in metrics else {}
        if trainer.parts.reads_reference() and "kl" in metrics:  # a KL to the reference is computed only for these
            postfix["kl"] = f"{metrics['kl']:.2e}"
        postfix.update(collapse_postfix(metrics))
        self.bar.set_postfix(postfix)
        self.bar.update(1)

    def save_samples(self, iteration: int, batches, scores) -> None:
        """A grid of this process's first 16 samples captioned ``prompt | reward``; a video model's is a grid video
        and a grid of frame strips (``save_sample_videos``)."""
        from flowalign.evaluation.images import save_grid

        metadata = [m for b in batches for m in b.sample_metadata][:16]
        captions = [f"{m['prompt']} | {float(r):.2f}" for m, r in zip(metadata, scores.display[:16])]
        name = f"samples/iteration-{iteration:06d}.png"
        if getattr(self.trainer.model, "modality", "image") == "video":
            self.save_sample_videos(iteration, scores.images[:16], captions)
            return
        self.files.record(name)
        save_grid(scores.images[:16], captions, self.trainer.out_dir / name, columns=8)
        if self.tracking:
            from flowalign.training.tracker_media import log_image

            log_image(self.trainer.accelerator, "samples", self.trainer.out_dir / name, iteration)
            self.record_tracker_files()

    def save_sample_videos(self, iteration: int, videos, captions: list[str]) -> None:
        """``samples/iteration-NNNNNN.mp4`` (the videos ``[N, F, 3, H, W]`` tiled per frame, at ``train.video_fps``,
        else the model's ``fps``, else 16) and ``.png`` (their frame strips of ``train.strip_frames`` frames,
        captioned); the grid video goes to the tracker as ``samples`` (``flowalign.training.tracker_videos``)."""
        from flowalign.evaluation.videos import DEFAULT_FPS, captioned_strips, grid_frames, write_mp4_frames

        if videos.dim() != 5:
            raise ValueError(f"a video model's samples must be [N, F, 3, H, W], got shape {list(videos.shape)}")
        train = self.config.train
        fps = train.video_fps if train.video_fps is not None else (getattr(self.trainer.model, "fps", None)
                                                                   or DEFAULT_FPS)
        name = f"samples/iteration-{iteration:06d}"
        self.files.record(f"{name}.mp4", f"{name}.png")
        mp4 = write_mp4_frames(grid_frames(videos, columns=4), self.trainer.out_dir / f"{name}.mp4", fps)
        captioned_strips(videos, captions, self.trainer.out_dir / f"{name}.png", max_frames=train.strip_frames,
                         columns=2)
        if self.tracking:
            from flowalign.training.tracker_videos import log_video

            log_video(self.trainer.accelerator, "samples", videos, fps=fps, step=iteration, mp4=mp4, columns=4)
            self.record_tracker_files()

    def record_tracker_files(self) -> None:
        """Record the files the tracker wrote into ``<run>/flowalign`` since the last look (main process)."""
        if self.tracked is not None:
            self.tracked.record_new()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def end(self, evaluation: dict | None = None, finished: bool = False) -> dict:
        """End the tracker, after giving it the final evaluation (``evaluation``: the before/after report, on the
        main process) at the last iteration's step: its two grids and its table. Returns the run's paths
        (``run_summary.run_paths``, on the main process; ``{}`` elsewhere), logged as a summary when ``finished``."""
        from flowalign.training.run_summary import log_run_summary, run_paths

        trainer, tracker = self.trainer, self.trainer.config.train.tracker
        if self.tracking:
            if evaluation is not None and trainer.is_main:
                self.log_evaluation(evaluation)
            trainer.accelerator.end_training()
            self.record_tracker_files()
        paths = run_paths(trainer.out_dir, tracker) if trainer.is_main else {}
        if trainer.is_main and finished:
            log_run_summary(paths, tracker)
        return paths

    def log_evaluation(self, report: dict) -> None:
        from flowalign.training.tracker_media import log_image, log_table

        accelerator, folder = self.trainer.accelerator, self.trainer.out_dir / "eval"
        step = max(0, self.trainer.iteration - 1)
        for name in ("grid_before", "grid_after"):
            if (folder / f"{name}.png").is_file():
                log_image(accelerator, f"eval/{name}", folder / f"{name}.png", step)
        rows = [[tag, e["mean_a"], e["mean_b"], e["diff"], e["se"], e["z"]]
                for tag, e in [*report["paired"]["tags"].items(), ("overall", report["paired"]["overall"])]]
        rows += [[f"reward/{name}", e["overall"]["mean_a"], e["overall"]["mean_b"], e["overall"]["diff"],
                  e["overall"]["se"], e["overall"]["z"]] for name, e in (report.get("rewards") or {}).items()]
        log_table(accelerator, "eval/before_after", (folder / "before_after.md").read_text(),
                  ["tag", "before", "after", "paired gain", "SE", "z"], rows, step)


def collapse_postfix(metrics: dict[str, float]) -> dict[str, str]:
    """The collapse metrics in the progress bar: ``div`` (within-group diversity), ``sat`` (saturated pixels) and
    ``held`` (the held-out reward)."""
    out = {}
    if "collapse/diversity" in metrics:
        out["div"] = f"{metrics['collapse/diversity']:.3f}"
    if "collapse/saturated_frac" in metrics:
        out["sat"] = f"{metrics['collapse/saturated_frac']:.3f}"
    held = [k for k in metrics if k.startswith("collapse/held_out/")]
    if held:
        out["held"] = f"{metrics[held[0]]:.3f}"
    return out


def flat_config(tree: dict, prefix: str = "") -> dict[str, Any]:
    """The config as flat ``{dotted key: scalar}`` for trackers (non-scalars as strings)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_config(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def summarize_records(records: list[dict], objective_records: dict[str, list[dict]],
                      norms: list[float]) -> dict[str, float]:
    """An update's metrics: the mean of every loss statistic over its micro-batches (the max of ``ratio_max``), the
    first micro-batch's ratio (exactly 1 when the rollout's log-probs are recomputed exactly), the mean gradient norm
    over its optimizer steps (``norms``) and each objective's mean statistics (``objectives/<name>/<stat>``). An
    objective-only run has no micro-batches: only the last two."""
    summary = {}
    if records:
        summary = {key: sum(r[key] for r in records) / len(records)
                   for key in records[0] if key not in ("epoch", "ratio_max")}
        summary["ratio_max"] = max(r["ratio_max"] for r in records)
        for key in ("ratio_max", "ratio_mean", "approx_kl", "clip_frac"):
            summary[f"first_{key}"] = records[0][key]  # approx_kl > 0 when training recomputes other log-probs
    summary["grad_norm"] = sum(norms) / max(1, len(norms))
    for name, rows in objective_records.items():
        for key in [k for k in (rows[0] if rows else {}) if k != "epoch"]:
            summary[f"objectives/{name}/{key}"] = sum(r[key] for r in rows) / len(rows)
    return summary
