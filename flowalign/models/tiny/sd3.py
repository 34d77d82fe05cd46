"""A small real Stable Diffusion 3 pipeline (the toy world pre-trains it at its own sizes)."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import clip_config, t5_encoder, tiny_autoencoder_kl
from .tokenizers import word_level_tokenizer


def tiny_sd3_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    clip_hidden: int = 32,
    clip_layers: int = 2,
    t5_dim: int = 64,
    t5_layers: int = 2,
    transformer: dict | None = None,
    vae: dict | None = None,
    shift: float = 3.0,
    seed: int = 0,
):
    """A randomly initialised ``StableDiffusion3Pipeline``: two CLIP encoders, a T5 encoder, an MMDiT and a VAE.

    The two CLIP widths concatenate to ``2 * clip_hidden``, padded by SD3 up to the T5 width ``t5_dim``, which is the
    transformer's ``joint_attention_dim``; the pooled projection is ``2 * clip_hidden`` wide.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    if 2 * clip_hidden > t5_dim:
        raise ValueError(f"SD3 pads the CLIP width 2*{clip_hidden} up to the T5 width {t5_dim}: need 2*clip_hidden <= t5_dim")
    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    clip = clip_config(len(tokenizer), clip_hidden, clip_hidden, clip_layers, 4, max_length)
    transformer_config = dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=t5_dim,
        caption_projection_dim=32,
        pooled_projection_dim=2 * clip_hidden,
        pos_embed_max_size=32,
    )
    transformer_config.update(transformer or {})
    vae_config = {"latent_channels": transformer_config["in_channels"], **(vae or {})}
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**transformer_config),
        vae=tiny_autoencoder_kl(**vae_config),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        text_encoder=CLIPTextModelWithProjection(clip),
        text_encoder_2=CLIPTextModelWithProjection(clip),
        text_encoder_3=t5_encoder(len(tokenizer), t5_dim, t5_layers, 4),
        tokenizer=tokenizer,
        tokenizer_2=word_level_tokenizer(words, max_length),
        tokenizer_3=word_level_tokenizer(words, max_length),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
