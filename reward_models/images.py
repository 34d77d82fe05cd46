"""Image batches for reward models: any input converted to ``[B, 3, H, W]`` float in [0, 1], and the resize / crop /
pad / normalise steps of CLIP-family preprocessing written in torch, so the same code serves scoring and gradients.

Every scorer states in its docstring which of these steps it applies. The steps:

* ``resize_shortest_center_crop(x, size)``: resize so the shorter side is ``size`` (bicubic, antialiased), then take
  the centred ``size x size`` crop. This is CLIP's, PickScore's and the LAION aesthetic predictor's preprocessing.
* ``resize_longest_pad_square(x, size, fill)``: resize so the longer side is ``size``, then pad the shorter side
  evenly to a square with ``fill`` (HPS v2's preprocessing; the extra pixel of an odd pad goes right / bottom).
* ``normalize(x, mean, std)``: per-channel ``(x - mean) / std`` after the resize, on [0, 1] pixels.

The resizes use ``torch.nn.functional.interpolate(..., antialias=True)``; PIL's bicubic resize, which the reference
processors use on uint8 images, differs from it by rounding (a few 1/255 steps at most), so scores match the reference
implementations to about the third decimal, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "as_image_batch",
    "normalize",
    "resize_longest_pad_square",
    "resize_shortest_center_crop",
]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def as_image_batch(images: Any) -> Tensor:
    """``images`` as a float32 ``[B, 3, H, W]`` tensor in [0, 1]; wrong modes are converted, not refused.

    Accepted: a tensor ``[B, C, H, W]`` or ``[C, H, W]`` (C = 1 grey is repeated to RGB, C = 4 drops alpha; uint8 is
    divided by 255, floats are clamped to [0, 1]); a PIL image or a list of them in any mode ("L", "P", "RGBA",
    "CMYK", ... are converted to "RGB"; sizes may differ only if each image is scored alone, see below); a numpy array
    ``[H, W]``, ``[H, W, C]`` or ``[B, H, W, C]``. A list of images of different sizes raises ValueError telling to
    resize or score them one at a time: stacking would need a resize choice that belongs to the scorer.
    """
    if isinstance(images, Tensor):
        return _tensor_batch(images)
    if isinstance(images, np.ndarray):
        return _numpy_batch(images)
    if _is_pil(images):
        return _numpy_batch(np.asarray(images.convert("RGB")))
    if isinstance(images, Sequence) and len(images) > 0:
        items = [as_image_batch(image) for image in images]
        sizes = {tuple(item.shape[-2:]) for item in items}
        if len(sizes) > 1:
            raise ValueError(
                f"images have different sizes {sorted(sizes)} (H, W); resize them to one size first or score them "
                "one at a time"
            )
        return torch.cat(items)
    raise ValueError(f"expected images as a tensor, numpy array, PIL image or a non-empty list; got {type(images)}")


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        return False
    return isinstance(value, Image.Image)


def _tensor_batch(images: Tensor) -> Tensor:
    if images.ndim == 3:
        images = images[None]
    if images.ndim != 4:
        raise ValueError(f"image tensor must be [B, C, H, W] or [C, H, W], got shape {tuple(images.shape)}")
    if images.shape[1] not in (1, 3, 4) and images.shape[-1] in (1, 3, 4):
        images = images.permute(0, 3, 1, 2)  # channels-last input
    channels = images.shape[1]
    if channels == 1:
        images = images.expand(-1, 3, -1, -1)
    elif channels == 4:
        images = images[:, :3]
    elif channels != 3:
        raise ValueError(f"images must have 1, 3 or 4 channels, got shape {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    if not images.is_floating_point():
        raise ValueError(f"image tensor dtype {images.dtype} is neither uint8 nor floating point")
    return images.float().clamp(0.0, 1.0)


def _numpy_batch(array: np.ndarray) -> Tensor:
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise ValueError(f"image array must be [H, W], [H, W, C] or [B, H, W, C], got shape {array.shape}")
    tensor = torch.from_numpy(np.array(array, copy=True)).permute(0, 3, 1, 2)  # PIL arrays are read-only
    if tensor.dtype == torch.uint8:
        return _tensor_batch(tensor)
    return _tensor_batch(tensor.float())


def resize_shortest_center_crop(images: Tensor, size: int) -> Tensor:
    """Resize so the shorter side is ``size`` (bicubic, antialiased), then crop the centred ``size x size`` square."""
    height, width = images.shape[-2:]
    scale = size / min(height, width)
    new_h, new_w = max(size, round(height * scale)), max(size, round(width * scale))
    if (new_h, new_w) != (height, width):
        images = F.interpolate(images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    return images[..., top : top + size, left : left + size].clamp(0.0, 1.0)


def resize_longest_pad_square(images: Tensor, size: int, fill: float = 0.0) -> Tensor:
    """Resize so the longer side is ``size`` (bicubic, antialiased), then pad evenly to ``size x size`` with ``fill``."""
    height, width = images.shape[-2:]
    scale = size / max(height, width)
    new_h, new_w = min(size, round(height * scale)), min(size, round(width * scale))
    if (new_h, new_w) != (height, width):
        images = F.interpolate(images, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    images = images.clamp(0.0, 1.0)
    pad_h, pad_w = size - new_h, size - new_w
    if pad_h or pad_w:
        images = F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=fill)
    return images


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """Per-channel ``(images - mean) / std``."""
    mean_t = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t
