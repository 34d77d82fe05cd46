"""Small real FLUX.2 pipelines: FLUX.2-dev (a Mistral3 encoder behind a Mistral-style chat template, guidance
embedding) and FLUX.2-Klein (a Qwen3 causal LM behind Qwen's chat template), each with a 1+1-block FLUX.2
transformer and a FLUX.2 VAE whose latent batch-norm statistics are set away from 0 / 1 so that the normalisation
shows."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import in_eval_mode
from .tokenizers import (MISTRAL_STYLE_CHAT_TEMPLATE, MISTRAL_STYLE_SPECIAL_TOKENS, chat_word_tokenizer,
                         word_level_tokenizer)


def tiny_flux2_pipeline(words: Iterable[str], *, max_length: int = 48, text_layers: int = 30, seed: int = 0):
    """A randomly initialised ``Flux2Pipeline`` (FLUX.2-dev): a Mistral3 text encoder from config, a word-level
    tokenizer with a Mistral-style chat template, a 1+1-block FLUX.2 transformer with guidance embedding, and a
    FLUX.2 VAE whose latent batch-norm statistics are set away from 0 / 1 so that the normalisation shows.

    The text model has ``text_layers`` = 30 layers (width 16), so the pipeline's default ``text_encoder_out_layers``
    (10, 20, 30) fit it and the prompt embedding is 3 x 16 wide. The vocabulary holds the system message's words;
    ``max_length`` 48 covers the system message (26 words), the chat tokens and a short prompt.
    """
    import re

    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import MistralConfig, Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    words = list(words) + re.findall(r"\w+|[^\w\s]+", SYSTEM_MESSAGE)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MISTRAL_STYLE_SPECIAL_TOKENS)})
    tokenizer.chat_template = MISTRAL_STYLE_CHAT_TEMPLATE
    text_hidden = 16
    text_config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden,
        intermediate_size=32,
        num_hidden_layers=text_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    vision_config = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, head_dim=8, image_size=32, patch_size=8)
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text_config, vision_config=vision_config, image_token_index=tokenizer.unk_token_id))
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape, generator=generator))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=generator))
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * 4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * text_hidden,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=True,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tokenizer,
                         transformer=transformer)
    in_eval_mode(pipe)
    return pipe


def tiny_flux2_klein_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 32,
    text_hidden: int = 16,
    text_layers: int = 4,
    transformer: dict | None = None,
    is_distilled: bool = False,
    seed: int = 0,
):
    """A randomly initialised ``Flux2KleinPipeline``: a 4-layer Qwen3 causal LM (``text_encoder_out_layers`` then
    fit its depth: layers 1, 2, 3, concatenated to ``3 * text_hidden``), a 1+1-block FLUX.2 transformer, a 2-level
    ``AutoencoderKLFlux2`` whose batch-norm statistics are set to non-trivial values. The tokenizer's
    ``model_max_length`` (32) bounds the text the pipeline pads to."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = chat_word_tokenizer(words, max_length, extra_special=("<think>", "</think>"))
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=text_hidden * 2,
        num_hidden_layers=text_layers, num_attention_heads=2, num_key_value_heads=2, head_dim=text_hidden // 2,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False,
    ))
    z_dim = 4
    transformer_config = dict(
        patch_size=1, in_channels=4 * z_dim, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * text_hidden, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )
    transformer_config.update(transformer or {})
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=z_dim, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, 4 * z_dim))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 4 * z_dim))
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0, time_shift_type="exponential"),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=Flux2Transformer2DModel(**transformer_config),
        is_distilled=is_distilled,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
