"""A small real Wan2.1 pipeline: a UMT5 encoder, a 1-2 layer Wan DiT, a tiny causal 3D VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import word_level_tokenizer


def tiny_wan_vae(z_dim: int = 4, *, base_dim: int = 4, spatial_levels: int = 2, temporal_levels: int = 2,
                 patch_size: int | None = None):
    """An ``AutoencoderKLWan`` downsampling ``2 ** spatial_levels`` in space and ``2 ** temporal_levels`` in time
    (released Wan2.1: 8 and 4), with ``z_dim`` latent channels and per-channel statistics that are not 0 and 1 (so the
    adapter's normalisation is exercised). ``patch_size`` p folds p x p pixels into channels before the encoder (the
    Wan2.2 VAE's ``patchify``), so that space shrinks ``p * 2 ** spatial_levels`` in all."""
    from diffusers import AutoencoderKLWan

    if temporal_levels > spatial_levels:
        raise ValueError("the Wan VAE downsamples time only at levels that also downsample space")
    levels = spatial_levels + 1
    pixels = 3 * (patch_size or 1) ** 2
    generator = torch.Generator().manual_seed(1)
    return AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1] * levels,
        num_res_blocks=1,
        temperal_downsample=[False] * (spatial_levels - temporal_levels) + [True] * temporal_levels,
        latents_mean=(0.2 * torch.randn(z_dim, generator=generator)).tolist(),
        latents_std=(1.0 + 0.5 * torch.rand(z_dim, generator=generator)).tolist(),
        in_channels=pixels,
        out_channels=pixels,
        patch_size=patch_size,
        scale_factor_temporal=2 ** temporal_levels,
        scale_factor_spatial=(patch_size or 1) * 2 ** spatial_levels,
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


def tiny_wan22_vae(z_dim: int = 4, *, base_dim: int = 8):
    """The Wan2.2 VAE (TI2V-5B's ``AutoencoderKLWan`` with ``is_residual=True`` and ``patch_size=2``: a 2x2 pixel
    patchify before a residual encoder, 12 input channels) at a tiny width: 8x in space (the patch, then 2 levels of
    2) and 4x in time (the released one: 16x and 4x, ``z_dim`` 48), with per-channel statistics that are not 0 and 1."""
    from diffusers import AutoencoderKLWan

    generator = torch.Generator().manual_seed(2)
    return AutoencoderKLWan(
        base_dim=base_dim,
        decoder_base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        latents_mean=(0.2 * torch.randn(z_dim, generator=generator)).tolist(),
        latents_std=(1.0 + 0.5 * torch.rand(z_dim, generator=generator)).tolist(),
        scale_factor_temporal=4,
        scale_factor_spatial=8,
    )


def _umt5(words, max_length: int, t5_dim: int, t5_layers: int):
    """A tiny UMT5 encoder and its word-level tokenizer (as ``tiny_wan_pipeline`` builds them)."""
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = word_level_tokenizer(list(words), max_length)
    encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=t5_dim, d_kv=t5_dim // 2, d_ff=2 * t5_dim, num_layers=t5_layers,
        num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    return tokenizer, encoder


def _finished(pipe):
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_clip_vision(image_size: int = 32, hidden: int = 16):
    """A tiny ``CLIPVisionModel`` (2 layers: the pipeline reads the penultimate hidden state) and its
    ``CLIPImageProcessor`` at ``image_size`` px."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=2,
        image_size=image_size, patch_size=8, projection_dim=hidden))
    processor = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size,
                                                                                  "width": image_size})
    return encoder, processor


def tiny_wan_i2v_pipeline(words: Iterable[str], *, max_length: int = 12, t5_dim: int = 32, t5_layers: int = 1,
                          z_dim: int = 4, shift: float = 3.0, seed: int = 0):
    """A randomly initialised Wan2.1 I2V ``WanImageToVideoPipeline``: UMT5, a tiny CLIP vision encoder whose
    penultimate hidden state is the transformer's ``encoder_hidden_states_image``, a 1-layer DiT taking
    ``2 z + 4`` channels (noise, the 4-channel first-frame mask, the condition video's latents), the Wan2.1 VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    torch.manual_seed(seed)
    tokenizer, encoder = _umt5(words, max_length, t5_dim, t5_layers)
    vae = tiny_wan_vae(z_dim)  # drawn right after the text encoder: the same VAE as tiny_wan_pipeline's
    image_encoder, image_processor = tiny_clip_vision()
    inner = 2 * 8
    transformer = tiny_wan_transformer(2 * z_dim + 4, z_dim, text_dim=t5_dim, image_dim=image_encoder.config.hidden_size,
                                       added_kv_proj_dim=inner)
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), image_processor=image_processor,
                                   image_encoder=image_encoder, transformer=transformer)
    return _finished(pipe)


def tiny_wan22_pipeline(words: Iterable[str], *, max_length: int = 12, t5_dim: int = 32, t5_layers: int = 1,
                        z_dim: int = 4, boundary_ratio: float = 0.875, shift: float = 3.0, seed: int = 0):
    """A randomly initialised Wan2.2 A14B T2V ``WanPipeline``: two 1-layer experts, ``transformer`` (high noise, from
    ``boundary_ratio * 1000`` up: 875 as released) and ``transformer_2`` (low noise), the Wan2.1 VAE. With
    ``shift=3`` a 3-step schedule runs the high expert at t=1000 and the low one at t=750 and t=3: it crosses."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    torch.manual_seed(seed)
    tokenizer, encoder = _umt5(words, max_length, t5_dim, t5_layers)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=tiny_wan_vae(z_dim),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                       transformer=tiny_wan_transformer(z_dim, text_dim=t5_dim),
                       transformer_2=tiny_wan_transformer(z_dim, text_dim=t5_dim), boundary_ratio=boundary_ratio)
    return _finished(pipe)


def tiny_wan22_i2v_pipeline(words: Iterable[str], *, max_length: int = 12, t5_dim: int = 32, t5_layers: int = 1,
                            z_dim: int = 4, boundary_ratio: float = 0.9, shift: float = 3.0, seed: int = 0):
    """A randomly initialised Wan2.2 A14B I2V ``WanImageToVideoPipeline``: two 1-layer experts taking ``2 z + 4``
    channels (boundary 0.9 as released), no image encoder (A14B I2V conditions through the latents only)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    torch.manual_seed(seed)
    tokenizer, encoder = _umt5(words, max_length, t5_dim, t5_layers)
    experts = [tiny_wan_transformer(2 * z_dim + 4, z_dim, text_dim=t5_dim) for _ in range(2)]
    pipe = WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=encoder, vae=tiny_wan_vae(z_dim),
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), transformer=experts[0],
                                   transformer_2=experts[1], boundary_ratio=boundary_ratio)
    return _finished(pipe)


def tiny_wan22_ti2v_pipeline(words: Iterable[str], *, max_length: int = 12, t5_dim: int = 32, t5_layers: int = 1,
                             z_dim: int = 4, image_to_video: bool = False, shift: float = 5.0, seed: int = 0):
    """A randomly initialised Wan2.2 TI2V-5B pipeline: ``WanPipeline(expand_timesteps=True)`` (per-token timesteps),
    or with ``image_to_video`` its I2V mode ``WanImageToVideoPipeline(expand_timesteps=True)`` (the first latent frame
    is the condition image's); one 1-layer DiT on ``z`` channels, the Wan2.2 VAE (``tiny_wan22_vae``), flow shift 5
    (TI2V-5B's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    torch.manual_seed(seed)
    tokenizer, encoder = _umt5(words, max_length, t5_dim, t5_layers)
    parts = dict(tokenizer=tokenizer, text_encoder=encoder, vae=tiny_wan22_vae(z_dim),
                 scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                 transformer=tiny_wan_transformer(z_dim, text_dim=t5_dim), expand_timesteps=True)
    pipe = WanImageToVideoPipeline(**parts) if image_to_video else WanPipeline(**parts)
    return _finished(pipe)
