"""GenEval-style evaluation of a flow model on the toy world: sample, detect, judge, summarise.

``run_eval(EvalConfig(...))`` is what ``flowalign eval toy`` runs. The pieces are usable on their own:

* ``generate``: ODE samples, prompt-major (all images of prompt 0, then of prompt 1, ...). The initial noise of
  sample ``(p, k)`` comes from its own CPU ``torch.Generator`` seeded with ``sample_seed(seed, p, k)``, so it does not
  depend on the batch size or on the other prompts in the batch, and two models (say before and after training) are
  compared on identical noise.
* ``evaluate``: ``generate`` + the toy detector + GenEval's rules -> per-image results and the GenEval summary.
* ``paired_difference``: the per-tag and overall difference between two evaluations on the same samples, with
  standard errors from the paired per-sample differences.
* ``images_per_tag``: a tag-balanced sample allocation. GenEval's overall is the unweighted mean of its tag means,
  so its variance is ``sum_t var_t / (36 n_t)``; with a fixed number of images per prompt a tag with 2 prompts (the toy
  test set has 44 color_attr prompts and 2 two_object ones) gets 22x fewer samples than another and dominates the
  standard error. Equal samples per tag, split evenly over each tag's prompts, roughly halves the overall standard
  error on the toy test set at the same total.

Images are kept in memory as one float tensor: this is meant for the toy world's small images, not for thousands of
1024 px samples.
"""

from __future__ import annotations

import logging
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from flowalign.deprecation import moved_names
from flowalign.config import ConfigError
from flowalign.devices import resolve_device
from flowalign.evaluation.geneval import TAGS, format_table, judge, load_metadata, summarize
from flowalign.evaluation.images import save_grid
from flowalign.lora_loading import DEFAULT_MODEL
from flowalign.outputs import OutputFolder
from flowalign.seeding import mixed_seed
from flowalign.settings import option, redefault

__all__ = [
    "EvalConfig",
    "GRID_MAX_IMAGES",
    "default_prompts_path",
    "evaluate",
    "generate",
    "images_per_tag",
    "paired_difference",
    "run_eval",
    "run_evaluation_settings",
    "sample_seed",
]

logger = logging.getLogger(__name__)

GRID_MAX_IMAGES = 64
# a short run's end-of-run evaluation, or a run's from Python (flowalign.training.evaluation's size rule), and what
# `eval toy --lora` reproduces for such a run: 164 images per model on the toy test set
SMALL_PER_TAG = 24
# What run_eval writes into --out (flowalign.outputs.OutputFolder: an earlier run's are refused or replaced).
TOY_EVAL_OUTPUTS = ("results.json", "summary.md", "grid.png")


def default_prompts_path() -> Path:
    """The held-out toy prompt set, ``assets/prompts/test.jsonl``."""
    from flowalign.toy.prompts import PROMPT_ASSET_DIR

    return Path(PROMPT_ASSET_DIR) / "test.jsonl"


@dataclass(kw_only=True)
class SamplingRun:
    """What every evaluation command shares: ODE samples per prompt, their seed, batching, size and device.

    ``EvalConfig``, ``GenEvalRunConfig`` and ``HPDRunConfig`` extend it and change the defaults; ``resolution``
    None is the model's default image size, ``max_prompts`` keeps the first prompts (of each style for HPD).
    """

    steps: int = option(28, "ODE steps")
    images_per_prompt: int = option(4, "images per prompt")
    guidance_scale: float = option(1.0, "guidance scale (CFG with negative prompt '' when > 1)", flag="guidance")
    seed: int = option(0, "noise seed")
    batch_size: int = option(8, "images per transformer batch")
    resolution: int | None = option(None, "image size (default: the model's)")
    max_prompts: int | None = option(None, "evaluate only the first M prompts (of each style for HPD)")
    out_dir: str = option("outputs/eval", "output directory", flag="out")
    overwrite: bool = option(False, "replace the outputs of an earlier run in --out (deletes the files this command "
                                    "writes there, and only those)")
    device: str | None = option(None, "torch device (default: cuda when available, else cpu)")
    dtype: Literal["fp32", "fp16", "bf16"] = option("fp32", "dtype of the model's weights")
    lora: str | None = option(None, "a trained LoRA: a checkpoint directory (checkpoint-NNNNNN) or a diffusers LoRA "
                              "folder (e.g. a checkpoint's lora/, its last weights); --model defaults to the "
                              "checkpoint's model", metavar="DIR")
    lora_weights: Literal["ema", "last"] | None = option(
        None, "a checkpoint's EMA or last weights (default: ema when it has them, else last)", flag="weights")

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        check_sampling_args(
            steps=self.steps,
            images_per_prompt=self.images_per_prompt,
            guidance_scale=self.guidance_scale,
            seed=self.seed,
            batch_size=self.batch_size,
        )
        for name in ("resolution", "max_prompts"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 (or None for the default), got {value!r}", key=name)
        if self.lora_weights is not None and self.lora is None:
            raise ValueError(f"--weights {self.lora_weights} chooses a checkpoint's weights: give the checkpoint "
                             "with --lora CHECKPOINT")

    def lora_source(self):
        """The checked ``lora`` (``flowalign.lora_loading.resolve_lora``), or None; loads nothing."""
        from flowalign.lora_loading import resolve_lora

        return None if self.lora is None else resolve_lora(self.lora, self.lora_weights)


# flowalign eval toy's settings when no training checkpoint gives its run's (run_evaluation_settings)
COMMAND_DEFAULTS = {"steps": 10, "guidance_scale": 1.0, "seed": 0, "images_per_prompt": 4,
                    "out_dir": "outputs/eval-toy"}


@dataclass(kw_only=True)
class EvalConfig(SamplingRun):
    """Settings of one toy evaluation (``flowalign eval toy``).

    ``prompts`` defaults to the held-out ``assets/prompts/test.jsonl``. ``images_per_tag``, when set, replaces
    ``images_per_prompt`` by a tag-balanced allocation (``images_per_tag``). ``lora`` (a checkpoint with
    ``lora_weights`` ema/last, or a LoRA folder; ``flowalign.lora_loading``) is evaluated on ``model``, which defaults
    to the checkpoint's base model, else ``assets/toy-sd3``.

    With ``--lora CHECKPOINT`` (a training run's checkpoint) every setting left unset is the run's own final
    evaluation's, read from the checkpoint's ``config.yaml`` (``run_evaluation_settings``): the command then
    reproduces the run's "after" column, and writes next to the checkpoint.
    """

    model: str | None = option(None, "diffusers pipeline directory (default: a --lora checkpoint's model, else "
                               "assets/toy-sd3)")
    prompts: str | None = option(None, "GenEval metadata jsonl (default: a --lora checkpoint's data.eval_prompts, else "
                                 "assets/prompts/test.jsonl)")
    images_per_tag: int | None = option(None, "tag-balanced: this many images per tag, split evenly over its prompts "
                                        "(replaces images_per_prompt; equal tag sizes minimise the standard error of "
                                        "GenEval's overall; default: a --lora checkpoint's final evaluation's)")
    images_per_prompt: int | None = option(None, "images per prompt (default: a --lora checkpoint's final "
                                           "evaluation's, else 4)")
    steps: int | None = option(None, "ODE steps (default: a --lora checkpoint's train.eval_steps, else 10)")
    guidance_scale: float | None = option(None, "guidance scale (CFG with negative prompt '' when > 1; default: a "
                                          "--lora checkpoint's train.eval_guidance, else its sampling.guidance_scale, "
                                          "else 1)", flag="guidance")
    seed: int | None = option(None, "noise seed (default: a --lora checkpoint's evaluation seed, train.eval_seed or "
                              "train.seed + 10000, else 0)")
    resolution: int | None = option(None, "image size (default: a --lora checkpoint's sampling.image_size, else the "
                                    "model's)")
    batch_size: int = redefault(SamplingRun, "batch_size", 64)
    out_dir: str | None = option(None, "output directory (default: next to a --lora checkpoint, "
                                 "<run>/eval-<checkpoint>, else outputs/eval-toy)", flag="out")

    def validate(self) -> None:
        """Check what is set (an unset setting is filled by ``run_evaluation_settings``)."""
        from dataclasses import replace

        SamplingRun.validate(replace(self, **{key: value for key, value in COMMAND_DEFAULTS.items()
                                              if getattr(self, key) is None}))
        if self.images_per_tag is not None and (not _is_int(self.images_per_tag) or self.images_per_tag < 1):
            raise ConfigError(f"images_per_tag must be an integer >= 1 (or None), got {self.images_per_tag!r}",
                              key="images_per_tag")


def run_evaluation_settings(config: EvalConfig, lora=None) -> EvalConfig:
    """``config`` with every unset setting filled: from a training checkpoint's run (``lora``, a ``LoraSource`` of
    kind ``checkpoint``), its final evaluation's (``train.eval_steps``, its guidance, the evaluation seed, its images
    per tag or per prompt, ``data.eval_prompts``, ``sampling.image_size``; the output folder
    ``<run>/eval-<checkpoint>``); without
    one, the command's own defaults (10 steps, guidance 1, 4 images per prompt, seed 0, ``outputs/eval-toy``)."""
    from dataclasses import replace


    run = (lora.config or {}) if lora is not None and lora.kind == "checkpoint" else None
    if run is None:
        return replace(config, **{key: value for key, value in COMMAND_DEFAULTS.items()
                                  if getattr(config, key) is None})
    train, data, sampling = (dict(run.get(key) or {}) for key in ("train", "data", "sampling"))
    counts = {"images_per_prompt": config.images_per_prompt or 4}
    if config.images_per_prompt is None and config.images_per_tag is None:  # the run's allocation
        if train.get("eval_images_per_prompt"):
            counts = {"images_per_prompt": train["eval_images_per_prompt"]}
        else:  # a command-line run records the size it chose; null: a run from Python, the small evaluation
            counts["images_per_tag"] = train.get("eval_images_per_tag") or SMALL_PER_TAG
    eval_seed = train.get("eval_seed")
    return replace(
        config, **counts,
        steps=config.steps if config.steps is not None else train.get("eval_steps", 10),
        guidance_scale=config.guidance_scale if config.guidance_scale is not None else next(
            g for g in (train.get("eval_guidance"), sampling.get("guidance_scale"), 1.0) if g is not None),
        seed=config.seed if config.seed is not None else (
            eval_seed if eval_seed is not None else int(train.get("seed", 0)) + 10_000),
        prompts=config.prompts or data.get("eval_prompts"),
        resolution=config.resolution if config.resolution is not None else sampling.get("image_size"),
        out_dir=config.out_dir or str(lora.path.parent / f"eval-{lora.path.name}"))


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_sampling_args(*, steps, images_per_prompt, guidance_scale, seed, batch_size) -> None:
    """Validate the sampling settings shared by ``generate``, ``evaluate`` and ``EvalConfig``.

    ``images_per_prompt`` is one count for every prompt or a sequence with one count per prompt.
    """
    for name, value in (("steps", steps), ("batch_size", batch_size)):
        if not _is_int(value) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", key=name)
    counts = images_per_prompt if isinstance(images_per_prompt, Sequence) else [images_per_prompt]
    if not counts or not all(_is_int(value) and value >= 1 for value in counts):
        raise ConfigError(f"images_per_prompt must be an integer >= 1 or a list of them, got {images_per_prompt!r}",
                          key="images_per_prompt")
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}", key="seed")
    if isinstance(guidance_scale, bool) or not isinstance(guidance_scale, (int, float)) or not (
        math.isfinite(guidance_scale) and guidance_scale >= 0
    ):
        raise ConfigError(f"guidance_scale must be a finite number >= 0, got {guidance_scale!r}", key="guidance_scale")


# ------------------------------------------------------------------------------------------------ sampling


def sample_seed(seed: int, prompt_index: int, image_index: int) -> int:
    """The noise seed of image ``image_index`` of prompt ``prompt_index``: a fixed hash of the three numbers.

    ``numpy.random.SeedSequence`` mixes them, so nearby triples give unrelated seeds; the value is a 63-bit integer
    for ``torch.Generator().manual_seed``.
    """
    return mixed_seed(seed, prompt_index, image_index)


def _prompt_text(entry: Any) -> str:
    return entry["prompt"] if isinstance(entry, Mapping) else str(entry)


def _condition_paths(entry: Any) -> list[str] | None:
    """An editing prompt's condition-image paths (its ``images``), or None."""
    return entry.get("images") if isinstance(entry, Mapping) else None


def images_per_tag(metadata_list: Sequence[Mapping[str, Any]], per_tag: int) -> list[int]:
    """Images for each prompt so that every tag gets ``per_tag`` of them (rounded up), evenly over its prompts.

    A tag with ``m`` prompts gives each ``ceil(per_tag / m)`` images. Entries without a tag count as one tag ``""``.
    """
    if not _is_int(per_tag) or per_tag < 1:
        raise ValueError(f"per_tag must be an integer >= 1, got {per_tag!r}")
    tags = [str(entry.get("tag", "")) if isinstance(entry, Mapping) else "" for entry in metadata_list]
    prompts_in = {tag: tags.count(tag) for tag in set(tags)}
    return [math.ceil(per_tag / prompts_in[tag]) for tag in tags]


def _rows(num_prompts: int, images_per_prompt: int | Sequence[int]) -> list[tuple[int, int]]:
    if isinstance(images_per_prompt, Sequence):
        if len(images_per_prompt) != num_prompts:
            raise ValueError(
                f"images_per_prompt has {len(images_per_prompt)} counts for {num_prompts} prompts: give one per prompt"
            )
        counts = list(images_per_prompt)
    else:
        counts = [images_per_prompt] * num_prompts
    return [(p, k) for p in range(num_prompts) for k in range(counts[p])]


def initial_noise(model, rows: Sequence[tuple[int, int]], seed: int, image_size=None) -> Tensor:
    """Initial latents for the ``(prompt_index, image_index)`` rows, one seeded CPU generator per row."""
    generators = [torch.Generator("cpu").manual_seed(sample_seed(seed, p, k)) for p, k in rows]
    return model.prepare_noise(len(rows), image_size, generator=generators)


def _sample_batch(model, prompts: Sequence[str], noise: Tensor, sigmas: Tensor, guidance_scale: float,
                  images: Sequence[Sequence[str] | None] | None = None) -> Tensor:
    """ODE-sample one batch (one prompt per row) and decode it to images in [0, 1] on the CPU; ``images``: each row's
    condition-image paths (an editing prompt's ``images``), or None."""
    from flowalign.data.condition_images import encode_kwargs
    from flowalign.samplers import rollout

    keys = [(prompt, tuple(paths or ())) for prompt, paths in zip(prompts, images or [None] * len(prompts))]
    unique = list(dict.fromkeys(keys))
    negatives = [""] * len(unique) if model.uses_cfg(guidance_scale) else None
    cond = model.encode([prompt for prompt, _ in unique], negative_prompts=negatives,
                        **encode_kwargs([{"images": list(paths)} for _, paths in unique]))
    cond = cond.index([unique.index(key) for key in keys])
    steps = sigmas.numel() - 1
    result = rollout(model.velocity_fn(cond, guidance_scale), noise, sigmas, torch.zeros(steps))
    return model.decode(result.final).float().cpu()


def generate(
    model,
    metadata_list: Sequence[Mapping[str, Any]],
    *,
    steps: int = 10,
    images_per_prompt: int | Sequence[int] = 4,
    guidance_scale: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    image_size: int | Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool | None = None,
) -> Tensor:
    """ODE samples ``[N, 3, H, W]`` in [0, 1] (CPU, fp32), prompt-major: with ``K`` images for every prompt, image
    ``k`` of prompt ``p`` is row ``p * K + k``. ``images_per_prompt`` may instead give one count per prompt.

    An entry's condition images (``images``: paths, as the loaders resolve them) condition its samples (editing).
    CFG-free unless the model uses CFG at ``guidance_scale`` (then the negative prompt is ""). The noise of each
    sample depends only on ``(seed, p, k)``; rows are processed ``batch_size`` at a time under ``torch.no_grad()``.
    ``progress``: a tqdm bar counting images on stderr (True), none (False), or one when stderr is a terminal (None).
    """
    check_sampling_args(
        steps=steps, images_per_prompt=images_per_prompt, guidance_scale=guidance_scale, seed=seed, batch_size=batch_size
    )
    if len(metadata_list) == 0:
        raise ValueError("no prompts to generate for")
    prompts = [_prompt_text(entry) for entry in metadata_list]
    sigmas = model.sigmas(steps, image_size)
    images = []
    rows = _rows(len(prompts), images_per_prompt)
    batches = _batches(rows, batch_size, shard)
    # A sharded model (FSDP2) runs every forward as a collective: a process with fewer batches samples its first
    # batch again, unused, so that every process runs as many forwards.
    padding = (math.ceil(len(_batches(rows, batch_size, None)) / shard[1]) - len(batches)
               if shard is not None and getattr(model, "collective_forwards", False) else 0)
    with torch.no_grad(), progress_bar(sum(map(len, batches)), progress) as bar:
        for index, batch in enumerate(batches + [_batches(rows, batch_size, None)[0]] * padding):
            noise = initial_noise(model, batch, seed, image_size)
            sampled = _sample_batch(model, [prompts[p] for p, _ in batch], noise, sigmas, guidance_scale,
                                    [_condition_paths(metadata_list[p]) for p, _ in batch])
            if index < len(batches):
                images.append(sampled)
                bar.update(len(batch))
    return torch.cat(images) if images else torch.zeros(0)


def _batches(rows: list[tuple[int, int]], batch_size: int, shard: tuple[int, int] | None) -> list[list[tuple[int, int]]]:
    """The rows in batches of ``batch_size``; with ``shard = (rank, world)`` only every ``world``-th batch from
    ``rank`` on. Whole batches are shared out, so each image is computed in the same batch as on one process."""
    batches = [rows[start : start + batch_size] for start in range(0, len(rows), batch_size)]
    if shard is None:
        return batches
    rank, world = shard
    if not 0 <= rank < world:
        raise ValueError(f"shard rank {rank} is outside 0..{world - 1}")
    return batches[rank::world]


def progress_bar(total: int, progress: bool | None = None, desc: str = "eval"):
    """A tqdm bar over ``total`` images on stderr: shown (True), hidden (False), or shown on a terminal (None)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=None if progress is None else not progress,
                dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- evaluation


def evaluate(
    model,
    metadata_list: Sequence[Mapping[str, Any]],
    *,
    steps: int = 10,
    images_per_prompt: int | Sequence[int] = 4,
    guidance_scale: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
    image_size: int | Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool | None = None,
) -> tuple[list[dict], dict, Tensor]:
    """Generate, detect and judge: ``(results, summary, images)``; ``progress`` as for ``generate``.

    ``shard = (rank, world)``: only this process's share of the batches (``generate``); gather the results of all
    ranks and ``summarize`` them for the whole evaluation.

    One result per image, in ``generate``'s row order: ``{prompt_id: p, prompt, tag, image_index: k,
    seed: sample_seed(seed, p, k), correct, reason}``; ``summary`` is ``geneval.summarize(results)``.
    """
    from flowalign.toy.detector import detect_batch

    images = generate(
        model,
        metadata_list,
        steps=steps,
        images_per_prompt=images_per_prompt,
        guidance_scale=guidance_scale,
        seed=seed,
        batch_size=batch_size,
        image_size=image_size,
        shard=shard,
        progress=progress,
    )
    detections = detect_batch(images) if len(images) else []
    size = (int(images.shape[-1]), int(images.shape[-2])) if len(images) else None  # (width, height)
    results = []
    rows = [row for batch in _batches(_rows(len(metadata_list), images_per_prompt), batch_size, shard) for row in batch]
    for (p, k), found in zip(rows, detections):
        metadata = metadata_list[p]
        correct, reason = judge(metadata, found, size)
        results.append(
            {
                "prompt_id": p,
                "prompt": metadata["prompt"],
                "tag": metadata["tag"],
                "image_index": k,
                "seed": sample_seed(seed, p, k),
                "correct": bool(correct),
                "reason": reason,
            }
        )
    return results, summarize(results) if results else {}, images


# ------------------------------------------------------------------------------------- paired comparison


def _keyed(results: Sequence[Mapping[str, Any]], name: str) -> dict[tuple[Any, Any], Mapping[str, Any]]:
    keyed = {}
    for index, result in enumerate(results):
        try:
            key = (result["prompt_id"], result["image_index"])
        except (KeyError, TypeError):
            raise ValueError(f"{name}[{index}] has no prompt_id/image_index") from None
        if key in keyed:
            raise ValueError(f"{name} has two entries for (prompt_id={key[0]!r}, image_index={key[1]!r})")
        keyed[key] = result
    return keyed


def _z(diff: float, se: float) -> float:
    if math.isnan(se):
        return math.nan
    if se > 0:
        return diff / se
    return 0.0 if diff == 0 else math.copysign(math.inf, diff)


def paired_difference(results_a: Sequence[Mapping[str, Any]], results_b: Sequence[Mapping[str, Any]], *,
                      score: str = "correct") -> dict:
    """Mean accuracy difference ``b - a`` on the same samples, per tag and overall, with standard errors.

    ``score`` names the result field compared: ``correct`` (a verdict, read as 0 or 1), or a number in each result
    (the toy video verifier's ``partial``).

    Samples are matched on ``(prompt_id, image_index)``; a key present in one list only raises ValueError naming it.
    Per tag, with ``d_i = correct_b - correct_a`` over the tag's ``n`` samples: ``diff = mean(d)``,
    ``se = std(d, ddof=1) / sqrt(n)`` (NaN when ``n = 1``) and ``z = diff / se``. Overall (GenEval's unweighted mean
    over the tags present): ``diff = mean_t diff_t``, ``se = sqrt(sum_t se_t^2) / n_tags``.

    Returns ``{"tags": {tag: entry}, "overall": entry}`` with entries ``{n, mean_a, mean_b, diff, se, z}``.
    """
    keyed_a, keyed_b = _keyed(results_a, "results_a"), _keyed(results_b, "results_b")
    for key in keyed_a:
        if key not in keyed_b:
            raise ValueError(f"results_b has no entry for (prompt_id={key[0]!r}, image_index={key[1]!r}) of results_a")
    for key in keyed_b:
        if key not in keyed_a:
            raise ValueError(f"results_a has no entry for (prompt_id={key[0]!r}, image_index={key[1]!r}) of results_b")
    if not keyed_a:
        raise ValueError("paired_difference needs at least one result")

    per_tag: dict[str, list[tuple[float, float]]] = {}
    for key, a in keyed_a.items():
        b = keyed_b[key]
        if a["tag"] != b["tag"]:
            raise ValueError(f"tag mismatch for (prompt_id={key[0]!r}, image_index={key[1]!r}): {a['tag']!r} vs {b['tag']!r}")
        value = (lambda r: float(bool(r["correct"]))) if score == "correct" else (lambda r: float(r[score]))
        per_tag.setdefault(a["tag"], []).append((value(a), value(b)))

    order = [tag for tag in TAGS if tag in per_tag] + sorted(tag for tag in per_tag if tag not in TAGS)
    tags = {}
    for tag in order:
        pairs = np.asarray(per_tag[tag], dtype=np.float64)
        n = len(pairs)
        d = pairs[:, 1] - pairs[:, 0]
        diff = float(d.mean())
        se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
        tags[tag] = {
            "n": n,
            "mean_a": float(pairs[:, 0].mean()),
            "mean_b": float(pairs[:, 1].mean()),
            "diff": diff,
            "se": se,
            "z": _z(diff, se),
        }
    entries = list(tags.values())
    diff = float(np.mean([e["diff"] for e in entries]))
    se = math.sqrt(sum(e["se"] ** 2 for e in entries)) / len(entries)
    overall = {
        "n": sum(e["n"] for e in entries),
        "mean_a": float(np.mean([e["mean_a"] for e in entries])),
        "mean_b": float(np.mean([e["mean_b"] for e in entries])),
        "diff": diff,
        "se": se,
        "z": _z(diff, se),
    }
    return {"tags": tags, "overall": overall}


# ----------------------------------------------------------------------------------------------- run_eval


def _summary_markdown(config: EvalConfig, summary: Mapping[str, Any], model: str, lora=None) -> str:
    n_images, n_prompts = summary["n_images"], summary["n_prompts"]
    images_ok = round(summary["images_correct"] * n_images)
    prompts_ok = round(summary["prompts_correct"] * n_prompts)
    if config.images_per_tag:
        allocation = f"{config.images_per_tag} images per tag"
    else:
        allocation = f"{config.images_per_prompt} images per prompt"
    return "\n".join(
        [
            f"# Toy GenEval: {model}" + ("" if lora is None else f" + {lora.describe()}"),
            "",
            f"{config.steps} ODE steps, {allocation}, guidance {config.guidance_scale:g}, seed {config.seed}",
            "",
            format_table(summary),
            "",
            f"images correct: {images_ok}/{n_images} ({summary['images_correct']:.3f}); "
            f"prompts correct: {prompts_ok}/{n_prompts} ({summary['prompts_correct']:.3f})",
            "",
        ]
    )


def run_eval(config: EvalConfig) -> dict:
    """Evaluate ``config.model`` on the toy prompts; write ``results.json``, ``summary.md`` and ``grid.png``.

    Returns the GenEval summary and prints its table. Bad settings raise ValueError, a missing model, LoRA or prompt
    file FileNotFoundError (both name what is wrong), all before the model loads.
    """
    from flowalign.errors import setup_phase
    from flowalign.lora_loading import base_model_path, load_model

    with setup_phase():  # the user's mistakes, up to a loaded model, are reported as such (exit 2 on the CLI)
        lora = config.lora_source()
        config = run_evaluation_settings(config, lora)  # a checkpoint's run: its own final evaluation's settings
        config.validate()
        outputs = OutputFolder(Path(config.out_dir), TOY_EVAL_OUTPUTS, "flowalign eval toy")
        replacing = outputs.check(overwrite=config.overwrite)
        prompts_path = Path(config.prompts) if config.prompts is not None else default_prompts_path()
        if not prompts_path.is_file():
            raise FileNotFoundError(f"prompt file {str(prompts_path)!r} does not exist")
        metadata = load_metadata(prompts_path)
        if config.max_prompts is not None:
            metadata = metadata[: config.max_prompts]
        if not metadata:
            raise ValueError(f"prompt file {str(prompts_path)!r} has no prompts")
        model_path = base_model_path(config.model, lora, DEFAULT_MODEL)
        model = load_model(model_path, lora, dtype=config.dtype, device=str(resolve_device(config.device)))

    counts = images_per_tag(metadata, config.images_per_tag) if config.images_per_tag else config.images_per_prompt
    results, summary, images = evaluate(
        model,
        metadata,
        steps=config.steps,
        images_per_prompt=counts,
        guidance_scale=config.guidance_scale,
        seed=config.seed,
        batch_size=config.batch_size,
        image_size=config.resolution,
    )

    if replacing:  # --overwrite: the earlier run's outputs go just before the first write
        outputs.replace_earlier()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "config": {**asdict(config), "model": model_path, "prompts": str(prompts_path),
                   "lora_weights": None if lora is None else lora.weights},
        "summary": summary,
        "results": results,
    }
    (out / "results.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    markdown = _summary_markdown(config, summary, model_path, lora)
    (out / "summary.md").write_text(markdown, encoding="utf-8")
    shown = min(GRID_MAX_IMAGES, len(results))
    captions = [f"{r['prompt']} | {'yes' if r['correct'] else 'no'}" for r in results[:shown]]
    save_grid(images[:shown], captions, out / "grid.png")
    logger.info("%s", markdown.split("\n", 4)[-1].rstrip())
    logger.info("%s", f"wrote {out / 'results.json'}, {out / 'summary.md'}, {out / 'grid.png'}")
    return summary


# resolve_model_path moved to flowalign.lora_loading in 0.2: the old name works for one release, with a warning.
__getattr__ = moved_names(__name__, {"resolve_model_path": "flowalign.lora_loading:resolve_model_path"})
