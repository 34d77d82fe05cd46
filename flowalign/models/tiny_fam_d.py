"""A small real FLUX.1-Kontext pipeline built in-process: no hub access needed.

``FluxKontextPipeline`` takes exactly FLUX's components (CLIP + T5 text encoders, a FLUX transformer, a VAE), so the
tiny Kontext pipeline is the tiny FLUX pipeline's components under the Kontext pipeline class.
"""

from __future__ import annotations

from typing import Iterable

from .tiny import tiny_flux_pipeline


def tiny_flux_kontext_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    guidance_embeds: bool = True,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``FluxKontextPipeline`` (FLUX.1-Kontext-dev has a guidance embedding, as the default)."""
    from diffusers import FluxKontextPipeline

    flux = tiny_flux_pipeline(words, max_length=max_length, guidance_embeds=guidance_embeds, transformer=transformer,
                              seed=seed)
    pipe = FluxKontextPipeline(**flux.components)
    pipe.set_progress_bar_config(disable=True)
    return pipe
