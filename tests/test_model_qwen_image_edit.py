"""Qwen-Image-Edit-Plus beyond the adapter contract (which gives every prompt two condition images).

An ODE rollout through the adapter with one condition image equals ``QwenImageEditPlusPipeline(image=...,
output_type="latent")`` bit for bit, the condition image non-square and of another size than the output (the rotary
embedding must list every condition image at its own size: without that, the token count and the rotary table
disagree, the length mismatch users met on Qwen-Image-Edit). The prompt embeddings depend on the condition images
(the VL encoder sees them); rows with different condition images run in one batch; the model trains on an editing
prompt file. The tiny pipeline runs at small condition-image areas (``edit_plus_areas``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.models import pack_latents, wrap_pipeline
from flowalign.models.qwen_image_edit import CONDITION_SHAPES, CONDITION_TOKENS, fit_area
from flowalign.samplers import rollout

from model_families import edit_plus_areas, fresh_pipeline, tiny_pipeline

PROMPT = "make the circle red"


@pytest.fixture(autouse=True)
def small_areas():
    with edit_plus_areas():
        yield


@pytest.fixture
def model():
    return wrap_pipeline(tiny_pipeline("qwen_image_edit_plus"))


def pil(size, seed=5):
    return Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8))


@pytest.mark.parametrize("size,condition_size,guidance", [
    ((32, 32), (32, 32), 1.0),
    ((32, 48), (64, 40), 4.0),  # output 32x48, condition 64x40 (HxW): 32x32 for the VL encoder, 64x32 for the VAE
    ((48, 32), (32, 64), 1.0),
], ids=lambda value: "x".join(map(str, value)) if isinstance(value, tuple) else f"g{value:g}")
def test_ode_rollout_with_one_condition_image_is_the_pipeline_bitwise(model, size, condition_size, guidance):
    image = pil(condition_size)
    cfg = {"negative_prompt": ""} if guidance > 1 else {}
    expected = model.pipe(image=[image], prompt=PROMPT, true_cfg_scale=guidance, num_inference_steps=3,
                          generator=torch.Generator().manual_seed(0), height=size[0], width=size[1],
                          output_type="latent", **cfg).images
    cond = model.encode([PROMPT], negative_prompts=[""] if guidance > 1 else None, images=[[image]])
    x = model.prepare_noise(1, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = rollout(model.velocity_fn(cond, guidance), x, model.sigmas(3, size), torch.zeros(3)).final
    assert torch.equal(pack_latents(ours), expected)


def test_the_rotary_embedding_needs_every_condition_image_in_img_shapes(model):
    """The mismatch the adapter avoids: condition tokens in the sequence but not in ``img_shapes``."""
    cond = model.encode([PROMPT], images=[[pil((64, 40))]])
    x = model.prepare_noise(1, (32, 48), generator=torch.Generator().manual_seed(0))
    tokens = torch.cat([pack_latents(x), cond.extras[CONDITION_TOKENS]], dim=1)
    assert cond.extras[CONDITION_SHAPES].tolist() == [[[8, 4]]]  # 64x40 px (HxW) -> 64x32 VAE pixels -> 8x4 patches
    with torch.no_grad(), pytest.raises(RuntimeError, match="size of tensor"):
        model.transformer(hidden_states=tokens, timestep=torch.tensor([0.5]), encoder_hidden_states=cond.embeds,
                          img_shapes=[[(1, 4, 6)]], return_dict=False)
    with torch.no_grad():
        assert torch.isfinite(model.velocity(x, 0.5, cond)).all()


def test_the_prompt_embeddings_see_the_condition_images(model):
    plain = model.encode([PROMPT])
    first = model.encode([PROMPT], images=[[pil((32, 32), seed=1)]])
    second = model.encode([PROMPT], images=[[pil((32, 32), seed=2)]])
    both = model.encode([PROMPT], images=[[pil((32, 32), seed=1), pil((32, 32), seed=2)]])
    assert first.embeds.shape == second.embeds.shape and not torch.equal(first.embeds, second.embeds)
    # "Picture 1:" (3 tokens), then the image's 4 vision tokens between the vision start and end tokens
    assert first.embeds.shape[1] == plain.embeds.shape[1] + 3 + 1 + 4 + 1
    assert both.embeds.shape[1] == first.embeds.shape[1] + 3 + 1 + 4 + 1
    assert CONDITION_TOKENS not in plain.extras


def test_a_tensor_condition_image_is_its_8_bit_pil_image(model):
    image = torch.rand(3, 40, 24, generator=torch.Generator().manual_seed(0))
    rounded = model.pipe.image_processor.numpy_to_pil(image.permute(1, 2, 0).numpy()[None])[0]
    from_tensor = model.encode([PROMPT], images=[image])
    from_pil = model.encode([PROMPT], images=[[rounded]])
    assert torch.equal(from_tensor.embeds, from_pil.embeds)
    assert torch.equal(from_tensor.extras[CONDITION_TOKENS], from_pil.extras[CONDITION_TOKENS])


def test_rows_with_different_condition_images_run_in_one_batch(model):
    prompts = [PROMPT, "remove the square", "a blue circle"]
    images = [[pil((32, 32), seed=1)], [pil((64, 40), seed=2), pil((32, 32), seed=3)], None]
    cond = model.encode(prompts, negative_prompts=[""] * 3, images=images)
    assert cond.extras[CONDITION_SHAPES].tolist() == [[[4, 4], [0, 0]], [[8, 4], [4, 4]], [[0, 0], [0, 0]]]
    x = model.prepare_noise(3, (32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        batched = model.velocity(x, sigma, cond, 4.0)
        rows = [model.velocity(x[i: i + 1], sigma[i: i + 1], cond.index(torch.tensor([i])), 4.0) for i in range(3)]
    assert torch.equal(batched, torch.cat(rows))
    assert not torch.equal(rows[0], rows[2])


def test_the_default_areas_are_the_pipelines():
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    model = wrap_pipeline(tiny_pipeline("qwen_image_edit_plus"))
    with edit_plus_areas({"CONDITION_IMAGE_SIZE": 384 * 384, "VAE_IMAGE_SIZE": 1024 * 1024}):
        assert model.image_areas() == (384 * 384, 1024 * 1024)
        vl, pixels = model.prepare_condition_image(pil((48, 32)))
        assert vl.size == plus.calculate_dimensions(384 * 384, 32 / 48) == fit_area(384 * 384, 32 / 48)
        assert tuple(pixels.shape[-2:])[::-1] == plus.calculate_dimensions(1024 * 1024, 32 / 48)


def test_qwen_image_edit_plus_trains_on_editing_prompts_and_the_reward_receives_the_source_images(tmp_path):
    from test_editing import run_values, write_png

    entries = [{"prompt": PROMPT, "images": ["sources/0.png"]},
               {"prompt": "remove the square", "images": ["sources/1.png", "sources/0.png"]}]
    write_png(tmp_path / "sources" / "0.png", seed=0)
    write_png(tmp_path / "sources" / "1.png", seed=1, size=(48, 32))
    path = tmp_path / "edits.jsonl"
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    received = []

    def edit_reward(images, prompts, metadata):
        received.extend((prompt, len(entry["images"])) for prompt, entry in zip(prompts, metadata))
        return images.float().flatten(1).mean(dim=1)

    model = wrap_pipeline(fresh_pipeline("qwen_image_edit_plus"))
    from flowalign.training.trainer import Trainer

    history = Trainer(run_values(tmp_path, path), rewards=[edit_reward], model=model).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert sorted(set(received)) == [(PROMPT, 1), ("remove the square", 2)]
