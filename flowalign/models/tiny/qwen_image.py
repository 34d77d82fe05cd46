"""A small real Qwen-Image pipeline: a Qwen2.5-VL text encoder behind the pipeline's own chat template (the tiny
chat tokenizer gives its prefix as many tokens as the pipeline drops), a Qwen-Image MMDiT, its video-shaped VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import chat_word_tokenizer


def _check_template_prefix(pipe, tokenizer) -> None:
    """The tokens the pipeline drops must be exactly its template's prefix, up to the user's text."""
    prefix = pipe.prompt_template_encode.split("{}")[0]
    count = len(tokenizer(prefix, add_special_tokens=False).input_ids)
    if count != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"the tiny tokenizer gives the template prefix {count} tokens, but the pipeline drops "
                           f"{pipe.prompt_template_encode_start_idx}")


def tiny_qwen_image_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 64,
    text_hidden: int = 32,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``QwenImagePipeline``: a 1-layer Qwen2.5-VL text encoder (with a 1-block vision tower
    that text-to-image never runs), a 1-block Qwen-Image MMDiT and a 2-level AutoencoderKLQwenImage (4x downsampling)
    with non-trivial ``latents_mean`` / ``latents_std``; the scheduler shifts with the image length and stretches to
    a terminal sigma as Qwen-Image's does."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = chat_word_tokenizer(words, max_length)
    heads = 2
    head_dim = text_hidden // heads
    text_config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=text_hidden * 2,
            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [head_dim // 8, head_dim // 8, head_dim // 4],
                             "rope_theta": 1000000.0},
            pad_token_id=0, bos_token_id=None, eos_token_id=1,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text_hidden),
    )
    z_dim = 4
    transformer_config = dict(
        patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_hidden, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    )
    transformer_config.update(transformer or {})
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.05, 0.3], latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=16, max_image_seq_len=256,
            shift_terminal=0.02, time_shift_type="exponential"),
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration(text_config),
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(**transformer_config),
    )
    _check_template_prefix(pipe, tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe
