"""Kandinsky 5 text-to-video adapter (``diffusers.Kandinsky5T2VPipeline``): a Qwen2.5-VL text encoder and a CLIP
pooled embedding, a text-encoder + cross-attention 3D DiT, the HunyuanVideo causal 3D VAE.

Conventions (``Kandinsky5T2VPipeline.__call__``):

* the pipeline's latents are channels-last, ``[B, f, h, w, C]`` (``f = (num_frames - 1) / 4 + 1``, ``h, w`` the frame
  size over 8 released); flowalign's are diffusers' video layout ``[B, C, f, h, w]``: ``prepare_noise`` draws the
  pipeline's channels-last noise (same generator, same values) and moves the channels, ``velocity`` moves them back
  for the transformer, and the pipeline's ``output_type="latent"`` result is ``latents.permute(0, 2, 3, 4, 1)``
  (``pipeline_latents``). A transformer with ``visual_cond`` (the released 5s checkpoints) takes
  ``cat([latents, zeros, zero mask], dim=-1)`` in text-to-video, as the pipeline's ``prepare_latents`` builds it;
* time: the transformer takes the scheduler's timestep ``1000 sigma`` in its dtype for every row; the sigmas are
  ``FlowMatchEulerDiscreteScheduler.set_timesteps(N)``'s (shift 5 released); the velocity's sign is the scheduler's;
* text: the pipeline's ``encode_prompt``: Qwen2.5-VL's last hidden state over its prompt template (the template's
  prefix dropped), the batch padded to its longest prompt (``Cond.embeds``; the transformer attends to every
  position, padding included, with rotary positions ``0 .. L - 1``, as the pipeline runs it), and CLIP's pooled
  output (``Cond.pooled``); ``max_sequence_length`` (512) caps Qwen's tokens;
* CFG: two passes (conditional, then unconditional), ``uncond + scale * (cond - uncond)``. The pipeline's own
  default negative prompt (a fixed list of defects) applies only when none is given; flowalign's negative prompts
  are the config's (the empty prompt by default);
* resolution-dependent rotary scaling (``_get_scale_factor``: (1, 2, 2) between 480 and 854 px, else
  (1, 3.16, 3.16)) and the sparse-attention parameters of NABLA checkpoints (``get_sparse_params``) come from the
  pipeline's own methods at each call;
* VAE: ``AutoencoderKLHunyuanVideo``, normalised by its config's ``scaling_factor`` (0.476986).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, guided, register_model_family, require_negative
from .video import VideoFlowModel

# Every attention and MLP projection of the text blocks (self-attention, feed-forward) and the visual blocks
# (self-attention, cross-attention, feed-forward); peft matches the suffixes in both.
KANDINSKY5_LORA_TARGETS = (
    "self_attention.to_query", "self_attention.to_key", "self_attention.to_value", "self_attention.out_layer",
    "cross_attention.to_query", "cross_attention.to_key", "cross_attention.to_value", "cross_attention.out_layer",
    "feed_forward.in_layer", "feed_forward.out_layer",
)


@register_model_family("kandinsky5_t2v")
class Kandinsky5T2VModel(VideoFlowModel):
    """Adapter over ``diffusers.Kandinsky5T2VPipeline`` (Kandinsky 5 T2V)."""

    family = "kandinsky5_t2v"
    # Kandinsky5AttnProcessor dispatches, but the video tokens and their rotary table are flattened by a function
    # inside forward (fractal_flatten) and reshaped with the whole video's shape (fractal_unflatten) before out_layer:
    # the last place to gather them is the last visual block, whose name depends on the checkpoint's depth, which a
    # plan of the class cannot name; the Pro checkpoints' NABLA attention builds a flex-attention block mask over the
    # whole sequence.
    context_parallel_refusal = ("its video tokens are flattened and reshaped back with the whole video's shape inside "
                                "the transformer's forward (fractal_flatten / fractal_unflatten), so diffusers' plan "
                                "format has no fixed submodule at which to gather them, and its sparse (NABLA) "
                                "attention masks the whole sequence")
    pipeline_class_name = "Kandinsky5T2VPipeline"
    lora_targets = KANDINSKY5_LORA_TARGETS
    default_num_frames = 9

    def default_max_sequence_length(self) -> int:
        return 512

    @property
    def default_image_size(self) -> tuple[int, int]:
        """512x768, the pipeline's defaults."""
        return 512, 768

    @property
    def image_multiple(self) -> int:
        """16 (the pipeline refuses other sizes) and a multiple of the VAE's downsampling times the patch."""
        return math.lcm(16, self.vae_scale_factor * int(self.transformer.config.patch_size[1]))

    @property
    def latent_channels(self) -> int:
        """The transformer's ``in_visual_dim``."""
        return int(self.transformer.config.in_visual_dim)

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """The pipeline's channels-last noise ``[B, f, h, w, C]`` (``randn_tensor``, same generator), as
        ``[B, C, f, h, w]``."""
        from diffusers.utils.torch_utils import randn_tensor

        b, c, f, h, w = self.latent_shape(batch, image_size)
        noise = randn_tensor((b, f, h, w, c), generator=generator, device=self.device, dtype=dtype or self.dtype)
        return noise.permute(0, 4, 1, 2, 3).contiguous()

    @staticmethod
    def pipeline_latents(latents: Tensor) -> Tensor:
        """flowalign's ``[B, C, f, h, w]`` as the pipeline's channels-last ``[B, f, h, w, C]``."""
        return latents.permute(0, 2, 3, 4, 1)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """Qwen2.5-VL embeddings and CLIP's pooled output through the pipeline's ``encode_prompt`` (negatives when
        given). Text-to-video takes no condition images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompts, max_sequence_length=self.max_sequence_length,
                                                    device=self.device, dtype=self.dtype)
        cond = Cond(embeds, pooled=pooled)
        if negative_prompts is not None:
            negative = list(negative_prompts)
            if len(negative) != len(prompts):
                raise ValueError(f"{len(negative)} negative prompts for {len(prompts)} prompts: give one per prompt")
            cond.negative_embeds, cond.negative_pooled, _ = self.pipe.encode_prompt(
                prompt=negative, max_sequence_length=self.max_sequence_length, device=self.device, dtype=self.dtype)
        return cond

    def model_input(self, x: Tensor) -> Tensor:
        """The transformer's ``hidden_states``: ``x`` channels-last in its dtype, with zeros and a zero mask
        appended when the transformer has ``visual_cond`` (as the pipeline's ``prepare_latents``)."""
        hidden = self.pipeline_latents(x).to(self.dtype)
        if self.transformer.config.visual_cond:
            mask = torch.zeros(*hidden.shape[:-1], 1, dtype=hidden.dtype, device=hidden.device)
            hidden = torch.cat([hidden, torch.zeros_like(hidden), mask], dim=-1)
        return hidden

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(x channels-last, t = 1000 sigma, Qwen text, CLIP pooled)``, back to ``[B, C, f, h, w]``;
        with ``guidance_scale > 1`` a second, unconditional pass and ``uncond + scale * (cond - uncond)``."""
        batch, _, frames, height, width = x.shape
        hidden = self.model_input(x)
        timestep = self.timestep(sigma, batch).to(self.dtype)
        scale = self.vae_scale_factor
        shared = dict(
            hidden_states=hidden, timestep=timestep,
            visual_rope_pos=[torch.arange(frames, device=x.device), torch.arange(height // 2, device=x.device),
                             torch.arange(width // 2, device=x.device)],
            scale_factor=self.pipe._get_scale_factor(height * scale, width * scale),
            sparse_params=self.pipe.get_sparse_params(hidden, x.device), return_dict=True,
        )

        def run(embeds: Tensor, pooled: Tensor) -> Tensor:
            text_positions = torch.arange(embeds.shape[1], device=x.device)
            return self.run_transformer(encoder_hidden_states=embeds, pooled_projections=pooled,
                                        text_rope_pos=text_positions, **shared).sample

        v = run(cond.embeds, cond.pooled)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale)
            v = guided(v, run(cond.negative_embeds, cond.negative_pooled), guidance_scale)
        return v.permute(0, 4, 1, 2, 3).contiguous()

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        return {}
