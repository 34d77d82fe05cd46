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

Context parallelism (``distributed.context_parallel``): diffusers ships no plan for ``SkyReelsV2Transformer3DModel``;
``skyreels_v2_plan`` is Wan's in diffusers' format, which SkyReels' transformer admits because it is Wan's layout:
its attention (``SkyReelsV2AttnProcessor``) goes through diffusers' dispatcher with no mask in the T2V and I2V
forwards flowalign runs, the rotary table comes out of one submodule (``rope``: cos and sin ``[1, L, 1, d]``, split on
the token axis like the tokens), the video tokens enter the first block ``[B, L, D]`` and leave through ``proj_out``,
where they are gathered before the unpatchify. The text (and the I2V's CLIP image tokens ahead of it) is not split:
the cross-attention runs on each process's own queries against the whole text, without an exchange
(``after_context_parallel``: SkyReels' processor would route it through Ulysses, whose backward in diffusers 0.42.1
fails for keys longer or shorter than the queries; diffusers' Wan processor keeps it local). Diffusion forcing
(per-frame timesteps, the DF checkpoints), which the T2V and I2V pipelines do not use, would give ``norm_out`` a
per-token shift the plan does not split.
"""

from __future__ import annotations

import math

from .base import register_model_family
from .wan import WAN_LORA_TARGETS, WanModel


def skyreels_v2_plan() -> dict:
    """Wan's context-parallel plan for ``SkyReelsV2Transformer3DModel`` (module docstring): the rotary table's cos and
    sin split on their token axis as ``rope`` returns them, the video tokens split as the first block takes them, the
    whole sequence gathered from ``proj_out``."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "rope": {0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True),
                 1: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True)},
        "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


@register_model_family("skyreels_v2")
class SkyReelsV2Model(WanModel):
    """Adapter over ``diffusers.SkyReelsV2Pipeline`` (SkyReels-V2 T2V): ``WanModel`` with SkyReels' defaults."""

    family = "skyreels_v2"
    pipeline_class_name = "SkyReelsV2Pipeline"
    lora_targets = WAN_LORA_TARGETS
    default_num_frames = 9

    @classmethod
    def context_parallel_plan(cls, transformer_class: type) -> dict | None:
        """``skyreels_v2_plan`` for ``SkyReelsV2Transformer3DModel`` (diffusers has none); None for another class. The
        split video tokens are counted by ``WanModel.context_parallel_lengths`` (the same latent grid and patch)."""
        from diffusers import SkyReelsV2Transformer3DModel

        return skyreels_v2_plan() if issubclass(transformer_class, SkyReelsV2Transformer3DModel) else None

    @classmethod
    def after_context_parallel(cls, transformer) -> None:
        """Each block's cross-attention (to the unsplit text, and the I2V's image tokens) attends from the process's
        own queries to the whole text, without diffusers' exchange: what diffusers' Wan processor does
        (``parallel_config=None`` when it attends to the text, diffusers PR 12909). SkyReels' processor still passes
        the parallel config there, and diffusers 0.42.1's Ulysses backward takes the keys to be as long as the
        queries: the key gradient's reshape fails (measured on 2 gloo processes, the tiny SkyReels-V2:
        ``shape '[2, 2, 16, 1, 8]' is invalid for input of size 384``, 16 video tokens per process, 12 text
        tokens). The upstream fix is Wan's, in ``SkyReelsV2AttnProcessor``."""
        for block in transformer.blocks:
            block.attn2.processor._parallel_config = None

    @classmethod
    def configured_image_size(cls, transformer: dict, scale: int) -> tuple[int, int]:
        """``default_image_size`` before loading: 544x960 whatever the config."""
        return 544, 960

    @property
    def default_image_size(self) -> tuple[int, int]:
        """544x960, the pipeline's defaults (the 540P checkpoints' size)."""
        return 544, 960

    @property
    def image_multiple(self) -> int:
        """Wan's rule (the VAE's downsampling times the patch) and the pipeline's 16 (``check_inputs``)."""
        return math.lcm(16, super().image_multiple)
