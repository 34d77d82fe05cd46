"""A small real SkyReels-V2 T2V pipeline: the tiny Wan2.1 pipeline's UMT5 encoder and causal VAE with a 1-layer
``SkyReelsV2Transformer3DModel`` of the same tiny configuration."""

from __future__ import annotations

from typing import Iterable

import torch

from .wan import tiny_wan_pipeline


def tiny_skyreels_v2_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    transformer: dict | None = None,
    vae: dict | None = None,
    shift: float = 8.0,
    seed: int = 0,
):
    """A randomly initialised ``SkyReelsV2Pipeline``: the text encoder, tokenizer and VAE of
    ``tiny_wan_pipeline(words, seed=seed)`` (SkyReels-V2 ships Wan2.1's UMT5 and VAE), a ``SkyReelsV2Transformer3DModel``
    built from the tiny Wan transformer's configuration (``transformer`` overrides it), drawn after ``seed + 1``, and
    ``FlowMatchEulerDiscreteScheduler(shift=8)`` (SkyReels-V2 T2V's flow shift; the released pipelines ship UniPC over
    the same flow sigmas).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel

    wan = tiny_wan_pipeline(words, max_length=max_length, vae=vae, seed=seed)
    torch.manual_seed(seed + 1)
    config = {key: value for key, value in wan.transformer.config.items() if not key.startswith("_")}
    pipe = SkyReelsV2Pipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        vae=wan.vae,
        transformer=SkyReelsV2Transformer3DModel(**{**config, **(transformer or {})}),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_skyreels_v2_i2v_pipeline(words: Iterable[str], *, max_length: int = 12, shift: float = 5.0, seed: int = 0):
    """A randomly initialised ``SkyReelsV2ImageToVideoPipeline``: the text encoder, tokenizer, VAE and CLIP image
    processor of ``tiny_wan_i2v_pipeline(words, seed=seed)``, its tiny CLIP vision encoder's configuration as a
    ``CLIPVisionModelWithProjection`` (the released class) and its transformer's configuration (``2 z + 4`` input
    channels, image embeddings) as a ``SkyReelsV2Transformer3DModel``, both drawn after ``seed + 1``, and
    ``FlowMatchEulerDiscreteScheduler(shift=5)`` (SkyReels-V2 I2V's flow shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SkyReelsV2ImageToVideoPipeline, SkyReelsV2Transformer3DModel
    from transformers import CLIPVisionModelWithProjection

    from .wan import tiny_wan_i2v_pipeline

    wan = tiny_wan_i2v_pipeline(words, max_length=max_length, seed=seed)
    torch.manual_seed(seed + 1)
    config = {key: value for key, value in wan.transformer.config.items() if not key.startswith("_")}
    pipe = SkyReelsV2ImageToVideoPipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        image_encoder=CLIPVisionModelWithProjection(wan.image_encoder.config),
        image_processor=wan.image_processor,
        transformer=SkyReelsV2Transformer3DModel(**config),
        vae=wan.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
