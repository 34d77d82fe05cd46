"""FLUX.2-dev adapter: Mistral3 text embeddings from a chat template, patchified and batch-normalised latents, 4-axis
position ids, guidance embedding.

Conventions of ``diffusers.Flux2Pipeline`` that the adapter reproduces:

* **Latents**: the VAE's latents are patchified 2x2 (``[B, 4C, H/16, W/16]``, 128 channels for FLUX.2) and
  normalised with the VAE's latent batch-norm statistics, ``(z - running_mean) / sqrt(running_var + eps)``; the noise
  is drawn in that layout, which is the adapter's unpacked layout ``[B, C, h, w]``. ``velocity`` packs it into
  ``[B, h w, C]`` tokens (row-major, one token per patchified position) and unpacks the result.
* **Position ids**: 4 axes ``(t, h, w, l)``; image tokens ``(0, i, j, 0)``, text tokens ``(0, 0, 0, k)``.
* **Text**: the prompt inside the pipeline's chat conversation (its system message, then the user turn, as content
  lists ``[{"type": "text", ...}]``) through the tokenizer's chat template, padded to ``max_sequence_length``; the
  Mistral3 encoder's hidden states of ``text_encoder_out_layers`` (default 10, 20, 30: the encoder needs at least
  30 layers) stacked along the feature axis (3 x hidden wide). Nothing of the template is dropped.
* **Time**: ``t = sigma`` as ``round_dtype(1000 sigma) / 1000`` (the transformer multiplies by 1000 again).
  Sigmas ``linspace(1, 1/N, N)`` shifted with FLUX.2's empirical ``mu(image tokens, N)``.
* **Guidance**: ``guidance_scale`` goes to the guidance embedding (one pass per step at any scale); the pipeline has
  no classifier-free guidance. The velocity is the transformer's output, no sign flip.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, register_model_family
from .sd3 import JOINT_ATTENTION_TARGETS

# The double-stream blocks' joint attention (SD3 / FLUX names) and the single-stream blocks' fused QKV(+MLP) input
# projection. (The single-stream output projection ``attn.to_out`` shares its name with the double-stream
# ``attn.to_out`` ModuleList, which peft cannot adapt: name it with its block path to add it.)
FLUX2_ATTENTION_TARGETS = (*JOINT_ATTENTION_TARGETS, "attn.to_qkv_mlp_proj")


def pack_flux2_latents(latents: Tensor) -> Tensor:
    """``[B, C, h, w] -> [B, h w, C]``: one token per (patchified) latent position (``Flux2Pipeline._pack_latents``)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_flux2_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of ``pack_flux2_latents`` for a ``height x width`` grid."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


@register_model_family("flux2")
class Flux2DevModel(FlowModel):
    """Adapter over ``diffusers.Flux2Pipeline`` (FLUX.2-dev)."""

    family = "flux2"
    pipeline_class_name = "Flux2Pipeline"
    lora_targets = FLUX2_ATTENTION_TARGETS
    text_encoder_out_layers: tuple[int, ...] = (10, 20, 30)

    def __init__(self, pipe, *, max_sequence_length: int | None = None):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        encoder = getattr(pipe, "text_encoder", None)
        if encoder is not None:
            config = getattr(encoder.config, "text_config", encoder.config)
            depth = int(config.num_hidden_layers)
            if max(self.text_encoder_out_layers) > depth:
                raise ValueError(f"FLUX.2 takes the text encoder's hidden states {self.text_encoder_out_layers}, "
                                 f"but this text encoder has {depth} layers")

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        length = getattr(tokenizer, "model_max_length", 512) if tokenizer is not None else 512
        return min(512, int(length))

    def uses_cfg(self, guidance_scale: float) -> bool:
        return False  # the guidance embedding: one pass at any scale

    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling times the 2x2 patchification."""
        return self.vae_scale_factor * 2

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor * 2
        return batch, self.transformer.config.in_channels, height // scale, width // scale

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        _, _, h, w = self.latent_shape(1, image_size)
        kwargs = {"mu": compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)}
        if not self.scheduler.config.get("use_flow_sigmas", False):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        return kwargs

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        """Prompt embeddings through the pipeline's ``encode_prompt``; FLUX.2-dev has no negative prompts (they are
        ignored). The text ids are the same for every row: ``Cond.text_ids`` holds one ``[L, 4]`` copy."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        embeds, text_ids = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        return Cond(embeds, text_ids=text_ids[0])

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        batch, _, h, w = x.shape
        tokens = pack_flux2_latents(x).to(self.dtype)
        image_ids = self.pipe._prepare_latent_ids(x).to(self.device)
        # Flux2Pipeline rounds 1000 sigma to the latents' dtype and divides by 1000.
        timestep = self.timestep(sigma, batch).to(self.dtype) / 1000
        guidance = torch.full([1], float(guidance_scale), device=self.device, dtype=torch.float32).expand(batch)
        v = self.run_transformer(
            hidden_states=tokens,
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=cond.embeds,
            txt_ids=cond.text_ids,
            img_ids=image_ids,
            return_dict=False,
        )[0]
        return unpack_flux2_latents(v[:, : h * w], h, w)

    # --- VAE: patchify and the latent batch norm -------------------------------------------------------------------
    def _latent_statistics(self, like: Tensor) -> tuple[Tensor, Tensor]:
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, 4C, h, w]`` to images in [0, 1]: batch-norm statistics undone, unpatchified, decoded."""
        mean, std = self._latent_statistics(latents)
        latents = self.pipe._unpatchify_latents(latents * std + mean)
        vae = self.pipe.vae
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def encode_images(self, images: Tensor, *, generator=None, sample: bool = False,
                      dtype: torch.dtype | None = None) -> Tensor:
        """``decode``'s inverse, as the pipeline encodes its condition images (``_encode_vae_image``): the VAE
        posterior's mode (or, ``sample=True``, a draw), patchified 2x2, normalised with the latent batch norm."""
        self._check_images(images)
        vae = self.pipe.vae
        pixels = (2.0 * images.float() - 1.0).to(device=vae.device, dtype=vae.dtype)
        posterior = vae.encode(pixels).latent_dist
        latents = self.pipe._patchify_latents(posterior.sample(generator) if sample else posterior.mode())
        mean, std = self._latent_statistics(latents)
        return ((latents - mean) / std).to(dtype or self.dtype)
