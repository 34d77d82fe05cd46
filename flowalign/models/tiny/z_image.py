"""A small real Z-Image pipeline: a chat-templated Qwen3 encoder, a Z-Image DiT with its refiners, a VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import qwen3_encoder, tiny_autoencoder_kl
from .tokenizers import chat_word_tokenizer


def tiny_z_image_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 64,
    text_hidden: int = 32,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``ZImagePipeline``: a 2-layer Qwen3 encoder (the pipeline reads the second-to-last
    hidden states), a 1-layer Z-Image DiT with 1 refiner layer per stream, a 2-level VAE; shift 3 as Z-Image's.

    The transformer's ``x_pad_token`` / ``cap_pad_token`` (the learned padding of image and text tokens to a multiple
    of 32) are set to seeded finite values: nothing may leave them uninitialised.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = chat_word_tokenizer(words, max_length)
    latent_channels = 4
    transformer_config = dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=32, n_layers=1,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=text_hidden, axes_dims=[4, 6, 6],
        axes_lens=[640, 32, 32],
    )
    transformer_config.update(transformer or {})
    dit = ZImageTransformer2DModel(**transformer_config)
    with torch.no_grad():
        dit.x_pad_token.normal_(std=0.5)
        dit.cap_pad_token.normal_(std=0.5)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_autoencoder_kl(latent_channels),
        text_encoder=qwen3_encoder(len(tokenizer), text_hidden, 2),
        tokenizer=tokenizer,
        transformer=dit,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
