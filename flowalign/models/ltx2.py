"""LTX-2 audio-video adapter (``diffusers.LTX2Pipeline``), generating and training on the VIDEO stream.

LTX-2 is one transformer over two token streams, video and audio, each with its own self-attention, text
cross-attention and feed-forward, joined in every block by audio-to-video and video-to-audio cross-attention. Its
pipeline denoises both streams together: one transformer call per step returns a velocity for each.

The audio stream during rollouts (the choice this adapter makes, and why): the adapter's state is the video latents
only, ``[B, C, f, h, w]``, as every other video family's, so rollouts, log-probs, credit, losses, rewards, ``decode``
and ``encode_videos`` see a video model. The transformer still needs audio tokens (it has no video-only path but
``isolate_modalities``, which switches the cross-modal attention off, a mode the pipeline uses only as a guidance
negative). So every call gets the audio stream *held at a fixed draw*: one Gaussian draw of the audio latents from a
generator seeded with ``audio_seed`` (the same draw for every row, step and call), at audio timestep 1000 (sigma 1),
which is exactly what pure noise is: audio not yet generated. The video stream is then the model's prediction given
no audio information, consistent with its inputs at every sigma. The velocity is a function of the video state
alone, so the trainer's recomputation of a transition's log-prob sees the same audio as the rollout did, and only the
video stream's transitions carry log-probs and gradients. The alternative, evolving the audio alongside (the
pipeline's joint sampling), makes the audio part of the state: every transition's log-prob would then be over both
streams, and the samplers, transitions and ``decode`` / ``encode_videos`` would need a second latent tensor of
another rank (``[B, C_a, L, M]``); that is what audio rewards would need (docs/guides/video.md, "What audio would
need"). Consequently an ODE rollout here equals the pipeline's own sampling with its audio stream frozen at that draw
(the contract checks that bit for bit), not the pipeline's joint audio-video sampling.

Conventions (``LTX2Pipeline.__call__``):

* latents: diffusers' unpacked ``[B, C, f, h, w]`` (``f = (num_frames - 1) / 8 + 1``, ``h, w`` the frame size over 32
  in the released VAE; the pipeline requires sides that are multiples of 32), packed into tokens ``[B, f h w, C]``
  (``_pack_latents``) for the transformer; the pipeline keeps the latents normalised by the VAE's
  ``latents_mean`` / ``latents_std`` buffers and ``scaling_factor`` during the loop and denormalises them for its
  ``output_type="latent"`` result; fp32 noise drawn before packing, video first (then the audio, from the same
  generator: the adapter draws the video noise only);
* sigmas: ``linspace(1, 1 / n, n)`` shifted by ``mu`` from the video token count (``calculate_shift`` with the
  scheduler config's ``base/max_image_seq_len``, ``base/max_shift``; the released ``FlowMatchEulerDiscreteScheduler``
  has ``use_dynamic_shifting`` and ``shift_terminal``), then the terminal 0;
* time: the transformer takes ``1000 sigma`` as ``timestep`` and ``sigma`` (LTX-2.3's prompt modulation), the held
  audio's ``1000`` as ``audio_timestep`` and ``audio_sigma``; the video's RoPE coordinates scale with ``frame_rate``
  (24 fps by default, an adapter option: the pipeline's ``frame_rate / motion_speed``);
  ``use_cross_timestep`` (the pipeline's default True) takes the other stream's sigma for the cross-modal
  attention's modulation;
* text: Gemma 3's hidden states of every layer, stacked, through the pipeline's ``LTX2TextConnectors`` into a video
  and an audio text embedding with one binary mask; ``encode`` runs the connectors once over ``[negative, positive]``
  as the pipeline does (``Cond.embeds`` / ``mask`` are the video stream's, the audio stream's in ``Cond.extras``);
* CFG: one batched pass over ``[negative, positive]`` (negatives default to the empty prompt); the pipeline guides in
  x0 space, ``x0 = x - sigma v``, ``x0_c + (scale - 1)(x0_c - x0_u)``, optionally rescaled (``guidance_rescale``,
  diffusers' ``rescale_noise_cfg`` against ``x0_c``; the pipeline's default is 0.7, the adapter's 0, an option), then
  back to ``v = (x - x0) / sigma``; the adapter computes the same (at sigma 0, where that is undefined, it returns
  the plain guided velocity). Spatio-temporal guidance and modality-isolation guidance (the pipeline's ``stg_scale``
  and ``modality_scale``, extra transformer passes) are not applied: sampling equals the pipeline called with
  ``stg_scale=0, modality_scale=1``;
* VAE: ``AutoencoderKLLTX2Video``; ``decode`` mixes the decode noise in first (``timestep_conditioning`` decoders
  only; ``decode_timestep`` / ``decode_noise_scale`` as LTX-Video's adapter, 0 by default), then denormalises
  (``_denormalize_latents``), as the pipeline orders them; ``encode_videos`` normalises the posterior's mode with
  ``_normalize_latents`` (``LTX2ImageToVideoPipeline.prepare_latents``' encoding of its condition).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import _UNCONDITIONAL_GRADIENT, Cond, register_model_family, require_negative
from .ltx_video import LTXTokenPacking
from .video import VideoFlowModel

# Every attention and MLP projection of an LTX-2 block: the video stream's self-attention, text cross-attention and
# feed-forward, the audio stream's, and the two cross-modal attentions (audio-to-video, video-to-audio). The audio
# stream's weights shape the video velocity through the audio-to-video attention, so they are trained with it.
LTX2_LORA_TARGETS = tuple(
    f"{module}.{projection}"
    for module in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for projection in ("to_q", "to_k", "to_v", "to_out.0")
) + ("ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")

# ``Cond.extras`` keys of the audio stream's text embeddings (the connectors' audio output), positive and negative.
AUDIO_TEXT = "ltx2_audio_text"
NEGATIVE_AUDIO_TEXT = "ltx2_negative_audio_text"


@register_model_family("ltx2")
class LTX2Model(LTXTokenPacking, VideoFlowModel):
    """Adapter over ``diffusers.LTX2Pipeline`` (LTX-2 text-to-audio-video), sampling and training the video stream
    with the audio stream held at a fixed noise draw (see the module docstring).

    Args:
        pipe: the ``LTX2Pipeline``.
        frame_rate: the frame rate of the videos (the RoPE's time scale and the held audio's length; the pipeline's
            ``frame_rate``, 24).
        guidance_rescale: the x0-space CFG rescale (the pipeline's ``guidance_rescale``; 0 is none).
        use_cross_timestep: the cross-modal attention's modulation takes the other stream's sigma (the pipeline's
            default True; False is LTX-2.0's legacy behaviour).
        audio_seed: the seed of the held audio draw.
        decode_timestep: the decoder's timestep (``timestep_conditioning`` VAEs only; the pipeline's default 0).
        decode_noise_scale: the noise mixed into the latents before decoding; None is ``decode_timestep``.
        decode_generator: the generator of that noise (None: torch's global one).
        **options: ``VideoFlowModel``'s (``max_sequence_length``, ``num_frames``, ``vae_batch``, ``vae_tiling``).
    """

    family = "ltx2"
    pipeline_class_name = "LTX2Pipeline"
    lora_targets = LTX2_LORA_TARGETS
    default_num_frames = 9
    fps = 24
    context_parallel_refusal = ("diffusers' plan splits its video tokens while its audio tokens stay whole on every "
                                "process, and its attention processor repeats the text mask over every head as "
                                "LTX-Video's does, which diffusers' Ulysses attention does not split")

    def __init__(self, pipe, *, frame_rate: float = 24.0, guidance_rescale: float = 0.0,
                 use_cross_timestep: bool = True, audio_seed: int = 0, decode_timestep: float = 0.0,
                 decode_noise_scale: float | None = None, decode_generator: torch.Generator | None = None,
                 **options):
        super().__init__(pipe, **options)
        if not frame_rate > 0:
            raise ValueError(f"frame_rate must be positive, got {frame_rate!r}")
        if not 0 <= guidance_rescale <= 1:
            raise ValueError(f"guidance_rescale must be in [0, 1], got {guidance_rescale!r}")
        self.frame_rate = float(frame_rate)
        self.guidance_rescale = float(guidance_rescale)
        self.use_cross_timestep = bool(use_cross_timestep)
        self.audio_seed = int(audio_seed)
        self.decode_timestep = float(decode_timestep)
        self.decode_noise_scale = self.decode_timestep if decode_noise_scale is None else float(decode_noise_scale)
        self.decode_generator = decode_generator
        self._check_sequence_length()
        self._held_audio: Tensor | None = None

    def _check_sequence_length(self) -> None:
        """A ValueError when the connectors' learnable registers cannot tile ``max_sequence_length`` (the connector
        replaces padding with registers and needs a whole number of them)."""
        registers = getattr(self.pipe.connectors.video_connector, "num_learnable_registers", None)
        if registers and self.max_sequence_length % registers:
            raise ValueError(f"max_sequence_length={self.max_sequence_length}: LTX-2's text connectors tile the "
                             f"prompt with {registers} learnable registers, so it must be a multiple of {registers} "
                             f"(e.g. {max(registers, self.max_sequence_length // registers * registers)})")

    # --- shapes ---------------------------------------------------------------------------------------------------
    @property
    def temporal_compression(self) -> int:
        return int(self.pipe.vae_temporal_compression_ratio)

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_spatial_compression_ratio)

    @property
    def default_image_size(self) -> tuple[int, int]:
        """512x768, the pipeline's defaults."""
        return 512, 768

    @property
    def image_multiple(self) -> int:
        """32: the pipeline refuses other frame sides (and the VAE and patching need at least their product)."""
        return max(32, self.vae_scale_factor * int(self.pipe.transformer_spatial_patch_size))

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return min(1024, tokenizer.model_max_length) if tokenizer is not None else 1024

    # --- the held audio stream ------------------------------------------------------------------------------------
    def audio_latent_frames(self) -> int:
        """The audio stream's latent length for ``num_frames`` at ``frame_rate``, as the pipeline computes it:
        ``round(num_frames / frame_rate * sample_rate / hop_length / temporal_compression)``."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(self.num_frames / self.frame_rate * per_second)

    def held_audio(self, batch: int) -> Tensor:
        """The held audio stream's packed tokens ``[batch, L, C_a M]``, fp32: one draw of the audio latents
        ``[1, C_a, L, M]`` (``prepare_audio_latents``' shape and packing) from a generator seeded with ``audio_seed``,
        the same for every row, contiguous (a stride-0 expanded input makes ``nn.Linear`` on CPU round differently
        depending on whether its weight requires grad, so LoRA's frozen base would not equal the base bit for bit)."""
        if self._held_audio is None:
            audio_vae = self.pipe.audio_vae
            mel_bins = audio_vae.config.mel_bins // self.pipe.audio_vae_mel_compression_ratio
            shape = (1, audio_vae.config.latent_channels, self.audio_latent_frames(), mel_bins)
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(self.audio_seed), dtype=torch.float32)
            self._held_audio = self.pipe._pack_audio_latents(noise)
        return self._held_audio.to(self.device).expand(batch, -1, -1).contiguous()

    # --- text -----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """Gemma 3's stacked hidden states through the pipeline's ``encode_prompt``, then its text connectors over
        ``[negative, positive]`` in one batch as the pipeline runs them: the video stream's embeddings and mask in
        ``embeds`` / ``mask``, the audio stream's embeddings in ``extras``. LTX-2 T2V takes no condition images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        with_negative = negative_prompts is not None
        embeds, mask, negative, negative_mask = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        if with_negative:
            embeds, mask = torch.cat([negative, embeds]), torch.cat([negative_mask, mask])
        padding_side = getattr(getattr(self.pipe, "tokenizer", None), "padding_side", "left")
        video, audio, connector_mask = self.pipe.connectors(embeds, mask, padding_side=padding_side)
        if not with_negative:
            return Cond(video, mask=connector_mask, extras={AUDIO_TEXT: audio})
        count = len(prompts)
        return Cond(video[count:], mask=connector_mask[count:], negative_embeds=video[:count],
                    negative_mask=connector_mask[:count],
                    extras={AUDIO_TEXT: audio[count:], NEGATIVE_AUDIO_TEXT: audio[:count]})

    # --- the transformer ------------------------------------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """The video stream's (guided) velocity at ``x [B, C, f, h, w]``, unpacked, fp32, as the pipeline's loop
        computes it (the audio stream held, see the module docstring): one transformer call (batched over
        ``[negative, positive]`` with CFG), the x0-space guidance and rescale, back to a velocity."""
        batch = x.shape[0]
        grid = self.token_grid(x)
        latents = self.pack(x.float())
        embeds, mask, audio_text = cond.embeds, cond.mask, cond.extras[AUDIO_TEXT]
        timestep = self.timestep(sigma, batch)
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            require_negative(cond, guidance_scale)
            embeds, mask = torch.cat([cond.negative_embeds, embeds]), torch.cat([cond.negative_mask, mask])
            audio_text = torch.cat([cond.extras[NEGATIVE_AUDIO_TEXT], audio_text])
        rows = embeds.shape[0]
        tokens = torch.cat([latents, latents]) if cfg else latents
        timesteps = torch.cat([timestep, timestep]) if cfg else timestep
        audio_timestep = self.timestep(1.0, rows)
        v = self.run_transformer(
            hidden_states=tokens.to(embeds.dtype),
            audio_hidden_states=self.held_audio(rows).to(embeds.dtype),
            encoder_hidden_states=embeds,
            audio_encoder_hidden_states=audio_text,
            timestep=timesteps,
            audio_timestep=audio_timestep,
            sigma=timesteps,
            audio_sigma=audio_timestep,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            fps=self.frame_rate,
            audio_num_frames=self.audio_latent_frames(),
            isolate_modalities=False,
            use_cross_timestep=self.use_cross_timestep,
            return_dict=False,
        )[0].float()
        return self.unpack(self.guided_velocity(latents, v, sigma, guidance_scale if cfg else None), grid)

    def guided_velocity(self, latents: Tensor, v: Tensor, sigma: float | Tensor, guidance_scale: float | None
                        ) -> Tensor:
        """The pipeline's x0-space guidance of the transformer's velocity ``v`` (``[uncond; cond]`` rows with CFG,
        ``guidance_scale`` None without) at packed ``latents``: ``x0 = latents - sigma v``, ``x0_c + (scale - 1)
        (x0_c - x0_u)``, rescaled by ``guidance_rescale``, then ``(latents - x0) / sigma``; in the pipeline's packed
        layout and order of operations. Rows at sigma 0 get the plain (v-space) guided velocity."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        sigma = sigma.view(-1, 1, 1) if sigma.ndim else sigma
        safe = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
        if guidance_scale is None:
            text = direct = v
            x0 = latents - v * safe
            x0_text = x0
        else:
            uncond, text = v.chunk(2)
            if not _UNCONDITIONAL_GRADIENT.get():
                uncond = uncond.detach()
            direct = uncond + guidance_scale * (text - uncond)
            x0_text = latents - text * safe
            x0 = x0_text + (guidance_scale - 1) * (x0_text - (latents - uncond * safe))
        if self.guidance_rescale > 0:
            x0 = rescale_noise_cfg(x0, x0_text, guidance_rescale=self.guidance_rescale)
        guided = (latents - x0) / safe
        return torch.where(sigma > 0, guided, direct) if bool((sigma <= 0).any()) else guided

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """``sigmas = linspace(1, 1 / n, n)`` and ``mu`` from the video token count (the pipeline's
        ``calculate_shift`` with its defaults for keys the scheduler config lacks)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        height, width = image_size
        patch, patch_t = self.pipe.transformer_spatial_patch_size, self.pipe.transformer_temporal_patch_size
        scale = self.vae_scale_factor
        tokens = (self.latent_frames() // patch_t) * (height // scale // patch) * (width // scale // patch)
        config = self.scheduler.config
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps), "mu": mu}

    # --- the VAE --------------------------------------------------------------------------------------------------
    def pipeline_latents(self, latents: Tensor) -> Tensor:
        """The pipeline's ``output_type="latent"`` result for the adapter's latents: ``_denormalize_latents`` with
        the VAE's statistics buffers and ``scaling_factor``, in the latents' dtype."""
        vae = self.pipe.vae
        return self.pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    def to_vae_space(self, latents: Tensor) -> Tensor:
        """``pipeline_latents`` in the transformer's dtype (the pipeline's ``prompt_embeds`` dtype), then the VAE's."""
        return self.pipeline_latents(latents.to(self.dtype)).to(self.pipe.vae.dtype)

    def from_vae_space(self, latents: Tensor) -> Tensor:
        """``(z - mean) * scaling_factor / std`` (``LTX2Pipeline._normalize_latents``)."""
        vae = self.pipe.vae
        return self.pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, C, f, h, w]`` to videos ``[B, F, 3, H, W]`` in [0, 1], fp32, ``vae_batch`` videos per VAE
        call, as the pipeline decodes: in the transformer's dtype, the decode noise mixed in first (with
        ``timestep_conditioning``), then denormalised, then the VAE at the decode timestep. Differentiable."""
        return torch.cat([self.decode_chunk(chunk) for chunk in latents.split(self.vae_batch)])

    def decode_chunk(self, latents: Tensor) -> Tensor:
        """``decode`` of one VAE call's videos."""
        vae = self.pipe.vae
        latents = latents.to(self.dtype)
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
        latents = self.pipeline_latents(latents).to(vae.dtype)
        video = vae.decode(latents, timestep, return_dict=False)[0]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
