"""Every shipped accelerate launch config (``configs/accelerate/*.yaml``) runs ``flowalign train`` for real: on this
CPU machine with ``ACCELERATE_USE_CPU=1`` (gloo), 2 processes in all, and a multi-machine config as that many
"machines" on the loopback (``--machine_rank k --main_process_ip 127.0.0.1``); one machine under DDP, several under
FSDP2, so that both engines run from a shipped config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_fsdp2 import free_port, lora, relative_difference, settings, train_here
from test_trainer import TRAIN_CLI, tiny_model  # noqa: F401 - the module's tiny SD3

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
LAUNCH_CONFIGS = sorted((REPO / "configs/accelerate").glob("*.yaml"))


def engine_for(launch: Path) -> str:
    """Each config under one engine, the two engines between them: DDP on one machine, FSDP2 across machines."""
    return "fsdp2" if int(yaml.safe_load(launch.read_text()).get("num_machines", 1)) > 1 else "ddp"


@pytest.mark.slow
@pytest.mark.parametrize("launch", LAUNCH_CONFIGS, ids=lambda p: p.stem)
def test_the_shipped_launch_config_trains_on_two_cpu_processes(launch, tiny_model, tmp_path):
    engine = engine_for(launch)
    machines = int(yaml.safe_load(launch.read_text()).get("num_machines", 1))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [str(BIN / "accelerate"), "launch", "--config_file", str(launch), "--num_processes", "2"]
    train = ["-m", "flowalign.cli", *TRAIN_CLI, *settings(tiny_model, tmp_path / "run", **{"distributed.engine": engine})]
    if machines == 1:
        runs = [subprocess.Popen(command + train, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    else:
        port = str(free_port())
        runs = [subprocess.Popen(command + ["--num_machines", str(machines), "--machine_rank", str(rank),
                                            "--main_process_ip", "127.0.0.1", "--main_process_port", port] + train,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for rank in range(machines)]
    try:  # meanwhile, one process
        train_here(tiny_model, tmp_path / "one", **{"distributed.engine": engine})
    finally:
        outputs = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), "\n".join(err[-2000:] for _, err in outputs)
    checkpoint = tmp_path / "run" / "checkpoint-000002"
    assert (checkpoint / "rng-1.pt").is_file()  # two processes wrote the checkpoint
    assert (checkpoint / "sharded").is_dir() == (engine == "fsdp2")
    assert relative_difference(lora(tmp_path / "run", 2), lora(tmp_path / "one", 2)) < 1e-3
