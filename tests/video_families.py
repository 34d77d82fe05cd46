"""The video model families the video adapter contract (tests/test_video_families.py) runs over.

A ``VideoFamily`` says how to build the family's tiny in-process pipeline, how to call it so that it samples what an
ODE rollout through the adapter samples, how to lay the adapter's latents out as the pipeline's
``output_type="latent"`` result, and which diffusers code is the family's own VAE encoding. Adding a video family
means adding a row here: the contract then checks it bit for bit against its pipeline, its VAE path, its LoRA round
trip, export, and that it trains.

The shapes are the smallest that exercise a frame axis: 5 frames (2 latent frames), 16 px frames, 1-layer models.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from flowalign.models import (SanaVideoModel, SkyReelsV2I2VModel, SkyReelsV2Model, Wan22I2VModel, Wan22Model,
                              WanI2VModel, WanModel, WanTI2VImageModel, WanTI2VModel)
from flowalign.models.tiny import (tiny_sana_video_pipeline, tiny_skyreels_v2_i2v_pipeline, tiny_skyreels_v2_pipeline,
                                   tiny_wan22_i2v_pipeline, tiny_wan22_pipeline, tiny_wan22_ti2v_pipeline,
                                   tiny_wan_i2v_pipeline, tiny_wan_pipeline)

from model_families import WORDS


def _cfg_kwargs(model, guidance: float) -> dict:
    """``guidance_scale`` as the pipeline's CFG scale (its negative prompt defaults to the empty prompt)."""
    return {"guidance_scale": guidance, "max_sequence_length": model.max_sequence_length}


def wan_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """``WanVideoToVideoPipeline.prepare_latents``' encoding before it noises: one video per VAE call through diffusers'
    ``retrieve_latents(..., sample_mode="argmax")``, then ``(z - mean) * (1 / std)`` with the VAE config's statistics
    built as the pipeline builds them. Videos ``[B, 3, F, H, W]`` in [-1, 1]."""
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents

    config = pipe.vae.config
    latents = torch.cat([retrieve_latents(pipe.vae.encode(video.unsqueeze(0)), sample_mode="argmax")
                         for video in videos])
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents.dtype)
    return (latents - mean) * inverse_std


def _sana_video_kwargs(model, guidance: float) -> dict:
    """SANA-Video's CFG scale, with the adapter's (empty) complex human instruction and no resolution binning."""
    return {**_cfg_kwargs(model, guidance), "complex_human_instruction": model.complex_human_instruction,
            "use_resolution_binning": False}


def sana_video_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """SANA-Video's encoding. One-frame videos go through diffusers' own ``SanaImageToVideoPipeline.prepare_latents``
    (the first-frame latents it writes over the noise, ``argmax`` of the posterior normalised by the VAE's statistics);
    diffusers has no SANA-Video video-to-video pipeline, so longer videos are a faithful restatement of the same code
    (one video per VAE call). Videos ``[B, 3, F, H, W]`` in [-1, 1]."""
    from diffusers import SanaImageToVideoPipeline
    from diffusers.pipelines.sana_video.pipeline_sana_video_i2v import retrieve_latents

    if videos.shape[2] == 1:
        i2v = SanaImageToVideoPipeline(**pipe.components)
        rows = []
        for image in videos[:, :, 0]:
            latents = i2v.prepare_latents(image[None], 1, pipe.transformer.config.in_channels, *image.shape[-2:],
                                          num_frames=1, dtype=pipe.vae.dtype, device=image.device,
                                          latents=torch.zeros(1, pipe.transformer.config.in_channels, 1,
                                                              *(side // pipe.vae_scale_factor_spatial
                                                                for side in image.shape[-2:])))
            rows.append(latents[:, :, 0:1])
        return torch.cat(rows)
    config = pipe.vae.config
    latents = torch.cat([retrieve_latents(pipe.vae.encode(video.unsqueeze(0)), sample_mode="argmax")
                         for video in videos])
    mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1, 1).to(latents.device, latents.dtype)
    return (latents - mean) * inverse_std


def first_frame_image(size: tuple[int, int] = (16, 32)):
    """The I2V rows' condition image: a fixed random RGB PIL image of ``size`` (height, width), the frame size the
    rows sample (an I2V video is sampled at its condition image's size)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(3).randint(0, 256, size=(*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def condition_as_first_frame(model, latents: torch.Tensor) -> torch.Tensor:
    """TI2V-5B I2V's ``output_type="latent"`` layout: the pipeline overwrites the first latent frame with the
    condition's after the loop; flowalign's ODE reaches it within rounding (flowalign.models.wan22_ti2v), so the
    comparison puts the condition there and checks every other frame bit for bit."""
    count = latents.shape[0]
    condition = model.encode([""] * count, images=[first_frame_image()] * count).extras["condition"]
    return torch.cat([condition.to(latents.dtype), latents[:, :, 1:]], dim=2)


def load_lora_folder(pipe, folder) -> None:
    """A LoRA folder into a pipeline with diffusers' own loader: ``pipe.load_lora_weights(folder)``."""
    pipe.load_lora_weights(folder)


def load_expert_lora_folder(pipe, folder) -> None:
    """A Wan2.2 A14B LoRA folder (flowalign.models.wan22) with diffusers' own loader: the high expert's file into
    ``transformer``, the low expert's into ``transformer_2`` (``load_into_transformer_2=True``)."""
    from pathlib import Path

    from flowalign.models.wan22 import LORA_WEIGHT_NAMES

    if (Path(folder) / LORA_WEIGHT_NAMES["high"]).is_file():
        pipe.load_lora_weights(folder)
    if (Path(folder) / LORA_WEIGHT_NAMES["low"]).is_file():
        pipe.load_lora_weights(folder, weight_name=LORA_WEIGHT_NAMES["low"], load_into_transformer_2=True)


@dataclass(frozen=True)
class VideoFamily:
    """A video family under the adapter contract (the fields mean what they mean for image families in
    tests/model_families.py). ``frames``: the pixel frames the contract samples; ``vae_encoding(pipe, videos)``:
    the family's own diffusers encoding of videos ``[B, 3, F, H, W]`` in [-1, 1] into the transformer's latents;
    ``pipeline_frames``: the pipeline's keyword for the frame count (``frames`` for SANA-Video);
    ``load_lora(pipe, folder)``: how diffusers loads a LoRA folder the adapter saved into the plain pipeline (Wan2.2 A14B: one file per expert)."""

    adapter: type
    build: Callable
    vae_encoding: Callable
    guidances: tuple[float, ...] = (1.0, 3.0)
    call: Callable = _cfg_kwargs
    pipeline_layout: Callable = staticmethod(lambda model, latents: latents)
    sizes: tuple[tuple[int, int], ...] = ((16, 16), (16, 32))
    frames: int = 5
    lora_loader: bool = True
    build_kwargs: dict = field(default_factory=dict)
    condition_images: Callable | None = None
    prompts_per_call: int | None = None
    context: Callable = nullcontext
    pipeline_frames: str = "num_frames"
    load_lora: Callable = load_lora_folder

    def images_kwargs(self, count: int) -> dict:
        """``encode``'s ``images=`` for ``count`` prompts (nothing for a family without condition images)."""
        return {} if self.condition_images is None else {"images": [self.condition_images()] * count}


VIDEO_FAMILIES: dict[str, VideoFamily] = {
    # Wan2.1 T2V: UMT5 text, CFG in two passes, a causal VAE with per-channel statistics.
    "wan": VideoFamily(WanModel, tiny_wan_pipeline, wan_vae_encoding),
    # SkyReels-V2 T2V: Wan2.1's pipeline loop, text and VAE under SkyReels' classes; its own LoRA loader.
    "skyreels_v2": VideoFamily(SkyReelsV2Model, tiny_skyreels_v2_pipeline, wan_vae_encoding),
    # SkyReels-V2 I2V: Wan2.1 I2V's first-frame condition (CLIP image embeddings, mask and condition video latents).
    "skyreels_v2_i2v": VideoFamily(SkyReelsV2I2VModel, tiny_skyreels_v2_i2v_pipeline, wan_vae_encoding,
                                   sizes=((16, 32),), condition_images=first_frame_image),
    # SANA-Video: SANA's Gemma2 text with its mask and batched CFG over Wan's VAE; 32 px multiples, ``frames=``.
    "sana_video": VideoFamily(SanaVideoModel, tiny_sana_video_pipeline, sana_video_vae_encoding,
                              call=_sana_video_kwargs, sizes=((32, 32), (32, 64)), pipeline_frames="frames"),
    # Wan2.1 I2V: a CLIP image encoder's embeddings, the condition video's latents and mask concatenated (2z+4 in).
    "wan_i2v": VideoFamily(WanI2VModel, tiny_wan_i2v_pipeline, wan_vae_encoding, sizes=((16, 32),),
                           condition_images=first_frame_image),
    # Wan2.2 A14B T2V: two experts switching at t = 875; the 3-step schedule runs high at 1000, low at 750 and 3.
    "wan22": VideoFamily(Wan22Model, tiny_wan22_pipeline, wan_vae_encoding, load_lora=load_expert_lora_folder),
    # Wan2.2 A14B I2V: two experts (boundary 900), the condition through the latents only (no image encoder).
    "wan22_i2v": VideoFamily(Wan22I2VModel, tiny_wan22_i2v_pipeline, wan_vae_encoding, sizes=((16, 32),),
                             condition_images=first_frame_image, load_lora=load_expert_lora_folder),
    # Wan2.2 TI2V-5B: per-token timesteps, the Wan2.2 VAE (residual, 2x2 patchify).
    "wan22_ti2v": VideoFamily(WanTI2VModel, tiny_wan22_ti2v_pipeline, wan_vae_encoding),
    # Wan2.2 TI2V-5B I2V: the condition image is the first latent frame, never denoised.
    "wan22_ti2v_i2v": VideoFamily(WanTI2VImageModel, tiny_wan22_ti2v_pipeline, wan_vae_encoding, sizes=((16, 32),),
                                  condition_images=first_frame_image, pipeline_layout=condition_as_first_frame,
                                  build_kwargs={"image_to_video": True}),
}


@lru_cache(maxsize=None)
def tiny_video_pipeline(name: str):
    """The family's tiny pipeline, built once per test session (do not change it: build your own for that)."""
    family = VIDEO_FAMILIES[name]
    return family.build(WORDS, seed=0, **family.build_kwargs)


def fresh_video_pipeline(name: str):
    """A new tiny pipeline of the family, equal to ``tiny_video_pipeline(name)``, for tests that change it."""
    family = VIDEO_FAMILIES[name]
    return family.build(WORDS, seed=0, **family.build_kwargs)
