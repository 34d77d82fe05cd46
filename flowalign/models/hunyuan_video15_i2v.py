"""HunyuanVideo 1.5 image-to-video adapter (``diffusers.HunyuanVideo15ImageToVideoPipeline``): the text-to-video
model's conventions (``flowalign.models.hunyuan_video15``) with a first frame.

The first frame (``HunyuanVideo15ImageToVideoPipeline.__call__``), one condition image per prompt
(``encode(..., images=)``; a prompt file entry's ``"images": [path]``):

* sizes the video: the pipeline buckets the image's aspect around the transformer's ``target_size``
  (``calculate_default_height_width``) and crops the image to that bucket, so the frames are sampled at that size;
  ``velocity`` refuses latents of another size, naming the size to sample at (``sampling.image_size``);
* its SigLIP last hidden state is the transformer's ``image_embeds`` (``encode_image``), in
  ``Cond.extras["image_embeds"]``;
* its VAE latents (``_get_image_latents``: the mode of the posterior times ``scaling_factor``), in
  ``Cond.extras["first_frame"]`` ``[B, C, 1, h, w]``, become the condition concatenated to the latents: the first
  latent frame, zeros after it, and a mask that is 1 on the first latent frame (``prepare_cond_latents_and_mask``).

The pipeline takes PIL images: a tensor ``[3, H, W]`` in [0, 1] is rounded to 8 bits first, as
``VaeImageProcessor.numpy_to_pil`` does. A prompt without a condition image is refused.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .hunyuan_video15 import HunyuanVideo15Model


@register_model_family("hunyuan_video15_i2v")
class HunyuanVideo15I2VModel(HunyuanVideo15Model):
    """Adapter over ``diffusers.HunyuanVideo15ImageToVideoPipeline`` (HunyuanVideo 1.5 I2V)."""

    family = "hunyuan_video15_i2v"
    pipeline_class_name = "HunyuanVideo15ImageToVideoPipeline"
    takes_condition_images = True
    max_condition_images = 1
    # Every prompt needs its first frame: a prompt file without one is refused before the model loads.
    requires_condition_images = True

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """The text's ``Cond`` (``HunyuanVideo15Model.text_cond``) with each prompt's first frame: its SigLIP
        embeddings and VAE latents in ``extras``. ``images[i]``: prompt ``i``'s first frame (a PIL image or a tensor
        ``[3, H, W]`` in [0, 1]); every prompt needs one, and all of them must give the same frame size."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = self.condition_images(images, len(prompts))
        missing = [i for i, row in enumerate(rows or [[] for _ in prompts]) if not row]
        if missing:
            raise ValueError(f"model family {self.family!r} animates a first frame: prompt(s) {missing} have no "
                             "condition image; give one per prompt (encode(..., images=[image, ...]); in a prompt "
                             "file, each entry's \"images\": [\"path/to/frame.png\"])")
        frames = [self.prepare_first_frame(row[0]) for row in rows]
        sizes = sorted({tuple(latents.shape[-2:]) for _, latents in frames})
        if len(sizes) > 1:
            scale = self.vae_scale_factor
            raise ValueError(f"the condition images give frames of different sizes "
                             f"{[(h * scale, w * scale) for h, w in sizes]}: one batch samples one size; give first "
                             "frames of one aspect ratio per batch")
        cond = self.text_cond(prompts, negative_prompts)
        cond.extras["image_embeds"] = torch.cat([embeds for embeds, _ in frames])
        cond.extras["first_frame"] = torch.cat([latents for _, latents in frames])
        return cond

    def prepare_first_frame(self, image: Any) -> tuple[Tensor, Tensor]:
        """One first frame as the pipeline prepares it: ``(SigLIP embeddings [1, N, D] in the transformer's dtype,
        VAE latents [1, C, 1, h, w])`` of the image cropped to its bucket."""
        pipe = self.pipe
        processor = pipe.video_processor
        if isinstance(image, Tensor):
            image = processor.numpy_to_pil(image.detach().float().permute(1, 2, 0).cpu().numpy()[None])[0]
        height, width = self.sized_like(image.size[1], image.size[0])
        image = processor.resize(image, height=height, width=width, resize_mode="crop")
        embeds = pipe.encode_image(image=image, batch_size=1, device=self.device, dtype=self.dtype)
        latents = pipe._get_image_latents(vae=pipe.vae, image_processor=processor, image=image, height=height,
                                          width=width, device=self.device)
        return embeds, latents

    def condition_input(self, x: Tensor, cond: Cond) -> tuple[Tensor, Tensor]:
        """The first frame's latents on the first latent frame (zeros after it) and a mask that is 1 there, in the
        transformer's dtype, as the pipeline's ``prepare_cond_latents_and_mask``."""
        first = cond.extras.get("first_frame")
        if first is None:
            raise ValueError(f"model family {self.family!r}: the Cond has no first frame; encode the prompts with "
                             "their condition images (encode(..., images=[...]))")
        batch, _, frames, height, width = x.shape
        if tuple(first.shape[-2:]) != (height, width):
            scale = self.vae_scale_factor
            raise ValueError(f"the first frames are {first.shape[-2] * scale}x{first.shape[-1] * scale} px (the "
                             f"pipeline sizes the video by its first frame), but the latents are "
                             f"{height * scale}x{width * scale} px: sample at image_size "
                             f"[{first.shape[-2] * scale}, {first.shape[-1] * scale}] (sampling.image_size)")
        condition = first.repeat(1, 1, frames, 1, 1)
        condition[:, :, 1:] = 0
        mask = torch.zeros(batch, 1, frames, height, width, dtype=self.dtype, device=x.device)
        mask[:, :, 0] = 1.0
        return condition.to(device=x.device, dtype=self.dtype), mask

    def image_embeds(self, x: Tensor, cond: Cond) -> Tensor:
        """The first frames' SigLIP embeddings."""
        return cond.extras["image_embeds"]
