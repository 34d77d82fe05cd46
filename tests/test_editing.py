"""Editing prompts: a prompt file entry ``{"prompt": ..., "images": ["path", ...]}`` (paths relative to the file)
conditions the rollouts of a model that takes condition images (FLUX.1-Kontext here); rewards receive the source
images' paths in each sample's metadata, and evaluation and ``flowalign sample`` pass them through."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowalign.config import load_config
from flowalign.data.prompts import load_prompts
from flowalign.errors import SetupError
from flowalign.evaluation.geneval import GenEvalError
from flowalign.models import wrap_pipeline
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from golden_runs import small_run_values
from model_families import fresh_pipeline, tiny_pipeline

PROMPTS = ["make the circle red", "remove the square"]


def write_png(path, seed, size=(32, 32)):
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = (np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def editing_prompts(tmp_path, name="edits.jsonl"):
    """Two editing prompts with one source image each, under ``tmp_path/sources``, named relative to the file."""
    for i in range(len(PROMPTS)):
        write_png(tmp_path / "sources" / f"{i}.png", seed=i)
    lines = [json.dumps({"prompt": prompt, "images": [f"sources/{i}.png"]}) for i, prompt in enumerate(PROMPTS)]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_condition_image_paths_are_resolved_against_the_prompt_file_and_a_missing_one_is_named(tmp_path):
    path = editing_prompts(tmp_path)
    entries = load_prompts(path)
    assert [e["images"] for e in entries] == [[str((tmp_path / "sources" / f"{i}.png").resolve())] for i in range(2)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "images": ["sources/0.png"]}) + "\n\n"
                   + json.dumps({"prompt": "y", "images": ["sources/missing.png"]}) + "\n")
    with pytest.raises(GenEvalError, match=r"bad\.jsonl:3: condition image 'sources/missing\.png' does not exist"):
        load_prompts(bad)
    bad.write_text(json.dumps({"prompt": "x", "images": "sources/0.png"}) + "\n")
    with pytest.raises(GenEvalError, match=r"bad\.jsonl:1: 'images' must be a list of image paths"):
        load_prompts(bad)


def run_values(tmp_path, prompts, model_path="unused", **extra):
    values = {**small_run_values(model_path, tmp_path / "run"), "data.train_prompts": str(prompts),
              "train.checkpoint_every": 0, **extra}
    return load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])


def test_a_family_without_condition_images_refuses_an_editing_prompt_file_before_the_model_loads(tmp_path):
    # The model path does not exist: the check runs on the family alone, before anything loads.
    config = run_values(tmp_path, editing_prompts(tmp_path), model_path=tmp_path / "no-model",
                        **{"model.family": "flux"})
    with pytest.raises(SetupError, match=r"data\.train_prompts = .*edits\.jsonl gives prompts condition images .*"
                                         r"model family 'flux' takes none.*flux_kontext"):
        Trainer(config)


def test_kontext_trains_on_editing_prompts_and_the_reward_receives_the_source_images(tmp_path):
    path = editing_prompts(tmp_path)
    sources = {entry["prompt"]: entry["images"] for entry in load_prompts(path)}
    received = []

    def edit_reward(images, prompts, metadata):
        received.extend((prompt, entry["images"]) for prompt, entry in zip(prompts, metadata))
        return images.float().flatten(1).mean(dim=1)

    config = run_values(tmp_path, path)
    model = wrap_pipeline(fresh_pipeline("flux_kontext"))
    history = Trainer(config, rewards=[edit_reward], model=model).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert len(received) == 2 * 2 * 2  # 2 iterations of 2 prompts x 2 samples
    assert all(images == sources[prompt] for prompt, images in received)


def test_evaluation_samples_each_entry_with_its_own_condition_image(tmp_path):
    from flowalign.evaluation.toy_eval import generate

    first, second = load_prompts(editing_prompts(tmp_path))
    other = {**second, "images": first["images"]}  # the same text, another source image
    model = wrap_pipeline(tiny_pipeline("flux_kontext"))
    kwargs = dict(steps=2, images_per_prompt=1, image_size=32)
    edited = generate(model, [first, second], **kwargs)
    swapped = generate(model, [first, other], **kwargs)
    plain = generate(model, [{"prompt": first["prompt"]}, {"prompt": second["prompt"]}], **kwargs)
    assert torch.equal(edited[0], swapped[0]) and not torch.equal(edited[1], swapped[1])
    assert not torch.equal(edited[0], plain[0])


def test_flowalign_sample_passes_the_condition_images_to_the_model_and_the_reward(tmp_path):
    from flowalign.inference.sample import SampleConfig, run_guided

    entries = load_prompts(editing_prompts(tmp_path))
    model = wrap_pipeline(tiny_pipeline("flux_kontext"))
    received = []

    def edit_reward(images, prompts, metadata):
        received.extend(entry.get("images") for entry in metadata)
        return images.float().flatten(1).mean(dim=1)

    config = SampleConfig(guidance="bon", budget=2, steps=2)
    edited = run_guided(model, entries, config, reward_fn=edit_reward)
    assert received == [entry["images"] for entry in entries]
    plain = run_guided(model, [{"prompt": e["prompt"]} for e in entries], config, reward_fn=edit_reward)
    assert not torch.equal(edited.final, plain.final)


# ------------------------------------------------------------------------- source_similarity, the editing reward
def test_source_similarity_pixel_is_one_minus_the_mean_absolute_difference_to_the_resized_source(tmp_path):
    from flowalign.rewards import build_reward

    source = write_png(tmp_path / "src.png", seed=3, size=(64, 64))
    reward = build_reward("source_similarity")
    metadata = [{"images": [str(source)]}] * 3
    from flowalign.reward_models.source_similarity import source_tensor

    resized = source_tensor(str(source), (32, 32))
    assert resized.shape == (3, 32, 32) and 0 <= resized.min() and resized.max() <= 1
    images = torch.stack([resized, (resized + 0.1).clamp(max=1.0), 1.0 - resized])
    scores = reward(images, ["keep it"] * 3, metadata)
    assert scores[0] == pytest.approx(1.0, abs=1e-6)
    assert scores[1] == pytest.approx(1.0 - float((images[1] - resized).abs().mean()), abs=1e-6)
    assert scores[2] == pytest.approx(1.0 - float((2 * resized - 1).abs().mean()), abs=1e-6)
    # differentiable in the sample: a gradient reaches the images
    x = images.clone().requires_grad_(True)
    reward.forward(x, ["keep it"] * 3, metadata).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_source_similarity_clip_is_the_image_embeddings_cosine(tmp_path):
    from reward_fixtures import register_tiny_open_clip, tiny_open_clip_checkpoint

    from flowalign.reward_models.clipscore import clip_preprocess
    from flowalign.reward_models.open_clip_backbone import encode_image
    from flowalign.rewards import build_reward

    (tmp_path / "clip").mkdir()
    register_tiny_open_clip(tmp_path / "clip")
    weights = tiny_open_clip_checkpoint(tmp_path / "clip", seed=0)
    reward = build_reward("source_similarity", metric="clip", weights=str(weights), model_name="flowalign-tiny-clip",
                          quick_gelu=False, device="cpu")
    paths = [str(write_png(tmp_path / f"s{i}.png", seed=i)) for i in range(2)]
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    scores = reward(images, ["a", "b"], [{"images": [p]} for p in paths])
    sources = reward.sources(images, ["a", "b"], [{"images": [p]} for p in paths])
    with torch.no_grad():
        a = encode_image(reward.model, clip_preprocess(images, reward.image_size))
        b = encode_image(reward.model, clip_preprocess(sources, reward.image_size))
    torch.testing.assert_close(scores, (a * b).sum(dim=-1), rtol=1e-5, atol=1e-6)
    same = reward(sources, ["a", "b"], [{"images": [p]} for p in paths])
    torch.testing.assert_close(same, torch.ones(2), rtol=0, atol=1e-5)


def test_source_similarity_refuses_a_sample_without_its_source_and_a_bad_setting():
    from flowalign.rewards import build_reward

    reward = build_reward("source_similarity")
    with pytest.raises(ValueError, match=r"prompt 'a red circle' has 0 condition image.*\"images\" list"):
        reward(torch.rand(1, 3, 8, 8), ["a red circle"], [{}])
    with pytest.raises(ValueError, match="metric must be one of pixel, clip, got 'lpips'"):
        build_reward("source_similarity", metric="lpips")
    with pytest.raises(ValueError, match="image must be an index >= 0"):
        build_reward("source_similarity", image=-1)


def test_kontext_trains_with_the_source_similarity_reward_by_name(tmp_path):
    path = editing_prompts(tmp_path)
    config = run_values(tmp_path, path, **{"reward.rewards": "[{name: source_similarity}]"})
    model = wrap_pipeline(fresh_pipeline("flux_kontext"))
    history = Trainer(config, model=model).train()
    assert len(history) == 2 and history[0]["first_ratio_max"] == 1.0
    rewards = [h["rewards/source_similarity/mean"] for h in history]
    assert all(0.0 < r < 1.0 for r in rewards), rewards
