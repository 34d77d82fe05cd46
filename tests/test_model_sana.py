"""SANA beyond the adapter contract: the DC-AE encoding, fp32 latents, and a complex human instruction."""

import torch

from flowalign.models import SanaModel, wrap_pipeline
from flowalign.samplers import rollout

from model_families import tiny_pipeline

PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def test_sana_encode_images_is_the_dc_ae_encoding_and_inverts_decode_in_shape():
    pipe = tiny_pipeline("sana")
    model = wrap_pipeline(pipe)
    images = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.encode_images(images)
        # SANA's ControlNet pipeline: the image processor's normalisation, the DC-AE's latent, its scaling factor.
        expected = pipe.vae.encode(pipe.image_processor.preprocess(images)).latent * pipe.vae.config.scaling_factor
        sampled = model.encode_images(images, sample=True, generator=torch.Generator().manual_seed(1))
        decoded = model.decode(ours)
    assert tuple(ours.shape) == model.latent_shape(2, (32, 64)) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert torch.equal(sampled, ours)  # a deterministic encoder: nothing to sample
    assert decoded.shape == images.shape
    assert model.prepare_noise(1, 32, generator=torch.Generator().manual_seed(0)).dtype == torch.float32


def test_sana_with_a_complex_human_instruction_is_the_pipeline_with_it_bitwise():
    pipe = tiny_pipeline("sana")
    instruction = ["describe the photo of the shapes:", "the prompt:"]
    model = SanaModel(pipe, complex_human_instruction=instruction)
    cond = model.encode(PROMPTS, negative_prompts=["", ""])
    # Token 0 plus the last max_sequence_length - 1 tokens of the instruction-prefixed prompt.
    assert cond.embeds.shape[1] == cond.negative_embeds.shape[1] == model.max_sequence_length
    assert not torch.equal(cond.embeds, wrap_pipeline(pipe).encode(PROMPTS).embeds)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(model.velocity_fn(cond, 3.0), x, model.sigmas(3, 32), torch.zeros(3)).final
    expected = pipe(prompt=PROMPTS, num_inference_steps=3, generator=torch.Generator().manual_seed(0),
                    output_type="latent", height=32, width=32, guidance_scale=3.0, use_resolution_binning=False,
                    max_sequence_length=model.max_sequence_length, complex_human_instruction=instruction).images
    assert torch.equal(ours, expected)
