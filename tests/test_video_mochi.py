"""Mochi beyond the video adapter contract: its inverted, linear-quadratic time as flowalign's flow time, exact in
fp32 for every step count; the transformer's time; 6k+1 frames."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_video_families import wrap


@pytest.mark.parametrize("steps", [2, 3, 7, 28, 64])
def test_flow_time_is_the_inverted_schedule_exactly(steps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    model = wrap("mochi")
    # The released scheduler (genmo/mochi-1-preview): flow matching with inverted sigmas, no shift.
    released = FlowMatchEulerDiscreteScheduler(invert_sigmas=True, shift=1.0)
    released.set_timesteps(sigmas=np.array(linear_quadratic_schedule(steps, 0.025)))
    inverted = released.sigmas
    sigmas = model.sigmas(steps, (16, 16))
    assert sigmas[0] == 1 and sigmas[-1] == 0 and (sigmas[1:] < sigmas[:-1]).all()
    assert torch.equal(1.0 - sigmas, inverted)  # sigma = 1 - s_inv loses nothing
    # An Euler step of flowalign's (sigma' - sigma) * (-out) is the scheduler's (s_inv' - s_inv) * out, bit for bit.
    assert torch.equal(sigmas[1:] - sigmas[:-1], -(inverted[1:] - inverted[:-1]))
    timesteps = torch.stack([model.timestep(sigma, 1)[0] for sigma in sigmas[:-1]])
    assert torch.equal(timesteps, released.timesteps)


def test_mochi_refuses_one_step_clearly():
    with pytest.raises(ValueError, match="at least 2 steps, got 1"):
        wrap("mochi").sigmas(1)


def test_mochi_takes_6k_plus_1_frames():
    with pytest.raises(ValueError, match=r"sampling.num_frames=9.*6k\+1: use 7 or 13"):
        wrap("mochi", num_frames=9)
    model = wrap("mochi")
    assert model.latent_frames() == 2 and model.latent_shape(1, (16, 32)) == (1, 12, 2, 2, 4)


def test_the_mochi_preset_samples_with_the_pipelines_defaults():
    from pathlib import Path

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    preset = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/models/mochi.yaml", [])
    s = preset.sampling
    assert (preset.model.family, s.num_steps, s.guidance_scale, s.num_frames, s.image_size, s.stochastic_steps()) == \
        ("mochi", 64, 4.5, 19, None, 63)
    model = wrap("mochi")
    assert model.check_num_frames(s.num_frames) == 19 and model.default_image_size == (480, 848)
    assert model.sigmas(s.num_steps).shape == (65,)
