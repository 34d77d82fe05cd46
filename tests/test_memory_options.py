"""Memory that scales (``flowalign.memory``, ``distributed.*``): selective activation checkpointing per block,
FSDP2's CPU offload of parameters, gradients and optimizer state, a full fine-tune's reference copy sharded and
offloaded, and HSDP (replicate x shard). Each trains the tiny SD3 to the same weights as the plain run: in this
process (one process; FSDP2 over a world of one) and in one launch of 4 CPU processes on gloo
(tests/memory_options_worker.py through tests/forked_launch.py), where HSDP's 2 x 2 mesh is compared with FSDP2 over
the 4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import ConfigError, load_config
from flowalign.memory.checkpointing import checkpointed_blocks
from flowalign.training.config import TrainConfig

from forked_launch import launch
from memory_options_worker import train_runs
from test_fsdp2 import one_world_per_test, relative_difference, settings, train_here  # noqa: F401
from test_trainer import tiny_model  # noqa: F401 - the module's tiny SD3

ONE = {"train.iterations": 1, "optim.minibatches": 1, "sampling.num_steps": 6, "sampling.window_last": 3,
       "data.group_size": 2}


def trained(run: Path, finetune: str) -> dict[str, torch.Tensor]:
    checkpoint = run / "checkpoint-000001"
    if finetune == "lora":
        return load_file(str(checkpoint / "lora/pytorch_lora_weights.safetensors"))
    return load_file(str(checkpoint / "transformer/diffusion_pytorch_model.safetensors"))


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def test_checkpointed_blocks_are_every_nth():
    assert checkpointed_blocks(5, 1) == [0, 1, 2, 3, 4]
    assert checkpointed_blocks(5, 2) == [0, 2, 4]
    assert checkpointed_blocks(5, 0) == []


def test_activation_checkpointing_trains_bitwise_the_plain_run(tiny_model, tmp_path):
    """Every block and every other block recomputed in the backward: the same LoRA, bit for bit (one process, DDP);
    the 4-process launch below checks it under FSDP2 with a full fine-tune."""
    extra = {**ONE, "distributed.engine": "ddp"}
    plain = train_here(tiny_model, tmp_path / "plain", **extra)
    for every in (1, 2):
        run = tmp_path / f"every{every}"
        history = train_here(tiny_model, run, **extra, **{"distributed.activation_checkpointing": every})
        assert [m["loss"] for m in history] == [m["loss"] for m in plain]
        assert_bitwise(trained(run, "lora"), trained(tmp_path / "plain", "lora"))


@pytest.mark.parametrize("override, key", [
    ({"distributed.cpu_offload": "true"}, "distributed.cpu_offload"),
    ({"distributed.replicate": 2}, "distributed.replicate"),
    ({"distributed.activation_checkpointing": -1}, "distributed.activation_checkpointing"),
    ({"distributed.activation_checkpointing": 1, "model.gradient_checkpointing": "true"},
     "distributed.activation_checkpointing"),
])
def test_memory_options_refuse_what_they_cannot_do_naming_the_key(override, key, tmp_path):
    values = {"distributed.engine": "ddp", **override}
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()])
    assert error.value.key == key


def test_four_processes_hsdp_and_offload_train_as_fsdp2_over_four(tiny_model, tmp_path):
    """One launch of 4 CPU processes (gloo): a full fine-tune under FSDP2 over the 4, HSDP on a 2 x 2 mesh
    (``distributed.replicate: 2``: shard over 2, replicate twice), and FSDP2 with the parameters, gradients, optimizer
    state and the reference copy offloaded to CPU memory and every block checkpointed. The offloaded, checkpointed run
    is bitwise the plain one; HSDP reduces the gradients in another order (reduce-scatter within a copy, then
    all-reduce across the copies), so it agrees to that rounding."""
    common = ("model.finetune:full,train.iterations:1,optim.minibatches:1,data.prompts_per_iteration:4,"
              "data.group_size:2,sampling.batch_size:2,sampling.num_steps:6,sampling.window_last:3")
    runs = {"plain": common, "hsdp": common + ",distributed.replicate:2",
            "offload": common + ",distributed.cpu_offload:true,model.reference_offload:true,"
                                "distributed.activation_checkpointing:1"}
    launch(4, train_runs, tiny_model, tmp_path, [f"{name}={values}" for name, values in runs.items()],
           log_dir=tmp_path / "launch")
    plain = trained(tmp_path / "plain", "full")
    assert_bitwise(trained(tmp_path / "offload", "full"), plain)
    base = load_file(str(tiny_model / "transformer/diffusion_pytorch_model.safetensors"))
    difference = relative_difference(trained(tmp_path / "hsdp", "full"), plain, base)
    print(f"HSDP 2 x 2 against FSDP2 over 4: relative difference {difference:.2e} of the update")
    assert difference < 1e-4
