"""FLUX.2 adapters: the transformer side shared by the FLUX.2 pipelines, and FLUX.2-Klein's Qwen3 text side.

Conventions of ``diffusers.Flux2KleinPipeline`` (and ``Flux2Pipeline``) reproduced here:

* latents: the flow lives in the VAE's latent space patchified 2x2 and normalised per channel by the VAE's
  batch-norm statistics, ``[B, 4 z, H/16, W/16]`` (``in_channels`` of the transformer): noise is drawn in that shape,
  and that is the adapter's ``[B, C, h, w]`` layout. ``velocity`` packs it as ``[B, h w, C]`` tokens (row-major, no
  further patching) with 4-axis position ids ``(t, h, w, l) = (0, i, j, 0)``; text tokens get ``(0, 0, 0, k)``.
  The pipeline's ``output_type="latent"`` result is the VAE's space: ``x * sqrt(running_var + eps) + running_mean``,
  then unpatchified to ``[B, z, H/8, W/8]`` (``to_vae_latents``); ``decode`` and ``encode_images`` go through it.
* time: the transformer takes ``sigma * 1000`` rounded to the latents' dtype, divided by 1000; velocity sign as the
  scheduler's. The shift ``mu`` is FLUX.2's empirical one, which depends on the image length and the step count.
* Klein text: the prompt is one chat user turn with the generation prompt and ``enable_thinking=False``, padded to
  ``max_sequence_length`` (no attention mask: every position goes to the transformer); the features are the Qwen3
  hidden states of ``text_encoder_out_layers`` (9, 18, 27 of Qwen3's 36) concatenated per token.
* Klein CFG: ``uncond + s * (cond - uncond)`` against the empty prompt for ``s > 1``, unless the pipeline is a
  distilled one (``is_distilled``), which takes no guidance. No guidance embedding.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, register_model_family
from .sd3 import JOINT_ATTENTION_TARGETS

# The double-stream blocks' joint attention and the single-stream blocks' fused QKV (+ MLP input) projection.
FLUX2_ATTENTION_TARGETS = JOINT_ATTENTION_TARGETS + ("attn.to_qkv_mlp_proj",)

# Flux2KleinPipeline's default text_encoder_out_layers: a quarter, a half and three quarters of Qwen3's 36 layers.
KLEIN_OUT_LAYERS = (9, 18, 27)


def klein_out_layers(depth: int) -> tuple[int, ...]:
    """The pipeline's default layers where the encoder is deep enough (every released Klein: 36 layers), else the same
    fractions of ``depth`` (a small test encoder)."""
    if depth >= max(KLEIN_OUT_LAYERS):
        return KLEIN_OUT_LAYERS
    return tuple(max(1, round(depth * k / 4)) for k in (1, 2, 3))


class Flux2Base(FlowModel):
    """The transformer side of the FLUX.2 pipelines: packing, position ids, timestep, BN latent normalisation,
    the empirical shift. Subclasses give ``encode`` and ``_guidance``/CFG."""

    lora_targets = FLUX2_ATTENTION_TARGETS

    def default_max_sequence_length(self) -> int:
        return min(512, self.pipe.tokenizer.model_max_length)

    # --- the transformer ---------------------------------------------------------------------------------------------
    def _forward(self, tokens: Tensor, timestep: Tensor, embeds: Tensor, image_ids: Tensor, guidance) -> Tensor:
        text_ids = self.pipe._prepare_text_ids(embeds).to(self.device)
        out = self.run_transformer(hidden_states=tokens, timestep=timestep, guidance=guidance,
                                   encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=image_ids,
                                   return_dict=False)[0]
        return out[:, : tokens.shape[1]]

    def _inputs(self, x: Tensor, sigma: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Packed tokens ``[B, h w, C]``, their position ids and the timestep, as the pipeline prepares them."""
        tokens = self.pipe._pack_latents(x.to(self.dtype))
        image_ids = self.pipe._prepare_latent_ids(x).to(self.device)
        timestep = self.timestep(sigma, x.shape[0]).to(self.dtype) / 1000
        return tokens, image_ids, timestep

    @staticmethod
    def _unpack(tokens: Tensor, height: int, width: int) -> Tensor:
        """``[B, h w, C] -> [B, C, h, w]``: the inverse of the pipeline's row-major ``_pack_latents``."""
        return tokens.permute(0, 2, 1).reshape(tokens.shape[0], tokens.shape[2], height, width)

    # --- latents and the VAE -----------------------------------------------------------------------------------------
    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling times 2: the 2x2 patchifying."""
        return self.vae_scale_factor * 2

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor * 2
        return batch, self.transformer.config.in_channels, height // scale, width // scale

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        _, _, h, w = self.latent_shape(1, image_size)
        kwargs = {"mu": compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)}
        if not self.scheduler.config.get("use_flow_sigmas", False):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        return kwargs

    def _bn_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def to_vae_latents(self, latents: Tensor) -> Tensor:
        """The adapter's latents as the pipeline's ``output_type="latent"``: BN-denormalised, unpatchified."""
        mean, std = self._bn_stats(latents)
        return self.pipe._unpatchify_latents(latents * std + mean)

    def decode(self, latents: Tensor) -> Tensor:
        vae = self.pipe.vae
        images = vae.decode(self.to_vae_latents(latents).to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def encode_images(self, images: Tensor, *, generator=None, sample: bool = False, dtype=None) -> Tensor:
        """Images in [0, 1] to the adapter's latents as the pipeline's ``_encode_vae_image`` encodes a condition image:
        ``2x - 1``, the posterior's mean (or, with ``sample=True``, a draw with ``generator``), patchified 2x2,
        ``(z - running_mean) / sqrt(running_var + eps)``. Differentiable: wrap in ``torch.no_grad()`` when no
        gradient is wanted."""
        self._check_images(images)
        vae = self.pipe.vae
        pixels = (2.0 * images.float() - 1.0).to(device=vae.device, dtype=vae.dtype)
        posterior = vae.encode(pixels).latent_dist
        latents = self.pipe._patchify_latents(posterior.sample(generator) if sample else posterior.mode())
        mean, std = self._bn_stats(latents)
        latents = (latents - mean) / std
        expected = self.latent_shape(images.shape[0], tuple(images.shape[-2:]))
        if tuple(latents.shape) != tuple(expected):
            raise RuntimeError(f"the VAE encodes {tuple(images.shape)} images to latents {tuple(latents.shape)}, but "
                               f"the transformer takes {tuple(expected)}")
        return latents.to(dtype or self.dtype)


@register_model_family("flux2_klein")
class Flux2KleinModel(Flux2Base):
    """Adapter over ``diffusers.Flux2KleinPipeline`` (FLUX.2 [klein]: Qwen3 text encoder, no guidance embedding)."""

    family = "flux2_klein"
    pipeline_class_name = "Flux2KleinPipeline"

    @property
    def text_encoder_out_layers(self) -> tuple[int, ...]:
        return klein_out_layers(self.pipe.text_encoder.config.num_hidden_layers)

    @property
    def is_distilled(self) -> bool:
        return bool(self.pipe.config.get("is_distilled", False))

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0 and not self.is_distilled

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        cond = Cond(self._encode(prompts))
        if negative_prompts is not None:
            cond.negative_embeds = self._encode(list(negative_prompts))
        return cond

    def _encode(self, prompts: list[str]) -> Tensor:
        embeds, _ = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                            max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_encoder_out_layers)
        return embeds

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        _, _, h, w = x.shape
        tokens, image_ids, timestep = self._inputs(x, sigma)
        v = self._forward(tokens, timestep, cond.embeds, image_ids, None)
        if self.uses_cfg(guidance_scale):
            if not cond.has_negative:
                raise ValueError(f"guidance_scale={guidance_scale} on FLUX.2-Klein means CFG and needs negative prompt "
                                 "embeddings: encode with negative_prompts, or use guidance_scale=1")
            uncond = self._forward(tokens, timestep, cond.negative_embeds, image_ids, None)
            v = uncond + guidance_scale * (v - uncond)
        return self._unpack(v, h, w)
