"""Wan2.2 TI2V-5B adapters: ``WanPipeline(expand_timesteps=True)`` (text-to-video) and its image-to-video mode
``WanImageToVideoPipeline(expand_timesteps=True)``.

Conventions (the pipelines' ``expand_timesteps`` branches; everything else is Wan2.1's, ``flowalign.models.wan``):

* one transformer on the Wan2.2 VAE's latents (``AutoencoderKLWan`` with ``is_residual`` and a 2x2 pixel patchify:
  16x in space, 4x in time, 48 channels as released), normalised per channel as Wan2.1's;
* per-token timesteps: the transformer takes ``[B, f * h/2 * w/2]`` timesteps (one per patch token), built as the
  pipeline builds them, ``(mask[:, ::2, ::2] * t).flatten()`` with a mask of ones (text-to-video) or of ones with a
  zero first latent frame (image-to-video);
* image-to-video: the condition image is the first pixel frame; its latent (``[B, z, 1, h, w]``, the pipeline's own
  ``prepare_latents``: ``Cond.extras["condition"]``) replaces the first latent frame of the transformer's input,
  ``(1 - mask) * condition + mask * latents``, at timestep 0. The pipeline steps the first frame with the
  transformer's output there and overwrites it with the condition at the end: that frame is never denoised. Here
  the velocity of the first frame is the flow's own velocity towards the condition, ``(x_first - condition) /
  sigma`` (what the Euler step needs to land on it): it does not depend on the transformer, so a policy and its
  reference give every transition's first frame the same mean, and the frozen frame's terms cancel from every
  ratio and KL (each is the same policy-independent Gaussian term). An ODE rollout's first frame reaches the
  condition within rounding (the pipeline's is the condition exactly); every other frame is the pipeline's bit for
  bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Cond, register_model_family
from .wan import WanModel, wan_variant
from .wan_i2v import CONDITION, FirstFrameCondition


@register_model_family("wan22_ti2v")
class WanTI2VModel(WanModel):
    """Adapter over ``diffusers.WanPipeline(expand_timesteps=True)``: Wan2.2 TI2V-5B text-to-video."""

    family = "wan22_ti2v"
    pipeline_class_name = "WanPipeline"
    frozen_first_frame = False
    context_parallel_refusal = ("its per-token timesteps and frozen condition frame are not yet checked under a "
                                "split sequence")

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        return None

    @classmethod
    def claims(cls, index: dict) -> int:
        """A Wan config with ``expand_timesteps`` (TI2V-5B): this adapter's own."""
        return 2 if wan_variant(index) == "ti2v" else 0

    def token_timesteps(self, sigma: float | Tensor, x: Tensor) -> Tensor:
        """``[B, f * h/p * w/p]``: each row's ``1000 sigma`` on every patch token, as the pipeline's
        ``(mask[0][0][:, ::p, ::p] * t).flatten()`` (0 on the first frame's tokens when it is the condition)."""
        batch, _, frames, height, width = x.shape
        t = self.timestep(sigma, batch)
        _, patch_h, patch_w = self.transformer.config.patch_size
        mask = torch.ones(frames, height, width, dtype=torch.float32, device=x.device)
        if self.frozen_first_frame:
            mask[0] = 0
        tokens = mask[:, ::patch_h, ::patch_w]
        if t.ndim == 0 or bool((t == t[0]).all()):
            return (tokens * t[0]).flatten().unsqueeze(0).expand(batch, -1)
        return (tokens.unsqueeze(0) * t.view(batch, 1, 1, 1)).flatten(1)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """The transformer's velocity at per-token timesteps ``1000 sigma`` (CFG as Wan2.1's)."""
        return self.transformer_velocity(x, self.token_timesteps(sigma, x), cond, guidance_scale,
                                         self.uses_cfg(guidance_scale))


@register_model_family("wan22_ti2v_i2v")
class WanTI2VImageModel(FirstFrameCondition, WanTI2VModel):
    """Adapter over ``diffusers.WanImageToVideoPipeline(expand_timesteps=True)``: Wan2.2 TI2V-5B image-to-video."""

    family = "wan22_ti2v_i2v"
    pipeline_class_name = "WanImageToVideoPipeline"
    frozen_first_frame = True

    @staticmethod
    def first_frame_mask(x: Tensor) -> Tensor:
        """``[1, 1, f, h, w]``: 0 on the first latent frame (the condition), 1 elsewhere (the pipeline's)."""
        mask = torch.ones(1, 1, *x.shape[2:], dtype=x.dtype, device=x.device)
        mask[:, :, 0] = 0
        return mask

    def model_input(self, x: Tensor, cond: Cond) -> Tensor:
        """``(1 - mask) * condition + mask * latents`` in the transformer's dtype: the condition as first frame."""
        condition = cond.extras[CONDITION]
        self.check_condition_size(x, condition)
        mask = self.first_frame_mask(x)
        return ((1 - mask) * condition.to(x.dtype) + mask * x).to(self.dtype)

    def velocity(self, x: Tensor, sigma: float | Tensor, cond: Cond, guidance_scale: float = 1.0) -> Tensor:
        """The transformer's velocity on every frame but the first; on the first, ``(x - condition) / sigma``, the
        flow's velocity to the condition (module docstring)."""
        v = super().velocity(x, sigma, cond, guidance_scale)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
        sigma = sigma.view(-1, 1, 1, 1, 1) if sigma.ndim else sigma
        first = (x[:, :, :1].float() - cond.extras[CONDITION].float()) / sigma
        return torch.cat([first.to(v.dtype), v[:, :, 1:]], dim=2)
