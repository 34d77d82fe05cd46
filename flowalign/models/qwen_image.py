"""Qwen-Image adapter: Qwen2.5-VL text embeddings with their mask, 2x2 packing, true CFG with norm rescaling.

Conventions of ``diffusers.QwenImagePipeline`` reproduced here:

* text: the prompt is put in the pipeline's chat template (``prompt_template_encode``: a system prompt, then the user
  turn) and the Qwen2.5-VL encoder's last hidden states are taken; the first ``prompt_template_encode_start_idx``
  tokens (34: the system prompt and the user-turn header) are dropped, the rest right-padded with zeros to the
  longest prompt of the batch, with an attention mask (1 = token). A batch whose mask is all ones passes no mask, as
  the pipeline's ``encode_prompt`` does.
* latents: the VAE is video-shaped (``[B, C, frames, h, w]``); one frame, squeezed here to the ``[B, C, h, w]``
  layout the other adapters use; ``velocity`` packs 2x2 patches into ``[B, (h/2)(w/2), 4C]`` tokens as FLUX does,
  and passes ``img_shapes = [(1, h/2, w/2)]`` per row for the image rotary embedding (the text positions follow the
  image's, from the text length); no position-id tensors.
* time: the transformer takes ``sigma * 1000`` rounded to the latents' dtype, then divided by 1000; velocity sign as
  the scheduler's (no flip).
* CFG: "true" CFG with negative prompts, ``uncond + s * (cond - uncond)``, then rescaled per token to the norm of the
  conditional prediction (``comb * (|cond| / |comb|)`` over the channel axis of the packed tokens). Without a
  guidance embedding (Qwen-Image has none), a scale above 1 means two forward passes.
* context parallelism (``distributed.context_parallel``): diffusers' plan splits the image tokens and the text
  tokens; the text is as long as the batch's longest prompt, unknown before the prompts are encoded, so under a
  split it is padded with masked zero tokens to a multiple of the degree (``context_parallel_text``). A masked key
  takes no part in attention, and the padding goes after the prompt, whose tokens keep their rotary positions, so
  the image tokens' output is the unpadded one's (tests/test_context_parallel.py measures it).
* VAE: latents are normalised per channel, ``(z - latents_mean) / latents_std``; no scaling or shift factor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, guided, norm_rescaled, register_model_family, require_negative
from .flux import PackedFlowModel, pack_latents, packed_image_tokens, unpack_latents
from .sd3 import JOINT_ATTENTION_TARGETS


@register_model_family("qwen_image")
class QwenImageModel(PackedFlowModel):
    """Adapter over ``diffusers.QwenImagePipeline``. Latents ``[B, z_dim, H/8, W/8]`` (z_dim 16 for Qwen-Image)."""

    family = "qwen_image"
    pipeline_class_name = "QwenImagePipeline"
    # The dual-stream blocks' joint attention: image projections and the text stream's add_*/to_add_out.
    lora_targets = JOINT_ATTENTION_TARGETS
    # the last block's text stream is computed and dropped: its to_add_out (a LoRA target) gets no gradient
    ddp_find_unused_parameters = True

    def __init__(self, pipe, *, max_sequence_length: int | None = None):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        if pipe.transformer is not None and pipe.transformer.config.guidance_embeds:
            raise NotImplementedError("a guidance-distilled Qwen-Image transformer (guidance_embeds=True) is not "
                                      "supported: the adapter implements Qwen-Image's true CFG only")

    def default_max_sequence_length(self) -> int:
        return 512  # QwenImagePipeline.__call__'s default

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        """diffusers' own plan of ``QwenImageTransformer2DModel`` (the image and text tokens and their rotary
        embeddings split at the first block, the text mask at every block, ``proj_out`` gathered)."""
        return getattr(transformer_class, "_cp_plan", None)

    @classmethod
    def context_parallel_lengths(cls, model_dir: Path, config) -> dict[str, int]:
        """The packed image tokens ``(H / 2s)(W / 2s)`` (``s = 2 ** len(vae.temperal_downsample)``); the text's
        length is the batch's longest prompt, padded to a multiple of the degree at each forward
        (``context_parallel_text``), so it is not checked here."""
        vae = json.loads((model_dir / "vae" / "config.json").read_text())
        return {"image token sequence": packed_image_tokens(config, 2 ** len(vae["temperal_downsample"]))}

    def context_parallel_text(self, embeds: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``embeds [B, L, D]`` and ``mask [B, L]`` right-padded with masked zero tokens to a multiple of the
        context-parallel degree (module docstring); unchanged when ``L`` divides (always without a split)."""
        pad = -embeds.shape[1] % self.context_parallel_degree
        if pad == 0:
            return embeds, mask
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return (torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
                torch.nn.functional.pad(mask, (0, pad)))

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        return self.masked_cond(self._encode, prompts, negative_prompts)

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask; keep one so rows can be regrouped
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return embeds, mask

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        return self._velocity(x, sigma, cond, guidance_scale)

    def _velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0,
                  context: tuple[Tensor, list[tuple[int, int, int]]] | None = None) -> Tensor:
        """The velocity on the generated image's tokens; ``context``: further image tokens ``[B, M, 4C]`` put after
        them in the sequence, with their ``img_shapes`` entries (an editing family's condition images)."""
        batch, _, h, w = x.shape
        tokens = pack_latents(x.to(self.dtype))
        count = tokens.shape[1]
        img_shapes = [[(1, h // 2, w // 2)]] * batch
        if context is not None:
            tokens = torch.cat([tokens, context[0].to(self.dtype)], dim=1)
            img_shapes = [[(1, h // 2, w // 2), *context[1]]] * batch
        # QwenImagePipeline rounds 1000*sigma to the latents' dtype and divides by 1000.
        timestep = self.timestep(sigma, batch).to(self.dtype) / 1000

        def forward(embeds: Tensor, mask: Tensor | None) -> Tensor:
            embeds, mask = self.context_parallel_text(embeds, mask)
            if mask is not None and bool(mask.all()):
                mask = None  # as the pipeline passes an all-ones mask: not at all
            return self.run_transformer(
                hidden_states=tokens,
                timestep=timestep,
                guidance=None,
                encoder_hidden_states_mask=mask,
                encoder_hidden_states=embeds,
                img_shapes=img_shapes,
                return_dict=False,
            )[0][:, :count]

        v = forward(cond.embeds, cond.mask)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale, "on Qwen-Image means true CFG and")
            v = norm_rescaled(guided(v, forward(cond.negative_embeds, cond.negative_mask), guidance_scale), v)
        return unpack_latents(v, h, w)

    # --- latents and the VAE (the 2x2-packed layout: PackedFlowModel) -----------------------------------------------
    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": self.packed_mu(image_size)}

    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        """``latents_mean`` and ``1 / latents_std`` as the pipeline builds them, ``[1, z, 1, 1, 1]``."""
        config = self.pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
        inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
        return mean, inv_std

    def decode(self, latents: Tensor) -> Tensor:
        """As the pipeline: add the frame axis, ``z / (1 / std) + mean``, decode, take frame 0."""
        vae = self.pipe.vae
        latents = latents.unsqueeze(2).to(vae.dtype)
        mean, inv_std = self._latent_stats(latents)
        images = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def encode_images(
        self,
        images: Tensor,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        sample: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Images in [0, 1] to latents ``[B, C, h, w]`` as ``QwenImageImg2ImgPipeline._encode_vae_image``: ``2x - 1``
        with a frame axis, the posterior's mean (or a draw with ``generator``), ``(z - mean) * (1 / std)``.
        Differentiable: wrap in ``torch.no_grad()`` when no gradient is wanted."""
        self._check_images(images)
        vae = self.pipe.vae
        pixels = (2.0 * images.float() - 1.0).unsqueeze(2).to(device=vae.device, dtype=vae.dtype)
        if isinstance(generator, list):
            posteriors = [vae.encode(pixels[i: i + 1]).latent_dist for i in range(pixels.shape[0])]
            latents = torch.cat([p.sample(g) if sample else p.mode() for p, g in zip(posteriors, generator)])
        else:
            posterior = vae.encode(pixels).latent_dist
            latents = posterior.sample(generator) if sample else posterior.mode()
        mean, inv_std = self._latent_stats(latents)
        return self.checked_latents(((latents - mean) * inv_std)[:, :, 0], images, dtype)
