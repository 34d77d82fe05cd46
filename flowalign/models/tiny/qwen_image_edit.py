"""A tiny in-process Qwen-Image-Edit-Plus pipeline: a Qwen2.5-VL encoder with its vision tower from a transformers
config, a locally assembled ``Qwen2VLProcessor``, no hub access.

The processor is assembled from a ``Qwen2VLImageProcessor`` and a ``Qwen2VLVideoProcessor`` (patch size 8, merge 2:
a 32x32 condition image is 4 vision tokens) and a word-level chat tokenizer with the vision special tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``); the VL config's
``image_token_id`` / ``video_token_id`` / ``vision_start_token_id`` / ``vision_end_token_id`` are set to their ids.
The tokenizer splits English contractions (``user's``: ``user`` + ``'s``) as Qwen's own does, so the edit pipelines'
system prompt is exactly the 64 tokens they drop (``prompt_template_encode_start_idx``).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import chat_word_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
PATCH, MERGE, TEMPORAL_PATCH = 8, 2, 2


def vision_chat_tokenizer(words: Iterable[str], max_length: int):
    """``chat_word_tokenizer`` with the vision special tokens, splitting ``'s``, ``'t``, ``'re``, ``'ve``, ``'m``,
    ``'ll`` and ``'d`` off as single tokens (as Qwen's pre-tokenizer does) and every other word and punctuation run
    as ``word_level_tokenizer`` does."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = chat_word_tokenizer(words, max_length, extra_special=VISION_TOKENS)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(
        Regex(r"'s|'t|'re|'ve|'m|'ll|'d|\w+|[^\w\s]+"), behavior="removed", invert=True)
    return tokenizer


def tiny_vl_processor(tokenizer, *, max_pixels: int = 32 * 32):
    """A ``Qwen2VLProcessor`` over ``tokenizer`` with image and video processors of the tiny vision tower's patch
    geometry; images above ``max_pixels`` are scaled down to it by the processor (as Qwen2-VL's ``max_pixels``)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    geometry = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, merge_size=MERGE)
    size = {"shortest_edge": (PATCH * MERGE) ** 2, "longest_edge": max_pixels}
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(size=size, **geometry), tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(size=size, **geometry))


def tiny_qwen_image_edit_plus_pipeline(
    words: Iterable[str],
    *,
    max_length: int = 512,
    text_hidden: int = 32,
    transformer: dict | None = None,
    seed: int = 0,
):
    """A randomly initialised ``QwenImageEditPlusPipeline``: a 1-layer Qwen2.5-VL text model with a 1-block vision
    tower (patch 8, merge 2), the processor of ``tiny_vl_processor``, a 1-block Qwen-Image MMDiT and a 2-level
    AutoencoderKLQwenImage (4x downsampling) with non-trivial ``latents_mean`` / ``latents_std``; the scheduler as
    Qwen-Image's (shift with the image length, terminal sigma).

    The pipeline resizes condition images to fixed areas (``CONDITION_IMAGE_SIZE``, 384^2, for the VL encoder and
    ``VAE_IMAGE_SIZE``, 1024^2, for the VAE: module constants of ``pipeline_qwenimage_edit_plus``); tests of this
    tiny model shrink both (see tests/test_model_qwen_image_edit.py)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageEditPlusPipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = vision_chat_tokenizer(words, max_length)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token)
           for name, token in zip(("vision_start", "image", "vision_end", "video"), VISION_TOKENS)}
    heads = 2
    head_dim = text_hidden // heads
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=text_hidden, intermediate_size=text_hidden * 2,
            num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "mrope_section": [head_dim // 8, head_dim // 8, head_dim // 4],
                             "rope_theta": 1000000.0},
            pad_token_id=0, bos_token_id=None, eos_token_id=1,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text_hidden,
                           patch_size=PATCH, temporal_patch_size=TEMPORAL_PATCH, spatial_merge_size=MERGE,
                           window_size=PATCH * MERGE * 2, fullatt_block_indexes=[0]),
        **ids,
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
    pipe = QwenImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=16, max_image_seq_len=256,
            shift_terminal=0.02, time_shift_type="exponential"),
        vae=vae,
        text_encoder=Qwen2_5_VLForConditionalGeneration(config),
        tokenizer=tokenizer,
        processor=tiny_vl_processor(tokenizer),
        transformer=QwenImageTransformer2DModel(**transformer_config),
    )
    prefix = pipe.prompt_template_encode.split("{}")[0]
    count = len(tokenizer(prefix, add_special_tokens=False).input_ids)
    if count != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"the tiny tokenizer gives the template prefix {count} tokens, but the pipeline drops "
                           f"{pipe.prompt_template_encode_start_idx}")
    pipe.set_progress_bar_config(disable=True)
    return pipe
