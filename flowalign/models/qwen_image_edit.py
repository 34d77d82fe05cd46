"""Qwen-Image-Edit-Plus adapter: Qwen-Image conditioned on source images, through the VL encoder and the VAE.

Conventions of ``diffusers.QwenImageEditPlusPipeline`` reproduced here (everything else is Qwen-Image's:
``flowalign.models.qwen_image``: 2x2 packing, ``sigma * 1000`` rounded to the latents' dtype then ``/ 1000``, true CFG
with its norm rescaling, the per-channel VAE normalisation, ``mu`` from the generated image's token count only):

* condition images: each prompt takes any number (the model card recommends 1 to 3). Each is resized twice, as the
  pipeline does, keeping its aspect ratio: to about ``CONDITION_IMAGE_SIZE`` pixels (384^2) for the VL encoder and
  to about ``VAE_IMAGE_SIZE`` pixels (1024^2) for the VAE, both sides rounded to multiples of 32
  (``calculate_dimensions``).
  The two areas are ``pipeline_qwenimage_edit_plus``'s module constants, read when encoding (set ``vl_image_area`` /
  ``vae_image_area`` on the adapter to use others). The pipeline takes PIL images: a tensor ``[3, H, W]`` in [0, 1]
  is rounded to 8 bits first, as ``VaeImageProcessor.numpy_to_pil`` does.
* text: the edit system prompt (``prompt_template_encode``) with ``"Picture k: <|vision_start|><|image_pad|>
  <|vision_end|>"`` for each condition image before the instruction; the processor expands each ``<|image_pad|>`` to
  the image's vision tokens and the Qwen2.5-VL encoder sees the images (the prompt embeddings depend on them); the
  first ``prompt_template_encode_start_idx`` (64) tokens are dropped. The pipeline encodes one prompt per call, so
  the adapter encodes each prompt (and its negative, with the same images) on its own and right-pads the batch with
  zeros and a mask, as Qwen-Image's batches are.
* latents: each condition image is VAE-encoded (the posterior mode, ``(z - mean) / std``), packed 2x2 and its tokens
  put after the generated image's, in the prompt's order; ``img_shapes`` lists the generated image then every
  condition image ``(1, h/2, w/2)``, so the rotary embedding covers each at its own size (a condition image of
  another size or aspect ratio than the output is positioned correctly; omitting them from ``img_shapes`` is the
  rotary length mismatch users meet). The velocity is read on the generated image's tokens only. The packed tokens
  sit in ``Cond.extras["condition_tokens"]`` (zero-padded per row) with ``extras["condition_shapes"]``, each row's
  ``(h/2, w/2)`` per image, ``(0, 0)`` past its last: rows of different shapes run in separate transformer calls
  (the rotary embedding takes one shape list per call).
* without condition images a prompt is encoded with the edit template and no image (the pipeline's ``encode_prompt``
  with ``image=None``) and denoised as Qwen-Image; ``QwenImageEditPlusPipeline`` itself always needs an image.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .flux import pack_latents
from .qwen_image import QwenImageModel

CONDITION_TOKENS = "condition_tokens"
CONDITION_SHAPES = "condition_shapes"


def fit_area(area: int, ratio: float) -> tuple[int, int]:
    """``(width, height)`` of about ``area`` pixels at aspect ratio ``ratio = width / height``, each a multiple of 32
    (the pipeline's ``calculate_dimensions``)."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@register_model_family("qwen_image_edit_plus")
class QwenImageEditPlusModel(QwenImageModel):
    """Adapter over ``diffusers.QwenImageEditPlusPipeline``: Qwen-Image plus condition images (module docstring)."""

    family = "qwen_image_edit_plus"
    pipeline_class_name = "QwenImageEditPlusPipeline"
    takes_condition_images = True
    max_condition_images = None
    vl_image_area: int | None = None  # None: the pipeline module's CONDITION_IMAGE_SIZE
    vae_image_area: int | None = None  # None: the pipeline module's VAE_IMAGE_SIZE
    context_parallel_refusal = ("its condition images' tokens, appended to the split image sequence, are as many as "
                                "each condition image's aspect ratio gives, which neither the config check nor a "
                                "test covers yet")

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        return None

    def image_areas(self) -> tuple[int, int]:
        """The pixel areas condition images are resized to: ``(VL encoder, VAE)``."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        return (self.vl_image_area or plus.CONDITION_IMAGE_SIZE, self.vae_image_area or plus.VAE_IMAGE_SIZE)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence[Any] | None = None) -> Cond:
        """Prompt embeddings through the VL encoder with each prompt's condition images (``images[i]``: a PIL
        image, a tensor ``[3, H, W]`` in [0, 1], a list of them, or None), and the images' packed VAE tokens."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = self.condition_images(images, len(prompts)) or [[] for _ in prompts]
        prepared = [[self.prepare_condition_image(image) for image in row] for row in rows]
        vl_images = [[vl for vl, _ in row] or None for row in prepared]
        embeds, mask = self._encode_rows(prompts, vl_images)
        cond = Cond(embeds, mask=mask)
        if negative_prompts is not None:
            cond.negative_embeds, cond.negative_mask = self._encode_rows(list(negative_prompts), vl_images)
        if any(prepared):
            tokens, shapes = self.condition_tokens([[pixels for _, pixels in row] for row in prepared],
                                                   dtype=embeds.dtype)
            cond.extras[CONDITION_TOKENS], cond.extras[CONDITION_SHAPES] = tokens, shapes
        return cond

    def prepare_condition_image(self, image: Any) -> tuple[Any, Tensor]:
        """One condition image as the pipeline prepares it: ``(the PIL image resized for the VL encoder, the VAE's
        pixels [1, 3, 1, H, W] in [-1, 1])``."""
        processor = self.pipe.image_processor
        if isinstance(image, Tensor):
            image = processor.numpy_to_pil(image.detach().float().permute(1, 2, 0).cpu().numpy()[None])[0]
        width, height = image.size
        vl_area, vae_area = self.image_areas()
        vl_width, vl_height = fit_area(vl_area, width / height)
        vae_width, vae_height = fit_area(vae_area, width / height)
        return (processor.resize(image, vl_height, vl_width),
                processor.preprocess(image, vae_height, vae_width).unsqueeze(2))

    def _encode_rows(self, prompts: list[str], vl_images: list[list[Any] | None]) -> tuple[Tensor, Tensor]:
        """Each prompt encoded on its own with its VL images (the pipeline's ``encode_prompt``, one prompt per
        call), right-padded with zeros to the longest, with the mask."""
        if len(prompts) != len(vl_images):
            raise ValueError(f"{len(prompts)} negative prompts for {len(vl_images)} prompts: give one per prompt")
        encoded = [self.pipe.encode_prompt(prompt=[prompt], image=images, device=self.device)[0][0]
                   for prompt, images in zip(prompts, vl_images)]
        length = max(e.shape[0] for e in encoded)
        embeds = torch.stack([torch.cat([e, e.new_zeros(length - e.shape[0], e.shape[1])]) for e in encoded])
        mask = torch.zeros(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        for row, e in enumerate(encoded):
            mask[row, : e.shape[0]] = 1
        return embeds, mask

    def condition_tokens(self, rows: Sequence[Sequence[Tensor]], *, dtype: torch.dtype | None = None
                         ) -> tuple[Tensor, Tensor]:
        """``(tokens [B, M, 4C], shapes [B, K, 2])`` for each row's VAE pixels: each image encoded by the pipeline's
        ``_encode_vae_image`` and packed, a row's images one after another, zero-padded to the longest row;
        ``shapes`` the ``(h/2, w/2)`` of each image, ``(0, 0)`` past a row's last."""
        dtype = dtype or self.dtype
        packed: list[list[Tensor]] = []
        for row in rows:
            packed.append([])
            for pixels in row:
                latents = self.pipe._encode_vae_image(pixels.to(device=self.device, dtype=dtype), generator=None)
                packed[-1].append(pack_latents(latents[:, :, 0]))
        present = [t for row in packed for t in row]
        width = present[0].shape[-1]
        length = max(sum(t.shape[1] for t in row) for row in packed)
        most = max(len(row) for row in packed)
        tokens = present[0].new_zeros(len(rows), length, width)
        shapes = torch.zeros(len(rows), most, 2, dtype=torch.long, device=present[0].device)
        for r, (row, sources) in enumerate(zip(packed, rows)):
            if row:
                joined = torch.cat(row, dim=1)[0]
                tokens[r, : joined.shape[0]] = joined
            for k, pixels in enumerate(sources):
                scale = self.vae_scale_factor * 2
                shapes[r, k] = torch.tensor([pixels.shape[-2] // scale, pixels.shape[-1] // scale])
        return tokens, shapes

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        shapes = cond.extras.get(CONDITION_SHAPES)
        if shapes is None:
            return self._velocity(x, sigma, cond, guidance_scale)
        distinct = torch.unique(shapes, dim=0)
        if len(distinct) == 1:
            return self._velocity(x, sigma, cond, guidance_scale, self._context(cond.extras[CONDITION_TOKENS],
                                                                                distinct[0]))
        out = torch.empty_like(x, dtype=self.dtype)
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        for signature in distinct:
            rows = (shapes == signature).flatten(1).all(dim=1).nonzero().flatten()
            part = cond.index(rows)
            row_sigma = sigma[rows.to(sigma.device)] if sigma.ndim > 0 and sigma.numel() == x.shape[0] else sigma
            out[rows.to(x.device)] = self._velocity(x[rows.to(x.device)], row_sigma, part, guidance_scale,
                                                    self._context(part.extras[CONDITION_TOKENS], signature))
        return out

    @staticmethod
    def _context(tokens: Tensor, signature: Tensor) -> tuple[Tensor, list[tuple[int, int, int]]] | None:
        """The condition tokens and ``img_shapes`` entries of rows sharing ``signature`` (their images' shapes);
        None for rows without condition images."""
        shapes = [(1, int(h), int(w)) for h, w in signature.tolist() if h > 0]
        if not shapes:
            return None
        count = sum(h * w for _, h, w in shapes)
        return tokens[:, :count], shapes
