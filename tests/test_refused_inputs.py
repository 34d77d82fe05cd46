"""Bad input to ``flowalign train`` is refused before any model loads, with exit status 2, the key or file named and
the fix, and no traceback: a tracker whose package is missing, a model preset run that names no reward or prompts,
a reward keyword that is misspelt or of the wrong type, a prompt path that is a directory or not UTF-8, an OCR reward
on prompts without a quoted target or without its extra.

Each command line points ``model.path`` at a model that does not exist (named ``toy-sd3``, so the toy world's
defaults still apply where a test wants them): a refusal that names anything else proves it ran before the model
load, which would have failed on the path."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from flowalign.cli import main
from flowalign.config import ConfigError, load_config, set_keys
from flowalign.training.config import TrainConfig
from flowalign.training.toy_defaults import check_world_is_named

REPO = Path(__file__).resolve().parents[1]
SD35 = str(REPO / "configs/models/sd35_medium.yaml")


def refused(args, capsys, monkeypatch) -> str:
    """``flowalign train ARGS`` from the repository root: exit status 2, no traceback; returns the error text."""
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_status:
        main(["train", *args])
    err = capsys.readouterr().err
    assert exit_status.value.code == 2, err
    assert "Traceback" not in err and err.startswith("flowalign: error: "), err
    return err


def missing_model(tmp_path) -> str:
    return f"model.path={tmp_path / 'toy-sd3'}"


# ------------------------------------------------------------------------------------------------ trackers


def test_the_wandb_tracker_without_wandb_is_refused_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's way to block an import: wandb is absent here
    err = refused(["train.tracker=wandb", missing_model(tmp_path), f"train.out_dir={tmp_path / 'run'}"], capsys,
                  monkeypatch)
    assert "train.tracker = 'wandb' needs the wandb package" in err and "pip install -e '.[tracking]'" in err
    assert "train.tracker=none" in err and not (tmp_path / "run").exists()


def test_the_tensorboard_tracker_without_tensorboard_is_refused_naming_the_extra(monkeypatch):
    """An entry of None in ``sys.modules`` is Python's own way to make a package unimportable."""
    for package in ("tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ConfigError, match=r"train\.tracker = 'tensorboard' needs the tensorboard package.*"
                                          r"\.\[tracking\].*train\.tracker=none"):
        load_config(TrainConfig, None, ["train.tracker=tensorboard"])
    load_config(TrainConfig, None, ["train.tracker=none"])  # no tracker, no package needed


# ------------------------------------------------------------------------------------------------ model presets


def test_a_model_preset_run_that_names_no_reward_and_no_prompts_is_refused_with_a_complete_example(
        tmp_path, capsys, monkeypatch):
    err = refused([SD35, "model.path=/models/sd3.5-medium", f"train.out_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert "reward.rewards and data.train_prompts are not set" in err and "'/models/sd3.5-medium'" in err
    assert "toy_geneval" in err and "assets/prompts/train.jsonl" in err and not (tmp_path / "run").exists()
    example = err.rsplit("e.g.: ", 1)[1].strip()
    words = shlex.split(example)
    assert words[:2] == ["flowalign", "train"]
    # the example is complete: the same check passes on it
    config = load_config(TrainConfig, words[2], words[3:])
    check_world_is_named(config, set_keys(TrainConfig, words[2], words[3:]), words[2])


@pytest.mark.parametrize("given, missing", [("data.train_prompts=p.txt", "reward.rewards"),
                                            ("reward.rewards=[{name: brightness}]", "data.train_prompts")])
def test_a_model_preset_run_that_names_one_of_the_two_is_refused_naming_the_other(given, missing, capsys,
                                                                                 monkeypatch):
    err = refused([SD35, given], capsys, monkeypatch)  # the preset's own model.path: a hub id
    assert f"{missing} is not set, and model.path = 'stabilityai/stable-diffusion-3.5-medium'" in err


def test_the_toy_defaults_still_apply_to_the_toy_model_and_a_named_world_passes():
    default = load_config(TrainConfig, REPO / "configs/default.yaml", [])
    check_world_is_named(default, set_keys(TrainConfig, REPO / "configs/default.yaml"))
    preset = ["model.path=/models/sd3", "reward.rewards=[{name: brightness}]", "data.train_prompts=p.txt"]
    check_world_is_named(load_config(TrainConfig, SD35, preset), set_keys(TrainConfig, SD35, preset))
    # a model preset still loads for inspection; the rule is the run's
    assert load_config(TrainConfig, SD35, []).model.path == "stabilityai/stable-diffusion-3.5-medium"


# ------------------------------------------------------------------------------------------------ reward keywords


def test_a_misspelt_reward_keyword_is_refused_with_did_you_mean(tmp_path, capsys, monkeypatch):
    err = refused(["reward.rewards=[{name: brightness, kwargs: {chanel: 0}}]", missing_model(tmp_path),
                   f"train.out_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert "reward.rewards[0].kwargs.chanel is not a setting of the 'brightness' reward" in err
    assert "did you mean 'channel'?" in err


@pytest.mark.parametrize("reward, value, expected", [
    ("toy_geneval", "{partial_credit: maybe}", "reward.rewards[0].kwargs.partial_credit: expected a bool (true or "
                                                "false), got 'maybe' (str)"),
    ("brightness", "{channel: red}", "reward.rewards[0].kwargs.channel: expected an int or null, got 'red' (str)"),
])
def test_a_reward_keyword_of_the_wrong_type_is_refused(reward, value, expected, tmp_path, capsys, monkeypatch):
    err = refused([f"reward.rewards=[{{name: {reward}, kwargs: {value}}}]", missing_model(tmp_path),
                   f"train.out_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert expected in err


# ------------------------------------------------------------------------------------------------ prompt files


def test_a_prompt_path_that_is_a_directory_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    err = refused([f"data.train_prompts={tmp_path}", missing_model(tmp_path), f"train.out_dir={tmp_path / 'run'}"],
                  capsys, monkeypatch)
    assert f"{tmp_path} is a directory: give the path of a prompt file" in err


def test_a_prompt_file_that_is_not_utf8_is_refused_naming_the_file_and_line(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red circle\n".encode() + "caf\u00e9 photo\n".encode("latin-1"))
    err = refused([f"data.train_prompts={prompts}", missing_model(tmp_path), f"train.out_dir={tmp_path / 'run'}"],
                  capsys, monkeypatch)
    assert f"{prompts}:2: not UTF-8 text (byte 0xe9): save the file as UTF-8" in err


def test_an_ocr_reward_on_prompts_without_a_quoted_target_is_refused_naming_the_first(tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "Open"\na plain sign\na sign without quotes\n')
    err = refused(["reward.rewards=[{name: ocr}]", f"data.train_prompts={prompts}", missing_model(tmp_path),
                   f"train.out_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert (f"reward.rewards[0].name: the 'ocr' reward cannot score prompt 2 of {prompts}: OCR prompt 'a plain sign' "
            "has no double-quoted text") in err


def test_the_ocr_reward_without_the_ocr_extra_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)  # Python's way to block an import
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "Open"\n')
    err = refused(["reward.rewards=[{name: ocr}]", f"data.train_prompts={prompts}", missing_model(tmp_path),
                   f"train.out_dir={tmp_path / 'run'}"], capsys, monkeypatch)
    assert "the 'ocr' reward (reward.rewards[0]) needs the rapidocr-onnxruntime package" in err
    assert "pip install -e '.[ocr]'" in err


# ------------------------------------------------------------------------------------------------ the docs


def test_every_documented_model_preset_run_names_its_reward_and_prompts():
    """Every ``flowalign train configs/models/...`` line of docs/ and README.md passes the check it would meet."""
    from doc_commands import pages, preset_runs

    runs = [(page, number, args) for page in pages() for number, _, args in preset_runs(page)]
    assert len(runs) >= 25  # the landing page, the training guide, every method page, the distributed guide
    for page, number, (config, *overrides) in runs:
        loaded = load_config(TrainConfig, REPO / config, overrides)
        try:
            check_world_is_named(loaded, set_keys(TrainConfig, REPO / config, overrides), config)
        except ConfigError as error:
            pytest.fail(f"{page.relative_to(REPO)}:{number}: {error}")
