"""Wan2.1 text-to-video adapter (``diffusers.WanPipeline``): a UMT5 text encoder, a 3D DiT, a causal 3D VAE.

Conventions (``WanPipeline.__call__``):

* latents ``[B, C, f, h, w]``, ``f = (num_frames - 1) / 4 + 1`` and ``h, w`` the frame size over 8 (the released
  VAE's ``scale_factor_temporal`` and ``scale_factor_spatial``); the pipeline draws them in fp32 and casts to the
  transformer's dtype for each forward pass, so ``prepare_noise`` draws fp32 noise by default;
* time: the transformer takes the scheduler's timestep ``1000 sigma`` for every row; the velocity's sign is the
  scheduler's;
* text: UMT5's last hidden state, each prompt's tokens kept and the rest zeroed up to ``max_sequence_length``
  (the pipeline's ``_get_t5_prompt_embeds``); no mask is passed to the transformer;
* CFG: two passes (conditional, then unconditional), ``uncond + scale * (cond - uncond)``, as the pipeline runs them;
* VAE: ``AutoencoderKLWan``, normalised per channel by its config's ``latents_mean`` and ``latents_std``
  (``z = (x - mean) / std``), applied in the VAE's dtype exactly as the pipeline writes it.

Wan2.1 ships ``UniPCMultistepScheduler`` with flow sigmas (``flow_shift`` 3 at 480p, 5 at 720p); flowalign's samplers
step the flow's ODE/SDE on the same sigma schedule (``sigmas``), with the shift the scheduler config names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .base import Cond, as_image_size, guided, register_model_family, require_negative
from .video import VideoFlowModel

# Every attention and MLP projection of a Wan block: self-attention, cross-attention (with the I2V image keys and
# values where present) and the feed-forward layers.
WAN_LORA_TARGETS = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "attn2.add_k_proj", "attn2.add_v_proj",
    "ffn.net.0.proj", "ffn.net.2",
)


def component_present(index: dict, name: str) -> bool:
    """Whether a pipeline config (``model_index.json`` or ``pipe.config``) has component ``name`` (an entry
    ``[library, class]`` whose class is not null)."""
    entry = index.get(name)
    return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None


def wan_variant(index: dict) -> str:
    """Which Wan model a ``WanPipeline`` / ``WanImageToVideoPipeline`` config describes: ``"ti2v"`` (Wan2.2 TI2V-5B,
    ``expand_timesteps``), ``"experts"`` (Wan2.2 A14B, a ``transformer_2``) or ``"wan21"``."""
    if index.get("expand_timesteps"):
        return "ti2v"
    if component_present(index, "transformer_2"):
        return "experts"
    return "wan21"


@register_model_family("wan")
class WanModel(VideoFlowModel):
    """Adapter over ``diffusers.WanPipeline`` (Wan2.1 T2V, one transformer)."""

    family = "wan"
    pipeline_class_name = "WanPipeline"
    lora_targets = WAN_LORA_TARGETS
    default_num_frames = 9

    @classmethod
    def claims(cls, index: dict) -> int:
        """Wan2.1 T2V: not a config with a ``transformer_2`` (Wan2.2 A14B) or ``expand_timesteps`` (TI2V-5B)."""
        return 1 if wan_variant(index) == "wan21" else 0

    def default_max_sequence_length(self) -> int:
        tokenizer = getattr(self.pipe, "tokenizer", None)
        return min(512, tokenizer.model_max_length) if tokenizer is not None else 512

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        """diffusers' own plan of ``WanTransformer3DModel`` (the video tokens split at the first block, the rotary
        embedding's outputs alike, ``proj_out`` gathered; the text is not split); None for another class."""
        return getattr(transformer_class, "_cp_plan", None)

    @classmethod
    def context_parallel_lengths(cls, model_dir: Path, config) -> dict[str, int]:
        """The video tokens ``(f / p_t)(h / p_h)(w / p_w)`` of ``sampling.num_frames`` frames at
        ``sampling.image_size``: latent frames ``f = (frames - 1) / t + 1``, latent sides ``H / s``, the transformer's
        patch ``p``."""
        vae = json.loads((model_dir / "vae" / "config.json").read_text())
        transformer = json.loads((model_dir / "transformer" / "config.json").read_text())
        t, s = int(vae.get("scale_factor_temporal", 4)), int(vae.get("scale_factor_spatial", 8))
        height, width = as_image_size(config.sampling.image_size, cls.configured_image_size(transformer, s))
        frames = config.sampling.num_frames or cls.default_num_frames
        pt, ph, pw = (int(p) for p in transformer["patch_size"])
        return {"video token sequence": ((frames - 1) // t + 1) // pt * (height // s // ph) * (width // s // pw)}

    @classmethod
    def configured_image_size(cls, transformer: dict, scale: int) -> tuple[int, int]:
        """``default_image_size`` before loading, from the transformer's config (``scale``: the VAE's spatial
        downsampling)."""
        sample = transformer.get("sample_size")
        return (int(sample) * scale, int(sample) * scale) if sample else (480, 832)

    @property
    def default_image_size(self) -> tuple[int, int]:
        """480x832, the pipeline's defaults; the tiny pipelines' transformers set a smaller ``sample_size``."""
        size = getattr(self.transformer.config, "sample_size", None)
        if size:
            side = int(size) * self.vae_scale_factor
            return side, side
        return 480, 832

    @property
    def image_multiple(self) -> int:
        """The VAE's spatial downsampling times the transformer's spatial patch (the pipeline rounds to it)."""
        return self.vae_scale_factor * int(self.transformer.config.patch_size[1])

    def vae_statistics(self, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
        """The VAE config's per-channel ``(mean, 1 / std)`` as ``[1, z, 1, 1, 1]`` tensors, built as the pipeline
        builds them (``1.0 / tensor(std)`` in fp32, then cast)."""
        config = self.pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(device, dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(device, dtype)
        return mean, inverse_std

    def to_vae_space(self, latents: Tensor) -> Tensor:
        """``x / (1 / std) + mean`` in the VAE's dtype, as ``WanPipeline`` undoes the normalisation."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean, inverse_std = self.vae_statistics(latents.dtype, latents.device)
        return latents / inverse_std + mean

    def from_vae_space(self, latents: Tensor) -> Tensor:
        """``(z - mean) * (1 / std)``, as ``WanImageToVideoPipeline.prepare_latents`` normalises its condition."""
        mean, inverse_std = self.vae_statistics(latents.dtype, latents.device)
        return (latents - mean) * inverse_std

    def prepare_noise(self, batch, image_size=None, *, generator=None, dtype=None) -> Tensor:
        """fp32 noise by default, as ``WanPipeline.prepare_latents``."""
        return super().prepare_noise(batch, image_size, generator=generator, dtype=dtype or torch.float32)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None,
               images: Sequence | None = None) -> Cond:
        """UMT5 embeddings through the pipeline's ``encode_prompt`` (negatives when given). Wan2.1 T2V takes no
        condition images."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.condition_images(images, len(prompts))
        return self.text_cond(prompts, negative_prompts)

    def text_cond(self, prompts: list[str], negative_prompts: Sequence[str] | None) -> Cond:
        """The ``Cond`` of the prompts' (and negatives') UMT5 embeddings, in the transformer's dtype."""
        with_negative = negative_prompts is not None
        embeds, negative = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            do_classifier_free_guidance=with_negative,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return Cond(embeds.to(self.dtype), negative_embeds=negative.to(self.dtype) if with_negative else None)

    def transformer_inputs(self, x: Tensor, cond: Cond) -> dict:
        """Keyword arguments beyond the latents, timestep and text that the family's transformer takes (the I2V
        families' image embeddings); none for T2V."""
        return {}

    def model_input(self, x: Tensor, cond: Cond) -> Tensor:
        """The transformer's ``hidden_states`` for latents ``x``: the latents themselves in T2V (the I2V families
        concatenate their condition)."""
        return x.to(self.dtype)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """``v = transformer(x, t = 1000 sigma, text)``; with ``guidance_scale > 1`` a second, unconditional pass and
        ``uncond + scale * (cond - uncond)``."""
        timestep = self.timestep(sigma, x.shape[0])
        return self.transformer_velocity(x, timestep, cond, guidance_scale, self.uses_cfg(guidance_scale))

    def transformer_velocity(self, x: Tensor, timestep: Tensor, cond: Cond, scale: float, cfg: bool,
                             **route) -> Tensor:
        """The transformer's velocity at ``timestep`` (the pipeline's ``timestep`` argument), the conditional pass
        and, with ``cfg``, the unconditional one combined at ``scale``; ``route``: further keyword arguments of the
        forward module (the Wan2.2 expert pair's ``expert``)."""
        hidden = self.model_input(x, cond)
        extra = {**self.transformer_inputs(x, cond), **route}
        v = self.run_transformer(hidden_states=hidden, timestep=timestep, encoder_hidden_states=cond.embeds,
                                 return_dict=False, **extra)[0]
        if cfg:
            require_negative(cond, scale)
            uncond = self.run_transformer(hidden_states=hidden, timestep=timestep,
                                          encoder_hidden_states=cond.negative_embeds, return_dict=False, **extra)[0]
            v = guided(v, uncond, scale)
        return v

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        return {}
