"""A run never touches another run's files; resuming is refused where it would not continue the run exactly; set-up
errors are user errors (exit 2) and later failures are not; launch configs the trainer cannot run are refused."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from flowalign.cli import main
from flowalign.errors import SetupError
from flowalign.rewards import REWARDS, register_reward
from flowalign.training.run_directory import holds_run, trim_metrics

from test_trainer import TRAIN_CLI, final_checkpoint, make_trainer, overrides, tiny_model  # noqa: F401 - the fixture


def _snapshot(run):
    """Every file of a run directory with its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _without_timings(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")}
            for line in path.read_text().splitlines()]


def test_a_new_run_never_writes_into_a_directory_holding_a_run(tiny_model, tmp_path):
    run = tmp_path / "run"
    make_trainer(tiny_model, run, **{"train.iterations": 1}).train()
    before = _snapshot(run)
    assert holds_run(run) and "config.yaml" in before and "metrics.jsonl" in before
    # 1. refused, naming the directory and the three ways out, before any model loads; nothing is modified
    with pytest.raises(SetupError) as refused:
        make_trainer(tmp_path / "no-model", run, **{"data.group_size": 2})
    message = str(refused.value)
    assert str(run) in message
    assert all(way in message for way in ('config.train.resume = "latest"', "config.train.out_dir",
                                          "config.train.overwrite = True"))  # from Python: in Python's words
    assert _snapshot(run) == before
    # 2. resuming continues the same run
    history = make_trainer(tiny_model, run, **{"train.iterations": 2, "train.resume": "latest"}).train()
    assert len(history) == 2 and final_checkpoint(run).name == "checkpoint-000002"
    assert [m["iteration"] for m in _without_timings(run / "metrics.jsonl")] == [0.0, 1.0]
    # 3. an explicit overwrite replaces that run's files (and only those) with the new run's
    (run / "notes.txt").write_text("mine")
    make_trainer(tiny_model, run, **{"train.iterations": 1, "data.group_size": 2, "train.overwrite": "true"}).train()
    assert [p.name for p in run.glob("checkpoint-*")] == ["checkpoint-000001"]
    assert "group_size: 2" in (run / "config.yaml").read_text()
    assert len(_without_timings(run / "metrics.jsonl")) == 1
    assert (run / "notes.txt").read_text() == "mine"


def test_resuming_never_overwrites_later_checkpoints_or_another_run(tiny_model, tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    extra = {"train.iterations": 2, "train.checkpoint_every": 1, "train.keep_checkpoints": 3}
    make_trainer(tiny_model, run, **extra).train()
    make_trainer(tiny_model, other, **{"train.iterations": 1}).train()
    older = run / "checkpoint-000001"
    with pytest.raises(SetupError, match="not the newest checkpoint .*checkpoint-000002"):
        make_trainer(tiny_model, run, **{**extra, "train.resume": str(older)})
    with pytest.raises(SetupError, match=f"{other} already holds a training run"):
        make_trainer(tiny_model, other, **{**extra, "train.resume": str(older)})
    # into a fresh directory the older checkpoint continues exactly like the original run
    make_trainer(tiny_model, tmp_path / "branch", **{**extra, "train.resume": str(older)}).train()
    a = load_file(str(run / "checkpoint-000002" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "branch" / "checkpoint-000002" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_run_writes_the_metrics_of_an_uninterrupted_one(tiny_model, tmp_path):
    extra = {"train.iterations": 3, "train.checkpoint_every": 1}
    make_trainer(tiny_model, tmp_path / "full", **extra).train()
    make_trainer(tiny_model, tmp_path / "split", **extra).train()
    # a crash after iteration 3 was logged but before its checkpoint: drop that checkpoint, resume the one before
    import shutil

    shutil.rmtree(tmp_path / "split" / "checkpoint-000003")
    make_trainer(tiny_model, tmp_path / "split", **{**extra, "train.resume": "latest"}).train()
    assert _without_timings(tmp_path / "split" / "metrics.jsonl") == _without_timings(tmp_path / "full" / "metrics.jsonl")


def test_trim_metrics_keeps_the_iterations_before_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": float(i), "reward": i / 10}) + "\n" for i in range(5)))
    trim_metrics(path, 3)
    assert [json.loads(line)["iteration"] for line in path.read_text().splitlines()] == [0.0, 1.0, 2.0]
    trim_metrics(tmp_path / "absent.jsonl", 3)  # nothing to trim
    assert not (tmp_path / "absent.jsonl").exists()


@pytest.mark.parametrize("feature, extra", [
    ("optim.lr_schedule = 'cosine'", {"optim.lr_schedule": "cosine"}),
    ("sampling.window_start = 'sliding'", {"sampling.window_size": 2, "sampling.window_start": "sliding",
                                           "sampling.window_last": "null"}),
])
def test_a_longer_resumed_run_is_refused_when_the_math_reads_the_run_length(tiny_model, tmp_path, feature, extra):
    make_trainer(tiny_model, tmp_path / "run", **{**extra, "train.iterations": 2}).train()
    with pytest.raises(SetupError) as refused:
        make_trainer(tmp_path / "no-model", tmp_path / "run", **{**extra, "model.path": str(tiny_model),
                                                                 "train.iterations": 3, "train.resume": "latest"})
    assert feature in str(refused.value) and "train.iterations = 3" in str(refused.value)


def test_a_longer_resumed_run_continues_when_nothing_reads_the_run_length(tiny_model, tmp_path):
    make_trainer(tiny_model, tmp_path / "full", **{"train.iterations": 3}).train()
    make_trainer(tiny_model, tmp_path / "split", **{"train.iterations": 2}).train()
    make_trainer(tiny_model, tmp_path / "split", **{"train.iterations": 3, "train.resume": "latest"}).train()
    a = load_file(str(tmp_path / "full" / "checkpoint-000003" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000003" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resumed_ema_sits_on_its_parameters_device_and_dtype(tiny_model, tmp_path):
    extra = {"train.iterations": 1, "optim.ema_decay": 0.9}
    make_trainer(tiny_model, tmp_path / "run", **extra).train()
    trainer = make_trainer(tiny_model, tmp_path / "run", **{**extra, "train.iterations": 2, "train.resume": "latest"})
    for param in trainer.params:  # stands in for CUDA: parameters of another dtype than the fp32 file
        param.data = param.data.double()
    trainer.checkpointer.resume(trainer.checkpoint)
    saved = load_file(str(tmp_path / "run" / "checkpoint-000001" / "ema.safetensors"))
    averages = trainer.ema.state_dict()
    assert set(averages) == set(trainer.trainable_state()) == set(saved)
    for name, param in trainer.trainable_state().items():
        assert averages[name].device == param.device and averages[name].dtype == param.dtype == torch.float64
        assert torch.equal(averages[name], saved[name].double())
    trainer.ema.update()  # lerp_ of mismatched dtypes would raise


def _failing_at_iteration(n):
    """A reward whose ``n``-th call returns complex scores, which the trainer's scoring refuses with a ValueError
    mid-run: a bug, not a user error."""
    calls = {"count": 0}

    def reward(images, prompts, metadata):
        calls["count"] += 1
        scores = images.float().mean(dim=(1, 2, 3))
        return scores.to(torch.complex64) if calls["count"] == n else scores

    return reward


def test_a_failure_after_set_up_is_no_user_error(tiny_model, tmp_path):
    register_reward("fails_on_second_call", lambda: _failing_at_iteration(2))
    try:
        argv = [*TRAIN_CLI, *overrides(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: fails_on_second_call}]"})]
        with pytest.raises(ValueError, match="returned a tensor of dtype torch.complex64") as raised:  # propagates: traceback, exit status 1
            main(argv)
        assert not isinstance(raised.value, SetupError)
        with pytest.raises(SystemExit) as refused:  # a set-up error of the same command: exit 2, no traceback
            main([*TRAIN_CLI, *overrides(tmp_path / "no-model", tmp_path / "fresh")])
        assert refused.value.code == 2
    finally:
        REWARDS.unregister("fails_on_second_call")


def test_the_command_line_shows_the_traceback_of_a_failure_after_set_up(tiny_model, tmp_path):
    # A command-line run whose reward breaks at iteration 2: exit status 1 and the traceback on stderr.
    script = (
        "import sys, test_run_directory as t; from flowalign.rewards import register_reward; "
        "register_reward('fails_on_second_call', lambda: t._failing_at_iteration(2)); "
        "from flowalign.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    args = overrides(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: fails_on_second_call}]"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script, *TRAIN_CLI, *args], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" in result.stderr and "returned a tensor of dtype torch.complex64" in result.stderr
    assert "flowalign: error" not in result.stderr


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_sharded_launches_are_refused_before_the_model_loads(tmp_path, kind):
    # accelerate makes an FSDP or DeepSpeed state only on GPUs, so the launch is stood in for by its distributed type
    # (accelerate's own enum). The model path does not exist: a refusal that names the type proves it ran first.
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    launch = SimpleNamespace(distributed_type=DistributedType[kind], num_processes=8)
    config = load_config(TrainConfig, None, overrides(tmp_path / "no-model", tmp_path / "run"))
    with pytest.raises(SetupError, match=f"distributed_type {kind} is not how flowalign train shards.*ddp.yaml.*distributed.engine: fsdp2"):
        Trainer(config, accelerator=launch)
    assert not (tmp_path / "run").exists()


def test_a_multi_process_launch_that_accelerate_left_as_single_runs_is_refused(tmp_path, monkeypatch):
    # WORLD_SIZE=2 with an accelerator of one process: each process would train the whole run alone into one out_dir
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from flowalign.config import load_config
    from flowalign.training.collectives import launched_without_accelerator
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_without_accelerator()  # no GPU here: the trainer asks accelerate for gloo itself
    config = load_config(TrainConfig, None, overrides(tmp_path / "no-model", tmp_path / "run"))
    single = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)
    with pytest.raises(SetupError, match="one of WORLD_SIZE=2, but accelerate started no process group.*"
                                         "ACCELERATE_USE_CPU=1"):
        Trainer(config, accelerator=single)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not launched_without_accelerator()


def test_resuming_a_checkpoint_whose_optimizer_file_carries_code_is_a_user_error(tiny_model, tmp_path, capsys):
    from test_checkpoint import CodePayload

    run, marker = tmp_path / "run", tmp_path / "payload-ran"
    make_trainer(tiny_model, run, **{"train.iterations": 1}).train()
    torch.save({"state": CodePayload(marker)}, final_checkpoint(run) / "optimizer.pt")
    with pytest.raises(SystemExit) as refused:
        main([*TRAIN_CLI, *overrides(tiny_model, run, **{"train.iterations": 2, "train.resume": "latest"})])
    assert refused.value.code == 2 and not marker.exists()
    assert f"refusing to load '{final_checkpoint(run) / 'optimizer.pt'}'" in capsys.readouterr().err
