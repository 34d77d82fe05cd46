"""The crash matrix's runs and checks, shared by tests/test_crash_matrix.py (a subset) and bench/crash_matrix.py (all).

A *case* kills training with SIGKILL at one named point of the save of checkpoint ``KILLED_SAVE`` on one process
(``flowalign.training.kill_points``), then resumes it with ``--resume latest`` at the same process count. It is a
*loss* when, after the kill, a ``checkpoint-*`` under its normal name is not whole or differs from the uninterrupted
run's (a file missing, truncated or other), when ``--resume latest`` does not continue, or when the continued run's
final checkpoint is not bitwise the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from flowalign.serialization import safe_load
from flowalign.training.kill_points import FAULT_VARIABLE
from forked_launch import fork_server

REPO = Path(__file__).resolve().parents[1]
TRAIN_CLI = ("train", str(REPO / "configs/methods/flow_grpo_fast.yaml"))
ITERATIONS = 2
KILLED_SAVE = 2  # the save killed: checkpoint-000001 is there, and train.keep_checkpoints = 1 prunes it

# Which process passes each kill point of a save (rank 0 is the main process), per engine; re-saving an iteration
# (``trainer.save()`` after ``train()``) also passes "replaced".
MAIN = ("begin", "trainable", "ema", "optimizer", "rng", "state", "config", "model", "written", "flushed", "renamed",
        "prune-set-aside", "pruned", "saved")
SHARDED_MAIN = ("begin", "sharded", "exported", "rng", "state", "config", "model", "written", "flushed", "renamed",
                "prune-set-aside", "pruned", "saved")
EVERY_PROCESS = ("sharded", "exported", "rng", "written", "saved")
RESAVE = ("begin", "trainable", "ema", "optimizer", "rng", "state", "config", "model", "written", "flushed",
          "renamed", "replaced", "saved")


def cases(engine: str, nproc: int) -> list[tuple[str, int]]:
    """Every ``(point, rank)`` a save of ``engine`` on ``nproc`` processes passes."""
    main = SHARDED_MAIN if engine == "fsdp2" else MAIN
    return [(point, 0) for point in main] + [(point, rank) for rank in range(1, nproc) for point in main
                                             if point in EVERY_PROCESS]


def settings(model, out, engine: str, **extra) -> list[str]:
    values = {"model.path": str(model), "model.lora_rank": 4, "model.lora_alpha": 8,
              "reward.rewards": "[{name: brightness}]", "data.train_prompts": str(REPO / "assets/prompts/train.jsonl"),
              "data.prompts_per_iteration": 2, "data.group_size": 4, "sampling.num_steps": 8,
              "sampling.batch_size": 2, "optim.minibatches": 2, "optim.lr": 3e-3,
              "optim.ema_decay": 0.5, "train.iterations": ITERATIONS, "train.tracker": "none",
              "train.eval_at_end": "false", "train.sample_every": 0, "train.checkpoint_every": 1,
              "train.keep_checkpoints": 1, "train.out_dir": str(out), "distributed.engine": engine, **extra}
    return [f"{k}={v}" for k, v in values.items()]


def fault(point: str, rank: int = 0, iteration: int = KILLED_SAVE, action: str = "kill") -> str:
    return f"{action}:{point}:{iteration}:{rank}"


def launch(model, out, engine: str, nproc: int, *, fault: str | None = None, timeout: float = 600,
           **extra) -> subprocess.CompletedProcess:
    """``flowalign train`` on ``nproc`` processes (``torchrun --standalone`` on CPU with gloo when more than one),
    with ``FLOWALIGN_FAULT`` set to ``fault``; not checked."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(FAULT_VARIABLE, None)
    if fault:
        env[FAULT_VARIABLE] = fault
    command = [sys.executable, "-m", "flowalign.cli"] if nproc == 1 else [  # torchrun is torch.distributed.run
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m",
        "flowalign.cli"]
    return subprocess.run([*command, *TRAIN_CLI, *settings(model, out, engine, **extra)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def train_in_fork(model, out, engine: str, fault: str | None = None, *, resave: bool = False, **extra) -> int:
    """Train in a child forked from this process's fork server (tests/forked_launch.py ``fork_server``: never a
    fork of the pytest process, whose state broke children) in one intra-op thread, with
    ``FLOWALIGN_FAULT=fault``; ``resave`` saves the last iteration once more after ``train()``, and then only that
    save has the fault. Returns the child's exit code (``-SIGKILL`` when a kill point fired)."""
    child = fork_server().Process(target=_train_child, args=(model, out, engine, fault, resave, extra))
    child.start()
    child.join()
    return child.exitcode


def _train_child(model, out, engine, fault, resave, extra) -> None:
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.pop(FAULT_VARIABLE, None)
    if fault and not resave:
        os.environ[FAULT_VARIABLE] = fault
    trainer = Trainer(load_config(TrainConfig, None, settings(model, out, engine, **extra)))
    trainer.train()
    if resave:
        if fault:
            os.environ[FAULT_VARIABLE] = fault
        trainer.save()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    state = safe_load(path, "a checkpoint file", allow=_rng_globals())
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)
        else:
            flat[prefix] = torch.tensor(hash(str(value)))

    walk("", state)
    return flat


def _rng_globals():
    from flowalign.training.checkpoint_files import _numpy_array_globals

    return _numpy_array_globals()


def _run_state(path: Path) -> dict:
    """``state.json`` without what differs between equal runs (the timings)."""
    state = json.loads(path.read_text())
    state["history"] = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in state["history"]]
    return state


def _run_config(path: Path) -> dict:
    """A checkpoint's ``config.yaml`` without the keys that name the run's directory and how it was started."""
    config = yaml.safe_load(path.read_text())
    for key in ("out_dir", "resume", "keep_checkpoints"):
        config.get("train", {}).pop(key, None)
    return config


def checkpoint_differences(checkpoint: Path, reference: Path) -> list[str]:
    """How ``checkpoint`` differs from the uninterrupted run's ``reference`` (empty: whole and bitwise the same).

    Files: the same names and sizes; tensors (safetensors, ``optimizer.pt``, torch's RNG state of ``rng-*.pt``; the
    python and numpy states there start from the OS's entropy in every process): bitwise equal;
    ``state.json``: equal but for the timings; DCP shard files (``sharded/*.distcp``): the same bytes (its
    ``.metadata`` holds the directory's path: not empty)."""
    found = {p.relative_to(checkpoint) for p in checkpoint.rglob("*") if p.is_file()}
    wanted = {p.relative_to(reference) for p in reference.rglob("*") if p.is_file()}
    problems = [f"{checkpoint.name}/{name}: missing" for name in sorted(wanted - found)]
    problems += [f"{checkpoint.name}/{name}: unexpected" for name in sorted(found - wanted)]
    for name in sorted(found & wanted):
        a, b = checkpoint / name, reference / name
        if name.suffix in (".safetensors", ".pt"):
            try:
                ta, tb = _tensors(a), _tensors(b)
            except Exception as error:  # noqa: BLE001 - a truncated file is a finding, reported
                problems.append(f"{checkpoint.name}/{name}: unreadable ({error})")
                continue
            if name.name.startswith("rng-"):  # python's and numpy's global RNGs start from the OS's entropy in
                ta, tb = ({k: v for k, v in t.items() if k.startswith("/torch")} for t in (ta, tb))  # every process
            if ta.keys() != tb.keys() or any(not torch.equal(ta[k], tb[k]) for k in tb):
                problems.append(f"{checkpoint.name}/{name}: differs")
        elif name.name == "state.json":
            if _run_state(a) != _run_state(b):
                problems.append(f"{checkpoint.name}/{name}: differs")
        elif name.name == "config.yaml":
            if _run_config(a) != _run_config(b):
                problems.append(f"{checkpoint.name}/{name}: differs")
        elif name.name == ".metadata":  # DCP's index: a pickle that holds the directory's path; the shards it
            if a.stat().st_size == 0:  # indexes are compared byte for byte, and the resume reads it whole
                problems.append(f"{checkpoint.name}/{name}: empty")
        elif name.parts[0] == "sharded" or name.suffix == ".json":
            if a.read_bytes() != b.read_bytes():
                problems.append(f"{checkpoint.name}/{name}: differs")
        elif a.stat().st_size != b.stat().st_size:
            problems.append(f"{checkpoint.name}/{name}: {a.stat().st_size} bytes, not {b.stat().st_size}")
    return problems


def losses_after_kill(run: Path, reference: Path) -> list[str]:
    """What a kill lost: every ``checkpoint-*`` left under its normal name must be the uninterrupted run's."""
    problems = []
    for checkpoint in sorted(run.glob("checkpoint-*")):
        if not (reference / checkpoint.name).is_dir():
            problems.append(f"{checkpoint.name}: not a checkpoint of the uninterrupted run")
        else:
            problems += checkpoint_differences(checkpoint, reference / checkpoint.name)
    if not list(run.glob("checkpoint-*")):
        problems.append("no checkpoint left to resume")
    return problems


def final_differences(run: Path, reference: Path) -> list[str]:
    """The continued run's final checkpoint against the uninterrupted run's."""
    name = f"checkpoint-{ITERATIONS:06d}"
    if not (run / name).is_dir():
        return [f"{name}: missing after the resume"]
    return checkpoint_differences(run / name, reference / name)
