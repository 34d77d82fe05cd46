"""GenEval's colour classifier: zero-shot CLIP over 10 colours, on the object masked onto grey and cropped to its box.

Backbone: open_clip ``ViT-L-14`` with OpenAI's weights (as ``CLIPScore``). For an object of class ``cls`` the text
classifier of colour ``c`` is the mean of the L2-normalised embeddings of GenEval's three templates,

    "a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object",

renormalised (the usual zero-shot prompt ensemble). The image is the object's pixels where its mask is set and
#999999 grey elsewhere, cropped to its box (x1, y1 rounded down, x2, y2 up), then CLIP-preprocessed (shorter side to
224, centre crop, OpenAI mean/std). The colour is the argmax of the cosine similarities.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import resolve_device, resolve_dtype
from .clipscore import OPENAI_VIT_L14_SOURCE, clip_preprocess, image_size_of
from .open_clip_backbone import encode_image, encode_text, load_open_clip

__all__ = ["BACKGROUND_GREY", "COLOR_TEMPLATES", "ColorClassifier", "GENEVAL_COLORS", "masked_crop"]

GENEVAL_COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}", "a photo of a {c} object")
BACKGROUND_GREY = 0x99 / 255.0


def masked_crop(image: Tensor, mask: np.ndarray | Tensor, box: Sequence[float]) -> Tensor:
    """``image [3, H, W]`` in [0, 1] with pixels outside ``mask`` set to #999999, cropped to ``box``."""
    mask_t = torch.as_tensor(np.asarray(mask), dtype=torch.bool, device=image.device)
    composite = torch.where(mask_t[None], image, torch.full_like(image, BACKGROUND_GREY))
    height, width = image.shape[-2:]
    x1, y1 = max(0, math.floor(box[0])), max(0, math.floor(box[1]))
    x2, y2 = min(width, max(x1 + 1, math.ceil(box[2]))), min(height, max(y1 + 1, math.ceil(box[3])))
    return composite[:, y1:y2, x1:x2]


class ColorClassifier:
    """Colour names of detected objects (see module docstring). ``weights``: local file or open_clip tag."""

    def __init__(self, weights: str = "openai", *, model_name: str = "ViT-L-14", quick_gelu: bool = True,
                 colors: Sequence[str] = GENEVAL_COLORS, device=None, dtype="fp32", batch_size: int = 32):
        self.device, self.dtype, self.batch_size = resolve_device(device), resolve_dtype(dtype), batch_size
        self.model, self.tokenizer = load_open_clip(model_name, weights, reward="geneval colour classifier",
                                                    key="clip_weights", source=OPENAI_VIT_L14_SOURCE,
                                                    quick_gelu=quick_gelu, device=self.device, dtype=self.dtype)
        self.colors = tuple(colors)
        self.image_size = image_size_of(self.model)
        self._classifiers: dict[str, Tensor] = {}

    @torch.no_grad()
    def text_classifier(self, class_name: str) -> Tensor:
        """``[n_colors, D]``: per colour, the renormalised mean of its template embeddings (cached per class)."""
        if class_name not in self._classifiers:
            rows = []
            for color in self.colors:
                texts = [template.format(c=color, cls=class_name) for template in COLOR_TEMPLATES]
                mean = encode_text(self.model, self.tokenizer, texts, self.device).mean(dim=0)
                rows.append(mean / mean.norm())
            self._classifiers[class_name] = torch.stack(rows)
        return self._classifiers[class_name]

    @torch.no_grad()
    def similarities(self, crops: Sequence[Tensor], class_name: str) -> Tensor:
        """Cosine similarities ``[N, n_colors]`` of ``crops`` (each ``[3, h, w]`` in [0, 1]) to the colour texts."""
        classifier = self.text_classifier(class_name)
        out = []
        for start in range(0, len(crops), self.batch_size):
            pixels = torch.cat([clip_preprocess(crop[None].to(self.device), self.image_size)
                                for crop in crops[start : start + self.batch_size]])
            out.append(encode_image(self.model, pixels) @ classifier.T)
        return torch.cat(out) if out else torch.zeros(0, len(self.colors))

    def classify(self, image: Tensor, objects: Sequence[dict], class_name: str) -> list[str]:
        """The colour of each object (a dict with ``mask`` and ``box``) of class ``class_name`` in ``image``."""
        crops = [masked_crop(image, obj["mask"], obj["box"]) for obj in objects]
        if not crops:
            return []
        return [self.colors[i] for i in self.similarities(crops, class_name).argmax(dim=1).tolist()]
