"""A small real Mochi pipeline: a T5 encoder, a 2-layer Mochi DiT, a tiny Mochi VAE (8x space, 6x time)."""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import word_level_tokenizer


def tiny_mochi_vae(*, width: int = 32, seed: int = 1):
    """An ``AutoencoderKLMochi`` with the released layout of expansions (6x in time, 8x in space: what
    ``MochiPipeline`` assumes) at ``width`` channels, one layer per block and no attention, with 12 latent channels
    (the pipeline reshapes its statistics to 12) and per-channel statistics that are not 0 and 1."""
    from diffusers import AutoencoderKLMochi

    generator = torch.Generator().manual_seed(seed)
    return AutoencoderKLMochi(
        latent_channels=12,
        out_channels=3,
        encoder_block_out_channels=(width,) * 4,
        decoder_block_out_channels=(width,) * 4,
        layers_per_block=(1, 1, 1, 1, 1),
        add_attention_block=(False,) * 5,
        latents_mean=(0.2 * torch.randn(12, generator=generator)).tolist(),
        latents_std=(1.0 + 0.5 * torch.rand(12, generator=generator)).tolist(),
    )


def tiny_mochi_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    t5_dim: int = 32,
    transformer: dict | None = None,
    force_zeros_for_empty_prompt: bool = True,
    seed: int = 0,
):
    """A randomly initialised ``MochiPipeline``: a T5 encoder, a 2-layer Mochi DiT (patch 2; the last block has no text outputs, so two exercise both kinds), a tiny Mochi VAE, and
    the released scheduler (``FlowMatchEulerDiscreteScheduler(invert_sigmas=True)``: genmo/mochi-1-preview's
    ``scheduler_config.json``); ``force_zeros_for_empty_prompt`` as the released ``model_index.json``.

    ``transformer`` overrides the DiT's settings.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=t5_dim, d_kv=t5_dim // 2, d_ff=2 * t5_dim, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    settings = dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
                    in_channels=12, qk_norm="rms_norm", text_embed_dim=t5_dim, time_embed_dim=4,
                    activation_fn="swiglu", max_sequence_length=max_length)
    settings.update(transformer or {})
    pipe = MochiPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=tiny_mochi_vae(),
        transformer=MochiTransformer3DModel(**settings),
        scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True),
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
