"""Small real FLUX.1 pipelines: FLUX (CLIP + T5, a 1+1-block FLUX transformer), FLUX.1-Kontext (FLUX's components
under the Kontext class) and Chroma (T5 only, FLUX's layout with a modulation approximator)."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import clip_config, t5_encoder, tiny_autoencoder_kl
from .tokenizers import word_level_tokenizer

# The tiny FLUX.1 transformer both FLUX and Chroma build on (1 double- and 1 single-stream block, 2 heads of 16).
FLUX1_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(4, 4, 8),
)
# FLUX's resolution-dependent shift, with sequence lengths fitting 32-64 px images.
FLUX1_SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
                       max_image_seq_len=256)


def tiny_flux_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    guidance_embeds: bool = True,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``FluxPipeline`` (CLIP + T5 text encoders, a 1+1-block FLUX transformer, a VAE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    transformer_config = dict(FLUX1_TRANSFORMER, pooled_projection_dim=32, guidance_embeds=guidance_embeds)
    transformer_config.update(transformer or {})
    pipe = FluxPipeline(
        transformer=FluxTransformer2DModel(**transformer_config),
        vae=tiny_autoencoder_kl(transformer_config["in_channels"] // 4),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX1_SCHEDULER),
        text_encoder=CLIPTextModel(clip_config(len(tokenizer), 32, 32, 2, 4, max_length)),
        text_encoder_2=t5_encoder(len(tokenizer), transformer_config["joint_attention_dim"], 2, 4),
        tokenizer=tokenizer,
        tokenizer_2=word_level_tokenizer(words, max_length),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_kontext_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    guidance_embeds: bool = True,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``FluxKontextPipeline``: the tiny FLUX pipeline's components (``FluxKontextPipeline``
    takes exactly FLUX's) under the Kontext pipeline class; FLUX.1-Kontext-dev has a guidance embedding, as the
    default."""
    from diffusers import FluxKontextPipeline

    flux = tiny_flux_pipeline(words, max_length=max_length, guidance_embeds=guidance_embeds, transformer=transformer,
                              seed=seed)
    pipe = FluxKontextPipeline(**flux.components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_chroma_pipeline(words: Iterable[str], *, max_length: int = 12, transformer: dict | None = None, seed: int = 0):
    """A randomly initialised ``ChromaPipeline``: a T5 encoder, a 1+1-block Chroma transformer, a VAE.

    The transformer's approximator (the MLP producing every block's modulation from the timestep) is one layer of
    width 16 over ``approximator_num_channels = 16`` input features.
    """
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    transformer_config = dict(FLUX1_TRANSFORMER, approximator_num_channels=16, approximator_hidden_dim=16,
                              approximator_layers=1)
    transformer_config.update(transformer or {})
    pipe = ChromaPipeline(
        transformer=ChromaTransformer2DModel(**transformer_config),
        vae=tiny_autoencoder_kl(transformer_config["in_channels"] // 4),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX1_SCHEDULER),
        text_encoder=t5_encoder(len(tokenizer), transformer_config["joint_attention_dim"], 2, 4),
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
