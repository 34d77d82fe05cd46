"""CogView4 conventions beyond the adapter contract: the transformer's unshifted integer timestep, a VAE without
shift factor."""

import pytest
import torch

from flowalign.models import CogView4Model

from model_families import tiny_pipeline


def transformer_timesteps(pipe, steps, size):
    """The timesteps the pipeline passes its transformer, one per step."""
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"][0].clone()), with_kwargs=True)
    try:
        pipe(prompt=["a red circle"], num_inference_steps=steps, guidance_scale=1.0, height=size[0], width=size[1],
             output_type="latent", generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    return torch.stack(seen)


@pytest.mark.parametrize("steps,size", [(2, (32, 32)), (12, (32, 48)), (25, (48, 32))])
def test_the_shifted_sigmas_map_back_to_the_pipelines_integer_timesteps(steps, size):
    pipe = tiny_pipeline("cogview4")
    model = CogView4Model(pipe)
    sigmas = model.sigmas(steps, size)
    _, _, h, w = model.latent_shape(1, size)
    expected = transformer_timesteps(pipe, steps, size)
    assert torch.equal(sigmas, pipe.scheduler.sigmas)  # the pipeline's own schedule, shifted for this size
    assert torch.equal(model.model_timestep(sigmas[:-1], steps, h, w), expected)
    assert torch.equal(expected, expected.round()) and not torch.equal(sigmas[:-1] * 1000, expected)


def test_decode_and_encode_images_ignore_a_vae_shift_factor_as_the_pipeline_does():
    from flowalign.models.tiny import tiny_cogview4_pipeline
    from model_families import WORDS

    pipe = tiny_cogview4_pipeline(WORDS)
    pipe.vae.register_to_config(shift_factor=0.3)
    model = CogView4Model(pipe)
    images = pipe(prompt=["a red circle"], num_inference_steps=2, guidance_scale=1.0, height=32, width=32,
                  output_type="pt", generator=torch.Generator().manual_seed(0)).images
    latents = pipe(prompt=["a red circle"], num_inference_steps=2, guidance_scale=1.0, height=32, width=32,
                   output_type="latent", generator=torch.Generator().manual_seed(0)).images
    with torch.no_grad():
        torch.testing.assert_close(model.decode(latents), images, rtol=0, atol=1e-6)
        pixels = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(1))
        encoded = model.encode_images(pixels)
        expected = pipe.vae.encode(pipe.image_processor.preprocess(pixels)).latent_dist.mode()
    assert encoded.shape == model.latent_shape(2, (32, 48))
    assert torch.equal(encoded, expected * pipe.vae.config.scaling_factor)


def test_an_uninvertible_schedule_is_refused():
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = tiny_pipeline("cogview4")
    original = pipe.scheduler
    try:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, use_karras_sigmas=True)
        with pytest.raises(ValueError, match="use_karras_sigmas"):
            CogView4Model(pipe)
    finally:
        pipe.scheduler = original
