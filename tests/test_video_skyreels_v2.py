"""SkyReels-V2 beyond the video adapter contract: T2V's own family when loaded, the released UniPC's flow sigmas, the
pipeline's frame-side rule and the preset; I2V's first-frame condition bitwise the pipeline's own, and I2V without
condition images refused (encoding, and training before the model loads)."""

import pytest
import torch

from flowalign.errors import SetupError
from flowalign.models import SkyReelsV2I2VModel, SkyReelsV2Model, WanModel, load_flow_model, wrap_pipeline

from video_families import wan_first_frame_image, fresh_video_pipeline, tiny_video_pipeline

PROMPTS = ["a red circle moving to the left", "two blue squares moving up"]


def test_a_saved_skyreels_v2_pipeline_loads_as_its_own_family_not_as_wan(tmp_path):
    tiny_video_pipeline("skyreels_v2").save_pretrained(tmp_path / "skyreels")
    model = load_flow_model(tmp_path / "skyreels", adapter_options={"num_frames": 5})
    assert type(model) is SkyReelsV2Model and isinstance(model, WanModel) and model.family == "skyreels_v2"
    assert model.default_image_size == (544, 960) and model.latent_frames() == 2
    in_memory = wrap_pipeline(tiny_video_pipeline("skyreels_v2"), num_frames=5)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 16, generator=torch.Generator().manual_seed(0))
    assert x.dtype == torch.float32  # drawn in fp32, as the pipeline's prepare_latents
    with torch.no_grad():
        assert torch.equal(model.velocity(x, 0.7, cond), in_memory.velocity(x, 0.7, in_memory.encode(PROMPTS)))


def test_sigmas_are_the_released_unipc_flow_sigmas():
    """The released pipelines ship UniPCMultistepScheduler over flow sigmas (flow_shift 8 for T2V, diffusers'
    SkyReelsV2Pipeline example): the adapter's sigmas are that scheduler's, and the timesteps it would pass are the
    integer part of 1000 sigma (flowalign passes 1000 sigma)."""
    from diffusers import UniPCMultistepScheduler

    pipe = fresh_video_pipeline("skyreels_v2")
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0)
    model = wrap_pipeline(pipe, num_frames=5)
    sigmas = model.sigmas(6, 16)
    released = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    released.set_timesteps(6)
    assert torch.equal(sigmas, released.sigmas.float()) and len(sigmas) == 7 and sigmas[-1] == 0
    assert sigmas[0] > 0.999 and bool((sigmas.diff() < 0).all())
    assert torch.equal(released.timesteps, (sigmas[:-1].double() * 1000).long())


def test_frame_sides_must_be_multiples_of_sixteen_as_the_pipeline_says():
    model = wrap_pipeline(tiny_video_pipeline("skyreels_v2"), num_frames=5)
    assert model.image_multiple == 16
    with pytest.raises(ValueError, match="multiple of 16"):
        model.encode_videos(torch.rand(1, 5, 3, 24, 24))


def test_the_preset_has_dancegrpos_skyreels_settings():
    from pathlib import Path

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    preset = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs/models/skyreels_v2.yaml", [])
    assert (preset.model.family, preset.model.finetune, preset.sampling.num_steps, preset.sampling.kind,
            preset.sampling.noise_level, preset.sampling.shared_noise, preset.sampling.guidance_scale,
            preset.sampling.num_frames, preset.data.group_size, preset.optim.lr, preset.loss["grpo"].beta,
            preset.loss["grpo"].clip_range) == \
        ("skyreels_v2", "full", 16, "dance", 0.3, True, 5.0, 53, 8, 1e-5, 0.0, 1e-4)
    assert preset.sampling.stochastic_steps() == 15 and preset.step_selection.count == 9  # timestep_fraction 0.6
    wrap_pipeline(tiny_video_pipeline("skyreels_v2"), num_frames=preset.sampling.num_frames)  # a 4k+1 count


def test_i2v_condition_is_the_pipelines_own_prepare_latents_and_clip_embeddings():
    pipe = tiny_video_pipeline("skyreels_v2_i2v")
    model = wrap_pipeline(pipe, num_frames=5)
    assert type(model) is SkyReelsV2I2VModel and model.takes_condition_images and model.max_condition_images == 1
    image = wan_first_frame_image()
    cond = model.encode(PROMPTS, negative_prompts=["", ""], images=[image, image])
    pixels = pipe.video_processor.preprocess(image, height=16, width=32).to(dtype=torch.float32)
    with torch.no_grad():
        _, condition = pipe.prepare_latents(pixels, 1, 4, 16, 32, 5, torch.float32, torch.device("cpu"), None,
                                            torch.zeros(1, 4, 2, 4, 8))
        embeds = pipe.encode_image(image, torch.device("cpu"))
    assert condition.shape == (1, 4 + 4, 2, 4, 8)  # the 4-channel first-frame mask, then the condition video's z
    assert torch.equal(cond.extras["condition"], torch.cat([condition, condition]))
    assert torch.equal(cond.extras["image_embeds"], torch.cat([embeds, embeds]).to(model.dtype))
    x = model.prepare_noise(2, (16, 32), generator=torch.Generator().manual_seed(0))
    assert x.shape == (2, 4, 2, 4, 8)  # the noise has the VAE's z channels, the transformer takes 2 z + 4


def test_i2v_without_condition_images_is_refused_naming_what_to_give(tmp_path, monkeypatch):
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer
    import flowalign.training.builder as builder

    from golden_runs import small_run_values

    model = wrap_pipeline(tiny_video_pipeline("skyreels_v2_i2v"), num_frames=5)
    with pytest.raises(ValueError, match=r"'skyreels_v2_i2v' is image-to-video: 2 of 2 prompts have no condition "
                                         r"image.*images=\[image"):
        model.encode(PROMPTS)
    tiny_video_pipeline("skyreels_v2_i2v").save_pretrained(tmp_path / "i2v")
    values = {**small_run_values(tmp_path / "i2v", tmp_path / "run"), "sampling.num_frames": 5}
    monkeypatch.setattr(builder, "load_flow_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SetupError, match=r"data.train_prompts = .*model family 'skyreels_v2_i2v' generates each "
                                         r"video from a condition image, but the prompt .* has none"):
        Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()]))
