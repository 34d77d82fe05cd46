"""``flowalign reward train-discriminator``: DRL's discriminator between data images and the base model's samples
(``flowalign.training.discriminator``), built from its settings dataclass by the config loader."""

from __future__ import annotations

import argparse

from .options import ConfigCommand, add_config_command

__all__ = ["add_train_discriminator"]


def _run_train_discriminator(config, args: argparse.Namespace) -> None:
    from flowalign.training.discriminator import train_discriminator

    result = train_discriminator(config)
    print(f"wrote {result['checkpoint']} (validation accuracy {result['val_accuracy']:.3f} at step "
          f"{result['selected_step']})")


def add_train_discriminator(group) -> None:
    add_config_command(
        group, "train-discriminator",
        ConfigCommand("flowalign.training.discriminator:DiscriminatorTrainConfig", _run_train_discriminator),
        help="train DRL's discriminator reward: data images against the base model's samples, on frozen features",
        description="Sample the base model on the data's prompts, and fit a projection logit r(x, c) = phi(h(f)) + "
        "<h(f), e(c)> + b(c) on frozen features f (the toy segmenter's trunk, or DINOv2's CLS token) with the "
        "logistic loss and an R1 penalty, in buffered refreshes with early stopping on a validation split. Writes "
        "--out (safetensors) and a .json sidecar (feature extractor, image size, base model fingerprint, validation "
        "accuracy); the reward `discriminator` reads it (kwargs: {path: ...}).",
    )
