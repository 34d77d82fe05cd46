"""``flowalign reward fit-manifold``: fit a Shell-LCC data manifold on a model's VAE latents of data images
(``flowalign.training.manifold``), the checkpoint the ``shell_lcc`` reward and objective read."""

from __future__ import annotations

import argparse

from .options import ConfigCommand, add_config_command

__all__ = ["add_fit_manifold"]


def _run_fit_manifold(config, args: argparse.Namespace) -> None:
    from flowalign.training.manifold import fit_model_manifold

    meta = fit_model_manifold(config)
    print(f"wrote {config.out} ({meta['num_bases']} bases on {meta['latent_channels']}-channel latents of "
          f"{meta['fit']['images']} images; data distance {meta['data_distance']:.4f})")


def add_fit_manifold(group) -> None:
    add_config_command(
        group, "fit-manifold", ConfigCommand("flowalign.training.manifold:FitManifoldConfig", _run_fit_manifold),
        help="fit a Shell-LCC data manifold on the model's VAE latents of data images (the shell_lcc reward)",
        description="Encode the data images with the model's VAE (posterior mean, the transformer's shift and scale), "
        "fit the two-stage Shell-LCC manifold (LCC skeleton, then the shell head with the skeleton frozen) and write "
        "a safetensors checkpoint with a JSON sidecar naming the model and VAE it was fitted for.",
    )
