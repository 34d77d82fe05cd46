"""The held-out evaluation at the end of a run: toy GenEval of the reference (LoRA off) and of the trained policy (its
EMA when on) on identical captions and seeds, with the paired gain, its standard error and z per tag. A video model is
judged by the toy video world's verifier instead (``flowalign.evaluation.toy_video_eval.evaluate_videos``), with the
same paired statistics; its grids show each clip's frames side by side.

With several processes each one samples its share of the evaluation's batches (whole batches, so every image is
computed exactly as on one process) through the unwrapped transformer, whose forward has no collectives; the main
process gathers the verdicts and writes ``eval/before_after.md`` / ``.json`` and the two grids.
"""

from __future__ import annotations

import logging

import torch

from flowalign.evaluation.before_after import write_before_after
from flowalign.evaluation.geneval import load_metadata
from flowalign.training.collectives import gather_objects
from flowalign.training.run_files import RunFiles

__all__ = ["eval_seed", "evaluate_before_after"]

logger = logging.getLogger(__name__)

# What write_before_after writes into its folder (the run's eval/).
EVAL_FILES = ("before_after.md", "before_after.json", "grid_before.png", "grid_after.png")


@torch.no_grad()
def eval_seed(config) -> int:
    """The final evaluation's sample seed: ``train.eval_seed``, else ``train.seed + 10000``."""
    seed = config.train.eval_seed
    return config.train.seed + 10_000 if seed is None else seed


def evaluate_before_after(trainer) -> dict | None:
    """Run the evaluation (module docstring); returns the report on the main process."""
    from flowalign.evaluation.geneval import summarize
    from flowalign.evaluation.toy_eval import evaluate as evaluate_images
    from flowalign.evaluation.toy_eval import images_per_tag, paired_difference
    from flowalign.evaluation.toy_video_eval import evaluate_videos

    cfg, accelerator, model = trainer.config, trainer.accelerator, trainer.model
    metadata = load_metadata(cfg.data.eval_prompts)
    counts = cfg.train.eval_images_per_prompt or images_per_tag(metadata, cfg.train.eval_images_per_tag)
    shard = (accelerator.process_index, accelerator.num_processes)
    kwargs = dict(steps=cfg.train.eval_steps, images_per_prompt=counts, seed=eval_seed(cfg),
                  image_size=cfg.sampling.image_size, shard=shard)
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
    if accelerator.num_processes > 1:
        order = lambda r: (r["prompt_id"], r["image_index"])  # noqa: E731 - the one-process row order
        before, after = (sorted(gather_objects(accelerator, results), key=order) for results in (before, after))
    report = None
    if trainer.is_main:  # the first batch, the grids' images, is the main process's
        RunFiles(trainer.out_dir).record(*(f"eval/{name}" for name in EVAL_FILES))  # before they are written
        report = write_before_after(trainer.out_dir / "eval", before, after, summarize(before), summarize(after),
                                    paired_difference(before, after), before_images, after_images,
                                    seed=eval_seed(cfg))
    accelerator.wait_for_everyone()
    return report


