"""Small real HunyuanVideo 1.5 pipelines (text-to-video and image-to-video): a Qwen2.5-VL text model behind the
pipeline's chat template, a ByT5 glyph encoder (a T5 encoder over ByT5's byte tokenizer), a 1-block HunyuanVideo 1.5
DiT, its causal 3D VAE downsampling 4x in space and time and, for image-to-video, a SigLIP vision tower.

The pipelines drop the first 108 tokens of the chat-templated prompt (``prompt_template_encode_start_idx``, the
released Qwen tokenizer's count of the system turn): the tiny tokenizer's chat template gives the system turn exactly
108 tokens (the word-level split of the system prompt, then ``<|filler|>`` tokens up to 108: ``chat_template``),
so exactly the user's text is kept, as released. The released pipelines also pad the Qwen prompt to 1000 tokens, the
ByT5 glyph text to 256 and give text-to-video 729 zero image tokens: attributes the pipelines set in ``__init__``
(``tokenizer_max_length``, ``tokenizer_2_max_length``, ``vision_num_semantic_tokens``), which the tiny builders set
to tiny values after construction. A tiny pipeline saved and loaded again gets the released lengths back (still the
same model, over longer padding; ``model.max_sequence_length`` shortens the Qwen padding again).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .tokenizers import CHAT_TEMPLATE, chat_word_tokenizer

# The tiny transformer's width; the text widths are the encoders' hidden sizes.
TEXT_HIDDEN = 32
GLYPH_HIDDEN = 16
IMAGE_EMBED_DIM = 16


FILLER = "<|filler|>"


def chat_template(filler: int) -> str:
    """``CHAT_TEMPLATE`` with ``filler`` ``<|filler|>`` tokens after the system turn's text."""
    system_end = "{{ '<|im_end|>' + '\n' }}"
    padded = ("{% if message['role'] == 'system' %}{{ '" + FILLER + "' * " + str(filler) + " }}{% endif %}"
              + system_end)
    if CHAT_TEMPLATE.count(system_end) != 1:
        raise RuntimeError("the tiny chat template changed: place the filler tokens again")
    return CHAT_TEMPLATE.replace(system_end, padded)


def template_prefix_tokens(pipe) -> int:
    """The tokens the pipeline's chat template puts before the user's text, counted by its own tokenizer (the
    ``prompt_template_encode_start_idx`` the released pipeline hard-codes for Qwen's tokenizer)."""
    marker = "marker"
    messages = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": marker}]
    text = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(pipe.tokenizer(text.split(marker)[0], add_special_tokens=False).input_ids)


def tiny_hunyuan_video15_vae(latent_channels: int = 4):
    """An ``AutoencoderKLHunyuanVideo15`` downsampling 4x in space and time (released: 16x and 4x) with
    ``latent_channels`` channels and the released ``scaling_factor``."""
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15(latent_channels=latent_channels, block_out_channels=(16, 16, 16),
                                       layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=4)


def tiny_hunyuan_video15_pipeline(
    words: Iterable[str],
    *,
    image_to_video: bool = False,
    max_length: int = 16,
    glyph_length: int = 8,
    image_tokens: int = 4,
    target_size: int = 16,
    transformer: dict | None = None,
    shift: float = 5.0,
    guidance_scale: float = 6.0,
    seed: int = 0,
):
    """A randomly initialised ``HunyuanVideo15Pipeline`` (or ``HunyuanVideo15ImageToVideoPipeline`` with
    ``image_to_video``): a 2-layer Qwen2.5-VL text model (the pipeline reads its third-last hidden state), a 1-layer
    T5 encoder over ``ByT5Tokenizer``, a 1-block DiT (1 token-refiner block), a 4x/4x VAE with 4 latent channels,
    ``FlowMatchEulerDiscreteScheduler(shift=5)`` and ``ClassifierFreeGuidance(guidance_scale=6)``, the released
    480p settings; image-to-video adds a 1-layer SigLIP vision tower over 16 px images (16 tokens).

    ``max_length`` (Qwen tokens after the template), ``glyph_length`` (ByT5 tokens) and ``image_tokens`` (the
    zero image tokens of text-to-video) set the pipeline's padded lengths; ``target_size`` is the transformer's
    ``target_size`` (the pixel size the pipeline's default frame size is bucketed around).
    """
    from diffusers import (ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline,
                           HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    words = list(words)
    torch.manual_seed(seed)
    tokenizer = chat_word_tokenizer(words, 512, extra_special=(FILLER,))
    heads = 2
    head_dim = TEXT_HIDDEN // heads
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "mrope_section": [head_dim // 8, head_dim // 8, head_dim // 4],
                         "rope_theta": 1000000.0},
        pad_token_id=0, bos_token_id=None, eos_token_id=1,
    ))
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=GLYPH_HIDDEN, d_kv=GLYPH_HIDDEN // 2, d_ff=2 * GLYPH_HIDDEN, num_layers=1,
        num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1))
    vae = tiny_hunyuan_video15_vae()
    latent = vae.config.latent_channels
    settings = dict(
        in_channels=2 * latent + 1, out_channels=latent, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=TEXT_HIDDEN, text_embed_2_dim=GLYPH_HIDDEN,
        image_embed_dim=IMAGE_EMBED_DIM, rope_axes_dim=(4, 6, 6), target_size=target_size,
        task_type="i2v" if image_to_video else "t2v",
    )
    settings.update(transformer or {})
    components = dict(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=HunyuanVideo15Transformer3DModel(**settings),
        vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )
    if image_to_video:
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        components["image_encoder"] = SiglipVisionModel(SiglipVisionConfig(
            hidden_size=IMAGE_EMBED_DIM, intermediate_size=2 * IMAGE_EMBED_DIM, num_hidden_layers=1,
            num_attention_heads=2, image_size=16, patch_size=4))
        components["feature_extractor"] = SiglipImageProcessor(size={"height": 16, "width": 16})
        pipe = HunyuanVideo15ImageToVideoPipeline(**components)
    else:
        pipe = HunyuanVideo15Pipeline(**components)
    natural = template_prefix_tokens(pipe)
    dropped = pipe.prompt_template_encode_start_idx
    if natural > dropped:
        raise RuntimeError(f"the tiny tokenizer gives the system turn {natural} tokens, more than the {dropped} the "
                           "pipeline drops")
    tokenizer.chat_template = chat_template(dropped - natural)
    if template_prefix_tokens(pipe) != dropped:
        raise RuntimeError(f"the tiny tokenizer gives the system turn {template_prefix_tokens(pipe)} tokens, but the "
                           f"pipeline drops {dropped}")
    pipe.tokenizer_max_length = max_length
    pipe.tokenizer_2_max_length = glyph_length
    pipe.vision_num_semantic_tokens = image_tokens
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
