"""Lumina-Image 2.0 adapter: a Gemma2 text encoder behind a system prompt, flipped time, a negated velocity.

Conventions (``diffusers.Lumina2Pipeline``):

* latents ``[B, C, H/8, W/8]`` (the pipeline fixes the VAE's downsampling at 8), not packed: the transformer patches
  them itself (``patch_size`` 2), so image sides are multiples of 16;
* time: the transformer's time runs the other way, ``1 - sigma`` (``1 - t / 1000`` with ``t = 1000 sigma`` in fp32),
  and it predicts ``noise -> data``: the scheduler's velocity is the transformer's output negated, after CFG;
* sigmas: the pipeline's linear ``sigmas`` with a ``mu`` computed from ``latents.shape[1]``, which for its unpacked
  latents is the channel count, not the image sequence length; ``mu`` only matters with dynamic shifting (the
  released model uses a static shift), and the adapter reproduces it as the pipeline computes it;
* text: the second-to-last hidden state of Gemma2 over ``system_prompt + " <Prompt Start> " + prompt``, padded to
  ``max_sequence_length``, with the tokenizer's attention mask; the system prompt is the pipeline's (``system_prompt``
  overrides it) and, as in the pipeline, negative prompts are encoded without it;
* CFG: two passes, ``uncond + scale * (cond - uncond)``, then with ``cfg_normalization`` (the pipeline's default)
  rescaled to the conditional prediction's norm along the last (latent width) axis; CFG applies at every step, the
  pipeline's default ``cfg_trunc_ratio=1`` (a ratio below 1 switches CFG off for the last steps by step index, which
  a velocity of sigma alone cannot know; it is not offered).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, guided, norm_rescaled, register_model_family, require_negative

# The attention projections of every Lumina2 block (the joint layers and both refiners).
LUMINA2_ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")


@register_model_family("lumina2")
class Lumina2Model(FlowModel):
    """Adapter over ``diffusers.Lumina2Pipeline``."""

    family = "lumina2"
    context_parallel_refusal = ("its attention processor (Lumina2AttnProcessor2_0) calls scaled_dot_product_attention "
                                "itself, not diffusers' attention dispatcher, so a split sequence would attend only "
                                "to each process's own tokens")
    pipeline_class_name = "Lumina2Pipeline"
    lora_targets = LUMINA2_ATTENTION_TARGETS

    def __init__(self, pipe, *, max_sequence_length: int | None = None, system_prompt: str | None = None,
                 cfg_normalization: bool = True):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        self.system_prompt = system_prompt
        self.cfg_normalization = bool(cfg_normalization)

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return min(256, tokenizer.model_max_length) if tokenizer is not None else 256

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        """Gemma2 embeddings and attention masks through the pipeline's ``encode_prompt``."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        with_negative = negative_prompts is not None
        embeds, mask, neg_embeds, neg_mask = self.pipe.encode_prompt(
            prompts,
            do_classifier_free_guidance=with_negative,
            negative_prompt=list(negative_prompts) if with_negative else None,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            system_prompt=self.system_prompt,
        )
        return Cond(embeds, mask=mask, negative_embeds=neg_embeds, negative_mask=neg_mask)

    def model_time(self, sigma: float | Tensor, batch: int) -> Tensor:
        """The transformer's time ``1 - t / 1000`` for ``t = 1000 sigma``: 0 at noise, 1 at data."""
        return 1 - self.timestep(sigma, batch) / self.scheduler.config.num_train_timesteps

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = -transformer(x, 1 - sigma, text)``, with CFG (and its normalisation) before the negation."""
        batch = x.shape[0]
        hidden = x.to(self.dtype)
        timestep = self.model_time(sigma, batch)

        def forward(embeds: Tensor, mask: Tensor) -> Tensor:
            return self.run_transformer(
                hidden_states=hidden,
                timestep=timestep,
                encoder_hidden_states=embeds,
                encoder_attention_mask=mask,
                return_dict=False,
            )[0]

        prediction = forward(cond.embeds, cond.mask)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale)
            combined = guided(prediction, forward(cond.negative_embeds, cond.negative_mask), guidance_scale)
            prediction = norm_rescaled(combined, prediction) if self.cfg_normalization else combined
        return -prediction

    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling (8) times the transformer's patch size."""
        return self.vae_scale_factor * self.transformer.config.patch_size

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor * 2  # as the pipeline's prepare_latents: even latent sides
        return batch, self.transformer.config.in_channels, 2 * (height // scale), 2 * (width // scale)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        # The pipeline's "image_seq_len" is latents.shape[1] of its unpacked latents: the channel count.
        mu = self.shift_mu(self.transformer.config.in_channels)
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}
