"""Collapse metrics: what a run logs every iteration so a user sees reward hacking as it starts (``collapse``).

On the iteration's decoded rollout images, gathered over the processes (so the numbers do not depend on the layout):

* ``collapse/diversity``: the mean over groups of the within-group diversity, the mean pairwise cosine distance of
  the group's image embeddings (``flowalign.embeddings.set_diversity``; ``collapse.embedding``, ``toy_scene`` on the
  toy world, ``pixels`` elsewhere). Falls towards 0 when a prompt's images collapse onto one.
* ``collapse/saturated_frac``: the fraction of pixel channels within ``collapse.saturation_margin`` of 0 or 1
  (over-saturation, a frequent way to hack aesthetic and preference rewards).
* ``collapse/held_out/<name>``: the mean (over valid images) of a reward the run does not optimise
  (``collapse.held_out``). ``auto`` picks, on the toy world, the exact binary ``toy_geneval`` when the run trains on
  ``toy_geneval_soft`` or the partial-credit ``toy_geneval``, and ``toy_geneval_soft`` when it trains on the binary
  one: the proxy rising while the held-out one falls is over-optimisation. On the toy video world, the other reading
  of ``toy_video``: the binary verdict when the run trains on its partial credit, and the reverse.

They are measurements: computed without gradients and without drawing randomness from anything the run uses, they
change no weight, optimizer state or later metric (the golden runs leave ``collapse/`` out of their digests). The
models they need are built at start-up, before the LoRA is initialised.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["CollapseMetrics", "auto_held_out", "saturated_fraction", "within_group_diversity"]


def saturated_fraction(images: Tensor, margin: float) -> tuple[float, int]:
    """``(count, total)`` of pixel channels of ``images [B, 3, H, W]`` (or videos ``[B, F, 3, H, W]``) in [0, 1] that are ``<= margin`` or
    ``>= 1 - margin``."""
    x = images.float()
    saturated = (x <= margin) | (x >= 1.0 - margin)
    return float(saturated.sum()), int(saturated.numel())


def within_group_diversity(embeddings: Tensor, group_ids: Tensor) -> Tensor:
    """``[G]`` float64: ``set_diversity`` of each group's embeddings (rows of ``embeddings [n, D]`` with equal
    ``group_ids``; groups of equal size)."""
    from flowalign.embeddings import set_diversity

    groups = torch.unique(group_ids)
    sets = torch.stack([embeddings[group_ids == g] for g in groups])
    return set_diversity(sets)


def auto_held_out(rewards) -> tuple[str, dict[str, Any]] | None:
    """``collapse.held_out: auto`` for the trained ``reward.rewards`` (module docstring), or None."""
    trained = {spec.name: spec for spec in rewards if spec.weight != 0}
    if "toy_video" in trained:
        return "toy_video", {"partial_credit": not trained["toy_video"].kwargs.get("partial_credit", False)}
    if "toy_geneval_soft" in trained:
        return ("toy_geneval", {"partial_credit": False}) if "toy_geneval" not in trained or \
            trained["toy_geneval"].kwargs.get("partial_credit") else None
    if "toy_geneval" in trained:
        if trained["toy_geneval"].kwargs.get("partial_credit"):
            return "toy_geneval", {"partial_credit": False}
        return "toy_geneval_soft", {}
    return None


class CollapseMetrics:
    """The ``collapse`` section's metrics for one run (module docstring)."""

    def __init__(self, config, *, rewards_given: bool = False):
        from flowalign.embeddings import build_embedding, resolve_embedding
        from flowalign.rewards import build_reward

        settings = config.collapse
        self.enabled, self.margin = settings.enabled, settings.saturation_margin
        self.embedding = self.held_out = self.held_out_name = None
        if not self.enabled:
            return
        name = resolve_embedding(settings.embedding, config.model.path)
        self.embedding = build_embedding(name, **settings.embedding_kwargs)
        held_out = None
        if settings.held_out == "auto":
            held_out = None if rewards_given else auto_held_out(config.reward.rewards)
        elif settings.held_out is not None:
            held_out = (settings.held_out, dict(settings.held_out_kwargs))
        if held_out is not None:
            self.held_out_name = held_out[0]
            self.held_out = build_reward(held_out[0], **held_out[1])

    @classmethod
    def check_prompts(cls, config, prompts: list[dict]) -> None:
        """An explicit held-out reward that reads GenEval metadata finds it in every training prompt."""
        from flowalign.rewards import require_prompt_metadata

        if config.collapse.enabled and config.collapse.held_out not in (None, "auto"):
            require_prompt_metadata(config.collapse.held_out, "collapse.held_out", prompts, config.data.train_prompts,
                                    config.collapse.held_out_kwargs)

    @torch.no_grad()
    def measure(self, trainer, batches, scores) -> dict[str, float]:
        """The iteration's ``collapse/*`` metrics (every process calls it: it gathers)."""
        if not self.enabled or scores is None or not batches:
            return {}
        from flowalign.embeddings import embed_samples

        accelerator, device = trainer.accelerator, trainer.accelerator.device
        images = scores.images
        ids = torch.cat([b.sample_ids for b in batches])
        embeddings = accelerator.gather(embed_samples(self.embedding, images).to(device)).cpu()
        group_ids = torch.arange(trainer.layout.global_samples) // trainer.config.data.group_size
        metrics = {"collapse/diversity": float(within_group_diversity(embeddings, group_ids).mean())}
        count, total = saturated_fraction(images, self.margin)
        summed = accelerator.gather(torch.tensor([count, float(total)], dtype=torch.float64, device=device)).cpu()
        summed = summed.reshape(-1, 2).sum(dim=0)
        metrics["collapse/saturated_frac"] = float(summed[0] / summed[1])
        if self.held_out is not None:
            from flowalign.rewards import score_all

            metadata = [m for b in batches for m in b.sample_metadata]
            out = score_all([(self.held_out_name, 1.0, self.held_out)], images, [m["prompt"] for m in metadata],
                            metadata, group_ids=ids // trainer.config.data.group_size)
            values = accelerator.gather(out.raw[0].double().to(device)).cpu()
            kept = values[torch.isfinite(values)]
            metrics[f"collapse/held_out/{self.held_out_name}"] = float(kept.mean()) if len(kept) else math.nan
        return metrics
