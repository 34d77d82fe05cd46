"""CogView4 adapter: GLM text embeddings, an unshifted integer timestep, size micro-conditioning, two-pass CFG.

Conventions of ``diffusers.CogView4Pipeline`` that the adapter reproduces:

* **Text**: the GLM encoder's second-to-last hidden state of the prompt tokenised with ``padding="longest"`` and
  then left-padded with the pad id up to a multiple of 16 tokens; no attention mask. A batch's embeddings therefore
  depend on its longest prompt: ``encode`` encodes the batch as the pipeline does, and the negative prompts (default
  the empty prompt) as a batch of their own, with their own length.
* **Time**: the transformer is conditioned on the *unshifted* timestep. The pipeline builds
  ``timesteps = int(linspace(1000, 1, N))`` and ``sigmas = timesteps / 1000``, which the scheduler then shifts
  (dynamic shifting, ``time_shift_type="linear"``: ``sigma' = mu / (mu + 1/sigma - 1)`` with
  ``mu = sqrt(seq_len / base_seq_len) * max_shift + base_shift``, seq_len the number of 2x2 image patches); the
  latents move along the shifted sigmas while the transformer sees the integer ``timesteps``. ``velocity`` receives
  the shifted sigma, inverts the shift for the size of ``x`` and rounds to the integer timestep the pipeline feeds
  (on the pipeline's grid that is its timestep exactly; elsewhere the nearest integer timestep).
* **Latents**: unpacked ``[B, C, H/8, W/8]``, as the pipeline's and the transformer's (it patchifies inside);
  the velocity is the transformer's output, no sign flip.
* **Size conditioning**: ``original_size = target_size = (H, W)``, ``crop_coords = (0, 0)``, in the text dtype.
* **CFG**: ``guidance_scale > 1``: a separate unconditional pass (text lengths differ), then
  ``uncond + s * (cond - uncond)``.
* **VAE**: ``latents / scaling_factor`` to decode, no shift factor (the pipeline ignores one).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from .base import Cond, FlowModel, guided, register_model_family, require_negative

# The single-stream attention's projections of every CogView4 block (text and image tokens share them).
COGVIEW4_ATTENTION_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")


@register_model_family("cogview4")
class CogView4Model(FlowModel):
    """Adapter over ``diffusers.CogView4Pipeline``."""

    family = "cogview4"
    context_parallel_refusal = ("its attention processor (CogView4AttnProcessor) calls scaled_dot_product_attention "
                                "itself, not diffusers' attention dispatcher, so a split sequence would attend only "
                                "to each process's own tokens")
    pipeline_class_name = "CogView4Pipeline"
    lora_targets = COGVIEW4_ATTENTION_TARGETS

    def __init__(self, pipe, *, max_sequence_length: int | None = None):
        super().__init__(pipe, max_sequence_length=max_sequence_length)
        config = self.scheduler.config
        unsupported = [name for name in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                                         "invert_sigmas") if config.get(name, False)]
        if config.get("shift_terminal"):
            unsupported.append("shift_terminal")
        if unsupported:
            raise ValueError(f"the CogView4 adapter conditions the transformer on the unshifted timestep, which it "
                             f"recovers by inverting the scheduler's shift; it cannot invert {unsupported}")

    def default_max_sequence_length(self) -> int:
        return min(1024, self.pipe.tokenizer.model_max_length)

    @property
    def default_image_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * self.vae_scale_factor
        return size, size

    @property
    def image_multiple(self) -> int:
        """16 (the pipeline's ``check_inputs``), and the VAE's downsampling times the transformer's patch size."""
        return math.lcm(16, self.vae_scale_factor * self.transformer.config.patch_size)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, negative_prompts: Sequence[str] | None = None) -> Cond:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        with_negative = negative_prompts is not None
        embeds, negative = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=list(negative_prompts) if with_negative else None,
            do_classifier_free_guidance=with_negative,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
        )
        return Cond(embeds, negative_embeds=negative if with_negative else None)

    # --- time ------------------------------------------------------------------------------------------------------
    def _mu(self, latent_height: int, latent_width: int) -> float:
        from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift

        config = self.scheduler.config
        patch = self.transformer.config.patch_size
        return calculate_shift(
            (latent_height * latent_width) // (patch**2),
            config.get("base_image_seq_len", 256),
            config.get("base_shift", 0.25),
            config.get("max_shift", 0.75),
        )

    def scheduler_kwargs(self, num_steps: int, image_size: tuple[int, int]) -> dict:
        """The pipeline's own schedule: integer timesteps ``linspace(1000, 1, N)``, sigmas ``timesteps / 1000``."""
        train_steps = self.scheduler.config.num_train_timesteps
        timesteps = np.linspace(train_steps, 1.0, num_steps).astype(np.int64).astype(np.float32)
        _, _, h, w = self.latent_shape(1, image_size)
        return {"timesteps": timesteps, "sigmas": timesteps / train_steps, "mu": self._mu(h, w)}

    def unshift(self, sigma: Tensor, latent_height: int, latent_width: int) -> Tensor:
        """The scheduler's shift inverted (float64): the sigma before shifting, for latents of this size."""
        config = self.scheduler.config
        sigma = sigma.to(torch.float64)
        if config.get("use_dynamic_shifting", False):
            mu = self._mu(latent_height, latent_width)
            factor = mu if config.get("time_shift_type", "exponential") == "linear" else math.exp(mu)
            # sigma' = f / (f + 1/s - 1)  <=>  s = 1 / (1 + f (1/sigma' - 1))
            return 1.0 / (1.0 + factor * (1.0 / sigma - 1.0))
        shift = float(config.shift)
        # sigma' = k s / (1 + (k - 1) s)  <=>  s = sigma' / (k - (k - 1) sigma')
        return sigma / (shift - (shift - 1.0) * sigma)

    def model_timestep(self, sigma: float | Tensor, batch: int, latent_height: int, latent_width: int) -> Tensor:
        """The transformer's timestep for the shifted ``sigma``: the integer unshifted timestep, fp32, one per row."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device)
        t = torch.round(self.unshift(sigma, latent_height, latent_width) * self.scheduler.config.num_train_timesteps)
        t = t.to(torch.float32)
        return t.expand(batch) if t.ndim == 0 else t

    # --- velocity --------------------------------------------------------------------------------------------------
    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        batch, _, h, w = x.shape
        hidden = x.to(self.dtype)
        timestep = self.model_timestep(sigma, batch, h, w)
        text_dtype = cond.embeds.dtype
        size = torch.tensor([[h * self.vae_scale_factor, w * self.vae_scale_factor]], dtype=text_dtype,
                            device=self.device).repeat(batch, 1)
        crop = torch.zeros((batch, 2), dtype=text_dtype, device=self.device)

        def forward(embeds: Tensor) -> Tensor:
            return self.run_transformer(hidden_states=hidden, encoder_hidden_states=embeds, timestep=timestep,
                                        original_size=size, target_size=size, crop_coords=crop, return_dict=False)[0]

        v = forward(cond.embeds)
        if self.uses_cfg(guidance_scale):
            require_negative(cond, guidance_scale)
            v = guided(v, forward(cond.negative_embeds), guidance_scale)
        return v

    # --- VAE: a scaling factor and no shift factor -----------------------------------------------------------------
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.pipe.vae
        return self.decode_vae_latents(latents.to(vae.dtype) / vae.config.scaling_factor)

    def encode_images(self, images: Tensor, *, generator=None, sample: bool = False,
                      dtype: torch.dtype | None = None) -> Tensor:
        """``decode``'s inverse: the VAE posterior's mean (or a draw) times ``scaling_factor``, no shift (as the
        CogView4 control pipeline encodes its control image)."""
        latents = self.vae_posterior_latents(images, generator=generator, sample=sample)
        return self.checked_latents(latents * self.pipe.vae.config.scaling_factor, images, dtype)
