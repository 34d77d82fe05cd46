"""Small real Chroma, SANA and Lumina2 pipelines built in-process with word-level tokenizers: no hub access needed.

As ``flowalign.models.tiny``: randomly initialised components from diffusers / transformers configs at tiny widths
and depths, 32 px images, for the adapter contract (tests/test_model_families.py).
"""

from __future__ import annotations

from typing import Iterable

import torch

from .tiny import _t5_encoder, word_level_tokenizer


def _tiny_vae(latent_channels: int, blocks: int = 2):
    """An ``AutoencoderKL`` downsampling by ``2 ** (blocks - 1)``, with FLUX-like scaling and shift factors."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(8,) * (blocks - 1) + (16,),
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.5,
        shift_factor=0.06,
    )


def tiny_chroma_pipeline(words: Iterable[str], *, max_length: int = 12, transformer: dict | None = None, seed: int = 0):
    """A randomly initialised ``ChromaPipeline``: a T5 encoder, a 1+1-block Chroma transformer, a VAE.

    The transformer's approximator (the MLP producing every block's modulation from the timestep) is one layer of
    width 16 over ``approximator_num_channels = 16`` input features.
    """
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

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
        axes_dims_rope=(4, 4, 8),
        approximator_num_channels=16,
        approximator_hidden_dim=16,
        approximator_layers=1,
    )
    transformer_config.update(transformer or {})
    pipe = ChromaPipeline(
        transformer=ChromaTransformer2DModel(**transformer_config),
        vae=_tiny_vae(transformer_config["in_channels"] // 4),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16, max_image_seq_len=256
        ),
        text_encoder=_t5_encoder(len(tokenizer), transformer_config["joint_attention_dim"], 2, 4),
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
