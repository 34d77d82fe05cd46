"""A small real Kandinsky 5 text-to-video pipeline: a Qwen2.5-VL text encoder behind the pipeline's own prompt
template (tokenised by a ``Qwen2VLProcessor`` over the tiny chat tokenizer), a CLIP text encoder for the pooled
embedding, a 1+1-block Kandinsky 5 DiT and a HunyuanVideo VAE downsampling 4x in space and time.

The pipeline drops the first ``prompt_template_encode_start_idx`` tokens (128, the released Qwen tokenizer's count of
the template's prefix); the tiny tokenizer gives the prefix exactly as many (one phrase of the template is a token of
its own, ``TEMPLATE_PHRASE``), so exactly the user's text and the template's suffix are kept, as released, and a
saved tiny pipeline loads back the same.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .components import clip_config
from .tokenizers import chat_word_tokenizer, word_level_tokenizer

# Qwen2-VL's vision tokens: the processor looks them up even for text-only calls.
QWEN_VL_SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# A phrase of the prompt template's system turn, one token of the tiny tokenizer: the word-level tokenizer splits the
# template's prefix into 131 tokens, 3 more than the released Qwen tokenizer's 128.
TEMPLATE_PHRASE = "a prompt engineer."


def template_prefix_tokens(pipe) -> int:
    """The tokens of the pipeline's prompt template before the user's text, counted by its own tokenizer."""
    prefix = pipe.prompt_template.split("{}")[0]
    return len(pipe.tokenizer.tokenizer(prefix, add_special_tokens=False).input_ids)


def check_template_prefix(pipe) -> None:
    """The tokens the pipeline drops must be exactly its template's prefix, up to the user's text."""
    count = template_prefix_tokens(pipe)
    if count != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(f"the tiny tokenizer gives the template prefix {count} tokens, but the pipeline drops "
                           f"{pipe.prompt_template_encode_start_idx}")


def randomise_modulations(transformer, std: float = 0.2) -> None:
    """Draw the adaptive-norm modulations' weights (``Kandinsky5Modulation``, zero at init as in the original
    training code): with zeros every block's gate is 0, so the blocks, and with them the text, would not reach the
    velocity of a randomly initialised model."""
    from diffusers.models.transformers.transformer_kandinsky import Kandinsky5Modulation

    with torch.no_grad():
        for module in transformer.modules():
            if isinstance(module, Kandinsky5Modulation):
                module.out_layer.weight.normal_(0.0, std)
                module.out_layer.bias.normal_(0.0, std)


def tiny_kandinsky5_pipeline(
    words: Iterable[str],
    *,
    text_hidden: int = 32,
    clip_hidden: int = 16,
    transformer: dict | None = None,
    shift: float = 5.0,
    seed: int = 0,
):
    """A randomly initialised ``Kandinsky5T2VPipeline``: a 1-layer Qwen2.5-VL (with a 1-block vision tower that
    text-to-video never runs), a 1-layer CLIP text model, a Kandinsky 5 DiT with one text and one visual block
    (patches 1x2x2, 2 heads of 16, ``visual_cond`` as the released 5s checkpoints), an ``AutoencoderKLHunyuanVideo``
    with 4 latent channels downsampling 4x in space and time (released: 16 channels, 8x and 4x), and
    ``FlowMatchEulerDiscreteScheduler(shift=5)`` (the released T2V Lite scheduler's shift). The modulations are drawn
    at random (``randomise_modulations``)."""
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline,
                           Kandinsky5Transformer3DModel)
    from transformers import (CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor)

    words = list(words)
    torch.manual_seed(seed)
    chat = chat_word_tokenizer(words, 512, extra_special=QWEN_VL_SPECIAL)
    from tokenizers import AddedToken

    chat.add_tokens([AddedToken(TEMPLATE_PHRASE, normalized=False, special=True)], special_tokens=True)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=chat,
                                 video_processor=Qwen2VLVideoProcessor())
    heads = 2
    head_dim = text_hidden // heads
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(chat), hidden_size=text_hidden, intermediate_size=text_hidden * 2, num_hidden_layers=1,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "mrope_section": [head_dim // 8, head_dim // 8, head_dim // 4],
                             "rope_theta": 1000000.0},
            pad_token_id=0, bos_token_id=None, eos_token_id=1,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=text_hidden),
    ))
    clip_tokenizer = word_level_tokenizer(words, 77)
    clip = CLIPTextModel(clip_config(len(clip_tokenizer), clip_hidden, clip_hidden, 1, 2, 77))
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 8), layers_per_block=1,
        norm_num_groups=4, spatial_compression_ratio=4, temporal_compression_ratio=4)
    settings = dict(
        in_visual_dim=4, out_visual_dim=4, in_text_dim=text_hidden, in_text_dim2=clip_hidden, time_dim=16,
        patch_size=(1, 2, 2), model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1, axes_dims=(4, 6, 6),
        visual_cond=True,
    )
    settings.update(transformer or {})
    dit = Kandinsky5Transformer3DModel(**settings)
    randomise_modulations(dit)
    pipe = Kandinsky5T2VPipeline(
        transformer=dit, vae=vae, text_encoder=text_encoder,
        tokenizer=processor, text_encoder_2=clip, tokenizer_2=clip_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
    )
    check_template_prefix(pipe)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe
