"""Chroma beyond the adapter contract: the text mask the transformer sees, and true CFG needing negatives."""

import pytest
import torch

from flowalign.models import wrap_pipeline

from model_families import tiny_pipeline


def test_chroma_mask_keeps_one_padding_token_and_the_image_tokens():
    pipe = tiny_pipeline("chroma")
    model = wrap_pipeline(pipe)
    prompts = ["a red circle", "two blue squares left of a triangle"]
    cond = model.encode(prompts)
    tokens = pipe.tokenizer(prompts, padding="max_length", max_length=model.max_sequence_length,
                            return_tensors="pt").attention_mask
    # The pipeline's Chroma convention: the real tokens plus the first padding token stay unmasked.
    expected = torch.zeros_like(tokens)
    for row, length in enumerate(tokens.sum(dim=1).tolist()):
        expected[row, : length + 1] = 1
    assert torch.equal(cond.mask, expected.to(cond.mask.dtype))
    assert cond.pooled is None and torch.equal(cond.text_ids, torch.zeros(model.max_sequence_length, 3))


def test_chroma_guidance_is_true_cfg_and_needs_negative_prompts():
    model = wrap_pipeline(tiny_pipeline("chroma"))
    assert model.uses_cfg(3.0) and not model.uses_cfg(1.0)
    assert model.velocity_fn(model.encode(["a red circle"]), 3.0).evals_per_sample == 2
    x = model.prepare_noise(1, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="negative prompt"):
        model.velocity(x, 0.5, model.encode(["a red circle"]), 3.0)


def test_chroma_encode_images_is_the_img2img_vae_path_bitwise():
    pipe = tiny_pipeline("chroma")
    model = wrap_pipeline(pipe)
    images = torch.rand(2, 3, 32, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.encode_images(images)
        # ChromaImg2ImgPipeline's path: preprocess to [-1, 1], the posterior's mode, (z - shift) * scale.
        posterior = pipe.vae.encode(pipe.image_processor.preprocess(images)).latent_dist
        expected = (posterior.mode() - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    assert tuple(ours.shape) == model.latent_shape(2, (32, 64)) and torch.equal(ours, expected)
