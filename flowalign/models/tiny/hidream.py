"""A small real HiDream-I1 pipeline: two CLIPs, a T5 and a Llama encoder, a 1+1-block MoE transformer, a VAE."""

from __future__ import annotations

from typing import Iterable

import torch

from .components import clip_config, in_eval_mode, t5_encoder, tiny_autoencoder_kl
from .tokenizers import word_level_tokenizer


def tiny_hidream_pipeline(words: Iterable[str], *, max_length: int = 12, seed: int = 0):
    """A randomly initialised ``HiDreamImagePipeline``: two CLIPs, a T5 and a 2-layer Llama, a 1+1-block MoE
    transformer (3 routed experts, 2 active per token) and a VAE.

    The transformer's ``max_resolution`` is 16x16 latents: the pipeline's fixed area is 32x32 pixels
    (``default_sample_size`` 16, which the adapter also sets on a loaded pipeline from ``max_resolution``).
    ``llama_layers`` [0, 1] feed the two blocks; the Llama tokenizer pads with EOS, as the pipeline sets it.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import CLIPTextModelWithProjection, LlamaConfig, LlamaForCausalLM

    words = list(words)
    torch.manual_seed(seed)
    tokenizers = [word_level_tokenizer(words, max_length) for _ in range(4)]
    vocab = len(tokenizers[0])
    clip = clip_config(vocab, 32, 16, 1, 4, max_length)
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
        vae=tiny_autoencoder_kl(4),
        text_encoder=CLIPTextModelWithProjection(clip),
        tokenizer=tokenizers[0],
        text_encoder_2=CLIPTextModelWithProjection(clip),
        tokenizer_2=tokenizers[1],
        text_encoder_3=t5_encoder(vocab, 32, 1, 4),
        tokenizer_3=tokenizers[2],
        text_encoder_4=LlamaForCausalLM(llama),
        tokenizer_4=tokenizers[3],
        transformer=transformer,
    )
    pipe.default_sample_size = 16
    in_eval_mode(pipe)
    return pipe
