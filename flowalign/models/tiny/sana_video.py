"""A small real SANA-Video pipeline: a Gemma2 encoder, a 1-layer SANA-Video DiT and the tiny causal Wan VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import gemma2_encoder
from .tokenizers import word_level_tokenizer
from .wan import tiny_wan_vae


def tiny_sana_video_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    gemma_dim: int = 32,
    transformer: dict | None = None,
    vae: dict | None = None,
    shift: float = 8.0,
    seed: int = 0,
):
    """A randomly initialised ``SanaVideoPipeline``: a Gemma2 encoder, a 1-block ``SanaVideoTransformer3DModel``
    (2 heads of 8, patches 1x2x2), ``tiny_wan_vae`` (4x in space and time, per-channel statistics that are not 0 and 1;
    the released 480p model ships Wan2.1's VAE, 8x in space) and ``FlowMatchEulerDiscreteScheduler(shift=8)`` (the
    released flow shift; the released pipeline ships a flow-sigma DPM-Solver). The pipeline takes frame sides that are
    multiples of 32: 32 px frames are 8x8 latents.

    ``transformer`` and ``vae`` override the transformer's settings and ``tiny_wan_vae``'s.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaVideoPipeline, SanaVideoTransformer3DModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    vae_settings = {"z_dim": 4, **(vae or {})}
    settings = dict(
        in_channels=vae_settings["z_dim"],
        out_channels=vae_settings["z_dim"],
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=gemma_dim,
        mlp_ratio=2.5,
        sample_size=4,
        patch_size=(1, 2, 2),
        rope_max_seq_len=32,
    )
    settings.update(transformer or {})
    pipe = SanaVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=gemma2_encoder(len(tokenizer), gemma_dim, 1),
        vae=tiny_wan_vae(**vae_settings),
        transformer=SanaVideoTransformer3DModel(**settings),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
