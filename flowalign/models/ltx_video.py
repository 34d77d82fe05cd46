"""LTX-Video text-to-video adapter (``diffusers.LTXPipeline``): a T5 text encoder with its mask, a 3D DiT over packed
tokens, a causal video VAE with per-channel statistics.

Conventions (``LTXPipeline.__call__``):

* latents: the adapter keeps diffusers' unpacked ``[B, C, f, h, w]`` (``f = (num_frames - 1) / 8 + 1``, ``h, w`` the
  frame size over 32 for the released VAE); the pipeline packs them into tokens ``[B, f h w, C]`` (its
  ``_pack_latents``, patch 1x1x1 in the released models) and keeps them packed through the loop, so ``velocity``
  packs before the transformer and unpacks after (a permutation: the Euler step is elementwise, so parity is
  bitwise); the pipeline draws fp32 noise ``[B, C, f, h, w]`` before packing, so ``prepare_noise`` draws fp32 noise;
* sigmas: ``linspace(1, 1 / n, n)`` shifted by ``mu`` from the *video* token count ``f h w`` (diffusers'
  ``calculate_shift`` with the scheduler config's ``base/max_image_seq_len`` and ``base/max_shift``), then the
  terminal 0; the released scheduler (``FlowMatchEulerDiscreteScheduler``, ``use_dynamic_shifting``) takes ``mu``;
* time: the transformer takes the scheduler's ``1000 sigma`` for every row; the velocity's sign is the scheduler's;
  it also takes the latent grid ``(f, h, w)`` and ``rope_interpolation_scale = (t / frame_rate, s, s)``
  (``frame_rate`` 25, the pipeline's default; an adapter option);
* text: T5's last hidden state padded to ``max_sequence_length`` (128 by default) with its boolean mask, passed as
  ``encoder_attention_mask``;
* CFG: one batched pass over ``[negative, positive]``, ``uncond + scale * (text - uncond)`` in fp32
  (``guidance_rescale`` 0, the pipeline's default);
* VAE: ``AutoencoderKLLTXVideo`` with ``latents_mean`` / ``latents_std`` *buffers* (not config values) and the config's
  ``scaling_factor``: ``z = (x - mean) * scaling_factor / std`` (``LTXPipeline._normalize_latents``) and its inverse
  before decoding. Decoders with ``timestep_conditioning`` (LTX-Video 0.9.1 and later) take a decode timestep and
  mix in noise first: ``x = (1 - scale) x + scale * noise`` with ``decode_timestep`` 0 and ``decode_noise_scale``
  None (= ``decode_timestep``), the pipeline's defaults, so by default the decoder sees timestep 0 and no noise. The
  released 0.9.1+ model cards sample with ``decode_timestep=0.03, decode_noise_scale=0.025``: pass them as adapter
  options (``decode_timestep``, ``decode_noise_scale``); the noise is then drawn from ``decode_generator`` (None:
  torch's global generator), which the pipeline draws from its own generator after the denoising loop.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, guided, register_model_family, require_negative
from .video import VideoFlowModel

# Every attention and MLP projection of an LTX-Video block: self-attention, cross-attention and the feed-forward.
LTX_LORA_TARGETS = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2",
)


@register_model_family("ltx_video")
class LTXVideoModel(VideoFlowModel):
    """Adapter over ``diffusers.LTXPipeline`` (LTX-Video T2V).

    Args:
        pipe: the ``LTXPipeline``.
        frame_rate: the frame rate the transformer's RoPE is scaled by (the pipeline's ``frame_rate``, 25).
        decode_timestep: the decoder's timestep (``timestep_conditioning`` VAEs only; the pipeline's default 0).
        decode_noise_scale: the noise mixed into the latents before decoding; None is ``decode_timestep``.
        decode_generator: the generator of that noise (None: torch's global one).
        **options: ``VideoFlowModel``'s (``max_sequence_length``, ``num_frames``, ``vae_batch``, ``vae_tiling``).
    """

    family = "ltx_video"
    pipeline_class_name = "LTXPipeline"
    lora_targets = LTX_LORA_TARGETS
    default_num_frames = 9

    def __init__(self, pipe, *, frame_rate: float = 25, decode_timestep: float = 0.0,
                 decode_noise_scale: float | None = None, decode_generator: torch.Generator | None = None,
                 **options):
        super().__init__(pipe, **options)
        if not frame_rate > 0:
            raise ValueError(f"frame_rate must be positive, got {frame_rate!r}")
        self.frame_rate = frame_rate
        self.decode_timestep = float(decode_timestep)
        self.decode_noise_scale = self.decode_timestep if decode_noise_scale is None else float(decode_noise_scale)
        self.decode_generator = decode_generator

    # --- shapes ---------------------------------------------------------------------------------------------------
    @property
    def temporal_compression(self) -> int:
        return int(self.pipe.vae_temporal_compression_ratio)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_spatial_compression_ratio)

    @property
    def default_image_size(self) -> tuple[int, int]:
        """512x704, the pipeline's defaults."""
        return 512, 704

    @property
    def image_multiple(self) -> int:
        return self.vae_scale_factor * int(self.pipe.transformer_spatial_patch_size)

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return min(128, tokenizer.model_max_length) if tokenizer is not None else 128

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """fp32 noise ``[B, C, f, h, w]`` by default, as ``LTXPipeline.prepare_latents`` draws it before packing."""
        return super().prepare_noise(batch, image_size, generator=generator, dtype=dtype or torch.float32)

    # --- packing --------------------------------------------------------------------------------------------------
    def pack(self, latents: Tensor) -> Tensor:
        """``[B, C, f, h, w]`` to the pipeline's tokens ``[B, N, D]`` (``LTXPipeline._pack_latents``)."""
        return self.pipe._pack_latents(latents, self.pipe.transformer_spatial_patch_size,
                                       self.pipe.transformer_temporal_patch_size)

    def unpack(self, tokens: Tensor, grid: Sequence[int]) -> Tensor:
        """``pack``'s inverse for the latent grid ``(f, h, w)`` (``LTXPipeline._unpack_latents``)."""
        return self.pipe._unpack_latents(tokens, *grid, self.pipe.transformer_spatial_patch_size,
                                         self.pipe.transformer_temporal_patch_size)

    def token_grid(self, latents: Tensor) -> tuple[int, int, int]:
        """The transformer's ``(num_frames, height, width)`` in tokens for latents ``[B, C, f, h, w]``."""
        f, h, w = latents.shape[-3:]
        patch, patch_t = self.pipe.transformer_spatial_patch_size, self.pipe.transformer_temporal_patch_size
        return f // patch_t, h // patch, w // patch

    # --- text -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """T5 embeddings and masks through the pipeline's ``encode_prompt``. LTX-Video T2V takes no condition
        images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        return self.text_cond(prompts, negative_prompts)

    def text_cond(self, prompts: list[str], negative_prompts: Sequence[str] | None) -> Cond:
        """The ``Cond`` of the prompts' (and negatives') T5 embeddings and masks."""
        with_negative = negative_prompts is not None
        embeds, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        if not with_negative:
            return Cond(embeds, mask=mask)
        return Cond(embeds, mask=mask, negative_embeds=negative, negative_mask=negative_mask)

    # --- the transformer ------------------------------------------------------------------------------------------
    def token_timestep(self, timestep: Tensor, latents: Tensor, cond: Cond) -> Tensor:
        """The transformer's timestep for rows ``timestep [B]``: one per row in T2V (the I2V family gives one per
        token)."""
        return timestep

    def transformer_tokens(self, latents: Tensor, cond: Cond) -> Tensor:
        """The latents the transformer sees (the I2V family puts its condition in the first frame)."""
        return latents

    def transformer_velocity(self, latents: Tensor, sigma: float | Tensor, cond: Cond,
                             guidance_scale: float = 1.0) -> Tensor:
        """The transformer's (guided) prediction at ``latents [B, C, f, h, w]``, unpacked, in fp32, as the pipeline's
        loop computes it: tokens, ``1000 sigma``, the text and its mask, the token grid and RoPE scale; CFG as one
        batched pass over ``[negative, positive]``."""
        batch = latents.shape[0]
        grid = self.token_grid(latents)
        tokens = self.pack(self.transformer_tokens(latents, cond))
        timestep = self.token_timestep(self.timestep(sigma, batch), latents, cond)
        embeds, mask = cond.embeds, cond.mask
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            require_negative(cond, guidance_scale)
            tokens, timestep = torch.cat([tokens, tokens]), torch.cat([timestep, timestep])
            embeds, mask = torch.cat([cond.negative_embeds, embeds]), torch.cat([cond.negative_mask, mask])
        t, s = self.temporal_compression, self.vae_scale_factor
        v = self.run_transformer(
            hidden_states=tokens.to(embeds.dtype),
            encoder_hidden_states=embeds,
            timestep=timestep,
            encoder_attention_mask=mask,
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            rope_interpolation_scale=(t / self.frame_rate, s, s),
            return_dict=False,
        )[0].float()
        if cfg:
            uncond, text = v.chunk(2)
            v = guided(text, uncond, guidance_scale)
        return self.unpack(v, grid)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(pack(x), 1000 sigma, text, mask)`` unpacked, fp32; CFG batched as the pipeline's."""
        return self.transformer_velocity(x, sigma, cond, guidance_scale)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """``sigmas = linspace(1, 1 / n, n)`` and ``mu`` from the video token count ``f h w`` (the pipeline's)."""
        height, width = image_size
        tokens = self.latent_frames() * (height // self.vae_scale_factor) * (width // self.vae_scale_factor)
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": self.shift_mu(tokens)}

    # --- the VAE --------------------------------------------------------------------------------------------------
    def vae_statistics(self, latents: Tensor) -> tuple[Tensor, Tensor, float]:
        """The VAE's ``latents_mean`` and ``latents_std`` buffers as ``[1, C, 1, 1, 1]`` in ``latents``' dtype and
        device, and the config's ``scaling_factor``."""
        vae = self.pipe.vae
        mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
        return mean, std, vae.config.scaling_factor

    def to_vae_space(self, latents: Tensor) -> Tensor:
        """``x std / scaling_factor + mean`` (``LTXPipeline._denormalize_latents``) in the transformer's dtype (the
        pipeline's ``prompt_embeds`` dtype), then the VAE's."""
        mean, std, scale = self.vae_statistics(latents)
        return (latents * std / scale + mean).to(self.dtype).to(self.pipe.vae.dtype)

    def from_vae_space(self, latents: Tensor) -> Tensor:
        """``(z - mean) * scaling_factor / std`` (``LTXPipeline._normalize_latents``)."""
        mean, std, scale = self.vae_statistics(latents)
        return (latents - mean) * scale / std

    def decode_vae_latents(self, latents: Tensor) -> Tensor:
        """The VAE's decode as the pipeline calls it: with ``timestep_conditioning`` the decode timestep per video
        and ``(1 - scale) x + scale * noise`` first (both 0 by default: the latents unchanged); then
        ``(x / 2 + 0.5).clamp(0, 1)``, frames first."""
        vae = self.pipe.vae
        timestep = None
        if vae.config.timestep_conditioning:
            batch = latents.shape[0]
            if self.decode_noise_scale:
                noise = torch.randn(latents.shape, generator=self.decode_generator, dtype=latents.dtype,
                                    device="cpu" if self.decode_generator is None else self.decode_generator.device)
                scale = torch.tensor([self.decode_noise_scale] * batch, dtype=latents.dtype,
                                     device=latents.device)[:, None, None, None, None]
                latents = (1 - scale) * latents + scale * noise.to(latents.device)
            timestep = torch.tensor([self.decode_timestep] * batch, dtype=latents.dtype, device=latents.device)
        video = vae.decode(latents.to(vae.dtype), timestep, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
