"""Low-level statistics of decoded toy images: colour purity, edge crispness and collapse to a flat canvas.

The toy world's scenes (``flowalign.toy.scenes``) are flat palette colours with hard edges on a grey canvas, so what a
per-position latent reward such as Shell-LCC can change is measurable directly on the pixels, for images ``[B, 3, H,
W]`` in [0, 1]:

* ``purity``: the share of pixels within ``radius`` (Euclidean RGB distance, [0, 1] units) of a palette colour or the
  background; a render scores 1, blur and noise lower it. ``palette_distance``: the mean distance to the nearest one.
* ``edge_step``: ``sum d^2 / sum |d|`` over the horizontal and vertical neighbour differences ``d`` of every channel:
  the typical height of an intensity step. A hard edge of height ``h`` is one step ``h``; blurred over ``n`` pixels it
  is ``n`` steps of ``h / n``, so the statistic falls to ``h / n``; noise (many small steps) lowers it too.
* ``flat_fraction``: the share of images whose pixel standard deviation is below ``flat_std`` (a blank canvas: the
  collapse a manifold reward minimised to its skeleton can drive to); ``background_fraction``: the share of pixels at
  the background grey.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowalign.toy.scenes import BACKGROUND, PALETTE

__all__ = ["image_statistics"]


def image_statistics(images: Tensor, *, radius: float = 0.12, flat_std: float = 0.02) -> dict[str, float]:
    """The statistics of the module docstring for images ``[B, 3, H, W]`` in [0, 1] (means over the batch)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"image_statistics takes images [B, 3, H, W], got shape {tuple(images.shape)}")
    images = images.detach().float().cpu()
    colours = torch.tensor([*PALETTE.values(), BACKGROUND], dtype=torch.float32) / 255  # [P + 1, 3]
    pixels = images.permute(0, 2, 3, 1).reshape(-1, 3)
    distance = torch.cdist(pixels, colours)  # [N, P + 1]
    nearest = distance.min(dim=1).values
    dx = images[..., :, 1:] - images[..., :, :-1]
    dy = images[..., 1:, :] - images[..., :-1, :]
    steps = torch.cat([dx.flatten(), dy.flatten()]).abs()
    spread = images.flatten(1).std(dim=1)
    return {
        "purity": float((nearest <= radius).float().mean()),
        "palette_distance": float(nearest.mean()),
        "edge_step": float(steps.pow(2).sum() / steps.sum().clamp_min(1e-12)),
        "flat_fraction": float((spread < flat_std).float().mean()),
        "background_fraction": float((distance[:, -1] <= radius).float().mean()),
    }
