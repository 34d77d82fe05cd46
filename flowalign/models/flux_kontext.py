"""FLUX.1-Kontext adapter: FLUX with a condition image in the token sequence.

Conventions (those of ``diffusers.FluxKontextPipeline``, reproduced bit for bit):

* Everything FLUX does (``flowalign.models.flux``): 2x2 packing of unpacked ``[B, C, h, w]`` latents, timestep
  ``sigma * 1000`` rounded to the latents' dtype then ``/ 1000``, the guidance embedding (FLUX.1-Kontext-dev) or true
  CFG, the resolution-dependent ``mu`` from the generated image's token count only.
* A prompt's condition image is preprocessed by the pipeline's image processor at its own size floored to a multiple
  of ``2 * vae_scale_factor`` (the pipeline with ``_auto_resize=False``: flowalign does not snap it to Kontext's
  preferred resolutions; resize it beforehand for that), VAE-encoded with the pipeline's ``_encode_vae_image``
  (the posterior mean, ``(z - shift) * scale``) and kept unpacked in ``Cond.extras["condition_latents"]``, one row
  per prompt, so indexing and grouping the conditioning carries it.
* In ``velocity`` its packed tokens follow the image tokens in the sequence, with position ids ``(1, row, col)``
  (the generated image's are ``(0, row, col)``); the velocity is read on the generated image's tokens only.
* Without condition images the model is FLUX. Rows whose condition images differ in size (or that have none) are
  run in separate transformer calls, one per size (``extras["condition_size"]``: the latent ``(h, w)``, ``(0, 0)``
  for none); a batch whose rows share one size is one call, as the pipeline's.
* The generated image's size is the requested one (the pipeline rescales every request to ``max_area``, 1024^2 by
  default: call it with ``max_area=height * width`` to compare).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .flux import FluxModel, pack_latents

CONDITION_LATENTS = "condition_latents"
CONDITION_SIZE = "condition_size"


@register_model_family("flux_kontext")
class FluxKontextModel(FluxModel):
    """Adapter over ``diffusers.FluxKontextPipeline``: FLUX plus one condition image per prompt (module docstring)."""

    context_parallel_refusal = ("its condition image's tokens are appended to the sequence, which the context-parallel "
                                "checks do not count yet")

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        return None

    family = "flux_kontext"
    pipeline_class_name = "FluxKontextPipeline"
    takes_condition_images = True
    max_condition_images = 1

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence[Any] | None = None) -> Cond:
        """Prompt embeddings as FLUX's; ``images[i]``: prompt ``i``'s condition image (a tensor ``[3, H, W]`` in
        [0, 1] or a PIL image; None for none), VAE-encoded into ``extras``."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = self.condition_images(images, len(prompts))
        cond = self._encode_text(prompts, negative_prompts)
        if rows is not None:
            latents, sizes = self.encode_condition_images([row[0] if row else None for row in rows],
                                                          dtype=cond.embeds.dtype)
            cond.extras[CONDITION_LATENTS], cond.extras[CONDITION_SIZE] = latents, sizes
        return cond

    def preprocess_condition_image(self, image: Any) -> Tensor:
        """One condition image as the pipeline's image processor makes it: ``[1, 3, H', W']`` in [-1, 1], the sides
        floored to a multiple of ``2 * vae_scale_factor``."""
        processor = self.pipe.image_processor
        if isinstance(image, Tensor):
            image = image[None].float()
        height, width = processor.get_default_height_width(image)
        multiple = self.vae_scale_factor * 2
        height, width = height // multiple * multiple, width // multiple * multiple
        if height < multiple or width < multiple:
            raise ValueError(f"a condition image of {processor.get_default_height_width(image, 0, 0)} is too small: "
                             f"both sides must be at least {multiple} pixels")
        return processor.preprocess(image, height, width)

    def encode_condition_images(self, images: Sequence[Any], *, dtype: torch.dtype | None = None
                                ) -> tuple[Tensor, Tensor]:
        """``(latents [B, C, h, w], sizes [B, 2])`` for one condition image (or None) per row: the pipeline's
        ``_encode_vae_image`` of each preprocessed image, rows of one size encoded in one VAE batch; zero-padded to
        the largest latent size, ``sizes`` the latent ``(h, w)`` of each row (``(0, 0)`` for none)."""
        dtype = dtype or self.dtype
        pixels = [None if image is None else self.preprocess_condition_image(image) for image in images]
        encoded: list[Tensor | None] = [None] * len(pixels)
        by_size: dict[tuple[int, int], list[int]] = {}
        for row, p in enumerate(pixels):
            if p is not None:
                by_size.setdefault(tuple(p.shape[-2:]), []).append(row)
        for rows in by_size.values():
            batch = torch.cat([pixels[r] for r in rows]).to(device=self.device, dtype=dtype)
            latents = self.pipe._encode_vae_image(batch, generator=None)
            for k, r in enumerate(rows):
                encoded[r] = latents[k]
        present = [latent for latent in encoded if latent is not None]
        channels = present[0].shape[0]
        height = max(latent.shape[-2] for latent in present)
        width = max(latent.shape[-1] for latent in present)
        out = torch.zeros(len(encoded), channels, height, width, device=present[0].device, dtype=present[0].dtype)
        sizes = torch.zeros(len(encoded), 2, dtype=torch.long, device=present[0].device)
        for row, latent in enumerate(encoded):
            if latent is not None:
                out[row, :, : latent.shape[-2], : latent.shape[-1]] = latent
                sizes[row] = torch.tensor(latent.shape[-2:])
        return out, sizes

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        latents = cond.extras.get(CONDITION_LATENTS)
        if latents is None:
            return self._velocity(x, sigma, cond, guidance_scale)
        sizes = cond.extras[CONDITION_SIZE]
        distinct = torch.unique(sizes, dim=0)
        if len(distinct) == 1:
            return self._velocity(x, sigma, cond, guidance_scale, self._context(latents, distinct[0]))
        out = torch.empty_like(x, dtype=self.dtype)
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        for size in distinct:
            rows = (sizes == size).all(dim=1).nonzero().flatten()
            part = cond.index(rows)
            row_sigma = sigma[rows.to(sigma.device)] if sigma.ndim > 0 and sigma.numel() == x.shape[0] else sigma
            out[rows.to(x.device)] = self._velocity(x[rows.to(x.device)], row_sigma, part, guidance_scale,
                                                    self._context(part.extras[CONDITION_LATENTS], size))
        return out

    def _context(self, latents: Tensor, size: Tensor) -> tuple[Tensor, Tensor] | None:
        """Packed condition tokens and their ids ``(1, row, col)`` for latents of latent size ``size``; None for
        ``(0, 0)``, rows without a condition image."""
        h, w = int(size[0]), int(size[1])
        if h == 0:
            return None
        tokens = pack_latents(latents[:, :, :h, :w].contiguous())
        ids = self.pipe._prepare_latent_image_ids(latents.shape[0], h // 2, w // 2, self.device, self.dtype)
        ids[..., 0] = 1
        return tokens, ids
