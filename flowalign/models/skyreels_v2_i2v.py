"""SkyReels-V2 image-to-video adapter (``diffusers.SkyReelsV2ImageToVideoPipeline``): SkyReels-V2 T2V plus Wan2.1
I2V's first-frame condition.

``SkyReelsV2ImageToVideoPipeline`` is ``WanImageToVideoPipeline``'s Wan2.1 path line for line (no second expert, no
``expand_timesteps``) under SkyReels' class names, so the adapter is ``FirstFrameCondition`` (``flowalign.models.
wan_i2v``: the condition image through the pipeline's own ``prepare_latents``, the ``[mask, condition video]``
latents concatenated to the noise, the CLIP image encoder's penultimate hidden state as
``encoder_hidden_states_image`` in both CFG passes) on ``SkyReelsV2Model``. The pipeline always encodes the image
with its CLIP encoder (a ``CLIPVisionModelWithProjection`` in the released checkpoints); every prompt needs one
condition image, and the video is sampled at its size (multiples of 16).

The released checkpoints (``Skywork/SkyReels-V2-I2V-14B-540P-Diffusers``, ``-720P``, ``-1.3B-540P``) sample with
``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=5)`` and CFG 5 (diffusers' SkyReels-V2 example).
"""

from __future__ import annotations

from .base import register_model_family
from .skyreels_v2 import SkyReelsV2Model
from .wan_i2v import FirstFrameCondition


@register_model_family("skyreels_v2_i2v")
class SkyReelsV2I2VModel(FirstFrameCondition, SkyReelsV2Model):
    """Adapter over ``diffusers.SkyReelsV2ImageToVideoPipeline`` (SkyReels-V2 I2V)."""

    family = "skyreels_v2_i2v"
    pipeline_class_name = "SkyReelsV2ImageToVideoPipeline"
