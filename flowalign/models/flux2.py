"""FLUX.2 adapters: the transformer side both FLUX.2 pipelines share (``Flux2Base``), FLUX.2-dev's Mistral3 text side
with its guidance embedding (``Flux2DevModel``) and FLUX.2-Klein's Qwen3 text side with CFG (``Flux2KleinModel``).

Conventions of ``diffusers.Flux2Pipeline`` and ``diffusers.Flux2KleinPipeline`` reproduced here:

* **Latents**: the flow lives in the VAE's latent space patchified 2x2 and normalised per channel by the VAE's
  batch-norm statistics, ``(z - running_mean) / sqrt(running_var + eps)``, ``[B, 4 z, H/16, W/16]`` (``in_channels``
  of the transformer, 128 for FLUX.2): noise is drawn in that shape, and that is the adapter's ``[B, C, h, w]``
  layout. ``velocity`` packs it as ``[B, h w, C]`` tokens (row-major, one token per patchified position, no further
  patching) and unpacks the result. The Klein pipeline's ``output_type="latent"`` result is the VAE's space:
  ``x * sqrt(running_var + eps) + running_mean``, unpatchified to ``[B, z, H/8, W/8]`` (``to_vae_latents``);
  ``decode`` and ``encode_images`` go through it.
* **Position ids**: 4 axes ``(t, h, w, l)``; image tokens ``(0, i, j, 0)``, text tokens ``(0, 0, 0, k)``.
* **Time**: the transformer takes ``sigma * 1000`` rounded to the latents' dtype, divided by 1000 (it multiplies by
  1000 again); velocity sign as the scheduler's (no flip). Sigmas ``linspace(1, 1/N, N)`` shifted with FLUX.2's
  empirical ``mu(image tokens, N)``, which depends on the image length and the step count.
* **FLUX.2-dev text**: the prompt inside the pipeline's chat conversation (its system message, then the user turn, as
  content lists ``[{"type": "text", ...}]``) through the tokenizer's chat template, padded to
  ``max_sequence_length``; the Mistral3 encoder's hidden states of ``text_encoder_out_layers`` (10, 20, 30: the
  encoder needs at least 30 layers) stacked along the feature axis (3 x hidden wide). Nothing of the template is
  dropped.
* **FLUX.2-dev guidance**: ``guidance_scale`` goes to the guidance embedding (one pass per step at any scale); the
  pipeline has no classifier-free guidance.
* **Klein text**: the prompt is one chat user turn with the generation prompt and ``enable_thinking=False``, padded
  to ``max_sequence_length`` (no attention mask: every position goes to the transformer); the features are the Qwen3
  hidden states of ``text_encoder_out_layers`` (9, 18, 27 of Qwen3's 36) concatenated per token.
* **Klein CFG**: ``uncond + s * (cond - uncond)`` against the empty prompt for ``s > 1``, unless the pipeline is a
  distilled one (``is_distilled``), which takes no guidance. No guidance embedding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, guided, register_model_family, require_negative
from .flux import packed_image_tokens, padded_text_tokens
from .sd3 import JOINT_ATTENTION_TARGETS

# The double-stream blocks' joint attention (SD3 / FLUX names) and the single-stream blocks' fused QKV(+MLP) input
# projection. (The single-stream output projection ``attn.to_out`` shares its name with the double-stream
# ``attn.to_out`` ModuleList, which peft cannot adapt: name it with its block path to add it.)
FLUX2_ATTENTION_TARGETS = (*JOINT_ATTENTION_TARGETS, "attn.to_qkv_mlp_proj")

# Flux2KleinPipeline's default text_encoder_out_layers: a quarter, a half and three quarters of Qwen3's 36 layers.
KLEIN_OUT_LAYERS = (9, 18, 27)


def klein_out_layers(depth: int) -> tuple[int, ...]:
    """The pipeline's default layers where the encoder is deep enough (every released Klein: 36 layers), else the same
    fractions of ``depth`` (a small test encoder)."""
    if depth >= max(KLEIN_OUT_LAYERS):
        return KLEIN_OUT_LAYERS
    return tuple(max(1, round(depth * k / 4)) for k in (1, 2, 3))


def pack_flux2_latents(latents: Tensor) -> Tensor:
    """``[B, C, h, w] -> [B, h w, C]``: one token per (patchified) latent position (the pipelines' ``_pack_latents``)."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_flux2_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of ``pack_flux2_latents`` for a ``height x width`` grid."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


class Flux2Base(FlowModel):
    """The transformer side of the FLUX.2 pipelines: packing, position ids, timestep, BN latent normalisation, the
    empirical shift, the VAE. Subclasses give the text side (``encode``) and the guidance (``velocity``)."""

    lora_targets = FLUX2_ATTENTION_TARGETS

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        length = getattr(tokenizer, "model_max_length", 512) if tokenizer is not None else 512
        return min(512, int(length))

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        """diffusers' own plan of ``Flux2Transformer2DModel`` (the image and text tokens and their position ids split
        on the way in, ``proj_out`` gathered)."""
        return getattr(transformer_class, "_cp_plan", None)

    @classmethod
    def context_parallel_lengths(cls, model_dir: Path, config) -> dict[str, int]:
        """The packed image tokens ``(H / 2s)(W / 2s)`` and the text, padded to ``model.max_sequence_length``, else
        ``min(512, tokenizer.model_max_length)``: the plan splits both."""
        vae = json.loads((model_dir / "vae" / "config.json").read_text())
        return {"image token sequence": packed_image_tokens(config, 2 ** (len(vae["block_out_channels"]) - 1)),
                "text token sequence": padded_text_tokens(model_dir / "tokenizer", config, 512)}

    # --- the transformer ---------------------------------------------------------------------------------------------
    def _inputs(self, x: Tensor, sigma: float | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Packed tokens ``[B, h w, C]``, their position ids and the timestep, as the pipelines prepare them."""
        tokens = pack_flux2_latents(x.to(self.dtype))
        image_ids = self.pipe._prepare_latent_ids(x).to(self.device)
        timestep = self.timestep(sigma, x.shape[0]).to(self.dtype) / 1000
        return tokens, image_ids, timestep

    def _forward(self, tokens: Tensor, timestep: Tensor, embeds: Tensor, text_ids: Tensor, image_ids: Tensor,
                 guidance: Tensor | None) -> Tensor:
        """The transformer's output on the image tokens ``[B, h w, C]``. The text ids go in per row ``[B, L, 4]``, as
        the image ids do: the transformer reads row 0 of either, and the context-parallel plan splits only 3-D ids."""
        if text_ids.ndim == 2:
            text_ids = text_ids.expand(tokens.shape[0], -1, -1)
        out = self.run_transformer(hidden_states=tokens, timestep=timestep, guidance=guidance,
                                   encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=image_ids,
                                   return_dict=False)[0]
        return out[:, : tokens.shape[1]]

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
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu  # the Klein pipeline's is the same

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
        """The adapter's latents as the Klein pipeline's ``output_type="latent"``: BN-denormalised, unpatchified."""
        mean, std = self._bn_stats(latents)
        return self.pipe._unpatchify_latents(latents * std + mean)

    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, 4C, h, w]`` to images in [0, 1]: batch-norm statistics undone, unpatchified, decoded."""
        return self.decode_vae_latents(self.to_vae_latents(latents))

    def encode_images(self, images: Tensor, *, generator=None, sample: bool = False, dtype=None) -> Tensor:
        """Images in [0, 1] to the adapter's latents as the pipelines' ``_encode_vae_image`` encodes a condition
        image: ``2x - 1``, the posterior's mean (or, with ``sample=True``, a draw with ``generator``), patchified 2x2,
        ``(z - running_mean) / sqrt(running_var + eps)``. Differentiable: wrap in ``torch.no_grad()`` when no
        gradient is wanted."""
        latents = self.pipe._patchify_latents(self.vae_posterior_latents(images, generator=generator, sample=sample))
        mean, std = self._bn_stats(latents)
        return self.checked_latents((latents - mean) / std, images, dtype)


@register_model_family("flux2")
class Flux2DevModel(Flux2Base):
    """Adapter over ``diffusers.Flux2Pipeline`` (FLUX.2-dev: Mistral3 text encoder, guidance embedding, no CFG)."""

    family = "flux2"
    pipeline_class_name = "Flux2Pipeline"
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

    def uses_cfg(self, guidance_scale: float) -> bool:
        return False  # the guidance embedding: one pass at any scale

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
        tokens, image_ids, timestep = self._inputs(x, sigma)
        guidance = torch.full([1], float(guidance_scale), device=self.device, dtype=torch.float32).expand(batch)
        v = self._forward(tokens, timestep, cond.embeds, cond.text_ids, image_ids, guidance)
        return unpack_flux2_latents(v, h, w)


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

        def forward(embeds: Tensor) -> Tensor:
            text_ids = self.pipe._prepare_text_ids(embeds).to(self.device)
            return self._forward(tokens, timestep, embeds, text_ids, image_ids, None)

        v = forward(cond.embeds)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale, "on FLUX.2-Klein means CFG and")
            v = guided(v, forward(cond.negative_embeds), guidance_scale)
        return unpack_flux2_latents(v, h, w)
