"""The held-out evaluation at the end of a run: toy GenEval of the reference (LoRA off) and of the trained policy (its
EMA when on) on identical captions and seeds, with the paired gain, its standard error and z per tag. Both are
sampled at the run's own guidance (``train.eval_guidance``, else ``sampling.guidance_scale``). A video model is
judged by the toy video world's verifier instead (``flowalign.evaluation.toy_video_eval.evaluate_videos``), with the
same paired statistics; its grids show each clip's frames side by side.

The same images are scored by the run's own rewards (every image reward of ``reward.rewards``, or the callables
given to the trainer; a latent reward is left out, the evaluation has no latents), each with the same paired
statistics: ``before_after.md``'s second table and ``before_after.json``'s ``rewards``.

Its size follows the run (``eval_images_per_tag``): ``train.eval_images_per_tag`` when set; else a run of at least
``SHORT_RUN`` iterations started from the command line gets the full evaluation (``FULL_PER_TAG`` images per tag:
the default run's), and a shorter run, or any run started from Python, the small one (``SMALL_PER_TAG``).

Before it starts, one log line gives the number of images and an estimated time (from the run's own rollout speed),
then a progress bar counts them. With several processes each one samples its share of the evaluation's batches
(whole batches, so every image is computed exactly as on one process) through the unwrapped transformer, whose
forward has no collectives; the main process gathers the verdicts and writes ``eval/before_after.md`` / ``.json``
and the two grids.
"""

from __future__ import annotations

import logging
import math

import torch

from flowalign.evaluation.before_after import write_before_after
from flowalign.evaluation.geneval import load_metadata
from flowalign.evaluation.toy_eval import SMALL_PER_TAG
from flowalign.training.collectives import gather_objects
from flowalign.training.run_files import RunFiles

__all__ = ["FULL_PER_TAG", "SHORT_RUN", "SMALL_PER_TAG", "estimated_seconds", "eval_guidance", "eval_images_per_tag",
           "eval_seed", "evaluate_before_after", "score_with_rewards"]

logger = logging.getLogger(__name__)

# What write_before_after writes into its folder (the run's eval/).
EVAL_FILES = ("before_after.md", "before_after.json", "grid_before.png", "grid_after.png")

FULL_PER_TAG = 528  # the default run's evaluation: 3,168 images per model on the toy test set's 6 tags
SHORT_RUN = 50  # iterations: a command-line run shorter than this gets the small evaluation
REWARD_BATCH = 64  # images per call of a reward during the evaluation


def eval_seed(config) -> int:
    """The final evaluation's sample seed: ``train.eval_seed``, else ``train.seed + 10000``."""
    seed = config.train.eval_seed
    return config.train.seed + 10_000 if seed is None else seed


def eval_guidance(config) -> float:
    """The final evaluation's CFG scale: ``train.eval_guidance``, else the rollouts' ``sampling.guidance_scale``."""
    return config.train.eval_guidance if config.train.eval_guidance is not None else config.sampling.guidance_scale


def eval_images_per_tag(config, *, command_line: bool = False) -> int:
    """Images per tag of the run's final evaluation (module docstring): ``train.eval_images_per_tag`` when set, else
    ``FULL_PER_TAG`` for a command-line run of at least ``SHORT_RUN`` iterations, else ``SMALL_PER_TAG``."""
    chosen = config.train.eval_images_per_tag
    if chosen is not None:
        return chosen
    return FULL_PER_TAG if command_line and config.train.iterations >= SHORT_RUN else SMALL_PER_TAG


def estimated_seconds(history: list[dict], samples_per_iteration: int, rollout_steps: int, images: int,
                      steps: int) -> float | None:
    """Seconds to sample ``images`` images of ``steps`` ODE steps each at the run's own rollout speed (the mean
    seconds per image per step of its rollouts: ``time/rollout`` over ``samples_per_iteration * rollout_steps``);
    None for a run without rollouts (objective-only, or no iteration run in this process)."""
    times = [m["time/rollout"] for m in history if "time/rollout" in m]
    if not times or samples_per_iteration < 1 or rollout_steps < 1:
        return None
    per_image_step = sum(times) / (len(times) * samples_per_iteration * rollout_steps)
    return per_image_step * images * steps


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "time unknown (this run has no rollout to time)"
    if seconds < 90:
        return f"about {max(1, round(seconds))} s"
    return f"about {math.ceil(seconds / 60)} min"


@torch.no_grad()
def score_with_rewards(rewards, results: list[dict], images, metadata: list[dict]) -> list[str]:
    """Score the evaluation's images with the run's rewards: each result gets ``reward/<name>`` (NaN where a reward
    found a sample invalid). A latent reward is left out, and so is a reward whose ``check_inputs`` refuses the
    evaluation's prompts (``ocr`` on toy prompts, which quote no text). Returns the names scored."""
    from flowalign.rewards import reads_latents, score_all

    rewards = [spec for spec in rewards if not reads_latents(spec[2]) and _scores_prompts(spec, metadata)]
    if not rewards or not results:
        return [spec[0] for spec in rewards]
    for start in range(0, len(results), REWARD_BATCH):
        rows = results[start:start + REWARD_BATCH]
        entries = [metadata[r["prompt_id"]] for r in rows]
        scores = score_all(rewards, images[start:start + REWARD_BATCH].float(), [e["prompt"] for e in entries],
                           entries, group_ids=torch.tensor([r["prompt_id"] for r in rows]))
        for name, row in zip(scores.names, scores.raw.cpu()):
            for result, value in zip(rows, row.tolist()):
                result[f"reward/{name}"] = value if math.isfinite(value) else math.nan  # invalid for this reward
    return [spec[0] for spec in rewards]


def _scores_prompts(spec, metadata: list[dict]) -> bool:
    """Whether the reward of ``spec`` (name, weight, reward) accepts the evaluation's prompts (its ``check_inputs``,
    when it declares one); logged when it does not."""
    from flowalign.errors import RewardInputError

    check = getattr(spec[2], "check_inputs", None)
    if not callable(check):
        return True
    try:
        check([entry["prompt"] for entry in metadata], metadata)
    except RewardInputError as error:
        logger.info("the evaluation leaves reward %r out: it cannot score the evaluation's prompts (%s)", spec[0],
                    error)
        return False
    return True


def paired_rewards(before: list[dict], after: list[dict], names: list[str]) -> dict[str, dict]:
    """Each reward's paired statistics (``toy_eval.paired_difference`` on ``reward/<name>``) over the samples that
    both of its scores found valid."""
    from flowalign.evaluation.toy_eval import paired_difference

    out = {}
    for name in names:
        key = f"reward/{name}"
        kept = [(a, b) for a, b in zip(before, after) if not (math.isnan(a[key]) or math.isnan(b[key]))]
        if kept:
            out[name] = paired_difference([a for a, _ in kept], [b for _, b in kept], score=key)
    return out


def evaluate_before_after(trainer) -> dict | None:
    """Run the evaluation (module docstring); returns the report on the main process."""
    from flowalign.evaluation.geneval import summarize
    from flowalign.evaluation.toy_eval import evaluate as evaluate_images
    from flowalign.evaluation.toy_eval import images_per_tag, paired_difference
    from flowalign.evaluation.toy_video_eval import evaluate_videos

    cfg, accelerator, model = trainer.config, trainer.accelerator, trainer.model
    metadata = load_metadata(cfg.data.eval_prompts)
    counts = cfg.train.eval_images_per_prompt or images_per_tag(metadata, eval_images_per_tag(cfg))
    guidance = eval_guidance(cfg)
    shard = (accelerator.process_index, accelerator.num_processes)
    kwargs = dict(steps=cfg.train.eval_steps, images_per_prompt=counts, seed=eval_seed(cfg), guidance_scale=guidance,
                  image_size=cfg.sampling.image_size, shard=shard, progress=trainer.is_main)
    total = counts * len(metadata) if isinstance(counts, int) else sum(counts)
    if trainer.is_main:
        seconds = estimated_seconds(trainer.history, trainer.layout.samples_per_process, cfg.sampling.num_steps,
                                    2 * math.ceil(total / accelerator.num_processes), cfg.train.eval_steps)
        if seconds is not None:  # the rollouts' speed, at their own number of CFG passes
            seconds *= (1 + (guidance > 1)) / (1 + (cfg.sampling.guidance_scale > 1))
        logger.info("evaluating %d held-out images before and %d after training (%d prompts of %s, %d ODE steps, "
                    "guidance %g): %s", total, total, len(metadata), cfg.data.eval_prompts, cfg.train.eval_steps,
                    guidance, _duration(seconds))
    # a video model: the toy video world's verifier (toy_video_eval), else toy GenEval
    evaluate = evaluate_videos if getattr(model, "modality", "image") == "video" else evaluate_images
    model.transformer.eval()
    wrapped, model.forward_module = model.forward_module, None
    try:
        with model.reference():
            before, _, before_images = evaluate(model, metadata, **kwargs)
        with trainer.ema_weights():
            after, _, after_images = evaluate(model, metadata, **kwargs)
    finally:
        model.forward_module = wrapped
    names = score_with_rewards(trainer.rewards, before, before_images, metadata)
    score_with_rewards(trainer.rewards, after, after_images, metadata)
    if accelerator.num_processes > 1:
        order = lambda r: (r["prompt_id"], r["image_index"])  # noqa: E731 - the one-process row order
        before, after = (sorted(gather_objects(accelerator, results), key=order) for results in (before, after))
    report = None
    if trainer.is_main:  # the first batch, the grids' images, is the main process's
        RunFiles(trainer.out_dir).record(*(f"eval/{name}" for name in EVAL_FILES))  # before they are written
        report = write_before_after(trainer.out_dir / "eval", before, after, summarize(before), summarize(after),
                                    paired_difference(before, after), before_images, after_images,
                                    seed=eval_seed(cfg), guidance_scale=guidance,
                                    rewards=paired_rewards(before, after, names))
    accelerator.wait_for_everyone()
    return report
