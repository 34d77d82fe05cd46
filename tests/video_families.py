"""The video model families the video adapter contract (tests/test_video_families.py) runs over.

A ``VideoFamily`` says how to build the family's tiny in-process pipeline, how to call it so that it samples what an
ODE rollout through the adapter samples, how to lay the adapter's latents out as the pipeline's
``output_type="latent"`` result, and which diffusers code is the family's own VAE encoding. Adding a video family
means adding a row here: the contract then checks it bit for bit against its pipeline, its VAE path, its LoRA round
trip, export, and that it trains.

The shapes are the smallest that exercise a frame axis: 5 frames (2 latent frames), 16 px frames, 1-layer models.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from flowalign.models import WanModel
from flowalign.models.tiny import tiny_wan_pipeline

from model_families import WORDS


def _cfg_kwargs(model, guidance: float) -> dict:
    """``guidance_scale`` as the pipeline's CFG scale (its negative prompt defaults to the empty prompt)."""
    return {"guidance_scale": guidance, "max_sequence_length": model.max_sequence_length}


def wan_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """``WanVideoToVideoPipeline.prepare_latents``' encoding before it noises: one video per VAE call through diffusers'
    ``retrieve_latents(..., sample_mode="argmax")``, then ``(z - mean) * (1 / std)`` with the VAE config's statistics
    built as the pipeline builds them. Videos ``[B, 3, F, H, W]`` in [-1, 1]."""
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents

    config = pipe.vae.config
    latents = torch.cat([retrieve_latents(pipe.vae.encode(video.unsqueeze(0)), sample_mode="argmax")
                         for video in videos])
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.dtype)
    return (latents - mean) * inverse_std


@dataclass(frozen=True)
class VideoFamily:
    """A video family under the adapter contract (the fields mean what they mean for image families in
    tests/model_families.py). ``frames``: the pixel frames the contract samples; ``vae_encoding(pipe, videos)``:
    the family's own diffusers encoding of videos ``[B, 3, F, H, W]`` in [-1, 1] into the transformer's latents;
    ``pipeline_frames``: the pipeline's keyword for the frame count."""

    adapter: type
    build: Callable
    vae_encoding: Callable
    guidances: tuple[float, ...] = (1.0, 3.0)
    call: Callable = _cfg_kwargs
    pipeline_layout: Callable = staticmethod(lambda model, latents: latents)
    sizes: tuple[tuple[int, int], ...] = ((16, 16), (16, 32))
    frames: int = 5
    lora_loader: bool = True
    build_kwargs: dict = field(default_factory=dict)
    condition_images: Callable | None = None
    prompts_per_call: int | None = None
    context: Callable = nullcontext

    def images_kwargs(self, count: int) -> dict:
        """``encode``'s ``images=`` for ``count`` prompts (nothing for a family without condition images)."""
        return {} if self.condition_images is None else {"images": [self.condition_images()] * count}


VIDEO_FAMILIES: dict[str, VideoFamily] = {
    # Wan2.1 T2V: UMT5 text, CFG in two passes, a causal VAE with per-channel statistics.
    "wan": VideoFamily(WanModel, tiny_wan_pipeline, wan_vae_encoding),
}


@lru_cache(maxsize=None)
def tiny_video_pipeline(name: str):
    """The family's tiny pipeline, built once per test session (do not change it: build your own for that)."""
    family = VIDEO_FAMILIES[name]
    return family.build(WORDS, seed=0, **family.build_kwargs)


def fresh_video_pipeline(name: str):
    """A new tiny pipeline of the family, equal to ``tiny_video_pipeline(name)``, for tests that change it."""
    family = VIDEO_FAMILIES[name]
    return family.build(WORDS, seed=0, **family.build_kwargs)
