"""Image embeddings for measuring diversity: ``images [B, 3, H, W]`` in [0, 1] in, unit vectors ``[B, D]`` out.

Two images are as different as the cosine distance ``max(1 - cos(e_i, e_j), 0)`` of their embeddings (the distance
SatisDive and DreamSim use). ``flowalign.embeddings`` registers these and turns them into a set's diversity.

* ``toy_scene`` (the toy world): what the scene is and where. The toy shape segmenter's per-pixel class
  probabilities (``flowalign.toy.segmenter``, default ``assets/toy-segmenter``) and the RGB image, each area-pooled
  to ``grid x grid`` cells and centred (class probabilities minus their image mean, colours minus 0.5), each scaled to
  unit norm and concatenated. Four renders of one layout are at distance ~0; a moved, recoloured or reshaped object
  moves the embedding. Pooling the segmenter's trunk over the image (DRL's features) would forget where things are.
* ``pixels`` (any model, no weights): the image area-pooled to ``grid x grid`` minus 0.5. A crude distance, but always
  available and model-free.
* ``clip`` (real models): open_clip's image embedding (``weights`` a local file or an open_clip tag;
  ``reward_models.open_clip_backbone``).
* ``dreamsim`` (real models): DreamSim (Fu et al. 2023, "DreamSim: Learning New Dimensions of Human Visual
  Similarity using Synthetic Data"), the ``dreamsim`` package's model loaded from a local ``path`` (its cache
  directory holding the downloaded checkpoints); its distance is the same cosine distance of its embeddings.

``embedding.embed(images)`` returns float32 unit vectors on the CPU without gradients, ``batch_size`` images at a time;
``embedding.forward(images)`` keeps the graph (a differentiable diversity term can use it).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import resolve_device
from .images import as_image_batch

__all__ = ["CLIPEmbedding", "DreamSimEmbedding", "ImageEmbedding", "PixelEmbedding", "ToySceneEmbedding",
           "cosine_distances", "unit"]


def unit(vectors: Tensor, eps: float = 1e-12) -> Tensor:
    """Rows scaled to unit L2 norm (a zero row stays zero)."""
    return vectors / vectors.norm(dim=-1, keepdim=True).clamp_min(eps)


def cosine_distances(embeddings: Tensor) -> Tensor:
    """``[..., K, K]`` pairwise ``max(1 - cos, 0)`` of ``embeddings [..., K, D]`` (zero on the diagonal)."""
    e = unit(embeddings.float())
    return (1.0 - e @ e.transpose(-1, -2)).clamp_min(0.0)


class ImageEmbedding:
    """Base class: subclasses set ``name`` and implement ``forward(images) -> [B, D]`` (unit rows, differentiable)."""

    name = "embedding"

    def __init__(self, *, device: str | torch.device | None = None, batch_size: int = 64):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be an integer >= 1, got {batch_size!r}")
        self.device = resolve_device(device)
        self.batch_size = batch_size

    def forward(self, images: Tensor) -> Tensor:
        raise NotImplementedError

    def embed(self, images) -> Tensor:
        """``[B, D]`` float32 unit vectors on the CPU, ``batch_size`` images at a time, no gradient."""
        batch = as_image_batch(images)
        with torch.no_grad():
            parts = [self.forward(batch[i : i + self.batch_size].to(self.device).float()).float().cpu()
                     for i in range(0, batch.shape[0], self.batch_size)]
        return torch.cat(parts) if parts else torch.zeros(0, 0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r})"


def _pooled(images: Tensor, grid: int) -> Tensor:
    return F.adaptive_avg_pool2d(images, grid).flatten(1)


class PixelEmbedding(ImageEmbedding):
    """The image area-pooled to ``grid x grid`` cells, minus 0.5 (module docstring)."""

    name = "pixels"

    def __init__(self, *, grid: int = 8, device=None, batch_size: int = 64):
        super().__init__(device=device, batch_size=batch_size)
        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
            raise ValueError(f"pixels: grid must be an integer >= 1, got {grid!r}")
        self.grid = grid

    def forward(self, images: Tensor) -> Tensor:
        return unit(_pooled(images - 0.5, self.grid))


class ToySceneEmbedding(ImageEmbedding):
    """Segmenter class maps and colours of a toy scene, pooled to ``grid x grid`` (module docstring)."""

    name = "toy_scene"

    def __init__(self, segmenter: str | None = None, *, grid: int = 8, device=None, batch_size: int = 64):
        super().__init__(device=device, batch_size=batch_size)
        from flowalign.toy.segmenter import load_segmenter

        if isinstance(grid, bool) or not isinstance(grid, int) or grid < 1:
            raise ValueError(f"toy_scene: grid must be an integer >= 1, got {grid!r}")
        self.grid = grid
        self.segmenter = load_segmenter(segmenter, device=self.device)
        self.segmenter.requires_grad_(False)

    def forward(self, images: Tensor) -> Tensor:
        classes = _pooled(self.segmenter.probabilities(images), self.grid)
        classes = classes - classes.mean(dim=1, keepdim=True)
        colours = _pooled(images - 0.5, self.grid)
        return unit(torch.cat([unit(classes), unit(colours)], dim=1))


class CLIPEmbedding(ImageEmbedding):
    """open_clip's normalised image embedding (``weights``: a local file or an open_clip tag)."""

    name = "clip"

    def __init__(self, weights: str = "openai", *, model_name: str = "ViT-L-14", quick_gelu: bool = True,
                 device=None, batch_size: int = 32):
        super().__init__(device=device, batch_size=batch_size)
        from .clipscore import OPENAI_VIT_L14_SOURCE, image_size_of
        from .open_clip_backbone import load_open_clip

        self.model, _ = load_open_clip(model_name, weights, reward=self.name, key="weights",
                                       source=OPENAI_VIT_L14_SOURCE, quick_gelu=quick_gelu, device=self.device)
        self.image_size = image_size_of(self.model)

    def forward(self, images: Tensor) -> Tensor:
        from .clipscore import clip_preprocess
        from .open_clip_backbone import encode_image

        return unit(encode_image(self.model, clip_preprocess(images, self.image_size)))


class DreamSimEmbedding(ImageEmbedding):
    """DreamSim's embedding, its model loaded by the ``dreamsim`` package from the local directory ``path``."""

    name = "dreamsim"

    def __init__(self, path: str, *, dreamsim_type: str = "ensemble", device=None, batch_size: int = 16):
        super().__init__(device=device, batch_size=batch_size)
        check_dreamsim_path(path)
        try:
            from dreamsim import dreamsim
        except ImportError as error:
            raise ImportError("the dreamsim embedding needs the dreamsim package: pip install 'flowalign[dreamsim]' "
                              f"({error})") from None
        self.model, _ = dreamsim(pretrained=True, cache_dir=str(path), device=str(self.device),
                                 dreamsim_type=dreamsim_type)
        self.model.eval().requires_grad_(False)

    def forward(self, images: Tensor) -> Tensor:
        # DreamSim's own preprocessing: bicubic resize to 224, images in [0, 1]
        resized = F.interpolate(images, size=(224, 224), mode="bicubic", align_corners=False).clamp(0, 1)
        return unit(self.model.embed(resized))


def check_dreamsim_path(path) -> Path:
    """The DreamSim checkpoint directory, or a FileNotFoundError naming it and where its files come from."""
    if not path:
        raise FileNotFoundError("the dreamsim embedding loads from a local directory: pass "
                                "--diversity-kwargs '{\"path\": \"/weights/dreamsim\"}' (the cache_dir the dreamsim "
                                "package downloaded its checkpoints into)")
    folder = Path(path)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise FileNotFoundError(f"DreamSim directory {folder} does not exist or is empty: copy the dreamsim package's "
                                "cache_dir (its downloaded checkpoints) there and pass it as "
                                "--diversity-kwargs '{\"path\": DIR}'")
    return folder
