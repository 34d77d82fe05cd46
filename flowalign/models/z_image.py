"""Z-Image adapter: Qwen3 chat-templated text features, per-sample token lists, flipped time, negated velocity.

Conventions of ``diffusers.ZImagePipeline`` reproduced here:

* text: the prompt is wrapped in the tokenizer's chat template as one user turn with the generation prompt
  (``enable_thinking=True``), padded to ``max_sequence_length``; the Qwen3 encoder's second-to-last hidden states
  are taken and only the mask's tokens kept, one ``[L_i, D]`` tensor per prompt. ``Cond`` stores them right-padded
  with zeros, ``[B, L, D]``, with the mask; ``velocity`` passes the unpadded list, as the pipeline does (the
  transformer pads text and image tokens itself, with its learned ``cap_pad_token`` / ``x_pad_token``).
* latents: ``[B, C, h, w]``, passed to the transformer as a list of ``[C, 1, h, w]`` (a frame axis); it patchifies
  2x2 itself. The pipeline draws its noise and keeps its latents in fp32 whatever the transformer's dtype, so
  ``prepare_noise`` and ``velocity`` do too.
* time: the model's time runs the other way, ``(1000 - sigma * 1000) / 1000`` in fp32 (1 = clean), and its output
  is the negated velocity: ``velocity`` returns ``-output`` in fp32.
* CFG: the pipeline's ``guidance_scale`` ``g`` means ``cond + g * (cond - uncond)`` with CFG on for ``g > 0``;
  flowalign's ``guidance_scale`` ``s`` is the usual ``uncond + s * (cond - uncond)``, so ``s = g + 1`` and the
  adapter computes the pipeline's form with ``g = s - 1``. Conditional and negative rows go through one forward
  pass of ``2B`` samples, as the pipeline's. ``cfg_normalization`` and ``cfg_truncation`` stay at the pipeline's
  defaults (off).
* VAE: an ``AutoencoderKL`` with ``scaling_factor`` / ``shift_factor``, as SD3's (the base class's decode/encode).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, register_model_family, require_negative

# Attention projections of the main layers and both refiners (noise and context).
Z_IMAGE_ATTENTION_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")


def pad_token_lists(embeds: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Per-prompt ``[L_i, D]`` tensors to zero-padded ``[B, L, D]`` and a bool mask ``[B, L]``."""
    length = max(e.shape[0] for e in embeds)
    padded = embeds[0].new_zeros(len(embeds), length, embeds[0].shape[-1])
    mask = torch.zeros(len(embeds), length, dtype=torch.bool, device=embeds[0].device)
    for row, e in enumerate(embeds):
        padded[row, : e.shape[0]] = e
        mask[row, : e.shape[0]] = True
    return padded, mask


def token_lists(embeds: Tensor, mask: Tensor) -> list[Tensor]:
    """Inverse of ``pad_token_lists``: each row's masked tokens."""
    return [row[keep] for row, keep in zip(embeds, mask.bool())]


@register_model_family("z_image")
class ZImageModel(FlowModel):
    """Adapter over ``diffusers.ZImagePipeline``. Latents ``[B, 16, H/8, W/8]`` in fp32."""

    family = "z_image"
    # ZSingleStreamAttnProcessor dispatches with a key mask, but the transformer refines the image and the caption
    # tokens separately, then builds the joint sequence, its rotary table and its padding mask inside forward
    # (_build_unified_sequence, a method), and hands all three to every main layer: no submodule's input or output
    # carries them once, so the plan format cannot split them together (splitting them at each layer would split the
    # hidden states again).
    context_parallel_refusal = ("its joint image and caption sequence, with its rotary table and padding mask, is "
                                "assembled inside the transformer's forward rather than by a submodule, so diffusers' "
                                "plan format has no boundary at which to split them together")
    pipeline_class_name = "ZImagePipeline"
    lora_targets = Z_IMAGE_ATTENTION_TARGETS

    def default_max_sequence_length(self) -> int:
        return 512  # ZImagePipeline.__call__'s default

    @property
    def default_image_size(self) -> tuple[int, int]:
        return 1024, 1024  # the pipeline's default height and width

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        return self.masked_cond(self._encode, prompts, negative_prompts)

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        # A copy: the pipeline writes the templated text back into the list it is given.
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)
        return pad_token_lists(embeds)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        batch = x.shape[0]
        timestep = (1000 - self.timestep(sigma, batch)) / 1000
        latents = x.to(self.dtype)
        embeds = token_lists(cond.embeds, cond.mask)
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            require_negative(cond, guidance_scale, "on Z-Image means CFG and")
            latents = latents.repeat(2, 1, 1, 1)
            embeds = embeds + token_lists(cond.negative_embeds, cond.negative_mask)
            timestep = timestep.repeat(2)
        outputs = self.run_transformer(x=list(latents.unsqueeze(2).unbind(dim=0)), t=timestep, cap_feats=embeds,
                                       return_dict=False)[0]
        if cfg:
            scale = guidance_scale - 1.0  # the pipeline's guidance_scale
            predictions = []
            for positive, negative in zip(outputs[:batch], outputs[batch:]):
                positive, negative = positive.float(), negative.float()
                predictions.append(positive + scale * (positive - negative))
            prediction = torch.stack(predictions, dim=0)
        else:
            prediction = torch.stack([out.float() for out in outputs], dim=0)
        return -prediction.squeeze(2)

    # --- latents ----------------------------------------------------------------------------------------------------
    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling times the transformer's 2x2 patches."""
        return self.vae_scale_factor * 2

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor * 2
        return batch, self.transformer.in_channels, 2 * (height // scale), 2 * (width // scale)

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """The pipeline draws its initial latents in fp32, whatever the transformer's dtype."""
        return super().prepare_noise(batch, image_size, generator=generator, dtype=dtype or torch.float32)

    def encode_images(self, images, *, generator=None, sample=False, dtype=None) -> Tensor:
        """As the base (``ZImageImg2ImgPipeline``'s VAE path), in fp32 by default like the pipeline's latents."""
        return super().encode_images(images, generator=generator, sample=sample, dtype=dtype or torch.float32)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        _, _, h, w = self.latent_shape(1, image_size)
        # An fp32 torch.linspace, unlike FLUX's fp64 numpy one; mu from the transformer's 2x2 patch count.
        return {"sigmas": get_default_z_image_sigmas(num_steps), "mu": self.shift_mu((h // 2) * (w // 2))}
