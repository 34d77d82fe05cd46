"""Chroma adapter: FLUX's 2x2 packing and position ids, a T5 encoder only, a text attention mask, true CFG.

Conventions (``diffusers.ChromaPipeline``):

* latents ``[B, C, h, w]`` here, packed inside ``velocity`` into FLUX's ``[B, (h/2)(w/2), 4C]`` token sequence;
  image position ids ``(0, row, col)`` per 2x2 patch, text ids all zeros, as FLUX's;
* time: the transformer takes ``t / 1000`` with ``t = 1000 sigma`` rounded to the latents' dtype (it multiplies by
  1000 again inside); the velocity's sign is the scheduler's (no flip);
* text: T5 hidden states, no CLIP and no pooled projection; no guidance embedding (Chroma's approximator takes a
  guidance of 0 internally);
* mask: the T5 padding mask with one padding token left unmasked (the pipeline's ``mask_indices <= seq_lengths``),
  in the text encoder's dtype, followed by ones for the image tokens (the pipeline's ``_prepare_attention_mask``);
* CFG: a ``guidance_scale`` above 1 is true classifier-free guidance against negative prompts, two forward passes,
  ``uncond + scale * (cond - uncond)``, each pass with its own mask.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, guided, register_model_family, require_negative
from .flux import FluxModel, pack_latents, unpack_latents


@register_model_family("chroma")
class ChromaModel(FluxModel):
    """Adapter over ``diffusers.ChromaPipeline`` (FLUX's layout and LoRA targets, T5 only, masked text, true CFG)."""

    family = "chroma"
    # FluxAttnProcessor dispatches, but ChromaTransformerBlock / ChromaSingleTransformerBlock turn the [text, image]
    # padding mask into mask[:, None, None, :] * mask[:, None, :, None], a [B, 1, S, S] mask over the tokens a process
    # holds; diffusers' Ulysses attention gathers a key mask ([..., S_local]) only, and its ring applies one mask to
    # every process's keys, so the padded text cannot be masked under a split. Measured with FLUX's diffusers plan on
    # 2 gloo processes, the tiny Chroma: one padded text token puts the output 1.7e-2 off one process's, with no
    # error (the whole-sequence mask lands on the exchanged tokens in another order); no padding, 1.4e-7.
    context_parallel_refusal = ("its blocks turn the text padding mask into a query-by-key mask over the joint text "
                                "and image sequence, and diffusers' Ulysses and ring attention can only carry a key "
                                "mask across a split sequence")
    pipeline_class_name = "ChromaPipeline"

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return min(512, tokenizer.model_max_length) if tokenizer is not None else 512

    @property
    def guidance_embeds(self) -> bool:
        return False

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        """T5 embeddings and the pipeline's attention mask; the negatives' when ``negative_prompts`` are given."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        with_negative = negative_prompts is not None
        embeds, text_ids, mask, neg_embeds, _, neg_mask = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            device=self.device,
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
        )
        return Cond(embeds, text_ids=text_ids, mask=mask, negative_embeds=neg_embeds, negative_mask=neg_mask)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        batch, _, h, w = x.shape
        tokens = pack_latents(x.to(self.dtype))
        image_ids = self.pipe._prepare_latent_image_ids(batch, h // 2, w // 2, self.device, self.dtype)
        timestep = self.timestep(sigma, batch).to(self.dtype) / 1000

        def forward(embeds: Tensor, mask: Tensor | None) -> Tensor:
            attention_mask = self.pipe._prepare_attention_mask(batch, tokens.shape[1], self.dtype, mask)
            return self.run_transformer(
                hidden_states=tokens,
                timestep=timestep,
                encoder_hidden_states=embeds,
                txt_ids=cond.text_ids,
                img_ids=image_ids,
                attention_mask=attention_mask,
                return_dict=False,
            )[0]

        v = forward(cond.embeds, cond.mask)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale, "on Chroma is true CFG and")
            v = guided(v, forward(cond.negative_embeds, cond.negative_mask), guidance_scale)
        return unpack_latents(v, h, w)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """FLUX's ``mu`` and linear sigmas; unlike FLUX, Chroma passes its sigmas whatever ``use_flow_sigmas`` says."""
        kwargs = super().scheduler_kwargs(num_steps, image_size)
        kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        return kwargs
