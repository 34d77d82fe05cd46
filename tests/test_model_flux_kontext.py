"""FLUX.1-Kontext with condition images, beyond the adapter contract (which runs it without one, as FLUX).

An ODE rollout through the adapter with a condition image per prompt equals ``FluxKontextPipeline(image=...,
output_type="latent")`` bit for bit. The pipeline is called with ``max_area=height * width`` (it otherwise rescales
the request to 1024^2) and ``_auto_resize=False`` (it otherwise snaps the condition image to one of Kontext's
preferred resolutions, all about 1024^2): the adapter encodes a condition image at its own size floored to a multiple
of ``2 * vae_scale_factor``, as the pipeline then does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.models import FluxModel, pack_latents, wrap_pipeline
from flowalign.models.tiny import tiny_flux_kontext_pipeline
from flowalign.samplers import rollout

from model_families import WORDS, tiny_pipeline

PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


def condition_tensors(size, seed=3):
    return list(torch.rand(len(PROMPTS), 3, *size, generator=torch.Generator().manual_seed(seed)))


def condition_pils(size, seed=3):
    rng = np.random.RandomState(seed)
    return [Image.fromarray((rng.rand(*size, 3) * 255).astype(np.uint8)) for _ in PROMPTS]


def adapter_latents(model, images, size, guidance, steps=3):
    negatives = [""] * len(PROMPTS) if model.uses_cfg(guidance) else None
    cond = model.encode(PROMPTS, negative_prompts=negatives, images=images)
    x = model.prepare_noise(len(PROMPTS), size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return rollout(model.velocity_fn(cond, guidance), x, model.sigmas(steps, size), torch.zeros(steps)).final


def pipeline_latents(pipe, model, images, size, guidance, steps=3):
    image = torch.stack(images) if isinstance(images[0], torch.Tensor) else images
    if model.guidance_embeds:
        guidance_kwargs = {"guidance_scale": guidance}
    else:
        guidance_kwargs = {"true_cfg_scale": guidance, **({"negative_prompt": [""] * 2} if guidance > 1 else {})}
    return pipe(prompt=PROMPTS, image=image, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                output_type="latent", height=size[0], width=size[1], max_sequence_length=model.max_sequence_length,
                max_area=size[0] * size[1], _auto_resize=False, **guidance_kwargs).images


@pytest.mark.parametrize("size,condition_size,guidance,kind", [
    ((32, 32), (32, 32), 1.0, "tensor"),
    ((32, 32), (32, 32), 3.5, "tensor"),
    ((32, 64), (48, 32), 3.5, "tensor"),  # non-square, the condition image of another size than the output
    ((32, 48), (34, 50), 1.0, "tensor"),  # a condition size not a multiple of 4: floored to 32x48, as the pipeline
    ((32, 32), (40, 24), 3.5, "pil"),
], ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else str(value))
def test_ode_rollout_with_a_condition_image_is_the_pipeline_bitwise(size, condition_size, guidance, kind):
    pipe = tiny_pipeline("flux_kontext")
    model = wrap_pipeline(pipe)
    images = condition_tensors(condition_size) if kind == "tensor" else condition_pils(condition_size)
    ours = adapter_latents(model, images, size, guidance)
    assert tuple(ours.shape) == model.latent_shape(len(PROMPTS), size)
    assert torch.equal(pack_latents(ours), pipeline_latents(pipe, model, images, size, guidance))


def test_true_cfg_with_a_condition_image_is_the_pipeline_bitwise():
    pipe = tiny_flux_kontext_pipeline(WORDS, guidance_embeds=False)
    model = wrap_pipeline(pipe)
    images = condition_tensors((32, 32))
    ours = adapter_latents(model, images, (32, 32), 3.0)
    assert torch.equal(pack_latents(ours), pipeline_latents(pipe, model, images, (32, 32), 3.0))


def test_the_condition_changes_the_velocity_and_without_one_kontext_is_flux():
    pipe = tiny_pipeline("flux_kontext")
    model, flux = wrap_pipeline(pipe), FluxModel(pipe)
    x = model.prepare_noise(2, (32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model.velocity(x, 0.6, model.encode(PROMPTS), 3.5)
        edited = model.velocity(x, 0.6, model.encode(PROMPTS, images=condition_tensors((32, 32))), 3.5)
        assert torch.equal(plain, flux.velocity(x, 0.6, flux.encode(PROMPTS), 3.5))
    assert not torch.allclose(plain, edited)


def test_rows_with_condition_images_of_different_sizes_or_none_are_each_their_own_batch():
    model = wrap_pipeline(tiny_pipeline("flux_kontext"))
    small, large = condition_tensors((32, 32))[0], condition_tensors((48, 32), seed=4)[0]
    texts = PROMPTS + PROMPTS[:1]
    cond = model.encode(texts, images=[small, large, None])
    assert cond.extras["condition_size"].tolist() == [[16, 16], [24, 16], [0, 0]]
    x = model.prepare_noise(3, (32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.6, 0.3])
    with torch.no_grad():
        together = model.velocity(x, sigma, cond, 3.5)
        alone = [model.velocity(x[i:i + 1], sigma[i:i + 1], model.encode([texts[i]], images=[image]), 3.5)
                 for i, image in enumerate([small, large, None])]
        # indexing carries the condition rows (a GRPO group repeats them)
        regrouped = model.velocity(x[[1, 1]], sigma[[1, 1]], cond.index([1, 1]), 3.5)
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(regrouped, torch.cat([alone[1]] * 2), rtol=1e-5, atol=1e-6)


def test_encode_images_is_the_pipelines_vae_encode():
    pipe = tiny_pipeline("flux_kontext")
    model = wrap_pipeline(pipe)
    images = torch.stack(condition_tensors((32, 48)))
    with torch.no_grad():
        expected = pipe._encode_vae_image(2 * images - 1, generator=None)
        assert torch.equal(model.encode_images(images), expected)
        assert torch.equal(model.encode(PROMPTS, images=list(images)).extras["condition_latents"], expected)


def test_condition_images_are_refused_where_they_do_not_fit():
    kontext = wrap_pipeline(tiny_pipeline("flux_kontext"))
    image = condition_tensors((32, 32))[0]
    flux = FluxModel(tiny_pipeline("flux_kontext"))
    with pytest.raises(ValueError, match=r"'flux' \(FluxModel\) takes no condition images.*flux_kontext"):
        flux.encode(PROMPTS, images=[image, image])
    assert flux.encode(PROMPTS, images=[None, []]).extras == {}  # no image at all is plain text conditioning
    with pytest.raises(ValueError, match="prompt 1 has 2 condition images.*at most 1"):
        kontext.encode(PROMPTS, images=[image, [image, image]])
    with pytest.raises(ValueError, match="1 entries for 2 prompts"):
        kontext.encode(PROMPTS, images=[image])
    with pytest.raises(ValueError, match=r"values in \[-0\.\d+, 0\.\d+\]: give floats in \[0, 1\]"):
        kontext.encode(PROMPTS, images=[image * 2 - 1, None])
    with pytest.raises(ValueError, match=r"shape \(32, 32, 3\).*\[3, H, W\]"):
        kontext.encode(PROMPTS, images=[image.permute(1, 2, 0), None])
