"""A small real LTX-2 (audio-video) pipeline: a Gemma3 encoder, the text connectors, a 1-layer audio-video DiT, a tiny
LTX-2 video VAE, a tiny audio VAE and vocoder."""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import word_level_tokenizer


def tiny_gemma3_encoder(vocab_size: int, hidden: int = 16, layers: int = 1):
    """A ``Gemma3ForConditionalGeneration`` (LTX-2's text encoder, a Gemma-3 12B in the released model) at a tiny
    width and depth, with a tiny SigLIP vision tower it never uses for text; pad id 0, EOS id 1. The pipeline stacks
    its ``layers + 1`` hidden states."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config=dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=256, sliding_window=64, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2),
        vision_config=dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4),
        mm_tokens_per_image=4, boi_token_index=vocab_size, eoi_token_index=vocab_size + 1,
        image_token_index=vocab_size + 2)
    config._attn_implementation = "eager"
    return Gemma3ForConditionalGeneration(config)


def tiny_ltx2_connectors(caption_channels: int, layers: int):
    """``LTX2TextConnectors`` (LTX-2.0: one shared projection of the stacked hidden states, a video and an audio
    connector) at a tiny width: 1 layer each, 4 learnable registers (the released model has 128)."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors(
        caption_channels=caption_channels, text_proj_in_factor=layers + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=4, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1, audio_connector_num_learnable_registers=4,
        connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split")


def tiny_ltx2_vae(latent_channels: int = 4, *, seed: int = 1):
    """An ``AutoencoderKLLTX2Video`` downsampling 4x in space and time (one spatio-temporal level and the 2x2 patch;
    released LTX-2: 32x and 8x), as diffusers' own LTX-2 tests build it, with ``latents_mean`` / ``latents_std``
    buffers that are not 0 and 1 (so the adapter's normalisation is exercised)."""
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1,),
        decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",),
        upsample_type=("spatiotemporal",), upsample_residual=(False,), upsample_factor=(1,),
        timestep_conditioning=False, patch_size=2, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vae.latents_mean.copy_(0.2 * torch.randn(latent_channels, generator=generator))
        vae.latents_std.copy_(1.0 + 0.5 * torch.rand(latent_channels, generator=generator))
    return vae


def tiny_ltx2_audio(latent_channels: int = 2, mel_bins: int = 8):
    """A tiny ``AutoencoderKLLTX2Audio`` (16 kHz, hop 160, 4x in time and mel: 25 latent frames a second) and its
    ``LTX2Vocoder``, as diffusers' own LTX-2 tests build them."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=latent_channels, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=mel_bins)
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * mel_bins, hidden_channels=8, out_channels=2,
        upsample_kernel_sizes=[4], upsample_factors=[2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
        output_sampling_rate=16000)
    return audio_vae, vocoder


def tiny_ltx2_transformer(in_channels: int, audio_channels: int, caption_channels: int, **config):
    """An ``LTX2VideoTransformer3DModel`` at a tiny width and depth (2 heads of 8 for video, 2 of 4 for audio, 1
    layer, patch 1x1x1)."""
    from diffusers import LTX2VideoTransformer3DModel

    settings = dict(in_channels=in_channels, out_channels=in_channels, patch_size=1, patch_size_t=1,
                    num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                    audio_in_channels=audio_channels, audio_out_channels=audio_channels,
                    audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
                    num_layers=1, caption_channels=caption_channels, rope_double_precision=False, rope_type="split",
                    vae_scale_factors=(4, 4, 4))
    settings.update(config)
    return LTX2VideoTransformer3DModel(**settings)


def tiny_ltx2_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    text_dim: int = 16,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``LTX2Pipeline``: a 1-layer Gemma3 encoder, the text connectors, a 1-layer LTX-2 DiT
    over 4 video latent channels and 2x2 audio latent channels and mel bins, a video VAE downsampling 4x in space and
    time, the audio VAE and vocoder, and the LTX line's released scheduler settings (``FlowMatchEulerDiscreteScheduler``
    with ``use_dynamic_shifting``, shifts 0.95 / 2.05 between 1024 and 4096 tokens, ``shift_terminal`` 0.1: the
    values of Lightricks/LTX-Video's ``scheduler_config.json`` and the defaults ``LTX2Pipeline`` falls back to; LTX-2's
    own config file was not read here, its 0.95 / 2.05 shifts are what other LTX-2 runtimes use).

    ``transformer`` overrides the settings of ``tiny_ltx2_transformer``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    tokenizer.padding_side = "left"
    encoder = tiny_gemma3_encoder(len(tokenizer), text_dim)
    connectors = tiny_ltx2_connectors(text_dim, encoder.config.text_config.num_hidden_layers)
    vae = tiny_ltx2_vae()
    audio_vae, vocoder = tiny_ltx2_audio()
    audio_channels = audio_vae.config.latent_channels * (audio_vae.config.mel_bins // audio_vae.mel_compression_ratio)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
        max_image_seq_len=4096, shift_terminal=0.1)
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=tiny_ltx2_transformer(vae.config.latent_channels, audio_channels, text_dim,
                                          **(transformer or {})),
        vocoder=vocoder,
    )
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
