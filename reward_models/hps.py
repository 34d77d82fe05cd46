"""HPS v2 / v2.1: Human Preference Score (Wu et al. 2023, "Human Preference Score v2", arXiv:2306.09341).

An open_clip ``ViT-H-14`` fine-tuned on human preference pairs. It is built with ``pretrained=None`` and loaded from
the HPS checkpoint file (``HPS_v2_compressed.pt`` or ``HPS_v2.1_compressed.pt``, hub repository ``xswu/HPSv2``).

Preprocessing: resize the longest side to 224 (bicubic), pad evenly to 224 x 224 with black, normalise with the
OpenAI CLIP mean and std. Score: ``cos(image embedding, text embedding)``, in [-1, 1] (typically 0.2 to 0.35); the
HPD v2 benchmark reports it multiplied by 100.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .base import RewardModel
from .images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize, resize_longest_pad_square
from .open_clip_backbone import encode_image, encode_text, load_open_clip
from .weights import hub_file

__all__ = ["HPS_CHECKPOINTS", "HPSv2"]

HPS_HUB_REPO = "xswu/HPSv2"
HPS_CHECKPOINTS = {"v2": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


class HPSv2(RewardModel):
    """HPS v2 or v2.1 (see module docstring). ``checkpoint``: local file; None downloads it from the hub."""

    name = "hps"

    def __init__(self, checkpoint: str | None = None, version: str = "v2.1", *, model_name: str = "ViT-H-14",
                 device=None, dtype="fp32", batch_size: int = 16):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        if version not in HPS_CHECKPOINTS:
            raise ValueError(f"hps: unknown version {version!r}: expected one of {', '.join(HPS_CHECKPOINTS)}")
        self.version = version
        filename = HPS_CHECKPOINTS[version]
        if checkpoint is None:
            checkpoint = str(hub_file(HPS_HUB_REPO, filename, reward=self.name, key="checkpoint"))
        source = f"the hub repository {HPS_HUB_REPO} (file {filename})"
        self.model, self.tokenizer = load_open_clip(model_name, checkpoint, reward=self.name, key="checkpoint",
                                                    source=source, device=self.device, dtype=self.dtype)
        size = self.model.visual.image_size
        self.image_size = size[0] if isinstance(size, (tuple, list)) else int(size)

    def preprocess(self, images: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> ``[B, 3, S, S]`` normalised pixels, S = the model's image size (224)."""
        padded = resize_longest_pad_square(images.float(), self.image_size, fill=0.0)
        return normalize(padded, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    def forward(self, images: Tensor, prompts: Sequence[str], metadata=None) -> Tensor:
        """``cos(image, text)`` per pair, differentiable with respect to ``images``."""
        image_features = encode_image(self.model, self.preprocess(images))
        text_features = encode_text(self.model, self.tokenizer, prompts, self.device)
        return (image_features * text_features).sum(dim=-1)
