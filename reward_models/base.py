"""The shared shape of a reward model: a differentiable ``forward`` and batched, gradient-free scoring.

``model.forward(images, prompts, metadata=None) -> [B]`` takes ``images [B, 3, H, W]`` in [0, 1] on the model's device
and keeps the autograd graph: it is the differentiable entry point of ``flowalign.rewards`` that reward-gradient
guidance (RGS, FK's RGS proposals) and RG-OPD call, through ``flowalign.rewards.differentiable_score`` (which moves the
images to ``model.device`` and the scores back). ``metadata`` (one dict per image, or None) reaches ``forward`` with
the images of its chunk; most models ignore it (``source_similarity`` reads the condition images' paths from it).
``model(images, prompts, metadata)`` is the reward protocol of ``flowalign.rewards`` for values only: it converts any
image input (``reward_models.images.as_image_batch``), scores ``batch_size`` images at a time under
``torch.no_grad()`` and returns float32 scores on the CPU, so it never carries a gradient. Preprocessing (resize, crop,
normalise) happens inside ``forward``, in fp32, before the backbone's dtype.

``reads_files`` declares the metadata keys whose values are paths the model opens (a string or a list of strings per
sample): empty for most models, ``("images",)`` for ``source_similarity``. A reward server serves such a model only
under an allow-listed root (``flowalign serve-reward --files-root DIR``) and refuses every path outside it. A model
that refuses its input (a sample without the metadata it needs) raises ``flowalign.errors.RewardInputError``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..devices import DTYPES, resolve_device, resolve_dtype
from .images import as_image_batch

__all__ = ["DTYPES", "RewardModel", "resolve_device", "resolve_dtype"]

class RewardModel:
    """Base class: subclasses set ``name`` and implement ``forward`` (differentiable in the images)."""

    name = "reward_model"
    differentiable = True
    reads_files: tuple[str, ...] = ()  # metadata keys holding paths this model opens (module docstring)

    def __init__(self, *, device: str | torch.device | None = None, dtype: str | torch.dtype = "fp32",
                 batch_size: int = 16):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{self.name}: batch_size must be an integer >= 1, got {batch_size!r}")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        self.batch_size = batch_size

    def forward(self, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` of ``images`` on ``self.device``, keeping the graph to them (module docstring)."""
        raise NotImplementedError

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> Tensor:
        """Scores ``[B]`` float32 on the CPU, computed ``batch_size`` images at a time without gradients."""
        batch = as_image_batch(images)
        prompts = list(prompts)
        if len(prompts) != batch.shape[0]:
            raise ValueError(f"{self.name}: got {batch.shape[0]} images but {len(prompts)} prompts")
        scores = []
        with torch.no_grad():
            for start in range(0, batch.shape[0], self.batch_size):
                chunk = batch[start : start + self.batch_size].to(self.device)
                rows = None if metadata is None else list(metadata)[start : start + self.batch_size]
                scores.append(self.forward(chunk, prompts[start : start + self.batch_size], rows).float().cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r}, dtype={self.dtype})"
