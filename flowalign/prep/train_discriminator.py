"""``flowalign prep train-discriminator``: DRL's stage 1 (Beltran-Velez et al., arXiv 2606.19162, Alg. 1).

A projection discriminator (``flowalign.reward_models.discriminator``) between data images and the base model's
samples of the same prompts, on frozen features, with the logistic loss and R1.

* Data: an image-caption dataset, or ``toy`` / ``toy:N`` (the toy world's exact scenes of the training prompts;
  ``flowalign.data.images``). Row ``i`` of the dataset is one real image; its fake is an ODE sample of the base
  model for row ``i``'s prompt, its noise keyed ``(seed, purpose, refresh, i)``, so a run is repeatable bitwise on
  one machine and a fake depends only on what it is for.
* Validation: ``val_fraction`` of the rows (a keyed draw), each with one fake drawn once; scored every
  ``validate_every`` optimizer steps with the logistic loss (without R1), which early stopping reads: training stops
  after ``patience`` validations without improvement and the checkpoint keeps the best weights.
* Buffered training, as the paper: each *refresh* draws ``buffer_batches`` mini-batches of ``batch_size`` training rows
  (with fresh fakes) and runs ``epochs`` shuffled epochs over them, Adam at ``lr``, up to ``max_steps`` steps.

Writes ``out`` (safetensors) and its ``.json`` sidecar: the feature extractor, the image size, the conditioning, the
base model (path and fingerprint), the validation accuracy and loss of the kept weights, and the history.
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.settings import option

__all__ = ["DiscriminatorTrainConfig", "train_discriminator"]

logger = logging.getLogger(__name__)

# Keys of the command's random draws (the second element of each key).
_VALIDATION_ROWS, _VALIDATION_FAKES, _BUFFER_ROWS, _BUFFER_FAKES, _SHUFFLE = range(5)


@dataclass
class DiscriminatorTrainConfig:
    """Settings of ``flowalign prep train-discriminator``."""

    model: str = option("assets/toy-sd3", "diffusers pipeline directory (or hub id) of the base model whose samples "
                        "are the fakes; the checkpoint records its fingerprint")
    data: str = option("toy", "the real images: an image-caption JSONL (or a folder with metadata.jsonl), or toy / "
                       "toy:N (the toy world's exact scenes of the training prompts, N per prompt)")
    features: Literal["segmenter", "dinov2"] = option(
        "segmenter", "frozen feature extractor: segmenter (the toy segmenter's trunk) or dinov2 (DINOv2's CLS token)")
    features_path: str | None = option(None, "its weights: the segmenter folder (default: the embedded one) or a "
                                       "DINOv2 directory / hub id (required for dinov2)")
    conditioning: Literal["text", "none"] = option(
        "text", "text: e(c), b(c) from the base model's pooled text embedding of the prompt (an extrapolation of the "
        "paper's class embeddings); none: the prompt-free logit phi(h(f))")
    image_size: int | None = option(None, "image side in pixels (data resized and cropped to it, samples drawn at "
                                    "it); default: the model's")
    sample_steps: int = option(10, "ODE steps of the base model's samples")
    guidance_scale: float = option(1.0, "CFG scale of the samples (1: none)")
    val_fraction: float = option(0.1, "fraction of the dataset's rows held out for validation")
    batch_size: int = option(64, "real (and as many fake) images per mini-batch (paper: 512)")
    buffer_batches: int = option(20, "mini-batches per buffer refresh")
    epochs: int = option(10, "epochs over each buffer")
    max_steps: int = option(10000, "most optimizer steps")
    validate_every: int = option(50, "validate every this many optimizer steps")
    patience: int = option(15, "validations without a lower validation loss before stopping")
    lr: float = option(1e-4, "Adam learning rate")
    gamma: float = option(1e-5, "R1 weight: gamma/2 ||grad_x r(x_real)||^2")
    width: int = option(512, "width of h (the projection)")
    sample_batch_size: int = option(64, "samples generated at a time")
    seed: int = option(0, "seed")
    out: str = option("outputs/discriminator/discriminator.safetensors", "checkpoint to write (and its .json)")
    device: str | None = option(None, "torch device (default: cuda when available, else cpu)")

    def validate(self) -> None:
        from flowalign.settings import at_least, finite

        for name in ("sample_steps", "batch_size", "buffer_batches", "epochs", "max_steps", "validate_every",
                     "patience", "width", "sample_batch_size"):
            at_least(name, getattr(self, name), 1)
        at_least("seed", self.seed, 0)
        at_least("image_size", self.image_size, 8)
        finite("val_fraction", self.val_fraction, 0, strict=True, high=0.9)
        finite("lr", self.lr, 0, strict=True)
        finite("gamma", self.gamma, 0)
        finite("guidance_scale", self.guidance_scale, 0)


def validation_rows(rows: int, config: DiscriminatorTrainConfig) -> int:
    """The rows held out for validation, ``max(1, round(val_fraction * rows))``; a split that leaves no row to train
    on (or none to validate) is a ValueError naming ``val_fraction`` and ``data``, raised before the model loads."""
    held = max(1, round(config.val_fraction * rows))
    if rows < 2 or held >= rows:
        raise ValueError(
            f"val_fraction = {config.val_fraction} holds out {held} of the {rows} rows of data = {config.data!r}, "
            f"leaving {max(0, rows - held)} to train on: lower val_fraction (each side needs at least 1 row), or give "
            "more images")
    return held


def train_discriminator(config: DiscriminatorTrainConfig) -> dict:
    """Train and save; returns the sidecar's contents plus ``checkpoint`` (the path written)."""
    from flowalign.errors import setup_phase

    with setup_phase():  # the user's mistakes, up to a loaded model, are reported as such (exit 2 on the CLI)
        parts = _set_up(config)
    return _train(config, *parts)


def _set_up(config: DiscriminatorTrainConfig):
    from flowalign.data.images import check_image_dataset, open_image_dataset
    from flowalign.devices import resolve_device
    from flowalign.lora_loading import resolve_model_path
    from flowalign.models.loading import load_flow_model
    from flowalign.outputs import check_new_files
    from flowalign.reward_models.discriminator import build_features, feature_spec, sidecar_path

    config.validate()
    check_new_files(config.out, also=[sidecar_path(config.out)], key="out")  # as export: nothing is overwritten
    validation_rows(check_image_dataset(config.data), config)
    spec = feature_spec(config.features, config.features_path)
    model_path = resolve_model_path(config.model)
    device = resolve_device(config.device)
    model = load_flow_model(model_path, device=device)
    model.transformer.requires_grad_(False)
    size = config.image_size or model.default_image_size[0]
    dataset = open_image_dataset(config.data, size)
    features = build_features(config.features, config.features_path, device)
    return model, model_path, dataset, features, {**spec, "dim": int(features.dim)}, size, device


def _fakes(model, prompts: list[str], keys: list[tuple[int, ...]], config, size: int) -> Tensor:
    """ODE samples ``[N, 3, size, size]`` of the base model, sample ``j`` from the noise keyed ``keys[j]``."""
    from flowalign.evaluation.toy_eval import _sample_batch
    from flowalign.seeding import generator

    sigmas = model.sigmas(config.sample_steps, size)
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), config.sample_batch_size):
            chunk = keys[start:start + config.sample_batch_size]
            noise = model.prepare_noise(len(chunk), size, generator=[generator(*key) for key in chunk])
            out.append(_sample_batch(model, prompts[start:start + len(chunk)], noise, sigmas, config.guidance_scale))
    return torch.cat(out)


def _train(config: DiscriminatorTrainConfig, model, model_path, dataset, features, spec, size, device) -> dict:
    from flowalign.reward_models.discriminator import (
        ProjectionDiscriminator, TextEmbeddings, accuracy, discriminator_loss, model_fingerprint, save_discriminator,
        sidecar_path)
    from flowalign.errors import setup_phase
    from flowalign.outputs import check_new_files
    from flowalign.seeding import generator, numpy_rng

    seed, rows = config.seed, len(dataset)
    text = TextEmbeddings(lambda prompts: model.encode(list(prompts)).sentence_embedding().float()) \
        if config.conditioning == "text" else None
    text_dim = int(text([dataset.prompt(0)], "cpu").shape[1]) if text is not None else None
    torch.manual_seed(seed)
    head = ProjectionDiscriminator(spec["dim"], text_dim=text_dim, width=config.width).to(device)
    optimizer = torch.optim.Adam(head.parameters(), lr=config.lr)

    def score(images: Tensor, embeddings: Tensor | None) -> Tensor:
        return head(features(images.to(device)), embeddings)

    def embed(prompts: list[str]) -> Tensor | None:
        return text(prompts, device) if text is not None else None

    order = numpy_rng(seed, _VALIDATION_ROWS).permutation(rows)
    held = validation_rows(rows, config)
    val_rows, train_rows = sorted(order[:held].tolist()), sorted(order[held:].tolist())
    val_real, val_prompts = dataset.batch(val_rows)
    val_fake = _fakes(model, val_prompts, [(seed, _VALIDATION_FAKES, r) for r in val_rows], config, size)

    @torch.no_grad()
    def validate() -> tuple[float, float]:
        real_logits, fake_logits = [], []
        for start in range(0, len(val_rows), config.batch_size):
            prompts = val_prompts[start:start + config.batch_size]
            real_logits.append(score(val_real[start:start + config.batch_size], embed(prompts)).cpu())
            fake_logits.append(score(val_fake[start:start + config.batch_size], embed(prompts)).cpu())
        real, fake = torch.cat(real_logits), torch.cat(fake_logits)
        loss = float(torch.nn.functional.softplus(-real).mean() + torch.nn.functional.softplus(fake).mean())
        return loss, accuracy(real, fake)

    loss0, accuracy0 = validate()
    history = [{"step": 0, "val_loss": loss0, "val_accuracy": accuracy0}]
    best = {"loss": loss0, "accuracy": accuracy0, "step": 0, "state": copy.deepcopy(head.state_dict())}
    step, refresh, waited, stop = 0, 0, 0, False
    per_buffer = config.buffer_batches * config.batch_size
    while not stop:
        picked = numpy_rng(seed, _BUFFER_ROWS, refresh).choice(train_rows, size=per_buffer,
                                                              replace=per_buffer > len(train_rows)).tolist()
        real, prompts = dataset.batch(picked)
        fake = _fakes(model, prompts, [(seed, _BUFFER_FAKES, refresh, j) for j in range(len(picked))], config, size)
        for epoch in range(config.epochs):
            shuffled = torch.randperm(len(picked), generator=generator(seed, _SHUFFLE, refresh, epoch))
            for batch in shuffled.split(config.batch_size):
                texts = embed([prompts[i] for i in batch.tolist()])
                parts = discriminator_loss(score, real[batch], fake[batch], real_text=texts, fake_text=texts,
                                           gamma=config.gamma)
                optimizer.zero_grad(set_to_none=True)
                parts["loss"].backward()
                optimizer.step()
                step += 1
                if step % config.validate_every == 0 or step == config.max_steps:
                    val_loss, val_accuracy = validate()
                    history.append({"step": step, "refresh": refresh, "loss": float(parts["loss"].detach()),
                                    "r1": float(parts["r1"].detach()), "val_loss": val_loss,
                                    "val_accuracy": val_accuracy})
                    logger.info("discriminator step %d: loss %.4f, validation loss %.4f, accuracy %.3f", step,
                                history[-1]["loss"], val_loss, val_accuracy)
                    if val_loss < best["loss"]:
                        best = {"loss": val_loss, "accuracy": val_accuracy, "step": step,
                                "state": copy.deepcopy(head.state_dict())}
                        waited = 0
                    else:
                        waited += 1
                    stop = waited >= config.patience
                if stop or step >= config.max_steps:
                    stop = True
                    break
            if stop:
                break
        refresh += 1
    head.load_state_dict(best["state"])
    meta = {
        "features": spec, "image_size": [size, size], "conditioning": config.conditioning,
        "model": str(model_path), "model_fingerprint": model_fingerprint(model_path),
        "val_accuracy": best["accuracy"], "val_loss": best["loss"], "selected_step": best["step"], "steps": step,
        "val_images": len(val_rows), "train_rows": len(train_rows), "data": config.data,
        "config": asdict(config), "history": history,
    }
    with setup_phase():  # again: nothing may have appeared there while it trained
        check_new_files(config.out, also=[sidecar_path(config.out)], key="out")
    out = save_discriminator(head, config.out, meta)
    logger.info("kept the weights of step %d: validation accuracy %.3f on %d real and %d fake images", best["step"],
                best["accuracy"], len(val_rows), len(val_rows))
    if math.isnan(best["accuracy"]):
        logger.warning("no validation accuracy: the validation split is empty")
    return {**meta, "checkpoint": str(out)}
