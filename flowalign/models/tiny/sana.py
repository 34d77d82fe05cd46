"""A small real SANA pipeline: a Gemma2 encoder, a linear-attention DiT and a tiny DC-AE."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import gemma2_encoder
from .tokenizers import word_level_tokenizer


def tiny_sana_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    gemma_dim: int = 32,
    transformer: dict | None = None,
    shift: float = 7.0,
    seed: int = 0,
):
    """A randomly initialised ``SanaPipeline``: a Gemma2 encoder, a 1-block SANA transformer, a 2-level DC-AE.

    The DC-AE downsamples by 2 (released SANA models: 32), so 32 px images are 16x16 latents; the transformer's
    ``sample_size`` 16 makes 32 px the default size. ``timestep_scale`` is 0.5 (released SANA: 1) so that the
    adapter contract exercises it. The scheduler is ``FlowMatchEulerDiscreteScheduler(shift=7)``, as diffusers'
    SANA tests (the released models ship a flow-matching DPM-Solver).
    """
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    transformer_config = dict(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=8,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=gemma_dim,
        sample_size=16,
        timestep_scale=0.5,
    )
    transformer_config.update(transformer or {})
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=transformer_config["in_channels"],
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    pipe = SanaPipeline(
        tokenizer=tokenizer,
        text_encoder=gemma2_encoder(len(tokenizer), gemma_dim, 1),
        vae=vae,
        transformer=SanaTransformer2DModel(**transformer_config),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
