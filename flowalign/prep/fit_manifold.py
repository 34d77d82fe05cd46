"""``flowalign prep fit-manifold``: fit a Shell-LCC manifold on a model's VAE latents of data images.

The data images (an image-caption dataset, or ``toy`` / ``toy:N``: the toy world's exact scenes,
``flowalign.data.images.open_image_dataset``) are encoded with ``model.encode_images`` (the VAE posterior mean with
the transformer's shift/scale normalisation, the latents the transformer sees), and the manifold is fitted on them
with the public two-stage schedule (``flowalign.reward_models.shell_lcc.fit_manifold``). The checkpoint is a
safetensors file and a JSON sidecar naming the pipeline and VAE it was fitted for, the latent channels, the settings
and the fit's statistics. Every draw is keyed by
``seed``: the same settings on the same machine give the same file, bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from flowalign.devices import resolve_device
from flowalign.settings import option

__all__ = ["FitManifoldConfig", "encode_dataset", "fit_model_manifold"]

logger = logging.getLogger(__name__)


@dataclass
class FitManifoldConfig:
    """Settings of ``flowalign prep fit-manifold``."""

    model: str = option("assets/toy-sd3", "diffusers pipeline directory whose VAE latents the manifold models")
    data: str = option("toy", "data images: an image-caption JSONL, a folder with metadata.jsonl, or toy / toy:N "
                              "(the toy world's exact scenes, N per training prompt)")
    image_size: int | None = option(None, "images are resized (cover, centre crop) to this side; null = the model's "
                                          "default")
    max_images: int | None = option(None, "use only the first M images of the data")
    num_bases: int = option(256, "LCC bases K (the public code: 4096 for Wan latents)")
    hidden_dim: int = option(512, "width of the predictor and the shell head (the public trainer's 512)")
    epochs_lcc: int = option(5, "stage 1 (LCC skeleton) epochs (the public code: 500)")
    epochs_shell: int = option(5, "stage 2 (shell head, LCC frozen) epochs (the public code: 100)")
    batch_size: int = option(8, "images per optimizer step")
    lr: float = option(1e-3, "Adam learning rate of both stages")
    lambda_usage: float = option(0.1, "weight of KL(usage || uniform) in stage 1 (0 = off)")
    lambda_basis_to_data: float = option(0.1, "weight of the basis-to-data pull in stage 1 (0 = off)")
    seed: int = option(0, "seed of the initialisation, the bases' data points and the batch order")
    encode_batch: int = option(32, "images per VAE encoder batch")
    out: str = option("outputs/manifolds/shell_lcc.safetensors", "checkpoint to write (and its .json sidecar)")
    device: str | None = option(None, "torch device (default: cuda when available, else cpu)")

    def validate(self) -> None:
        for name in ("num_bases", "hidden_dim", "batch_size", "encode_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("epochs_lcc", "epochs_shell"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.epochs_shell < 1:
            raise ValueError("epochs_shell must be >= 1: the shell head is what the reward reads")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        for name in ("lambda_usage", "lambda_basis_to_data"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_images is not None and (not isinstance(self.max_images, int) or self.max_images < 1):
            raise ValueError(f"max_images must be an integer >= 1 or null, got {self.max_images!r}")
        if not str(self.out).endswith(".safetensors"):
            raise ValueError(f"out must be a .safetensors file (its sidecar is written next to it), got {self.out!r}")


def encode_dataset(model, dataset, count: int, batch: int) -> torch.Tensor:
    """``model.encode_images`` (the posterior mean) of the first ``count`` images of ``dataset``, fp32 ``[N, C, h, w]``."""
    out = []
    with torch.no_grad():
        for start in range(0, count, batch):
            images, _ = dataset.batch(range(start, min(count, start + batch)))
            out.append(model.encode_images(images, dtype=torch.float32))
    return torch.cat(out)


def fit_model_manifold(config: FitManifoldConfig) -> dict:
    """Check the inputs, encode the data, fit, write the checkpoint; returns the sidecar's content."""
    from flowalign.data.images import check_image_dataset, open_image_dataset
    from flowalign.errors import SetupError, setup_phase
    from flowalign.outputs import check_new_files
    from flowalign.reward_models.shell_lcc import (fit_manifold, read_sidecar, save_manifold, sidecar_path,
                                                   vae_fingerprint)

    with setup_phase():
        config.validate()
        check_new_files(config.out, also=[sidecar_path(config.out)], key="out")  # as export: nothing is overwritten
        fingerprint = vae_fingerprint(config.model)
        if fingerprint is None:
            raise SetupError(f"model {config.model!r} is not a local diffusers pipeline with vae/config.json: "
                             "fit-manifold reads the VAE it fits for from the pipeline directory")
        try:
            check_image_dataset(config.data)
        except (FileNotFoundError, ValueError) as error:
            raise SetupError(f"data = {config.data!r}: {error}") from error
        device = resolve_device(config.device)
        from flowalign.models import load_flow_model
        from flowalign.models.base import as_image_size

        model = load_flow_model(config.model, device=device)
        size = as_image_size(config.image_size, model.default_image_size)
        dataset = open_image_dataset(config.data, size)
        count = len(dataset) if config.max_images is None else min(len(dataset), config.max_images)
        if count < config.batch_size:
            raise SetupError(f"data = {config.data!r} has {count} images, fewer than batch_size = {config.batch_size}")
    logger.info("fit-manifold: encoding %d images of %s at %dx%d with %s's VAE", count, config.data, *size, config.model)
    latents = encode_dataset(model, dataset, count, config.encode_batch)
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("device", "out", "encode_batch")}
    manifold, stats = fit_manifold(latents, num_bases=config.num_bases, hidden_dim=config.hidden_dim,
                                   epochs_lcc=config.epochs_lcc, epochs_shell=config.epochs_shell,
                                   batch_size=config.batch_size, lr=config.lr, lambda_usage=config.lambda_usage,
                                   lambda_basis_to_data=config.lambda_basis_to_data, seed=config.seed, log_every=1)
    extra = {"fit": {**settings, "image_size": list(size), "images": count, "latent_shape": list(latents.shape[1:])},
             "data_distance": stats["data_distance"], "data_distance_std": stats["data_distance_std"],
             "stats": {k: v for k, v in stats.items() if isinstance(v, dict)}}
    with setup_phase():  # again: nothing may have appeared there while it fitted
        check_new_files(config.out, also=[sidecar_path(config.out)], key="out")
    path = save_manifold(manifold, config.out, fitted_for=fingerprint, extra=extra)
    logger.info("fit-manifold: data distance %.4f (std %.4f)", stats["data_distance"], stats["data_distance_std"])
    return read_sidecar(Path(path))
