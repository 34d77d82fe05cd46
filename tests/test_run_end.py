"""The visible end of a training run: the evaluation's announcement and size rule, the run's own rewards in the
before/after report, the summary of paths, ``train()``'s result, and the library's lines shown from Python."""

import json
import logging
import math

import pytest
import torch

from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.evaluation import (FULL_PER_TAG, SMALL_PER_TAG, estimated_seconds, eval_guidance,
                                           eval_images_per_tag, score_with_rewards)
from short_runs import REPO, finish_short_run, save_tiny_model



@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-sd3")


def unconfigured_logging(monkeypatch):
    """A process in which nobody configured logging, as a notebook's kernel (pytest's own capture, whose handlers it
    adds to the root logger at each phase of a test, is put aside)."""
    library = logging.getLogger("flowalign")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(library, "handlers", [])
    monkeypatch.setattr(library, "level", logging.NOTSET)


def test_a_run_from_python_shows_its_end_and_returns_the_evaluation(tiny_model, tmp_path, capsys, monkeypatch):
    unconfigured_logging(monkeypatch)
    out = tmp_path / "run"
    result = finish_short_run(tiny_model, out)
    shown = capsys.readouterr().out
    # the announcement: the image count and an estimated time, before the (stderr) progress bar
    assert "evaluating 66 held-out images before and 66 after training (66 prompts of " in shown
    assert ", 2 ODE steps, guidance 1): about " in shown
    # the summary of paths
    checkpoint = out / "checkpoint-000001"
    for line in (f"run finished: {out}", f"last checkpoint: {checkpoint}", f"before/after:    {out / 'eval'}",
                 str(out / "eval" / "grid_after.png")):
        assert line in shown, line
    # train() is still the list of every iteration's metrics, with the evaluation and the paths
    assert len(result) == 1 and "reward" in result[0]
    assert result.paths["checkpoint"] == checkpoint and result.paths["before_after"].is_file()
    saved = json.loads((out / "eval" / "before_after.json").read_text())
    assert result.evaluation == saved
    brightness = saved["rewards"]["brightness"]["overall"]
    assert brightness["n"] == 66 and 0 < brightness["mean_a"] < 1 and 0 < brightness["mean_b"] < 1
    assert math.isclose(brightness["diff"], brightness["mean_b"] - brightness["mean_a"], abs_tol=1e-12)
    table = (out / "eval" / "before_after.md").read_text()
    assert "| reward | before | after | paired gain | SE | z |" in table and "| brightness | " in table
    assert "| brightness | " in shown  # the table printed too


def test_the_evaluation_size_follows_the_run():
    default = load_config(TrainConfig, REPO / "configs/default.yaml", [])
    assert default.train.eval_images_per_tag is None and default.train.iterations == 227
    assert eval_images_per_tag(default, command_line=True) == FULL_PER_TAG == 528  # the default run's, unchanged
    assert eval_images_per_tag(default) == SMALL_PER_TAG  # the same run from Python
    short = load_config(TrainConfig, REPO / "configs/default.yaml", ["train.iterations=3"])
    assert eval_images_per_tag(short, command_line=True) == SMALL_PER_TAG
    asked = load_config(TrainConfig, REPO / "configs/default.yaml", ["train.iterations=3",
                                                                      "train.eval_images_per_tag=100"])
    assert eval_images_per_tag(asked) == eval_images_per_tag(asked, command_line=True) == 100


def test_the_evaluation_samples_at_the_runs_guidance():
    def guidance(*overrides):
        return eval_guidance(load_config(TrainConfig, REPO / "configs/default.yaml", list(overrides)))

    assert guidance() == 1.0  # the default run samples without CFG, and is judged so
    assert guidance("sampling.guidance_scale=4") == 4.0  # a run that rolls out with CFG is judged with it
    assert guidance("sampling.guidance_scale=4", "train.eval_guidance=1") == 1.0  # unless told otherwise
    with pytest.raises(ValueError, match="train.eval_guidance"):
        guidance("train.eval_guidance=-1")


def test_the_estimate_is_the_runs_rollout_speed_per_image_step():
    history = [{"time/rollout": 2.0}, {"time/rollout": 4.0}]  # 3 s for 6 samples of 5 steps: 0.1 s per image-step
    assert math.isclose(estimated_seconds(history, 6, 5, images=100, steps=10), 100.0)
    assert estimated_seconds([{"time/train": 1.0}], 6, 5, images=100, steps=10) is None  # an objective-only run


def test_the_evaluation_images_are_scored_by_the_runs_rewards_and_latent_rewards_are_left_out():
    images = torch.rand(5, 3, 8, 8)
    metadata = [{"prompt": "a", "tag": "t"}, {"prompt": "b", "tag": "t"}]
    results = [{"prompt_id": p, "image_index": k} for p, k in ((0, 0), (0, 1), (1, 0), (1, 1), (1, 2))]
    calls = []

    def mean(images, prompts, metadata):
        calls.append(list(prompts))
        return images.mean(dim=(1, 2, 3))

    def half_invalid(images, prompts, metadata):
        return [math.nan if i % 2 else 1.0 for i in range(len(prompts))]

    def latent(latents, prompts, metadata):
        raise AssertionError("a latent reward is never called on the evaluation's images")

    latent.reads_latents = True
    names = score_with_rewards([("mean", 1.0, mean), ("half", 0.0, half_invalid), ("latent", 1.0, latent)],
                               results, images, metadata)
    assert names == ["mean", "half"] and calls == [["a", "a", "b", "b", "b"]]
    assert [r["reward/mean"] for r in results] == pytest.approx(images.mean(dim=(1, 2, 3)).tolist())
    assert [math.isnan(r["reward/half"]) for r in results] == [False, True, False, True, False]


def test_eval_toy_on_a_checkpoint_reproduces_the_runs_own_evaluation_next_to_it(tiny_model, tmp_path, capsys):
    from flowalign.cli import main

    out = tmp_path / "run"
    finish_short_run(tiny_model, out, **{"train.eval_images_per_prompt": "null", "train.eval_images_per_tag": 2,
                                         "train.eval_seed": 7, "train.eval_guidance": 2})
    run = json.loads((out / "eval" / "before_after.json").read_text())
    checkpoint = out / "checkpoint-000001"
    assert main(["eval", "toy", "--lora", str(checkpoint)]) == 0  # nothing but the checkpoint
    written = out / "eval-checkpoint-000001"
    record = json.loads((written / "results.json").read_text())
    settings = record["config"]
    assert (settings["steps"], settings["seed"], settings["images_per_tag"], settings["resolution"]) == (2, 7, 2, 32)
    assert settings["guidance_scale"] == run["guidance_scale"] == 2  # the run's evaluation guidance, re-read
    assert settings["lora_weights"] == "ema" and settings["prompts"] == str(REPO / "assets/prompts/test.jsonl")
    assert record["summary"] == run["after"]  # the run's "after" column, exactly
    assert len(record["results"]) == run["samples"]
    # a second evaluation into the same place is refused, as a second training run into a run's directory is
    with pytest.raises(SystemExit) as refused:
        main(["eval", "toy", "--lora", str(checkpoint)])
    assert refused.value.code == 2
    assert "already holds the outputs of an earlier flowalign eval toy" in capsys.readouterr().err
