"""Lumina2 beyond the adapter contract: flipped time and negated velocity, CFG without normalisation, the system
prompt."""

import torch

from flowalign.models import Lumina2Model, wrap_pipeline
from flowalign.samplers import rollout

from model_families import tiny_pipeline

PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def test_lumina2_velocity_is_the_negated_transformer_at_one_minus_sigma():
    pipe = tiny_pipeline("lumina2")
    model = wrap_pipeline(pipe)
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v = model.velocity(x, 0.75, cond)
        direct = pipe.transformer(hidden_states=x, timestep=torch.full((2,), 0.25), encoder_hidden_states=cond.embeds,
                                  encoder_attention_mask=cond.mask, return_dict=False)[0]
    assert torch.equal(v, -direct)
    assert torch.equal(model.model_time(torch.tensor([1.0, 0.0]), 2), torch.tensor([0.0, 1.0]))


def test_lumina2_cfg_without_normalization_is_the_pipeline_without_it_bitwise():
    pipe = tiny_pipeline("lumina2")
    model = Lumina2Model(pipe, cfg_normalization=False)
    cond = model.encode(PROMPTS, negative_prompts=["", ""])
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(model.velocity_fn(cond, 4.0), x, model.sigmas(3, 32), torch.zeros(3)).final
        normalized = rollout(wrap_pipeline(pipe).velocity_fn(cond, 4.0), x, model.sigmas(3, 32), torch.zeros(3)).final
    expected = pipe(prompt=PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(0), height=32,
                    width=32, guidance_scale=4.0, cfg_normalization=False, output_type="latent",
                    max_sequence_length=model.max_sequence_length).images
    assert torch.equal(ours, expected) and not torch.allclose(ours, normalized)


def test_lumina2_system_prompt_prefixes_the_prompts_but_not_the_negatives():
    pipe = tiny_pipeline("lumina2")
    default, custom = wrap_pipeline(pipe), Lumina2Model(pipe, system_prompt="two squares")
    a = default.encode(PROMPTS, negative_prompts=["", ""])
    b = custom.encode(PROMPTS, negative_prompts=["", ""])
    embeds, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, system_prompt="two squares",
                                            max_sequence_length=custom.max_sequence_length)
    assert torch.equal(b.embeds, embeds) and torch.equal(b.mask, mask)
    assert not torch.equal(a.embeds, b.embeds) and torch.equal(a.negative_embeds, b.negative_embeds)
    assert b.mask.sum() < a.mask.sum()  # the default system prompt is longer


def test_lumina2_encode_images_is_the_vae_path_bitwise():
    pipe = tiny_pipeline("lumina2")
    model = wrap_pipeline(pipe)
    images = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.encode_images(images)
        # The inverse of the pipeline's decode: preprocess to [-1, 1], the posterior's mode, (z - shift) * scale.
        posterior = pipe.vae.encode(pipe.image_processor.preprocess(images)).latent_dist
        expected = (posterior.mode() - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    assert tuple(ours.shape) == model.latent_shape(2, (32, 48)) and torch.equal(ours, expected)
    assert model.image_multiple == 16
