"""What the command line shows when a command starts: the settings that differ from the defaults, ``--print-config``,
``--help-config`` with the values of the config it is given, no libraries' loading bars or deprecation warnings
without ``-v``, advice in the caller's words, and a ``flowalign --help`` that imports no torch."""

import subprocess
import sys
import time
import warnings

import pytest
import yaml

from flowalign.cli import main
from flowalign.config import load_config
from flowalign.console import callers_words, command_line_session
from flowalign.training.config import TrainConfig
from short_runs import REPO, save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny-sd3")


def test_flowalign_help_imports_no_torch():
    script = ("import sys, time; t = time.perf_counter(); from flowalign.cli import main\n"
              "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
              "print('SECONDS', time.perf_counter() - t, 'torch' in sys.modules, 'numpy' in sys.modules)")
    clock = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    wall = time.perf_counter() - clock
    line = done.stdout.strip().splitlines()[-1].split()
    assert line[0] == "SECONDS" and line[2:] == ["False", "False"], done.stdout[-500:]
    assert "train" in done.stdout and "export" in done.stdout
    print(f"flowalign --help: {float(line[1]):.3f} s in Python, {wall:.3f} s with the interpreter's start")


def test_help_config_shows_the_values_of_the_config_it_is_given(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    main(["train", "--help-config"])  # no CONFIG: the default run's values
    shown = capsys.readouterr().out
    assert "sampling.noise_level = 0.0 [default: 0.7]" in shown
    assert "train.iterations = 227 [default: 330]" in shown
    main(["train", "configs/methods/flow_grpo_fast.yaml", "train.iterations=7", "--help-config"])
    shown = capsys.readouterr().out
    assert "train.iterations = 7 [default: 330]" in shown and "sampling.noise_level = 0.7  (" in shown


def test_print_config_prints_the_resolved_config_that_loads_back(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    main(["train", "train.iterations=7", "--optim.lr", "3e-4", "--print-config"])
    text = capsys.readouterr().out
    assert text.startswith("# fully resolved TrainConfig\n")
    (tmp_path / "printed.yaml").write_text(text)
    expected = load_config(TrainConfig, REPO / "configs/default.yaml", ["train.iterations=7", "optim.lr=3e-4"])
    assert load_config(TrainConfig, tmp_path / "printed.yaml", []) == expected
    assert yaml.safe_load(text)["train"]["iterations"] == 7


def test_train_shows_the_changed_settings_first_and_advice_for_the_command_line(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("# an earlier run\n")
    with pytest.raises(SystemExit) as refused:
        main(["train", f"train.out_dir={run}", "train.iterations=3"])
    captured = capsys.readouterr()
    assert refused.value.code == 2
    lines = captured.out.splitlines()
    assert lines[0].startswith("settings from configs/default.yaml and the command line that differ from the "
                               "defaults (")
    assert "  train.iterations = 3  (default: 330)" in lines and "  loss.grpo: off" in lines
    assert "  objectives.diffusion_nft.beta = 1.0" in lines  # the default run's objective, not in the defaults
    assert "--resume latest (train.resume=latest)" in captured.err and "config.train" not in captured.err
    # the evaluation's size the command line chose (flowalign.training.evaluation): a short run's is small...
    assert "  train.eval_images_per_tag = 24  (default: None)" in lines
    with pytest.raises(SystemExit):
        main(["train", f"train.out_dir={run}"])
    # ...and the default run's is the full one it always had
    assert "  train.eval_images_per_tag = 528  (default: None)" in capsys.readouterr().out.splitlines()


def test_advice_is_in_the_callers_words():
    assert callers_words("--x", "config.x = 1") == "config.x = 1"
    with command_line_session():
        assert callers_words("--x", "config.x = 1") == "--x"
    assert callers_words("--x", "config.x = 1") == "config.x = 1"  # as before, after the command


def test_library_loading_bars_and_deprecations_show_only_with_verbose(tiny_model, tmp_path, capsys):
    common = ["eval", "toy", "--model", str(tiny_model), "--max-prompts", "1", "--steps", "1",
              "--images-per-prompt", "1", "--resolution", "32"]
    main([*common, "--out", str(tmp_path / "quiet")])
    quiet = capsys.readouterr().err
    assert "Loading pipeline components" not in quiet and "Loading weights" not in quiet
    main(["-v", *common, "--out", str(tmp_path / "verbose")])
    assert "Loading pipeline components" in capsys.readouterr().err
    for verbose, shown in ((False, 0), (True, 1)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # whatever the test run's own filters say
            with command_line_session(verbose=verbose):
                warnings.warn_explicit(f"`torch_dtype` is deprecated ({verbose})", FutureWarning, "deprecation_utils.py",
                                       23, module="diffusers.utils.deprecation_utils")
        assert len(seen) == shown


def test_loading_a_model_raises_no_deprecation_of_diffusers(tiny_model):
    from flowalign.models.loading import load_flow_model

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load_flow_model(tiny_model)
