"""A small real CogView4 pipeline: a GLM encoder (left padding, as GLM-4's tokenizer), a CogView4 DiT, a VAE
without a shift factor."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import in_eval_mode, tiny_autoencoder_kl
from .tokenizers import word_level_tokenizer


def tiny_cogview4_pipeline(words: Iterable[str], *, max_length: int = 12, seed: int = 0):
    """A randomly initialised ``CogView4Pipeline``: a 2-layer GLM encoder, a 1-block transformer, a VAE.

    The GLM config's ``pad_token_id`` is the tokenizer's pad id (0), inside the tiny vocabulary; the tokenizer pads
    on the left as GLM-4's does. The scheduler is CogView4's: dynamic shifting with ``time_shift_type="linear"``
    (base_shift 0.25, max_shift 0.75, base_image_seq_len 256).
    """
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = word_level_tokenizer(words, max_length)
    tokenizer.padding_side = "left"
    glm = GlmConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    transformer = CogView4Transformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        text_embed_dim=glm.hidden_size,
        time_embed_dim=16,
        condition_dim=8,
        sample_size=16,
        rope_axes_dim=(16, 16),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    pipe = CogView4Pipeline(
        tokenizer=tokenizer,
        text_encoder=GlmModel(glm),
        vae=tiny_autoencoder_kl(4, scaling_factor=1.5, shift_factor=None),
        transformer=transformer,
        scheduler=scheduler,
    )
    in_eval_mode(pipe)
    return pipe
