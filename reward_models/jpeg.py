"""JPEG compressibility and incompressibility (Black et al. 2023, "Training Diffusion Models with Reinforcement
Learning", DDPO's prompt-independent rewards).

Each image is converted to 8-bit RGB (``round(255 x)``), encoded as JPEG at ``quality`` (95, as DDPO) with PIL, and
scored by its size in kilobytes: ``compressibility = -kB`` (smaller files score higher), ``incompressibility = +kB``.
No resizing: the size depends on the resolution, so compare images of one size. Not differentiable: it has no
``forward`` entry point, so RGS and RG-OPD refuse it (``flowalign.rewards.require_differentiable``).
"""

from __future__ import annotations

import io
from typing import Any, Sequence

import torch
from PIL import Image
from torch import Tensor

from .images import as_image_batch

__all__ = ["JpegCompressibility", "jpeg_kilobytes"]


def jpeg_kilobytes(images: Tensor, quality: int = 95) -> Tensor:
    """JPEG sizes in kB (1000 bytes) of ``images [B, 3, H, W]`` in [0, 1]."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(array, mode="RGB").save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility:
    """``-kB`` (``incompressible=False``) or ``+kB`` of the JPEG encoding; see the module docstring."""

    differentiable = False

    def __init__(self, quality: int = 95, incompressible: bool = False):
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(f"jpeg quality must be an integer in [1, 100], got {quality!r}")
        self.quality = quality
        self.sign = 1.0 if incompressible else -1.0
        self.name = "jpeg_incompressibility" if incompressible else "jpeg_compressibility"

    def __call__(self, images: Any, prompts: Sequence[str] | None = None, metadata=None) -> Tensor:
        return self.sign * jpeg_kilobytes(as_image_batch(images), self.quality)
