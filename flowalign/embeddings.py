"""Image embeddings as registered components, and the diversity of a set of images.

An *image embedding* maps ``images [B, 3, H, W]`` in [0, 1] to unit vectors ``[B, D]`` (``embed(images)``, no gradient;
``forward(images)``, differentiable). The built-in ones (``flowalign.reward_models.embeddings``): ``toy_scene`` (the
toy world's segmenter maps and colours, pooled on a grid), ``pixels`` (the pooled image, no weights), ``clip``
(open_clip) and ``dreamsim`` (DreamSim from a local directory). Add one with
``register_embedding("name", factory)``; ``factory(**kwargs)`` returns an object with ``embed``.

**Temporal consistency of a clip** (``TemporalConsistency``, the ``temporal_consistency`` video reward). For a video's
frames ``x_1 .. x_F`` and a registered embedding ``e``, the mean cosine similarity of consecutive frames,

    consistency = 1 / (F - 1) * sum_{j=1}^{F-1} cos(e(x_j), e(x_{j+1})),

in [-1, 1]: 1 for a still clip, lower the more each frame changes from the one before. It needs at least two frames.

**Diversity of a set.** For the ``K`` images of one prompt, the mean pairwise cosine distance of their embeddings,

    diversity = 2 / (K (K - 1)) * sum_{i < j} max(1 - cos(e_i, e_j), 0),

0 for ``K`` copies of one image (and for ``K = 1``), at most 2. It is the batch diversity SatisDive keeps above its
cutoff and reports (with DreamSim on real models), and what ``flowalign sample --candidates K`` writes per prompt.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from flowalign.config import ConfigError
from flowalign.errors import RewardInputError
from flowalign.registry import Registry

__all__ = ["EMBEDDINGS", "TOY_MODEL_MARKERS", "TOY_VIDEO_MODEL_MARKERS", "TemporalConsistency", "is_toy_model",
           "build_embedding", "check_embedding", "consecutive_similarity", "embed_samples", "register_embedding",
           "resolve_embedding", "set_diversity"]


def _lazy(attribute: str) -> Callable[..., Any]:
    def build(**kwargs: Any):
        from flowalign.reward_models import embeddings

        return getattr(embeddings, attribute)(**kwargs)

    build.target = ("flowalign.reward_models.embeddings", attribute)
    return build


EMBEDDINGS: Registry = Registry("image embedding")
EMBEDDINGS.register("toy_scene", _lazy("ToySceneEmbedding"))
EMBEDDINGS.register("pixels", _lazy("PixelEmbedding"))
EMBEDDINGS.register("clip", _lazy("CLIPEmbedding"))
EMBEDDINGS.register("dreamsim", _lazy("DreamSimEmbedding"))

# ``auto`` means ``toy_scene`` for the toy world (a model path ending in one of these), else ``pixels``.
TOY_MODEL_MARKERS = ("toy-sd3",)
# The toy video world's model (``flowalign toy pretrain-video``): its frames are toy images.
TOY_VIDEO_MODEL_MARKERS = ("toy-wan",)


def register_embedding(name: str, factory: Callable[..., Any], *, overwrite: bool = False) -> None:
    """Register an image embedding: ``factory(**kwargs)`` returns an object with ``embed(images) -> [B, D]``."""
    EMBEDDINGS.register(name, factory, overwrite=overwrite)


def is_toy_model(model: str | None) -> bool:
    """Whether ``model`` (a model path or hub id) is the toy world's model: a path ending in ``TOY_MODEL_MARKERS``."""
    return model is not None and str(model).rstrip("/").endswith(TOY_MODEL_MARKERS)


def resolve_embedding(name: str, model: str | None) -> str:
    """``name``, with ``auto`` made ``toy_scene`` for the toy worlds' models (the image world's, and the video
    world's, whose frames are toy images) and ``pixels`` for any other."""
    if name != "auto":
        return name
    toy_video = model is not None and str(model).rstrip("/").endswith(TOY_VIDEO_MODEL_MARKERS)
    return "toy_scene" if is_toy_model(model) or toy_video else "pixels"


def check_embedding(name: str, kwargs: Mapping[str, Any], *, key: str) -> None:
    """ConfigError naming ``key`` for an unknown embedding, constructor arguments that are not an object, or a
    DreamSim directory that does not exist, before anything is built or loaded."""
    if name != "auto" and name not in EMBEDDINGS:
        close = EMBEDDINGS.closest(name)
        raise ConfigError(f"unknown image embedding {name!r}: expected auto or one of {', '.join(EMBEDDINGS.names())}"
                          + (f"; did you mean {close!r}?" if close else ""), key=key)
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"the {key} embedding's arguments must be a JSON object, got {kwargs!r}", key=f"{key}_kwargs")
    if name == "dreamsim":
        from flowalign.reward_models.embeddings import check_dreamsim_path

        try:
            check_dreamsim_path(kwargs.get("path"))
        except FileNotFoundError as error:
            raise ConfigError(str(error), key=f"{key}_kwargs") from None


def build_embedding(name: str, **kwargs: Any):
    """The registered image embedding ``name`` built with ``kwargs``."""
    return EMBEDDINGS.build(name, **kwargs)


def embed_samples(embedding, samples: Tensor) -> Tensor:
    """``[B, D]``: ``embedding.embed`` of each image ``[B, 3, H, W]``; of a video ``[B, F, 3, H, W]``, the mean of its
    frames' embeddings, renormalised to a unit vector (so videos differ as their frames do on average)."""
    if samples.ndim != 5:
        return embedding.embed(samples)
    frames = embedding.embed(samples.flatten(0, 1))
    mean = frames.reshape(samples.shape[0], samples.shape[1], -1).float().mean(dim=1)
    return torch.nn.functional.normalize(mean, dim=1)


def set_diversity(embeddings: Tensor) -> Tensor:
    """Mean pairwise cosine distance within each set: ``embeddings [B, K, D]`` -> ``[B]`` float64 (module
    docstring); 0 for ``K = 1``."""
    from flowalign.reward_models.embeddings import cosine_distances

    if embeddings.dim() != 3:
        raise ValueError(f"set_diversity takes embeddings [sets, K, D], got shape {tuple(embeddings.shape)}")
    k = embeddings.shape[1]
    if k < 2:
        return torch.zeros(embeddings.shape[0], dtype=torch.float64)
    distances = cosine_distances(embeddings).double()
    upper = torch.triu(torch.ones(k, k, dtype=torch.bool), diagonal=1)
    return distances[:, upper].mean(dim=1)


def consecutive_similarity(embeddings: Tensor) -> Tensor:
    """The mean cosine similarity of consecutive rows: ``embeddings [B, F, D]`` (F >= 2) -> ``[B]`` (module
    docstring); differentiable."""
    from flowalign.reward_models.embeddings import unit

    if embeddings.dim() != 3 or embeddings.shape[1] < 2:
        raise ValueError(f"consecutive_similarity takes embeddings [B, F >= 2, D], got shape {tuple(embeddings.shape)}")
    e = unit(embeddings.float())
    return (e[:, :-1] * e[:, 1:]).sum(dim=-1).mean(dim=1)


class TemporalConsistency:
    """The ``temporal_consistency`` video reward: the mean cosine similarity of consecutive frames under the
    registered image embedding ``embedding`` (built with ``embedding_kwargs``; ``auto`` is ``pixels``, the toy world's
    ``toy_scene`` needing a model path to be told apart). Scores ``[B]`` of videos ``[B, F, 3, H, W]`` (F >= 2, else
    ``RewardInputError``); ``forward`` keeps the graph through the embedding's own ``forward``."""

    name = "temporal_consistency"
    modality = "video"
    score_range = (-1.0, 1.0)

    def __init__(self, embedding: str = "pixels", embedding_kwargs: dict[str, Any] | None = None):
        check_embedding(embedding, embedding_kwargs or {}, key="temporal_consistency.embedding")
        self.embedding_name = resolve_embedding(embedding, None)
        self.embedding = build_embedding(self.embedding_name, **(embedding_kwargs or {}))

    @classmethod
    def check_run(cls, kwargs: Mapping[str, Any], *, key: str, model: str | None, image_size: Any = None) -> None:
        """Before it is built and any model loads: a registered embedding and well-formed arguments (naming
        ``key.embedding``)."""
        check_embedding(kwargs.get("embedding", "pixels"), kwargs.get("embedding_kwargs") or {}, key=f"{key}.embedding")

    @property
    def device(self):
        return getattr(self.embedding, "device", None)

    def _frames(self, videos: Tensor) -> Tensor:
        if not isinstance(videos, Tensor) or videos.dim() != 5 or videos.shape[2] != 3:
            shape = tuple(videos.shape) if isinstance(videos, Tensor) else type(videos).__name__
            raise RewardInputError(f"reward {self.name!r} scores videos [B, F, 3, H, W], got {shape}")
        if videos.shape[1] < 2:
            raise RewardInputError(f"reward {self.name!r} compares consecutive frames: a video needs at least two, "
                                   f"got {videos.shape[1]}")
        return videos.float().flatten(0, 1)

    def forward(self, videos: Tensor, prompts: Any = None, metadata: Any = None) -> Tensor:
        """Scores ``[B]``, differentiable in ``videos`` (on the embedding's device)."""
        embedded = self.embedding.forward(self._frames(videos))
        return consecutive_similarity(embedded.reshape(videos.shape[0], videos.shape[1], -1))

    def __call__(self, videos: Tensor, prompts: Any, metadata: Any = None) -> Tensor:
        """Scores ``[B]`` float32 on the CPU, without gradients (the embedding's ``embed``)."""
        embed = getattr(self.embedding, "embed", None)
        with torch.no_grad():
            embedded = embed(self._frames(videos)) if callable(embed) else self.embedding.forward(self._frames(videos))
        return consecutive_similarity(embedded.float().cpu().reshape(videos.shape[0], videos.shape[1], -1))
