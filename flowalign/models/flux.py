"""FLUX adapter: 2x2 latent packing, image/text position ids, guidance embedding, resolution-dependent ``mu``.

The adapter keeps latents unpacked, ``[B, C, h, w]``, like SD3's, so samplers, rewards and registers see one
layout; it packs into FLUX's ``[B, h/2 * w/2, 4C]`` token sequence inside ``velocity`` and unpacks the result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size, guided, register_model_family, require_negative
from .sd3 import JOINT_ATTENTION_TARGETS


def pack_latents(latents: Tensor) -> Tensor:
    """``[B, C, h, w] -> [B, (h/2)(w/2), 4C]``: each 2x2 patch becomes one token (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of ``pack_latents`` for a latent grid of ``height x width``."""
    b, _, channels = tokens.shape
    patches = tokens.view(b, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, channels // 4, height, width)


class PackedFlowModel(FlowModel):
    """A family whose transformer takes FLUX's 2x2-packed tokens (FLUX, Chroma, Kontext, Qwen-Image): latents
    ``[B, in_channels / 4, h, w]`` with even sides, ``mu`` from the number of packed tokens."""

    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling times 2: the 2x2 packing needs even latent sides."""
        return self.vae_scale_factor * 2

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor * 2  # VAE compression, then 2x2 packing needs even latent sides
        return batch, self.transformer.config.in_channels // 4, 2 * (height // scale), 2 * (width // scale)

    def packed_mu(self, image_size: tuple[int, int]) -> float:
        """``shift_mu`` of the image's packed token count ``(h/2)(w/2)``."""
        _, _, h, w = self.latent_shape(1, image_size)
        return self.shift_mu((h // 2) * (w // 2))


def packed_image_tokens(config, scale: int) -> int:
    """The 2x2-packed latent tokens ``(H / 2s)(W / 2s)`` of ``sampling.image_size`` for a VAE of spatial scale ``s``
    (default: the pipelines' ``default_sample_size`` of 128 latents a side), read before any model loads."""
    height, width = as_image_size(config.sampling.image_size, (128 * scale, 128 * scale))
    return (height // (2 * scale)) * (width // (2 * scale))


def padded_text_tokens(tokenizer_dir: Path, config, cap: int) -> int:
    """The length of a text padded to ``model.max_sequence_length``, else to ``min(cap, model_max_length)`` of the
    tokenizer in ``tokenizer_dir`` (``cap`` when it has no config), read before any model loads."""
    if config.model.max_sequence_length is not None:
        return config.model.max_sequence_length
    tokenizer = tokenizer_dir / "tokenizer_config.json"
    limit = json.loads(tokenizer.read_text()).get("model_max_length", cap) if tokenizer.is_file() else cap
    return min(cap, int(limit))


@register_model_family("flux")
class FluxModel(PackedFlowModel):
    """Adapter over ``diffusers.FluxPipeline``.

    ``guidance_scale`` goes to the guidance embedding when the transformer has one (FLUX.1-dev; one forward pass);
    otherwise a scale above 1 means true classifier-free guidance with negative prompts (two passes).
    """

    family = "flux"
    pipeline_class_name = "FluxPipeline"
    # The FLUX equivalents of SD3's targets carry the same names; in FLUX, to_q/to_k/to_v also match the
    # single-stream blocks' attention.
    lora_targets = JOINT_ATTENTION_TARGETS

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer_2", None)
        return min(512, tokenizer.model_max_length) if tokenizer is not None else 512

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        """diffusers' own plan of the transformer class (``FluxTransformer2DModel._cp_plan``: the image and text
        tokens and their position ids split on the way in, ``proj_out`` gathered); None for a class without one."""
        return getattr(transformer_class, "_cp_plan", None)

    @classmethod
    def context_parallel_lengths(cls, model_dir: Path, config) -> dict[str, int]:
        """The packed image tokens ``(H / 2s)(W / 2s)`` and the text tokens (``model.max_sequence_length``, else
        ``min(512, tokenizer_2.model_max_length)``): the plan splits both."""
        vae = json.loads((model_dir / "vae" / "config.json").read_text())
        return {"image token sequence": packed_image_tokens(config, 2 ** (len(vae["block_out_channels"]) - 1)),
                "text token sequence": padded_text_tokens(model_dir / "tokenizer_2", config, 512)}

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 1.0 and not self.guidance_embeds

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """Prompt embeddings through the pipeline's own ``encode_prompt``. FLUX takes no condition images (``images``
        are refused; FLUX.1-Kontext, ``flowalign.models.flux_kontext``, does)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        return self._encode_text(prompts, negative_prompts)

    def _encode_text(self, prompts: list[str], negative_prompts: Sequence[str] | None) -> Cond:
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        cond = Cond(embeds, pooled, text_ids=text_ids)
        if negative_prompts is not None:
            neg_embeds, neg_pooled, _ = self.pipe.encode_prompt(
                prompt=list(negative_prompts), prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
            )
            cond.negative_embeds, cond.negative_pooled = neg_embeds, neg_pooled
        return cond

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        return self._velocity(x, sigma, cond, guidance_scale)

    def _velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float,
                  context: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The velocity of ``x``; ``context = (tokens, ids)``: packed tokens appended to the image tokens in the
        sequence with their own position ids (FLUX.1-Kontext's condition image), the velocity read on ``x``'s own."""
        batch, _, h, w = x.shape
        tokens = pack_latents(x.to(self.dtype))
        image_ids = self.pipe._prepare_latent_image_ids(batch, h // 2, w // 2, self.device, self.dtype)
        length = tokens.shape[1]
        if context is not None:
            tokens = torch.cat([tokens, context[0]], dim=1)
            image_ids = torch.cat([image_ids, context[1]], dim=0)
        # FluxPipeline rounds 1000*sigma to the latents' dtype and divides by 1000: do the same, bit for bit.
        timestep = self.timestep(sigma, batch).to(self.dtype) / 1000
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), float(guidance_scale), device=self.device, dtype=torch.float32)

        def forward(embeds: Tensor, pooled: Tensor) -> Tensor:
            out = self.run_transformer(
                hidden_states=tokens,
                timestep=timestep,
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=embeds,
                txt_ids=cond.text_ids,
                img_ids=image_ids,
                return_dict=False,
            )[0]
            return out if context is None else out[:, :length]

        v = forward(cond.embeds, cond.pooled)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale, "on a FLUX model without guidance embedding means true CFG and")
            v = guided(v, forward(cond.negative_embeds, cond.negative_pooled), guidance_scale)
        return unpack_latents(v, h, w)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        kwargs = {"mu": self.packed_mu(image_size)}
        if not self.scheduler.config.get("use_flow_sigmas", False):
            kwargs["sigmas"] = np.linspace(1.0, 1 / num_steps, num_steps)
        return kwargs
