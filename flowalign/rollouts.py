"""Group rollouts through a FlowModel: K samples per prompt, returned as transitions.

This joins the model adapter (``flowalign.models``) and the model-free samplers (``flowalign.samplers``): it encodes
the prompts, draws the initial noise the way the pipeline does (optionally shared within a group), picks the
stochastic steps from a noise schedule and integrates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .models.base import Cond, FlowModel
from .samplers import NoiseSchedule, Rollout, noise_schedule, rollout


@dataclass
class GroupRollout:
    """A rollout of ``len(prompts) * group_size`` samples. ``cond`` has one row per prompt (``prompt_id``)."""

    rollout: Rollout
    cond: Cond
    prompts: list[str]
    group_size: int
    sigmas: Tensor
    noise_levels: Tensor

    @property
    def transitions(self):
        return self.rollout.transitions

    @property
    def latents(self) -> Tensor:
        """Final latents, ``[P * K, ...]``, grouped by prompt: rows ``p*K .. p*K + K - 1`` belong to prompt ``p``."""
        return self.rollout.final

    @property
    def nfe(self) -> int:
        return self.rollout.nfe


def initial_noise(
    model: FlowModel,
    num_prompts: int,
    group_size: int,
    *,
    image_size=None,
    shared: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``[P * K, C, h, w]`` starting latents; with ``shared`` the K members of a group start from the same noise."""
    if shared:
        return model.prepare_noise(num_prompts, image_size, generator=generator).repeat_interleave(group_size, dim=0)
    return model.prepare_noise(num_prompts * group_size, image_size, generator=generator)


@torch.no_grad()
def sample_groups(
    model: FlowModel,
    prompts: Sequence[str],
    *,
    group_size: int,
    num_steps: int,
    noise: float | Sequence[float] | NoiseSchedule | dict = 0.7,
    kind: str = "flow_grpo",
    reduce: str = "mean",
    guidance_scale: float = 1.0,
    negative_prompt: str = "",
    image_size=None,
    shared_noise: bool = False,
    progress: float = 0.0,
    generator: torch.Generator | None = None,
    cond: Cond | None = None,
) -> GroupRollout:
    """Sample ``group_size`` images per prompt and record every transition.

    Rollouts are CFG-free by default (``guidance_scale=1``: one forward pass per step). ``noise`` is anything
    ``noise_schedule`` accepts; ``progress`` in [0, 1] moves a sliding SDE window. Group ``p`` (and ``prompt_id``) is
    the prompt's index in ``prompts``. Pass ``cond`` to reuse embeddings already computed for these prompts.
    """
    prompts = list(prompts)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not prompts:
        raise ValueError("sample_groups needs at least one prompt")
    if cond is None:
        negatives = [negative_prompt] * len(prompts) if model.uses_cfg(guidance_scale) else None
        cond = model.encode(prompts, negative_prompts=negatives)
    schedule = noise_schedule(noise)
    levels = schedule.levels(num_steps, progress=progress, generator=generator)
    sigmas = model.sigmas(num_steps, image_size)
    x_init = initial_noise(model, len(prompts), group_size, image_size=image_size, shared=shared_noise, generator=generator)
    prompt_ids = torch.arange(len(prompts), device=x_init.device).repeat_interleave(group_size)
    per_sample = cond.repeat_interleave(group_size)
    result = rollout(
        model.velocity_fn(per_sample, guidance_scale),
        x_init,
        sigmas,
        levels,
        kind=kind,
        reduce=reduce,
        generator=generator,
        group_ids=prompt_ids,
        prompt_ids=prompt_ids,
    )
    return GroupRollout(result, cond, prompts, group_size, sigmas, levels)
