"""LAION aesthetic predictor ("improved aesthetic predictor", C. Schuhmann, LAION 2022).

A small MLP on the L2-normalised CLIP ViT-L/14 (OpenAI) image embedding, trained to regress 1-10 aesthetic ratings
(SAC + LOGOS + AVA). Two weight files: the MLP (``sac+logos+ava1-l14-linearMSE.pth`` from the improved-aesthetic-
predictor repository, keys ``layers.{0,2,4,6,7}.{weight,bias}``) and the CLIP backbone (as for ``CLIPScore``).

MLP: ``768 -> 1024 -> 128 -> 64 -> 16 -> 1`` linear layers, with dropout (0.2, 0.2, 0.1; inactive at eval) after the
first three and no nonlinearity (the published predictor is a deep *linear* model).

Preprocessing: resize the shorter side to 224 (bicubic), centre crop 224, OpenAI CLIP mean/std. Score: the MLP
output, about 1 to 10 (prompt-independent).
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from .base import RewardModel
from .clipscore import OPENAI_VIT_L14_SOURCE, clip_preprocess, image_size_of
from .open_clip_backbone import encode_image, load_open_clip
from .weights import load_state_dict, require_file

__all__ = ["AestheticMLP", "LaionAesthetic"]

AESTHETIC_SOURCE = "the improved-aesthetic-predictor repository (christophschuhmann), file sac+logos+ava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The predictor head; ``layers`` indices match the published state dict."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: Tensor) -> Tensor:
        return self.layers(embeddings).squeeze(-1)


class LaionAesthetic(RewardModel):
    """Aesthetic score of images (see module docstring); ``mlp_weights`` is required (no hub copy is assumed)."""

    name = "aesthetic"

    def __init__(self, mlp_weights: str, clip_weights: str = "openai", *, model_name: str = "ViT-L-14",
                 quick_gelu: bool = True, device=None, dtype="fp32", batch_size: int = 16):
        super().__init__(device=device, dtype=dtype, batch_size=batch_size)
        path = require_file(mlp_weights, reward=self.name, key="mlp_weights", source=AESTHETIC_SOURCE)
        self.clip, _ = load_open_clip(model_name, clip_weights, reward=self.name, key="clip_weights",
                                      source=OPENAI_VIT_L14_SOURCE, quick_gelu=quick_gelu, device=self.device,
                                      dtype=self.dtype)
        state = load_state_dict(path)
        self.mlp = AestheticMLP(state["layers.0.weight"].shape[1] if "layers.0.weight" in state else 768)
        self.mlp.load_state_dict(state)
        self.mlp = self.mlp.to(self.device).eval().requires_grad_(False)  # the head stays fp32: it is tiny
        self.image_size = image_size_of(self.clip)

    def forward(self, images: Tensor, prompts: Sequence[str] | None = None, metadata=None) -> Tensor:
        return self.mlp(encode_image(self.clip, clip_preprocess(images, self.image_size)))
