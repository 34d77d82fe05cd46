"""VideoFlowModel: the FlowModel interface over diffusers' flow-matching video pipelines.

A video family differs from an image family in its shapes only; rollouts, credit, losses and objectives reduce over
every axis but the batch, so they take video latents unchanged:

* latents are diffusers' ``[B, C, f, h, w]`` (``f`` latent frames); ``num_frames`` pixel frames are sampled
  (the adapter's ``num_frames``, set at construction: ``sampling.num_frames`` in a config);
* ``decode(latents)`` returns videos ``[B, F, 3, H, W]`` in [0, 1], fp32 (frames first, as diffusers'
  ``VideoProcessor.postprocess_video(output_type="pt")``), one video per VAE call by default (``vae_batch``),
  with the VAE's own spatial tiling when ``vae_tiling`` is set;
* ``encode_videos(videos)`` is decode's inverse through the family's VAE path; ``encode_images`` encodes one-frame
  videos ``[B, C, 1, h, w]``.

The causal video VAEs (Wan, HunyuanVideo, LTX, ...) compress ``t`` frames into one after the first: valid frame
counts are ``k t + 1`` (``temporal_compression``), checked with a clear error before anything runs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, FlowModel, as_image_size


class VideoFlowModel(FlowModel):
    """Base adapter for video families; subclasses set ``family``, ``pipeline_class_name``, ``lora_targets``,
    ``default_num_frames`` and the family-specific parts (``encode``, ``velocity``, ``scheduler_kwargs``, and the
    VAE's normalisation in ``to_vae_space`` / ``from_vae_space``).

    Args:
        pipe: the diffusers video pipeline to wrap.
        max_sequence_length: the text encoders' token limit; None is the family's default.
        num_frames: pixel frames per sampled video; None is ``default_num_frames``.
        vae_batch: videos per VAE call, decoding and encoding (1 holds one video's frames at a time).
        vae_tiling: decode and encode with the VAE's own spatial tiling (``vae.enable_tiling()``).
    """

    modality = "video"
    # Frames sampled when none are asked for: small enough for a CPU (the pipelines' own defaults are 49-121).
    default_num_frames: int = 9
    # Frames per second the family's videos are made for (what the pipelines' examples export at): mp4 files and
    # tracker videos play at it unless told otherwise.
    fps: int = 16

    def __init__(self, pipe, *, max_sequence_length: int | None = None, num_frames: int | None = None,
                 vae_batch: int = 1, vae_tiling: bool = False):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        self.num_frames = self.check_num_frames(self.default_num_frames if num_frames is None else num_frames)
        if not isinstance(vae_batch, int) or vae_batch < 1:
            raise ValueError(f"vae_batch must be a positive integer (videos per VAE call), got {vae_batch!r}")
        self.vae_batch = vae_batch
        self.vae_tiling = bool(vae_tiling)
        if self.vae_tiling:
            pipe.vae.enable_tiling()

    # --- frames ---------------------------------------------------------------------------------------------------
    @property
    def temporal_compression(self) -> int:
        """The VAE's temporal downsampling ``t``: valid frame counts are ``k t + 1``."""
        return int(getattr(self.pipe, "vae_scale_factor_temporal", 1))

    @property
    def vae_scale_factor(self) -> int:
        """The VAE's spatial downsampling."""
        return int(self.pipe.vae_scale_factor_spatial)

    def check_num_frames(self, num_frames: int) -> int:
        """``num_frames`` when the family's VAE takes it, else a ValueError naming ``sampling.num_frames`` and the
        nearest valid counts.

        Args:
            num_frames: pixel frames per video.

        Returns:
            ``num_frames``.
        """
        t = self.temporal_compression
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"sampling.num_frames must be a positive integer, got {num_frames!r}")
        if (num_frames - 1) % t:
            below = (num_frames - 1) // t * t + 1
            raise ValueError(f"sampling.num_frames={num_frames}: the {self.family or 'model'} VAE compresses {t} "
                             f"frames into one after the first, so the frame count must be {t}k+1: use {below} or "
                             f"{below + t}")
        return num_frames

    def latent_frames(self, num_frames: int | None = None) -> int:
        """Latent frames for ``num_frames`` pixel frames: ``(num_frames - 1) / t + 1``.

        Args:
            num_frames: pixel frames; None is the adapter's ``num_frames``.

        Returns:
            The number of latent frames.
        """
        frames = self.num_frames if num_frames is None else self.check_num_frames(num_frames)
        return (frames - 1) // self.temporal_compression + 1

    def latent_shape(self, batch: int, image_size: int | Sequence[int] | None = None) -> tuple[int, ...]:
        """``(B, in_channels, f, H / s, W / s)``: the noise of ``num_frames`` frames at ``image_size``.

        Args:
            batch: the number of videos.
            image_size: the frame size in pixels (an int or ``(height, width)``); None is the default.

        Returns:
            The shape of the initial noise.
        """
        height, width = as_image_size(image_size, self.default_image_size)
        scale = self.vae_scale_factor
        return (batch, self.latent_channels, self.latent_frames(), height // scale, width // scale)

    @property
    def latent_channels(self) -> int:
        """Channels of the noise latents (the transformer's ``in_channels`` unless the family concatenates a
        condition to them)."""
        return int(self.transformer.config.in_channels)

    # --- text ------------------------------------------------------------------------------------------------------
    def masked_pipeline_cond(self, prompts: list[str], negative_prompts: Sequence[str] | None) -> Cond:
        """The ``Cond`` of a pipeline whose ``encode_prompt`` returns ``(embeds, mask, negative, negative_mask)``
        (LTX-Video, Mochi): the prompts' embeddings and masks, and the negatives' when given.

        Args:
            prompts: the batch's prompts.
            negative_prompts: one negative prompt per prompt, or None.

        Returns:
            The ``Cond``.
        """
        with_negative = negative_prompts is not None
        embeds, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        if not with_negative:
            return Cond(embeds, mask=mask)
        return Cond(embeds, mask=mask, negative_embeds=negative, negative_mask=negative_mask)

    # --- the VAE --------------------------------------------------------------------------------------------------
    def to_vae_space(self, latents: Tensor) -> Tensor:
        """The transformer's latents to the VAE's own space (the family's normalisation undone). Default: the
        VAE config's ``scaling_factor`` (and ``shift_factor``) as the image families.

        Args:
            latents: ``[B, C, f, h, w]``.

        Returns:
            The latents in the VAE's space, in the VAE's dtype.
        """
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        return latents / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)

    def from_vae_space(self, latents: Tensor) -> Tensor:
        """``to_vae_space``'s inverse: the VAE's posterior latents to the transformer's.

        Args:
            latents: ``[B, C, f, h, w]`` in the VAE's space.

        Returns:
            The normalised latents.
        """
        vae = self.pipe.vae
        return (latents - (getattr(vae.config, "shift_factor", None) or 0.0)) * vae.config.scaling_factor

    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, f, h, w]`` to videos ``[B, F, 3, H, W]`` in [0, 1], fp32, as the pipeline's decode and
        ``postprocess_video``: ``vae_batch`` videos per VAE call. Differentiable.

        Args:
            latents: video latents in the layout ``velocity`` takes.

        Returns:
            Videos ``[B, F, 3, H, W]`` in [0, 1].
        """
        chunks = [self.decode_vae_latents(self.to_vae_space(chunk)) for chunk in latents.split(self.vae_batch)]
        return torch.cat(chunks)

    def decode_vae_latents(self, latents: Tensor) -> Tensor:
        """VAE-space latents ``[b, C, f, h, w]`` to videos ``[b, F, 3, H, W]`` in [0, 1], fp32: the VAE's decode,
        then ``(x / 2 + 0.5).clamp(0, 1)`` with the frame axis moved before the channels.

        Args:
            latents: latents in the VAE's space.

        Returns:
            Videos ``[b, F, 3, H, W]``.
        """
        vae = self.pipe.vae
        video = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)

    def encode_videos(
        self,
        videos: Tensor,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        sample: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Tensor:
        """Videos in [0, 1], ``[B, F, 3, H, W]`` (what ``decode`` returns), to latents ``[B, C, f, h, w]``: ``2 x - 1``
        through the VAE's encoder in its dtype (``vae_batch`` videos per call), the posterior's mode (or a draw with ``sample=True``), then the
        family's normalisation (``from_vae_space``). Differentiable.

        Args:
            videos: ``[B, F, 3, H, W]`` float in [0, 1]; ``F`` a frame count the VAE takes.
            generator: for ``sample=True``: one generator, or one per row.
            sample: draw from the VAE's posterior instead of taking its mode.
            dtype: the latents' dtype; None is the transformer's.

        Returns:
            Latents ``[B, C, f, h, w]``.
        """
        self._check_videos(videos)
        vae = self.pipe.vae
        pixels = (2.0 * videos.float() - 1.0).permute(0, 2, 1, 3, 4).to(device=vae.device, dtype=vae.dtype)
        generators = generator if isinstance(generator, list) else [generator] * len(pixels)
        chunks = []
        for start in range(0, len(pixels), self.vae_batch):
            posterior = vae.encode(pixels[start:start + self.vae_batch]).latent_dist
            rows = generators[start:start + self.vae_batch]
            chunks.append(posterior.sample(rows if isinstance(generator, list) else generator) if sample
                          else posterior.mode())
        latents = self.from_vae_space(torch.cat(chunks))
        batch, frames = videos.shape[:2]
        height, width = videos.shape[-2:]
        expected = (batch, self.latent_channels, (frames - 1) // self.temporal_compression + 1,
                    height // self.vae_scale_factor, width // self.vae_scale_factor)
        if tuple(latents.shape) != expected:
            raise RuntimeError(f"the VAE encodes {tuple(videos.shape)} videos to latents {tuple(latents.shape)}, but "
                               f"the transformer takes {expected}: the VAE's z_dim does not match its in_channels")
        return latents.to(dtype or self.dtype)

    def encode_images(self, images: Tensor, *, generator=None, sample: bool = False,
                      dtype: torch.dtype | None = None) -> Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] as one-frame videos: latents ``[B, C, 1, h, w]`` (``encode_videos``).

        Args:
            images: ``[B, 3, H, W]`` float in [0, 1].
            generator: for ``sample=True``: one generator, or one per row.
            sample: draw from the VAE's posterior instead of taking its mode.
            dtype: the latents' dtype; None is the transformer's.

        Returns:
            Latents ``[B, C, 1, h, w]``.
        """
        self._check_images(images)
        return self.encode_videos(images[:, None], generator=generator, sample=sample, dtype=dtype)

    def _check_videos(self, videos: Tensor) -> None:
        """A clear ValueError for input ``encode_videos`` cannot take: type, rank, frame count, then each frame as
        ``encode_images`` checks images."""
        if not isinstance(videos, Tensor):
            raise ValueError(f"encode_videos takes a torch.Tensor of videos [B, F, 3, H, W], got "
                             f"{type(videos).__name__}")
        if videos.ndim != 5:
            hint = " (a single video: add the batch dimension with videos[None])" if videos.ndim == 4 else ""
            raise ValueError(f"encode_videos takes videos of rank 5 [B, F, 3, H, W], got rank {videos.ndim} "
                             f"{tuple(videos.shape)}{hint}")
        frames = videos.shape[1]
        if (frames - 1) % self.temporal_compression:
            raise ValueError(f"encode_videos: {frames} frames; the {self.family or 'model'} VAE takes "
                             f"{self.temporal_compression}k+1 frames")
        self._check_images(videos.flatten(0, 1))
