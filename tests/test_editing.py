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
from flowalign.training.trainer import GRPOTrainer

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
        GRPOTrainer(config)


def test_kontext_trains_on_editing_prompts_and_the_reward_receives_the_source_images(tmp_path):
    path = editing_prompts(tmp_path)
    sources = {entry["prompt"]: entry["images"] for entry in load_prompts(path)}
    received = []

    def edit_reward(images, prompts, metadata):
        received.extend((prompt, entry["images"]) for prompt, entry in zip(prompts, metadata))
        return images.float().flatten(1).mean(dim=1)

    config = run_values(tmp_path, path)
    model = wrap_pipeline(fresh_pipeline("flux_kontext"))
    history = GRPOTrainer(config, rewards=[edit_reward], model=model).train()
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
