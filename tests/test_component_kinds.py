"""One table of component kinds (``flowalign.training.kinds.COMPONENT_KINDS``) drives the config's component sections,
``TrainConfig.components()``, ``Components.named()`` and the resumable keys; the components declare the method
policies the trainer applies (the skip of an update without signal, an objective's guidance scale)."""

import dataclasses

import pytest

from flowalign.components import ComponentConfig
from flowalign.config import load_config, resolve_reference
from flowalign.training import kinds
from flowalign.training.config import TrainConfig
from flowalign.training.kinds import COMPONENT_KINDS, ComponentKind, Components, component_sections


def test_every_row_is_a_section_of_the_config_with_its_registry_and_default():
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for kind in COMPONENT_KINDS:
        meta = fields[kind.section].metadata
        assert meta["registry"] == kind.registry and meta["help"] == kind.help, kind.section
        assert (meta["defaults"] if kind.many else meta["default"]) == kind.default, kind.section
    component_fields = [name for name, f in fields.items() if "registry" in f.metadata]
    assert component_fields == [kind.section for kind in COMPONENT_KINDS]


def test_components_named_and_resumable_keys_follow_the_table():
    config = load_config(TrainConfig, None, ["objectives.flow_matching.data=toy"])
    parts = config.components()
    assert list(parts.named()) == ["rollout", "credit", "step_selection", "step_weighting", "loss.grpo",
                                   "objectives.flow_matching", "reference"]
    for kind in COMPONENT_KINDS:
        settings = getattr(config, kind.section)
        value = getattr(parts, kind.attribute)
        built = value if kind.many else {settings.name: value}
        names = settings if kind.many else {settings.name: settings}
        assert {n: type(p) for n, p in built.items()} == {
            n: resolve_reference(kind.registry).get(s.name) for n, s in names.items()}, kind.section
    owners = {key.rsplit(".", 1)[0] for key in config.resumable_keys()}
    assert {"model", "reward", "collapse", "train"} <= owners
    # the process layout's keys (distributed.context_parallel) may change on a resume, as the process count does
    assert all(owner in parts.named() or owner.split(".")[0] in {"model", "reward", "collapse", "train", "distributed"}
               for owner in owners)


def test_a_new_kind_of_component_is_one_row(monkeypatch):
    row = ComponentKind("critic", "critic", "flowalign.credit.steps:STEP_WEIGHTINGS", "uniform", "a new kind")
    monkeypatch.setattr(kinds, "COMPONENT_KINDS", (*COMPONENT_KINDS, row))

    @dataclasses.dataclass
    @component_sections(after="first")
    class Schema:
        first: int = 0
        last: int = 1

    names = [f.name for f in dataclasses.fields(Schema)]
    assert names == ["first", *(k.section for k in COMPONENT_KINDS), "critic", "last"]
    schema = Schema()
    assert isinstance(schema.critic, ComponentConfig) and schema.critic.name == "uniform"
    parts = Components.build(schema)
    assert list(parts.named())[-1] == "critic" and parts.critic.name == "uniform"
    with pytest.raises(TypeError, match="one part per kind"):
        Components(shape=None)


def test_every_registered_credit_and_objective_keeps_the_policies_of_before():
    """Before 0.2 the trainer skipped every zero-variance update and evaluated every objective at guidance 1: each
    built-in component declares exactly that, so no method changed."""
    from flowalign.credit import CREDIT
    from flowalign.objectives import OBJECTIVES

    for name in CREDIT.names():
        assert CREDIT.get(name).skip_without_signal is True, name
    for name in OBJECTIVES.names():
        assert OBJECTIVES.get(name).skip_without_signal is True, name
        assert OBJECTIVES.get(name).guidance_scale == 1.0, name


def test_an_update_without_signal_is_skipped_only_when_every_training_part_says_so():
    config = load_config(TrainConfig, None, ["objectives.flow_matching.data=toy"])
    parts = config.components()
    assert parts.skip_without_signal()
    parts.objectives["flow_matching"].skip_without_signal = False  # the objective still learns from its data
    assert not parts.skip_without_signal()
    parts.objectives["flow_matching"].skip_without_signal = True
    parts.credit.skip_without_signal = False
    assert not parts.skip_without_signal()
    parts.losses.clear()  # without loss terms the credit trains nothing, so it has no say
    assert parts.skip_without_signal()
