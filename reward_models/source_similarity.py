"""Source similarity: how much of its condition image an edited sample keeps (the preservation half of an editing
reward).

A sample made from an editing prompt (``{"prompt": ..., "images": [...]}``, see ``flowalign.data.condition_images``)
carries the paths of its source images in ``metadata[b]["images"]``. This reward reads source ``image`` of that list
and scores the sample ``x`` against it:

* ``metric: pixel``: ``1 - mean |x - s|`` over pixels and channels, in [0, 1], where ``s`` is the source resized to the
  sample's size (bilinear, antialiased) as fp32 in [0, 1];
* ``metric: clip``: the cosine ``cos(E(x), E(s))`` of open_clip image embeddings (CLIP's preprocessing of both; the
  ``weights`` / ``model_name`` / ``quick_gelu`` of ``clipscore``: OpenAI's ViT-L-14 by default).

Both are differentiable in the sample (RGS, RG-OPD and Euphonium can use them). Alone the reward is maximised by
copying the source; weigh it against an instruction-following reward (``clipscore`` on the instruction,
``toy_geneval`` on the target's metadata, a remote judge) in ``reward.rewards``. A sample without a source image is
refused with the prompt it came from: every line of an editing prompt file needs its ``images``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flowalign.data.condition_images import IMAGES_KEY, load_condition_image
from flowalign.errors import RewardInputError

from .base import RewardModel
from .clipscore import OPENAI_VIT_L14_SOURCE, clip_preprocess, image_size_of
from .open_clip_backbone import encode_image, load_open_clip

__all__ = ["METRICS", "SourceSimilarity", "pixel_similarity", "source_tensor"]

METRICS = ("pixel", "clip")


def source_tensor(path: str, size: tuple[int, int]) -> Tensor:
    """The image at ``path`` as ``[3, H, W]`` fp32 in [0, 1], resized (bilinear, antialiased) to ``size``."""
    import numpy as np

    pixels = torch.from_numpy(np.asarray(load_condition_image(path), dtype=np.float32) / 255.0).permute(2, 0, 1)
    if tuple(pixels.shape[-2:]) != tuple(size):
        pixels = F.interpolate(pixels[None], size=tuple(size), mode="bilinear", antialias=True,
                               align_corners=False)[0].clamp(0, 1)
    return pixels


def pixel_similarity(images: Tensor, sources: Tensor) -> Tensor:
    """``1 - mean |x - s|`` per image of ``[B, 3, H, W]`` batches in [0, 1]."""
    return 1.0 - (images.float() - sources.float()).abs().flatten(1).mean(dim=1)


class SourceSimilarity(RewardModel):
    """Similarity of each sample to its condition image ``image`` (module docstring)."""

    name = "source_similarity"
    reads_files = (IMAGES_KEY,)  # opens metadata[b]["images"][image]: served only under a files_root

    def __init__(self, metric: str = "pixel", *, image: int = 0, weights: str = "openai",
                 model_name: str = "ViT-L-14", quick_gelu: bool = True, device=None, dtype="fp32",
                 batch_size: int = 16):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if metric not in METRICS:
            raise ValueError(f"source_similarity: metric must be one of {', '.join(METRICS)}, got {metric!r}")
        if isinstance(image, bool) or not isinstance(image, int) or image < 0:
            raise ValueError(f"source_similarity: image must be an index >= 0 into each prompt's images, got {image!r}")
        self.metric, self.image = metric, image
        self.model = None
        if metric == "clip":
            self.model, _ = load_open_clip(model_name, weights, reward=self.name, key="weights",
                                           source=OPENAI_VIT_L14_SOURCE, quick_gelu=quick_gelu,
                                           device=self.device, dtype=self.dtype)
            self.image_size = image_size_of(self.model)

    def sources(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> Tensor:
        """The source image of every sample at the samples' size, ``[B, 3, H, W]`` on the images' device."""
        size = tuple(images.shape[-2:])
        rows = []
        for b in range(images.shape[0]):
            paths = (metadata[b].get(IMAGES_KEY) if metadata is not None and b < len(metadata) else None) or ()
            if isinstance(paths, str) or len(paths) <= self.image:
                prompt = prompts[b] if b < len(prompts) else "?"
                raise RewardInputError(f"source_similarity: the sample of prompt {prompt!r} has {len(paths)} condition "
                                 f"image(s), and image={self.image} asks for one more: give every line of the prompt "
                                 f"file an \"{IMAGES_KEY}\" list (data.train_prompts / data.eval_prompts), or set "
                                 "reward.rewards[...].kwargs.image")
            try:
                rows.append(source_tensor(str(paths[self.image]), size))
            except Exception as error:  # noqa: BLE001 - PIL: missing, not an image, truncated, a bomb
                prompt = prompts[b] if b < len(prompts) else "?"
                raise RewardInputError(f"source_similarity: condition image {self.image} of the sample of prompt "
                                       f"{prompt!r} cannot be read as an image ({type(error).__name__})") from error
        return torch.stack(rows).to(images.device)

    def forward(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        sources = self.sources(images, prompts, metadata)
        if self.metric == "pixel":
            return pixel_similarity(images, sources)
        features = encode_image(self.model, clip_preprocess(torch.cat([images, sources]), self.image_size))
        ours, theirs = features[: images.shape[0]], features[images.shape[0]:]
        return (ours * theirs).sum(dim=-1)
