"""Small real LTX-Video pipelines (T2V and I2V): a T5 encoder, a 1-layer LTX DiT, a tiny causal LTX VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import word_level_tokenizer


def tiny_ltx_vae(latent_channels: int = 8, *, timestep_conditioning: bool = True, seed: int = 1):
    """An ``AutoencoderKLLTXVideo`` downsampling 4x in space and time (two spatio-temporal levels, patch 1; released
    LTX-Video: 32x and 8x), as diffusers' own LTX tests build it, with ``latents_mean`` / ``latents_std`` buffers that
    are not 0 and 1 (so the adapter's normalisation is exercised) and, by default, a timestep-conditioned decoder
    (LTX-Video 0.9.1 and later)."""
    from diffusers import AutoencoderKLLTXVideo

    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=timestep_conditioning,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vae.latents_mean.copy_(0.2 * torch.randn(latent_channels, generator=generator))
        vae.latents_std.copy_(1.0 + 0.5 * torch.rand(latent_channels, generator=generator))
    return vae


def tiny_ltx_transformer(in_channels: int = 8, *, text_dim: int = 32, **config):
    """An ``LTXVideoTransformer3DModel`` at a tiny width and depth (2 heads of 8, 1 layer, patch 1x1x1)."""
    from diffusers import LTXVideoTransformer3DModel

    settings = dict(in_channels=in_channels, out_channels=in_channels, patch_size=1, patch_size_t=1,
                    num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, num_layers=1,
                    caption_channels=text_dim)
    settings.update(config)
    return LTXVideoTransformer3DModel(**settings)


def tiny_ltx_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    t5_dim: int = 32,
    transformer: dict | None = None,
    vae: dict | None = None,
    image_to_video: bool = False,
    seed: int = 0,
):
    """A randomly initialised ``LTXPipeline`` (or ``LTXImageToVideoPipeline`` with ``image_to_video``): a T5 encoder,
    a 1-layer LTX DiT over 8 latent channels, a VAE downsampling 4x in space and time, and the released scheduler's
    settings (``FlowMatchEulerDiscreteScheduler`` with ``use_dynamic_shifting``, shifts 0.95 / 2.05 between 1024 and
    4096 tokens: Lightricks/LTX-Video's ``scheduler_config.json``).

    ``transformer`` and ``vae`` override the settings of ``tiny_ltx_transformer`` and ``tiny_ltx_vae``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXImageToVideoPipeline, LTXPipeline
    from transformers import T5Config, T5EncoderModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=t5_dim, d_kv=t5_dim // 2, d_ff=2 * t5_dim, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    vae_settings = {"latent_channels": 8, **(vae or {})}
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    pipeline_class = LTXImageToVideoPipeline if image_to_video else LTXPipeline
    pipe = pipeline_class(
        tokenizer=tokenizer,
        text_encoder=encoder,
        vae=tiny_ltx_vae(**vae_settings),
        transformer=tiny_ltx_transformer(vae_settings["latent_channels"], text_dim=t5_dim, **(transformer or {})),
        scheduler=scheduler,
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
