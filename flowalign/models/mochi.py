"""Mochi text-to-video adapter (``diffusers.MochiPipeline``): a T5 text encoder with its mask, an asymmetric DiT, the
Mochi VAE (8x space, 6x time).

Conventions (``MochiPipeline.__call__``):

* latents ``[B, 12, f, h, w]``, ``f = (num_frames - 1) / 6 + 1``, ``h, w`` the frame size over 8 (the pipeline's
  fixed ``vae_temporal_scale_factor`` and ``vae_spatial_scale_factor``); noise is drawn in fp32 and cast to the
  text embeddings' dtype; the transformer patches 2x2 itself;
* time runs the other way: the pipeline builds a linear-quadratic schedule (``linear_quadratic_schedule(n, 0.025)``,
  1 down to 0.025 linearly over the first half of the steps, then quadratically) and the released scheduler
  (``FlowMatchEulerDiscreteScheduler(invert_sigmas=True)``) inverts it: ``s_inv = 1 - s`` ascending from 0 to a
  terminal 1, the transformer taking ``1000 s_inv`` and predicting ``data - noise``, stepped by
  ``x + (s_inv' - s_inv) out``. flowalign's flow time is ``sigma = 1 - s_inv`` (noise at 1, data at 0) and its
  velocity ``v = -out``: ``1 - s_inv`` is exact in fp32 for every ``s_inv`` the scheduler makes (it is itself
  ``1 - s`` of an fp32 ``s``, and ``1 - x`` is exact on [1/2, 1] by Sterbenz), so ``(sigma' - sigma) v`` is bitwise the
  scheduler's ``(s_inv' - s_inv) out`` and an ODE rollout is the pipeline's bit for bit. A scheduler without
  ``invert_sigmas`` is taken as it is (``sigma`` its sigmas, ``v = out``, the transformer's time ``1000 sigma``);
* text: T5's last hidden state, computed with the attention mask, padded to ``max_sequence_length`` (256), its mask
  passed as ``encoder_attention_mask``; with the pipeline's ``force_zeros_for_empty_prompt`` an empty (negative)
  prompt is all-zero ids and mask (``encode_prompt`` does it);
* CFG: one batched pass over ``[negative, positive]``, ``uncond + scale * (text - uncond)`` in fp32;
* the adapter freezes the transformer when it wraps the pipeline (``requires_grad_(False)``): torch computes the
  linear layer over Mochi's non-contiguous attention output by a different kernel path when the weight requires grad
  (1 ulp apart), so frozen is the state in which the pipeline, the adapter and a LoRA at zero agree bit for bit (a
  full fine-tune's trained weights require grad again: its frozen reference copy then agrees within 1 ulp only);
* VAE: ``AutoencoderKLMochi``, normalised by its config's ``latents_mean`` / ``latents_std`` and ``scaling_factor``:
  the pipeline decodes ``x std / scaling_factor + mean``; no Mochi pipeline encodes, so ``encode_videos`` is that
  map's inverse, ``(z - mean) * scaling_factor / std``, on the posterior's mode.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, guided, register_model_family, require_negative
from .video import VideoFlowModel

# Every attention and MLP projection of a Mochi block: the joint attention's visual and text projections and both
# streams' feed-forward layers (the last block has no text output projection or text feed-forward).
MOCHI_LORA_TARGETS = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn1.add_q_proj", "attn1.add_k_proj", "attn1.add_v_proj", "attn1.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)

# The pipeline's ``threshold_noise`` of its linear-quadratic schedule.
MOCHI_THRESHOLD_NOISE = 0.025


@register_model_family("mochi")
class MochiModel(VideoFlowModel):
    """Adapter over ``diffusers.MochiPipeline`` (Mochi 1 T2V)."""

    family = "mochi"
    context_parallel_refusal = ("its attention processor (MochiAttnProcessor2_0) calls scaled_dot_product_attention "
                                "itself, one sample at a time over that sample's unpadded text, not through "
                                "diffusers' attention dispatcher, so a split sequence would attend only to each "
                                "process's own tokens")
    pipeline_class_name = "MochiPipeline"
    lora_targets = MOCHI_LORA_TARGETS
    default_num_frames = 7

    def __init__(self, pipe, **options):
        super().__init__(pipe, **options)
        # Frozen as an inference pipeline is: the attention output Mochi projects is not contiguous, and torch's
        # matmul folds such an input differently when the weight requires grad, so the same weights would give
        # velocities 1 ulp apart before and after LoRA freezes them. ``add_lora`` / ``make_full_finetune`` set what
        # trains.
        if pipe.transformer is not None:
            pipe.transformer.requires_grad_(False)

    @property
    def temporal_compression(self) -> int:
        return int(self.pipe.vae_temporal_scale_factor)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_spatial_scale_factor)

    @property
    def default_image_size(self) -> tuple[int, int]:
        """480x848, the pipeline's defaults."""
        return int(self.pipe.default_height), int(self.pipe.default_width)

    @property
    def image_multiple(self) -> int:
        return self.vae_scale_factor * int(self.pipe.patch_size)

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return min(256, tokenizer.model_max_length) if tokenizer is not None else 256

    @property
    def inverted(self) -> bool:
        """Whether the scheduler inverts its sigmas (the released Mochi scheduler does)."""
        return bool(self.scheduler.config.get("invert_sigmas", False))

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """fp32 noise cast to the transformer's dtype, as ``MochiPipeline.prepare_latents``."""
        noise = super().prepare_noise(batch, image_size, generator=generator, dtype=torch.float32)
        return noise.to(dtype or self.dtype)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """T5 embeddings and masks through the pipeline's ``encode_prompt``. Mochi takes no condition images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        return self.masked_pipeline_cond(prompts, negative_prompts)

    def timestep(self, sigma: float | Tensor, batch: int) -> Tensor:
        """The transformer's time: ``1000 (1 - sigma)`` with an inverting scheduler (``1000 sigma`` without), one per
        row, in the transformer's dtype as the pipeline casts it."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        if self.inverted:
            sigma = 1.0 - sigma
        t = sigma * self.scheduler.config.num_train_timesteps
        return (t.expand(batch) if t.ndim == 0 else t).to(self.dtype)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``-transformer(x, 1000 (1 - sigma), text, mask)`` in fp32 (the sign flipped with the scheduler's inverted
        time); CFG batched as the pipeline's."""
        batch = x.shape[0]
        hidden, embeds, mask = x, cond.embeds, cond.mask
        timestep = self.timestep(sigma, batch)
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            require_negative(cond, guidance_scale)
            hidden, timestep = torch.cat([hidden, hidden]), torch.cat([timestep, timestep])
            embeds, mask = torch.cat([cond.negative_embeds, embeds]), torch.cat([cond.negative_mask, mask])
        out = self.run_transformer(hidden_states=hidden.to(self.dtype), encoder_hidden_states=embeds,
                                   timestep=timestep, encoder_attention_mask=mask, return_dict=False)[0].float()
        if cfg:
            uncond, text = out.chunk(2)
            out = guided(text, uncond, guidance_scale)
        return -out if self.inverted else out

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """The pipeline's ``linear_quadratic_schedule(num_steps, 0.025)`` as the scheduler's ``sigmas``."""
        from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

        if num_steps < 2:
            raise ValueError(f"Mochi samples with at least 2 steps, got {num_steps}: its linear-quadratic schedule "
                             "spends half the steps on each part (the pipeline fails on 1 step too)")
        return {"sigmas": np.array(linear_quadratic_schedule(num_steps, MOCHI_THRESHOLD_NOISE))}

    def sigmas(self, num_steps: int, image_size=None) -> Tensor:
        """The pipeline's schedule in flowalign's flow time: the scheduler's sigmas, ``1 - s_inv`` when it inverts
        them (from 1 down to the terminal 0, exact: see the module docstring)."""
        sigmas = super().sigmas(num_steps, image_size)
        return 1.0 - sigmas if self.inverted else sigmas

    def vae_statistics(self, latents: Tensor) -> tuple[Tensor, Tensor, float] | None:
        """The VAE config's ``latents_mean``, ``latents_std`` as ``[1, C, 1, 1, 1]`` in ``latents``' dtype and device
        and its ``scaling_factor`` (mean and std None when the config has none, as the pipeline checks)."""
        config = self.pipe.vae.config
        mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
        if mean is None or std is None:
            return None, None, config.scaling_factor
        channels = len(mean)
        mean = torch.tensor(mean).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
        std = torch.tensor(std).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
        return mean, std, config.scaling_factor

    def to_vae_space(self, latents: Tensor) -> Tensor:
        """``x std / scaling_factor + mean`` (or ``x / scaling_factor``), as the pipeline, in the latents' dtype."""
        mean, std, scale = self.vae_statistics(latents)
        latents = latents / scale if mean is None else latents * std / scale + mean
        return latents.to(self.pipe.vae.dtype)

    def from_vae_space(self, latents: Tensor) -> Tensor:
        """``to_vae_space``'s inverse: ``(z - mean) * scaling_factor / std`` (or ``z * scaling_factor``)."""
        mean, std, scale = self.vae_statistics(latents)
        return latents * scale if mean is None else (latents - mean) * scale / std
