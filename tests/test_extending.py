"""Extending flowalign from outside the package: a reward, a credit estimator, a loss term and an objective are
defined in this file, registered through the public API, named in a config, and run through the trainer for 2
iterations, and a guided sampler runs through ``flowalign sample`` for one prompt; neither the trainer nor the sample
command is edited (more on samplers: tests/test_samplers_registry.py)."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import flowalign
from flowalign.components import ComponentConfig
from flowalign.credit import Credit, CreditEstimator
from flowalign.inference import GuidedSampler
from flowalign.losses import LossTerm
from flowalign.objectives import DataUnit, Objective
from flowalign.settings import check, option

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ the new parts
class RedReward:
    """Mean red channel: a reward is any callable (images, prompts, metadata) -> one score per image."""

    def __call__(self, images, prompts, metadata):
        return images[:, 0].flatten(1).mean(dim=1)


class RedRank:
    """A groupwise reward: each image's rank of redness within its group, in [0, 1]; called once per group."""

    groupwise = True
    calls: list[int] = []

    def __call__(self, images, prompts, metadata):
        RedRank.calls.append(len(images))
        red = images[:, 0].flatten(1).mean(dim=1)
        return red.argsort().argsort().float() / (len(red) - 1)


@dataclass
class RankCreditConfig(ComponentConfig):
    scale: float = option(1.0, "advantage of the best image of a group")

    def validate(self):
        check(self.scale > 0, "scale", f"must be > 0, got {self.scale}")


class RankCredit(CreditEstimator):
    """Every transition gets its trajectory's centred rank within its group, in [-scale, scale]."""

    shapes = ("group",)
    whole_prompts = True  # ranks are taken within a batch, so a batch holds whole groups

    def assign(self, batch, scores, context):
        t = batch.rollout.transitions
        group = batch.sample_ids // context.config.data.group_size
        ranks = torch.zeros(len(group))
        for g in group.unique():
            members = (group == g).nonzero().flatten()
            order = scores.combined[members].argsort().argsort().float()
            ranks[members] = self.config.scale * (2 * order / (len(members) - 1) - 1)
        return Credit(ranks[t.sample_id], stats={"credit/rank_abs_mean": float(ranks.abs().mean())})


@dataclass
class SpeedConfig(ComponentConfig):
    weight: float = option(1e-3, "weight of the penalty")


class SpeedPenalty(LossTerm):
    """weight * mean_n w_n |v_n|^2: a penalty on the policy's velocity, read from the one policy forward."""

    def loss(self, micro, policy):
        per = policy.v.float().pow(2).flatten(1).mean(dim=1)
        value = (per * micro.weights).sum() / micro.weights.sum().clamp_min(1e-8)
        return self.config.weight * value, {"speed": float(value.detach())}


@dataclass
class AnchorConfig(ComponentConfig):
    weight: float = option(0.5, "weight of the anchor loss")
    units: int = option(2, "data units per iteration (over all processes)")
    batch: int = option(2, "samples per unit")


class AnchorObjective(Objective):
    """Keep the policy's velocity at random noisy latents close to the reference's: weight * |v - v_ref|^2."""

    needs_reference = True

    def units(self, iteration, context):
        model, made = context.model, []
        for k in range(self.config.units):
            g = context.generator(k)
            x = torch.randn(model.latent_shape(self.config.batch, context.config.sampling.image_size), generator=g)
            sigma = torch.rand(self.config.batch, generator=g) * 0.8 + 0.1
            cond = model.encode(["a red circle"] * self.config.batch)
            made.append(DataUnit(x.to(context.device), sigma.to(context.device), cond, {"unit": k}))
        return context.shard(made)

    def loss(self, unit, policy):
        value = (policy.v.float() - policy.v_ref.float()).pow(2).mean()
        return self.config.weight * value, {"anchor": float(value.detach())}


@dataclass
class EulerConfig(ComponentConfig):
    shrink: float = option(1.0, "scale of the initial noise")


class ShrunkNoiseODE(GuidedSampler):
    """One ODE sample per prompt from shrunk initial noise (a toy of a guided sampler: no guidance at all)."""

    def sample(self, problem):
        from flowalign.samplers.guided import GuidedResult, initial_noise
        from flowalign.samplers.sde import ode_step

        rows = torch.arange(len(problem.generators), device=problem.device)
        x = self.config.shrink * initial_noise(problem.shape, problem.generators, rows, problem.device)
        with torch.no_grad():
            for i in range(problem.sigmas.numel() - 1):
                x = ode_step(x, problem.velocity(x, problem.sigmas[i], rows), problem.sigmas[i], problem.sigmas[i + 1])
            scores = problem.reward(x, rows).double().cpu()
        nfe = (problem.sigmas.numel() - 1) * problem.evals_per_sample
        return GuidedResult(final=x, reward=scores, nfe=torch.full((len(rows),), nfe, dtype=torch.long))


@pytest.fixture(scope="module")
def registered():
    """Register the parts (as a user's package would at import) and remove them afterwards."""
    from flowalign.credit import CREDIT
    from flowalign.losses import LOSSES
    from flowalign.objectives import OBJECTIVES
    from flowalign.inference import SAMPLERS
    from flowalign.rewards import REWARDS

    flowalign.register_reward("red", RedReward)
    flowalign.register_reward("red_rank", RedRank)
    flowalign.register_credit("rank", RankCredit, config=RankCreditConfig)
    flowalign.register_loss("speed", SpeedPenalty, config=SpeedConfig)
    flowalign.register_objective("anchor", AnchorObjective, config=AnchorConfig)
    flowalign.register_sampler("shrunk_ode", ShrunkNoiseODE, config=EulerConfig)
    yield
    REWARDS.unregister("red")
    REWARDS.unregister("red_rank")
    CREDIT.unregister("rank")
    LOSSES.unregister("speed")
    OBJECTIVES.unregister("anchor")
    SAMPLERS.unregister("shrunk_ode")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    words = sorted({w for e in train + test for w in e["prompt"].split()})
    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    tiny_sd3_pipeline(words, seed=0).save_pretrained(path)
    return path


def _config(model, out, *extra):
    base = [f"model.path={model}", "model.lora_rank=4", "model.lora_alpha=8", "data.prompts_per_iteration=2",
            "data.group_size=4", "sampling.num_steps=4", "sampling.batch_size=4", "sampling.window_size=2",
            "sampling.window_last=1", f"data.train_prompts={REPO / 'assets/prompts/train.jsonl'}", "optim.lr=3e-3",
            "train.iterations=2", "train.tracker=none", "train.eval_at_end=false", "train.sample_every=0",
            f"train.out_dir={out}"]
    return flowalign.load_config(flowalign.TrainConfig, None, base + list(extra))


def test_every_new_part_runs_through_the_trainer(registered, tiny_model, tmp_path):
    config = _config(tiny_model, tmp_path / "run", "reward.rewards=[{name: red}]", "credit.name=rank",
                     "credit.scale=2.0", "loss.speed.weight=1e-3", "objectives.anchor.weight=0.5")
    assert config.credit.scale == 2.0 and list(config.loss) == ["grpo", "speed"] and list(config.objectives) == [
        "anchor"]
    trainer = flowalign.Trainer(config)
    history = trainer.train()
    assert len(history) == 2
    for metrics in history:
        assert "rewards/red/mean" in metrics
        assert metrics["credit/rank_abs_mean"] > 0  # the estimator's advantages reached the metrics
        assert metrics["speed"] > 0 and metrics["objectives/anchor/anchor"] >= 0
        assert metrics["first_ratio_max"] == 1.0  # the loss terms share one forward: still exactly 1
    assert history[0]["objectives/anchor/anchor"] == 0.0  # the LoRA starts at zero: policy = reference
    assert history[1]["objectives/anchor/anchor"] > 0.0  # after an update it moved


def test_a_groupwise_reward_scores_one_group_at_a_time(registered, tiny_model, tmp_path):
    RedRank.calls.clear()
    config = _config(tiny_model, tmp_path / "run", "reward.rewards=[{name: red_rank}]", "train.iterations=1")
    (metrics,) = flowalign.Trainer(config).train()
    assert RedRank.calls == [4, 4]  # 2 prompts x a group of 4
    assert metrics["rewards/red_rank/mean"] == pytest.approx(0.5)  # ranks 0, 1/3, 2/3, 1 in every group


def test_a_new_parts_settings_are_checked_by_the_loader(registered, tiny_model, tmp_path):
    from flowalign.config import ConfigError

    with pytest.raises(ConfigError, match=r"credit.scale must be > 0"):
        _config(tiny_model, tmp_path, "credit.name=rank", "credit.scale=0")
    with pytest.raises(ConfigError, match=r"did you mean 'credit.scale'"):
        _config(tiny_model, tmp_path, "credit.name=rank", "credit.sacle=1")
    with pytest.raises(ConfigError, match=r"accepts rollout shapes 'group'"):
        _config(tiny_model, tmp_path, "credit.name=rank", "rollout.name=probe", "rollout.probe_steps=[0]")


def test_reward_callables_and_a_model_object_go_straight_to_the_trainer(tiny_model, tmp_path):
    from flowalign.models import load_flow_model

    model = load_flow_model(str(tiny_model))
    config = _config(tiny_model, tmp_path / "run", "train.iterations=1")
    trainer = flowalign.Trainer(config, rewards=[RedReward()], model=model)
    assert trainer.model is model and [name for name, _, _ in trainer.rewards] == ["RedReward"]
    (metrics,) = trainer.train()
    assert "rewards/RedReward/mean" in metrics


def test_a_new_guided_sampler_runs_through_flowalign_sample(registered, tiny_model, tmp_path):
    import json

    from flowalign.cli import main

    out = tmp_path / "sample"
    assert main(["sample", "--guidance", "shrunk_ode", "--shrink", "0.5", "--steps", "2", "--budget", "2",
                 "--max-prompts", "1", "--model", str(tiny_model), "--out", str(out), "--reward", "brightness"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["sampler"] == {"name": "shrunk_ode", "shrink": 0.5}
    assert [row["nfe"] for row in results["results"]] == [2] and (out / "images" / "0000.png").is_file()
