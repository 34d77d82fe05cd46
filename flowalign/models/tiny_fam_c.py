"""Tiny in-process CogView4, HiDream and FLUX.2-dev pipelines: text encoders from transformers configs, word-level
tokenizers (``word_level_tokenizer``), no hub access. Sizes are the smallest the pipelines allow (32 px images)."""

from __future__ import annotations

from typing import Iterable

import torch

from .tiny import word_level_tokenizer


def _eval(pipe):
    """Every module in eval mode, as ``from_pretrained`` leaves them (HiDream's transformer changes its output layout
    and its MoE path in train mode); no progress bars."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    pipe.set_progress_bar_config(disable=True)


def _tiny_vae(latent_channels: int, *, scaling_factor: float = 1.5, shift_factor: float | None = 0.06):
    """A two-level ``AutoencoderKL`` (downsampling 2) with ``latent_channels`` channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


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
        vae=_tiny_vae(4, scaling_factor=1.5, shift_factor=None),
        transformer=transformer,
        scheduler=scheduler,
    )
    _eval(pipe)
    return pipe


def tiny_hidream_pipeline(words: Iterable[str], *, max_length: int = 12, seed: int = 0):
    """A randomly initialised ``HiDreamImagePipeline``: two CLIPs, a T5 and a 2-layer Llama, a 1+1-block MoE
    transformer (3 routed experts, 2 active per token) and a VAE.

    The transformer's ``max_resolution`` is 16x16 latents: the pipeline's fixed area is 32x32 pixels
    (``default_sample_size`` 16, which the adapter also sets on a loaded pipeline from ``max_resolution``).
    ``llama_layers`` [0, 1] feed the two blocks; the Llama tokenizer pads with EOS, as the pipeline sets it.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM

    from .tiny import _clip_config, _t5_encoder

    words = list(words)
    torch.manual_seed(seed)
    tokenizers = [word_level_tokenizer(words, max_length) for _ in range(4)]
    vocab = len(tokenizers[0])
    clip = _clip_config(vocab, 32, 16, 1, 4, max_length)
    llama = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=tokenizers[3].eos_token_id,
        bos_token_id=0,
        eos_token_id=tokenizers[3].eos_token_id,
        attn_implementation="eager",
    )
    transformer = HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        caption_channels=[32, llama.hidden_size],
        text_emb_dim=2 * clip.projection_dim,
        num_routed_experts=3,
        num_activated_experts=2,
        axes_dims_rope=(8, 4, 4),
        max_resolution=(16, 16),
        llama_layers=[0, 1],
    )
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_tiny_vae(4),
        text_encoder=CLIPTextModelWithProjection(clip),
        tokenizer=tokenizers[0],
        text_encoder_2=CLIPTextModelWithProjection(clip),
        tokenizer_2=tokenizers[1],
        text_encoder_3=_t5_encoder(vocab, 32, 1, 4),
        tokenizer_3=tokenizers[2],
        text_encoder_4=LlamaForCausalLM(llama),
        tokenizer_4=tokenizers[3],
        transformer=transformer,
    )
    pipe.default_sample_size = 16
    _eval(pipe)
    return pipe


# A Mistral-style chat template over content lists (``[{"type": "text", "text": ...}]``), as FLUX.2 formats its
# prompts: the system message inside [SYSTEM_PROMPT] ... [/SYSTEM_PROMPT], each user turn inside [INST] ... [/INST].
MISTRAL_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -%}"
    "{%- if message['role'] == 'system' -%}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{%- elif message['role'] == 'user' -%}[INST]{{ text }}[/INST]"
    "{%- else -%}{{ text }}{%- endif -%}"
    "{%- endfor -%}"
)
MISTRAL_STYLE_SPECIAL_TOKENS = ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]")


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
    _eval(pipe)
    return pipe
