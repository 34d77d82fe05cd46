"""``flowalign eval ocr``: Flow-GRPO's OCR reward (``flowalign.reward_models.ocr``) of a model's images, the
text-rendering benchmark of Flow-GRPO (Liu et al. 2025, arXiv 2505.05470).

Every prompt quotes the text to render (``a sign that says "Open"``). Each prompt gets ``images_per_prompt`` ODE
samples (the noise of image ``k`` of prompt ``p`` seeded by ``sample_seed(seed, p, k)``), PP-OCRv4 reads each image,
and Flow-GRPO's rule scores what it read against the quoted text. The summary:

* ``mean``: the mean reward over all images (``1 - min(d, |t|)/|t|``), with its standard error (sample std / sqrt n);
* ``exact``: the fraction of images that score 1 (the target read in full, extra text allowed);
* ``n``: images scored, ``prompts``: prompts.

``--prompts`` defaults to Flow-GRPO's 1,018 OCR test prompts, shipped in ``assets/prompts/ocr_test.txt`` under their
MIT license (``assets/prompts/ocr_test.LICENSE``); any ``.txt`` (one prompt a line) or ``.jsonl`` prompt file works.
A prompt without a quoted target is refused before the model loads, naming it; so is a missing ``ocr`` extra.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch

from flowalign.devices import resolve_device
from flowalign.evaluation.toy_eval import SamplingRun
from flowalign.outputs import OutputFolder, write_atomically
from flowalign.settings import option, redefault

__all__ = ["OcrRunConfig", "format_ocr_table", "ocr_summary", "run_ocr"]

logger = logging.getLogger(__name__)

OCR_TEST_PROMPTS_NAME = "ocr_test.txt"  # in the prompt assets (flowalign.toy.prompts.PROMPT_ASSET_DIR)

# What this command writes into --out (flowalign.outputs.OutputFolder: an earlier run's are refused or replaced).
OCR_OUTPUTS = ("results.json", "summary.md", "images/[0-9]*_[0-9]*.png")


def ocr_summary(rewards: Sequence[float], num_prompts: int) -> dict[str, float]:
    """``{"mean", "se", "exact", "n", "prompts"}`` of per-image rewards (module docstring); ``se`` is 0 for one
    image."""
    values = np.asarray(rewards, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no rewards to summarise")
    se = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else 0.0
    return {"mean": float(values.mean()), "se": se, "exact": float((values == 1.0).mean()), "n": int(values.size),
            "prompts": int(num_prompts)}


def format_ocr_table(summary: dict) -> str:
    return "\n".join(["| OCR reward (mean ± SE) | exact reads | images | prompts |", "|---:|---:|---:|---:|",
                      f"| {summary['mean']:.4f} ± {summary['se']:.4f} | {summary['exact']:.4f} | {summary['n']} | "
                      f"{summary['prompts']} |"])


@dataclass(kw_only=True)
class OcrRunConfig(SamplingRun):
    """Settings of ``flowalign eval ocr``; ``model`` may be None when ``lora`` is a checkpoint (its base model)."""

    model: str | None = option(None, "diffusers pipeline directory or hub id (required unless --lora is a "
                               "checkpoint)")
    prompts: str | None = option(None, "prompt file, .txt (one prompt a line) or .jsonl ('prompt' keys), each "
                                 "quoting the text to render; default: Flow-GRPO's OCR test prompts "
                                 "(assets/prompts/ocr_test.txt)")
    variant: Literal["flow_grpo", "flow_factory"] = option(
        "flow_grpo", "the scoring rule: flow_grpo (released: the first quoted span, lines of confidence > 0) or "
        "flow_factory (an unquoted prompt is its own target; every line counts)")
    threads: int | None = option(None, "onnxruntime threads of the OCR engine (default: onnxruntime's)")
    images_per_prompt: int = redefault(SamplingRun, "images_per_prompt", 1)
    save_images: bool = option(False, "also save the images under <out>/images")
    out_dir: str = redefault(SamplingRun, "out_dir", "outputs/eval-ocr")

    def prompts_path(self) -> Path:
        if self.prompts is not None:
            return Path(self.prompts)
        from flowalign.toy.prompts import PROMPT_ASSET_DIR

        return Path(PROMPT_ASSET_DIR) / OCR_TEST_PROMPTS_NAME


def _read_text(lines: list[tuple[str, float]] | None, variant: str) -> str | None:
    """What the rule joined from the lines (before normalisation); None for an engine error."""
    if lines is None:
        return None
    return "".join(text for text, conf in lines if variant == "flow_factory" or conf > 0)


def score_prompts(model, scorer, prompts: Sequence[str], *, config: OcrRunConfig,
                  image_dir: Path | None = None) -> list[dict[str, Any]]:
    """Sample ``images_per_prompt`` images of every prompt and score each; one record per image, prompt-major:
    ``{"prompt_index", "image_index", "target", "read", "reward"}``."""
    from flowalign.evaluation.images import to_uint8
    from flowalign.evaluation.toy_eval import _rows, _sample_batch, initial_noise, progress_bar
    from flowalign.reward_models.ocr_rule import ocr_reward_from_lines, ocr_target

    rows = _rows(len(prompts), config.images_per_prompt)
    sigmas = model.sigmas(config.steps, config.resolution)
    records: list[dict[str, Any]] = []
    with torch.no_grad(), progress_bar(len(rows), desc="OCR") as bar:
        for start in range(0, len(rows), config.batch_size):
            batch = rows[start : start + config.batch_size]
            noise = initial_noise(model, batch, config.seed, config.resolution)
            texts = [prompts[p] for p, _ in batch]
            images = _sample_batch(model, texts, noise, sigmas, config.guidance_scale)
            for (p, k), lines in zip(batch, scorer.read(images)):
                records.append({"prompt_index": p, "image_index": k, "target": ocr_target(prompts[p],
                                                                                          variant=config.variant),
                                "read": _read_text(lines, config.variant),
                                "reward": ocr_reward_from_lines(prompts[p], lines, variant=config.variant)})
            if image_dir is not None:
                from PIL import Image

                image_dir.mkdir(parents=True, exist_ok=True)
                for (p, k), pixels in zip(batch, to_uint8(images)):
                    with write_atomically(image_dir / f"{p:05d}_{k}.png") as tmp:
                        Image.fromarray(pixels).save(tmp, format="PNG")
            bar.update(len(batch))
    return records


def run_ocr(config: OcrRunConfig, scorer=None) -> dict:
    """Check everything, generate and score every prompt; write ``results.json`` and ``summary.md`` to ``out_dir``;
    return the summary. ``scorer`` (an ``OcrReward``) overrides the one built from the settings."""
    from flowalign.data.prompts import load_prompts
    from flowalign.errors import SetupError, setup_phase
    from flowalign.lora_loading import base_model_path, load_model
    from flowalign.reward_models.ocr import OcrReward, check_ocr_installed

    with setup_phase():  # the user's mistakes, up to the loaded models, are reported as such (exit 2 on the CLI)
        config.validate()
        if config.model is None and config.lora is None:
            raise SetupError("give --model (the pipeline to evaluate), or --lora with a training checkpoint")
        if config.threads is not None and (isinstance(config.threads, bool) or config.threads < 1):
            raise SetupError(f"--threads must be an integer >= 1, got {config.threads!r}")
        outputs = OutputFolder(Path(config.out_dir), OCR_OUTPUTS, "flowalign eval ocr")
        replacing = outputs.check(overwrite=config.overwrite)  # never two runs' results side by side
        path = config.prompts_path()
        entries = load_prompts(path)
        if config.max_prompts is not None:
            entries = entries[: config.max_prompts]
        OcrReward.check_prompts(entries, kwargs={"variant": config.variant}, key="--prompts", path=path)
        if scorer is None:
            check_ocr_installed("flowalign eval ocr")
        lora = config.lora_source()
        model_path = base_model_path(config.model, lora)
        if scorer is None:
            scorer = OcrReward(variant=config.variant, threads=config.threads)
        model = load_model(model_path, lora, dtype=config.dtype, device=str(resolve_device(config.device)))
    if replacing:  # --overwrite: the earlier run's outputs go just before the first write
        outputs.replace_earlier()
    out = Path(config.out_dir)
    prompts = [entry["prompt"] for entry in entries]
    records = score_prompts(model, scorer, prompts, config=config,
                            image_dir=out / "images" if config.save_images else None)
    summary = ocr_summary([record["reward"] for record in records], len(prompts))
    record = {"config": {**asdict(config), "model": model_path, "prompts": str(path),
                         "lora_weights": None if lora is None else lora.weights},
              "summary": summary, "images": records}
    with write_atomically(out / "results.json") as tmp:
        tmp.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    table = format_ocr_table(summary)
    title = model_path if lora is None else f"{model_path} + {lora.describe()}"
    with write_atomically(out / "summary.md") as tmp:
        tmp.write_text(f"# OCR ({config.variant} rule, PP-OCRv4): {title}\n\nprompts: {path}\n\n{table}\n",
                       encoding="utf-8")
    logger.info("%s", table)
    logger.info("%s", f"wrote {out / 'results.json'}, {out / 'summary.md'}")
    return summary
