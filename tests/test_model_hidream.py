"""HiDream conventions beyond the adapter contract: requests rescaled to the fixed area, the negated velocity, the
MoE's train and eval paths."""

import pytest
import torch

from flowalign.models import HiDreamModel

from model_families import tiny_pipeline

PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"]


@pytest.mark.parametrize("request_size,produced", [((32, 48), (24, 36)), ((64, 64), (32, 32))])
def test_a_request_is_rescaled_to_the_default_area_as_the_pipeline_does(request_size, produced):
    pipe = tiny_pipeline("hidream")
    model = HiDreamModel(pipe)
    assert model.image_size_for(request_size) == produced
    latents = pipe(prompt=PROMPTS[:1], num_inference_steps=1, guidance_scale=1.0, height=request_size[0],
                   width=request_size[1], max_sequence_length=model.max_sequence_length, output_type="latent",
                   generator=torch.Generator().manual_seed(0)).images
    assert tuple(latents.shape) == model.latent_shape(1, request_size)
    assert model.prepare_noise(1, request_size).shape == latents.shape


def test_the_velocity_is_the_negated_transformer_output():
    model = HiDreamModel(tiny_pipeline("hidream"))
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, (32, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.transformer(hidden_states=x, timesteps=model.timestep(0.4, 2), encoder_hidden_states_t5=cond.embeds,
                                encoder_hidden_states_llama3=cond.extras["llama"].transpose(0, 1).contiguous(),
                                pooled_embeds=cond.pooled, return_dict=False)[0]
        assert torch.equal(model.velocity(x, 0.4, cond), -out)


@pytest.mark.parametrize("size", [(16, 64)])
def test_train_mode_and_the_differentiable_expert_path_give_the_eval_velocity_bitwise(size):
    """The first ratio of a training update is exactly 1 only if the train-mode velocity is the rollout's."""
    model = HiDreamModel(tiny_pipeline("hidream"))
    cond = model.encode(PROMPTS)
    x = model.prepare_noise(2, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model.velocity(x, 0.6, cond)
    x.requires_grad_(True)
    with_grad = model.velocity(x, 0.6, cond)  # eval mode, gradients on: the MoE's differentiable path
    model.transformer.train()
    try:
        train_mode = model.velocity(x, 0.6, cond)
    finally:
        model.transformer.eval()
    assert torch.equal(with_grad, reference) and torch.equal(train_mode, reference)
    assert tuple(train_mode.shape) == tuple(x.shape)
    # The routed experts carry gradient in eval mode too (diffusers' inference path would cut it).
    expert = model.transformer.double_stream_blocks[0].block.ff_i.experts
    with_grad.square().sum().backward()
    try:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in expert.parameters())
    finally:
        model.transformer.zero_grad(set_to_none=True)
    assert all(not module.training for module in model.transformer.modules())


def test_a_loaded_pipeline_keeps_the_transformers_area(tmp_path):
    from flowalign.models import load_flow_model

    tiny_pipeline("hidream").save_pretrained(tmp_path / "hidream")
    model = load_flow_model(tmp_path / "hidream")
    assert isinstance(model, HiDreamModel)
    assert model.pipe.default_sample_size == 16 and model.default_image_size == (32, 32)
    assert model.latent_shape(1, (64, 64)) == (1, 4, 16, 16)


def test_encode_images_takes_images_at_the_fixed_area_and_refuses_others():
    pipe = tiny_pipeline("hidream")
    model = HiDreamModel(pipe)
    images = torch.rand(2, 3, 16, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents = model.encode_images(images)
        expected = pipe.vae.encode(pipe.image_processor.preprocess(images)).latent_dist.mode()
    config = pipe.vae.config
    assert torch.equal(latents, (expected - config.shift_factor) * config.scaling_factor)
    assert tuple(latents.shape) == model.latent_shape(2, (16, 64))
    with pytest.raises(ValueError, match=r"32x48 images are produced as \(24, 36\)"):
        model.encode_images(torch.rand(1, 3, 32, 48))
