"""Typed configs from YAML files and dotted command-line overrides.

The schema is a tree of dataclasses (one per config section, each field with a ``help`` string in its metadata);
this module knows nothing about any particular schema. ``load_config`` reads a YAML file (which may inherit from
another with ``base: other.yaml``), applies ``a.b.c=value`` overrides, checks every key and type against the
dataclasses, builds them, and runs their ``validate`` methods, so that every mistake in a config surfaces as one
``ConfigError`` naming the dotted key (and the file or override it came from) before any model is loaded.

Merging works on dotted leaf keys: a child file or an override replaces single fields, so sections merge deeply,
while a field's value (a list, a free-form dict) is replaced whole.

A field made with ``component(registry, default)`` is a *component section*: its ``name`` picks a registered component
and the rest of the section are that component's settings, checked against the settings dataclass the registry holds
for it (``flowalign.components``). A layer that sets ``name`` starts the section afresh (the settings earlier layers
gave another component are dropped). ``component_map(registry, defaults)`` is a mapping of such sections keyed by
name, several active at once (the loss terms): ``loss: {grpo: {clip_range: 1e-4}, rg_opd: {weight: 0.5}}``; an entry
set to ``null`` is switched off.

User code. A component's ``name`` may also name a class of the user's own, ``module.path:ClassName`` or
``path/to/file.py:ClassName`` (``flowalign.user_code``): the loader loads it, checks it against the registry's
protocol and builds its settings from its ``config_class`` as for a registered one (``Registry.resolve``). A relative
file path is read from the folder of the config file that names it, or from the current directory when a command-line
override names it; the config keeps the absolute path, so a saved config loads the same file from anywhere. In a
component map the entry's key is then a label of the user's choosing and its ``name`` the reference
(``objectives: {mine: {name: my_objectives.py:Mine}}``). A string field made with ``names(registry, field)`` (the
rewards' ``name``) is resolved the same way when it holds a reference.

A schema may define ``migrate(layer) -> (layer, notices)`` (a classmethod): every YAML file and override passes through
it before its keys are checked, so keys of an older schema keep working (each moved key is announced once).

YAML is read with YAML 1.2 rules for floats and bools: ``3e-4`` is a float (PyYAML's YAML 1.1 makes it a string),
and only ``true``/``false`` are bools (YAML 1.1 turns ``no``, ``off`` and ``y`` into bools, which would break
``mixed_precision: no``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypeVar, Union

import yaml

from .errors import SetupError
from .user_code import is_reference

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "load_config",
    "set_keys",
    "validate_config",
    "to_dict",
    "to_saved_dict",
    "save_config",
    "diff_configs",
    "format_help",
    "help_entries",
    "HelpEntry",
    "parse_yaml",
]


class ConfigError(SetupError):
    """A config mistake. ``key`` is the dotted key at fault when there is one, so callers can point at its source."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


# ------------------------------------------------------------------------------------------------ YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-3``) and bools (only true/false)."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
# New lists, so SafeLoader's own resolver table is left untouched.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
            |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str, *, lines: bool = True) -> Any:
    """Parse YAML text; a syntax error becomes a ConfigError naming ``source`` (and the line, when ``lines``)."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if lines and mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        what = "YAML" if lines else "value"
        raise ConfigError(f"malformed {what} in {source}{where}: {problem}") from None


# ------------------------------------------------------------------------------------------------ schema helpers


def _hints(cls: type) -> dict[str, Any]:
    """The types of ``cls``'s dataclass fields (class variables such as ``resumable`` are not settings)."""
    hints = typing.get_type_hints(cls)
    if dataclasses.is_dataclass(cls):
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return hints


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


# ------------------------------------------------------------------------------------------------ components


def component(registry: str, default: str, help: str) -> Any:
    """A component section (module docstring): ``registry`` is ``"module:NAME"`` of a ``Registry`` whose entries
    have settings dataclasses, ``default`` the component used when no layer names one."""
    return dataclasses.field(default_factory=lambda: resolve_reference(registry).make_config(default, {"name": default}),
                             metadata={"help": help, "registry": registry, "default": default})


def component_map(registry: str, defaults: Sequence[str], help: str) -> Any:
    """A mapping of component sections keyed by registered name (module docstring), ``defaults`` on by default."""
    return dataclasses.field(
        default_factory=lambda: {n: resolve_reference(registry).make_config(n, {"name": n}) for n in defaults},
        metadata={"help": help, "registry": registry, "defaults": tuple(defaults), "map": True},
    )


def names(registry: str, field: Any) -> Any:
    """``field`` (a str field) marked as naming an entry of the ``Registry`` ``registry`` (``"module:NAME"``): a
    reference to a class of the user's own in it is resolved when the config loads (module docstring)."""
    return dataclasses.field(default=field.default, default_factory=field.default_factory,
                             metadata={**field.metadata, "names": registry})


def _folder_of(where: str) -> str | None:
    """The folder of the config file ``where`` names (a layer's source), or None (an override: the current
    directory) for the folder a relative path of user code is read from."""
    return os.path.dirname(os.path.abspath(where)) if os.path.isfile(where) else None


def _resolve_name(registry: Any, name: str, key: str, where: str) -> str:
    """``registry.resolve(name)`` for a reference, with a relative path read from the folder of ``where``'s file; its
    mistakes as a ConfigError naming ``key`` and ``where``."""
    try:
        return registry.resolve(name, _folder_of(where))
    except ValueError as e:
        raise ConfigError(f"{key}: {e} {_source_tag(where)}", key=key) from e


def resolve_reference(ref: str) -> Any:
    """The object a ``"module:attribute"`` reference names, imported on first use."""
    import importlib

    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _component_meta(cls: type, name: str) -> Mapping[str, Any] | None:
    """The component metadata of field ``name`` of ``cls``, or None for an ordinary field."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata if "registry" in f.metadata else None
    return None


def _component_fields(cls: type, prefix: str = "") -> dict[str, Mapping[str, Any]]:
    """Every component field of the schema by dotted key."""
    out: dict[str, Mapping[str, Any]] = {}
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if "registry" in f.metadata:
            out[prefix + f.name] = f.metadata
        elif _is_section(tp):
            out.update(_component_fields(tp, f"{prefix}{f.name}."))
    return out


def _settings_keys(registry: Any, prefix: str) -> list[str]:
    """The dotted keys of every registered component's settings under ``prefix`` (for did-you-mean)."""
    keys = {prefix + "name"}
    for name in registry.names():
        cls = registry.config_class(name)
        if cls is not None:
            keys.update(prefix + f.name for f in dataclasses.fields(cls))
    return sorted(keys)


def _schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the schema: sections and leaves (a component section's: every component's settings)."""
    keys = []
    for name, tp in _hints(cls).items():
        keys.append(prefix + name)
        meta = _component_meta(cls, name)
        if meta is not None:
            registry = resolve_reference(meta["registry"])
            if meta.get("map"):
                for entry in registry.names():
                    keys.extend(k for k in _settings_keys(registry, f"{prefix}{name}.{entry}.") if not k.endswith(
                        ".name"))
            else:
                keys.extend(_settings_keys(registry, f"{prefix}{name}."))
        elif _is_section(tp):
            keys.extend(_schema_keys(tp, f"{prefix}{name}."))
    return keys


def _unknown_key(cls: type, root: type, prefix: str, key: str, where: str) -> ConfigError:
    """An unknown-key error with the closest known key, or the list of valid keys at that level."""
    dotted = prefix + key
    siblings = list(_hints(cls))
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    suggestion = prefix + close[0] if close else None
    if suggestion is None:  # a key put in the wrong section, e.g. 'lr' for 'optim.lr'
        same_name = [k for k in _schema_keys(root) if k.rsplit(".", 1)[-1] == key]
        suggestion = same_name[0] if same_name else None
    if suggestion is None:
        close = difflib.get_close_matches(dotted, _schema_keys(root), n=1, cutoff=0.6)
        suggestion = close[0] if close else None
    if suggestion is not None:
        hint = f"did you mean '{suggestion}'?"
    else:
        level = f"'{prefix[:-1]}'" if prefix else "the top level"
        hint = f"the keys of {level} are: {', '.join(siblings)}"
    return ConfigError(f"unknown key '{dotted}' in {where}: {hint}", key=dotted)


def _flatten_layer(cls: type, root: type, data: Any, prefix: str, where: str, out: dict[str, Any]) -> None:
    """Check ``data``'s keys against the schema and collect its leaf values under their dotted keys."""
    if data is None and prefix:  # a section left empty in YAML ('optim:' with only comments below)
        return
    if not isinstance(data, Mapping):
        name = prefix[:-1] if prefix else "the config"
        raise ConfigError(
            f"{name}: expected a mapping of {cls.__name__} fields, got {_show(data)} {_source_tag(where)}",
            key=prefix[:-1] or None,
        )
    hints = _hints(cls)
    for key, value in data.items():
        key = str(key)
        if key not in hints:
            raise _unknown_key(cls, root, prefix, key, where)
        meta = _component_meta(cls, key)
        if meta is not None:
            _flatten_component(meta, value, f"{prefix}{key}", where, out)
        elif _is_section(hints[key]):
            _flatten_layer(hints[key], root, value, f"{prefix}{key}.", where, out)
        else:
            out[prefix + key] = value


def _flatten_component(meta: Mapping[str, Any], value: Any, dotted: str, where: str, out: dict[str, Any]) -> None:
    """A component section's values as dotted keys (checked when the section is built, once its name is known).

    A map entry is also recorded as itself: ``{}`` (on) or ``None`` (off)."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"{dotted}: expected a mapping (name and settings), got {_show(value)} {_source_tag(where)}",
                          key=dotted)
    if not meta.get("map"):
        for k, v in value.items():
            out[f"{dotted}.{k}"] = v
        return
    for entry, settings in value.items():
        entry_key = f"{dotted}.{entry}"
        if ":" in str(entry) or "." in str(entry):
            raise ConfigError(f"{entry_key}: an entry of {dotted} is keyed by a plain label; name a class of your "
                              f"own in its 'name': {dotted}: {{mine: {{name: {entry}}}}} {_source_tag(where)}",
                              key=entry_key)
        if settings is None:
            out[entry_key] = None
            continue
        if not isinstance(settings, Mapping):
            raise ConfigError(f"{entry_key}: expected a mapping of settings or null (off), got {_show(settings)} "
                              f"{_source_tag(where)}", key=entry_key)
        out[entry_key] = {}
        for k, v in settings.items():
            out[f"{entry_key}.{k}"] = v


def _merge(flat: dict[str, Any], values: Mapping[str, Any], components: Mapping[str, Mapping[str, Any]]) -> None:
    """``flat.update(values)``, where a layer naming a component drops the settings earlier layers gave its section,
    and a map entry switched off drops that entry's settings."""
    for prefix, meta in components.items():
        if meta.get("map"):
            for key in [k for k in values if k.startswith(prefix + ".") and k.count(".") == prefix.count(".") + 1]:
                if values[key] is None:
                    for old in [k for k in flat if k.startswith(key + ".")]:
                        del flat[old]
        elif prefix + ".name" in values:
            for old in [k for k in flat if k.startswith(prefix + ".")]:
                del flat[old]
    flat.update(values)


def _leaf_type(cls: type, dotted: str) -> Any:
    tp: Any = cls
    for part in dotted.split("."):
        tp = _hints(tp)[part]
    return tp


# ------------------------------------------------------------------------------------------------ types


class _Mismatch(Exception):
    """A value that does not fit its type: raised while coercing, turned into a ConfigError with its source."""

    def __init__(self, key: str, expected: str, value: Any, extra: str = ""):
        super().__init__(key)
        self.key, self.expected, self.value, self.extra = key, expected, value, extra

    def message(self) -> str:
        return f"{self.key}: expected {self.expected}, got {_show(self.value)}{self.extra}"


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _describe(tp: Any) -> str:
    """The type as the error messages say it: 'a float', 'one of 'a', 'b'', 'a list of floats or null'."""
    if tp is Any:
        return "any value"
    if tp is bool:
        return "a bool (true or false)"
    if tp is int:
        return "an int"
    if tp is float:
        return "a float"
    if tp is str:
        return "a str"
    args = _union_args(tp)
    if args is not None:
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list or tp is list:
        (item,) = typing.get_args(tp) or (Any,)
        return "a list" if item is Any else f"a list of {_plural(item)}"
    if origin is dict or tp is dict:
        return "a mapping"
    if _is_section(tp):
        return f"a mapping of {tp.__name__} fields"
    raise TypeError(f"unsupported config field type {tp!r}")


def _plural(tp: Any) -> str:
    names = {bool: "bools", int: "ints", float: "floats", str: "strs"}
    if _is_section(tp):
        return f"{tp.__name__} mappings"
    return names.get(tp, f"({_describe(tp)})")


def _coerce(value: Any, tp: Any, key: str, root: type, where: str) -> Any:
    """Check ``value`` against ``tp`` and convert it (ints to floats, mappings to dataclasses); else _Mismatch."""
    if tp is Any:
        return value
    args = _union_args(tp)
    if args is not None:
        if value is None and type(None) in args:
            return None
        extra = ""
        for arg in [a for a in args if a is not type(None)]:
            try:
                return _coerce(value, arg, key, root, where)
            except _Mismatch as e:
                if e.key != key:  # an element inside the value is at fault: that is the error to show
                    raise
                extra = e.extra
        raise _Mismatch(key, _describe(tp), value, extra)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch(key, _describe(tp), value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _Mismatch(key, _describe(tp), value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _Mismatch(key, _describe(tp), value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _Mismatch(key, _describe(tp), value)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        extra = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1, cutoff=0.6)
            extra = f"; did you mean {close[0]!r}?" if close else ""
        raise _Mismatch(key, _describe(tp), value, extra)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise _Mismatch(key, _describe(tp), value)
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item, f"{key}[{i}]", root, where) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise _Mismatch(key, _describe(tp), value)
        key_type, value_type = typing.get_args(tp) or (Any, Any)
        return {
            _coerce(k, key_type, f"{key}.{k}", root, where): _coerce(v, value_type, f"{key}.{k}", root, where)
            for k, v in value.items()
        }
    if _is_section(tp):
        if not isinstance(value, Mapping):
            raise _Mismatch(key, _describe(tp), value)
        hints = _hints(tp)
        for k in value:
            if str(k) not in hints:
                raise _unknown_key(tp, root, f"{key}.", str(k), where)
        for f in dataclasses.fields(tp):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in value:
                raise _Mismatch(key, f"{_describe(tp)} including '{f.name}'", value)
        built = {str(k): _coerce(v, hints[str(k)], f"{key}.{k}", root, where) for k, v in value.items()}
        for f in dataclasses.fields(tp):
            if "names" in f.metadata and is_reference(built.get(f.name)):
                built[f.name] = _resolve_name(resolve_reference(f.metadata["names"]), built[f.name],
                                              f"{key}.{f.name}", where)
        return tp(**built)
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def check_value(value: Any, tp: Any, key: str) -> None:
    """ConfigError naming ``key`` when ``value`` does not fit the annotation ``tp`` by the config's own rules (a bool
    is only true or false, an int not a float, a Literal one of its values); an annotation the config has no rule for
    (a path, a tensor, a model object) accepts any value."""
    try:
        _coerce(value, tp, key, object, "")
    except _Mismatch as e:
        raise ConfigError(e.message(), key=e.key) from None
    except TypeError:  # a type outside the config's vocabulary: nothing to check it by
        pass


def _build(cls: type[T], root: type, flat: Mapping[str, Any], prefix: str, sources: Mapping[str, str]) -> T:
    """Build ``cls`` from the dotted leaf values under ``prefix``; fields not given keep their defaults."""
    kwargs = {}
    for name, tp in _hints(cls).items():
        dotted = prefix + name
        meta = _component_meta(cls, name)
        if meta is not None:
            if any(k.startswith(dotted + ".") for k in flat):
                kwargs[name] = (_build_component_map if meta.get("map") else _build_component)(meta, root, flat, dotted,
                                                                                                sources)
        elif _is_section(tp):
            if any(k.startswith(dotted + ".") for k in flat):
                kwargs[name] = _build(tp, root, flat, dotted + ".", sources)
        elif dotted in flat:
            where = sources.get(dotted, "the config")
            try:
                kwargs[name] = _coerce(flat[dotted], tp, dotted, root, where)
            except _Mismatch as e:
                raise ConfigError(f"{e.message()} {_source_tag(where)}", key=e.key) from None
    return cls(**kwargs)


def _build_component(meta: Mapping[str, Any], root: type, flat: Mapping[str, Any], dotted: str,
                     sources: Mapping[str, str], name: str | None = None) -> Any:
    """The settings dataclass of the component a section names, from its dotted keys (unknown keys: did-you-mean)."""
    registry = resolve_reference(meta["registry"])
    values = {k[len(dotted) + 1:]: v for k, v in flat.items() if k.startswith(dotted + ".")}
    if name is not None and values.get("name", name) == name:  # a map entry may repeat its key as its name
        values.pop("name", None)
    if name is None or is_reference(values.get("name")):  # a plain section: its 'name' key, or the default; a map
        # entry keyed by a label, naming a class of the user's own
        name = values.pop("name", meta.get("default"))
        where = sources.get(dotted + ".name", "the config")
        if is_reference(name):
            name = _resolve_name(registry, name, dotted + ".name", where)
        elif not isinstance(name, str) or name not in registry:
            close = registry.closest(str(name))
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(f"{dotted}.name: unknown {registry.kind} {name!r} {_source_tag(where)}: known "
                              f"{registry.plural} are {', '.join(registry.names())}{hint}", key=dotted + ".name")
    settings_cls = registry.config_class(name)
    if is_reference(name):
        from .components import ComponentConfig

        if settings_cls is None or not issubclass(settings_cls, ComponentConfig):
            raise ConfigError(f"{dotted}.name: {name!r}: the settings of a {registry.kind} are a dataclass "
                              "subclassing flowalign.components.ComponentConfig, its class's config_class; got "
                              f"{settings_cls!r} {_source_tag(where)}", key=dotted + ".name")
    hints = _hints(settings_cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        where = sources.get(f"{dotted}.{key}", "the config")
        if key not in hints or key == "name":
            fields = [f for f in hints if f != "name"]
            close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
            hint = (f"did you mean '{dotted}.{close[0]}'?" if close
                    else f"its settings are: {', '.join(fields) or '(none)'}")
            raise ConfigError(f"unknown key '{dotted}.{key}' in {where}: {registry.kind} {name!r} has no setting "
                              f"{key!r}; {hint}", key=f"{dotted}.{key}")
        try:
            kwargs[key] = _coerce(value, hints[key], f"{dotted}.{key}", root, where)
        except _Mismatch as e:
            raise ConfigError(f"{e.message()} {_source_tag(where)}", key=e.key) from None
    return settings_cls(name=name, **kwargs)


def _build_component_map(meta: Mapping[str, Any], root: type, flat: Mapping[str, Any], dotted: str,
                         sources: Mapping[str, str]) -> dict[str, Any]:
    """The entries of a component map: the defaults, and every entry a layer names, minus those switched off."""
    registry = resolve_reference(meta["registry"])
    depth = dotted.count(".") + 1
    named = {k.split(".")[depth] for k in flat if k.startswith(dotted + ".")}
    entries = {}
    for entry in list(meta.get("defaults", ())) + sorted(named - set(meta.get("defaults", ()))):
        key = f"{dotted}.{entry}"
        if flat.get(key, {}) is None:
            continue
        if entry not in registry and not is_reference(flat.get(f"{key}.name")):
            close = registry.closest(entry)
            hint = f"; did you mean '{dotted}.{close}'?" if close else ""
            where = sources.get(key) or next((sources[k] for k in sources if k.startswith(key + ".")), "the config")
            raise ConfigError(f"unknown {registry.kind} '{key}' in {where}: known {registry.plural} are "
                              f"{', '.join(registry.names())}{hint}", key=key)
        entries[entry] = _build_component(meta, root, flat, key, sources, name=entry)
    return entries


def _source_tag(where: str) -> str:
    return f"[from {where}]"


# ------------------------------------------------------------------------------------------------ loading


def _read_layers(path: str | os.PathLike, chain: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """The YAML layers of ``path``, base first: ``[(source, mapping), ...]``, following ``base:`` links."""
    source = os.path.normpath(str(path))
    real = os.path.realpath(source)
    if real in chain:
        raise ConfigError(f"{source}: 'base' links form a cycle")
    try:
        text = Path(source).read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {source}") from None
    data = parse_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: a config file must be a mapping of keys to values, got {_show(data)}")
    data = dict(data)
    base = data.pop("base", None)
    layers: list[tuple[str, Any]] = []
    if base is not None:
        if not isinstance(base, str):
            message = f"base: expected the path of a YAML file, got {_show(base)} {_source_tag(source)}"
            raise ConfigError(message, key="base")
        base_path = os.path.join(os.path.dirname(source), base)
        if not os.path.exists(base_path):
            raise ConfigError(f"base file {base!r} of {source} not found (looked for {os.path.normpath(base_path)})")
        layers = _read_layers(base_path, chain + (real,))
    return layers + [(source, data)]


def _override_layer(cls: type, text: str) -> tuple[str, dict[str, Any]]:
    """Turn ``a.b.c=value`` into a nested mapping; the value is YAML (``3e-4``, ``true``, ``[1, 2]``, ``null``)."""
    where = f"override {text!r}"
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"malformed override {text!r}: expected key=value, e.g. optim.lr=3e-4")
    value = parse_yaml(raw, where, lines=False)
    # A str field keeps the text as typed: train.out_dir=2024 is the directory '2024', not the int 2024.
    if isinstance(value, (bool, int, float)):
        try:
            tp = _leaf_type(cls, key)
        except Exception:  # unknown keys are reported when the layer is flattened
            tp = None
        if tp is str or [a for a in _union_args(tp) or () if a is not type(None)] == [str]:
            value = raw.strip()
    nested: dict[str, Any] = {}
    node = nested
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return where, nested


def validate_config(config: Any, sources: Mapping[str, str] | None = None) -> None:
    """Run every ``validate`` method, innermost sections first and the top-level one (cross-field checks) last.

    A plain ValueError from a ``validate`` becomes a ConfigError; when the error names its ``key`` and ``sources``
    knows where that key was set, the message says so.
    """

    from .components import ComponentConfig

    def visit(obj: Any, path: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else [
                (None, value)]
            for index, item in items:
                if dataclasses.is_dataclass(item) and not isinstance(item, type):
                    where = f"{path}{f.name}" + ("" if index is None else f"[{index}]" if isinstance(index, int)
                                                 else f".{index}")
                    visit(item, where + ".")
        if not hasattr(obj, "validate"):
            return
        if not isinstance(obj, ComponentConfig):
            obj.validate()
            return
        try:  # a component names its own settings; put its section in front
            obj.validate()
        except ConfigError as e:
            key = f"{path}{e.key}" if e.key else path.rstrip(".")
            message = str(e)
            if e.key and message.startswith(e.key):
                message = message[len(e.key):]
                raise ConfigError(f"{key}{message}", key=key) from None
            raise ConfigError(f"{path.rstrip('.')}: {message}", key=key) from None

    try:
        visit(config, "")
    except ConfigError as e:
        where = _lookup_source(e.key, sources or {})
        if where is None:
            raise
        raise ConfigError(f"{e} {_source_tag(where)}", key=e.key) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _lookup_source(key: str | None, sources: Mapping[str, str]) -> str | None:
    """The source of ``key`` or of its closest enclosing key (``reward.rewards`` for ``reward.rewards[0].weight``)."""
    while key:
        if key in sources:
            return sources[key]
        key = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", key) if re.search(r"[.\[]", key) else ""
    return None


def load_config(cls: type[T], path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a validated ``cls`` from a YAML file (optional) and then ``key=value`` overrides, applied in order.

    Raises ConfigError (a ValueError) for unknown keys, wrong types, malformed YAML or overrides, and whatever
    the ``validate`` methods reject.

    Args:
        cls: the config dataclass to build (``flowalign.TrainConfig``, ``SampleConfig``, ...).
        path: a YAML file (its ``base:`` chain read first), or None for the defaults.
        overrides: ``key=value`` strings with dotted keys (``"train.iterations=2"``), applied after the file, in
            order; a value is parsed as YAML.

    Returns:
        The validated ``cls`` instance.
    """
    flat, sources = _read_config(cls, path, overrides)
    config = _build(cls, cls, flat, "", sources)
    validate_config(config, sources)
    return config


def set_keys(cls: type, path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> set[str]:
    """The dotted keys that the YAML file ``path`` (with its ``base:`` chain) and the ``overrides`` set, read as
    ``load_config`` reads them: what a config names itself rather than takes from the schema's defaults."""
    return set(_read_config(cls, path, overrides)[1])


def _read_config(cls: type, path: str | os.PathLike | None, overrides: Sequence[str]) -> tuple[dict, dict]:
    """``(flat values, {dotted key: the layer that set it})`` of a YAML file and overrides, applied in order."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    layers = _read_layers(path) if path is not None else []
    layers += [_override_layer(cls, text) for text in overrides]
    components = _component_fields(cls)
    migrate = getattr(cls, "migrate", None)
    flat: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for where, data in layers:
        if migrate is not None:
            data, notices = migrate(data)
            for notice in notices:
                _announce(f"{where}: {notice}")
        values: dict[str, Any] = {}
        _flatten_layer(cls, cls, data, "", where, values)
        _merge(flat, values, components)
        sources.update(dict.fromkeys(values, where))
    return flat, sources


_ANNOUNCED: set[str] = set()


def _announce(notice: str) -> None:
    """A one-line notice of a migrated key, once per process (``logging``, logger ``flowalign.config``)."""
    import logging

    if notice not in _ANNOUNCED:
        _ANNOUNCED.add(notice)
        logging.getLogger(__name__).warning("%s", notice)


# ------------------------------------------------------------------------------------------------ saving, diffing


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain nested dicts and lists (a deep copy)."""
    return dataclasses.asdict(config)


def to_saved_dict(config: Any) -> dict[str, Any]:
    """``to_dict`` for writing a config that loads back as itself: a component map's default entry that is off is
    written as null (``loss: {grpo: null}``; ``loss: {}`` would load with the default term on)."""
    data = to_dict(config)

    def switch_off(obj: Any, node: dict[str, Any]) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.metadata.get("map"):
                for name in f.metadata.get("defaults", ()):
                    node[f.name].setdefault(name, None)
            elif dataclasses.is_dataclass(value) and isinstance(node.get(f.name), dict):
                switch_off(value, node[f.name])

    switch_off(config, data)
    return data


def save_config(config: Any, path: str | os.PathLike) -> None:
    """Write the fully resolved config as YAML; ``load_config(type(config), path)`` gives it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(to_saved_dict(config), sort_keys=False, default_flow_style=None)
    path.write_text(f"# fully resolved {type(config).__name__}\n{text}")


def _flat_items(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat_items(value, f"{prefix}{key}."))
        else:
            out[prefix + str(key)] = value
    return out


def diff_configs(a: Mapping[str, Any], b: Mapping[str, Any], ignore: Iterable[str] = ()) -> list[str]:
    """The dotted keys whose values differ between two config dicts, as ``'key: <a> != <b>'`` lines.

    ``ignore`` holds dotted keys or section prefixes (``"train"`` ignores every ``train.*`` key). A key present in
    only one dict shows ``<missing>`` on the other side. Used to refuse resuming a checkpoint made with another config.
    """
    ignore = tuple(ignore)
    flat_a, flat_b = _flat_items(a), _flat_items(b)
    lines = []
    for key in list(flat_a) + [k for k in flat_b if k not in flat_a]:
        if any(key == p or key.startswith(p + ".") for p in ignore):
            continue
        va, vb = flat_a.get(key, _MISSING), flat_b.get(key, _MISSING)
        if not _same(va, vb):
            lines.append(f"{key}: {_repr(va)} != {_repr(vb)}")
    return lines


_MISSING = object()


def _repr(value: Any) -> str:
    return "<missing>" if value is _MISSING else repr(value)


def _same(a: Any, b: Any) -> bool:
    """Equal values, where 1 == 1.0 but True != 1 (a bool flag is never the same setting as a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# ------------------------------------------------------------------------------------------------ help


@dataclasses.dataclass(frozen=True)
class HelpEntry:
    """One line of a schema's help (``help_entries``): ``format_help`` prints them as text (``--help-config``),
    ``flowalign.cli.reference`` as the Markdown config reference.

    ``kind`` is ``"section"`` (a section or component section: ``key`` and ``help``, ``note`` what a component map
    holds), ``"key"`` (a setting: ``type`` as the error messages say it, ``default``, or ``required``), or
    ``"component"`` (a registered component of the component section ``section``: ``key`` its name, ``help`` the
    first line of its docstring; the settings that follow, up to the next component or section, are its own).
    ``depth`` is the nesting of components: 1 for the settings of a component."""

    kind: str
    key: str
    help: str = ""
    type: str = ""
    default: Any = None
    required: bool = False
    note: str = ""
    section: str = ""
    depth: int = 0


ComponentFilter = typing.Callable[[Any, str], bool]  # (registry, name) -> list this component


def _component_entries(meta: Mapping[str, Any], dotted: str, help_text: str, depth: int,
                       include: ComponentFilter | None) -> Iterable[HelpEntry]:
    """A component section's help: the choice of component, then each registered one's settings."""
    registry = resolve_reference(meta["registry"])
    names = [n for n in registry.names() if include is None or include(registry, n)]
    if meta.get("map"):
        on = ", ".join(meta.get("defaults", ())) or "none"
        yield HelpEntry("section", dotted, help_text, depth=depth,
                        note=f"a mapping of {registry.plural} by name; on by default: {on}; null switches one off")
    else:
        yield HelpEntry("section", dotted, help_text, depth=depth)
        yield HelpEntry("key", f"{dotted}.name", type=f"one of {', '.join(map(repr, names))}",
                        default=meta["default"], depth=depth)
    for name in names:
        summary = (registry.get(name).__doc__ or "").strip().split("\n")[0]
        yield HelpEntry("component", name, summary, section=dotted, depth=depth)
        base = f"{dotted}.{name}." if meta.get("map") else f"{dotted}."
        for entry in help_entries(registry.config_class(name), base, depth=depth + 1, include=include):
            if entry.key != base + "name":
                yield entry


def help_entries(cls: type, prefix: str = "", *, depth: int = 0,
                 include: ComponentFilter | None = None) -> Iterable[HelpEntry]:
    """Every dotted key of the schema ``cls`` in field order, with its type, default and help string, sections and
    component sections in place (``HelpEntry``); ``include(registry, name)`` picks the registered components listed
    (all by default)."""
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        dotted = prefix + f.name
        help_text = f.metadata.get("help", "")
        if "registry" in f.metadata:
            yield from _component_entries(f.metadata, dotted, help_text, depth, include)
            continue
        if _is_section(tp):
            yield HelpEntry("section", dotted, help_text, depth=depth)
            yield from help_entries(tp, dotted + ".", depth=depth, include=include)
            continue
        required = False
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default, required = None, True
        default = to_dict(default) if dataclasses.is_dataclass(default) else default
        if isinstance(default, list):
            default = [to_dict(d) if dataclasses.is_dataclass(d) else d for d in default]
        yield HelpEntry("key", dotted, help_text, type=_describe(tp), default=default, required=required, depth=depth)
        item = (typing.get_args(tp) or (None,))[0] if typing.get_origin(tp) is list else None
        if _is_section(item):  # the fields of each list entry, e.g. reward.rewards[].weight
            yield from help_entries(item, dotted + "[].", depth=depth, include=include)


def _entry_text(entry: HelpEntry) -> str:
    indent = "  " * entry.depth
    if entry.kind == "section":
        note = f" ({entry.note})" if entry.note else ""
        return f"{indent}{entry.key}:  {entry.help}{note}".rstrip()
    if entry.kind == "component":
        return f"{indent}  [{entry.key}] {entry.help}".rstrip()
    default = "(required)" if entry.required else entry.default
    note = f" [{entry.note}]" if entry.note else ""
    return f"{indent}  {entry.key} = {default!r}{note}  ({entry.type})  {entry.help}".rstrip()


def format_help(cls: type, prefix: str = "", *, values: Mapping[str, Any] | None = None) -> str:
    """One line per dotted key: type, default and help string (for ``flowalign train --help-config``); with
    ``values`` (``flat_values`` of a loaded config) each key it holds shows its value, and its default where the two
    differ."""
    entries = list(help_entries(cls, prefix))
    if values is not None:
        entries = [dataclasses.replace(entry, default=values[entry.key], required=False,
                                       note="" if values[entry.key] == entry.default else
                                       f"default: {entry.default!r}")
                   if entry.kind == "key" and entry.key in values else entry for entry in entries]
    return "\n".join(_entry_text(entry) for entry in entries)


def flat_values(config: Any) -> dict[str, Any]:
    """A loaded config's values by dotted key (``model.path``, ``loss.grpo.clip_range``; a list as one value)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(to_dict(config), "")
    return out


def changed_settings(config: Any, base: Any) -> list[str]:
    """The settings of ``config`` that differ from ``base`` (the schema's defaults), one ``key = value  (default:
    ...)`` line each in field order; a component ``base`` has and ``config`` does not is one ``section.name: off``."""
    now, before = flat_values(config), flat_values(base)
    lines = [f"{key} = {value!r}" + (f"  (default: {before[key]!r})" if key in before else "")
             for key, value in now.items() if key not in before or before[key] != value]
    dropped = {".".join(key.split(".")[:2]) for key in before if key not in now}
    return lines + [f"{component}: off" for component in sorted(dropped)]
