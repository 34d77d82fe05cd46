"""LTX-Video beyond the video adapter contract: the I2V family's first-frame conditioning against the pipeline's own
``prepare_latents``, its frozen first frame, its refusals; the resolution-dependent shift; the decode timestep and
noise against the pipeline's."""

from __future__ import annotations

import pytest
import torch

from flowalign.models.ltx_video import FIRST_FRAME
from flowalign.samplers import noise_schedule, rollout

from test_video_families import PROMPTS, wrap
from video_families import ltx_condition_image, tiny_video_pipeline


def test_i2v_first_frame_is_the_pipelines_prepare_latents_bitwise():
    pipe = tiny_video_pipeline("ltx_video_i2v")
    model = wrap("ltx_video_i2v")
    image = ltx_condition_image()
    size = (32, 64)
    pixels = pipe.video_processor.preprocess(image, height=size[0], width=size[1])
    theirs, mask = pipe.prepare_latents(pixels, 1, 8, *size, 5, torch.float32, "cpu",
                                        torch.Generator().manual_seed(3))
    theirs = pipe._unpack_latents(theirs, 2, size[0] // 4, size[1] // 4)
    generator = torch.Generator().manual_seed(3)
    cond = model.encode(PROMPTS[:1], images=[image], image_size=size, generator=generator)
    start = model.start_latents(model.prepare_noise(1, size, generator=generator), cond)
    assert torch.equal(start, theirs)  # the condition draw, then the noise, from one generator
    assert torch.equal(model.conditioning_mask(start), mask)
    # Without a generator: the posterior's mode, one fixed condition per image.
    from diffusers.pipelines.ltx.pipeline_ltx_image2video import retrieve_latents

    mode = model.encode(PROMPTS[:1], images=[image], image_size=size).extras[FIRST_FRAME]
    with torch.no_grad():
        posterior = pipe.vae.encode(pixels.unsqueeze(2))
    expected = pipe._normalize_latents(retrieve_latents(posterior, sample_mode="argmax"), pipe.vae.latents_mean,
                                       pipe.vae.latents_std)
    assert torch.equal(mode, expected)


def test_i2v_first_frame_stays_or_flows_onto_the_condition():
    model = wrap("ltx_video_i2v")
    size = (32, 32)
    cond = model.encode(PROMPTS, images=[ltx_condition_image()] * 2)
    first = cond.extras[FIRST_FRAME]
    noise = model.prepare_noise(2, size, generator=torch.Generator().manual_seed(0))
    sigmas = model.sigmas(3, size)
    with torch.no_grad():
        kept = rollout(model.velocity_fn(cond), model.start_latents(noise, cond), sigmas, torch.zeros(3))
        flowed = rollout(model.velocity_fn(cond), noise, sigmas, torch.zeros(3))
        sde = rollout(model.velocity_fn(cond), noise, sigmas, noise_schedule(0.7).levels(3), kind="flow_grpo",
                      generator=torch.Generator().manual_seed(1))
    assert torch.equal(kept.final[:, :, :1], first)  # started as the pipeline starts: frame 0 bit for bit
    torch.testing.assert_close(flowed.final[:, :, :1], first, rtol=0, atol=1e-6)  # from plain noise: onto it
    assert not torch.equal(kept.final[:, :, 1:], noise[:, :, 1:])
    # The other frames see the condition whatever frame 0 of the state holds; frame 0's velocity is 0 on it.
    with torch.no_grad():
        from_start = model.velocity(model.start_latents(noise, cond), 0.7, cond)
        from_noise = model.velocity(noise, 0.7, cond)
    assert torch.equal(from_start[:, :, 1:], from_noise[:, :, 1:]) and not from_start[:, :, :1].any()
    torch.testing.assert_close(from_noise[:, :, :1], (noise[:, :, :1] - first) / 0.7)
    assert torch.isfinite(sde.transitions.log_prob).all()


def test_i2v_without_condition_images_is_refused_naming_what_to_give():
    model = wrap("ltx_video_i2v")
    with pytest.raises(ValueError, match=r"one condition image per prompt.*\"images\": \[path\].*prompts \[0, 1\]"):
        model.encode(PROMPTS)
    with pytest.raises(ValueError, match=r"prompts \[1\] have none"):
        model.encode(PROMPTS, images=[ltx_condition_image(), None])
    with pytest.raises(ValueError, match="at most 1 per prompt"):
        model.encode(PROMPTS[:1], images=[[ltx_condition_image()] * 2])
    cond = model.encode(PROMPTS[:1], images=[ltx_condition_image()])
    x = model.prepare_noise(1, (32, 64))
    with pytest.raises(ValueError, match=r"encoded at 32x32 px but the video is sampled at 32x64"):
        model.velocity(x, 1.0, cond)


def test_the_shift_follows_the_video_token_count():
    model = wrap("ltx_video")
    small, large = model.sigmas(4, (32, 32)), model.sigmas(4, (64, 64))
    assert small[0] == large[0] == 1 and small[-1] == large[-1] == 0
    assert (large[1:-2] > small[1:-2]).all() and torch.allclose(large[-2], small[-2])  # a larger shift; shift_terminal 0.1 at the end
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift
    import numpy as np

    released = FlowMatchEulerDiscreteScheduler.from_config(model.pipe.scheduler.config)
    released.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=calculate_shift(2 * 16 * 16, 1024, 4096, 0.95, 2.05))
    assert torch.equal(large, released.sigmas)


def test_decode_timestep_and_noise_are_the_pipelines():
    pipe = tiny_video_pipeline("ltx_video")
    size, decode = (32, 32), {"decode_timestep": 0.05, "decode_noise_scale": 0.025}
    frames = pipe(prompt=PROMPTS, num_inference_steps=2, generator=torch.Generator().manual_seed(4), height=size[0],
                  width=size[1], num_frames=5, guidance_scale=1.0, output_type="pt",
                  max_sequence_length=wrap("ltx_video").max_sequence_length, **decode).frames
    generator = torch.Generator().manual_seed(4)
    model = wrap("ltx_video", vae_batch=2, decode_generator=generator, **decode)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, size, generator=generator)  # the pipeline's draws: the noise, then the decode noise
    with torch.no_grad():
        latents = rollout(model.velocity_fn(cond), x, model.sigmas(2, size), torch.zeros(2)).final
        ours = model.decode(latents)
        plain = wrap("ltx_video", vae_batch=2).decode(latents)
    torch.testing.assert_close(ours, frames, rtol=0, atol=1e-6)
    assert not torch.allclose(plain, frames, rtol=0, atol=1e-6)


def test_the_ltx_video_preset_has_flow_factorys_ltx_settings_and_frames_the_vae_takes():
    from pathlib import Path

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    preset = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/models/ltx_video.yaml", [])
    s = preset.sampling
    assert (preset.model.family, s.num_steps, s.kind, s.noise_level, s.stochastic_steps(), s.guidance_scale,
            s.num_frames, preset.model.lora_rank, preset.model.lora_alpha, preset.optim.lr, preset.data.group_size,
            preset.loss["grpo"].beta, preset.loss["grpo"].clip_range, preset.advantage.clip) == \
        ("ltx_video", 24, "cps", 0.8, 3, 1.0, 121, 64, 128, 3e-4, 16, 0.0, 1e-4, 5.0)
    # The tiny VAE compresses 4x in time, the released one 8x: 121 = 8 * 15 + 1 = 4 * 30 + 1 fits both.
    assert wrap("ltx_video").check_num_frames(s.num_frames) == 121


def test_an_i2v_family_refuses_a_prompt_file_without_condition_images_before_the_model_loads(tmp_path):
    from flowalign.config import load_config
    from flowalign.errors import SetupError
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    from golden_runs import small_run_values

    # The model path does not exist: the check runs on the family alone, before anything loads.
    values = {**small_run_values(tmp_path / "no-model", tmp_path / "run"), "model.family": "ltx_video_i2v",
              "sampling.num_frames": 5}
    config = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(SetupError, match=r"data\.train_prompts = .*model family 'ltx_video_i2v' generates each video "
                                         r"from a condition image, but the prompt .* has none: give every entry one"):
        Trainer(config)
