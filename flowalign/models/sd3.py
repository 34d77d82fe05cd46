"""Stable Diffusion 3 / 3.5 adapter: three text encoders, pooled projections, the scheduler's shift."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, FlowModel, guided, register_model_family, require_negative


# Flow-GRPO's LoRA targets for SD3.5: the joint attention's image and context projections.
JOINT_ATTENTION_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


@register_model_family("sd3")
class SD3Model(FlowModel):
    """Adapter over ``diffusers.StableDiffusion3Pipeline``. Latents are ``[B, 16, H/8, W/8]`` as the pipeline's."""

    family = "sd3"
    # A plan in diffusers' format would split SD3's tokens, but its attention processor (JointAttnProcessor2_0) calls
    # scaled_dot_product_attention itself instead of diffusers' dispatcher, so no Ulysses or ring exchange would run.
    context_parallel_refusal = ("its joint attention (JointAttnProcessor2_0) calls scaled_dot_product_attention "
                                "itself, not diffusers' attention dispatcher, so a split sequence would attend only "
                                "to each process's own tokens")
    pipeline_class_name = "StableDiffusion3Pipeline"
    lora_targets = JOINT_ATTENTION_TARGETS

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer_3", None)
        return min(256, tokenizer.model_max_length) if tokenizer is not None else 256

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """Prompt embeddings through the pipeline's own ``encode_prompt``; negatives are computed when given. SD3
        takes no condition images (``images`` are refused)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        with_negative = negative_prompts is not None
        embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=with_negative,
            negative_prompt=list(negative_prompts) if with_negative else None,
            max_sequence_length=self.max_sequence_length,
        )
        return Cond(embeds, pooled, neg_embeds if with_negative else None, neg_pooled if with_negative else None)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(x, t = 1000 sigma, text)``; with ``guidance_scale > 1`` classifier-free guidance."""
        batch = x.shape[0]
        embeds, pooled = cond.embeds, cond.pooled
        timestep = self.timestep(sigma, batch)
        hidden = x.to(self.dtype)
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            require_negative(cond, guidance_scale)
            hidden = torch.cat([hidden, hidden])
            embeds = torch.cat([cond.negative_embeds, embeds])
            pooled = torch.cat([cond.negative_pooled, pooled])
            timestep = torch.cat([timestep, timestep])
        v = self.run_transformer(
            hidden_states=hidden,
            timestep=timestep,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if cfg:
            uncond, text = v.chunk(2)
            v = guided(text, uncond, guidance_scale)
        return v

    @property
    def image_multiple(self) -> int:
        """The VAE's downsampling times the transformer's patch size (the pipeline's ``check_inputs``)."""
        return self.vae_scale_factor * self.transformer.config.patch_size

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        config = self.scheduler.config
        if not config.get("use_dynamic_shifting", False):
            return {}
        _, _, h, w = self.latent_shape(1, image_size)
        patch = self.transformer.config.patch_size
        return {"mu": self.shift_mu((h // patch) * (w // patch), max_shift=1.16)}
