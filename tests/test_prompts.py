"""Training prompt files: plain text, plain JSONL, or GenEval metadata; a GenEval reward refuses plain prompts before
anything is built (flowalign.data.prompts.load_prompts, flowalign.training.builder.check_prompts_fit_rewards)."""

from __future__ import annotations

import json

import pytest

from flowalign.config import load_config
from flowalign.data.prompts import load_prompts
from flowalign.errors import SetupError
from flowalign.evaluation.geneval import GenEvalError
from flowalign.models.tiny import tiny_sd3_pipeline
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

PROMPTS = ["a photo of a red circle", "a blue square"]


def write_jsonl(path, entries):
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


def test_a_text_file_holds_one_prompt_a_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a photo of a red circle\n\n  a blue square  \n")
    assert load_prompts(path) == [{"prompt": p} for p in PROMPTS]


def test_plain_jsonl_keeps_extra_keys_and_geneval_entries_are_validated(tmp_path):
    entries = [{"prompt": PROMPTS[0], "source": "mine"},
               {"prompt": PROMPTS[1], "tag": "single_object", "include": [{"class": "square", "count": 1}]}]
    assert load_prompts(write_jsonl(tmp_path / "p.jsonl", entries)) == entries
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "tag": "single_object"}])
    with pytest.raises(GenEvalError, match=r"bad\.jsonl:1.*include"):
        load_prompts(bad)


@pytest.mark.parametrize("line, message", [
    ('{"text": "a cat"}', "non-empty string 'prompt'"),
    ('{"prompt": "  "}', "non-empty string 'prompt'"),
    ("a cat", "not valid JSON.*one prompt a line"),
])
def test_a_bad_line_is_named_with_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(GenEvalError, match=rf"p\.jsonl:2: .*{message}"):
        load_prompts(path)


def test_an_empty_prompt_file_is_refused(tmp_path):
    (tmp_path / "p.txt").write_text("\n\n")
    with pytest.raises(GenEvalError, match="holds no prompts"):
        load_prompts(tmp_path / "p.txt")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    words = sorted({w for p in PROMPTS for w in p.split()})
    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    tiny_sd3_pipeline(words, seed=0).save_pretrained(path)
    return path


def config(model, prompts, out, reward):
    return load_config(TrainConfig, None, [
        f"model.path={model}", "model.lora_rank=2", "model.lora_alpha=4", f"reward.rewards=[{{name: {reward}}}]",
        f"data.train_prompts={prompts}", "data.prompts_per_iteration=2", "data.group_size=2", "sampling.num_steps=4", "sampling.window_last=1",
        "sampling.batch_size=4", "train.iterations=1", "train.tracker=none", "train.eval_at_end=false",
        "train.sample_every=0", f"train.out_dir={out}"])


def test_plain_prompts_train_with_a_reward_of_the_image_alone(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    trainer = Trainer(config(tiny_model, prompts, tmp_path / "run", "brightness"))
    trainer.train()
    assert [row["iteration"] for row in trainer.history] == [0]


@pytest.mark.parametrize("reward", ["toy_geneval", "toy_geneval_soft", "geneval"])
def test_a_geneval_reward_refuses_plain_prompts_before_building_anything(tmp_path, reward):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    with pytest.raises(SetupError, match=rf"reward\.rewards\[0\]\.name = '{reward}'.*prompts\.txt.*a photo of a red"):
        Trainer(config(tmp_path / "no-model-here", prompts, tmp_path / "run", reward))


def test_flowalign_sample_takes_plain_prompts_and_refuses_them_for_a_geneval_reward(tiny_model, tmp_path):
    from flowalign.inference.sample import SampleConfig, run_sample

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")

    def sample(*extra):
        return run_sample(load_config(SampleConfig, None, [
            f"model={tiny_model}", f"prompts={prompts}", "steps=3", "budget=6", "device=cpu",
            f"out_dir={tmp_path / 'out'}", "overwrite=true", *extra]))  # each call replaces the last one's outputs

    summary = sample("reward=brightness", "sampler.name=bon")
    assert [row["prompt"] for row in summary["results"]] == PROMPTS and "geneval" not in summary
    assert all(row["nfe"] == 6 for row in summary["results"])
    with pytest.raises(SetupError, match=r"--reward = 'toy_geneval' scores a prompt by its GenEval metadata"):
        sample("reward=toy_geneval")
    red = sample("reward=brightness", "sampler.name=bon", 'reward_kwargs={"channel": 0}')  # --reward-kwargs JSON
    assert [row["reward"] for row in red["results"]] != [row["reward"] for row in summary["results"]]
    with pytest.raises(SetupError, match="brightness channel must be 0, 1, 2 or None"):
        sample("reward=brightness", 'reward_kwargs={"channel": 7}')
