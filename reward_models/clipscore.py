"""CLIPScore (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image Captioning").

open_clip ``ViT-L-14`` with OpenAI's weights (QuickGELU). ``weights`` is a local file (OpenAI's ``ViT-L-14.pt`` or an
open_clip state dict such as ``open_clip_pytorch_model.bin`` of ``timm/vit_large_patch14_clip_224.openai``) or the
open_clip tag ``"openai"`` (downloaded by open_clip).

Preprocessing: resize the shorter side to 224 (bicubic), centre crop 224, normalise with the OpenAI CLIP mean/std.
Score: ``w * max(cos(image, text), 0)`` with ``w = 2.5`` (the paper's rescaling; set ``w = 1`` for the raw cosine).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from .base import RewardModel
from .images import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize, resize_shortest_center_crop
from .open_clip_backbone import encode_image, encode_text, load_open_clip

__all__ = ["CLIPScore", "OPENAI_VIT_L14_SOURCE", "clip_preprocess"]

OPENAI_VIT_L14_SOURCE = (
    "OpenAI's CLIP release (ViT-L-14.pt) or the hub repository timm/vit_large_patch14_clip_224.openai "
    "(open_clip_pytorch_model.bin)"
)


def clip_preprocess(images: Tensor, size: int) -> Tensor:
    """CLIP's preprocessing of ``[B, 3, H, W]`` images in [0, 1]: shorter side to ``size``, centre crop, normalise."""
    return normalize(resize_shortest_center_crop(images.float(), size), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)


def image_size_of(model) -> int:
    size = model.visual.image_size
    return size[0] if isinstance(size, (tuple, list)) else int(size)


class CLIPScore(RewardModel):
    """``w * max(cos, 0)`` of open_clip ViT-L-14 (OpenAI) embeddings (see module docstring)."""

    name = "clipscore"

    def __init__(self, weights: str = "openai", *, w: float = 2.5, model_name: str = "ViT-L-14",
                 quick_gelu: bool = True, device=None, dtype="fp32", batch_size: int = 16):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        self.w = float(w)
        self.model, self.tokenizer = load_open_clip(model_name, weights, reward=self.name, key="weights",
                                                    source=OPENAI_VIT_L14_SOURCE, quick_gelu=quick_gelu,
                                                    device=self.device, dtype=self.dtype)
        self.image_size = image_size_of(self.model)

    def forward(self, images: Tensor, prompts: Sequence[str], metadata=None) -> Tensor:
        image_features = encode_image(self.model, clip_preprocess(images, self.image_size))
        text_features = encode_text(self.model, self.tokenizer, prompts, self.device)
        return self.w * (image_features * text_features).sum(dim=-1).clamp(min=0.0)
