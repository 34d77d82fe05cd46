"""SANA adapter: a Gemma2 text encoder with its attention mask, a linear-attention DiT, a DC-AE VAE.

Conventions (``diffusers.SanaPipeline``):

* latents ``[B, C, H/s, W/s]`` (``s`` the DC-AE's downsampling, 32 for the released models), not packed: the
  transformer patches them itself (``patch_size`` 1 in the released models); the pipeline keeps them in fp32 and casts
  to the transformer's dtype for each forward pass, so ``prepare_noise`` draws fp32 noise by default;
* time: the transformer takes ``1000 sigma * timestep_scale`` (``timestep_scale`` from its config: 1 for SANA,
  other values for distilled variants); the velocity's sign is the scheduler's (no flip), returned in fp32;
* text: Gemma2's last hidden state; prompts are lower-cased and stripped (the pipeline's ``clean_caption=False``
  preprocessing), padded on the right to ``max_sequence_length``; of the tokens the pipeline keeps token 0 plus the
  last ``max_sequence_length - 1`` (which is all of them unless a ``complex_human_instruction`` is prefixed);
  ``mask`` is the tokenizer's attention mask, passed as ``encoder_attention_mask``;
* ``complex_human_instruction``: the pipeline's ``__call__`` prefixes a long prompt-enhancing instruction by default;
  this adapter does not (``None``, as ``encode_prompt``'s default): pass the same list to the adapter to match a
  pipeline call that uses one;
* CFG: one batched pass over ``[negative, positive]``, ``uncond + scale * (text - uncond)`` in fp32;
* VAE: an ``AutoencoderDC``, deterministic (no posterior): ``decode`` divides by its ``scaling_factor`` (it has no
  shift factor), ``encode_images`` multiplies its encoding by it.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, FlowModel, guided, register_model_family, require_negative

# Every attention projection of a SANA block: the linear self-attention (attn1) and the cross-attention (attn2).
SANA_ATTENTION_TARGETS = tuple(f"{attn}.{proj}" for attn in ("attn1", "attn2")
                               for proj in ("to_q", "to_k", "to_v", "to_out.0"))


def sana_max_sequence_length(pipe) -> int:
    """The SANA pipelines' Gemma2 token limit: 300, or the tokenizer's own limit when smaller."""
    tokenizer = getattr(pipe, "tokenizer", None)
    return min(300, tokenizer.model_max_length) if tokenizer is not None else 300


def sana_text_cond(model: FlowModel, prompts: Sequence[str], negative_prompts: Sequence[str] | None) -> Cond:
    """The ``Cond`` of ``prompts`` (and ``negative_prompts``) through ``model.pipe.encode_prompt``, which
    ``SanaPipeline`` and ``SanaVideoPipeline`` share: Gemma2 embeddings with their attention masks, the adapter's
    ``complex_human_instruction`` prefixed to the prompts (never to the negatives, as the pipelines do).

    Args:
        model: a SANA adapter (``pipe``, ``device``, ``max_sequence_length``, ``complex_human_instruction``).
        prompts: the batch's prompts (a single string is one prompt).
        negative_prompts: one negative prompt per prompt, or None.

    Returns:
        The ``Cond`` with ``embeds`` and ``mask`` (and their negatives when given).
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    with_negative = negative_prompts is not None
    embeds, mask, neg_embeds, neg_mask = model.pipe.encode_prompt(
        prompts,
        do_classifier_free_guidance=with_negative,
        negative_prompt=list(negative_prompts) if with_negative else "",
        device=model.device,
        max_sequence_length=model.max_sequence_length,
        complex_human_instruction=model.complex_human_instruction,
    )
    return Cond(embeds, mask=mask, negative_embeds=neg_embeds, negative_mask=neg_mask)


def sana_velocity(model: FlowModel, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0,
                  timestep_scale: float | None = None) -> Tensor:
    """The SANA pipelines' velocity: ``transformer(x, 1000 sigma [* timestep_scale], text, mask)`` in fp32; with CFG
    one batched pass over ``[negative, positive]`` and ``uncond + scale * (text - uncond)``; a learned-sigma head's
    first half. ``SanaPipeline`` and ``SanaVideoPipeline`` run the same loop (the video transformer has no
    ``timestep_scale``: None multiplies by nothing).

    Args:
        model: a SANA adapter.
        x: latents ``[B, C, ...]``.
        sigma: the noise level, a scalar or one per row.
        cond: the rows' conditioning (``sana_text_cond``).
        guidance_scale: classifier-free guidance; 1 is none.
        timestep_scale: the transformer config's ``timestep_scale``, or None.

    Returns:
        The velocity, fp32, shaped as ``x``.
    """
    batch = x.shape[0]
    hidden, embeds, mask = x, cond.embeds, cond.mask
    timestep = model.timestep(sigma, batch)
    cfg = model.uses_cfg(guidance_scale)
    if cfg:
        require_negative(cond, guidance_scale)
        hidden = torch.cat([hidden, hidden])
        embeds = torch.cat([cond.negative_embeds, embeds])
        mask = torch.cat([cond.negative_mask, mask])
        timestep = torch.cat([timestep, timestep])
    if timestep_scale is not None:
        timestep = timestep * timestep_scale
    v = model.run_transformer(
        hidden_states=hidden.to(dtype=model.dtype),
        encoder_hidden_states=embeds.to(dtype=model.dtype),
        encoder_attention_mask=mask,
        timestep=timestep,
        return_dict=False,
    )[0].float()
    if cfg:
        uncond, text = v.chunk(2)
        v = guided(text, uncond, guidance_scale)
    config = model.transformer.config
    if config.out_channels // 2 == config.in_channels:
        v = v.chunk(2, dim=1)[0]  # a learned-sigma head: the velocity is the first half
    return v


@register_model_family("sana")
class SanaModel(FlowModel):
    """Adapter over ``diffusers.SanaPipeline``."""

    family = "sana"
    # SanaLinearAttnProcessor2_0: ReLU(q) (ReLU(k)^T v) / ReLU(q) sum ReLU(k), matmuls over the whole sequence, not a
    # dispatched softmax attention; GLUMBConv reshapes the tokens to the latent grid for a 3x3 depthwise convolution.
    context_parallel_refusal = ("its self-attention is linear attention (SanaLinearAttnProcessor2_0: key-value sums "
                                "over the whole sequence in its own matmuls, not diffusers' attention dispatcher), "
                                "and its feed-forward's 3x3 convolution needs each token's neighbours on the latent "
                                "grid")
    pipeline_class_name = "SanaPipeline"
    lora_targets = SANA_ATTENTION_TARGETS

    def __init__(self, pipe, *, max_sequence_length: int | None = None,
                 complex_human_instruction: Sequence[str] | None = None):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        self.complex_human_instruction = list(complex_human_instruction) if complex_human_instruction else None

    def default_max_sequence_length(self) -> int:
        return sana_max_sequence_length(self.pipe)

    @property
    def default_image_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * self.vae_scale_factor
        return size, size

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        """Gemma2 embeddings and attention masks through the pipeline's ``encode_prompt`` (``sana_text_cond``)."""
        return sana_text_cond(self, prompts, negative_prompts)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(x, 1000 sigma * timestep_scale, text, mask)`` in fp32; CFG batched as the pipeline's
        (``sana_velocity``)."""
        return sana_velocity(self, x, sigma, cond, guidance_scale, self.transformer.config.timestep_scale)

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """fp32 noise by default, as the pipeline's ``prepare_latents`` (whatever the transformer's dtype)."""
        return super().prepare_noise(batch, image_size, generator=generator, dtype=dtype or torch.float32)

    @property
    def image_multiple(self) -> int:
        """The DC-AE's downsampling times the transformer's patch size."""
        return self.vae_scale_factor * self.transformer.config.patch_size

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        return {}

    def decode(self, latents: Tensor) -> Tensor:
        """``vae.decode(latents / scaling_factor)`` mapped to [0, 1], as the pipeline's postprocess (no shift)."""
        vae = self.pipe.vae
        return self.decode_vae_latents(latents.to(vae.dtype) / vae.config.scaling_factor)

    def encode_images(self, images: Tensor, *, generator=None, sample: bool = False, dtype=None) -> Tensor:
        """Images in [0, 1] to latents: ``vae.encode(2 x - 1).latent * scaling_factor`` (SANA's ControlNet and
        Sprint img2img pipelines' encoding). The DC-AE is deterministic: there is no posterior to sample, so
        ``sample`` and ``generator`` change nothing. In ``dtype`` (default fp32, as ``prepare_noise``)."""
        self._check_images(images)
        vae = self.pipe.vae
        pixels = (2.0 * images.float() - 1.0).to(device=vae.device, dtype=vae.dtype)
        latents = vae.encode(pixels).latent * vae.config.scaling_factor
        return self.checked_latents(latents, images, dtype or torch.float32)
