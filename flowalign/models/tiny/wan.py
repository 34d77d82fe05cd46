"""A small real Wan2.1 pipeline: a UMT5 encoder, a 1-2 layer Wan DiT, a tiny causal 3D VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import word_level_tokenizer


def tiny_wan_vae(z_dim: int = 4, *, base_dim: int = 4, spatial_levels: int = 2, temporal_levels: int = 2):
    """An ``AutoencoderKLWan`` downsampling ``2 ** spatial_levels`` in space and ``2 ** temporal_levels`` in time
    (released Wan2.1: 8 and 4), with ``z_dim`` latent channels and per-channel statistics that are not 0 and 1 (so the
    adapter's normalisation is exercised)."""
    from diffusers import AutoencoderKLWan

    if temporal_levels > spatial_levels:
        raise ValueError("the Wan VAE downsamples time only at levels that also downsample space")
    levels = spatial_levels + 1
    generator = torch.Generator().manual_seed(1)
    return AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1] * levels,
        num_res_blocks=1,
        temperal_downsample=[False] * (spatial_levels - temporal_levels) + [True] * temporal_levels,
        latents_mean=(0.2 * torch.randn(z_dim, generator=generator)).tolist(),
        latents_std=(1.0 + 0.5 * torch.rand(z_dim, generator=generator)).tolist(),
        scale_factor_temporal=2 ** temporal_levels,
        scale_factor_spatial=2 ** spatial_levels,
    )


def tiny_wan_transformer(in_channels: int = 4, out_channels: int | None = None, *, text_dim: int = 32, **config):
    """A ``WanTransformer3DModel`` at a tiny width and depth (2 heads of 8, 1 layer, patches 1x2x2)."""
    from diffusers import WanTransformer3DModel

    settings = dict(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=in_channels,
        out_channels=out_channels or in_channels,
        text_dim=text_dim,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    settings.update(config)
    return WanTransformer3DModel(**settings)


def tiny_wan_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    t5_dim: int = 32,
    t5_layers: int = 1,
    transformer: dict | None = None,
    vae: dict | None = None,
    shift: float = 3.0,
    seed: int = 0,
):
    """A randomly initialised ``WanPipeline`` (Wan2.1 T2V): a UMT5 encoder, a 1-layer Wan DiT, a VAE downsampling 4x
    in space and time, and ``FlowMatchEulerDiscreteScheduler(shift=3)`` (Wan2.1 480p's flow shift; the released
    pipelines ship UniPC over the same flow sigmas).

    ``transformer`` and ``vae`` override the settings of ``tiny_wan_transformer`` and ``tiny_wan_vae``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=t5_dim, d_kv=t5_dim // 2, d_ff=2 * t5_dim, num_layers=t5_layers,
        num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    vae_settings = {"z_dim": 4, **(vae or {})}
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=tiny_wan_vae(**vae_settings),
        transformer=tiny_wan_transformer(vae_settings["z_dim"], text_dim=t5_dim, **(transformer or {})),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
