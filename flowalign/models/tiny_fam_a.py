"""Small real Chroma, SANA and Lumina2 pipelines built in-process with word-level tokenizers: no hub access needed.

As ``flowalign.models.tiny``: randomly initialised components from diffusers / transformers configs at tiny widths
and depths, 32 px images, for the adapter contract (tests/test_model_families.py).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .tiny import _t5_encoder, word_level_tokenizer


def _tiny_vae(latent_channels: int, blocks: int = 2):
    """An ``AutoencoderKL`` downsampling by ``2 ** (blocks - 1)``, with FLUX-like scaling and shift factors."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8,) * (blocks - 1) + (16,),
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.5,
        shift_factor=0.06,
    )


def tiny_chroma_pipeline(words: Iterable[str], *, max_length: int = 12, transformer: dict | None = None, seed: int = 0):
    """A randomly initialised ``ChromaPipeline``: a T5 encoder, a 1+1-block Chroma transformer, a VAE.

    The transformer's approximator (the MLP producing every block's modulation from the timestep) is one layer of
    width 16 over ``approximator_num_channels = 16`` input features.
    """
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    transformer_config = dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 4, 8),
        approximator_num_channels=16,
        approximator_hidden_dim=16,
        approximator_layers=1,
    )
    transformer_config.update(transformer or {})
    pipe = ChromaPipeline(
        transformer=ChromaTransformer2DModel(**transformer_config),
        vae=_tiny_vae(transformer_config["in_channels"] // 4),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16, max_image_seq_len=256
        ),
        text_encoder=_t5_encoder(len(tokenizer), transformer_config["joint_attention_dim"], 2, 4),
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _gemma2_encoder(vocab_size: int, hidden: int, layers: int, heads: int = 2, head_dim: int = 16):
    """A ``Gemma2Model`` (the text encoder of SANA and Lumina2) at a tiny width and depth; pad id 0."""
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        max_position_embeddings=256,
        sliding_window=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation="eager",
    )
    return Gemma2Model(config)


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
        text_encoder=_gemma2_encoder(len(tokenizer), gemma_dim, 1),
        vae=vae,
        transformer=SanaTransformer2DModel(**transformer_config),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
        vae=_tiny_vae(transformer_config["in_channels"], blocks=4),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        text_encoder=_gemma2_encoder(len(tokenizer), gemma_dim, 2),
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
