"""SkyReels-V2 text-to-video adapter (``diffusers.SkyReelsV2Pipeline``): Wan2.1's machinery under another name.

SkyReels-V2 is a Wan2.1 model retrained by the SkyReels team; its pipeline is ``WanPipeline``'s loop line for line
(``SkyReelsV2Pipeline.__call__``), so the adapter is ``WanModel`` with SkyReels' class names and defaults:

* latents ``[B, C, f, h, w]``, ``f = (num_frames - 1) / 4 + 1``, ``h, w`` the frame size over 8, drawn in fp32 and
  cast to the transformer's dtype for each forward pass;
* time: the transformer (``SkyReelsV2Transformer3DModel``, Wan's blocks with diffusion forcing and an fps embedding
  that the T2V pipeline does not use) takes the scheduler's timestep ``1000 sigma`` for every row; the velocity's
  sign is the scheduler's;
* text: UMT5's last hidden state, each prompt's tokens kept and the rest zeroed up to ``max_sequence_length`` (512),
  no mask passed to the transformer;
* CFG: two passes (conditional, then unconditional), ``uncond + scale * (cond - uncond)``; the pipeline's default
  scale is 6;
* VAE: Wan2.1's ``AutoencoderKLWan``, normalised per channel by its config's ``latents_mean`` and ``latents_std``;
* frame sizes: the pipeline refuses sides that are not multiples of 16 (``image_multiple``).

The released checkpoints (``Skywork/SkyReels-V2-T2V-14B-540P-Diffusers`` and ``-720P``) sample 97 frames at 544x960
with ``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=8)``; ``sigmas`` reads that scheduler's flow sigmas
(the released UniPC passes the integer part of ``1000 sigma`` as the timestep, flowalign passes ``1000 sigma``).
"""

from __future__ import annotations

import math

from .base import register_model_family
from .wan import WAN_LORA_TARGETS, WanModel


@register_model_family("skyreels_v2")
class SkyReelsV2Model(WanModel):
    """Adapter over ``diffusers.SkyReelsV2Pipeline`` (SkyReels-V2 T2V): ``WanModel`` with SkyReels' defaults."""

    family = "skyreels_v2"
    pipeline_class_name = "SkyReelsV2Pipeline"
    lora_targets = WAN_LORA_TARGETS
    default_num_frames = 9

    @property
    def default_image_size(self) -> tuple[int, int]:
        """544x960, the pipeline's defaults (the 540P checkpoints' size)."""
        return 544, 960

    @property
    def image_multiple(self) -> int:
        """Wan's rule (the VAE's downsampling times the patch) and the pipeline's 16 (``check_inputs``)."""
        return math.lcm(16, super().image_multiple)
