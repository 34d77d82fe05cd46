"""The toy video world's evaluation: sample the held-out video prompts, verify each clip exactly, summarise.

``run_video_eval(VideoEvalConfig(...))`` is what ``flowalign eval toy-video`` runs; it follows ``flowalign eval toy``
(``flowalign.evaluation.toy_eval``) step for step, with the toy video verifier (``flowalign.toy.video_reward``) in place
of the image detector's GenEval verdict:

* ``evaluate_videos``: ``toy_eval.generate`` (the same per-sample noise seeds, prompt-major rows, batching and sharding;
  a video model decodes ``[B, F, 3, H, W]``) + ``judge_videos``.
* ``judge_videos``: one result per clip, ``{prompt_id, prompt, tag, image_index, seed, correct, partial, checks,
  reason}``: ``correct`` is the verifier's binary verdict, ``checks`` its four checks (object, count, color,
  direction). ``image_index`` is the clip's index within its prompt (the name GenEval's results use, so that
  ``geneval.summarize`` and ``toy_eval.paired_difference`` read these rows as they read the image world's).
* ``check_rates``: the mean of each check per tag and overall (the per-check breakdown of ``summary.md``).

With ``--lora`` and ``--paired``, the reference (the LoRA switched off: the base model) is sampled on the same seeds
as well, and the paired before/after statistics of the image world's default run (``toy_eval.paired_difference``:
gain, standard error and z per tag and overall) are written as ``before_after.md`` / ``.json`` by
``flowalign.evaluation.before_after.write_before_after``, the writer of the trainer's own end-of-run evaluation;
``results.json`` adds the same statistics of the verifier's partial credit (``paired_partial``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from flowalign.config import ConfigError
from flowalign.devices import resolve_device
from flowalign.evaluation.geneval import format_table, summarize
from flowalign.evaluation.toy_eval import (SamplingRun, _batches, _is_int, _rows, generate, images_per_tag,
                                           paired_difference, sample_seed)
from flowalign.outputs import OutputFolder
from flowalign.settings import option, redefault

__all__ = [
    "DEFAULT_VIDEO_MODEL",
    "VideoEvalConfig",
    "check_rates",
    "default_video_prompts_path",
    "evaluate_videos",
    "judge_videos",
    "run_video_eval",
]

logger = logging.getLogger(__name__)

DEFAULT_VIDEO_MODEL = "assets/toy-wan"
STRIPS_MAX = 32
TOY_VIDEO_EVAL_OUTPUTS = ("results.json", "summary.md", "strips.png", "before_after.md", "before_after.json",
                          "grid_before.png", "grid_after.png")


def default_video_prompts_path() -> Path:
    """The held-out toy video prompt set, ``assets/prompts/video_test.jsonl``."""
    from flowalign.toy.prompts import PROMPT_ASSET_DIR
    from flowalign.toy.video_prompts import VIDEO_TEST_FILE

    return Path(PROMPT_ASSET_DIR) / VIDEO_TEST_FILE


@dataclass(kw_only=True)
class VideoEvalConfig(SamplingRun):
    """Settings of one toy video evaluation (``flowalign eval toy-video``); ``images_per_prompt`` counts clips.

    ``prompts`` defaults to the held-out ``assets/prompts/video_test.jsonl``, ``model`` to a ``--lora`` checkpoint's
    base model, else ``assets/toy-wan``. ``paired`` (needs ``lora``) also samples the reference (LoRA off) on the same
    seeds and writes the paired before/after statistics.
    """

    model: str | None = option(None, "diffusers video pipeline directory (default: a --lora checkpoint's model, else "
                               f"{DEFAULT_VIDEO_MODEL})")
    prompts: str | None = option(None, "toy video prompts jsonl (default: assets/prompts/video_test.jsonl)")
    images_per_tag: int | None = option(None, "tag-balanced: this many clips per tag, split evenly over its prompts "
                                        "(replaces images_per_prompt)")
    num_frames: int | None = option(5, "frames per clip: the toy clips' 5 (null: the model family's default)")
    paired: bool = option(False, "with --lora: also sample the base model (LoRA off) on the same seeds and write the "
                          "paired before/after gain, SE and z per tag (before_after.md)")
    steps: int = redefault(SamplingRun, "steps", 10)
    batch_size: int = redefault(SamplingRun, "batch_size", 16)
    out_dir: str = redefault(SamplingRun, "out_dir", "outputs/eval-toy-video")

    def validate(self) -> None:
        super().validate()
        if self.images_per_tag is not None and (not _is_int(self.images_per_tag) or self.images_per_tag < 1):
            raise ConfigError(f"images_per_tag must be an integer >= 1 (or None), got {self.images_per_tag!r}",
                              key="images_per_tag")
        if self.num_frames is not None and (not _is_int(self.num_frames) or self.num_frames < 2):
            raise ConfigError(f"num_frames must be an integer >= 2 (motion is read between frames), or None for the "
                              f"model's, got {self.num_frames!r}", key="num_frames")
        if self.paired and self.lora is None:
            raise ConfigError("--paired compares a trained LoRA with its base model: give the checkpoint with "
                              "--lora CHECKPOINT", key="paired")


def judge_videos(videos: Tensor, metadata_list: Sequence[Mapping[str, Any]], rows: Sequence[tuple[int, int]],
                 seed: int) -> list[dict]:
    """One result per clip of ``videos [N, F, 3, H, W]`` (row ``i`` is sample ``rows[i] = (prompt, index)``)."""
    from flowalign.toy.video_reward import ToyVideoReward

    if len(rows) != len(videos):
        raise ValueError(f"got {len(videos)} videos for {len(rows)} rows")
    if not len(rows):
        return []
    verdicts = ToyVideoReward().verdicts(videos, [metadata_list[p] for p, _ in rows])
    return [{"prompt_id": p, "prompt": metadata_list[p]["prompt"], "tag": metadata_list[p]["tag"], "image_index": k,
             "seed": sample_seed(seed, p, k), "correct": verdict["correct"], "partial": verdict["partial"],
             "checks": verdict["checks"], "reason": verdict["reason"]}
            for (p, k), verdict in zip(rows, verdicts)]


def evaluate_videos(model, metadata_list: Sequence[Mapping[str, Any]], *, steps: int = 10,
                    images_per_prompt: int | Sequence[int] = 4, guidance_scale: float = 1.0, seed: int = 0,
                    batch_size: int = 16, image_size: int | Sequence[int] | None = None,
                    shard: tuple[int, int] | None = None, progress: bool | None = None
                    ) -> tuple[list[dict], dict, Tensor]:
    """Generate and verify: ``(results, summary, videos)``, as ``toy_eval.evaluate`` is for images; ``summary`` is
    ``geneval.summarize(results)`` with ``checks`` (``check_rates``) added."""
    videos = generate(model, metadata_list, steps=steps, images_per_prompt=images_per_prompt,
                      guidance_scale=guidance_scale, seed=seed, batch_size=batch_size, image_size=image_size,
                      shard=shard, progress=progress)
    rows = [row for batch in _batches(_rows(len(metadata_list), images_per_prompt), batch_size, shard) for row in batch]
    results = judge_videos(videos, metadata_list, rows, seed)
    return results, (video_summary(results) if results else {}), videos


def check_rates(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean of each verifier check (and of ``partial``) per tag, and ``overall`` = the unweighted mean of the tags."""
    from flowalign.toy.video_reward import CHECKS

    per_tag: dict[str, list[Mapping[str, Any]]] = {}
    for result in results:
        per_tag.setdefault(result["tag"], []).append(result)
    keys = (*CHECKS, "partial")
    rates = {tag: {key: sum(float(r["partial"] if key == "partial" else r["checks"][key]) for r in rows) / len(rows)
                   for key in keys} for tag, rows in per_tag.items()}
    if rates:
        rates["overall"] = {key: sum(entry[key] for entry in rates.values()) / len(rates) for key in keys}
    return rates


def video_summary(results: Sequence[Mapping[str, Any]]) -> dict:
    """``geneval.summarize`` of the verdicts, with the per-check rates under ``checks``."""
    return {**summarize(results), "checks": check_rates(results)}


def checks_table(rates: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table of ``check_rates``: one row per tag, then overall."""
    from flowalign.toy.video_reward import CHECKS

    lines = ["| tag | " + " | ".join(CHECKS) + " | partial |", "|---|" + "---:|" * (len(CHECKS) + 1)]
    for tag, entry in rates.items():
        lines.append(f"| {tag} | " + " | ".join(f"{entry[key]:.3f}" for key in (*CHECKS, "partial")) + " |")
    return "\n".join(lines)


def _summary_markdown(config: VideoEvalConfig, summary: Mapping[str, Any], model: str, lora=None) -> str:
    allocation = (f"{config.images_per_tag} clips per tag" if config.images_per_tag
                  else f"{config.images_per_prompt} clips per prompt")
    return "\n".join([
        f"# Toy video verifier: {model}" + ("" if lora is None else f" + {lora.describe()}"), "",
        f"{config.steps} ODE steps, {allocation}, guidance {config.guidance_scale:g}, seed {config.seed}", "",
        format_table(summary), "", "Checks (share of frames for object, count and color; tracked motion for "
        "direction):", "", checks_table(summary["checks"]), ""])


def run_video_eval(config: VideoEvalConfig) -> dict:
    """Evaluate ``config.model`` on the toy video prompts; write ``results.json``, ``summary.md`` and ``strips.png``
    (and with ``paired`` the before/after files). Bad settings, a missing model, LoRA or prompt file are refused
    before the model loads. Returns the summary (with ``paired`` under that key when computed)."""
    from flowalign.errors import setup_phase
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.videos import captioned_strips
    from flowalign.lora_loading import base_model_path, load_model
    from flowalign.toy.video_reward import validate_video_metadata

    with setup_phase():
        config.validate()
        outputs = OutputFolder(Path(config.out_dir), TOY_VIDEO_EVAL_OUTPUTS, "flowalign eval toy-video")
        replacing = outputs.check(overwrite=config.overwrite)
        lora = config.lora_source()
        prompts_path = Path(config.prompts) if config.prompts is not None else default_video_prompts_path()
        if not prompts_path.is_file():
            raise FileNotFoundError(f"prompt file {str(prompts_path)!r} does not exist")
        metadata = load_metadata(prompts_path)
        for index, entry in enumerate(metadata):
            validate_video_metadata(entry, f"{prompts_path} entry {index}")
        if config.max_prompts is not None:
            metadata = metadata[: config.max_prompts]
        if not metadata:
            raise ValueError(f"prompt file {str(prompts_path)!r} has no prompts")
        model_path = base_model_path(config.model, lora, DEFAULT_VIDEO_MODEL)
        model = load_model(model_path, lora, dtype=config.dtype, device=str(resolve_device(config.device)))
        if getattr(model, "modality", "image") != "video":
            raise ValueError(f"--model {model_path!r} is an image model ({model.family}); flowalign eval toy-video "
                             "samples clips: give a video pipeline (e.g. assets/toy-wan), or use flowalign eval toy")
        if config.num_frames is not None:
            model.check_num_frames(config.num_frames)
            model.num_frames = config.num_frames

    counts = images_per_tag(metadata, config.images_per_tag) if config.images_per_tag else config.images_per_prompt
    kwargs = dict(steps=config.steps, images_per_prompt=counts, guidance_scale=config.guidance_scale,
                  seed=config.seed, batch_size=config.batch_size, image_size=config.resolution)
    results, summary, videos = evaluate_videos(model, metadata, **kwargs)
    paired = None
    if config.paired:
        with torch.no_grad(), model.reference():
            before, before_summary, before_videos = evaluate_videos(model, metadata, **kwargs)

    if replacing:
        outputs.replace_earlier()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.paired:
        from flowalign.evaluation.before_after import write_before_after

        paired = write_before_after(out, before, results, before_summary, summary,
                                    paired_difference(before, results), before_videos, videos,
                                    seed=config.seed, guidance_scale=config.guidance_scale)["paired"]
    record = {"config": {**asdict(config), "model": model_path, "prompts": str(prompts_path),
                         "lora_weights": None if lora is None else lora.weights},
              "summary": summary, "results": results}
    if paired is not None:
        record["paired"] = paired
        record["paired_partial"] = paired_difference(before, results, score="partial")
        summary = {**summary, "paired": paired, "paired_partial": record["paired_partial"]}
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    markdown = _summary_markdown(config, record["summary"], model_path, lora)
    (out / "summary.md").write_text(markdown, encoding="utf-8")
    shown = min(STRIPS_MAX, len(results))
    captions = [f"{r['prompt']} | {'yes' if r['correct'] else 'no'}" for r in results[:shown]]
    captioned_strips(videos[:shown], captions, out / "strips.png", columns=2)
    logger.info("%s", markdown.split("\n", 4)[-1].rstrip())
    return summary
