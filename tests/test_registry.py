"""The generic component registry (flowalign.registry) and the reward registry built on it."""

from dataclasses import dataclass

import pytest

from flowalign.registry import Registry


class Double:
    def __init__(self, value: int = 1):
        self.value = 2 * value


@dataclass
class ScaleConfig:
    factor: float = 1.0
    offset: float = 0.0

    def validate(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"factor must be > 0, got {self.factor}")


class Scale:
    def __init__(self, config: ScaleConfig):
        self.config = config


def test_register_get_build_and_list_names():
    registry = Registry("widget")
    assert registry.register("double", Double) is Double
    registry.register("half", lambda value=2: value / 2)
    assert registry.names() == ["double", "half"] == list(registry) and len(registry) == 2
    assert "double" in registry and "triple" not in registry
    assert registry.get("double") is Double and registry.config_class("double") is None
    assert registry.build("double", value=3).value == 6 and registry.build("half") == 1.0
    assert repr(registry) == "Registry('widget': double, half)"


def test_unknown_names_list_the_known_ones_with_a_did_you_mean():
    registry = Registry("credit estimator")
    registry.register("tree", Double)
    registry.register("terminal", Double)
    with pytest.raises(ValueError) as error:
        registry.build("termnal")
    assert str(error.value) == ("unknown credit estimator 'termnal': known credit estimators are terminal, tree; "
                                "did you mean 'terminal'?")
    for lookup in (registry.get, registry.config_class, registry.unregister):
        with pytest.raises(ValueError, match="unknown credit estimator 'xyz': known credit estimators are "
                                             r"terminal, tree$"):  # nothing close: no suggestion
            lookup("xyz")
    with pytest.raises(ValueError, match=r"unknown sampler 'x': known samplers are \(none\)$"):
        Registry("sampler").get("x")
    with pytest.raises(ValueError, match="known loss terms are"):
        Registry("loss term", plural="loss terms").get("x")


def test_a_name_is_registered_once_unless_overwritten_and_can_be_removed():
    registry = Registry("reward")
    registry.register("a", Double)
    with pytest.raises(ValueError, match=r"reward 'a' is already registered \(pass overwrite=True to replace it\)"):
        registry.register("a", Scale)
    assert registry.get("a") is Double  # the refused registration changed nothing
    registry.register("a", Scale, overwrite=True)
    assert registry.get("a") is Scale
    assert registry.unregister("a") is Scale and "a" not in registry and len(registry) == 0


def test_bad_registrations_are_refused():
    registry = Registry("reward")
    for name in ("", None, 3):
        with pytest.raises(TypeError, match="name must be a non-empty string"):
            registry.register(name, Double)
    with pytest.raises(TypeError, match="the factory must be callable"):
        registry.register("x", 3)
    with pytest.raises(TypeError, match="config must be a dataclass type"):
        registry.register("x", Scale, config=dict)
    with pytest.raises(TypeError, match="config must be a dataclass type"):
        registry.register("x", Scale, config=ScaleConfig())  # an instance, not the class
    assert len(registry) == 0


def test_a_component_with_a_config_dataclass_is_built_from_one():
    registry = Registry("shape")
    registry.register("scale", Scale, config=ScaleConfig)
    assert registry.config_class("scale") is ScaleConfig
    config = ScaleConfig(factor=2.0)
    assert registry.build("scale", config).config is config
    assert registry.build("scale", factor=3.0).config == ScaleConfig(factor=3.0)  # keywords become the config
    assert registry.build("scale").config == ScaleConfig()
    assert registry.make_config("scale", {"offset": 1.5}) == ScaleConfig(offset=1.5)
    with pytest.raises(ValueError, match="shape 'scale' has no setting 'factr': did you mean 'factor'?"):
        registry.build("scale", factr=2.0)
    with pytest.raises(ValueError, match="shape 'scale' has no setting 'zzz': its settings are: factor, offset"):
        registry.build("scale", zzz=2.0)
    with pytest.raises(ValueError, match="factor must be > 0, got -1"):  # the config's own validate() runs
        registry.build("scale", factor=-1.0)
    with pytest.raises(TypeError, match="pass a config or keyword arguments, not both"):
        registry.build("scale", config, factor=2.0)
    with pytest.raises(TypeError, match="shape 'scale' is built from a ScaleConfig, got dict"):
        registry.build("scale", {"factor": 2.0})
    registry.register("double", Double)
    with pytest.raises(TypeError, match="shape 'double' has no config dataclass"):
        registry.build("double", config)
    with pytest.raises(TypeError, match="shape 'double' has no config dataclass"):
        registry.make_config("double")


def test_a_config_field_without_a_default_must_be_given():
    @dataclass
    class Needs:
        path: str
        steps: int = 1

    registry = Registry("objective")
    registry.register("data", lambda config: config, config=Needs)
    with pytest.raises(ValueError, match="objective 'data' needs the setting 'path'"):
        registry.build("data", steps=2)
    assert registry.build("data", path="x") == Needs("x")


def test_register_works_as_a_decorator():
    registry = Registry("loss term")

    @registry.register("scaled", config=ScaleConfig)
    class Scaled(Scale):
        pass

    assert registry.get("scaled") is Scaled and registry.config_class("scaled") is ScaleConfig
    assert isinstance(registry.build("scaled", factor=2.0), Scaled)


def test_a_keyword_named_config_reaches_a_plain_factory():
    registry = Registry("reward")
    registry.register("takes_config", lambda config="default": config)
    assert registry.build("takes_config", config="given") == "given"  # only a positional config is the dataclass


def test_the_reward_registry_is_a_registry_and_keeps_its_messages():
    from flowalign.rewards import REWARDS, build_reward, register_reward

    assert isinstance(REWARDS, Registry) and REWARDS.kind == "reward"
    assert {"toy_geneval", "brightness", "pickscore", "geneval"} <= set(REWARDS)
    with pytest.raises(ValueError, match="unknown reward 'brightnes': known rewards are .*; did you mean 'brightness'"):
        build_reward("brightnes")
    register_reward("test_registry_brightness", REWARDS.get("brightness"))
    try:
        assert build_reward("test_registry_brightness", channel=1).channel == 1
        with pytest.raises(ValueError, match="reward 'test_registry_brightness' is already registered"):
            register_reward("test_registry_brightness", Double)
        register_reward("test_registry_brightness", Double, overwrite=True)
        assert build_reward("test_registry_brightness", value=2).value == 4
    finally:
        REWARDS.unregister("test_registry_brightness")
    assert "test_registry_brightness" not in REWARDS


def test_an_unknown_rg_opd_reward_is_a_config_error_with_a_did_you_mean(tmp_path):
    from flowalign.config import ConfigError, load_config
    from flowalign.training.config import TrainConfig

    settings = ["loss.rg_opd.weight=1", "loss.rg_opd.reward=brightnes"]
    with pytest.raises(ConfigError, match="'brightnes' is not a registered reward; known: .*brightness.*; did you "
                                          "mean 'brightness'") as error:
        load_config(TrainConfig, None, settings)
    assert error.value.key == "loss.rg_opd.reward"
