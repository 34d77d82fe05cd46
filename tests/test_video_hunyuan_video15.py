"""HunyuanVideo 1.5 (T2V and I2V) beyond the video adapter contract: the VAE's batch defect in diffusers 0.42.1 and
the adapter's one-video-per-call decode, the ByT5 glyph text, the LoRA round trip through the transformer's own
loader (the pipelines have no LoRA loader), and the I2V first frame against the pipeline's own preparation."""

from __future__ import annotations

import logging

import pytest
import torch

from flowalign.models import wrap_pipeline
from flowalign.samplers import rollout

from model_families import WORDS
from test_video_families import perturb_lora
from video_families import first_frame_image, fresh_video_pipeline, tiny_video_pipeline

PROMPTS = ["a red circle moving to the left", "two blue squares moving up"]


def unsliced_pipeline():
    """The tiny T2V pipeline as diffusers builds it: the VAE's batch slicing off."""
    from flowalign.models.tiny import tiny_hunyuan_video15_pipeline

    return tiny_hunyuan_video15_pipeline(WORDS, seed=0)


def test_the_diffusers_vae_cannot_take_a_batch_of_two_videos():
    """The defect the adapter works around (diffusers 0.42.1): the VAE's causal attention mask is ``[B, L, L]``
    against queries ``[B, 1, L, C]``, so a batch of two broadcasts to ``[2, 2, L, L]`` and the attention fails, in
    decode and encode alike. When this test fails, diffusers has fixed the VAE: lift the ``vae_batch`` cap in
    ``flowalign.models.hunyuan_video15``."""
    vae = unsliced_pipeline().vae
    latents = torch.randn(2, vae.config.latent_channels, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="broadcast"):
            vae.decode(latents)
        with pytest.raises(RuntimeError, match="broadcast"):
            vae.encode(torch.rand(2, 3, 5, 16, 16) * 2 - 1)
        one = vae.decode(latents[:1]).sample  # one video per call works
    assert one.shape == (1, 3, 5, 16, 16)


def test_a_batch_of_two_videos_decodes_and_encodes_one_video_per_vae_call(caplog):
    pipe = unsliced_pipeline()
    with caplog.at_level(logging.WARNING, logger="flowalign.models.hunyuan_video15"):
        model = wrap_pipeline(pipe, num_frames=5, vae_batch=2)
    assert model.vae_batch == 1 and "vae_batch=2 lowered to 1" in caplog.text
    latents = torch.randn(2, 4, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.decode(latents)
        each = [pipe.vae.decode(row[None] / pipe.vae.config.scaling_factor, return_dict=False)[0] for row in latents]
        theirs = torch.cat([pipe.video_processor.postprocess_video(video, output_type="pt") for video in each])
        encoded = model.encode_videos(ours)
    assert ours.shape == (2, 5, 3, 16, 32)
    assert torch.equal(ours, theirs)
    assert encoded.shape == latents.shape and torch.isfinite(encoded).all()


def ode(model, prompts, steps=2, size=(16, 16), **encode):
    cond = model.encode(prompts, **encode)
    x = model.prepare_noise(len(prompts), size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return rollout(model.velocity_fn(cond), x, model.sigmas(steps, size), torch.zeros(steps)).final


def test_quoted_text_reaches_the_velocity_through_the_byt5_glyph_encoder_as_in_the_pipeline():
    pipe = tiny_video_pipeline("hunyuan_video15")
    model = wrap_pipeline(pipe, num_frames=5)
    prompts = ['a sign that says "hello"', "a red circle"]
    cond = model.encode(prompts)
    glyph_tokens = cond.extras["glyph_mask"].sum(dim=1)
    assert glyph_tokens[0] > 0 and glyph_tokens[1] == 0
    assert cond.extras["glyph_embeds"][1].abs().sum() == 0
    x = model.prepare_noise(2, 16, generator=torch.Generator().manual_seed(0))
    blind = cond.index([0, 1])
    blind.extras = {**blind.extras, "glyph_mask": torch.zeros_like(blind.extras["glyph_mask"])}
    with torch.no_grad():
        assert not torch.allclose(model.velocity(x, 0.5, cond)[0], model.velocity(x, 0.5, blind)[0])
        assert torch.equal(model.velocity(x, 0.5, cond)[1], model.velocity(x, 0.5, blind)[1])
    pipe.guider = pipe.guider.new(guidance_scale=1.0)
    expected = pipe(prompt=prompts, num_inference_steps=2, num_frames=5, height=16, width=16, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(ode(model, prompts), expected)


def test_the_lora_round_trips_through_the_transformers_own_loader(tmp_path):
    model = wrap_pipeline(fresh_video_pipeline("hunyuan_video15"), num_frames=5)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 16, generator=torch.Generator().manual_seed(0))
    model.add_lora(rank=4, alpha=8)
    perturb_lora(model)
    with torch.no_grad():
        adapted = model.velocity(x, 0.6, cond)
    saved = model.save_lora(tmp_path / "lora")
    fresh = fresh_video_pipeline("hunyuan_video15")
    fresh.transformer.load_lora_adapter(str(saved), prefix=None, use_safetensors=True)
    with torch.no_grad():
        loaded = wrap_pipeline(fresh, num_frames=5).velocity(x, 0.6, cond)
    torch.testing.assert_close(loaded, adapted, rtol=1e-5, atol=1e-6)


def i2v_model():
    return wrap_pipeline(tiny_video_pipeline("hunyuan_video15_i2v"), num_frames=5)


def test_an_i2v_prompt_without_a_first_frame_is_refused_naming_what_to_give():
    model = i2v_model()
    with pytest.raises(ValueError, match=r"animates a first frame: prompt\(s\) \[0, 1\].*\"images\""):
        model.encode(PROMPTS)
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\]"):
        model.encode(PROMPTS, images=[first_frame_image(), None])


def test_the_i2v_first_frame_is_the_pipelines_own_preparation_bitwise():
    model = i2v_model()
    pipe = model.pipe
    image = first_frame_image()
    cond = model.encode(PROMPTS, images=[image, image])
    x = model.prepare_noise(2, 16, generator=torch.Generator().manual_seed(0))
    height, width = pipe.video_processor.calculate_default_height_width(image.size[1], image.size[0],
                                                                         pipe.target_size)
    resized = pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")
    with torch.no_grad():
        latents, mask = pipe.prepare_cond_latents_and_mask(latents=x, image=resized, batch_size=2, height=height,
                                                           width=width, dtype=model.dtype, device=model.device)
        embeds = pipe.encode_image(image=resized, batch_size=2, device=model.device, dtype=model.dtype)
    ours_latents, ours_mask = model.condition_input(x, cond)
    assert torch.equal(ours_latents, latents) and torch.equal(ours_mask, mask)
    assert torch.equal(model.image_embeds(x, cond), embeds)
    assert ours_latents[:, :, 0].abs().sum() > 0 and ours_latents[:, :, 1:].abs().sum() == 0
    tensor = torch.from_numpy(pipe.video_processor.pil_to_numpy(image)[0]).permute(2, 0, 1)
    from_tensor = model.encode(PROMPTS, images=[tensor, tensor])
    assert torch.equal(from_tensor.extras["first_frame"], cond.extras["first_frame"])


def test_i2v_latents_of_another_size_than_the_first_frame_are_refused_naming_the_size():
    model = i2v_model()
    cond = model.encode(PROMPTS, images=[first_frame_image()] * 2)
    x = model.prepare_noise(2, (16, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"first frames are 16x16 px.*image_size \[16, 16\]"):
        model.velocity(x, 0.5, cond)


def test_the_pipeline_drops_exactly_the_system_turn_of_the_tiny_tokenizer():
    """The tiny tokenizer's chat template gives the system turn the released 108 tokens, so the pipeline's crop keeps
    exactly the user's text (and a saved tiny pipeline, which loads back the released 108, crops the same)."""
    pipe = tiny_video_pipeline("hunyuan_video15")
    messages = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "red circle"}]
    ids = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    kept = pipe.tokenizer.convert_ids_to_tokens(ids["input_ids"][pipe.prompt_template_encode_start_idx:])
    assert pipe.prompt_template_encode_start_idx == 108 and kept[:2] == ["red", "circle"]


@pytest.mark.parametrize("shift", [5.0, 7.0, 9.0])
def test_sigmas_are_the_released_schedulers(shift):
    """The released checkpoints ship ``FlowMatchEulerDiscreteScheduler`` with shift 5 (480p), 7 (720p I2V) and 9
    (720p T2V) (diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py): ``sigmas`` is the schedule the pipeline
    sets on it, ``linspace(1, 0, N + 1)[:-1]`` shifted, then 0."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

    pipe = fresh_video_pipeline("hunyuan_video15")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    model = wrap_pipeline(pipe, num_frames=5)
    retrieve_timesteps(pipe.scheduler, 8, "cpu", sigmas=np.linspace(1.0, 0.0, 9)[:-1])
    assert torch.equal(model.sigmas(8, 16), pipe.scheduler.sigmas.float())
    assert model.sigmas(8, 16)[0] == 1 and model.sigmas(8, 16)[-1] == 0


def test_an_i2v_run_on_prompts_without_first_frames_is_refused_before_the_model_loads(tmp_path):
    """The model path does not exist: the check runs on the family alone, before anything loads."""
    from flowalign.config import load_config
    from flowalign.errors import SetupError
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    from golden_runs import small_run_values

    values = {**small_run_values(tmp_path / "no-model", tmp_path / "run"), "model.family": "hunyuan_video15_i2v",
              "train.checkpoint_every": 0}
    config = load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    with pytest.raises(SetupError, match=r"data\.train_prompts = .*model family 'hunyuan_video15_i2v' generates each "
                                         r"video from a condition image, but the prompt .* has none: give every entry "
                                         r"one.*images"):
        Trainer(config)
