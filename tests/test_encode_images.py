"""``FlowModel.encode_images``: decode's inverse, checked against the pipelines' own VAE path and the toy VAE."""

from pathlib import Path

import numpy as np
import pytest
import torch

from flowalign.models.flux import FluxModel, pack_latents
from flowalign.models.sd3 import SD3Model

TOY = Path(__file__).resolve().parents[1] / "assets" / "toy-sd3"


def make_model(family, sd3_pipe, flux_pipe):
    return SD3Model(sd3_pipe) if family == "sd3" else FluxModel(flux_pipe)


def pipeline_latents(pipe, images, *, generator=None, sample=False):
    """The img2img pipelines' path: preprocess to [-1, 1], VAE posterior, (z - shift) * scale."""
    pixels = pipe.image_processor.preprocess(images).to(pipe.vae.dtype)
    posterior = pipe.vae.encode(pixels).latent_dist
    latents = posterior.sample(generator) if sample else posterior.mode()
    return (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor


def images(batch, height, width, seed=0):
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("size", [(32, 32), (32, 48), (24, 16)])
def test_encode_images_equals_the_pipeline_vae_path_bitwise(sd3_pipe, flux_pipe, family, size):
    model = make_model(family, sd3_pipe, flux_pipe)
    x = images(2, *size)
    with torch.no_grad():
        latents = model.encode_images(x)
        expected = pipeline_latents(model.pipe, x)
    # The layout velocity / prepare_noise use, for non-square sizes too.
    assert tuple(latents.shape) == model.latent_shape(2, size)
    assert latents.dtype == model.dtype == model.prepare_noise(1, size).dtype
    assert torch.equal(latents, expected)
    if family == "flux":
        b, c, h, w = expected.shape
        assert torch.equal(pack_latents(latents), model.pipe._pack_latents(expected, b, c, h, w))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_posterior_sample_draws_with_the_generator(sd3_pipe, flux_pipe, family):
    model = make_model(family, sd3_pipe, flux_pipe)
    x = images(2, 32, 32)
    with torch.no_grad():
        drawn = model.encode_images(x, sample=True, generator=torch.Generator().manual_seed(3))
        again = model.encode_images(x, sample=True, generator=torch.Generator().manual_seed(3))
        expected = pipeline_latents(model.pipe, x, sample=True, generator=torch.Generator().manual_seed(3))
        mode = model.encode_images(x)
        # One generator per row: row 1 with its own generator is row 1 of the batch (to fp32 tolerance: the batched
        # convolutions round differently, measured 3e-6).
        rows = model.encode_images(x, sample=True, generator=[torch.Generator().manual_seed(k) for k in (5, 6)])
        row = model.encode_images(x[1:], sample=True, generator=torch.Generator().manual_seed(6))
    assert torch.equal(drawn, again) and torch.equal(drawn, expected)
    assert not torch.equal(drawn, mode)
    torch.testing.assert_close(rows[1:], row, rtol=0, atol=2e-5)


def test_encode_images_keeps_the_vae_dtype_and_returns_the_transformer_dtype(sd3_pipe):
    model = SD3Model(sd3_pipe)
    sd3_pipe.vae.to(torch.bfloat16)
    x = images(2, 32, 32)
    with torch.no_grad():
        latents = model.encode_images(x)
        expected = pipeline_latents(sd3_pipe, x)
        as_float64 = model.encode_images(x, dtype=torch.float64)
    assert expected.dtype == torch.bfloat16 and latents.dtype == torch.float32
    assert torch.equal(latents, expected.float())
    assert as_float64.dtype == torch.float64


@pytest.fixture(scope="module")
def toy():
    from flowalign.models.loading import load_flow_model
    from flowalign.toy.prompts import split_prompts
    from flowalign.toy.scenes import render, scene_for

    model = load_flow_model(str(TOY), device="cpu")
    train, _ = split_prompts()
    rng = np.random.default_rng(0)
    scenes = np.stack([render(scene_for(entry, rng)) for entry in train[:16]])
    return model, torch.from_numpy(scenes).permute(0, 3, 1, 2).float() / 255


def test_toy_vae_round_trips(toy):
    """decode(encode_images(x)) reconstructs toy scenes (measured: mean |err| 0.016, RMSE 0.032, max 0.32 at shape
    edges); encode_images(decode(z)) keeps an image latent's direction (measured: cosine >= 0.977, rel. err 0.14)."""
    model, x = toy
    with torch.no_grad():
        z = model.encode_images(x)
        reconstruction = model.decode(z)
        z_again = model.encode_images(reconstruction)
    error = reconstruction - x
    assert error.abs().mean() < 0.03 and error.pow(2).mean().sqrt() < 0.06
    cosine = torch.nn.functional.cosine_similarity(z_again.flatten(1), z.flatten(1))
    assert cosine.min() > 0.95
    assert (z_again - z).norm() / z.norm() < 0.25


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.rand(3, 32, 32), "rank 4"),
        (torch.rand(2, 4, 32, 32), "3 channels"),
        (torch.rand(2, 32, 32, 3), "channels last"),
        (torch.rand(2, 3, 32, 32) * 2 - 1, "[0, 1]"),
        (torch.rand(2, 3, 32, 32) + 0.5, "[0, 1]"),
        (torch.full((1, 3, 32, 32), float("nan")), "[0, 1]"),
        ((torch.rand(2, 3, 32, 32) * 255).to(torch.uint8), "uint8"),
        (torch.rand(2, 3, 30, 32), "multiple of 4"),
        (torch.rand(0, 3, 32, 32), "empty"),
        (np.zeros((1, 3, 32, 32), dtype=np.float32), "torch.Tensor"),
    ],
)
def test_bad_images_are_named(sd3_pipe, bad, message):
    model = SD3Model(sd3_pipe)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        model.encode_images(bad)


def test_values_just_outside_the_range_are_accepted(sd3_pipe):
    x = images(1, 32, 32)
    x[0, 0, 0, 0], x[0, 0, 0, 1] = -5e-4, 1 + 5e-4
    with torch.no_grad():
        assert SD3Model(sd3_pipe).encode_images(x).shape == (1, 4, 16, 16)


def test_flux_sizes_must_allow_the_2x2_packing(flux_pipe):
    model = FluxModel(flux_pipe)
    assert model.image_multiple == 2 * model.vae_scale_factor
    with pytest.raises(ValueError, match=f"multiple of {model.image_multiple}"):
        model.encode_images(images(1, 32, 34))
