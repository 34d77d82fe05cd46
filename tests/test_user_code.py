"""User code from the config: a component section's ``name``, or a reward's, may be ``module.path:ClassName`` or
``path/to/file.py:ClassName`` (flowalign.user_code, Registry.resolve). The classes here live in files written to
``tmp_path``, outside the package, and nothing is registered by hand: a reward, a credit estimator and an objective
train 2 iterations through ``flowalign train`` from a YAML file, and the run resumes from its saved config.yaml alone.
The mistakes are ConfigErrors from the loader, so they arrive before any model loads (the configs name a model path
that does not exist)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowalign.config import ConfigError, load_config
from flowalign.credit import CREDIT, CreditEstimator
from flowalign.objectives import OBJECTIVES
from flowalign.rewards import REWARDS
from flowalign.training.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

REWARD_FILE = '''
class RedReward:
    """Mean red channel."""

    name = "red"

    def __init__(self, channel: int = 0):
        self.channel = channel

    def __call__(self, images, prompts, metadata):
        return images[:, self.channel].flatten(1).mean(dim=1)


class Plain:
    """A reward without a constructor of its own: it takes no settings."""

    name = "plain"

    def __call__(self, images, prompts, metadata):
        return images.flatten(1).mean(dim=1)
'''

PARTS_FILE = '''
from dataclasses import dataclass
from pathlib import Path

import torch

from flowalign.components import ComponentConfig
from flowalign.credit import Credit, CreditEstimator
from flowalign.objectives import DataUnit, Objective
from flowalign.settings import check, option

with open(Path(__file__).with_suffix(".runs"), "a") as runs:  # one line each time this file is executed
    runs.write("ran\\n")


@dataclass
class RankCreditConfig(ComponentConfig):
    scale: float = option(1.0, "advantage of the best image of a group")

    def validate(self):
        check(self.scale > 0, "scale", f"must be > 0, got {self.scale}")


class RankCredit(CreditEstimator):
    """Every transition gets its trajectory's centred rank within its group, in [-scale, scale]."""

    config_class = RankCreditConfig
    shapes = ("group",)
    whole_prompts = True

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
class AnchorConfig(ComponentConfig):
    weight: float = option(0.5, "weight of the anchor loss")
    units: int = option(2, "data units per iteration (over all processes)")
    batch: int = option(2, "samples per unit")


class AnchorObjective(Objective):
    """weight * |v - v_ref|^2 at random noisy latents."""

    config_class = AnchorConfig
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
class PlainSettings:
    scale: float = 1.0


class PlainSettingsCredit(CreditEstimator):
    """Settings that are a dataclass but no ComponentConfig (no 'name')."""

    config_class = PlainSettings


class NotACredit:
    """A class of the right name shape but no credit estimator."""
'''


def write_parts(folder: Path) -> Path:
    """``folder/parts/{rewards,training}.py``; returns ``folder``."""
    (folder / "parts").mkdir(parents=True, exist_ok=True)
    (folder / "parts" / "rewards.py").write_text(textwrap.dedent(REWARD_FILE))
    (folder / "parts" / "training.py").write_text(textwrap.dedent(PARTS_FILE))
    return folder


def write_yaml(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    words = sorted({w for e in train + test for w in e["prompt"].split()})
    path = tmp_path_factory.mktemp("model") / "tiny-sd3"
    tiny_sd3_pipeline(words, seed=0).save_pretrained(path)
    return path


def _train(args, cwd):
    return subprocess.run([str(BIN / "flowalign"), "train", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=600)


def test_a_reward_credit_and_objective_from_files_train_through_the_cli_and_resume(tiny_model, tmp_path):
    """The relative paths are read from the YAML file's folder (the command runs elsewhere); the saved config.yaml
    holds absolute paths, so the run resumes from it alone, from yet another directory."""
    project = write_parts(tmp_path / "project")
    config = write_yaml(project / "run.yaml", f"""\
        base: {REPO / 'configs/methods/flow_grpo_fast.yaml'}
        model: {{path: {tiny_model}, lora_rank: 4, lora_alpha: 8}}
        data: {{train_prompts: {REPO / 'assets/prompts/train.jsonl'}, prompts_per_iteration: 2, group_size: 4}}
        sampling: {{num_steps: 4, batch_size: 4, window_size: 2, window_last: 1}}
        reward:
          rewards: [{{name: parts/rewards.py:RedReward}}]
        credit: {{name: parts/training.py:RankCredit, scale: 2.0}}
        objectives:
          anchor: {{name: parts/training.py:AnchorObjective, weight: 0.5}}
        optim: {{lr: 3.0e-3}}
        train: {{iterations: 2, tracker: none, eval_at_end: false, sample_every: 0, out_dir: {tmp_path / 'run'}}}
        """)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = _train([config], cwd=elsewhere)
    assert result.returncode == 0, result.stderr[-3000:]

    reward = f"{project / 'parts/rewards.py'}:RedReward"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "credit/rank_abs_mean" in row]
    assert [row["iteration"] for row in rows] == [0, 1]
    for row in rows:
        assert f"rewards/{reward}/mean" in row  # the reward from the file scored the rollouts
        assert row["credit/rank_abs_mean"] > 0  # the credit estimator's advantages reached the metrics
        assert row["objectives/anchor/anchor"] >= 0  # the objective trained
    assert rows[0]["objectives/anchor/anchor"] == 0.0 and rows[1]["objectives/anchor/anchor"] > 0.0

    saved = load_config(TrainConfig, tmp_path / "run" / "config.yaml")
    assert saved.credit.name == f"{project / 'parts/training.py'}:RankCredit" and saved.credit.scale == 2.0
    assert saved.objectives["anchor"].name == f"{project / 'parts/training.py'}:AnchorObjective"
    assert saved.reward.rewards[0].name == reward

    again = tmp_path / "again"
    again.mkdir()
    resumed = _train([tmp_path / "run" / "config.yaml", "train.iterations=3", "--resume", "latest"], cwd=again)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows if "credit/rank_abs_mean" in row] == [0, 1, 2]
    # each process executed the file once, not once per lookup: the first run, this test's load_config, the resumed run
    assert (project / "parts" / "training.runs").read_text().splitlines() == ["ran"] * 3
    # nothing was registered by hand: the test process's registries never saw these classes
    assert not any(":" in name for registry in (REWARDS, CREDIT, OBJECTIVES) for name in registry.names())


def test_a_mistake_in_user_code_is_exit_status_2_naming_the_key_the_file_and_the_fix(tmp_path):
    project = write_parts(tmp_path / "project")
    config = write_yaml(project / "run.yaml", f"""\
        model: {{path: {tmp_path / 'no-model'}}}
        credit: {{name: parts/training.py:RankCredt}}
        """)
    result = _train([config, f"train.out_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "credit.name" in result.stderr and str(project / "parts/training.py") in result.stderr
    assert "did you mean 'RankCredit'?" in result.stderr and str(config) in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------ the loader's errors
def _load(tmp_path, body, *overrides):
    """Load a YAML file in ``tmp_path/project`` (which holds parts/) naming a model path that does not exist and a
    run folder under ``tmp_path`` (never the working directory's ``outputs/``): every error below comes from the
    loader, before anything could load a model."""
    project = write_parts(tmp_path / "project")
    config = write_yaml(project / "run.yaml", f"model: {{path: {tmp_path / 'no-model'}}}\n"
                        f"train: {{out_dir: {tmp_path / 'run'}}}\n" + textwrap.dedent(body))
    return load_config(TrainConfig, config, list(overrides))


def test_a_relative_path_is_read_from_the_config_files_folder_and_kept_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the config's folder
    config = _load(tmp_path, "credit: {name: parts/training.py:RankCredit, scale: 3.0}\n")
    assert config.credit.name == f"{tmp_path / 'project/parts/training.py'}:RankCredit"
    assert config.credit.scale == 3.0 and type(config.components().credit).__name__ == "RankCredit"
    assert not (tmp_path / "no-model").exists()


def test_an_override_reads_a_relative_path_from_the_current_directory(tmp_path, monkeypatch):
    write_parts(tmp_path / "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    config = _load(tmp_path, "", "credit.name=parts/training.py:RankCredit")
    assert config.credit.name == f"{tmp_path / 'cwd/parts/training.py'}:RankCredit"


def test_a_missing_file_names_the_key_the_path_and_the_folder_it_was_read_from(tmp_path):
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, "credit: {name: parts/nothing.py:RankCredit}\n")
    message = str(error.value)
    assert error.value.key == "credit.name" and message.startswith("credit.name: ")
    assert f"no file {tmp_path / 'project/parts/nothing.py'}" in message
    assert f"read from {tmp_path / 'project'}" in message and str(tmp_path / "project/run.yaml") in message


def test_a_missing_class_lists_the_modules_classes_with_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"has no class 'AnchorObjectiv'; did you mean 'AnchorObjective'\? its "
                                          r"classes are: AnchorObjective \[from"):
        _load(tmp_path, "objectives: {anchor: {name: parts/training.py:AnchorObjectiv}}\n")  # only the objectives
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\].name: .*has no class 'Red'; its classes are: "
                                          r"Plain, RedReward \["):
        _load(tmp_path, "reward: {rewards: [{name: parts/rewards.py:Red}]}\n")


def test_a_registered_name_keeps_its_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown credit estimator 'grop'.*did you mean 'group'\?"):
        _load(tmp_path, "credit: {name: grop}\n")


def test_a_class_that_is_not_its_kind_is_refused_with_the_protocol_it_lacks(tmp_path):
    with pytest.raises(ConfigError, match=r"credit.name: .*NotACredit is not a credit estimator: a credit estimator "
                                          r"subclasses flowalign.credit.*CreditEstimator"):
        _load(tmp_path, "credit: {name: parts/training.py:NotACredit}\n")
    with pytest.raises(ConfigError, match=r"objectives.anchor.name: .*RankCredit is not an objective"):
        _load(tmp_path, "objectives: {anchor: {name: parts/training.py:RankCredit}}\n")
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\].name: .*RankCredit is not a reward: it lacks "
                                          r"__call__ of the Reward protocol"):
        _load(tmp_path, "reward: {rewards: [{name: parts/training.py:RankCredit}]}\n")


def test_the_settings_of_a_class_of_ones_own_are_checked_like_a_registered_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'credit.sacle'.*did you mean 'credit.scale'\?"):
        _load(tmp_path, "credit: {name: parts/training.py:RankCredit, sacle: 2}\n")
    with pytest.raises(ConfigError, match=r"credit.scale must be > 0, got 0.0"):
        _load(tmp_path, "credit: {name: parts/training.py:RankCredit, scale: 0}\n")
    with pytest.raises(ConfigError, match=r"credit.name: .*subclassing flowalign.components.ComponentConfig"):
        _load(tmp_path, "credit: {name: parts/training.py:PlainSettingsCredit}\n")


def test_a_rewards_settings_are_checked_against_its_constructor_before_the_model_loads(tmp_path):
    import flowalign

    config = _load(tmp_path, "reward: {rewards: [{name: parts/rewards.py:RedReward, kwargs: {chanel: 1}}]}\n")
    with pytest.raises(ValueError, match=r"reward.rewards\[0\].kwargs.chanel is not a setting of the .*RedReward' "
                                         r"reward; known: channel; did you mean 'channel'\?"):
        flowalign.Trainer(config)  # its model path does not exist: the check came first
    config = _load(tmp_path, "reward: {rewards: [{name: parts/rewards.py:Plain, kwargs: {scale: 1}}]}\n")
    with pytest.raises(ValueError, match=r"kwargs.scale is not a setting of the .*Plain' reward; known: \(none\)$"):
        flowalign.Trainer(config)


def test_a_file_that_raises_is_named_with_its_error_chained(tmp_path):
    (tmp_path / "broken.py").write_text("import os\n\nraise RuntimeError('half-written file')\n")
    with pytest.raises(ConfigError, match=r"running .*broken.py, line 3 raised RuntimeError: half-written") as error:
        _load(tmp_path, f"credit: {{name: {tmp_path / 'broken.py'}:Anything}}\n")
    assert isinstance(error.value.__cause__.__cause__, RuntimeError)


def test_a_component_map_entry_is_keyed_by_a_label(tmp_path):
    with pytest.raises(ConfigError, match=r"keyed by a plain label.*objectives: \{mine: \{name: parts/training.py"):
        _load(tmp_path, "objectives: {parts/training.py:AnchorObjective: {}}\n")


def test_a_module_path_names_a_class_of_an_importable_module(tmp_path, monkeypatch):
    package = tmp_path / "site" / "my_flowalign_parts"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "credit.py").write_text(textwrap.dedent(PARTS_FILE))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    config = _load(tmp_path, "credit: {name: my_flowalign_parts.credit:RankCredit, scale: 0.5}\n")
    assert config.credit.name == "my_flowalign_parts.credit:RankCredit" and config.credit.scale == 0.5
    estimator = config.components().credit
    assert isinstance(estimator, CreditEstimator) and type(estimator).__module__ == "my_flowalign_parts.credit"
    with pytest.raises(ConfigError, match=r"no module named 'my_flowalign_partz'.*PYTHONPATH"):
        _load(tmp_path, "credit: {name: my_flowalign_partz.credit:RankCredit}\n")


def test_a_file_runs_once_per_process_and_every_lookup_gets_the_same_class(tmp_path):
    first = _load(tmp_path, "credit: {name: parts/training.py:RankCredit}\n")
    second = _load(tmp_path, "credit: {name: parts/training.py:RankCredit, scale: 2.0}\n")
    assert first.credit.name == second.credit.name
    assert type(first.components().credit) is type(second.components().credit) is CREDIT.get(first.credit.name)
    assert (tmp_path / "project/parts/training.runs").read_text().splitlines() == ["ran"]
    assert first.credit.name in CREDIT and first.credit.name not in CREDIT.names()


def test_a_registrys_protocol_is_given_or_inferred_from_its_registered_classes():
    from flowalign.rewards import Reward

    assert CREDIT.protocol is CreditEstimator and REWARDS.protocol is Reward
    assert OBJECTIVES.protocol.__name__ == "Objective"


def test_flowalign_samples_guided_sampler_may_be_a_class_of_ones_own(tmp_path, monkeypatch):
    from flowalign.cli import parse_command

    (tmp_path / "guided.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass

        from flowalign.components import ComponentConfig
        from flowalign.inference import GuidedSampler


        @dataclass
        class ShrinkSettings(ComponentConfig):
            shrink: float = 1.0


        class Shrunk(GuidedSampler):
            config_class = ShrinkSettings
        '''))
    monkeypatch.chdir(tmp_path)  # --guidance is a command-line option: a relative path is read from here
    _, config = parse_command(["sample", "--guidance", "guided.py:Shrunk", "sampler.shrink=0.5", "--model",
                               str(tmp_path / "no-model")])
    assert config.sampler.name == f"{tmp_path / 'guided.py'}:Shrunk" and config.sampler.shrink == 0.5
    with pytest.raises(ConfigError, match=r"sampler.name: .*has no class 'Shrnk'; did you mean 'Shrunk'\?"):
        parse_command(["sample", "--guidance", "guided.py:Shrnk", "--model", str(tmp_path / "no-model")])


def test_a_registry_resolves_a_reference_wherever_a_name_is_looked_up(tmp_path, monkeypatch):
    """``in``, ``get`` and ``build`` take a reference too (a reward named in a component's settings, ``flowalign
    sample --reward``): a relative path is then read from the current directory; ``names()`` stays the registered
    names."""
    write_parts(tmp_path)
    monkeypatch.chdir(tmp_path)
    count = len(REWARDS)
    assert "parts/rewards.py:RedReward" in REWARDS and "parts/rewards.py:Nothing" not in REWARDS
    assert "parts/nothing.py:RedReward" not in REWARDS and "parts/training.py:RankCredit" not in REWARDS
    reward = REWARDS.build("parts/rewards.py:RedReward", channel=1)
    assert type(reward).__name__ == "RedReward" and reward.channel == 1
    absolute = f"{tmp_path / 'parts/rewards.py'}:RedReward"
    assert REWARDS.get(absolute) is type(reward) and len(REWARDS) == count and absolute not in REWARDS.names()
    REWARDS.unregister(absolute)
    assert absolute in REWARDS  # loaded again from the file the module cache holds
