"""A small real Lumina-Image 2.0 pipeline: a Gemma2 encoder behind the pipeline's system prompt, a Lumina2 DiT."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import gemma2_encoder, tiny_autoencoder_kl
from .tokenizers import word_level_tokenizer


def tiny_lumina2_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 40,
    gemma_dim: int = 32,
    transformer: dict | None = None,
    shift: float = 6.0,
    seed: int = 0,
):
    """A randomly initialised ``Lumina2Pipeline``: a 2-layer Gemma2 encoder, a 1-layer Lumina2 transformer, a VAE.

    The pipeline fixes the VAE's downsampling at 8, so the VAE has 4 levels; with patch size 2 and ``sample_size``
    4, 32 px is the default size. The tokenizer's ``max_length`` (40) holds the pipeline's system prompt (its words
    are unknown tokens here) plus a short prompt. Gemma2 has 2 layers: the pipeline takes the second-to-last hidden
    state.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    transformer_config = dict(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=1,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(8, 4, 4),
        axes_lens=(64, 16, 16),
        cap_feat_dim=gemma_dim,
    )
    transformer_config.update(transformer or {})
    pipe = Lumina2Pipeline(
        transformer=Lumina2Transformer2DModel(**transformer_config),
        vae=tiny_autoencoder_kl(transformer_config["in_channels"], blocks=4),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        text_encoder=gemma2_encoder(len(tokenizer), gemma_dim, 2),
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
