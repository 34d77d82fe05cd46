"""Components the tiny pipelines share: small text encoders from transformers configs and a small VAE, randomly
initialised (the caller seeds torch first), and ``in_eval_mode`` for a finished pipeline."""

from __future__ import annotations

import torch


def clip_config(vocab_size: int, hidden: int, projection: int, layers: int, heads: int, max_length: int):
    """A ``CLIPTextConfig`` at a tiny width and depth; ``eos_token_id=1``: with 2, transformers' CLIP falls back to
    its legacy pooling (the position of the largest token id) instead of the position of the EOS token."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        projection_dim=projection,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_length,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
    )


def t5_encoder(vocab_size: int, d_model: int, layers: int, heads: int):
    """A ``T5EncoderModel`` at a tiny width and depth; pad id 0, EOS id 1 (``word_level_tokenizer``'s)."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_model // heads,
        d_ff=d_model * 2,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config)


def gemma2_encoder(vocab_size: int, hidden: int, layers: int, heads: int = 2, head_dim: int = 16):
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


def qwen3_encoder(vocab_size: int, hidden: int, layers: int, heads: int = 2):
    """A ``Qwen3Model`` (Z-Image's text encoder) at a tiny width and depth; pad id 0, EOS id 1."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False,
    )
    return Qwen3Model(config)


def tiny_autoencoder_kl(latent_channels: int, *, blocks: int = 2, **config):
    """An ``AutoencoderKL`` downsampling by ``2 ** (blocks - 1)`` with ``latent_channels`` channels and FLUX-like
    scaling and shift factors (1.5, 0.06); ``config`` overrides any of its settings."""
    from diffusers import AutoencoderKL

    settings = dict(
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
    settings.update(config)
    return AutoencoderKL(**settings)


def in_eval_mode(pipe):
    """Every module in eval mode, as ``from_pretrained`` leaves them (HiDream's transformer changes its output layout
    and its MoE path in train mode); no progress bars."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
