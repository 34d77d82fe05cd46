"""FLUX.2-dev conventions beyond the adapter contract: the VAE's patchified, batch-normalised latents, the chat
template over content lists, the text encoder's depth."""

import pytest
import torch

from flowalign.models import Flux2DevModel

from model_families import WORDS, tiny_pipeline


def test_encode_images_is_the_pipelines_own_vae_encoding_bitwise():
    pipe = tiny_pipeline("flux2")
    model = Flux2DevModel(pipe)
    images = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents = model.encode_images(images)
        expected = pipe._encode_vae_image(pipe.image_processor.preprocess(images), generator=None)
        decoded = model.decode(latents)
    assert tuple(latents.shape) == model.latent_shape(2, (32, 48)) == (2, 16, 8, 12)
    assert torch.equal(latents, expected)
    # the batch-norm statistics are not the identity on the tiny VAE: the normalisation is exercised
    assert not torch.allclose(pipe.vae.bn.running_var, torch.ones_like(pipe.vae.bn.running_var))
    assert decoded.shape == images.shape and 0 <= decoded.min() and decoded.max() <= 1


def test_prompts_go_through_the_chat_template_with_the_system_message():
    pipe = tiny_pipeline("flux2")
    model = Flux2DevModel(pipe)
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    (text,) = pipe.tokenizer.apply_chat_template(format_input(["a red circle"], pipe.system_message), tokenize=False)
    assert text.startswith("[SYSTEM_PROMPT]" + pipe.system_message) and text.endswith("[INST]a red circle[/INST]")
    cond = model.encode(["a red circle", "a blue square"])
    assert cond.embeds.shape == (2, model.max_sequence_length, 3 * 16)  # 3 hidden layers of width 16
    assert cond.text_ids.shape == (model.max_sequence_length, 4)
    assert not torch.equal(cond.embeds[0], cond.embeds[1])  # the prompts survive the template and truncation


def test_a_text_encoder_too_shallow_for_the_hidden_state_layers_is_refused():
    from flowalign.models.tiny import tiny_flux2_pipeline

    with pytest.raises(ValueError, match=r"hidden states \(10, 20, 30\).*has 2 layers"):
        Flux2DevModel(tiny_flux2_pipeline(WORDS, text_layers=2))
