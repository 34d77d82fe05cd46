"""The GRPO trainer end to end on a tiny random SD3 pipeline: ratios, resume, 2 processes, signals, bad input."""

import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import ConfigError, load_config
from flowalign.errors import SetupError
from flowalign.credit.tree import tree_advantages
from flowalign.models.tiny import tiny_sd3_pipeline
from flowalign.rewards import REWARDS, register_reward
from flowalign.toy.prompts import split_prompts
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from train_runs_worker import runs_in_the_background

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# `flowalign train` with these tests' overrides: the Flow-GRPO-Fast preset (TrainConfig's own defaults, what the
# in-process runs build on) named first, since a command line without a config builds on the default run instead.
TRAIN_CLI = ("train", str(REPO / "configs/methods/flow_grpo_fast.yaml"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    train, test = split_prompts()
    words = sorted({w for e in train + test for w in e["prompt"].split()})
    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    tiny_sd3_pipeline(words, seed=0).save_pretrained(path)
    return path


# The Flow-GRPO layout these tests were written for: SDE on every step but the last (the default run uses a
# random 2-step window).
EVERY_STEP = {"sampling.window_size": "null", "sampling.window_start": "fixed", "sampling.window_last": "null"}


def overrides(model, out, **extra):
    base = {
        "model.path": str(model),
        "model.lora_rank": 4,
        "model.lora_alpha": 8,
        "reward.rewards": "[{name: brightness}]",
        "data.train_prompts": str(REPO / "assets/prompts/train.jsonl"),
        "data.eval_prompts": str(REPO / "assets/prompts/test.jsonl"),
        "data.prompts_per_iteration": 2,
        "data.group_size": 4,
        "sampling.num_steps": 4,
        "sampling.batch_size": 4,
        **EVERY_STEP,
        "optim.lr": 3e-3,
        "train.iterations": 3,
        "train.tracker": "none",
        "train.eval_at_end": "false",
        "train.sample_every": 0,
        "train.out_dir": str(out),
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def make_trainer(model, out, **extra):
    return Trainer(load_config(TrainConfig, None, overrides(model, out, **extra)))


def final_checkpoint(run: Path) -> Path:
    return sorted(run.glob("checkpoint-*"))[-1]


def test_first_ratio_is_exactly_one_and_metrics_are_logged(tiny_model, tmp_path):
    history = make_trainer(tiny_model, tmp_path / "run", **{"optim.inner_epochs": 2, "optim.minibatches": 3}).train()
    assert len(history) == 3
    for metrics in history:
        assert metrics["first_ratio_max"] == 1.0 and metrics["first_ratio_mean"] == 1.0
        assert metrics["nfe"] == 8 * 4 and metrics["skipped"] == 0.0
        for key in ("reward", "reward_std", "rewards/brightness/mean", "kl", "approx_kl", "clip_frac",
                    "zero_std_frac", "time/rollout", "time/reward", "time/train"):
            assert key in metrics and metrics[key] == metrics[key]  # present and not NaN
    # with two epochs and three minibatches the policy moves within an iteration, so ratios leave 1
    assert any(m["ratio_max"] > 1.0 for m in history)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [0, 1, 2]
    saved = final_checkpoint(tmp_path / "run")
    assert (saved / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_short_run_on_the_toy_model_raises_the_reward(seed, tmp_path):
    """8 iterations on the shipped toy model: the mean reward of the last 3 iterations beats the first 3.

    Brightness is dense and prompt-free, so a few iterations at a high learning rate move it clearly (measured on
    seeds 0, 1 and 2: +0.055, +0.058 and +0.111, against an iteration-to-iteration spread of about 0.02).
    """
    config = load_config(TrainConfig, None, [
        "reward.rewards=[{name: brightness}]", "data.prompts_per_iteration=2", "data.group_size=8",
        "optim.lr=2e-2", "model.lora_rank=8", "model.lora_alpha=16", "train.iterations=8", f"train.seed={seed}",
        "optim.ema_decay=0", *[f"{k}={v}" for k, v in EVERY_STEP.items()],
        "train.tracker=none", "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0",
        f"train.out_dir={tmp_path}", f"model.path={REPO / 'assets/toy-sd3'}",
        f"data.train_prompts={REPO / 'assets/prompts/train.jsonl'}",
    ])
    rewards = [m["reward"] for m in Trainer(config).train()]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.025, rewards


def test_resume_matches_an_uninterrupted_run(tiny_model, tmp_path):
    extra = {"train.iterations": 4, "train.checkpoint_every": 1, "optim.ema_decay": 0.5}
    full = make_trainer(tiny_model, tmp_path / "full", **extra).train()
    make_trainer(tiny_model, tmp_path / "split", **{**extra, "train.iterations": 2}).train()
    resumed = make_trainer(tiny_model, tmp_path / "split", **{**extra, "train.resume": "latest"}).train()
    assert [m["reward"] for m in resumed[2:]] == [m["reward"] for m in full[2:]]
    a = load_file(str(tmp_path / "full" / "checkpoint-000004" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000004" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ema_a = load_file(str(tmp_path / "full" / "checkpoint-000004" / "ema.safetensors"))
    ema_b = load_file(str(tmp_path / "split" / "checkpoint-000004" / "ema.safetensors"))
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)


def test_a_finished_run_resumed_only_reruns_its_evaluation_on_the_seed_asked_for(tiny_model, tmp_path):
    evaluation = {"train.eval_at_end": "true", "train.eval_images_per_prompt": 1, "train.eval_steps": 2,
                  "train.iterations": 1}
    make_trainer(tiny_model, tmp_path / "run", **evaluation).train()
    original = json.loads((tmp_path / "run" / "eval" / "before_after.json").read_text())
    assert original["seed"] == 10_000 and original["samples"] == 66
    checkpoint = final_checkpoint(tmp_path / "run")
    for name, seed in (("same", None), ("other", 7)):
        extra = {**evaluation, "train.resume": str(checkpoint), "train.out_dir": str(tmp_path / name)}
        if seed is not None:
            extra["train.eval_seed"] = seed
        history = make_trainer(tiny_model, tmp_path / name, **extra).train()
        report = json.loads((tmp_path / name / "eval" / "before_after.json").read_text())
        assert len(history) == 1  # the checkpoint's one iteration; none ran
        assert not list((tmp_path / name).glob("checkpoint-*"))
        assert report["seed"] == (10_000 if seed is None else seed)
        if seed is None:  # the same seeds reproduce the run's own evaluation exactly
            assert report["paired"] == original["paired"]
    assert "(evaluation seed 7, guidance 1)" in (tmp_path / "other" / "eval" / "before_after.md").read_text()


def test_rg_opd_on_a_differentiable_reward_regresses_onto_its_rgs_targets(tiny_model, tmp_path):
    from flowalign.samplers.rgs import rgs_velocity_target
    from flowalign.samplers.sde import predict_x0

    extra = {"loss.rg_opd.weight": 0.5, "loss.rg_opd.reward": "toy_geneval_soft", "loss.rg_opd.bands": "[[0.2, 1.0]]",
             "train.iterations": 1}
    trainer = make_trainer(tiny_model, tmp_path / "run", **extra)
    history = trainer.train()
    assert history[0]["rg_opd"] > 0
    # The target, by hand: the soft reward's gradient on the reference x0_hat, through rgs_velocity_target.
    prompts = trainer.prompts.prompts[:2]
    term = trainer.parts.losses["rg_opd"]
    cond = trainer.model.encode([p["prompt"] for p in prompts])
    x = torch.randn(2, *trainer.model.latent_shape(1)[1:], generator=torch.Generator().manual_seed(0))
    sigma, sigma_next = torch.full((2,), 0.75), torch.full((2,), 0.5)
    with torch.no_grad(), trainer.model.reference():
        v_ref = trainer.model.velocity(x, sigma, cond)
    x0 = predict_x0(x, v_ref, sigma[0]).requires_grad_(True)
    (grad,) = torch.autograd.grad(term.reward(trainer.model.decode(x0), [p["prompt"] for p in prompts],
                                              prompts).sum(), x0)
    expected = rgs_velocity_target(x, v_ref, [grad], [1.0], 0.75, 0.5, [(0.2, 1.0)])
    got = term.reward_target(x, sigma, sigma_next, cond, prompts, None)
    assert torch.allclose(got, expected, atol=1e-6) and not torch.allclose(got, v_ref)
    low = torch.full((2,), 0.1)  # below the band: the target is the reference velocity itself
    with torch.no_grad(), trainer.model.reference():
        v_low = trainer.model.velocity(x, low, cond)
    assert torch.equal(term.reward_target(x, low, torch.full((2,), 0.05), cond, prompts, None), v_low.float())


def test_cosine_schedule_sets_each_iterations_learning_rate(tiny_model, tmp_path):
    extra = {"train.iterations": 3, "optim.lr_schedule": "cosine", "optim.min_lr_ratio": 0.1, "optim.lr": 1e-3}
    history = make_trainer(tiny_model, tmp_path / "run", **extra).train()
    expected = [1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 3))) for k in range(3)]
    assert [m["lr"] for m in history] == pytest.approx(expected)


def test_resume_refuses_a_different_config_before_the_model_loads(tiny_model, tmp_path):
    make_trainer(tiny_model, tmp_path / "run", **{"train.iterations": 1}).train()
    with pytest.raises(SetupError, match=r"different config: .*optim.lr: 0.003 != 0.0005"):  # by the constructor
        make_trainer(tmp_path / "no-model", tmp_path / "run", **{"train.resume": "latest", "optim.lr": 5e-4})


def test_nan_rewards_are_masked_and_counted(tiny_model, tmp_path):
    class HalfNaN:
        name = "half_nan"

        def __call__(self, images, prompts, metadata):
            scores = images.mean(dim=(1, 2, 3))
            scores[::2] = float("nan")
            return scores

    register_reward("half_nan", HalfNaN, overwrite=True)
    try:
        trainer = make_trainer(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: half_nan}]",
                                                                 "train.iterations": 2})
        history = trainer.train()
    finally:
        REWARDS.unregister("half_nan")
    assert all(m["reward_invalid"] == 4 for m in history)
    assert all(torch.isfinite(p).all() for p in trainer.params)
    assert all(m["reward"] == m["reward"] for m in history)


def test_a_failing_reward_names_itself_and_the_prompt(tiny_model, tmp_path):
    class Broken:
        name = "broken"

        def __call__(self, images, prompts, metadata):
            raise OSError("scorer weights missing")

    register_reward("broken", Broken, overwrite=True)
    try:
        trainer = make_trainer(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: broken}]"})
        with pytest.raises(RuntimeError, match=r"reward 'broken' failed .*first prompt: 'a photo of"):
            trainer.train()
    finally:
        REWARDS.unregister("broken")


def test_all_zero_variance_skips_the_update(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: toy_geneval}]",
                                                             "train.iterations": 1})
    before = [p.detach().clone() for p in trainer.params]
    with pytest.warns(UserWarning, match="zero reward variance; skipping the update"):
        history = trainer.train()
    assert history[0]["skipped"] == 1.0 and history[0]["zero_std_frac"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params))


def test_a_credit_estimator_that_declares_no_skip_updates_on_zero_variance(tiny_model, tmp_path):
    """The skip is the credit estimator's declaration (``CreditEstimator.skip_without_signal``), not the trainer's."""
    trainer = make_trainer(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: toy_geneval}]",
                                                             "train.iterations": 1})
    trainer.parts.credit.skip_without_signal = False
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*skipping the update")
        history = trainer.train()
    assert history[0]["skipped"] == 0.0 and history[0]["zero_std_frac"] == 1.0 and trainer.optimizer_steps == 1


def test_the_trainer_is_the_loop_in_at_most_300_lines():
    """set-up, contexts, NFE accounting, the learning rate and signals live in their own modules."""
    lines = (REPO / "flowalign/training/trainer.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, len(lines)


def test_bad_configs_fail_before_any_model_loads(tmp_path):
    missing_model = tmp_path / "no-model"  # never loaded: validation fails first
    for extra, message in [
        ({"optim.lrr": 1}, "did you mean 'optim.lr'"),
        ({"optim.lr": "fast"}, "optim.lr: expected a float"),
        ({"data.group_size": 1}, "data.group_size"),
        ({"sampling.noise_level": -1}, "sampling.noise_level"),
        ({"sampling.batch_size": 3}, "sampling.batch_size = 3 does not divide"),
        ({"loss.rg_opd.reward_kwargs": "{channel: 0}"}, "loss.rg_opd.reward_kwargs are the constructor arguments"),
        ({"loss.rg_opd.weight": 1, "loss.rg_opd.reward": "nope"}, "'nope' is not a registered reward"),
        ({"loss.rg_opd.weight": 1}, "loss.rg_opd.registers or reward: give RG-OPD exactly one gradient source"),
        ({"loss.rg_opd.reward": "brightness", "loss.rg_opd.bands": "[[0.2, 1.0], [0.5, 0.1]]"}, "loss.rg_opd.bands"),
        ({"loss.rg_opd.reward": "brightness", "loss.rg_opd.weight": 0}, "loss.rg_opd.weight must be > 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, None, overrides(missing_model, tmp_path, **extra))


def test_a_missing_prompt_file_is_named_by_its_key_before_any_model_loads(tmp_path):
    """The README's SD3.5 quickstart run where its prompts.txt is not there yet: the error names the key, the path and
    where a relative path is read from (the model path does not exist either: nothing loaded)."""
    config = load_config(TrainConfig, None, overrides(tmp_path / "no-model", tmp_path / "run", **{
        "data.train_prompts": "prompts.txt"}))
    with pytest.raises(ValueError, match=r"data.train_prompts = 'prompts.txt': no such file \(a relative path is read "
                                         r"from the working directory, .*\.txt with one prompt a line"):
        Trainer(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def run_cli(args, env_extra=None, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    command = list(TRAIN_CLI) if args and "=" in args[0] else ["train"]
    return subprocess.run([str(BIN / "flowalign"), *command, *args], env=env, capture_output=True, text=True,
                          **kwargs)


def test_cli_reports_bad_config_with_exit_code_2(tmp_path):
    result = run_cli(["optim.lrr=1"])
    assert result.returncode == 2 and "did you mean 'optim.lr'" in result.stderr
    result = run_cli([str(tmp_path / "missing.yaml")])
    assert result.returncode == 2 and "missing.yaml" in result.stderr


def _one_vs_two_processes_each(tiny_model, tmp_path, runs: dict[str, dict]) -> dict[str, tuple[Path, Path]]:
    """Train each of ``runs`` (a name and its overrides) for 2 iterations on 2 processes (torchrun, gloo on CPU; every
    run in one launch of tests/train_runs_worker.py) and, meanwhile, on this one; return each run's two final
    checkpoints (one process's, two processes')."""
    def settings(name, processes):
        return overrides(tiny_model, tmp_path / name / processes, **{"train.iterations": 2, "optim.minibatches": 3,
                                                                        **runs[name]})

    with runs_in_the_background([(TRAIN_CLI[1], settings(name, "two")) for name in runs], tmp_path / "launch"):
        for name in runs:
            Trainer(load_config(TrainConfig, TRAIN_CLI[1], settings(name, "one"))).train()
    return {name: (final_checkpoint(tmp_path / name / "one"), final_checkpoint(tmp_path / name / "two"))
            for name in runs}


def _one_vs_two_processes(tiny_model, tmp_path, **extra) -> tuple[Path, Path]:
    """One run's two final checkpoints (``_one_vs_two_processes_each``)."""
    return _one_vs_two_processes_each(tiny_model, tmp_path, {"run": extra})["run"]


def _assert_same_run(a: Path, b: Path) -> None:
    state_a, state_b = json.loads((a / "state.json").read_text()), json.loads((b / "state.json").read_text())
    torch.testing.assert_close(torch.tensor(state_a["last_advantages"]), torch.tensor(state_b["last_advantages"]),
                               rtol=0, atol=1e-4)
    assert [m["reward"] for m in state_a["history"]] == pytest.approx([m["reward"] for m in state_b["history"]], abs=1e-6)
    assert [m["nfe"] for m in state_a["history"]] == [m["nfe"] for m in state_b["history"]]
    wa, wb = load_file(str(a / "trainable.safetensors")), load_file(str(b / "trainable.safetensors"))
    moved = max(wa[k].abs().max().item() for k in wa if "lora_B" in k)  # lora_B starts at zero
    assert moved > 1e-3  # the update is real...
    # ...and the same up to the all-reduce's rounding, which Adam's normalisation and two iterations of RL amplify
    # (1.4e-4 of the update's norm measured on a 2-core x86 CPU); a real difference (a group normalised on one
    # process, a gradient not reduced) is of the order of the update itself.
    update = sum(wa[k].double().pow(2).sum() for k in wa if "lora_B" in k).sqrt()
    difference = sum((wa[k] - wb[k]).double().pow(2).sum() for k in wa).sqrt()
    assert difference < 1e-3 * update, (float(difference), float(update))


@pytest.mark.slow
def test_two_processes_match_one_process(tiny_model, tmp_path):
    """``flowalign train`` on one process and under torchrun --nproc_per_node 2 with gloo on CPU: same advantages,
    same updated weights and the same evaluation table printed."""
    settings = {"train.iterations": 2, "optim.minibatches": 3, "train.eval_at_end": "true",
                "train.eval_images_per_prompt": 1, "train.eval_steps": 2}
    # one intra-op thread in both, as torchrun gives each of its processes: the reference model's evaluation is then
    # the same bitwise (2 threads sum in another order: 2e-10 apart). No ACCELERATE_USE_CPU: on a machine without an
    # accelerator the trainer asks accelerate for the CPU's process group itself (launched_without_accelerator)
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    two = subprocess.Popen(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "flowalign.cli", *TRAIN_CLI,
         *overrides(tiny_model, tmp_path / "two", **settings)],
        env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:  # meanwhile, one process
        one = run_cli(overrides(tiny_model, tmp_path / "one", **settings), {"OMP_NUM_THREADS": "1"}, timeout=300)
    finally:
        two_stdout, two_stderr = two.communicate(timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two_stderr[-2000:]
    a, b = final_checkpoint(tmp_path / "one"), final_checkpoint(tmp_path / "two")
    assert (b / "rng-1.pt").is_file()  # both processes wrote their RNG state
    _assert_same_run(a, b)
    # The final evaluation, sharded over the 2 processes (66 samples: one batch each), prints the same table
    reports = [json.loads((tmp_path / n / "eval" / "before_after.json").read_text()) for n in ("one", "two")]
    assert reports[0]["samples"] == reports[1]["samples"] == 66 and reports[0]["paired"] == reports[1]["paired"]
    tables = [[line for line in out.splitlines() if line.startswith("| ")] for out in (one.stdout, two_stdout)]
    assert len(tables[0]) == 8 + 2 and tables[0][:9] == tables[1][:9]  # toy GenEval, the run's rewards' header
    # the run's brightness on the same images: the reference's exactly, the trained policy's up to the all-reduce's
    # rounding (above), which a continuous reward shows where toy GenEval's verdicts do not
    ra, rb = reports[0]["rewards"]["brightness"]["overall"], reports[1]["rewards"]["brightness"]["overall"]
    assert ra["mean_a"] == rb["mean_a"] and math.isclose(ra["mean_b"], rb["mean_b"], rel_tol=1e-5), (ra, rb)


TREE = {"rollout.name": "tree", "credit.name": "tree", "rollout.split_steps": "[0, 1]", "rollout.branching": "[2]",
        "rollout.split_noise_scale": 2.0}


SHARDED_CREDIT = {
    "tree": TREE,
    # with Flow-DPPO's divergence mask and rollout correction's bypass rejection (per transition, on each process's
    # own micro-batches; no launch of their own)
    "dense": {"credit.name": "dense", "loss.grpo.trust_region": "dppo", "loss.grpo.kl_mask_threshold": 1e-7,
              "loss.grpo.rollout_rs": "token_k1", "loss.grpo.rollout_rs_threshold": "'0.99998_1.00002'"},
    "vgpo": {"credit.name": "vgpo"},  # instant rewards of every state's x0_hat, values and omega per group
    "tp_grpo": {"credit.name": "turning_point", "credit.process_rewards": "released_code", "sampling.kind": "cps"},
    # Euphonium guides and credits whole groups (its process reward here the differentiable brightness)
    "euphonium": {"credit.name": "euphonium", "credit.process_reward": "brightness", "credit.start_step": 1,
                  "credit.normalize": "true", "credit.scale": 1.0},
    # RG-OPD's second, grad-enabled forward of the reference inside DDP's forward/backward; on the same launch,
    # Pref-GRPO's reward combination: a groupwise pairwise win rate (each process judges its own groups) beside a
    # pointwise reward, GDPO-normalised over the gathered batch (reward.combine gdpo)
    "rg_opd": {"loss.rg_opd.weight": 0.5, "loss.rg_opd.reward": "toy_geneval_soft", "loss.rg_opd.bands": "[[0.2, 1.0]]",
               "reward.rewards": "[{name: pairwise_preference, weight: 0.4, kwargs: {judge: score, judge_kwargs: "
                                 "{reward: brightness}}}, {name: brightness, weight: 0.6, kwargs: {channel: 0}}]",
               "reward.combine": "gdpo", "reward.gdpo_variant": "pref_grpo"},
}


# The three forward-process objectives on one run (summed): ODE rollouts sampled with DiffusionNFT's theta_old, its
# r from global-std advantages, AWM's strata shared per unit of 2 samples and its theta_ema, online DPO's pairs per
# group (each process holds one) and its reference copy, refreshed every 3 optimizer steps. With them two objectives on
# keyed data units, 6 each over the 3 minibatches (unit_keys): flow matching on the toy scenes, and adjoint matching
# (trajectories, lean adjoints on the reference, and the outlier threshold moved through every unit's quantile).
# DGPO's group noise and shared levels (each process holds one group) with its clip copy, and CRD's dual-softmax
# centring over a unit (one group) with its old copy.
FORWARD_PROCESS = {"loss.grpo": "null", "sampling.noise_level": 0.0, "advantage.std": "global",
                   "objectives.diffusion_nft.batch_size": 2, "objectives.awm.train_sigmas": 3,
                   "objectives.awm.batch_size": 2, "objectives.dpo.ref_update_steps": 3,
                   "objectives.dpo.sample_with_reference": "false",
                   "objectives.flow_matching.data": "toy", "objectives.flow_matching.batch_size": 1,
                   "objectives.flow_matching.units_per_iteration": 6,
                   "objectives.adjoint_matching.reward": "brightness", "objectives.adjoint_matching.reward_kwargs": "{}",
                   "objectives.adjoint_matching.batch_size": 1, "objectives.adjoint_matching.units_per_iteration": 6,
                   "objectives.dgpo.num_train_timesteps": 3, "objectives.dgpo.trunc_steps": 3,
                   "objectives.crd.kl_cfg": 1.0, "objectives.crd.sample_with_copy": "false",
                   "objectives.crd.weight_temp": 0.5}


def _check_sharded_credit(shape: str, a: Path, b: Path) -> None:
    """Each process grows whole trees / scores whole groups' intermediate states (and VGPO's and TP-GRPO's per-step
    credit reads only its own groups, Euphonium guides whole groups): the run does not depend on the process count."""
    _assert_same_run(a, b)
    if shape == "rg_opd":  # the win rates of groups of 4 judged on their own process: a mean of exactly 1/2
        history = json.loads((b / "state.json").read_text())["history"]
        assert all(h["rewards/pairwise_preference/mean"] == 0.5 for h in history), history
    if shape == "dense":  # the mask and the rejection acted on both (the logged fractions are of the process's
        # own micro-batches, so they are not compared; the weights are, above)
        for run in (a, b):
            history = json.loads((run / "state.json").read_text())["history"]
            assert all(any(h[key] > 0 for h in history) for key in ("clip_frac", "rollout_corr/rs_rejected"))


def _check_forward_process(a: Path, b: Path) -> None:
    """Each process re-noises its own samples with draws keyed by sample, unit and group, DPO pairs whole groups on
    their process, the data units are keyed alike, and the policy copies move alike: the run, copies and the adjoint
    matching threshold included, does not depend on the process count."""
    _assert_same_run(a, b)
    taus = [[h["adjoint_matching/tau"] for h in json.loads((c / "state.json").read_text())["history"]] for c in (a, b)]
    assert taus[0] == pytest.approx(taus[1], rel=1e-3) and all(t > 0 for t in taus[0]), taus  # all-reduce rounding
    ca, cb = load_file(str(a / "copies.safetensors")), load_file(str(b / "copies.safetensors"))
    assert sorted({k.split("/")[0] for k in ca}) == ["crd_old", "dgpo_old", "kl_ema", "old", "ref"] and ca.keys() == cb.keys()
    difference = max((ca[k] - cb[k]).abs().max().item() for k in ca)
    assert difference < 1e-4, difference
    history = json.loads((b / "state.json").read_text())["history"]
    assert all(h["objectives/dpo/tie_frac"] == 0.0 for h in history)  # brightness never ties


@pytest.mark.slow
def test_two_processes_match_one_process_for_every_credit_and_the_forward_process_objectives(tiny_model, tmp_path):
    """The sharded credit estimators (``SHARDED_CREDIT``) and the forward-process objectives (``FORWARD_PROCESS``),
    each trained on 2 processes and on 1: one torchrun launch holds every 2-process run, since a process's start-up
    costs more than a tiny run. Every run is checked, and the failures are named together."""
    runs = {**SHARDED_CREDIT, "forward_process": FORWARD_PROCESS}
    checkpoints = _one_vs_two_processes_each(tiny_model, tmp_path, runs)
    failures = {}
    for name, (a, b) in checkpoints.items():
        try:
            _check_forward_process(a, b) if name == "forward_process" else _check_sharded_credit(name, a, b)
        except AssertionError as error:
            failures[name] = str(error)[:1500]
    assert not failures, failures


@pytest.mark.slow
@pytest.mark.parametrize("stop, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_iteration_checkpoints_and_exits_128_plus_it(tiny_model, tmp_path, stop, status):
    """So that scripts and make know the run did not finish; the checkpoint is saved as it is at an end."""
    run = tmp_path / "run"
    args = overrides(tiny_model, run, **{"train.iterations": 200, "train.checkpoint_every": 0})
    process = subprocess.Popen([str(BIN / "flowalign"), *TRAIN_CLI, *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(stop)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == status, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    checkpoint = final_checkpoint(run)
    done = json.loads((checkpoint / "state.json").read_text())["iteration"]
    assert 1 <= done < 200 and "stopped by signal" in stdout
    assert len((run / "metrics.jsonl").read_text().splitlines()) == done
    # and it resumes from there
    resumed = make_trainer(tiny_model, run, **{"train.iterations": done + 1, "train.resume": "latest"}).train()
    assert len(resumed) == done + 1


def test_ema_weights_swap_in_and_back(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path / "run", **{"train.iterations": 2, "optim.ema_decay": 0.5})
    trainer.train()
    live = {n: p.detach().clone() for n, p in trainer.trainable_state().items()}
    averages = trainer.ema.state_dict()
    assert set(averages) == set(live)
    with trainer.ema_weights():
        assert all(torch.equal(p, averages[n]) for n, p in trainer.trainable_state().items())
    assert all(torch.equal(p, live[n]) for n, p in trainer.trainable_state().items())
    assert any(not torch.equal(live[n], averages[n]) for n in live)


def test_sample_grids_are_written_without_rescoring(tiny_model, tmp_path):
    calls = []

    class Counting:
        name = "counting_brightness"

        def __call__(self, images, prompts, metadata):
            calls.append(len(images))
            return images.mean(dim=(1, 2, 3))

    register_reward("counting_brightness", Counting, overwrite=True)
    try:
        make_trainer(tiny_model, tmp_path / "run", **{"reward.rewards": "[{name: counting_brightness}]",
                                                       "train.iterations": 2, "train.sample_every": 1}).train()
    finally:
        REWARDS.unregister("counting_brightness")
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == \
        ["iteration-000000.png", "iteration-000001.png"]
    assert calls == [8, 8]  # one scoring pass per iteration, none for the grids


def test_tag_balanced_prompt_sampling_gives_every_tag_equal_mass():
    from flowalign.data.prompts import prompt_weights

    prompts = [{"prompt": f"p{i}", "tag": "a"} for i in range(9)] + [{"prompt": "q", "tag": "b"}, {"prompt": "r"}]
    weights = prompt_weights(prompts, "tag_balanced")
    assert weights.sum() == pytest.approx(1.0)
    assert weights[:9].sum() == pytest.approx(1 / 3) and weights[9] == pytest.approx(1 / 3)
    assert weights[10] == pytest.approx(1 / 3)  # untagged prompts form one group of their own
    assert prompt_weights(prompts, "uniform") is None
    with pytest.raises(ConfigError, match="data.prompt_sampling"):
        load_config(TrainConfig, overrides=["data.prompt_sampling=by_tag"])


# ------------------------------------------------------------------------------------------------- trees
def _credited(trainer, iteration=0):
    from flowalign.training.scoring import score_iteration

    prompts = trainer.prompts.prompts_for(iteration)
    chunks = trainer.rollout(iteration, prompts)
    scores = score_iteration(trainer, chunks)
    steps = trainer.parts.trained_steps(chunks[0].rollout.transitions, trainer.config.train.seed, iteration)
    nfe, _ = trainer.assign_credit(iteration, chunks, scores, steps)
    return chunks, scores, nfe


def test_tree_rollouts_train_with_ratio_one_and_count_nfes(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path / "run", **TREE, **{"train.iterations": 2, "optim.minibatches": 3})
    history = trainer.train()
    for metrics in history:
        # 2 trees x (1 + 2 + 4 + 4) evaluations, against 8 x 4 = 32 for independent trajectories
        assert metrics["nfe"] == 2 * 11
        assert metrics["first_ratio_max"] == 1.0 and metrics["first_ratio_mean"] == 1.0
        assert metrics["skipped"] == 0.0
    assert any(m["ratio_max"] > 1.0 for m in history)


def test_tree_credit_gives_edges_their_childs_depthwise_advantage(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path / "run", **TREE, **{"credit.width_prune": "top",
                                                                     "credit.width_prune_fraction": 0.5})
    chunks, scores, _ = _credited(trainer)
    chunk = chunks[0]
    result, t = chunk.rollout, chunk.rollout.transitions
    leaf_rewards = scores.combined[:4].double()  # sampling.batch_size 4: one tree per chunk
    _, expected = tree_advantages(result.parents, leaf_rewards)
    torch.testing.assert_close(chunk.advantages, expected[t.dst].float())
    # Width pruning after the last split (step 1): of each pair of siblings only the better branch is trained.
    last = (t.step >= 1) & t.stochastic  # step 3 is the final ODE step, never trained
    assert int((chunk.weights[last] > 0).sum()) == int(last.sum()) // 2
    assert torch.all(chunk.weights[t.step == 0] == 1.0) and torch.all(chunk.weights[~t.stochastic] == 0.0)


def test_tree_nan_leaves_are_not_trained(tiny_model, tmp_path):
    class FirstNaN:
        name = "first_nan"

        def __call__(self, images, prompts, metadata):
            scores = images.mean(dim=(1, 2, 3))
            scores[0] = float("nan")
            return scores

    register_reward("first_nan", FirstNaN, overwrite=True)
    try:
        trainer = make_trainer(tiny_model, tmp_path / "run", **TREE, **{"reward.rewards": "[{name: first_nan}]"})
        chunks, _, _ = _credited(trainer)
    finally:
        REWARDS.unregister("first_nan")
    t = chunks[0].rollout.transitions
    # From the last split (step 1) on, the edges leading only to leaf 0 are not trained; the step-0 edge above it
    # also leads to the valid leaf 1 and is.
    weights = chunks[0].weights
    only_leaf_0 = (t.sample_id == 0) & (t.step >= 1)
    assert torch.all(weights[only_leaf_0] == 0)
    assert torch.all(weights[(t.step <= 2) & ~only_leaf_0] == 1.0)
    assert torch.isfinite(chunks[0].advantages).all()


def test_tree_resume_matches_an_uninterrupted_run(tiny_model, tmp_path):
    make_trainer(tiny_model, tmp_path / "full", **TREE, **{"train.iterations": 3}).train()
    make_trainer(tiny_model, tmp_path / "part", **TREE, **{"train.iterations": 1}).train()
    make_trainer(tiny_model, tmp_path / "part", **TREE, **{"train.iterations": 3, "train.resume": "latest"}).train()
    a = load_file(str(final_checkpoint(tmp_path / "full") / "trainable.safetensors"))
    b = load_file(str(final_checkpoint(tmp_path / "part") / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------- probes and step rewards
def test_probe_groups_are_normalised_per_prompt_and_step_with_noise_aware_weights(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path / "run", **{
        "rollout.name": "probe", "rollout.probe_steps": "[0, 2]", "sampling.batch_size": 8,
        "step_weighting.name": "noise_aware"})
    chunks, scores, _ = _credited(trainer)
    t = chunks[0].rollout.transitions
    assert len(t) == 8 and sorted(set(t.step.tolist())) == [0, 2]
    for group in t.group_id.unique():
        members = t.group_id == group
        assert int(members.sum()) == 4 and len(set(t.step[members].tolist())) == 1
        assert abs(float(chunks[0].advantages[members].mean())) < 1e-5
    weights = chunks[0].weights
    assert abs(float(weights.mean()) - 1.0) < 1e-5  # every probe edge is trained; mean weight 1
    assert weights[t.step == 0].mean() > weights[t.step == 2].mean()  # more noise, more weight


@pytest.mark.parametrize("estimator", ["dense", "return_to_go", "turning_point"])
def test_step_reward_estimators_give_per_step_group_normalised_advantages(tiny_model, tmp_path, estimator):
    trainer = make_trainer(tiny_model, tmp_path / "run", **{"credit.name": estimator})
    chunks, _, nfe = _credited(trainer)
    # sampling.num_steps 4: completions from x_0..x_3 cost 4 + 3 + 2 + 1 evaluations per sample (8 samples); dense
    # needs every state, return-to-go only the trained steps' sources (x_0, x_1, x_2), and so do the released turning
    # points (x_3 completes to the final image, whose reward is R_T).
    assert nfe == 8 * (10 if estimator == "dense" else 9)
    for chunk in chunks:
        t = chunk.rollout.transitions
        trained = chunk.weights > 0
        assert torch.equal(trained, t.stochastic)  # brightness is always finite
        for key in (t.group_id * 4 + t.step)[trained].unique():
            members = ((t.group_id * 4 + t.step) == key) & trained
            assert abs(float(chunk.advantages[members].mean())) < 1e-5


def test_calibrate_writes_a_config_train_accepts(tiny_model, tmp_path):
    out = tmp_path / "calibrated.yaml"
    args = overrides(tiny_model, tmp_path / "cal", **{"train.iterations": 1})
    result = subprocess.run([str(BIN / "flowalign"), "prep", "calibrate", *args, "--rounds", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# flowalign calibrate") and "# round 1:" in text
    config = load_config(TrainConfig, out, [])
    table = config.sampling.noise_table
    assert len(table) == 4 and table[-1] == 0.0
    # two rounds of +-0.01 from 0.7 on each stochastic step
    assert all(round(level, 4) in (0.68, 0.7, 0.72) for level in table[:-1])
    bad = subprocess.run([str(BIN / "flowalign"), "train", str(out), "sampling.num_steps=5"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "sampling.noise_table has 4 entries but sampling.num_steps = 5" in bad.stderr


@pytest.mark.slow
def test_calibration_on_two_processes_gathers_every_trajectory_and_matches_one_process(tiny_model, tmp_path, capsys):
    from flowalign import cli

    args = [*overrides(tiny_model, tmp_path / "cal", **{"train.iterations": 1}), "--rounds", "2"]
    outs = {n: tmp_path / f"calibrated-{n}.yaml" for n in (1, 2)}
    two = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "flowalign.cli",
                            "prep", "calibrate", *args, "--out", str(outs[2])],
                           env={**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # meanwhile one process, this one, under the deprecated name: the same command
        assert cli.main(["calibrate", *args, "--out", str(outs[1])]) == 0
    finally:
        _, stderr = two.communicate(timeout=600)
    assert two.returncode == 0, stderr[-2000:]
    assert "deprecated: use `flowalign prep calibrate`" in capsys.readouterr().err
    assert "deprecated" not in stderr
    one, two = (outs[n].read_text() for n in (1, 2))
    assert one == two  # the same counts of dR > 0 and dR < 0 per step in every round: all 8 trajectories each
    assert "# round 0:" in one and load_config(TrainConfig, outs[2], []).sampling.noise_table


def test_rg_opd_reward_kwargs_reach_its_constructor_before_the_model_loads(tmp_path):
    settings = {"loss.rg_opd.weight": 1, "loss.rg_opd.reward": "brightness", "loss.rg_opd.reward_kwargs": "{channel: 7}"}
    config = load_config(TrainConfig, None, overrides(tmp_path / "no-model", tmp_path / "run", **settings))
    with pytest.raises(SetupError, match="brightness channel must be 0, 1, 2 or None"):
        Trainer(config)
    with pytest.raises(ConfigError, match="loss.rg_opd.reward_kwargs are the constructor arguments of reward"):
        load_config(TrainConfig, None, overrides(tmp_path, tmp_path, **{"loss.rg_opd.reward_kwargs": "{channel: 0}"}))
