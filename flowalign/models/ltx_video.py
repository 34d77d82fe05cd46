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


class LTXTokenPacking:
    """The LTX line's latents-to-tokens packing, shared by LTX-Video and LTX-2 (their pipelines' ``_pack_latents`` /
    ``_unpack_latents`` with the transformer's spatial and temporal patch sizes), and its fp32 noise: both pipelines
    draw ``prepare_latents``' noise in fp32 before packing. Mixed in before ``VideoFlowModel``."""

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """fp32 noise ``[B, C, f, h, w]`` by default, as the pipeline's ``prepare_latents`` draws it before packing."""
        return super().prepare_noise(batch, image_size, generator=generator, dtype=dtype or torch.float32)

    def pack(self, latents: Tensor) -> Tensor:
        """``[B, C, f, h, w]`` to the pipeline's tokens ``[B, N, D]`` (its ``_pack_latents``)."""
        return self.pipe._pack_latents(latents, self.pipe.transformer_spatial_patch_size,
                                       self.pipe.transformer_temporal_patch_size)

    def unpack(self, tokens: Tensor, grid: Sequence[int]) -> Tensor:
        """``pack``'s inverse for the token grid ``(f, h, w)`` (the pipeline's ``_unpack_latents``)."""
        return self.pipe._unpack_latents(tokens, *grid, self.pipe.transformer_spatial_patch_size,
                                         self.pipe.transformer_temporal_patch_size)

    def token_grid(self, latents: Tensor) -> tuple[int, int, int]:
        """The transformer's ``(num_frames, height, width)`` in tokens for latents ``[B, C, f, h, w]``."""
        f, h, w = latents.shape[-3:]
        patch, patch_t = self.pipe.transformer_spatial_patch_size, self.pipe.transformer_temporal_patch_size
        return f // patch_t, h // patch, w // patch


@register_model_family("ltx_video")
class LTXVideoModel(LTXTokenPacking, VideoFlowModel):
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

    # diffusers 0.42.1's Ulysses attention splits the heads of q, k and v but not of an attention mask that has
    # them: LTX's processor repeats the text mask over every head ([B, heads, 1, L]), so the cross-attention's mask
    # meets heads / degree heads and sdpa refuses the broadcast (measured on 2 gloo processes, the tiny LTX-Video)
    context_parallel_refusal = ("diffusers' Ulysses attention does not split the per-head text mask that LTX's "
                                "attention processor builds, so its cross-attention fails under a split")

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
        return self.masked_pipeline_cond(prompts, negative_prompts)

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


# ``Cond.extras`` key of the I2V family's first-frame latents ``[B, C, 1, h, w]`` (normalised as the pipeline does).
FIRST_FRAME = "ltx_first_frame"


@register_model_family("ltx_video_i2v")
class LTXImageToVideoModel(LTXVideoModel):
    """Adapter over ``diffusers.LTXImageToVideoPipeline`` (LTX-Video I2V): the video's first latent frame is the
    condition image's latents, kept fixed, and the transformer sees it at timestep 0.

    The pipeline (``prepare_latents`` and its loop):

    * encodes the condition image (resized to the video's frame size by its ``VideoProcessor``) one image per VAE
      call, a draw from the posterior with the call's generator (``retrieve_latents``), normalised by
      ``_normalize_latents`` with the VAE's statistics buffers and *no* scaling factor (1 in the released VAE);
    * then draws the noise ``[B, C, f, h, w]`` from the same generator and puts the condition in frame 0
      (``latents = cond * mask + noise * (1 - mask)``, ``mask`` 1 on frame 0);
    * gives the transformer a timestep per token, ``1000 sigma (1 - mask)``: 0 on the first frame's tokens;
    * steps only frames ``1:`` (``scheduler.step`` on ``latents[:, :, 1:]``), so frame 0 stays the condition bit for
      bit.

    The adapter's state is the whole latent video ``[B, C, f, h, w]``. ``encode(..., images=)`` stores the condition
    in ``Cond.extras`` (``FIRST_FRAME``): a draw with ``generator`` as the pipeline's, or the posterior's mode without
    one (the default: one fixed condition per image, as the trainer wants). ``velocity`` puts the condition in frame 0
    of what the transformer sees (whatever the state holds there), the per-token timesteps as the pipeline's, and
    returns on frames ``1:`` the transformer's velocity and on frame 0 ``(x_0 - c) / sigma``: the velocity of the
    straight path from the state's frame 0 to the condition, independent of the weights. So:

    * started from ``start_latents(noise, cond)`` (frame 0 already the condition, the pipeline's start), frame 0's
      velocity is exactly 0 and the ODE rollout is the pipeline's bit for bit, frame 0 included;
    * started from plain noise (the trainer's ``prepare_noise``), frame 0 flows onto the condition, reaching it at
      sigma 0 within fp32 rounding; frames ``1:`` see the same transformer inputs as in the pipeline;
    * under an SDE kind frame 0 is a coordinate whose prediction is the condition itself: its mean and noise terms do
      not depend on the weights, so it contributes the same term to every log-prob of a transition under any
      weights and cancels in each ratio (it is not frozen bit for bit there: the SDE's noise moves it and the next
      step pulls it back; freezing it exactly would need a per-coordinate mask in the samplers).

    Condition images are resized to ``image_size`` (an ``encode`` keyword; None is each image's own size, rounded
    down to the VAE's multiple); the sampled frame size must be that size (``velocity`` refuses another, naming both).
    """

    family = "ltx_video_i2v"
    pipeline_class_name = "LTXImageToVideoPipeline"
    takes_condition_images = True
    max_condition_images = 1
    # Every prompt needs its first frame: a prompt file without one per entry is refused before the model loads
    # (flowalign.data.condition_images.check_family_takes).
    requires_condition_images = True

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None, image_size: int | Sequence[int] | None = None,
               generator: torch.Generator | list[torch.Generator] | None = None) -> Cond:
        """T5 embeddings and masks as ``LTXVideoModel``, and each prompt's condition image's latents (exactly one
        per prompt) in ``extras[FIRST_FRAME]``: a posterior draw with ``generator`` (one, used in turn, or one per
        prompt: the pipeline's ``prepare_latents``), its mode without."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = self.condition_images(images, len(prompts))
        missing = [i for i, row in enumerate(rows or [[] for _ in prompts]) if not row]
        if missing:
            raise ValueError(f"model family {self.family!r} generates each video from its first frame: give one "
                             f"condition image per prompt (encode(images=[...]); in a prompt file each entry's "
                             f"\"images\": [path]); prompts {missing} have none")
        cond = self.text_cond(prompts, negative_prompts)
        cond.extras[FIRST_FRAME] = self.first_frame_latents([row[0] for row in rows], image_size, generator)
        return cond

    def condition_pixels(self, image, image_size: int | Sequence[int] | None) -> Tensor:
        """One condition image as the pipeline's ``VideoProcessor.preprocess`` makes it, ``[1, 3, H, W]`` in [-1, 1],
        resized to ``image_size`` (None: the image's own size rounded down to the VAE's multiple)."""
        from .base import as_image_size

        if image_size is None:
            height, width = (image.shape[-2:] if isinstance(image, Tensor) else (image.height, image.width))
            multiple = self.vae_scale_factor
            image_size = (height // multiple * multiple, width // multiple * multiple)
        height, width = as_image_size(image_size, self.default_image_size)
        return self.pipe.video_processor.preprocess(image, height=height, width=width)

    def first_frame_latents(self, images: list, image_size, generator) -> Tensor:
        """The condition images' normalised latents ``[B, C, 1, h, w]``, fp32, as ``prepare_latents`` computes them
        (posterior draws with ``generator``, the mode without)."""
        from diffusers.pipelines.ltx.pipeline_ltx_image2video import retrieve_latents

        pixels = torch.cat([self.condition_pixels(image, image_size) for image in images])
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        vae = self.pipe.vae
        latents = []
        for i, image in enumerate(pixels):
            posterior = vae.encode(image.unsqueeze(0).unsqueeze(2).to(vae.dtype))
            if generator is None:
                latents.append(retrieve_latents(posterior, sample_mode="argmax"))
            else:
                latents.append(retrieve_latents(posterior, generator[i] if isinstance(generator, list) else generator))
        latents = torch.cat(latents).to(torch.float32)
        return self.pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std)

    def first_frame(self, latents: Tensor, cond: Cond) -> Tensor:
        """``cond``'s condition latents in ``latents``' dtype, checked against the sampled frame size."""
        if FIRST_FRAME not in cond.extras:
            raise ValueError(f"model family {self.family!r}: this Cond has no condition image latents; encode the "
                             "prompts with images=[...] (one condition image per prompt)")
        first = cond.extras[FIRST_FRAME]
        if first.shape[-2:] != latents.shape[-2:]:
            scale = self.vae_scale_factor
            raise ValueError(f"the condition images were encoded at {first.shape[-2] * scale}x{first.shape[-1] * scale}"
                             f" px but the video is sampled at {latents.shape[-2] * scale}x{latents.shape[-1] * scale}:"
                             " encode them at the sampled size (encode(..., image_size=)) or sample at theirs")
        return first.to(device=latents.device, dtype=latents.dtype)

    def start_latents(self, noise: Tensor, cond: Cond) -> Tensor:
        """The pipeline's start state: ``noise`` with its first frame replaced by the condition
        (``cond * mask + noise * (1 - mask)``, bitwise: the mask is 0 or 1)."""
        return torch.cat([self.first_frame(noise, cond), noise[:, :, 1:]], dim=2)

    def conditioning_mask(self, latents: Tensor) -> Tensor:
        """The pipeline's packed conditioning mask ``[B, N]``, fp32: 1 on the first latent frame's tokens."""
        batch, _, frames, height, width = latents.shape
        mask = torch.zeros((batch, 1, frames, height, width), device=latents.device, dtype=torch.float32)
        mask[:, :, 0] = 1.0
        return self.pack(mask).squeeze(-1)

    def transformer_tokens(self, latents: Tensor, cond: Cond) -> Tensor:
        return self.start_latents(latents, cond)

    def token_timestep(self, timestep: Tensor, latents: Tensor, cond: Cond) -> Tensor:
        """``timestep [B]`` per token, ``t (1 - mask)``: 0 on the condition frame (the pipeline's)."""
        return timestep.unsqueeze(-1) * (1 - self.conditioning_mask(latents))

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """The transformer's velocity on frames ``1:`` (condition in frame 0, per-token timesteps, CFG batched) and
        ``(x_0 - c) / sigma`` on frame 0 (see the class docstring)."""
        v = self.transformer_velocity(x, sigma, cond, guidance_scale)
        first = self.first_frame(x, cond).float()
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        sigma = sigma.view(-1, *([1] * (x.ndim - 1))) if sigma.ndim else sigma
        return torch.cat([(x[:, :, :1].float() - first) / sigma, v[:, :, 1:]], dim=2)
