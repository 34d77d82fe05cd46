"""GenEval on real (or toy) models: generate into GenEval's folder layout, detect, judge, summarise.

``flowalign eval geneval`` runs ``run_geneval``. The folder layout is the one GenEval's own scripts read and write,
so a folder made here can be scored by the official script and vice versa::

    <folder>/00000/metadata.jsonl        the prompt's metadata, one JSON line
    <folder>/00000/samples/00000.png     its images, 00000.png, 00001.png, ...
    <folder>/00001/...

* ``generate_folder``: ODE samples (CFG-free unless ``guidance_scale`` makes the model use CFG), with the same
  per-sample seeding and batching as ``flowalign eval toy`` (``toy_eval.generate``), written as they are made (a
  thousand 1024 px images never sit in memory together).
* ``read_folder`` / ``score_folder``: read such a folder back and judge every image with a ``GenEvalDetections``
  detector (``mask2former``: Mask2Former + CLIP colours, GenEval's pipeline; ``toy``: the toy detector) and the rule
  engine of ``flowalign.evaluation.geneval``.

Outputs of ``run_geneval`` in ``out``: ``results.json`` (config, summary, one record per image), ``summary.md`` (the
per-tag markdown table and overall); the table is also printed.
"""

from __future__ import annotations

import logging
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image

from flowalign.devices import resolve_device
from flowalign.evaluation.geneval import GenEvalError, format_table, judge, load_metadata, summarize, validate_metadata
from flowalign.evaluation.images import to_uint8
from flowalign.outputs import OutputFolder
from flowalign.settings import option, redefault
from flowalign.evaluation.toy_eval import (
    SamplingRun,
    _rows,
    _sample_batch,
    check_sampling_args,
    initial_noise,
    progress_bar,
)

__all__ = ["GenEvalRunConfig", "generate_folder", "read_folder", "run_geneval", "score_folder"]

logger = logging.getLogger(__name__)

# What this command writes into --out (flowalign.outputs.OutputFolder: an earlier run's are refused or replaced).
GENEVAL_OUTPUTS = ("results.json", "summary.md")
# What generate_folder writes into the image folder it generates (GenEval's layout).
GENEVAL_IMAGES = ("[0-9]*/metadata.jsonl", "[0-9]*/samples/[0-9]*.png")


def _prompt_dir(folder: Path, index: int) -> Path:
    return folder / f"{index:05d}"


def generate_folder(model, metadata_list: Sequence[Mapping[str, Any]], folder: str | Path, *, steps: int = 28,
                    images_per_prompt: int = 4, guidance_scale: float = 1.0, seed: int = 0, batch_size: int = 8,
                    image_size: int | Sequence[int] | None = None) -> Path:
    """Sample every prompt ``images_per_prompt`` times into ``folder`` (GenEval layout); returns the folder.

    Image ``k`` of prompt ``p`` gets the noise of ``toy_eval.sample_seed(seed, p, k)``; rows are batched exactly as
    ``toy_eval.generate`` batches them, so the images equal its images.
    """
    check_sampling_args(steps=steps, images_per_prompt=images_per_prompt, guidance_scale=guidance_scale, seed=seed,
                        batch_size=batch_size)
    if not metadata_list:
        raise ValueError("no prompts to generate for")
    folder = Path(folder)
    for index, entry in enumerate(metadata_list):
        (_prompt_dir(folder, index) / "samples").mkdir(parents=True, exist_ok=True)
        (_prompt_dir(folder, index) / "metadata.jsonl").write_text(json.dumps(dict(entry)) + "\n", encoding="utf-8")
    rows = _rows(len(metadata_list), images_per_prompt)
    sigmas = model.sigmas(steps, image_size)
    with torch.no_grad(), progress_bar(len(rows)) as bar:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            noise = initial_noise(model, batch, seed, image_size)
            images = _sample_batch(model, [metadata_list[p]["prompt"] for p, _ in batch], noise, sigmas, guidance_scale)
            for (p, k), pixels in zip(batch, to_uint8(images)):
                Image.fromarray(pixels).save(_prompt_dir(folder, p) / "samples" / f"{k:05d}.png")
            bar.update(len(batch))
    return folder


def read_folder(folder: str | Path) -> list[tuple[int, dict, list[Path]]]:
    """``(prompt index, metadata, sorted sample paths)`` for every numbered prompt directory of ``folder``.

    A directory without ``metadata.jsonl`` or without samples, or a malformed metadata line, is a GenEvalError naming
    the file (and line).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"GenEval image folder {str(folder)!r} does not exist")
    entries = []
    for prompt_dir in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()):
        metadata_file = prompt_dir / "metadata.jsonl"
        if not metadata_file.is_file():
            raise GenEvalError(f"{metadata_file}: missing (every prompt directory holds its metadata.jsonl)")
        lines = [line for line in metadata_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len(lines) != 1:
            raise GenEvalError(f"{metadata_file}: expected one JSON line, found {len(lines)}")
        try:
            metadata = json.loads(lines[0])
        except json.JSONDecodeError as error:
            raise GenEvalError(f"{metadata_file}:1: not valid JSON ({error.msg} at column {error.colno})") from None
        validate_metadata(metadata, f"{metadata_file}:1")
        samples = sorted((prompt_dir / "samples").glob("*.png"))
        if not samples:
            raise GenEvalError(f"{prompt_dir / 'samples'}: no .png samples")
        entries.append((int(prompt_dir.name), metadata, samples))
    if not entries:
        raise GenEvalError(f"{folder}: no prompt directories (expected 00000/, 00001/, ... in GenEval's layout)")
    return entries


def _load_images(paths: Sequence[Path]) -> torch.Tensor:
    """PNG files as ``[N, 3, H, W]`` in [0, 1]; any mode is converted to RGB and sizes are matched to the first."""
    arrays, size = [], None
    for path in paths:
        with Image.open(path) as image:
            image = image.convert("RGB")
            size = size or image.size
            if image.size != size:
                image = image.resize(size, Image.BICUBIC)
            arrays.append(np.asarray(image))
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255.0


def score_folder(folder: str | Path, detections) -> tuple[list[dict], dict]:
    """Judge every image of a GenEval folder with ``detections`` (a ``GenEvalDetections``): ``(results, summary)``.

    ``results`` hold ``prompt_id, prompt, tag, image_index, filename, correct, reason``, in folder order.
    """
    results = []
    for prompt_id, metadata, paths in read_folder(folder):
        images = _load_images(paths)
        size = (int(images.shape[3]), int(images.shape[2]))
        found = detections(images, [metadata] * len(paths))
        for image_index, (path, objects) in enumerate(zip(paths, found)):
            correct, reason = judge(metadata, objects, size)
            results.append({"prompt_id": prompt_id, "prompt": metadata["prompt"], "tag": metadata["tag"],
                            "image_index": image_index, "filename": str(path.relative_to(Path(folder))),
                            "correct": bool(correct), "reason": reason})
    return results, summarize(results)


@dataclass(kw_only=True)
class GenEvalRunConfig(SamplingRun):
    """Settings of ``flowalign eval geneval``; with ``model`` None, ``images`` must be an existing folder to score
    (unless ``lora`` is a checkpoint: then its base model generates)."""

    metadata: str = option(dataclasses.MISSING, "GenEval evaluation_metadata.jsonl")
    model: str | None = option(None, "diffusers pipeline directory or hub id (omit to only score, or to generate with "
                               "a --lora checkpoint's model)")
    images: str | None = option(None, "image folder to write or to score (default: <out>/images)")
    detector: Literal["mask2former", "toy"] = option("mask2former", "object detector")
    detector_model: str | None = option(None, "Mask2Former directory or hub id (default: "
                                        "facebook/mask2former-swin-small-coco-instance)")
    clip_weights: str = option("openai", "colour classifier's CLIP ViT-L-14 weights: a local file or the open_clip "
                               "tag 'openai'")
    class_names: str | None = option(None, "GenEval's object_names.txt (label id order)")
    out_dir: str = redefault(SamplingRun, "out_dir", "outputs/eval-geneval")


def run_geneval(config: GenEvalRunConfig, detections=None) -> dict:
    """Generate (when ``config.model`` is set) and score; write ``results.json`` and ``summary.md``; return summary.

    ``detections`` overrides the detector built from the config (tests pass tiny models).
    """
    from flowalign.errors import setup_phase
    from flowalign.reward_models.geneval import GenEvalDetections

    with setup_phase():  # the user's mistakes, up to a loaded model, are reported as such (exit 2 on the CLI)
        config.validate()
        lora = config.lora_source()
        out = Path(config.out_dir)
        folder = Path(config.images) if config.images else out / "images"
        title = config.model or str(folder)
        generating = config.model is not None or lora is not None
        outputs = [OutputFolder(out, GENEVAL_OUTPUTS, "flowalign eval geneval")]
        if generating:  # the image folder it generates into is its output too (scored only, it is the input)
            outputs.append(OutputFolder(folder, GENEVAL_IMAGES, "flowalign eval geneval", flag="--images"))
        replacing = [o for o in outputs if o.check(overwrite=config.overwrite)]
        if generating:
            from flowalign.lora_loading import base_model_path, load_model

            if not Path(config.metadata).is_file():
                raise FileNotFoundError(f"GenEval metadata file {config.metadata!r} does not exist")
            metadata = load_metadata(config.metadata)[: config.max_prompts]
            device = str(resolve_device(config.device))
            title = base_model_path(config.model, lora)
            model = load_model(title, lora, dtype=config.dtype, device=device)
            if lora is not None:
                title += f" + {lora.describe()}"
        elif not folder.is_dir():
            raise FileNotFoundError(f"no --model to generate with and no image folder at {str(folder)!r} to score")
    for earlier in replacing:  # --overwrite: the earlier run's outputs go just before the first write
        earlier.replace_earlier()
    if generating:
        generate_folder(model, metadata, folder, steps=config.steps, images_per_prompt=config.images_per_prompt,
                        guidance_scale=config.guidance_scale, seed=config.seed, batch_size=config.batch_size,
                        image_size=config.resolution)
        del model
    if detections is None:
        with setup_phase():  # the detector loads after the generator has been freed: its weights are set-up too
            detections = GenEvalDetections(config.detector, detector_model=config.detector_model,
                                           clip_weights=config.clip_weights, class_names=config.class_names,
                                           device=config.device, dtype=config.dtype)
    results, summary = score_folder(folder, detections)

    out.mkdir(parents=True, exist_ok=True)
    record = {"config": {**asdict(config), "lora_weights": None if lora is None else lora.weights},
              "folder": str(folder), "summary": summary, "results": results}
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    markdown = "\n".join([f"# GenEval: {title}", "", f"detector: {config.detector}; folder: {folder}", "",
                          format_table(summary), "",
                          f"images correct: {summary['images_correct']:.3f}; prompts correct: "
                          f"{summary['prompts_correct']:.3f}", ""])
    (out / "summary.md").write_text(markdown, encoding="utf-8")
    logger.info("%s", format_table(summary))
    logger.info("%s", f"wrote {out / 'results.json'}, {out / 'summary.md'}")
    return summary
