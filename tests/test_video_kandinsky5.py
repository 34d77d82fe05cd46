"""Kandinsky 5 T2V beyond the video adapter contract: the text reaches the velocity (the tiny pipeline draws the
zero-initialised modulations, else every block's gate is 0), and a transformer without ``visual_cond`` (no zeros
appended to the latents) samples as its pipeline does, bit for bit."""

from __future__ import annotations

import torch

from flowalign.models import wrap_pipeline
from flowalign.models.tiny import tiny_kandinsky5_pipeline
from flowalign.samplers import rollout

from model_families import WORDS
from video_families import tiny_video_pipeline

PROMPTS = ["a red circle moving to the left", "two blue squares moving up"]


def test_the_prompt_reaches_the_velocity():
    model = wrap_pipeline(tiny_video_pipeline("kandinsky5_t2v"), num_frames=5)
    x = model.prepare_noise(1, 16, generator=torch.Generator().manual_seed(0)).repeat(2, 1, 1, 1, 1)
    with torch.no_grad():
        v = model.velocity(x, 0.5, model.encode(PROMPTS))
    assert not torch.allclose(v[0], v[1])


def test_a_transformer_without_visual_cond_samples_as_its_pipeline_bitwise():
    pipe = tiny_kandinsky5_pipeline(WORDS, transformer={"visual_cond": False})
    model = wrap_pipeline(pipe, num_frames=5)
    assert model.model_input(model.prepare_noise(2, 16)).shape[-1] == model.latent_channels
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(model.velocity_fn(cond), x, model.sigmas(2, 16), torch.zeros(2)).final
    expected = pipe(prompt=PROMPTS, num_inference_steps=2, num_frames=5, height=16, width=16, guidance_scale=1.0,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(model.pipeline_latents(ours), expected)


def test_the_pipeline_drops_exactly_the_template_prefix_of_the_tiny_tokenizer():
    pipe = tiny_video_pipeline("kandinsky5_t2v")
    ids = pipe.tokenizer.tokenizer(pipe.prompt_template.format("red circle")).input_ids
    kept = pipe.tokenizer.tokenizer.convert_ids_to_tokens(ids[pipe.prompt_template_encode_start_idx:])
    assert pipe.prompt_template_encode_start_idx == 128 and kept[:2] == ["red", "circle"]
