"""Component sections of the config loader: a registered component named by ``name`` with its own settings, and
mappings of several components (the loss terms), with did-you-mean, per-layer reset, help and migration."""

import sys
import types
from dataclasses import dataclass

import pytest

from flowalign.components import ComponentConfig
from flowalign.config import ConfigError, component, component_map, format_help, load_config, to_dict
from flowalign.registry import Registry
from flowalign.settings import check, option

PARTS = Registry("part")
TERMS = Registry("term")


@dataclass
class WideConfig(ComponentConfig):
    width: int = option(3, "how wide")
    label: str = option("w", "a label")

    def validate(self):
        check(self.width >= 1, "width", f"must be >= 1, got {self.width}")


@dataclass
class WeightConfig(ComponentConfig):
    weight: float = option(1.0, "the term's weight")


PARTS.register("plain", lambda c: c, config=ComponentConfig)
PARTS.register("wide", lambda c: c, config=WideConfig)
TERMS.register("main", lambda c: c, config=WeightConfig)
TERMS.register("extra", lambda c: c, config=WeightConfig)

module = types.ModuleType("component_test_registries")
module.PARTS, module.TERMS = PARTS, TERMS
sys.modules[module.__name__] = module


@dataclass
class Schema:
    part: ComponentConfig = component("component_test_registries:PARTS", "plain", "the part")
    terms: dict = component_map("component_test_registries:TERMS", ["main"], "the terms")
    seed: int = option(0, "a seed")

    @classmethod
    def migrate(cls, layer):
        layer = dict(layer)
        if "old_width" in layer:
            layer["part"] = {"name": "wide", "width": layer.pop("old_width")}
            return layer, ["old_width moved to part.width"]
        return layer, []


def test_defaults_and_round_trip(tmp_path):
    config = load_config(Schema)
    assert config.part.name == "plain" and list(config.terms) == ["main"] and config.terms["main"].weight == 1.0
    config = load_config(Schema, None, ["part.name=wide", "part.width=5", "terms.extra.weight=0.5"])
    assert isinstance(config.part, WideConfig) and config.part.width == 5
    assert list(config.terms) == ["main", "extra"] and config.terms["extra"].weight == 0.5
    import yaml
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(to_dict(config)))
    assert to_dict(load_config(Schema, path)) == to_dict(config)


def test_a_layer_naming_another_component_starts_afresh(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("part: {name: wide, width: 7}\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\npart: {width: 9}\n")
    assert load_config(Schema, child).part.width == 9  # same component: settings merge
    assert load_config(Schema, base, ["part.name=plain"]).part == ComponentConfig(name="plain")
    assert load_config(Schema, base, ["part.name=wide"]).part.width == 3  # named again: its defaults


def test_unknown_names_and_settings_get_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"part.name: unknown part 'wdie'.*did you mean 'wide'") as error:
        load_config(Schema, None, ["part.name=wdie"])
    assert error.value.key == "part.name"
    with pytest.raises(ConfigError, match=r"unknown key 'part.widht'.*did you mean 'part.width'"):
        load_config(Schema, None, ["part.name=wide", "part.widht=2"])
    with pytest.raises(ConfigError, match=r"'plain' has no setting 'width'"):
        load_config(Schema, None, ["part.width=2"])
    with pytest.raises(ConfigError, match=r"unknown term 'terms.extr'.*did you mean 'terms.extra'"):
        load_config(Schema, None, ["terms.extr.weight=1"])
    with pytest.raises(ConfigError, match=r"part.width: expected an int, got 'x'"):
        load_config(Schema, None, ["part.name=wide", "part.width=x"])


def test_a_components_validate_names_its_key_with_the_section_in_front():
    with pytest.raises(ConfigError, match=r"^part.width must be >= 1, got 0 \[from override 'part.width=0'\]") as e:
        load_config(Schema, None, ["part.name=wide", "part.width=0"])
    assert e.value.key == "part.width"


def test_a_map_entry_set_to_null_is_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("terms: {main: null, extra: {weight: 2.0}}\n")
    assert list(load_config(Schema, path).terms) == ["extra"]
    assert list(load_config(Schema, path, ["terms.main={}"]).terms) == ["main", "extra"]


def test_help_lists_every_component_and_its_settings():
    text = format_help(Schema)
    assert "part.name = 'plain'  (one of 'plain', 'wide')" in text
    assert "part.width = 3  (an int)  how wide" in text
    assert "terms.extra.weight = 1.0  (a float)  the term's weight" in text


def test_the_schemas_migration_runs_on_every_layer(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("old_width: 4\n")
    with caplog.at_level("WARNING", logger="flowalign.config"):
        config = load_config(Schema, path)
    assert config.part.width == 4
    assert "old_width moved to part.width" in caplog.text
