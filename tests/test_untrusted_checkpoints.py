"""Checkpoints from elsewhere: nothing in them runs, and a damaged one is named.

The checkpoints are real: one ``flowalign train`` iteration of the tiny SD3 under FSDP2 (``sharded/`` written by
``torch.distributed.checkpoint``) and under DDP, with EMA. Each test copies one and tampers with a file as an attacker
or a broken copy would: a ``.metadata`` or a ``.distcp`` item that is a pickle whose payload creates a marker file,
truncated safetensors / ``optimizer.pt`` / ``.distcp`` files, a corrupt ``state.json``, a deleted EMA. Every reader
(``flowalign export``, ``eval --lora``, ``sample --lora`` through the real command line in this process, and the
training resume) must refuse it with exit status 2 and a one-line error naming the file, and the payload never runs.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowalign import cli
from flowalign.config import load_config
from flowalign.errors import SetupError
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from test_fsdp2 import one_world_per_test, settings, train_here  # noqa: F401 - the autouse fixture tears worlds down
from test_trainer import TRAIN_CLI, tiny_model  # noqa: F401 - the module's tiny SD3

BIN = Path(sys.executable).parent
EMA = {"optim.ema_decay": 0.5, "train.iterations": 1}
CHECKPOINT = "checkpoint-000001"


class Payload:
    """A pickle that would create ``marker`` when loaded without restriction (``os.system`` at unpickling)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """One-iteration runs with EMA, by engine (their directories: copy before tampering)."""
    import torch.distributed as dist

    root = tmp_path_factory.mktemp("runs")
    made = {}
    for engine in ("fsdp2", "ddp"):
        train_here(tiny_model, root / engine, **EMA, **{"distributed.engine": engine})
        if dist.is_initialized():
            dist.destroy_process_group()
        made[engine] = root / engine
    return made


def copy_run(runs, engine: str, tmp_path: Path) -> tuple[Path, Path]:
    """(run directory, its checkpoint): a fresh copy of the engine's run."""
    run = tmp_path / f"run-{engine}"
    shutil.copytree(runs[engine], run)
    return run, run / CHECKPOINT


def commands(checkpoint: Path, out: Path) -> dict[str, list[str]]:
    """The commands that read a checkpoint's LoRA (as small as they go; the failure comes before any sampling)."""
    small = ["--max-prompts", "1", "--steps", "1"]
    return {"export": ["export", str(checkpoint), "--out", str(out / "export")],
            "eval": ["eval", "toy", "--lora", str(checkpoint), *small, "--images-per-prompt", "1",
                     "--out", str(out / "eval")],
            "sample": ["sample", "--lora", str(checkpoint), *small, "--out", str(out / "sample")]}


def fails_with_exit_2(args: list[str], capsys) -> str:
    """Run the command line in this process; it must exit 2 with one line on stderr and no traceback. The line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    error = capsys.readouterr().err.strip()  # progress bars of the model's loading may come first
    assert exit_info.value.code == 2, (args, error)
    assert "Traceback" not in error and error.splitlines()[-1].startswith("flowalign: error:"), (args, error)
    return error.splitlines()[-1]


def resume_fails_with_exit_2(model: Path, run: Path, capsys, **extra) -> str:
    """``flowalign train ... train.resume=latest`` of ``run`` in this process: exit 2, one line, no traceback."""
    return fails_with_exit_2([*TRAIN_CLI, *settings(model, run, **EMA, **{"train.resume": "latest", **extra})],
                             capsys)


def craft_items(sharded: Path, payload, chosen) -> list[str]:
    """Point the ``.metadata`` entries whose key ``chosen(key)`` accepts at ``payload`` (``torch.save``'d, appended to
    their ``.distcp`` file), as an attacker who rewrites a checkpoint would; the keys crafted."""
    metadata = pickle.loads((sharded / ".metadata").read_bytes())  # our own file: plain pickle is fine here
    crafted = []
    for index, info in metadata.storage_data.items():
        if not chosen(index.fqn):
            continue
        data = sharded / info.relative_path
        blob = pickle_of(payload)
        info.offset, info.length = data.stat().st_size, len(blob)
        with open(data, "ab") as handle:
            handle.write(blob)
        crafted.append(index.fqn)
    (sharded / ".metadata").write_bytes(pickle.dumps(metadata))
    return crafted


def pickle_of(value) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ------------------------------------------------------------------------------------------ payloads never run


@pytest.mark.parametrize("command", ["export", "eval", "sample"])
def test_a_crafted_metadata_is_refused_by_every_lora_reader_and_never_runs(runs, tmp_path, capsys, command):
    run, checkpoint = copy_run(runs, "fsdp2", tmp_path)
    marker = tmp_path / "marker"
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    error = fails_with_exit_2(commands(checkpoint, tmp_path)[command], capsys)
    assert f"refusing to load '{checkpoint / 'sharded' / '.metadata'}'" in error and "do not trust it" in error
    assert "posix.system" in error and not marker.exists()


def test_a_crafted_metadata_is_refused_at_resume_before_the_model_loads(runs, tiny_model, tmp_path, capsys):
    run, checkpoint = copy_run(runs, "fsdp2", tmp_path)
    marker = tmp_path / "marker"
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    error = resume_fails_with_exit_2(tmp_path / "no-model", run, capsys)  # refused before the model would load
    assert f"refusing to load '{checkpoint / 'sharded' / '.metadata'}'" in error and not marker.exists()


def test_a_metadata_naming_a_file_outside_its_folder_is_refused(runs, tmp_path):
    from flowalign.sharded_reading import read_sharded

    run, checkpoint = copy_run(runs, "fsdp2", tmp_path)
    metadata = pickle.loads((checkpoint / "sharded" / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    (checkpoint / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"refusing to load .*\.metadata.*names '\.\./\.\./elsewhere\.distcp'"):
        read_sharded(checkpoint / "sharded", "trainable")


@pytest.mark.parametrize("command", ["export", "eval", "sample"])
def test_a_crafted_distcp_item_is_refused_by_every_lora_reader_and_never_runs(runs, tmp_path, capsys, command):
    run, checkpoint = copy_run(runs, "fsdp2", tmp_path)
    marker = tmp_path / "marker"
    assert craft_items(checkpoint / "sharded", Payload(marker), lambda key: key.startswith(("trainable.", "ema.")))
    error = fails_with_exit_2(commands(checkpoint, tmp_path)[command], capsys)
    assert f"refusing to load '{checkpoint / 'sharded' / '__0_0.distcp'}'" in error and "do not trust it" in error
    assert not marker.exists()


def test_a_crafted_non_tensor_item_is_refused_at_resume_and_never_runs(runs, tiny_model, tmp_path, capsys):
    """The optimizer's param_groups are the non-tensor items (BYTE_IO) of a sharded checkpoint: torch's default
    planner loads them with ``weights_only=False``."""
    run, checkpoint = copy_run(runs, "fsdp2", tmp_path)
    marker = tmp_path / "marker"
    crafted = craft_items(checkpoint / "sharded", Payload(marker), lambda key: ".param_groups." in key)
    assert crafted and all(key.startswith("optimizer.") for key in crafted)
    error = resume_fails_with_exit_2(tiny_model, run, capsys)
    assert f"refusing to load '{checkpoint / 'sharded' / '__0_0.distcp'}'" in error and "do not trust it" in error
    assert not marker.exists()


def test_two_processes_refuse_a_crafted_non_tensor_item_on_every_rank(runs, tiny_model, tmp_path):
    """``torchrun`` with 2 processes (gloo) resuming the 1-process checkpoint (DCP reshards): every rank reads the
    optimizer's param_groups, every rank refuses them with the error naming the file, and the payload never runs."""
    run, checkpoint = copy_run(runs, "fsdp2", tmp_path)
    marker = tmp_path / "marker"
    craft_items(checkpoint / "sharded", Payload(marker), lambda key: ".param_groups." in key)
    done = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "flowalign.cli", *TRAIN_CLI,
         *settings(tiny_model, run, **EMA, **{"train.resume": "latest"})],
        env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600)
    refused = f"flowalign: error: refusing to load '{checkpoint / 'sharded' / '__0_0.distcp'}'"
    assert done.returncode != 0 and done.stderr.count(refused) == 2, done.stderr[-3000:]
    assert not marker.exists()


def test_a_real_sharded_checkpoint_still_resumes(runs, tiny_model, tmp_path):
    """Its .metadata passes the allow-list, its non-tensor items load under weights_only=True."""
    run, _ = copy_run(runs, "fsdp2", tmp_path)
    trainer = Trainer(load_config(TrainConfig, None, settings(tiny_model, run, **EMA, **{
        "train.resume": "latest"})))
    assert trainer.iteration == 1
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3)


# ------------------------------------------------------------------------------------------ damaged files


@pytest.mark.parametrize("engine,name", [("ddp", "optimizer.pt"), ("ddp", "trainable.safetensors"),
                                         ("ddp", "ema.safetensors"), ("ddp", "state.json"),
                                         ("fsdp2", "sharded/__0_0.distcp"), ("fsdp2", "sharded/.metadata"),
                                         ("fsdp2", "state.json")])
def test_a_truncated_or_corrupt_checkpoint_file_is_named_at_resume(runs, tiny_model, tmp_path, capsys, engine, name):
    run, checkpoint = copy_run(runs, engine, tmp_path)
    if name == "state.json":
        (checkpoint / name).write_text('{"iteration": 1, "hist')
    else:
        truncate(checkpoint / name)
    error = resume_fails_with_exit_2(tiny_model, run, capsys, **{"distributed.engine": engine})
    assert f"'{checkpoint / name}'" in error and "truncated or corrupt" in error


@pytest.mark.parametrize("engine,name", [("ddp", "ema.safetensors"), ("fsdp2", "sharded/__0_0.distcp")])
@pytest.mark.parametrize("command", ["export", "eval", "sample"])
def test_a_truncated_weights_file_is_named_by_every_lora_reader(runs, tmp_path, capsys, engine, name, command):
    run, checkpoint = copy_run(runs, engine, tmp_path)
    truncate(checkpoint / name)
    error = fails_with_exit_2(commands(checkpoint, tmp_path)[command], capsys)
    assert f"'{checkpoint / name}'" in error and "truncated or corrupt" in error


def test_a_state_json_that_is_no_run_state_is_named(runs, tiny_model, tmp_path, capsys):
    run, checkpoint = copy_run(runs, "ddp", tmp_path)
    (checkpoint / "state.json").write_text("[1, 2]")
    error = resume_fails_with_exit_2(tiny_model, run, capsys, **{"distributed.engine": "ddp"})
    assert f"'{checkpoint / 'state.json'}' is corrupt" in error


# ------------------------------------------------------------------------------------------ a missing EMA


def drop_sharded_ema(sharded: Path) -> None:
    """Remove the EMA's entries from a sharded checkpoint's metadata (its part gone, as a deleted ema.safetensors)."""
    metadata = pickle.loads((sharded / ".metadata").read_bytes())
    metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith("ema.")}
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if not k.fqn.startswith("ema.")}
    (sharded / ".metadata").write_bytes(pickle.dumps(metadata))


def delete_ema(checkpoint: Path, engine: str) -> str:
    """Delete a checkpoint's EMA (its ``ema.safetensors``, or its part of ``sharded/``); returns what a refusal names."""
    if engine == "ddp":
        (checkpoint / "ema.safetensors").unlink()
        return f"'{checkpoint / 'ema.safetensors'}' is missing"
    drop_sharded_ema(checkpoint / "sharded")
    return f"'{checkpoint / 'sharded' / '.metadata'}' lists no EMA"


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_missing_ema_is_refused_at_resume_unless_train_restart_ema(runs, tiny_model, tmp_path, capsys, engine):
    run, checkpoint = copy_run(runs, engine, tmp_path)
    named = delete_ema(checkpoint, engine)
    extra = {"distributed.engine": engine}
    error = resume_fails_with_exit_2(tmp_path / "no-model", run, capsys, **extra)  # before the model would load
    assert named in error and "train.restart_ema=true" in error
    trainer = Trainer(load_config(TrainConfig, None, settings(tiny_model, run, **EMA, **extra, **{
        "train.resume": "latest", "train.restart_ema": "true"})))
    assert trainer.iteration == 1
    weights, averages = trainer.trainable_state(), trainer.ema.state_dict()
    assert all(torch.equal(_full(averages[k]), _full(weights[k])) for k in weights)  # fresh: the resumed weights
    assert any(torch.count_nonzero(_full(weights[k])) for k in weights if "lora_B" in k)  # which are the trained ones


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_checkpoint_whose_ema_is_gone_is_no_silent_ema_source(runs, tmp_path, capsys, engine):
    """``export`` / ``eval`` / ``sample`` default to the EMA of a run that kept one: a missing EMA is named, before
    the model loads; ``--weights last`` still reads the last weights."""
    run, checkpoint = copy_run(runs, engine, tmp_path)
    named = delete_ema(checkpoint, engine)
    for command in commands(checkpoint, tmp_path).values():
        error = fails_with_exit_2(command, capsys)
        assert named in error and "--weights last" in error
    assert cli.main(["export", str(checkpoint), "--weights", "last", "--out", str(tmp_path / "last")]) == 0
