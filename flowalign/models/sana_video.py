"""SANA-Video text-to-video adapter (``diffusers.SanaVideoPipeline``): SANA's text and loop over a causal video VAE.

Conventions (``SanaVideoPipeline.__call__``):

* latents ``[B, C, f, h, w]``, ``f = (frames - 1) / t + 1`` and ``h, w`` the frame size over the VAE's spatial
  factor (the released 480p model: Wan2.1's VAE, ``t = 4``, 8x in space, patches 1x2x2); drawn in fp32 and cast to
  the transformer's dtype for each forward pass, so ``prepare_noise`` draws fp32 noise by default. The pipeline's
  frame-count keyword is ``frames``, not ``num_frames``;
* time: the transformer (``SanaVideoTransformer3DModel``: SANA's linear attention with Wan's rotary embedding and a
  temporal convolution in its feed-forward) takes the scheduler's timestep ``1000 sigma``, with no
  ``timestep_scale``; the velocity's sign is the scheduler's, returned in fp32;
* text: exactly SANA's (``sana_text_cond``: the two pipelines share ``encode_prompt``): Gemma2's last hidden state,
  prompts lower-cased and stripped, padded on the right to ``max_sequence_length`` (300), token 0 plus the last
  ``max_sequence_length - 1`` kept, the tokenizer's attention mask passed as ``encoder_attention_mask``;
* ``complex_human_instruction``: the pipeline's ``__call__`` prefixes a video prompt-enhancing instruction by default;
  this adapter does not (None, as ``encode_prompt``'s default): pass the same list to the adapter to match a pipeline
  call that uses one;
* CFG: one batched pass over ``[negative, positive]``, ``uncond + scale * (text - uncond)`` in fp32 (``sana_velocity``);
  the pipeline's default scale is 6;
* VAE: normalised per channel as the pipeline writes it: ``AutoencoderKLWan`` by its config's ``latents_mean`` and
  ``latents_std``, ``AutoencoderKLLTX2Video`` by its ``latents_mean`` / ``latents_std`` buffers, any other VAE not at
  all; the pipeline's resolution binning (snapping the size to its aspect-ratio bins, then resizing the decoded
  frames back) is not part of the adapter: it samples the size it is given.

The released ``Efficient-Large-Model/SANA-Video_2B_480p_diffusers`` samples 81 frames at 480x832 with
``DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=8, prediction_type="flow_prediction")`` (diffusers'
conversion script); ``sigmas`` reads that scheduler's flow sigmas (the released scheduler passes the integer part of
``1000 sigma`` as the timestep, flowalign passes ``1000 sigma``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .sana import SANA_ATTENTION_TARGETS, sana_max_sequence_length, sana_text_cond, sana_velocity
from .video import VideoFlowModel

# Every attention and MLP projection of a SANA-Video block: the linear self-attention (attn1), the cross-attention
# (attn2), and the feed-forward's pointwise projections (1x1 convolutions in and out; its depthwise and temporal
# convolutions are not projections).
SANA_VIDEO_LORA_TARGETS = SANA_ATTENTION_TARGETS + ("ff.conv_inverted", "ff.conv_point")


@register_model_family("sana_video")
class SanaVideoModel(VideoFlowModel):
    """Adapter over ``diffusers.SanaVideoPipeline`` (SANA-Video T2V).

    Args:
        pipe: the ``SanaVideoPipeline`` to wrap.
        complex_human_instruction: the lines the pipeline prefixes to each prompt (None: none, ``encode_prompt``'s
            default); the other arguments are ``VideoFlowModel``'s.
    """

    family = "sana_video"
    # SanaLinearAttnProcessor3_0: ReLU kernels and key-value sums in its own matmuls (only the cross-attention
    # dispatches); GLUMBConv reshapes the tokens to the latent grid for a 3x3 depthwise convolution.
    context_parallel_refusal = ("its self-attention is linear attention (SanaLinearAttnProcessor3_0: key-value sums "
                                "over the whole sequence in its own matmuls, not diffusers' attention dispatcher), "
                                "and its feed-forward's 3x3 convolution needs each token's neighbours on the latent "
                                "grid")
    pipeline_class_name = "SanaVideoPipeline"
    lora_targets = SANA_VIDEO_LORA_TARGETS
    default_num_frames = 9

    def __init__(self, pipe, *, max_sequence_length: int | None = None, num_frames: int | None = None,
                 vae_batch: int = 1, vae_tiling: bool = False, complex_human_instruction: Sequence[str] | None = None):
        super().__init__(pipe, max_sequence_length=max_sequence_length, num_frames=num_frames, vae_batch=vae_batch,
                         vae_tiling=vae_tiling)
        self.complex_human_instruction = list(complex_human_instruction) if complex_human_instruction else None

    def default_max_sequence_length(self) -> int:
        return sana_max_sequence_length(self.pipe)

    @property
    def default_image_size(self) -> tuple[int, int]:
        """480x832, the pipeline's defaults."""
        return 480, 832

    @property
    def image_multiple(self) -> int:
        """The VAE's spatial downsampling times the transformer's spatial patch, and the pipeline's 32
        (``check_inputs``)."""
        return math.lcm(32, self.vae_scale_factor * int(self.transformer.config.patch_size[1]))

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """fp32 noise by default, as the pipeline's ``prepare_latents``."""
        return super().prepare_noise(batch, image_size, generator=generator, dtype=dtype or torch.float32)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """Gemma2 embeddings and masks as SANA's (``sana_text_cond``). SANA-Video T2V takes no condition images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        return sana_text_cond(self, prompts, negative_prompts)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(x, 1000 sigma, text, mask)`` in fp32, CFG batched (``sana_velocity``)."""
        return sana_velocity(self, x, sigma, cond, guidance_scale)

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        return {}

    def vae_statistics(self, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
        """The per-channel ``(mean, 1 / std)`` as ``[1, C, 1, 1, 1]`` tensors, built as the pipeline builds them
        (cast, then the reciprocal): a Wan VAE's config values, an LTX-2 VAE's buffers, else 0 and 1."""
        from diffusers import AutoencoderKLLTX2Video, AutoencoderKLWan

        vae = self.pipe.vae
        if isinstance(vae, AutoencoderKLLTX2Video):
            mean, std = vae.latents_mean, vae.latents_std
        elif isinstance(vae, AutoencoderKLWan):
            mean, std = torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)
        else:
            mean = torch.zeros(self.latent_channels, device=device, dtype=dtype)
            std = torch.ones(self.latent_channels, device=device, dtype=dtype)
        mean = mean.view(1, -1, 1, 1, 1).to(device, dtype)
        inverse_std = 1.0 / std.view(1, -1, 1, 1, 1).to(device, dtype)
        return mean, inverse_std

    def to_vae_space(self, latents: Tensor) -> Tensor:
        """``x / (1 / std) + mean`` in the VAE's dtype, as the pipeline undoes the normalisation before decoding."""
        latents = latents.to(self.pipe.vae.dtype)
        mean, inverse_std = self.vae_statistics(latents.dtype, latents.device)
        return latents / inverse_std + mean

    def from_vae_space(self, latents: Tensor) -> Tensor:
        """``(z - mean) * (1 / std)``, as ``SanaImageToVideoPipeline.prepare_latents`` normalises its first frame."""
        mean, inverse_std = self.vae_statistics(latents.dtype, latents.device)
        return (latents - mean) * inverse_std
