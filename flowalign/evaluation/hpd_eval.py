"""HPD v2 benchmark (Wu et al. 2023, HPS v2 paper): HPS v2.1 scores of a model's images for 3,200 prompts in 4 styles.

``flowalign eval hpd`` runs ``run_hpd``. ``--prompts DIR`` holds ``anime.json``, ``concept-art.json``,
``paintings.json`` and ``photo.json``, each a JSON list of prompt strings (800 per style in the benchmark).

Protocol (as the HPS v2 benchmark reports it): every image's score is ``100 x cos`` (HPS v2.1); per style, the
scores in prompt order are split into 10 contiguous chunks (``numpy.array_split``: sizes differ by at most one when
the count is not a multiple of 10), and the style's result is the mean of the 10 chunk means together with their
(population) standard deviation. ``Average`` is the mean of the four style means.
"""

from __future__ import annotations

import logging
import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from flowalign.devices import resolve_device
from flowalign.evaluation.toy_eval import SamplingRun
from flowalign.outputs import OutputFolder
from flowalign.settings import option, redefault

__all__ = ["HPD_STYLES", "HPDRunConfig", "chunk_stats", "format_hpd_table", "hpd_summary", "load_hpd_prompts",
           "run_hpd"]

logger = logging.getLogger(__name__)

HPD_STYLES = ("anime", "concept-art", "paintings", "photo")
NUM_CHUNKS = 10

# What this command writes into --out (flowalign.outputs.OutputFolder: an earlier run's are refused or replaced).
HPD_OUTPUTS = ("results.json", "summary.md", "images/*/[0-9]*_[0-9]*.png")


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def load_prompt_list(path: str | Path) -> list[str]:
    """A JSON list of non-empty strings; any problem is a ValueError naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"HPD prompt file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(prompts, list):
        raise ValueError(f"{path}:1: expected a JSON list of prompt strings, got a {type(prompts).__name__}")
    decoder, position = json.JSONDecoder(), text.index("[") + 1
    for index, prompt in enumerate(prompts):
        while text[position] in " \t\r\n,":
            position += 1
        _, end = decoder.raw_decode(text, position)  # the element's extent, to report its line
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{path}:{_line_of(text, position)}: entry {index} is {prompt!r}, expected a non-empty "
                             "prompt string")
        position = end
    if not prompts:
        raise ValueError(f"{path}:1: the prompt list is empty")
    return prompts


def load_hpd_prompts(directory: str | Path, styles: Sequence[str] = HPD_STYLES) -> dict[str, list[str]]:
    """``{style: prompts}`` from ``<directory>/<style>.json``; a missing file names the file and the four expected."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"HPD prompt directory {str(directory)!r} does not exist (it must hold "
                                f"{', '.join(s + '.json' for s in HPD_STYLES)})")
    return {style: load_prompt_list(directory / f"{style}.json") for style in styles}


def chunk_stats(scores: Sequence[float], num_chunks: int = NUM_CHUNKS) -> tuple[float, float]:
    """``(mean of chunk means, population std of chunk means)`` over ``num_chunks`` contiguous chunks."""
    values = np.asarray(scores, dtype=np.float64)
    if len(values) < num_chunks:
        raise ValueError(f"need at least {num_chunks} scores to split into {num_chunks} chunks, got {len(values)}")
    means = np.array([chunk.mean() for chunk in np.array_split(values, num_chunks)])
    return float(means.mean()), float(means.std())


def hpd_summary(scores: dict[str, Sequence[float]], num_chunks: int = NUM_CHUNKS) -> dict:
    """``{"styles": {style: {mean, std, n}}, "average": mean of the style means}`` from per-image scores."""
    styles = {}
    for style, values in scores.items():
        mean, std = chunk_stats(values, num_chunks)
        styles[style] = {"mean": mean, "std": std, "n": len(values)}
    return {"styles": styles, "average": float(np.mean([entry["mean"] for entry in styles.values()]))}


def format_hpd_table(summary: dict) -> str:
    rows = ["| style | HPS v2.1 | std | n |", "|---|---:|---:|---:|"]
    for style, entry in summary["styles"].items():
        rows.append(f"| {style} | {entry['mean']:.2f} | {entry['std']:.4f} | {entry['n']} |")
    rows.append(f"| Average | {summary['average']:.2f} | | |")
    return "\n".join(rows)


@dataclass(kw_only=True)
class HPDRunConfig(SamplingRun):
    """Settings of ``flowalign eval hpd``; ``model`` may be None when ``lora`` is a checkpoint (its base model)."""

    model: str | None = option(None, "diffusers pipeline directory or hub id (required unless --lora is a "
                               "checkpoint)")
    prompts: str = option(dataclasses.MISSING, "directory with the four style JSON files (anime.json, "
                          "concept-art.json, paintings.json, photo.json)")
    hps_checkpoint: str | None = option(None, "HPS_v2.1_compressed.pt (default: download from the hub repository "
                                        "xswu/HPSv2)")
    images_per_prompt: int = redefault(SamplingRun, "images_per_prompt", 1)
    save_images: bool = option(False, "also save the images under <out>/images")
    out_dir: str = redefault(SamplingRun, "out_dir", "outputs/eval-hpd")


def score_style(model, scorer, prompts: Sequence[str], *, style_index: int, config: HPDRunConfig,
                image_dir: Path | None = None) -> list[float]:
    """Generate ``images_per_prompt`` images per prompt and return their HPS scores x 100, prompt-major.

    The noise of image ``k`` of prompt ``p`` in style ``s`` is seeded by ``sample_seed(seed, s * 100000 + p, k)``.
    """
    from flowalign.evaluation.images import to_uint8
    from flowalign.evaluation.toy_eval import _rows, _sample_batch, initial_noise, progress_bar

    rows = _rows(len(prompts), config.images_per_prompt)
    seeded = [(style_index * 100000 + p, k) for p, k in rows]
    sigmas = model.sigmas(config.steps, config.resolution)
    scores: list[float] = []
    with torch.no_grad(), progress_bar(len(rows), desc=f"HPD style {style_index}") as bar:
        for start in range(0, len(rows), config.batch_size):
            batch = rows[start : start + config.batch_size]
            noise = initial_noise(model, seeded[start : start + config.batch_size], config.seed, config.resolution)
            texts = [prompts[p] for p, _ in batch]
            images = _sample_batch(model, texts, noise, sigmas, config.guidance_scale)
            scores.extend((100.0 * scorer(images, texts)).tolist())
            if image_dir is not None:
                from PIL import Image

                image_dir.mkdir(parents=True, exist_ok=True)
                for (p, k), pixels in zip(batch, to_uint8(images)):
                    Image.fromarray(pixels).save(image_dir / f"{p:05d}_{k}.png")
            bar.update(len(batch))
    return scores


def run_hpd(config: HPDRunConfig, scorer=None) -> dict:
    """Generate and score every style; write ``results.json`` and ``summary.md`` to ``out_dir``; return the summary.

    ``scorer`` (an ``HPSv2``-like reward model) overrides the HPS v2.1 model built from ``hps_checkpoint``.
    """
    from flowalign.errors import setup_phase
    from flowalign.lora_loading import base_model_path, load_model

    with setup_phase():  # the user's mistakes, up to the loaded models, are reported as such (exit 2 on the CLI)
        config.validate()
        outputs = OutputFolder(Path(config.out_dir), HPD_OUTPUTS, "flowalign eval hpd")
        replacing = outputs.check(overwrite=config.overwrite)  # never two runs' results side by side
        lora = config.lora_source()
        model_path = base_model_path(config.model, lora)
        prompts = load_hpd_prompts(config.prompts)
        if config.max_prompts is not None:
            prompts = {style: values[: config.max_prompts] for style, values in prompts.items()}
        device = str(resolve_device(config.device))
        if scorer is None:
            from flowalign.reward_models.hps import HPSv2

            scorer = HPSv2(config.hps_checkpoint, version="v2.1", device=device, dtype=config.dtype)
        model = load_model(model_path, lora, dtype=config.dtype, device=device)
    if replacing:  # --overwrite: the earlier run's outputs go just before the first write
        outputs.replace_earlier()
    out = Path(config.out_dir)
    scores = {}
    for style_index, (style, style_prompts) in enumerate(prompts.items()):
        image_dir = out / "images" / style if config.save_images else None
        scores[style] = score_style(model, scorer, style_prompts, style_index=style_index, config=config,
                                    image_dir=image_dir)
    summary = hpd_summary(scores)
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": {**asdict(config), "model": model_path, "lora_weights": None if lora is None else lora.weights},
              "summary": summary, "scores": scores}
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    table = format_hpd_table(summary)
    title = model_path if lora is None else f"{model_path} + {lora.describe()}"
    (out / "summary.md").write_text(f"# HPD v2: {title}\n\n{table}\n", encoding="utf-8")
    logger.info("%s", table)
    logger.info("%s", f"wrote {out / 'results.json'}, {out / 'summary.md'}")
    return summary
