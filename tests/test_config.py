"""The config system: YAML + base inheritance + dotted overrides into TrainConfig, and every error it reports."""

import dataclasses
import math
import re
import textwrap

import pytest
import yaml

from flowalign.config import ConfigError, diff_configs, format_help, load_config, save_config, to_dict, validate_config
from flowalign.training.config import RewardSpec, TrainConfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Most schema tests vary the Flow-GRPO layout (SDE on every step but the last); the default run uses a 2-step window.
EVERY_STEP = REPO / "configs/methods/flow_grpo.yaml"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def load(*overrides, path=None):
    return load_config(TrainConfig, path, list(overrides))


def error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path)
    return str(info.value)


# ------------------------------------------------------------------------------------------------ defaults, schema


def test_defaults_are_the_toy_run_and_valid():
    config = load()
    assert config == TrainConfig()
    assert config.model.path == "assets/toy-sd3" and config.model.family is None
    assert config.reward.rewards == [RewardSpec("toy_geneval", 1.0, {"partial_credit": True})]
    assert config.optim.betas == [0.9, 0.999]
    assert TrainConfig().optim.betas is not TrainConfig().optim.betas  # mutable defaults are not shared
    # Flow-GRPO-Fast's random 2-step window in the high-noise half, LoRA r8 (the measured toy default)
    assert config.sampling.stochastic_steps() == 2 and config.sampling.window_start == "random"
    assert (config.model.lora_rank, config.optim.lr, config.optim.ema_decay) == (8, 5e-4, 0.99)
    assert config.data.prompt_sampling == "uniform" and config.train.iterations == 330
    fast = load(path=REPO / "configs/methods/flow_grpo_fast.yaml")
    assert fast.sampling == config.sampling  # the default run is the flow_grpo_fast preset
    assert load(path=REPO / "configs/methods/flow_grpo.yaml").sampling.stochastic_steps() == 9


def test_every_field_has_help_and_shows_in_format_help():
    text = format_help(TrainConfig)

    def walk(cls, prefix=""):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{prefix}{f.name} has no help string"
            assert f"{prefix}{f.name}" in text
            if dataclasses.is_dataclass(f.default_factory if callable(f.default_factory) else None):
                walk(f.default_factory, f"{prefix}{f.name}.")

    walk(TrainConfig)
    walk(RewardSpec, "reward.rewards[].")  # help strings only; not in format_help's dotted keys
    assert "optim.lr = 0.0005" in text


# ---------------------------------------------------------------------------------------- files, base, overrides


def test_base_inheritance_deep_merges_and_overrides_apply_last(tmp_path):
    write(
        tmp_path / "models" / "flux.yaml",
        """
        model:
          path: models/flux-dev
          family: flux
          dtype: bf16
          mixed_precision: bf16
        optim:
          lr: 1e-4
          betas: [0.9, 0.99]
        """,
    )
    write(
        tmp_path / "methods" / "flux_fast.yaml",
        """
        base: ../models/flux.yaml
        sampling:
          window_size: 2
          window_start: random
        optim:
          lr: 3e-4          # a float under YAML 1.2 rules, a str under PyYAML's YAML 1.1
        """,
    )
    child = write(tmp_path / "run.yaml", "base: methods/flux_fast.yaml\ntrain:\n  iterations: 7\n")
    config = load("optim.weight_decay=0", "train.iterations=9", path=child)
    assert config.model.family == "flux" and config.model.dtype == "bf16"  # from the grandparent
    assert config.model.path == "models/flux-dev"
    assert config.optim.lr == 3e-4 and isinstance(config.optim.lr, float)  # child beats base
    assert config.optim.betas == [0.9, 0.99]  # a sibling key of the base survives the merge
    assert config.sampling.window_size == 2 and config.sampling.window_start == "random"
    assert config.optim.weight_decay == 0.0 and isinstance(config.optim.weight_decay, float)
    assert config.train.iterations == 9  # overrides come last
    assert config.sampling.num_steps == 10  # untouched keys keep the defaults


def test_base_errors(tmp_path):
    a = write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    assert "cycle" in error(path=a)
    lonely = write(tmp_path / "c.yaml", "base: nowhere.yaml\n")
    assert "base file 'nowhere.yaml'" in error(path=lonely)
    assert "config file not found" in error(path=tmp_path / "missing.yaml")


def test_overrides_of_every_type():
    config = load(
        "optim.lr=3e-4",  # float in exponent form
        "optim.eps=1",  # an int is accepted for a float field
        "optim.minibatches=2",  # int
        "model.gradient_checkpointing=true",  # bool
        "model.path=some/dir",  # str
        "train.out_dir=2024",  # a str field keeps the text even when it looks like a number
        "sampling.kind=dance",  # Literal
        "model.family=flux",
        "model.family=null",  # Optional: null, and the later override wins
        "model.max_sequence_length=256",  # Optional[int]
        "optim.betas=[0.8, 0.99]",  # list[float]
        "model.lora_targets=[to_q, to_k]",  # list[str]
        "sampling.noise_table=[1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0]",  # list[float] with ints
        "reward.rewards=[{name: a, weight: 2}, {name: b, kwargs: {t: 1e-3}}]",  # list of nested dataclasses
        "advantage={std: global}",  # a whole section as a mapping merges into it
    )
    assert config.optim.lr == 3e-4 and config.optim.eps == 1.0 and type(config.optim.eps) is float
    assert config.optim.minibatches == 2
    assert config.model.gradient_checkpointing is True
    assert config.model.path == "some/dir" and config.train.out_dir == "2024"
    assert config.sampling.kind == "dance" and config.model.family is None
    assert config.model.max_sequence_length == 256
    assert config.optim.betas == [0.8, 0.99] and config.model.lora_targets == ["to_q", "to_k"]
    assert config.sampling.noise_table[0] == 1.0 and all(type(x) is float for x in config.sampling.noise_table)
    assert config.reward.rewards == [RewardSpec("a", 2.0, {}), RewardSpec("b", 1.0, {"t": 1e-3})]
    assert config.advantage.std == "global" and config.advantage.clip == 5.0


def test_yaml_12_scalars(tmp_path):
    path = write(tmp_path / "x.yaml", "model:\n  mixed_precision: no\nloss:\n  grpo:\n    clip_range: 2e-4\n")
    config = load(path=path)
    assert config.model.mixed_precision == "no"  # not False, as YAML 1.1 would have it
    assert config.loss["grpo"].clip_range == 2e-4
    assert "expected a bool (true or false), got 'yes' (str)" in error("model.gradient_checkpointing=yes")


def test_empty_section_in_yaml_is_allowed(tmp_path):
    path = write(tmp_path / "x.yaml", "optim:\n  # lr: 1\n")
    assert load(path=path) == TrainConfig()


# ------------------------------------------------------------------------------------------------ errors


def test_unknown_key_in_file_names_file_and_suggests(tmp_path):
    path = write(tmp_path / "x.yaml", "optim:\n  lrr: 0.1\n")
    assert error(path=path) == f"unknown key 'optim.lrr' in {path}: did you mean 'optim.lr'?"


def test_unknown_key_in_override_and_misplaced_key():
    assert error("optim.lrr=1") == "unknown key 'optim.lrr' in override 'optim.lrr=1': did you mean 'optim.lr'?"
    assert "did you mean 'optim.lr'?" in error("lr=1")  # right name, wrong section
    assert "did you mean 'sampling.noise_level'?" in error("sampling.noise_levle=1")
    message = error("zzz=1")
    assert "unknown key 'zzz'" in message and "model, data, sampling" in message
    assert "unknown key 'reward.rewards[0].nmae'" in error("reward.rewards=[{nmae: x}]")
    assert "did you mean 'reward.rewards[0].name'?" in error("reward.rewards=[{nmae: x}]")


def test_wrong_types(tmp_path):
    assert error("optim.lr=fast") == "optim.lr: expected a float, got 'fast' (str) [from override 'optim.lr=fast']"
    path = write(tmp_path / "x.yaml", "optim:\n  lr: fast\n")
    assert error(path=path) == f"optim.lr: expected a float, got 'fast' (str) [from {path}]"
    assert "optim.lr: expected a float, got True (bool)" in error("optim.lr=true")  # bools are not numbers
    assert "optim.minibatches: expected an int, got False (bool)" in error("optim.minibatches=false")
    assert "optim.minibatches: expected an int, got 2.5 (float)" in error("optim.minibatches=2.5")
    assert "model.path: expected a str, got [1] (list)" in error("model.path=[1]")
    assert "optim.betas[1]: expected a float, got 'x' (str)" in error("optim.betas=[0.9, x]")
    assert "optim.betas: expected a list of floats, got 0.9 (float)" in error("optim.betas=0.9")
    assert "model.max_sequence_length: expected an int or null, got 'long' (str)" in error(
        "model.max_sequence_length=long"
    )
    assert "optim: expected a mapping of OptimConfig fields, got 3 (int)" in error("optim=3")
    assert "reward.rewards[0].weight: expected a float" in error("reward.rewards=[{weight: heavy}]")


def test_bad_literal_lists_allowed_values():
    message = error("sampling.window_start=randm")
    assert message.startswith("sampling.window_start: expected one of 'fixed', 'random', 'sliding', got 'randm' (str)")
    assert "did you mean 'random'?" in message
    # the SDE kinds are a registry (flowalign.kernels.sde_kinds): the same message shape, the registered kinds listed
    message = error("sampling.kind=cpss")
    assert message.startswith("sampling.kind: unknown SDE kind 'cpss': expected one of flow_grpo, dance, cps")
    assert "did you mean 'cps'?" in message
    from flowalign.models import MODEL_FAMILIES

    known = ", ".join(sorted(MODEL_FAMILIES))
    assert f"model.family = 'sdxl' is not a registered model family; known: {known}" in error("model.family=sdxl")
    assert "did you mean 'flux'?" in error("model.family=flxu")


RANGE_ERRORS = [
    (["optim.lr=0"], "optim.lr must be > 0, got 0"),
    (["optim.lr=.nan"], "optim.lr must be a finite number"),
    (["loss.grpo.clip_range=0"], "loss.grpo.clip_range must be > 0"),
    (["loss.grpo.beta=-0.1"], "loss.grpo.beta must be >= 0"),
    (["optim.ema_decay=1"], "optim.ema_decay must be in [0, 1), got 1"),
    (["optim.betas=[0.9]"], "optim.betas must hold two numbers"),
    (["optim.minibatches=0"], "optim.minibatches must be >= 1, got 0"),
    (["optim.warmup_iterations=500"], "optim.warmup_iterations = 500 exceeds train.iterations = 330"),
    (["optim.min_lr_ratio=1.5"], "optim.min_lr_ratio must be in [0, 1], got 1.5"),
    (["data.group_size=1"], "data.group_size must be >= 2"),
    (["data.prompts_per_iteration=0"], "data.prompts_per_iteration must be >= 1"),
    (["model.lora_rank=0"], "model.lora_rank must be >= 1"),
    (["model.lora_targets=[]"], "model.lora_targets must list at least one module"),
    (["model.dtype=bf16", "model.mixed_precision=fp16"], "model.mixed_precision = 'fp16' contradicts model.dtype"),
    (["sampling.noise_level=-0.1"], "sampling.noise_level must be >= 0, got -0.1"),
    (["sampling.kind=cps", "sampling.noise_level=1.2"],
     "sampling.noise_level must be in [0, 1], got 1.2 for kind 'cps'"),
    (["sampling.noise_level=0"], "sampling.noise_level leaves no stochastic step"),
    (["sampling.noise_table=[1, 1]"], "sampling.noise_table has 2 entries but sampling.num_steps = 10"),
    (["sampling.num_steps=3", "sampling.noise_table=[1, -1, 0]"], "sampling.noise_table[1] must be >= 0, got -1"),
    (["sampling.num_steps=3", "sampling.noise_table=[0, 0, 0]"], "sampling.noise_table leaves no stochastic step"),
    (["sampling.window_size=10"], "sampling.window_size must be in 1..9"),
    (["sampling.window_size=0"], "sampling.window_size must be in 1..9"),
    (["sampling.window_size=3", "sampling.window_first=7"], "can start at 0..6"),
    (["sampling.window_size=3", "sampling.window_start=random", "sampling.window_first=4", "sampling.window_last=2"],
     "sampling.window_last = 2 must be in sampling.window_first..6"),
    (["sampling.window_size=3", "sampling.window_last=2"], "sampling.window_last is only used with"),
    (["sampling.window_start=random"], "sampling.window_start = 'random' needs sampling.window_size"),
    (["sampling.num_steps=4", "sampling.noise_table=[1, 0, 1, 0]", "sampling.window_size=1",
      "sampling.window_start=random"], "rollouts would have [0, 1] stochastic steps"),
    (["step_selection.name=random_subset", "step_selection.count=10"], "step_selection.count must be in 1..9"),
    (["sampling.window_size=2", "step_selection.name=random_subset", "step_selection.count=3"], "must be in 1..2"),
    (["step_selection.name=random_subset", "step_selection.count=0"], "step_selection.count must be >= 1, got 0"),
    (["step_selection.name=random_subset", "rollout.name=probe"], "does not apply to rollout.name = 'probe'"),
    (["sampling.guidance_scale=-1"], "sampling.guidance_scale must be >= 0"),
    (["advantage.clip=0"], "advantage.clip must be in (0, inf], got 0"),
    (["reward.rewards=[]"], "reward.rewards must list at least one reward"),
    (["reward.rewards=[{weight: .inf}]"], "reward.rewards[0].weight must be finite"),
    (["train.keep_checkpoints=0"], "train.keep_checkpoints must be >= 1"),
    # trees, probes and step rewards
    (["rollout.name=tree", "credit.name=tree", "data.group_size=16", "rollout.split_steps=[0, 2, 9]"],
     "rollout.split_steps [9] are not stochastic (trained) steps"),
    (["rollout.name=tree", "credit.name=tree", "data.group_size=16", "rollout.split_steps=[2, 2]"],
     "rollout.split_steps must strictly"),
    (["rollout.name=tree", "credit.name=tree", "data.group_size=16", "rollout.split_steps=[4, 1]"],
     "rollout.split_steps must strictly"),
    (["rollout.name=tree", "credit.name=tree", "rollout.branching=[0]"], "rollout.branching[0] must be >= 1, got 0"),
    (["rollout.name=tree", "credit.name=tree", "rollout.branching=[2, 2]"],
     "rollout.branching has 2 factors for 4 split steps"),
    (["rollout.name=tree", "credit.name=tree", "data.group_size=8"],
     "data.group_size = 8 must equal the leaves of one tree"),
    (["rollout.name=tree", "credit.name=tree", "data.group_size=16", "credit.width_prune=top",
      "credit.width_prune_fraction=0"], "credit.width_prune_fraction must be in (0, 1], got 0"),
    (["rollout.name=tree", "credit.name=tree", "data.group_size=16", "credit.width_prune_fraction=1.5"],
     "credit.width_prune_fraction must be in (0, 1], got 1.5"),
    (["rollout.name=tree", "credit.name=tree", "data.group_size=16", "credit.depth_prune_steps=[12]"],
     "credit.depth_prune_steps [12] are past the last step"),
    (["rollout.name=tree", "data.group_size=16"], "rollout.name = 'tree' is not a shape credit.name = 'group' accepts "
     "('group', 'probe'); trees take credit.name = 'tree'"),
    (["credit.name=tree"], "credit.name = 'tree' accepts rollout shapes 'tree', not rollout.name = 'group'"),
    (["rollout.name=probe", "rollout.probe_steps=[0, 9]"], "rollout.probe_steps [9] are not stochastic steps"),
    (["rollout.name=probe", "rollout.probe_steps=[3, 1]"], "rollout.probe_steps must strictly increase"),
    (["rollout.name=probe", "sampling.batch_size=16"], "is not a multiple of the 64 samples of one prompt"),
    (["credit.name=dense", "reward.combine=normalize_then_sum"],
     "reward.combine must be 'sum_then_normalize' with credit.name = 'dense'"),
    (["credit.name=dense", "rollout.name=tree", "data.group_size=16"],
     "credit.name = 'dense' accepts rollout shapes 'group', not rollout.name = 'tree'"),
    (["credit.name=dense", "credit.ode_steps=0"], "credit.ode_steps must be >= 1"),
    (["credit.name=registers", "credit.register_pass=polcy"], "did you mean 'policy'"),
]


@pytest.mark.parametrize("overrides, expected", RANGE_ERRORS, ids=[o[0] for o, _ in RANGE_ERRORS])
def test_out_of_range(overrides, expected):
    message = error(*overrides, path=EVERY_STEP)
    assert expected in message
    assert "[from override" in message  # points at where the value was set


def test_a_setting_of_another_component_is_an_unknown_key():
    assert "credit estimator 'dense' has no setting 'balanced'; its settings are: clean, ode_steps" in error(
        "credit.name=dense", "credit.balanced=true")


def test_out_of_range_in_file_names_file(tmp_path):
    path = write(tmp_path / "x.yaml", "optim:\n  lr: -1\n")
    assert error(path=path) == f"optim.lr must be > 0, got -1 [from {path}]"


def test_malformed_override():
    for bad in ["optim.lr", "=3", "optim..lr=3", ".lr=3"]:
        assert error(bad).startswith(f"malformed override {bad!r}: expected key=value")
    assert error("optim.betas=[1,").startswith("malformed value in override 'optim.betas=[1,'")


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path / "x.yaml", "optim:\n  lr: 1\n  betas: [0.9, 0.99\ntrain:\n  seed: 3\n")
    message = error(path=path)
    assert message.startswith(f"malformed YAML in {path}, line ")
    bad = write(tmp_path / "y.yaml", "optim:\n  lr: 1\n   bad: indent\n")
    assert re.match(rf"malformed YAML in {re.escape(str(bad))}, line 3, column \d+: ", error(path=bad))
    not_mapping = write(tmp_path / "z.yaml", "- 1\n- 2\n")
    assert "must be a mapping" in error(path=not_mapping)


# ------------------------------------------------------------------------------------------------ batch arithmetic


def test_batch_arithmetic_one_process():
    message = error("optim.minibatches=2", "optim.minibatch_split=steps", path=EVERY_STEP)
    assert "optim.minibatches = 2 does not divide the 9 stochastic steps of the noise schedule" in message
    assert "sampling.batch_size = 5 does not divide the 64 samples per process" in error("sampling.batch_size=5")
    # the trained steps are what gets split: 4 chunks of 16 samples x 4 steps = 16 micro-batches, 8 per minibatch
    config = load("step_selection.name=random_subset", "step_selection.count=4", "sampling.batch_size=16",
                  "optim.minibatches=2", "optim.minibatch_split=steps", path=EVERY_STEP)
    layout = config.check_batch(1)
    assert (layout.transitions_per_process, layout.micro_batches_per_process, layout.micro_batches_per_minibatch) == (
        256,
        16,
        8,
    )
    assert config.check_batch(4).micro_batches_per_minibatch == 2


def test_batch_arithmetic_several_processes():
    config = load("data.prompts_per_iteration=6", "data.group_size=5", "sampling.batch_size=null", "optim.minibatches=1",
                  path=EVERY_STEP)  # 30 samples: fine on 1 process
    with pytest.raises(ConfigError, match=re.escape(
        "data.prompts_per_iteration * data.group_size = 30 samples cannot be split over 4 processes"
    )):
        config.check_batch(4)
    layout = config.check_batch(3)
    assert (layout.global_samples, layout.samples_per_process, layout.rollout_batch_size) == (30, 10, 10)
    assert layout.transitions_per_process == 90

    config = load("sampling.batch_size=16", "optim.minibatches=9", "optim.minibatch_split=steps",
                  path=EVERY_STEP)  # 64 samples x 9 steps
    assert config.check_batch(4).rollout_batch_size == 16
    with pytest.raises(ConfigError, match=r"sampling.batch_size = 16 does not divide the 8 samples per process"):
        config.check_batch(8)
    with pytest.raises(ConfigError, match="number of processes"):
        config.check_batch(0)


# ------------------------------------------------------------------------------------------------ noise schedule


@pytest.mark.parametrize(
    "overrides, spec",
    [
        ([], {"level": 0.7}),
        (["sampling.window_size=2", "sampling.window_start=sliding", "sampling.window_last=5"],
         {"level": 0.7, "window": 2, "window_start": "sliding", "window_first": 0, "window_last": 5}),
        (["sampling.num_steps=3", "sampling.noise_table=[0.5, 0.2, 0]"], {"table": [0.5, 0.2, 0.0]}),
    ],
)
def test_noise_schedule_spec_matches_the_sampler(overrides, spec):
    config = load(*overrides, path=EVERY_STEP)
    assert config.noise_schedule_spec() == spec
    from flowalign.samplers import noise_schedule

    levels = noise_schedule(spec).levels(config.sampling.num_steps, progress=0.5)
    assert int((levels > 0).sum()) == config.sampling.stochastic_steps()


# ------------------------------------------------------------------------------------------------ save, load, diff


def test_save_load_round_trip(tmp_path):
    config = load(
        "optim.lr=3e-4",
        "optim.eps=1e-12",
        "model.family=flux",
        "model.lora_targets=[to_q, to_v]",
        "sampling.window_size=3",
        "sampling.window_start=random",
        "reward.rewards=[{name: a, weight: 0.5, kwargs: {x: [1, 2], y: no}}, {name: b}]",
        "train.out_dir=2024",
        "train.resume=null",
    )
    path = tmp_path / "out" / "config.yaml"
    save_config(config, path)
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == pytest.approx(3e-4)
    again = load_config(TrainConfig, path, [])
    assert again == config
    assert to_dict(again) == to_dict(config)
    assert diff_configs(to_dict(again), to_dict(config)) == []


def test_diff_configs_lists_changed_keys():
    a = to_dict(load())
    b = to_dict(load("optim.lr=3e-4", "train.resume=ckpt/5", "reward.rewards=[{name: x}]"))
    assert diff_configs(a, b) == [
        "reward.rewards: [{'name': 'toy_geneval', 'weight': 1.0, 'kwargs': {'partial_credit': True}, 'frames': None}] "
        "!= [{'name': 'x', 'weight': 1.0, 'kwargs': {}, 'frames': None}]",
        "optim.lr: 0.0005 != 0.0003",
        "train.resume: None != 'ckpt/5'",
    ]
    assert diff_configs(a, b, ignore=("train", "reward")) == ["optim.lr: 0.0005 != 0.0003"]
    assert diff_configs(a, b, ignore=["train.resume", "reward.rewards", "optim.lr"]) == []
    assert diff_configs({"x": {"y": 1}}, {"x": {"y": 1.0, "z": 2}}) == ["x.z: <missing> != 2"]
    assert diff_configs({"flag": True}, {"flag": 1}) == ["flag: True != 1"]


def test_validate_config_runs_nested_then_top_level():
    calls = []

    @dataclasses.dataclass
    class Inner:
        x: int = 1

        def validate(self):
            calls.append("inner")

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        items: list[Inner] = dataclasses.field(default_factory=lambda: [Inner(), Inner()])

        def validate(self):
            calls.append("outer")
            raise ValueError("plain ValueError")

    with pytest.raises(ConfigError, match="plain ValueError"):
        validate_config(Outer())
    assert calls == ["inner", "inner", "inner", "outer"]
    assert math.isclose(load("optim.lr=1e-2").optim.lr, 0.01)
