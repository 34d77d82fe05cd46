"""HunyuanVideo 1.5 text-to-video adapter (``diffusers.HunyuanVideo15Pipeline``): a Qwen2.5-VL text model and a ByT5
glyph encoder, a dual-stream 3D DiT, a causal 3D VAE.

Conventions (``HunyuanVideo15Pipeline.__call__``):

* latents ``[B, C, f, h, w]``, ``C`` the VAE's ``latent_channels`` (32 released), ``f = (num_frames - 1) / 4 + 1``,
  ``h, w`` the frame size over 16 (the released VAE); drawn in the transformer's dtype. The transformer's input is
  ``cat([latents, condition latents, mask], dim=1)`` (``2 C + 1`` channels): zeros for text-to-video (the
  image-to-video family puts its first frame there, ``flowalign.models.hunyuan_video15_i2v``);
* time: the transformer takes the scheduler's timestep ``1000 sigma`` in its dtype for every row; the velocity's sign
  is the scheduler's; the sigmas are ``linspace(1, 0, N + 1)[:-1]`` shifted by the scheduler's ``shift`` (5 at 480p,
  9 at 720p T2V), ``FlowMatchEulerDiscreteScheduler`` as released;
* text: Qwen2.5-VL's third-last hidden state over the pipeline's chat template (the system prompt's tokens dropped),
  padded to ``max_sequence_length`` (1000) with its mask; plus ByT5 embeddings of the prompt's quoted text (glyphs;
  zeros and an all-zero mask when the prompt quotes nothing), padded to 256 with its mask: the pipeline's
  ``encode_prompt``. ``Cond.embeds`` / ``mask`` are Qwen's, ``extras["glyph_embeds"]`` / ``["glyph_mask"]`` ByT5's
  (and ``negative_glyph_*`` for CFG); text-to-video gives the transformer zero image embeddings (729 tokens released);
* CFG: the pipeline's ``ClassifierFreeGuidance`` guider, a conditional then an unconditional pass (the empty prompt
  when none is given), ``uncond + scale * (cond - uncond)``; flowalign's ``guidance_scale`` replaces the guider's
  scale (6 released; 1 for the distilled checkpoints);
* VAE: ``AutoencoderKLHunyuanVideo15``, normalised by its config's ``scaling_factor`` (``z * s``, ``x / s``).

The VAE in diffusers 0.42.1 cannot decode or encode a batch of more than one video: its causal attention mask,
built ``[B, L, L]``, broadcasts against the queries' ``[B, 1, L, C]`` as ``[B, B, L, L]`` and the attention fails.
This adapter therefore takes one video per VAE call (``vae_batch`` is 1 whatever is asked;
tests/test_video_hunyuan_video15.py reproduces the defect, so a fixed diffusers shows up there).
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, guided, register_model_family, require_negative
from .video import VideoFlowModel

logger = logging.getLogger(__name__)

# Every attention and MLP projection of the dual-stream blocks (video and text streams) and of the text token
# refiner's blocks (peft matches the suffixes in both).
HUNYUAN_VIDEO15_LORA_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)


@register_model_family("hunyuan_video15")
class HunyuanVideo15Model(VideoFlowModel):
    """Adapter over ``diffusers.HunyuanVideo15Pipeline`` (HunyuanVideo 1.5 T2V)."""

    family = "hunyuan_video15"
    # HunyuanVideo15AttnProcessor2_0 dispatches (the video tokens, then the text tokens, in one joint attention), but
    # it builds from the text mask a dense [B, 1, S, S] query-by-key mask over the tokens a process holds (mask AND its
    # transpose); under Ulysses the queries become the whole sequence while that mask keeps the local queries (only a
    # key mask [..., S_local] is gathered), and diffusers' ring applies one mask to every process's keys. Without the
    # mask the padded text tokens would be attended: the sample would change. Measured with Wan's plan written for it
    # (rope, the first block's tokens, proj_out) on 2 gloo processes, the tiny model: "The size of tensor a (156)
    # must match the size of tensor b (78) at non-singleton dimension 2".
    context_parallel_refusal = ("its attention processor (HunyuanVideo15AttnProcessor2_0) builds a query-by-key mask "
                                "from the padded text over the tokens each process holds, and diffusers' Ulysses and "
                                "ring attention can only carry a key mask across a split sequence")
    pipeline_class_name = "HunyuanVideo15Pipeline"
    lora_targets = HUNYUAN_VIDEO15_LORA_TARGETS
    default_num_frames = 9

    def __init__(self, pipe, *, vae_batch: int = 1, **options):
        if isinstance(vae_batch, int) and vae_batch > 1:
            logger.warning("model family %s: vae_batch=%d lowered to 1: the HunyuanVideo 1.5 VAE of diffusers 0.42.1 "
                           "takes one video per call (its attention mask broadcasts wrongly over a batch)",
                           self.family, vae_batch)
            vae_batch = 1
        super().__init__(pipe, vae_batch=vae_batch, **options)
        if getattr(self.transformer.config, "use_meanflow", False):
            raise ValueError(f"model family {self.family!r}: the transformer uses MeanFlow (use_meanflow=True, the "
                             "step-distilled super-resolution checkpoints), whose velocity needs the next step's time; "
                             "flowalign's samplers take the flow's velocity at one time: load a checkpoint without it")

    def default_max_sequence_length(self) -> int:
        return int(getattr(self.pipe, "tokenizer_max_length", 1000))

    @property
    def default_image_size(self) -> tuple[int, int]:
        """The pipeline's default frame size: its 16:9 aspect bucketed around the transformer's ``target_size``."""
        return self.sized_like(9, 16)

    def sized_like(self, height: int, width: int) -> tuple[int, int]:
        """The pipeline's frame size for an aspect of ``height`` to ``width``: the bucket of
        ``HunyuanVideo15ImageProcessor.calculate_default_height_width`` around ``target_size``."""
        size = self.pipe.video_processor.calculate_default_height_width(height, width, self.pipe.target_size)
        return int(size[0]), int(size[1])

    @property
    def image_multiple(self) -> int:
        """The VAE's spatial downsampling times the transformer's patch."""
        return self.vae_scale_factor * int(self.transformer.config.patch_size)

    @property
    def latent_channels(self) -> int:
        """The VAE's latent channels (the transformer's input adds a condition and a mask to them)."""
        return int(self.pipe.vae.config.latent_channels)

    # --- text -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """Qwen2.5-VL and ByT5 embeddings through the pipeline's ``encode_prompt`` (negatives when given).
        Text-to-video takes no condition images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        return self.text_cond(prompts, negative_prompts)

    def encode_text(self, prompts: list[str]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(embeds, mask, glyph_embeds, glyph_mask)`` of ``prompts``, as the pipeline's ``encode_prompt`` returns
        them (in the transformer's dtype), with Qwen's prompt padded to ``max_sequence_length``."""
        pipe = self.pipe
        embeds, mask = pipe._get_mllm_prompt_embeds(
            text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, prompt=prompts, device=self.device,
            tokenizer_max_length=self.max_sequence_length, system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx)
        return pipe.encode_prompt(prompt=prompts, device=self.device, dtype=self.dtype, batch_size=len(prompts),
                                  prompt_embeds=embeds, prompt_embeds_mask=mask)

    def text_cond(self, prompts: list[str], negative_prompts: Sequence[str] | None) -> Cond:
        """The ``Cond`` of the prompts' (and negatives') embeddings: Qwen's in ``embeds`` / ``mask``, ByT5's in
        ``extras``."""
        embeds, mask, glyph, glyph_mask = self.encode_text(prompts)
        cond = Cond(embeds, mask=mask, extras={"glyph_embeds": glyph, "glyph_mask": glyph_mask})
        if negative_prompts is not None:
            negative = list(negative_prompts)
            if len(negative) != len(prompts):
                raise ValueError(f"{len(negative)} negative prompts for {len(prompts)} prompts: give one per prompt")
            cond.negative_embeds, cond.negative_mask, glyph, glyph_mask = self.encode_text(negative)
            cond.extras.update(negative_glyph_embeds=glyph, negative_glyph_mask=glyph_mask)
        return cond

    # --- the transformer ------------------------------------------------------------------------------------------
    def condition_input(self, x: Tensor, cond: Cond) -> tuple[Tensor, Tensor]:
        """``(condition latents, mask)`` concatenated to the latents: zeros for text-to-video, as the pipeline's
        ``prepare_cond_latents_and_mask``."""
        batch, _, frames, height, width = x.shape
        zeros = torch.zeros(batch, self.latent_channels, frames, height, width, dtype=self.dtype, device=x.device)
        return zeros, torch.zeros(batch, 1, frames, height, width, dtype=self.dtype, device=x.device)

    def image_embeds(self, x: Tensor, cond: Cond) -> Tensor:
        """The transformer's image embeddings: zeros for text-to-video (the pipeline's ``vision_num_semantic_tokens``
        of ``image_embed_dim``), which the transformer masks out."""
        return torch.zeros(x.shape[0], self.pipe.vision_num_semantic_tokens, self.pipe.vision_states_dim,
                           dtype=self.dtype, device=x.device)

    def model_input(self, x: Tensor, cond: Cond) -> Tensor:
        """``cat([x, condition latents, mask], dim=1)`` in the transformer's dtype."""
        return torch.cat([x.to(self.dtype), *self.condition_input(x, cond)], dim=1)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(cat(x, condition, mask), t = 1000 sigma, Qwen + ByT5 text, image embeddings)``; with
        ``guidance_scale > 1`` a second, unconditional pass and ``uncond + scale * (cond - uncond)``."""
        hidden = self.model_input(x, cond)
        timestep = self.timestep(sigma, x.shape[0]).to(hidden.dtype)
        image_embeds = self.image_embeds(x, cond)

        def run(embeds, mask, glyph, glyph_mask):
            return self.run_transformer(hidden_states=hidden, image_embeds=image_embeds, timestep=timestep,
                                        encoder_hidden_states=embeds, encoder_attention_mask=mask,
                                        encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
                                        return_dict=False)[0]

        extras = cond.extras
        v = run(cond.embeds, cond.mask, extras["glyph_embeds"], extras["glyph_mask"])
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale)
            uncond = run(cond.negative_embeds, cond.negative_mask, extras["negative_glyph_embeds"],
                         extras["negative_glyph_mask"])
            v = guided(v, uncond, guidance_scale)
        return v

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """The pipeline's ``sigmas = linspace(1, 0, N + 1)[:-1]`` (the scheduler shifts them)."""
        return {"sigmas": np.linspace(1.0, 0.0, num_steps + 1)[:-1]}
