"""Small real SD3 and FLUX pipelines built in-process, with word-level tokenizers: no hub access needed.

The toy world pre-trains ``tiny_sd3_pipeline`` at its own sizes; tests build smaller ones the same way, as
diffusers' own tests do. The tokenizers are ``tokenizers`` WordLevel models wrapped in ``PreTrainedTokenizerFast``,
so ``save_pretrained`` / ``from_pretrained`` round-trip them like any other tokenizer.

CLIP text encoders are configured with ``eos_token_id=1``: with 2, transformers' CLIP falls back to its legacy
pooling (the position of the largest token id) instead of the position of the EOS token.
"""

from __future__ import annotations

from typing import Iterable

import torch

PAD, EOS, UNK = "[PAD]", "[EOS]", "[UNK]"


def word_level_tokenizer(words: Iterable[str], max_length: int):
    """A lower-casing, whitespace/punctuation-splitting word tokenizer that appends ``[EOS]`` (id 1); pad id 0."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for word in words:
        vocab.setdefault(word.lower(), len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK, model_max_length=max_length
    )


def _clip_config(vocab_size: int, hidden: int, projection: int, layers: int, heads: int, max_length: int):
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


def _t5_encoder(vocab_size: int, d_model: int, layers: int, heads: int):
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


def tiny_sd3_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    clip_hidden: int = 32,
    clip_layers: int = 2,
    t5_dim: int = 64,
    t5_layers: int = 2,
    transformer: dict | None = None,
    vae: dict | None = None,
    shift: float = 3.0,
    seed: int = 0,
):
    """A randomly initialised ``StableDiffusion3Pipeline``: two CLIP encoders, a T5 encoder, an MMDiT and a VAE.

    The two CLIP widths concatenate to ``2 * clip_hidden``, padded by SD3 up to the T5 width ``t5_dim``, which is the
    transformer's ``joint_attention_dim``; the pooled projection is ``2 * clip_hidden`` wide.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    if 2 * clip_hidden > t5_dim:
        raise ValueError(f"SD3 pads the CLIP width 2*{clip_hidden} up to the T5 width {t5_dim}: need 2*clip_hidden <= t5_dim")
    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    clip = _clip_config(len(tokenizer), clip_hidden, clip_hidden, clip_layers, 4, max_length)
    transformer_config = dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=t5_dim,
        caption_projection_dim=32,
        pooled_projection_dim=2 * clip_hidden,
        pos_embed_max_size=32,
    )
    transformer_config.update(transformer or {})
    vae_config = dict(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=transformer_config["in_channels"],
        norm_num_groups=4,
        sample_size=32,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.5,
        shift_factor=0.06,
    )
    vae_config.update(vae or {})
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**transformer_config),
        vae=AutoencoderKL(**vae_config),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
        text_encoder=CLIPTextModelWithProjection(clip),
        text_encoder_2=CLIPTextModelWithProjection(clip),
        text_encoder_3=_t5_encoder(len(tokenizer), t5_dim, t5_layers, 4),
        tokenizer=tokenizer,
        tokenizer_2=word_level_tokenizer(words, max_length),
        tokenizer_3=word_level_tokenizer(words, max_length),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 12,
    guidance_embeds: bool = True,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``FluxPipeline`` (CLIP + T5 text encoders, a 1+1-block FLUX transformer, a VAE)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

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
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
        guidance_embeds=guidance_embeds,
    )
    transformer_config.update(transformer or {})
    pipe = FluxPipeline(
        transformer=FluxTransformer2DModel(**transformer_config),
        vae=AutoencoderKL(
            in_channels=3,
            out_channels=3,
            block_out_channels=(8, 16),
            down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2,
            layers_per_block=1,
            latent_channels=transformer_config["in_channels"] // 4,
            norm_num_groups=4,
            sample_size=32,
            mid_block_add_attention=False,
            use_quant_conv=False,
            use_post_quant_conv=False,
            scaling_factor=1.5,
            shift_factor=0.06,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16, max_image_seq_len=256
        ),
        text_encoder=CLIPTextModel(_clip_config(len(tokenizer), 32, 32, 2, 4, max_length)),
        text_encoder_2=_t5_encoder(len(tokenizer), transformer_config["joint_attention_dim"], 2, 4),
        tokenizer=tokenizer,
        tokenizer_2=word_level_tokenizer(words, max_length),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
