"""A run directory is handled safely: ``train.overwrite`` deletes only the files the replaced run recorded as written,
and only once the new run's inputs have all been checked; an ``out_dir`` that is a source tree, a file, under a file
or not writable is refused before anything loads; a diverging run stops with its last finite checkpoint; a resume
never rewrites a run into one it is not; a torn last line of ``metrics.jsonl`` is dropped, a corrupt one elsewhere
refused; signals end ``flowalign train`` with 128 + the signal; a closed pipe ends any command quietly."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from flowalign.cli import main
from flowalign.errors import SetupError
from flowalign.training.run_directory import metric_lines, trim_metrics
from flowalign.training.run_files import RECORD

from test_trainer import BIN, REPO, TRAIN_CLI, make_trainer, overrides, tiny_model  # noqa: F401 - the fixture


def _snapshot(run):
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_overwrite_deletes_only_the_replaced_runs_files_and_only_after_set_up(tiny_model, tmp_path):
    run = tmp_path / "run"
    first = {"train.iterations": 1, "train.sample_every": 1, "train.tracker": "tensorboard"}
    make_trainer(tiny_model, run, **first).train()
    written = _snapshot(run)
    assert "samples/iteration-000000.png" in written and any(k.startswith("flowalign/") for k in written), written
    recorded = [json.loads(line) for line in (run / RECORD).read_text().splitlines()]
    assert {"config.yaml", "metrics.jsonl", "samples/iteration-000000.png"} <= set(recorded)
    assert all(name in recorded for name in written if name.startswith("flowalign/"))  # the tracker's files too
    # the user's own files, in the folders the run writes into too
    mine = {"samples/mine.png": b"a", "eval/notes.md": b"b", "flowalign/mine.txt": b"c", "notes.txt": b"d"}
    for name, data in mine.items():
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_bytes(data)
    before = _snapshot(run)
    # a mistake in the new run's inputs is found before anything is deleted: the old run stays whole
    for bad in ({"data.train_prompts": str(tmp_path / "missing.jsonl")},
                {"reward.rewards": "[{name: toy_geneval, kwargs: {partial_credt: true}}]"}):
        with pytest.raises((SetupError, TypeError)):  # (the kwarg's typo is a TypeError until it is a SetupError)
            make_trainer(tiny_model, run, **{**first, **bad, "train.overwrite": "true"})
        assert _snapshot(run) == before, bad
    # the overwrite replaces the old run's files (checkpoints, config, metrics, grids, tracker logs) and nothing else
    make_trainer(tiny_model, run, **{"train.iterations": 2, "train.overwrite": "true", "data.group_size": 2}).train()
    after = _snapshot(run)
    assert all(after[name] == data for name, data in mine.items())
    assert "samples/iteration-000000.png" not in after and sorted(p.name for p in run.glob("checkpoint-*")) == [
        "checkpoint-000002"]
    assert not any(k.startswith("flowalign/") and k != "flowalign/mine.txt" for k in after)
    assert "group_size: 2" in (run / "config.yaml").read_text()
    # a resume past train.iterations is refused: the run's config.yaml keeps describing its two iterations
    config = (run / "config.yaml").read_bytes()
    with pytest.raises(SetupError, match="at iteration 2, past train.iterations = 1"):
        make_trainer(tiny_model, run, **{"train.iterations": 1, "train.resume": "latest", "data.group_size": 2})
    assert (run / "config.yaml").read_bytes() == config
    # a torn last line of metrics.jsonl (a crash while appending) is dropped on resume; the run continues
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"iteration": 2.0, "rew')
    make_trainer(tiny_model, run, **{"train.iterations": 3, "train.resume": "latest", "data.group_size": 2}).train()
    assert [row["iteration"] for _, row in metric_lines(run / "metrics.jsonl")] == [0.0, 1.0, 2.0]


def test_a_corrupt_metrics_line_is_refused_naming_the_file_and_line_and_a_torn_last_one_dropped(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0.0}\n{"iteration": 1.0}\n{"iteration": 2.0, "rew')
    trim_metrics(path, 2)
    assert path.read_text() == '{"iteration": 0.0}\n{"iteration": 1.0}\n' and "torn last line 3" in caplog.text
    path.write_text('{"iteration": 0.0}\nnot json\n{"iteration": 2.0}\n')
    with pytest.raises(SetupError, match=rf"{path}, line 2, is corrupt"):
        trim_metrics(path, 2)
    assert path.read_text() == '{"iteration": 0.0}\nnot json\n{"iteration": 2.0}\n'


@pytest.mark.parametrize("make, expected", [
    (lambda d: (d / ".git").mkdir(), r"holds \.git"),
    (lambda d: (d / "pyproject.toml").write_text(""), "holds pyproject.toml"),
    (lambda d: (d / "pkg").mkdir() or (d / "pkg" / "__init__.py").write_text(""), r"pkg/ \(a Python package\)"),
])
def test_an_out_dir_that_is_a_source_tree_is_refused_before_the_model_loads(tmp_path, make, expected):
    out = tmp_path / "clone"
    out.mkdir()
    make(out)
    with pytest.raises(SetupError, match=f"is a source tree or a repository root .*{expected}"):
        make_trainer(tmp_path / "no-model", out, **{"train.overwrite": "true"})
    assert len(list(out.iterdir())) == 1


def test_the_repository_root_is_refused_as_out_dir(tmp_path):
    with pytest.raises(SetupError, match="source tree or a repository root"):
        make_trainer(tmp_path / "no-model", REPO, **{"train.overwrite": "true"})


def test_an_out_dir_that_is_a_file_or_lies_under_one_is_refused_before_the_model_loads(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SetupError, match="train.out_dir = .*afile' is a file"):
        make_trainer(tmp_path / "no-model", afile)
    with pytest.raises(SetupError, match="lies under the file"):
        make_trainer(tmp_path / "no-model", afile / "run")
    with pytest.raises(SetupError, match="cannot write into '/proc'"):  # holds for root too
        make_trainer(tmp_path / "no-model", "/proc/run")


def test_a_diverging_run_stops_with_its_last_finite_checkpoint_and_exit_status_1(tiny_model, tmp_path, capsys):
    run = tmp_path / "run"
    args = overrides(tiny_model, run, **{"optim.lr": 1e30, "train.iterations": 4, "train.checkpoint_every": 1})
    with pytest.raises(SystemExit) as failed:
        main([*TRAIN_CLI, *args])
    error = capsys.readouterr().err
    assert failed.value.code == 1 and "the run diverged at iteration" in error and "Traceback" not in error, error
    checkpoints = sorted(run.glob("checkpoint-*"))
    stopped = int(error.split("diverged at iteration ")[1].split(":")[0])
    assert len(checkpoints) == stopped and len((run / "metrics.jsonl").read_text().splitlines()) == stopped
    for checkpoint in checkpoints:  # no saved weight is inf or NaN
        assert all(t.isfinite().all() for t in load_file(str(checkpoint / "trainable.safetensors")).values())


def test_a_closed_pipe_ends_a_command_quietly():
    # `flowalign train --help-config | head -1`, made deterministic: the reading end is closed before the command
    # writes, so its first write meets the closed pipe (a pipe's buffer would otherwise take the whole text at once
    # on a fast machine, and no write would ever fail).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        process = subprocess.Popen([str(BIN / "flowalign"), "train", "--help-config"], stdout=write_end,
                                   stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1 and stderr == "", stderr


def test_clear_run_deletes_recorded_files_only_never_outside_and_by_name_without_a_record(tmp_path):
    from flowalign.training.run_directory import clear_run

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    run = tmp_path / "run"
    files = ["config.yaml", "samples/iteration-000000.png", "flowalign/events.out", "samples/mine.png", "eval/own.md",
             "checkpoint-000002/state.json"]
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    # a record naming paths outside the run (hostile or broken) deletes nothing there; a torn last line is ignored
    recorded = ("config.yaml", "samples/iteration-000000.png", "flowalign/events.out", "../outside.txt", str(outside))
    (run / RECORD).write_text("".join(json.dumps(n) + "\n" for n in recorded) + '"eva')
    clear_run(run)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()) == ["eval/own.md",
                                                                                      "samples/mine.png"]
    assert outside.read_text() == "keep" and not (run / "flowalign").exists()
    # a run written before runs kept a record: only the files whose names a run writes go; the tracker's are kept
    for name in files:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(name)
    clear_run(run)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()) == [
        "eval/own.md", "flowalign/events.out", "samples/mine.png"]
