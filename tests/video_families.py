"""The video model families the video adapter contract (tests/test_video_families.py) runs over.

A ``VideoFamily`` says how to build the family's tiny in-process pipeline, how to call it so that it samples what an
ODE rollout through the adapter samples, how to lay the adapter's latents out as the pipeline's
``output_type="latent"`` result, and which diffusers code is the family's own VAE encoding. Adding a video family
means adding a row here: the contract then checks it bit for bit against its pipeline, its VAE path, its LoRA round
trip, export, and that it trains.

The shapes are the smallest that exercise a frame axis: 5 frames (2 latent frames), 16 px frames, 1-layer models.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from flowalign.models import (HunyuanVideo15I2VModel, HunyuanVideo15Model, Kandinsky5T2VModel, LTX2Model,
                              LTXImageToVideoModel, LTXVideoModel, MochiModel, SanaVideoModel, SkyReelsV2I2VModel,
                              SkyReelsV2Model, Wan22I2VModel, Wan22Model, WanI2VModel, WanModel, WanTI2VImageModel,
                              WanTI2VModel)
from flowalign.models.tiny import (tiny_hunyuan_video15_pipeline, tiny_kandinsky5_pipeline, tiny_ltx2_pipeline,
                                   tiny_ltx_pipeline, tiny_mochi_pipeline, tiny_sana_video_pipeline,
                                   tiny_skyreels_v2_i2v_pipeline, tiny_skyreels_v2_pipeline, tiny_wan22_i2v_pipeline, tiny_wan22_pipeline,
                                   tiny_wan22_ti2v_pipeline, tiny_wan_i2v_pipeline, tiny_wan_pipeline)

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


def ltx_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """``LTXImageToVideoPipeline.prepare_latents``' encoding of its condition, taken at the posterior's mode: one video
    per VAE call through diffusers' ``retrieve_latents(..., sample_mode="argmax")``, then the pipeline's own
    ``_normalize_latents`` with the VAE's ``latents_mean`` / ``latents_std`` buffers and ``scaling_factor`` (1 in the
    released VAE and the tiny one; the I2V pipeline passes none, the T2V decode divides by it). Videos
    ``[B, 3, F, H, W]`` in [-1, 1]."""
    from diffusers import LTXPipeline
    from diffusers.pipelines.ltx.pipeline_ltx_image2video import retrieve_latents

    vae = pipe.vae
    latents = torch.cat([retrieve_latents(vae.encode(video.unsqueeze(0)), sample_mode="argmax") for video in videos])
    return LTXPipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def mochi_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """No Mochi pipeline encodes videos, so this is a faithful restatement: the posterior's mode of one video per VAE
    call, then the inverse of ``MochiPipeline``'s decode normalisation, ``(z - mean) * scaling_factor / std`` with
    the VAE config's statistics built as the pipeline builds them. Videos ``[B, 3, F, H, W]`` in [-1, 1]."""
    config = pipe.vae.config
    latents = torch.cat([pipe.vae.encode(video.unsqueeze(0)).latent_dist.mode() for video in videos])
    mean = torch.tensor(config.latents_mean).view(1, 12, 1, 1, 1).to(latents.device, latents.dtype)
    std = torch.tensor(config.latents_std).view(1, 12, 1, 1, 1).to(latents.device, latents.dtype)
    return (latents - mean) * config.scaling_factor / std


def ltx_i2v_start(model, prompts, negatives, size, generator):
    """``LTXImageToVideoPipeline.prepare_latents``' order of draws: the condition image's posterior draw, then the
    noise, from the one generator; the start state is the noise with the condition in frame 0."""
    cond = model.encode(prompts, negative_prompts=negatives, images=[ltx_condition_image()] * len(prompts),
                        image_size=size, generator=generator)
    return cond, model.start_latents(model.prepare_noise(len(prompts), size, generator=generator), cond)


def ltx_condition_image() -> torch.Tensor:
    """The LTX I2V row's condition image: ``[3, 32, 32]`` in [0, 1] (the pipeline resizes it to each frame size)."""
    return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(5))


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


def hunyuan_video15_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """HunyuanVideo 1.5's VAE encoding, a faithful restatement (no pipeline of the family encodes a video; the
    image-to-video pipeline's ``_get_image_latents`` is this for one frame, and tests/test_video_hunyuan_video15.py
    checks the first-frame condition against it): one video per VAE call (the VAE of diffusers 0.42.1 cannot take a
    batch), diffusers' ``retrieve_latents(..., sample_mode="argmax")``, times the config's ``scaling_factor``."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents

    latents = torch.cat([retrieve_latents(pipe.vae.encode(video.unsqueeze(0)), sample_mode="argmax")
                         for video in videos])
    return latents * pipe.vae.config.scaling_factor


def hunyuan_video15_call(model, guidance: float) -> dict:
    """The pipeline's guider set to ``guidance`` (HunyuanVideo 1.5 takes its CFG scale from its
    ``ClassifierFreeGuidance`` guider, not a call argument); its negative prompt defaults to the empty prompt."""
    model.pipe.guider = model.pipe.guider.new(guidance_scale=guidance)
    return {}


def tiny_hunyuan_video15_sliced(words, **kwargs):
    """The tiny HunyuanVideo 1.5 pipeline with its VAE decoding one video at a time (``vae.enable_slicing()``), so
    that the pipeline's own batched decode runs in diffusers 0.42.1, whose VAE cannot decode a batch of videos."""
    pipe = tiny_hunyuan_video15_pipeline(words, **kwargs)
    pipe.vae.enable_slicing()
    return pipe


def kandinsky5_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """Kandinsky 5's VAE encoding, a faithful restatement of ``Kandinsky5I2VPipeline.prepare_latents``' encoding
    (``vae.encode(...).latent_dist`` times the config's ``scaling_factor``; the pipeline draws from the posterior,
    this takes its mode, as ``encode_videos`` does by default): one video per VAE call."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents

    latents = torch.cat([retrieve_latents(pipe.vae.encode(video.unsqueeze(0)), sample_mode="argmax")
                         for video in videos])
    return latents * pipe.vae.config.scaling_factor


def kandinsky5_call(model, guidance: float) -> dict:
    """The CFG scale and the empty negative prompt (the pipeline's own default negative is a list of defects)."""
    return {**_cfg_kwargs(model, guidance), "negative_prompt": ""}


def first_frame_image(size: tuple[int, int] = (16, 16)):
    """The I2V rows' condition image: a fixed random RGB PIL image of ``size`` (height, width), the frame size the
    rows sample (an I2V video is sampled at its condition image's size)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(3).randint(0, 256, size=(*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def wan_first_frame_image():
    """The Wan I2V rows' condition image: 16x32 (a non-square frame)."""
    return first_frame_image((16, 32))


def condition_as_first_frame(model, latents: torch.Tensor) -> torch.Tensor:
    """TI2V-5B I2V's ``output_type="latent"`` layout: the pipeline overwrites the first latent frame with the
    condition's after the loop; flowalign's ODE reaches it within rounding (flowalign.models.wan22_ti2v), so the
    comparison puts the condition there and checks every other frame bit for bit."""
    count = latents.shape[0]
    condition = model.encode([""] * count, images=[wan_first_frame_image()] * count).extras["condition"]
    return torch.cat([condition.to(latents.dtype), latents[:, :, 1:]], dim=2)


def ltx2_vae_encoding(pipe, videos: torch.Tensor) -> torch.Tensor:
    """``LTX2ImageToVideoPipeline.prepare_latents``' encoding of its condition, at the posterior's mode: one video per
    VAE call through diffusers' ``retrieve_latents(..., sample_mode="argmax")``, then the pipeline's own
    ``_normalize_latents`` with the VAE's statistics buffers and ``scaling_factor`` (1 in the released VAE and the
    tiny one; the I2V pipeline passes none, the decode divides by it). Videos ``[B, 3, F, H, W]`` in [-1, 1]."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_image2video import retrieve_latents

    vae = pipe.vae
    latents = torch.cat([retrieve_latents(vae.encode(video.unsqueeze(0)), sample_mode="argmax") for video in videos])
    return LTX2Pipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def ltx2_call(model, guidance: float) -> dict:
    """LTX-2's pipeline as the adapter samples: CFG at ``guidance`` for both streams, no spatio-temporal or
    modality-isolation guidance, no guidance rescale (the pipeline's defaults are 1, 3 and 0.7), the adapter's
    frame rate."""
    return {**_cfg_kwargs(model, guidance), "audio_guidance_scale": guidance, "stg_scale": 0.0,
            "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0, "guidance_rescale": 0.0,
            "audio_guidance_rescale": 0.0, "frame_rate": model.frame_rate}


@contextmanager
def ltx2_audio_held():
    """The tiny LTX-2 pipeline with its audio stream held as the adapter holds it (flowalign.models.ltx2): a forward
    pre-hook on its transformer gives every call of the *pipeline's* loop (the calls without an ``audio_timestep``;
    the adapter always passes one) the adapter's held audio draw at audio timestep and sigma 1000, instead of the
    audio the pipeline denoises alongside. Everything else, text, connectors, packing, sigmas, RoPE, CFG in x0 space,
    denormalisation, is the pipeline's own code; the hook checks the pipeline's audio shape equals the held one."""
    pipe = tiny_video_pipeline("ltx2")
    adapter = LTX2Model(pipe, num_frames=VIDEO_FAMILIES["ltx2"].frames)

    def hold_audio(module, args, kwargs):
        if kwargs.get("audio_timestep") is not None:
            return None
        audio = kwargs["audio_hidden_states"]
        held = adapter.held_audio(audio.shape[0]).to(audio.dtype)
        assert held.shape == audio.shape, (held.shape, audio.shape)
        assert kwargs["fps"] == adapter.frame_rate and kwargs["audio_num_frames"] == adapter.audio_latent_frames()
        timestep = torch.full((audio.shape[0],), 1000.0, dtype=kwargs["timestep"].dtype)
        return args, {**kwargs, "audio_hidden_states": held, "audio_timestep": timestep, "audio_sigma": timestep}

    handle = pipe.transformer.register_forward_pre_hook(hold_audio, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


# Wan2.2 A14B's contract runs train steps on both sides of the expert boundary: 4 steps at the tiny shift run
# t = 1000 (the high expert), then 857, 600 and 3 (the low one), and a fixed window of 3 trains all but the last.
BOTH_EXPERTS = {"sampling.num_steps": 4, "sampling.window_size": 3, "sampling.window_start": "fixed",
                "sampling.window_last": "null"}

# HunyuanVideo 1.5's contract runs pad the Qwen prompt to 32 tokens, not the 1000 a saved pipeline loads with: the
# padding is masked out (measured: the same gradient norms) and a run takes about a third less time.
SHORT_QWEN_PADDING = {"model.max_sequence_length": 32}


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
    ``pipeline_frames``: the pipeline's keyword for the frame count (``frames`` for SANA-Video). ``start(model,
    prompts, negatives, size, generator) -> (cond, x_init)``: how a rollout that equals the pipeline's call begins, for
    a family whose pipeline draws more than the noise from its generator (None: ``encode``, then ``prepare_noise``
    with the generator); ``sized_by_image``: the pipeline takes no ``height`` / ``width`` but sizes the video by its
    condition image (HunyuanVideo 1.5 I2V: ``sizes`` then lists the size its condition image gives); ``decode_atol``:
    how far one video per VAE call may be from the pipeline's batched call (fp32 rounding: batched convolutions round
    differently, by CPU: up to 1.1e-6 measured for LTX-Video's VAE under AVX2 kernels, 4e-6 for HunyuanVideo's; 1e-5
    is still 400 times finer than one 8-bit pixel step). ``load_lora(pipe, folder)``: how diffusers loads a LoRA
    folder the adapter saved into the plain pipeline (Wan2.2 A14B: one file per expert). ``training``: config
    overrides of the family's contract training runs (tests/video_training.py), for a family the default run's
    trained steps do not cover."""

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
    start: Callable | None = None
    pipeline_frames: str = "num_frames"
    sized_by_image: bool = False
    decode_atol: float = 1e-5
    load_lora: Callable = load_lora_folder
    training: dict = field(default_factory=dict)

    def images_kwargs(self, count: int) -> dict:
        """``encode``'s ``images=`` for ``count`` prompts (nothing for a family without condition images)."""
        return {} if self.condition_images is None else {"images": [self.condition_images()] * count}


VIDEO_FAMILIES: dict[str, VideoFamily] = {
    # Wan2.1 T2V: UMT5 text, CFG in two passes, a causal VAE with per-channel statistics.
    "wan": VideoFamily(WanModel, tiny_wan_pipeline, wan_vae_encoding),
    # Wan2.1 I2V: a CLIP image encoder's embeddings, the condition video's latents and mask concatenated (2z+4 in).
    "wan_i2v": VideoFamily(WanI2VModel, tiny_wan_i2v_pipeline, wan_vae_encoding, sizes=((16, 32),),
                           condition_images=wan_first_frame_image),
    # Wan2.2 A14B T2V: two experts switching at t = 875; the 3-step schedule runs high at 1000, low at 750 and 3.
    "wan22": VideoFamily(Wan22Model, tiny_wan22_pipeline, wan_vae_encoding, load_lora=load_expert_lora_folder,
                         training=BOTH_EXPERTS),
    # Wan2.2 A14B I2V: two experts (boundary 900), the condition through the latents only (no image encoder).
    "wan22_i2v": VideoFamily(Wan22I2VModel, tiny_wan22_i2v_pipeline, wan_vae_encoding, sizes=((16, 32),),
                             condition_images=wan_first_frame_image, load_lora=load_expert_lora_folder,
                             training=BOTH_EXPERTS),
    # Wan2.2 TI2V-5B: per-token timesteps, the Wan2.2 VAE (residual, 2x2 patchify).
    "wan22_ti2v": VideoFamily(WanTI2VModel, tiny_wan22_ti2v_pipeline, wan_vae_encoding),
    # Wan2.2 TI2V-5B I2V: the condition image is the first latent frame, never denoised.
    "wan22_ti2v_i2v": VideoFamily(WanTI2VImageModel, tiny_wan22_ti2v_pipeline, wan_vae_encoding, sizes=((16, 32),),
                                  condition_images=wan_first_frame_image, pipeline_layout=condition_as_first_frame,
                                  build_kwargs={"image_to_video": True}),
    # LTX-Video T2V: T5 text with its mask, batched CFG, tokens packed inside the pipeline, a resolution-dependent
    # shift, a VAE with statistics buffers and a timestep-conditioned decoder (the pipeline checks sizes of 32k).
    "ltx_video": VideoFamily(LTXVideoModel, tiny_ltx_pipeline, ltx_vae_encoding,
                             pipeline_layout=lambda model, latents: model.pack(latents), sizes=((32, 32), (32, 64))),
    # LTX-Video I2V: the condition image's latents (a posterior draw from the call's generator) fixed in frame 0,
    # per-token timesteps (0 there); one prompt per call (the pipeline encodes each image it is given once).
    "ltx_video_i2v": VideoFamily(LTXImageToVideoModel, tiny_ltx_pipeline, ltx_vae_encoding,
                                 build_kwargs={"image_to_video": True}, pipeline_layout=lambda model, latents: model.pack(latents),
                                 sizes=((32, 32), (32, 64)), condition_images=ltx_condition_image, prompts_per_call=1,
                                 start=ltx_i2v_start),
    # LTX-2 (audio-video): the video stream, its audio stream held at a fixed noise draw (flowalign.models.ltx2; the
    # pipeline with the same audio held through ltx2_audio_held); Gemma 3 text through the connectors, CFG in x0
    # space, 32 px multiples, a VAE 4x in space and 2x in time (5 frames are 3 latent frames).
    "ltx2": VideoFamily(LTX2Model, tiny_ltx2_pipeline, ltx2_vae_encoding, call=ltx2_call, context=ltx2_audio_held,
                        pipeline_layout=lambda model, latents: model.pipeline_latents(latents),
                        sizes=((32, 32), (32, 64))),
    # Mochi: its own linear-quadratic sigmas through an inverting scheduler (time and sign flipped), batched CFG, a
    # VAE 8x in space and 6x in time (7 frames are 2 latent frames).
    "mochi": VideoFamily(MochiModel, tiny_mochi_pipeline, mochi_vae_encoding, frames=7),
    # SkyReels-V2 T2V: Wan2.1's pipeline loop, text and VAE under SkyReels' classes; its own LoRA loader.
    "skyreels_v2": VideoFamily(SkyReelsV2Model, tiny_skyreels_v2_pipeline, wan_vae_encoding),
    # SkyReels-V2 I2V: Wan2.1 I2V's first-frame condition (CLIP image embeddings, mask and condition video latents).
    "skyreels_v2_i2v": VideoFamily(SkyReelsV2I2VModel, tiny_skyreels_v2_i2v_pipeline, wan_vae_encoding,
                                   sizes=((16, 32),), condition_images=wan_first_frame_image),
    # SANA-Video: SANA's Gemma2 text with its mask and batched CFG over Wan's VAE; 32 px multiples, ``frames=``.
    "sana_video": VideoFamily(SanaVideoModel, tiny_sana_video_pipeline, sana_video_vae_encoding,
                              call=_sana_video_kwargs, sizes=((32, 32), (32, 64)), pipeline_frames="frames"),
    # HunyuanVideo 1.5 T2V: Qwen2.5-VL + ByT5 text, CFG through the pipeline's guider, the first frame's latents and
    # a mask concatenated to the latents (zeros in T2V), one video per VAE call; the pipeline has no LoRA loader
    # (tests/test_video_hunyuan_video15.py round-trips through the transformer's load_lora_adapter).
    "hunyuan_video15": VideoFamily(HunyuanVideo15Model, tiny_hunyuan_video15_sliced, hunyuan_video15_vae_encoding,
                                   call=hunyuan_video15_call, lora_loader=False, training=SHORT_QWEN_PADDING),
    # HunyuanVideo 1.5 I2V: the T2V row's conventions with a first frame (SigLIP embeddings, the first latent frame
    # and its mask); the pipeline sizes the video by the image.
    "hunyuan_video15_i2v": VideoFamily(HunyuanVideo15I2VModel, tiny_hunyuan_video15_sliced,
                                       hunyuan_video15_vae_encoding, call=hunyuan_video15_call, lora_loader=False,
                                       build_kwargs={"image_to_video": True}, condition_images=first_frame_image,
                                       sizes=((16, 16),), sized_by_image=True, training=SHORT_QWEN_PADDING),
    # Kandinsky 5 T2V: channels-last pipeline latents, Qwen2.5-VL text with CLIP's pooled embedding, CFG in two passes,
    # the released visual_cond transformer (zeros and a zero mask appended in T2V), the HunyuanVideo VAE (whose
    # one-video and two-video calls differ by up to 4e-6 on CPU: decode_atol).
    "kandinsky5_t2v": VideoFamily(Kandinsky5T2VModel, tiny_kandinsky5_pipeline, kandinsky5_vae_encoding,
                                  call=kandinsky5_call,
                                  pipeline_layout=staticmethod(lambda model, latents: model.pipeline_latents(latents))),
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
