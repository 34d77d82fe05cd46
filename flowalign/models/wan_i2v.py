"""Wan2.1 image-to-video adapter (``diffusers.WanImageToVideoPipeline``): Wan2.1 T2V plus a first-frame condition.

Conventions of ``WanImageToVideoPipeline.__call__`` reproduced here (everything else is Wan2.1 T2V's:
``flowalign.models.wan``):

* condition image: one per prompt (``images=[...]``), a PIL image or a tensor ``[3, H, W]`` in [0, 1] (rounded to 8
  bits first, as ``VaeImageProcessor.numpy_to_pil`` does: the pipeline takes PIL images). The video is sampled at the
  condition image's size (the pipeline resizes the image to the video's ``height`` x ``width``: give condition images
  at ``sampling.image_size``); every row of a batch has the same size.
* condition latents: the pipeline's own ``prepare_latents`` on the preprocessed image (one row per call, the
  condition encoded by itself as the pipeline encodes one image): the condition video ``[image, zeros]``
  (``num_frames`` frames) through the VAE (posterior mode, ``(z - mean) / std``), after a 4-channel mask that is 1 on
  the first frame's ``t`` sub-frames. ``Cond.extras["condition"]`` holds it, ``[B, 4 + z, f, h, w]`` fp32; the
  transformer's ``hidden_states`` are ``cat([latents, condition], dim=1)`` (``in_channels = 2 z + 4``).
* image embeddings (Wan2.1 I2V's CLIP image encoder, when the transformer has an ``image_dim``): the encoder's
  penultimate hidden state of the pipeline's ``encode_image``, ``Cond.extras["image_embeds"]``, passed as
  ``encoder_hidden_states_image`` to both CFG passes (the unconditional one sees the image too, as in the pipeline).
* the noise latents have the VAE's ``z`` channels (not the transformer's ``in_channels``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .wan import WanModel, wan_variant

CONDITION = "condition"
IMAGE_EMBEDS = "image_embeds"


class FirstFrameCondition:
    """The condition-image part of the Wan image-to-video adapters (mixed into a ``WanModel``): each row's image
    through the pipeline's ``prepare_latents`` (module docstring)."""

    takes_condition_images = True
    max_condition_images = 1
    requires_condition_images = True  # every prompt needs one (checked before the model loads in training)

    def condition_rows(self, images: Sequence[Any] | None, count: int) -> list[Any]:
        """One PIL image per prompt; a ValueError naming what to give when a prompt has none."""
        rows = self.condition_images(images, count)
        if rows is None or not all(rows):
            missing = count if rows is None else sum(1 for row in rows if not row)
            raise ValueError(
                f"model family {self.family!r} is image-to-video: {missing} of {count} prompts have no condition image; "
                "give one per prompt (encode(prompts, images=[image, ...]); in training and sampling, an 'images' "
                "entry in every prompt of the .jsonl prompt file)")
        processor = self.pipe.video_processor
        pils = []
        for row in rows:
            image = row[0]
            if isinstance(image, Tensor):
                image = processor.numpy_to_pil(image.detach().float().permute(1, 2, 0).cpu().numpy()[None])[0]
            pils.append(image.convert("RGB") if image.mode != "RGB" else image)
        sizes = {pil.size for pil in pils}
        if len(sizes) > 1:
            raise ValueError(f"the condition images of one batch have different sizes {sorted(sizes)} (width, "
                             "height): the video is sampled at its condition image's size, so give them one size "
                             "(sampling.image_size)")
        width, height = pils[0].size
        multiple = self.image_multiple
        if height % multiple or width % multiple:
            raise ValueError(f"condition image size {height}x{width}: the {self.family} video is sampled at its "
                             f"condition image's size, which must be a multiple of {multiple} on both sides; resize "
                             "the images to sampling.image_size")
        return pils

    def condition_latents(self, image) -> Tensor:
        """One condition image's latents through the pipeline's own ``prepare_latents`` (fp32, batch of one, no
        noise drawn): ``[1, 4 + z, f, h, w]`` (mask and condition video), or for ``expand_timesteps`` the first
        frame's ``[1, z, 1, h, w]``."""
        width, height = image.size
        pixels = self.pipe.video_processor.preprocess(image, height=height, width=width).to(self.device,
                                                                                           dtype=torch.float32)
        shape = (1, self.latent_channels, self.latent_frames(), height // self.vae_scale_factor,
                 width // self.vae_scale_factor)
        out = self.pipe.prepare_latents(pixels, 1, self.latent_channels, height, width, self.num_frames, torch.float32,
                                        self.device, None, torch.zeros(shape, device=self.device))
        return out[1]

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence[Any] | None = None) -> Cond:
        """UMT5 embeddings (as Wan2.1 T2V) and each prompt's condition image: its latents
        (``extras["condition"]``) and, with an image encoder, its CLIP embeddings (``extras["image_embeds"]``)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        pils = self.condition_rows(images, len(prompts))
        cond = self.text_cond(prompts, negative_prompts)
        cond.extras[CONDITION] = torch.cat([self.condition_latents(pil) for pil in pils])
        if self.image_dim is not None:
            embeds = torch.cat([self.pipe.encode_image(pil, self.device) for pil in pils])
            cond.extras[IMAGE_EMBEDS] = embeds.to(self.dtype)
        return cond

    @property
    def image_dim(self) -> int | None:
        """The transformer's image-embedding width (Wan2.1 I2V's CLIP features), None without an image encoder."""
        return getattr(self.transformer.config, "image_dim", None)

    @property
    def latent_channels(self) -> int:
        """The noise latents' channels: the VAE's ``z_dim`` (the transformer takes the condition on top)."""
        return int(self.pipe.vae.config.z_dim)

    def check_condition_size(self, x: Tensor, condition: Tensor) -> None:
        """A ValueError when latents ``x`` and the condition latents differ in frames or size."""
        if x.shape[-2:] != condition.shape[-2:] or (condition.shape[2] != 1 and x.shape[2] != condition.shape[2]):
            scale = self.vae_scale_factor
            raise ValueError(
                f"latents of {x.shape[2]} frames at {x.shape[-2] * scale}x{x.shape[-1] * scale} px, but the condition "
                f"was encoded for {condition.shape[2]} latent frames at {condition.shape[-2] * scale}x"
                f"{condition.shape[-1] * scale} px: the {self.family} video is sampled at its condition image's size "
                "and the adapter's num_frames (give condition images at sampling.image_size)")

    def transformer_inputs(self, x: Tensor, cond: Cond) -> dict:
        """``encoder_hidden_states_image``: the CLIP image embeddings, where the transformer takes them."""
        embeds = cond.extras.get(IMAGE_EMBEDS)
        return {} if embeds is None else {"encoder_hidden_states_image": embeds}

    def model_input(self, x: Tensor, cond: Cond) -> Tensor:
        """``cat([latents, condition], dim=1)`` in the transformer's dtype, as the pipeline's loop."""
        condition = cond.extras[CONDITION]
        self.check_condition_size(x, condition)
        return torch.cat([x, condition.to(x.dtype)], dim=1).to(self.dtype)


@register_model_family("wan_i2v")
class WanI2VModel(FirstFrameCondition, WanModel):
    """Adapter over ``diffusers.WanImageToVideoPipeline`` (Wan2.1 I2V: a CLIP image encoder, one transformer)."""

    family = "wan_i2v"
    pipeline_class_name = "WanImageToVideoPipeline"

    @classmethod
    def claims(cls, index: dict) -> int:
        """Wan2.1 I2V: no ``transformer_2``, no ``expand_timesteps`` (those are Wan2.2's)."""
        return 1 if wan_variant(index) == "wan21" else 0
