"""Configs and checkpoints from before the component redesign: every moved key loads through the migration (with a
one-line notice), and a checkpoint written by the pre-redesign trainer resumes and continues bitwise like the
uninterrupted pre-redesign run (tests/golden/pre_redesign, written with the code of commit 7f24f60)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from flowalign.config import load_config, to_dict
from flowalign.errors import SetupError
from flowalign.training.config import TrainConfig
from flowalign.training.migration import migrate_layer

from golden_runs import REPO, _optimizer_digest, _tensors_digest, fingerprint, small_run_values, torch_threads

PRE = Path(__file__).parent / "golden" / "pre_redesign"

# The method presets as they were written before the redesign (their comments left out).
OLD_PRESETS = {
    "branch_grpo": "base: flow_grpo.yaml\ndata: {group_size: 16}\nrollout: {shape: tree, split_steps: [0, 2, 4, 6], "
                   "branching: [2], split_noise_scale: 1.0, fusion: mean}\n",
    "dance_grpo": "base: flow_grpo.yaml\nsampling: {kind: dance, noise_level: 0.3, shared_noise: true, "
                  "train_steps_per_rollout: 5}\n",
    "dense_grpo": "base: flow_grpo.yaml\nstep_reward: {estimator: dense, clean: ode, ode_steps: null}\n",
    "register_grpo": "base: flow_grpo.yaml\nstep_reward: {estimator: registers, registers: "
                     "outputs/registers/registers.pt, register_pass: policy}\n",
    "tempflow_grpo": "base: flow_grpo.yaml\ndata: {group_size: 8}\nrollout: {shape: probe, probe_steps: [0, 2, 4, 6]}\n"
                     "loss: {step_weighting: noise_aware}\n",
    "tp_grpo": "base: flow_grpo.yaml\nsampling: {kind: cps, noise_level: 0.7}\nstep_reward: {estimator: turning_point, "
               "clean: ode, ode_steps: null, balanced: true}\n",
}
OLD_FLOW_GRPO = ("data: {group_size: 16}\nrollout: {shape: group}\nsampling: {window_size: null, window_start: fixed, "
                 "window_first: 0, window_last: null, kind: flow_grpo, noise_level: 0.7}\n"
                 "loss: {clip_range: 1.0e-4, step_weighting: uniform}\n")


@pytest.mark.parametrize("name", sorted(OLD_PRESETS))
def test_every_old_preset_loads_as_the_new_one(name, tmp_path, caplog):
    (tmp_path / "flow_grpo.yaml").write_text(OLD_FLOW_GRPO)
    (tmp_path / f"{name}.yaml").write_text(OLD_PRESETS[name])
    with caplog.at_level("WARNING", logger="flowalign.config"):
        old = load_config(TrainConfig, tmp_path / f"{name}.yaml")
    new = "tp_grpo_paper" if name == "tp_grpo" else name  # old turning-point configs ran the paper's reading
    assert to_dict(old) == to_dict(load_config(TrainConfig, REPO / "configs/methods" / f"{new}.yaml"))
    notices = [r.getMessage() for r in caplog.records if "moved" in r.getMessage()]
    assert notices and all(message.count("\n") == 0 for message in notices)  # one line each


def test_a_turning_point_config_saved_before_credit_semantics_loads_as_the_paper_variant(tmp_path, caplog):
    """A config.yaml written before credit.semantics existed (its credit section: name, clean, ode_steps, balanced)
    ran the paper's reading: it loads as tp_grpo_paper, so its checkpoints resume with the same math."""
    from flowalign.config import save_config
    from flowalign.credit.tp_grpo import RELEASED_OPTIONS

    paper = load_config(TrainConfig, REPO / "configs/methods/tp_grpo_paper.yaml")
    save_config(paper, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    for key in ("process_rewards", *RELEASED_OPTIONS):
        del saved["credit"][key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with caplog.at_level("WARNING", logger="flowalign.config"):
        assert to_dict(load_config(TrainConfig, tmp_path / "config.yaml")) == to_dict(paper)
    assert any("credit.process_rewards = paper" in r.getMessage() for r in caplog.records)
    # a partial section (an override) is not guessed at: credit.balanced alone is the paper variant's, refused
    with pytest.raises(SetupError, match="credit.balanced is the paper variant's setting"):
        load_config(TrainConfig, REPO / "configs/methods/tp_grpo.yaml", ["credit.balanced=true"])


@pytest.mark.parametrize("old, new", [
    (["loss.beta=0.04", "loss.kl=velocity_mse"], ["loss.grpo.beta=0.04", "loss.grpo.kl=velocity_mse"]),
    (["rollout.shape=tree", "rollout.split_steps=[0, 1]", "rollout.width_prune=top", "data.group_size=4"],
     ["rollout.name=tree", "credit.name=tree", "rollout.split_steps=[0, 1]", "credit.width_prune=top",
      "data.group_size=4"]),
    (["sampling.train_steps_per_rollout=3"], ["step_selection.name=random_subset", "step_selection.count=3"]),
    (["loss.rg_opd_weight=0.5", "loss.rg_opd_reward=toy_geneval_soft"],
     ["loss.rg_opd.weight=0.5", "loss.rg_opd.reward=toy_geneval_soft"]),
    (["step_reward.estimator=turning_point", "step_reward.balanced=true"],
     ["credit.name=turning_point", "credit.process_rewards=paper", "credit.balanced=true"]),
])
def test_old_command_line_keys_land_on_their_components(old, new):
    every_step = ["sampling.window_size=null", "sampling.window_start=fixed", "sampling.window_last=null"]
    assert to_dict(load_config(TrainConfig, None, every_step + old)) == to_dict(
        load_config(TrainConfig, None, every_step + new))


def test_a_resolved_old_config_drops_the_settings_of_shapes_it_does_not_use():
    layer = {"rollout": {"shape": "group", "split_steps": [0, 2], "fusion": "mean", "probe_steps": [0]},
             "step_reward": {"estimator": "terminal", "clean": "ode", "registers": None},
             "sampling": {"train_steps_per_rollout": None},
             "loss": {"clip_range": 1e-4, "beta": 0.0, "rg_opd_weight": 0.0, "rg_opd_bands": [[0.8, 0.3]]}}
    migrated, notices = migrate_layer(layer)
    assert migrated["rollout"] == {"name": "group"} and migrated["credit"] == {"name": "group"}
    assert "step_selection" not in migrated and migrated["loss"] == {"grpo": {"clip_range": 1e-4, "beta": 0.0},
                                                                     "rg_opd": None}
    assert len(notices) == 1
    assert migrate_layer({"optim": {"lr": 1e-3}}) == ({"optim": {"lr": 1e-3}}, [])


def test_rg_opd_on_registers_takes_the_old_shared_register_checkpoint():
    migrated, _ = migrate_layer({"step_reward": {"estimator": "registers", "registers": "r.pt"},
                                 "loss": {"rg_opd_weight": 1.0}})
    assert migrated["credit"] == {"name": "registers", "registers": "r.pt"}
    assert migrated["loss"]["rg_opd"] == {"weight": 1.0, "registers": "r.pt"}


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    words = sorted({w for e in train + test for w in e["prompt"].split()})
    path = tmp_path_factory.mktemp("pre") / "sd3"
    tiny_sd3_pipeline(words, seed=0).save_pretrained(path)
    return path


def _resume(name, checkpoint, model, run, record, *, new_format):
    from flowalign.config import save_config
    from flowalign.training.trainer import Trainer

    shutil.copytree(checkpoint, run / "checkpoint-000001")
    config_file = run / "checkpoint-000001" / "config.yaml"
    config_file.write_text(config_file.read_text().replace("@MODEL@", str(model)).replace("@OUT@", str(run)))
    assert "shape:" in config_file.read_text()  # written with the old schema
    if new_format:  # the same checkpoint with its config written the new way
        save_config(load_config(TrainConfig, config_file), config_file)
        assert "shape:" not in config_file.read_text()
    values = {**small_run_values(model, run), **record["runs"][name]["settings"], "train.checkpoint_every": 1,
              "train.iterations": 2, "data.train_prompts": "assets/prompts/train.jsonl", "train.resume": "latest"}
    with torch_threads(1):
        trainer = Trainer(load_config(TrainConfig, REPO / "configs/methods" / f"{name}.yaml",
                                          [f"{k}={v}" for k, v in values.items()]))
        assert trainer.iteration == 1
        trainer.train()
    optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    weights = {n: p.detach().cpu() for n, p in trainer.trainable_state().items()}
    return {"weights": _tensors_digest(weights), "ema": _tensors_digest(trainer.ema.state_dict()),
            "optimizer": _optimizer_digest(optimizer.state_dict())}


@pytest.mark.parametrize("name", ["branch_grpo", "dance_grpo"])
def test_a_pre_redesign_checkpoint_resumes_like_the_uninterrupted_old_run(name, tiny_sd3, tmp_path):
    record = json.loads((PRE / "record.json").read_text())
    digests = _resume(name, PRE / name, tiny_sd3, tmp_path / "old", record, new_format=False)
    # On any machine: resuming through the migration is bitwise resuming the same checkpoint in the new format.
    assert digests == _resume(name, PRE / name, tiny_sd3, tmp_path / "new", record, new_format=True)
    if fingerprint() == record["fingerprint"]:  # the platform the old run was recorded on: the old run, bitwise
        assert digests == record["runs"][name]["digests"]


@pytest.mark.parametrize("old, new", [("released", "released_code"), ("paper", "paper")])
def test_the_old_credit_semantics_key_loads_as_process_rewards_with_a_warning(old, new, tmp_path, caplog):
    """``credit.semantics: released | paper`` (before 0.2) is ``credit.process_rewards: released_code | paper``: a YAML
    file and a command line with the old key load as the new one, with a one-line warning naming both."""
    preset = "tp_grpo" if new == "released_code" else "tp_grpo_paper"
    expected = to_dict(load_config(TrainConfig, REPO / "configs/methods" / f"{preset}.yaml"))
    config = yaml.safe_load((REPO / "configs/methods" / f"{preset}.yaml").read_text())
    config["base"] = str(REPO / "configs/methods" / config["base"])
    config["credit"]["semantics"] = config["credit"].pop("process_rewards")
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(config))
    with caplog.at_level("WARNING", logger="flowalign.config"):
        assert to_dict(load_config(TrainConfig, tmp_path / "old.yaml")) == expected
        assert to_dict(load_config(TrainConfig, REPO / "configs/methods/tp_grpo.yaml",
                                   [f"credit.semantics={old}"] + (["credit.balanced=true"] if old == "paper" else []))
                       ) == expected
    warnings = [r.getMessage() for r in caplog.records if "credit.semantics was renamed" in r.getMessage()]
    assert len(warnings) == 2 and f"credit.process_rewards = {new}" in warnings[0]
    assert all(message.count("\n") == 0 for message in warnings)
