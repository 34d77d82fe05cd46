"""Tiny in-process Qwen-Image, Z-Image and FLUX.2-Klein pipelines: Qwen text encoders from transformers configs,
word-level tokenizers with the chat special tokens, no hub access.

``chat_word_tokenizer`` extends ``word_level_tokenizer`` with ``<|im_start|>``, ``<|im_end|>`` and the newline as
tokens of their own, so Qwen chat text tokenizes into as many tokens as Qwen's own tokenizer gives it: Qwen-Image's
system prompt, for instance, is 34 tokens up to the user's text, the ``prompt_template_encode_start_idx`` the
pipeline drops. The tiny pipelines therefore keep the pipelines' own templates, and a saved tiny pipeline loads back
with them.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .tiny import word_level_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# A small Jinja chat template in Qwen's format over plain-string or content-list messages, with the
# ``add_generation_prompt`` and ``enable_thinking`` switches the Qwen3 pipelines pass.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


def chat_word_tokenizer(words: Iterable[str], max_length: int, extra_special: Iterable[str] = ()):
    """``word_level_tokenizer`` plus ``<|im_start|>``, ``<|im_end|>`` (and ``extra_special``) as special tokens and
    ``\\n`` as an added token, and ``CHAT_TEMPLATE`` as its chat template."""
    from tokenizers import AddedToken

    tokenizer = word_level_tokenizer(words, max_length)
    tokenizer.add_tokens([AddedToken("\n", normalized=False, special=False)])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in (IM_START, IM_END, *extra_special)],
                         special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


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


def _qwen3_encoder(vocab_size: int, hidden: int, layers: int, heads: int = 2):
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=None, eos_token_id=1, tie_word_embeddings=False,
    )
    return Qwen3Model(config)


def tiny_z_image_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 64,
    text_hidden: int = 32,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``ZImagePipeline``: a 2-layer Qwen3 encoder (the pipeline reads the second-to-last
    hidden states), a 1-layer Z-Image DiT with 1 refiner layer per stream, a 2-level VAE; shift 3 as Z-Image's.

    The transformer's ``x_pad_token`` / ``cap_pad_token`` (the learned padding of image and text tokens to a multiple
    of 32) are set to seeded finite values: nothing may leave them uninitialised.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = chat_word_tokenizer(words, max_length)
    latent_channels = 4
    transformer_config = dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=latent_channels, dim=32, n_layers=1,
        n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=text_hidden, axes_dims=[4, 6, 6],
        axes_lens=[640, 32, 32],
    )
    transformer_config.update(transformer or {})
    dit = ZImageTransformer2DModel(**transformer_config)
    with torch.no_grad():
        dit.x_pad_token.normal_(std=0.5)
        dit.cap_pad_token.normal_(std=0.5)
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=latent_channels,
            norm_num_groups=4, sample_size=32, mid_block_add_attention=False, use_quant_conv=False,
            use_post_quant_conv=False, scaling_factor=1.5, shift_factor=0.06,
        ),
        text_encoder=_qwen3_encoder(len(tokenizer), text_hidden, 2),
        tokenizer=tokenizer,
        transformer=dit,
    )
    pipe.set_progress_bar_config(disable=True)
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
