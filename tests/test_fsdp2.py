"""The FSDP2 engine (``distributed.engine: fsdp2``): parameters, gradients and Adam state sharded per transformer block
over real processes (``torchrun`` on CPU with gloo, and one process over a world of one), sharded checkpoints
(``torch.distributed.checkpoint``) that resume bitwise at the same process count and reshard 2 -> 1 and 1 -> 2, and a
two-"node" rendezvous on the loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import load_config
from flowalign.errors import SetupError
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from conftest import module_from_file
from forked_launch import launch as launch_forked
from test_trainer import TRAIN_CLI, tiny_model  # noqa: F401 - the module's tiny SD3
from train_runs_worker import runs_in_the_background

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
LORA_FILE = "lora/pytorch_lora_weights.safetensors"


def settings(model, out, **extra) -> list[str]:
    values = {"model.path": str(model), "model.lora_rank": 4, "model.lora_alpha": 8,
              "reward.rewards": "[{name: brightness}]", "data.train_prompts": str(REPO / "assets/prompts/train.jsonl"),
              "data.prompts_per_iteration": 2, "data.group_size": 4, "sampling.num_steps": 8,
              "sampling.batch_size": 2, "optim.minibatches": 2, "optim.lr": 3e-3, "train.iterations": 2,
              "train.tracker": "none", "train.eval_at_end": "false", "train.sample_every": 0,
              "train.checkpoint_every": 1, "train.out_dir": str(out), "distributed.engine": "fsdp2", **extra}
    return [f"{k}={v}" for k, v in values.items()]


def train_here(model, out, **extra) -> list[dict]:
    """One process, in this one: FSDP2 over a world of one."""
    return Trainer(load_config(TrainConfig, None, settings(model, out, **extra))).train()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(model, out, *, nproc=2, **extra) -> None:
    """``torchrun --standalone --nproc_per_node nproc`` of ``flowalign train`` on CPU (gloo)."""
    done = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), "-m", "flowalign.cli", *TRAIN_CLI,
         *settings(model, out, **extra)],
        env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(autouse=True)
def one_world_per_test():
    """A test that shards in this process leaves its world of one behind; the next test starts clean."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def lora(run: Path, iteration: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"checkpoint-{iteration:06d}" / LORA_FILE))


def relative_difference(a: dict, b: dict, base: dict | None = None) -> float:
    """``|a - b| / |b - base|`` over all tensors (``base``: zeros, the LoRA B matrices' start)."""
    update = sum((b[k] - (0 if base is None else base[k])).double().pow(2).sum() for k in b).sqrt()
    return float(sum((a[k] - b[k]).double().pow(2).sum() for k in b).sqrt() / update)


def test_one_process_under_fsdp2_is_bitwise_the_ddp_run(tiny_model, tmp_path):
    sharded = train_here(tiny_model, tmp_path / "fsdp2")
    whole = train_here(tiny_model, tmp_path / "ddp", **{"distributed.engine": "ddp"})
    assert [m["reward"] for m in sharded] == [m["reward"] for m in whole]
    assert sharded[0]["first_ratio_max"] == 1.0
    a, b = lora(tmp_path / "fsdp2", 2), lora(tmp_path / "ddp", 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    checkpoint = tmp_path / "fsdp2" / "checkpoint-000002"
    assert (checkpoint / "sharded" / ".metadata").is_file() and not (checkpoint / "trainable.safetensors").exists()


def test_one_process_under_fsdp2_is_bitwise_the_ddp_run_on_flux(tmp_path, words):
    """FLUX's two block lists (transformer_blocks, single_transformer_blocks) each shard per block."""
    from flowalign.models.tiny import tiny_flux_pipeline

    tiny_flux_pipeline(words, seed=0).save_pretrained(tmp_path / "flux")
    extra = {"model.gradient_checkpointing": "false", "sampling.image_size": 32}
    sharded = train_here(tmp_path / "flux", tmp_path / "fsdp2", **extra)
    whole = train_here(tmp_path / "flux", tmp_path / "ddp", **extra, **{"distributed.engine": "ddp"})
    assert [m["reward"] for m in sharded] == [m["reward"] for m in whole] and sharded[0]["first_ratio_max"] == 1.0
    a, b = lora(tmp_path / "fsdp2", 2), lora(tmp_path / "ddp", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp2_trains_in_bf16_with_a_mixed_precision_policy(tiny_model, tmp_path):
    """bf16 base weights, bf16 compute (the policy's param_dtype), fp32 LoRA masters and gradient reduction."""
    history = train_here(tiny_model, tmp_path / "bf16", **{"model.dtype": "bf16", "model.mixed_precision": "bf16"})
    assert history[0]["first_ratio_max"] == 1.0 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    assert all(v.dtype == torch.float32 for v in lora(tmp_path / "bf16", 2).values())


def test_a_sharded_checkpoint_resumes_bitwise_at_the_same_process_count(tiny_model, tmp_path):
    extra = {"train.iterations": 3, "optim.ema_decay": 0.5}
    train_here(tiny_model, tmp_path / "whole", **extra)
    train_here(tiny_model, tmp_path / "split", **{**extra, "train.iterations": 2})
    resumed = Trainer(load_config(TrainConfig, None, settings(tiny_model, tmp_path / "split", **{
        **extra, "train.resume": "latest"})))
    assert resumed.iteration == 2
    resumed.train()
    a, b = lora(tmp_path / "whole", 3), lora(tmp_path / "split", 3)
    assert all(torch.equal(a[k], b[k]) for k in a)


FORWARD_PROCESS = {"loss.grpo": "null", "sampling.noise_level": 0.0, "optim.minibatches": 1,
                   "objectives.diffusion_nft.batch_size": 2, "objectives.awm.batch_size": 4}


def test_policy_copies_shard_and_resume_bitwise_under_fsdp2(tiny_model, tmp_path):
    """DiffusionNFT's theta_old (the rollout's weights) and AWM's theta_ema are DTensors like the weights they copy:
    one FSDP2 process is bitwise the DDP run, and a sharded checkpoint (copies in sharded/) resumes bitwise."""
    sharded = train_here(tiny_model, tmp_path / "fsdp2", **FORWARD_PROCESS)
    whole = train_here(tiny_model, tmp_path / "ddp", **FORWARD_PROCESS, **{"distributed.engine": "ddp"})
    assert [m["reward"] for m in sharded] == [m["reward"] for m in whole]
    assert [m["objectives/awm/ema_kl"] for m in sharded] == [m["objectives/awm/ema_kl"] for m in whole]
    a, b = lora(tmp_path / "fsdp2", 2), lora(tmp_path / "ddp", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    train_here(tiny_model, tmp_path / "split", **FORWARD_PROCESS, **{"train.iterations": 1})
    Trainer(load_config(TrainConfig, None, settings(tiny_model, tmp_path / "split", **FORWARD_PROCESS, **{
        "train.resume": "latest"}))).train()
    c = lora(tmp_path / "split", 2)
    assert all(torch.equal(a[k], c[k]) for k in a)


TREE = {"rollout.name": "tree", "credit.name": "tree", "rollout.split_steps": "[0, 1]", "rollout.branching": "[2]",
        "rollout.split_noise_scale": 2.0, "sampling.window_size": "null", "sampling.window_start": "fixed",
        "sampling.window_last": "null", "sampling.batch_size": 4, "optim.minibatches": 1}
# The final evaluation too: 66 prompts x 2 images in batches of 64 are 2 batches on one process and 1 on the other,
# so the sharded model's lockstep padding runs.
EVALUATION = {"train.eval_at_end": "true", "train.eval_images_per_prompt": 2, "train.eval_steps": 2,
              "data.eval_prompts": str(REPO / "assets/prompts/test.jsonl")}


RG_OPD = {"loss.rg_opd.weight": 0.5, "loss.rg_opd.reward": "toy_geneval_soft", "loss.rg_opd.bands": "[[0.2, 1.0]]"}
# The runs 2 FSDP2 processes train as 1 does: LoRA and full fine-tuning, the default rollout (with the final
# evaluation sharded over the processes) and a tree; and RG-OPD's second forward of the reference, which all-gathers
# the blocks again
ONE_VS_TWO = {"lora-group": {"model.finetune": "lora", **EVALUATION}, "full-group": {"model.finetune": "full", **EVALUATION},
              "lora-tree": {"model.finetune": "lora", **TREE}, "full-tree": {"model.finetune": "full", **TREE},
              "rg_opd": RG_OPD}


def _check_one_vs_two(name: str, one: Path, two: Path, base_model: Path) -> None:
    histories = [json.loads((run / "checkpoint-000002" / "state.json").read_text())["history"] for run in (one, two)]
    assert [m["reward"] for m in histories[0]] == pytest.approx([m["reward"] for m in histories[1]], abs=1e-6)
    if name.endswith("group"):  # the sharded evaluation sampled every image, as one process does
        reports = [json.loads((run / "eval" / "before_after.json").read_text()) for run in (one, two)]
        assert reports[0]["samples"] == reports[1]["samples"] == 2 * 66
        assert reports[0]["paired"] == reports[1]["paired"]
    if not name.startswith("full"):
        assert relative_difference(lora(two, 2), lora(one, 2)) < 1e-3
        return
    from diffusers import SD3Transformer2DModel

    def weights(path):
        return dict(SD3Transformer2DModel.from_pretrained(path).state_dict())

    base = weights(base_model / "transformer")
    assert relative_difference(weights(two / "checkpoint-000002" / "transformer"),
                               weights(one / "checkpoint-000002" / "transformer"), base) < 1e-3


@pytest.mark.slow
def test_two_processes_match_one_process_under_fsdp2(tiny_model, tmp_path):
    """2 FSDP2 processes against 1 at the same global batch and seed, for every run of ``ONE_VS_TWO``: the weights
    agree to the reduce-scatter's rounding (docs/guides/distributed.md gives the measured differences). One torchrun
    launch trains every 2-process run (a process's start-up costs more than a tiny run) while this process trains the
    references; every run is checked, and the failures are named together."""
    with runs_in_the_background([(TRAIN_CLI[1], settings(tiny_model, tmp_path / name / "two", **extra))
                                 for name, extra in ONE_VS_TWO.items()], tmp_path / "launch"):
        for name, extra in ONE_VS_TWO.items():
            train_here(tiny_model, tmp_path / name / "one", **extra)
    failures = {}
    for name in ONE_VS_TWO:
        try:
            _check_one_vs_two(name, tmp_path / name / "one", tmp_path / name / "two", tiny_model)
        except AssertionError as error:
            failures[name] = str(error)[:1500]
    assert not failures, failures


@pytest.mark.slow
def test_two_nodes_on_the_loopback_train_as_two_processes_and_their_checkpoint_reshards(tiny_model, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1`` twice on one machine, over a c10d rendezvous at 127.0.0.1: the
    multi-node code path (node ranks, a rendezvous, a shared run directory) runs, and trains as 2 processes on one
    node do. Its sharded checkpoints then reshard: saved on 2 processes, resumed on 1 (and the reverse), the resumed
    run continues the same run, agreeing with the uninterrupted one to the reduce-scatter's rounding; a checkpoint
    that did not load would be an update away."""
    from flowalign.sharded_reading import read_sharded

    port = free_port()
    command = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "flowalign-test", "-m", "flowalign.cli", *TRAIN_CLI,
               *settings(tiny_model, tmp_path / "nodes")]  # 2 iterations, a checkpoint after each
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    train_here(tiny_model, tmp_path / "one")  # meanwhile, one process
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs[0][1][-2000:] + outputs[1][1][-2000:]
    two = tmp_path / "nodes"
    assert (two / "checkpoint-000002" / "rng-1.pt").is_file()
    # 2 processes on one node, and 1 -> 2: the one-process run's first checkpoint resumed on two (one launch)
    with runs_in_the_background([(TRAIN_CLI[1], settings(tiny_model, tmp_path / "one-node")),
                                 (TRAIN_CLI[1], settings(tiny_model, tmp_path / "one-to-two", **{
                                     "train.resume": str(tmp_path / "one" / "checkpoint-000001")}))],
                                tmp_path / "launch"):
        # 2 -> 1: the 2-process run's first checkpoint resumed on one process (into a run directory of its own)
        train_here(tiny_model, tmp_path / "two-to-one", **{"train.resume": str(two / "checkpoint-000001")})
    assert relative_difference(lora(two, 2), lora(tmp_path / "one-node", 2)) < 1e-6
    # the two processes' shards read back whole in this one, without a process group: the run's last weights
    whole = read_sharded(two / "checkpoint-000002" / "sharded", "trainable")
    saved = lora(two, 2)
    assert all(torch.equal(whole[name], saved["transformer." + name.replace(".default", "")]) for name in whole)
    assert relative_difference(lora(tmp_path / "two-to-one", 2), lora(two, 2)) < 1e-3
    assert relative_difference(lora(tmp_path / "one-to-two", 2), lora(tmp_path / "one", 2)) < 1e-3
    # and the weights a resume loads are the checkpoint's, bitwise
    trainer = Trainer(load_config(TrainConfig, None, settings(
        tiny_model, tmp_path / "one-to-two", **{"train.resume": str(tmp_path / "one-to-two" / "checkpoint-000002"),
                                                "train.iterations": 3})))
    saved = lora(tmp_path / "one-to-two", 2)
    loaded = trainer.model.lora_state_dict(trainer.engine.export_state(trainer))
    assert {f"transformer.{k}" for k in loaded} == set(saved)
    assert all(torch.equal(loaded[k], saved[f"transformer.{k}"]) for k in loaded)


def test_fsdp2_refuses_a_transformer_without_blocks_before_the_model_loads(tiny_model, tmp_path):
    """A transformer whose blocks cannot be found (here a VAE's config in the transformer's place, built on the
    meta device only) is refused naming distributed.engine, before any weight is read."""
    model = tmp_path / "blockless"
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text((tiny_model / "model_index.json").read_text())
    (model / "transformer" / "config.json").write_text((tiny_model / "vae" / "config.json").read_text())
    with pytest.raises(SetupError, match=r"distributed.engine = fsdp2 shards the transformer per block.*AutoencoderKL"
                                         r".*distributed.engine: ddp"):
        Trainer(load_config(TrainConfig, None, settings(model, tmp_path / "run")))


def test_resuming_with_another_engine_is_refused_before_the_model_loads(tiny_model, tmp_path):
    train_here(tiny_model, tmp_path / "run", **{"train.iterations": 1})
    with pytest.raises(Exception, match="distributed.engine"):
        Trainer(load_config(TrainConfig, None, settings(
            tmp_path / "no-model", tmp_path / "run", **{"distributed.engine": "ddp", "train.resume": "latest"})))


@pytest.mark.slow
def test_nodes_launched_with_different_configs_are_refused_naming_the_key(tiny_model, tmp_path):
    """Two "nodes" whose overrides differ stop at set-up, before the model loads, each naming the key."""
    port = free_port()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "flowalign-mismatch", "-m", "flowalign.cli", *TRAIN_CLI,
         *settings(tiny_model, tmp_path / "run", **{"optim.lr": lr})],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for lr in (3e-3, 1e-3)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    errors = outputs[0][1] + outputs[1][1]
    assert "do not run the same config" in errors and "optim.lr: 0.003 != 0.001" in errors, errors[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_rg_opd_second_forward_under_fsdp2_is_bitwise_the_ddp_run(tiny_model, tmp_path):
    """RG-OPD differentiates the soft reward through a second forward of the reference (the LoRA-disabled model):
    under FSDP2 that forward all-gathers the blocks again. One process matches DDP bitwise (two match one:
    ``test_two_processes_match_one_process_under_fsdp2``)."""
    sharded = train_here(tiny_model, tmp_path / "fsdp2", **RG_OPD)
    whole = train_here(tiny_model, tmp_path / "ddp", **RG_OPD, **{"distributed.engine": "ddp"})
    assert [m["rg_opd"] for m in sharded] == [m["rg_opd"] for m in whole] and sharded[0]["rg_opd"] > 0
    assert all(torch.equal(a, b) for a, b in zip(lora(tmp_path / "fsdp2", 2).values(), lora(tmp_path / "ddp", 2).values()))


def measure_both_engines(out: Path, extra: list[str]) -> None:
    """A worker of ``test_fsdp2_holds_half_of_ddps_training_state_per_process``: bench/scale.py's measured run under
    DDP, then under FSDP2, in the same processes."""
    scale = module_from_file("bench_scale", REPO / "bench" / "scale.py")
    for engine in ("ddp", "fsdp2"):
        scale.worker(engine, out, extra)


@pytest.mark.slow
def test_fsdp2_holds_half_of_ddps_training_state_per_process(tmp_path):
    """bench/scale.py's measured run (its ``worker``, both engines in one launch of 2 processes): a full fine-tune;
    FSDP2's parameters + gradients + Adam state per process is at most 60% of DDP's (half, plus what does not split
    evenly), and so is its reference copy."""
    scale = module_from_file("bench_scale", REPO / "bench" / "scale.py")
    launch_forked(2, measure_both_engines, tmp_path, ["sampling.num_steps=4", "sampling.window_last=1"],  # shorter
                  log_dir=tmp_path / "launch")  # rollouts: the state measured does not depend on them
    rows = {e: [json.loads((tmp_path / f"{e}-rank{r}.json").read_text()) for r in range(2)] for e in ("ddp", "fsdp2")}
    ddp, fsdp2 = (max(r["state"] for r in rows[e]) for e in ("ddp", "fsdp2"))
    assert fsdp2 <= 0.6 * ddp
    assert max(r["reference"] for r in rows["fsdp2"]) <= 0.6 * max(r["reference"] for r in rows["ddp"])
    assert all(r["gradients"] == r["parameters"] for e in rows for r in rows[e])  # every weight trains
    computed = scale.computed_sd35_medium()
    assert 2.2e9 < computed["transformer_parameters"] < 2.3e9  # SD3.5-Medium's published dimensions
    assert computed["modes"]["full"]["total"] == 18 * computed["transformer_parameters"]


def test_a_sharded_checkpoint_exports_and_evaluates_like_a_whole_one(tiny_model, tmp_path):
    """``flowalign export`` (and ``eval --lora``) read a sharded checkpoint's weights without a process group: the
    last weights equal its lora/ folder, and the EMA is the run's EMA."""
    from flowalign.export import export_lora
    from flowalign.lora_loading import resolve_lora
    from flowalign.sharded_reading import read_sharded

    train_here(tiny_model, tmp_path / "run", **{"optim.ema_decay": 0.5})
    checkpoint = tmp_path / "run" / "checkpoint-000002"
    assert resolve_lora(checkpoint).weights == "ema"
    last = export_lora(checkpoint, tmp_path / "last", weights="last")
    a, b = load_file(str(last / "pytorch_lora_weights.safetensors")), lora(tmp_path / "run", 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ema = export_lora(checkpoint, tmp_path / "ema", weights="ema")
    e = load_file(str(ema / "pytorch_lora_weights.safetensors"))
    assert any(not torch.equal(e[k], b[k]) for k in b)
    assert read_sharded(checkpoint / "sharded", "ema").keys() == read_sharded(checkpoint / "sharded", "trainable").keys()


def test_a_full_fine_tunes_checkpoint_is_no_lora_source(tiny_model, tmp_path):
    from flowalign.lora_loading import resolve_lora

    train_here(tiny_model, tmp_path / "run", **{"model.finetune": "full", "train.iterations": 1})
    with pytest.raises(ValueError, match=r"full fine-tune.*holds no LoRA.*transformer"):
        resolve_lora(tmp_path / "run" / "checkpoint-000001")
