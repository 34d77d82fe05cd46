"""Crash safety of checkpoint saves: SIGKILL at the named kill points of a save (``flowalign.training.kill_points``),
then ``--resume latest`` continues from a whole checkpoint, no file of an earlier checkpoint is missing or truncated,
and the continued run is bitwise the uninterrupted one; a failure to save on one process ends every process; the
RNG files of every process are part of the whole checkpoint.

This module runs a subset: every kill point of a single-process save and of a re-save (each in a forked child of this
process, so no start-up cost), a failing save on 2 DDP processes and a kill on 2 FSDP2 processes (``torchrun`` on CPU
with gloo).
``bench/crash_matrix.py`` runs the whole matrix (docs/concepts/reliability.md has its figures)."""

from __future__ import annotations

import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch

import crash_matrix as matrix
from flowalign.config import load_config
from flowalign.errors import SetupError
from flowalign.training.config import TrainConfig
from flowalign.training.kill_points import KILL_POINTS
from flowalign.training.trainer import Trainer

from test_trainer import tiny_model  # noqa: F401 - the module's tiny SD3
from train_runs_worker import runs_in_the_background


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: the forked children and the runs they are compared with add up the same
    way, and no child inherits an OpenMP pool forked mid-use."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory, one_thread):
    """The uninterrupted single-process run, every checkpoint kept."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert matrix.train_in_fork(tiny_model, out, "ddp", **{"train.keep_checkpoints": 9}) == 0
    return out


def resume_here(model, out, **extra):
    return Trainer(load_config(TrainConfig, None, matrix.settings(model, out, "ddp", **{
        "train.resume": "latest", **extra}))).train()


def test_the_matrix_names_every_kill_point_of_the_protocol():
    assert set(matrix.MAIN) | set(matrix.SHARDED_MAIN) | set(matrix.RESAVE) <= set(KILL_POINTS)
    # copies and components are passed only by runs whose components keep policy copies or tensors
    assert set(KILL_POINTS) - set(matrix.MAIN) - set(matrix.SHARDED_MAIN) - set(matrix.RESAVE) == {
        "copies", "components"}


@pytest.mark.parametrize("point", matrix.MAIN)
def test_a_kill_anywhere_in_a_single_process_save_loses_nothing(point, tiny_model, reference, tmp_path):
    run = tmp_path / "run"
    assert matrix.train_in_fork(tiny_model, run, "ddp", matrix.fault(point)) == -9  # the kill point fired
    assert matrix.losses_after_kill(run, reference) == []
    resume_here(tiny_model, run)
    assert matrix.final_differences(run, reference) == []


@pytest.mark.parametrize("point", ["flushed", "renamed", "replaced"])
def test_a_kill_while_re_saving_an_iteration_never_leaves_it_without_a_whole_checkpoint(point, tiny_model,
                                                                                        reference, tmp_path):
    """``trainer.save()`` after ``train()`` saves iteration 2 again: the new directory is exchanged with the old one
    in one atomic rename, so at every instant ``checkpoint-000002`` is a whole checkpoint."""
    run = tmp_path / "run"
    fault = matrix.fault(point, iteration=matrix.ITERATIONS)
    assert matrix.train_in_fork(tiny_model, run, "ddp", fault, resave=True) == -9
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-000002"]
    assert matrix.losses_after_kill(run, reference) == []


def test_a_resume_at_the_same_process_count_refuses_a_missing_rng_file(tiny_model, reference, tmp_path, caplog):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoint-000002")
    (run / "checkpoint-000001" / "rng-0.pt").unlink()
    with pytest.raises(SetupError, match=r"checkpoint-000001/rng-0.pt is missing: checkpoint-000001 was saved by 1"):
        resume_here(tiny_model, run, **{"train.resume": str(run / "checkpoint-000001")})
    with caplog.at_level(logging.WARNING), pytest.raises(SetupError, match="no checkpoint to resume"):
        resume_here(tiny_model, run)  # latest picks only whole checkpoints
    assert "skipping" in caplog.text and "not a whole checkpoint (no rng-0.pt)" in caplog.text


def test_a_resume_at_another_process_count_says_how_the_rng_streams_are_re_keyed(tiny_model, reference, tmp_path,
                                                                                  caplog):
    """A checkpoint of 2 processes resumed on 1: one line, and the global RNGs re-seeded from (seed, iteration,
    rank), the same on every such resume."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoint-000002")
    state_file = run / "checkpoint-000001" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["processes"] == 1
    state_file.write_text(json.dumps({**state, "processes": 2}))
    shutil.copy(run / "checkpoint-000001" / "rng-0.pt", run / "checkpoint-000001" / "rng-1.pt")
    draws = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            trainer = Trainer(load_config(TrainConfig, None, matrix.settings(tiny_model, run, "ddp", **{
                "train.resume": "latest"})))
        draws.append((random.random(), float(np.random.random_sample()), float(torch.rand(1))))
        lines = [r.getMessage() for r in caplog.records if "re-seeded" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0], caplog.text
        assert lines[0].startswith("checkpoint-000001 was saved by 2 process(es) and resumes on 1:")
        assert "keyed by (train.seed, iteration, sample, purpose)" in lines[0]
    assert draws[0] == draws[1] and trainer.iteration == 1


def test_two_ddp_processes_one_failing_to_save_all_end_with_the_error_and_lose_nothing(tiny_model, tmp_path):
    """Process 1 cannot write its RNG file (a full disk): both processes end with the error at once (not after the
    collective's timeout), nothing is renamed or pruned, and checkpoint-000001 stays whole. Before the fix, process 0
    had already renamed checkpoint-000002 into place, without process 1's RNG file, and pruned checkpoint-000001.
    (That a resume then continues bitwise at 2 processes: the FSDP2 case below, and bench/crash_matrix.py for ddp.)"""
    from flowalign.training.checkpoint_files import missing_files

    run = tmp_path / "run"
    failed = matrix.launch(tiny_model, run, "ddp", 2, fault=matrix.fault("rng", rank=1, action="fail"), timeout=300)
    assert failed.returncode != 0
    assert "OSError: [Errno 28] No space left on device" in failed.stderr  # process 1's own error
    assert (f"RuntimeError: saving {run / 'checkpoint-000002'} failed on another process: process 1: OSError"
            in failed.stderr)  # process 0's
    assert [p.name for p in run.glob("*checkpoint-*")] == ["checkpoint-000001"]  # the temporary directory deleted
    assert missing_files(run / "checkpoint-000001") == [] and (run / "checkpoint-000001" / "rng-1.pt").is_file()


def test_two_fsdp2_processes_one_killed_before_the_rename_lose_nothing(tiny_model, tmp_path):
    """Process 1 killed once its shards and RNG file are in the temporary directory: nothing is renamed or pruned,
    and the resumed run writes checkpoint-000002 bitwise, with the RNG files of both processes. The killed and the
    resumed runs are the command line's (``torchrun -m flowalign.cli train``); the uninterrupted run trains meanwhile
    in a launch of tests/forked_launch.py."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    with runs_in_the_background([(matrix.TRAIN_CLI[1], matrix.settings(tiny_model, reference, "fsdp2", **{
            "train.keep_checkpoints": 9}))], tmp_path / "launch"):  # the uninterrupted run, meanwhile
        killed = matrix.launch(tiny_model, run, "fsdp2", 2, fault=matrix.fault("rng", rank=1))
    assert killed.returncode != 0 and "Signal 9 (SIGKILL) received" in killed.stderr
    assert matrix.losses_after_kill(run, reference) == [] and not (run / "checkpoint-000002").exists()
    resumed = matrix.launch(tiny_model, run, "fsdp2", 2, **{"train.resume": "latest"})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert matrix.final_differences(run, reference) == []
    assert {p.name for p in (run / "checkpoint-000002").glob("rng-*.pt")} == {"rng-0.pt", "rng-1.pt"}


def test_resume_latest_takes_the_newest_whole_checkpoint_never_a_temporary_or_trash_one(reference, tmp_path):
    from flowalign.training.checkpoint_files import latest_checkpoint

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.copytree(run / "checkpoint-000002", run / ".tmp-checkpoint-000003")
    shutil.copytree(run / "checkpoint-000002", run / ".trash-checkpoint-000004")
    assert latest_checkpoint(run) == run / "checkpoint-000002"
    (run / "checkpoint-000002" / "optimizer.pt").unlink()  # what an earlier version's kill could leave
    assert latest_checkpoint(run) == run / "checkpoint-000001"


@pytest.mark.parametrize("atomic", [True, False], ids=["renameat2", "three-renames"])
def test_exchanging_two_checkpoint_directories_swaps_them_whole(tmp_path, monkeypatch, atomic):
    """Re-saving swaps the new directory with the old in one renameat2(RENAME_EXCHANGE); where the system cannot,
    by three renames through the trash name."""
    from flowalign.training import checkpoint_files as checkpoint

    if not atomic:
        monkeypatch.setattr(checkpoint, "_rename_exchange", lambda a, b: False)
    new, old = tmp_path / ".tmp-checkpoint-000002", tmp_path / "checkpoint-000002"
    for directory, text in ((new, "new"), (old, "old")):
        directory.mkdir()
        (directory / "state.json").write_text(text)
    checkpoint._exchange(new, old)
    assert (old / "state.json").read_text() == "new" and (new / "state.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-checkpoint-000002", "checkpoint-000002"]
