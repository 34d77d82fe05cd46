"""Command-line options generated from a settings dataclass, turned into the config loader's ``key=value`` overrides.

Every configurable command (``train``, ``prep ...``, ``sample``, ``eval ...``, ``toy ...``) is
``flowalign COMMAND [CONFIG] [key=value ...] [--option VALUE ...]`` and is built by ``flowalign.config.load_config``
from its dataclass: the YAML file ``CONFIG`` (with ``base:``; ``train`` without one reads ``configs/default.yaml``,
the default run), then the overrides. An option is sugar for an override:
``--steps 4``, ``--steps=4`` and ``steps=4`` are the same setting, and ``--a.b value`` works for any dotted key. So
every option is declared once, as the dataclass field (``flowalign.settings.option``: its help, and the flag when it
is not ``--<field-name>``), and ``--help`` is generated from the fields: help, type, default.

A field's option (``Flag``):

* a bool field is a switch (``--save-images`` sets it true; ``option(..., flag="binary-reward", flag_value=False)``
  makes ``--binary-reward`` set ``partial_credit`` false); give ``key=false`` to set a value explicitly;
* a list field takes one or more values (``--taps 0 2``), each converted by the field's ``parse`` when it has one;
* a component section (``flowalign.config.component``) gets one option for its name when its field declares a flag
  (``--guidance fk`` -> ``sampler.name=fk``) and one per setting of the registered components (``--lam 10`` ->
  ``sampler.lam=10``), named after the settings' fields or their flags; a setting the chosen component lacks is an
  error naming the components that have it.

Order: the config file, then the command line; of the command line, the overrides that name a component come first
(a layer naming a component starts its section afresh, so ``--lam 10 --guidance fk`` keeps ``lam``), then the
options, then the ``key=value`` items. Every mistake is a ``ConfigError`` naming the option as it was typed
(``[from --steps 0]``), reported before anything loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["ConfigCommand", "Flag", "add_config_command", "command_flags", "config_and_overrides",
           "dotted_options", "load_command_config", "load_from_args", "unknown_option"]

_MISSING = object()


@dataclass
class Flag:
    """One generated option: ``--option`` sets the dotted ``key``; ``owners`` are the components whose settings
    hold it (empty for a field of the command's own dataclass), ``section`` their section."""

    option: str
    key: str
    type: Any
    help: str
    default: Any
    parse: Callable[[str], Any] | None = None
    switch: Any = _MISSING  # the value a switch sets; _MISSING: the option takes a value
    metavar: str | None = None
    owners: list[str] = field(default_factory=list)
    section: str | None = None
    choices: tuple | None = None

    @property
    def many(self) -> bool:
        return _list_type(self.type)

    def override(self, values: Sequence[str]) -> str:
        """The ``key=value`` override for the typed ``values``; a ValueError from ``parse`` names the option."""
        if self.switch is not _MISSING:
            return f"{self.key}={json.dumps(self.switch)}"
        if self.parse is not None:
            try:
                parsed = [self.parse(v) for v in values]
            except ValueError as error:
                raise ValueError(f"argument {self.option}: {error}") from None
            return f"{self.key}={json.dumps(parsed if self.many else parsed[0])}"
        if self.many:
            return f"{self.key}=[{', '.join(values)}]"
        return f"{self.key}={values[0]}"


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _list_type(tp: Any) -> bool:
    tp = _strip_optional(tp)
    return tp is list or typing.get_origin(tp) is list


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return getattr(value, "name", value) if dataclasses.is_dataclass(value) else value
    return _MISSING


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_flag(f: dataclasses.Field, tp: Any, key: str, **extra: Any) -> Flag:
    meta = f.metadata
    switch = meta.get("flag_value", True if tp is bool else _MISSING)
    literal = _strip_optional(tp)
    choices = typing.get_args(literal) if typing.get_origin(literal) is typing.Literal else None
    return Flag(option="--" + meta["flag"] if "flag" in meta else _dashed(f.name), key=key, type=tp,
                help=meta.get("help", ""), default=_default(f), parse=meta.get("parse"), switch=switch,
                metavar=meta.get("metavar"), choices=choices, **extra)


def command_flags(cls: type) -> dict[str, Flag]:
    """The options of ``cls`` by option string: one per plain field, and for each component section its name (when
    its field declares a flag) and every setting of every registered component (a setting whose option a field of
    ``cls`` already has is left to ``--section.key``). Nested sections are reached with ``--a.b``."""
    from flowalign.config import resolve_reference

    flags: dict[str, Flag] = {}
    hints = typing.get_type_hints(cls)
    sections = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if "registry" in f.metadata:
            sections.append(f)
        elif not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            flag = _field_flag(f, tp, f.name)
            flags[flag.option] = flag
    for f in sections:
        if f.metadata.get("map"):
            continue  # several at once: only --section.entry.key
        registry = resolve_reference(f.metadata["registry"])
        if "flag" in f.metadata:
            option = "--" + f.metadata["flag"]
            flags[option] = Flag(option=option, key=f"{f.name}.name", type=str, help=f.metadata.get("help", ""),
                                 default=f.metadata.get("default"), choices=tuple(registry.names()),
                                 section=f.name)
        for name in registry.names():
            settings = registry.config_class(name)
            if settings is None:
                continue
            settings_hints = typing.get_type_hints(settings)
            for s in dataclasses.fields(settings):
                if s.name == "name":
                    continue
                flag = _field_flag(s, settings_hints[s.name], f"{f.name}.{s.name}", owners=[name], section=f.name)
                known = flags.get(flag.option)
                if known is None:
                    flags[flag.option] = flag
                elif known.key == flag.key and known.owners:
                    known.owners.append(name)
    return flags


# ------------------------------------------------------------------------------------------------ argparse


class _OverrideAction(argparse.Action):
    """Records ``--option VALUE`` as the override ``key=VALUE`` (in ``namespace.flag_overrides``, with how it was
    typed in ``namespace.flag_sources``)."""

    def __init__(self, option_strings, dest, *, flag: Flag, **kwargs):
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        values = [] if values is None else values if isinstance(values, list) else [values]
        try:
            text = self.flag.override(values)
        except ValueError as error:
            parser.error(str(error))
        overrides = list(getattr(namespace, "flag_overrides", None) or [])
        sources = dict(getattr(namespace, "flag_sources", None) or {})
        overrides.append(text)
        sources[text] = " ".join([option_string or self.flag.option, *values])
        namespace.flag_overrides, namespace.flag_sources = overrides, sources


def _describe_default(flag: Flag) -> str:
    if flag.default is _MISSING:
        return "required"
    if flag.switch is not _MISSING or flag.default is None:  # a switch; None: the help says what it means
        return ""
    return f"default: {flag.default!r}"


def _help_text(flag: Flag, section_option: str | None) -> str:
    text = flag.help.rstrip(".")
    notes = []
    if flag.choices:
        notes.append("one of " + ", ".join(map(str, flag.choices)))
    default = _describe_default(flag)
    if default:
        notes.append(default)
    if flag.owners and section_option:
        notes.append(f"with {section_option} {' / '.join(flag.owners)}")
    elif flag.owners:
        notes.append(f"{flag.section}: {' / '.join(flag.owners)}")
    if _dashed(flag.key) != flag.option:
        notes.append(f"= {flag.key}")
    return (f"{text} ({'; '.join(notes)})" if notes else text).replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, flags: dict[str, Flag]) -> None:
    """Declare the generated options on ``parser`` (each records an override; nothing else is stored)."""
    section_options = {f.section: f.option for f in flags.values() if f.key.endswith(".name") and f.section}
    for flag in flags.values():
        kwargs: dict[str, Any] = {}
        if flag.switch is not _MISSING:
            kwargs["nargs"] = 0
        elif flag.many:
            kwargs["nargs"] = "+"
        metavar = flag.metavar or ("{" + ",".join(map(str, flag.choices)) + "}" if flag.choices else
                                   flag.key.rsplit(".", 1)[-1].upper())
        if flag.switch is _MISSING:
            kwargs["metavar"] = metavar
        parser.add_argument(flag.option, action=_OverrideAction, flag=flag, dest=argparse.SUPPRESS,
                            default=argparse.SUPPRESS, help=_help_text(flag, section_options.get(flag.section)),
                            **kwargs)


@dataclass
class ConfigCommand:
    """A command built from ``cls`` by the loader; ``run(config, args)`` does its work once the config is built.

    ``flags``: generate ``cls``'s options (``train`` has only dotted ones); ``options``: a second dataclass whose
    options the command also takes (``prep calibrate``: rounds, eps1, eps2, out), built from those options alone and
    passed as ``args.options``; ``aliases``: extra options naming one dotted key each (``train --resume``);
    ``default_config``: the YAML a command line without a CONFIG builds on, relative to the working directory (``train``:
    ``configs/default.yaml``, the default run), where the schema's own defaults are the base of every config file."""

    cls: type | str  # a class, or "module:Name"
    run: Callable[[Any, argparse.Namespace], None]
    flags: bool = True
    options: type | str | None = None
    aliases: dict[str, tuple[str, str]] = field(default_factory=dict)  # option -> (key, help)
    default_config: str | None = None

    def schema(self) -> type:
        return _resolve(self.cls)

    def option_schema(self) -> type | None:
        return None if self.options is None else _resolve(self.options)

    def all_flags(self) -> dict[str, Flag]:
        flags: dict[str, Flag] = {}
        source = self.option_schema() or (self.schema() if self.flags else None)
        if source is not None:
            flags.update(command_flags(source))
        for option, (key, help) in self.aliases.items():
            flags[option] = Flag(option=option, key=key, type=str, help=help, default=None)
        return flags


def _resolve(cls: Any) -> type:
    """A schema given as a class, or as ``"module:Name"`` imported when the command is used (heavy modules load
    only for the command that runs)."""
    if isinstance(cls, type):
        return cls
    from flowalign.config import resolve_reference  # the same ``module:attribute`` lookup component sections use

    return resolve_reference(cls)


def add_config_command(commands, name: str, command: ConfigCommand, *, help: str, description: str):
    """The subcommand ``name``: ``[CONFIG] [key=value ...]``, ``--help-config`` and the generated options."""
    parser = commands.add_parser(name, help=help, description=description + " Options are sugar for key=value "
                                 "overrides (--steps 4 = steps=4; --a.b X for any dotted key); "
                                 "--help-config lists every key.")
    parser.add_argument("items", nargs="*", metavar="CONFIG|KEY=VALUE",
                        help="a YAML config (may name a 'base:'), then dotted key=value overrides")
    parser.add_argument("--help-config", action="store_true", help="print every config key with its help and exit "
                        "(with a CONFIG or overrides: with the values they give)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config (YAML) and exit")
    # its generated options are added when the command line names it (add_command_flags): resolving a schema imports
    # its module (and torch), which `flowalign --help` and the other commands never need
    parser.set_defaults(handler=_handler(command), command_spec=command, command_name=name, flags_added=False)
    return parser


def add_command_flags(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> None:
    """Add the generated options of the configurable commands under ``parser`` that the command line ``argv`` names
    (its leading words, e.g. ``eval toy``), or of every one when ``argv`` is None (the reference pages, tests)."""
    words = None if argv is None else [token for token in argv if not token.startswith("-")]

    def walk(sub: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*path, name))
        command = sub.get_default("command_spec")
        if command is None or sub.get_default("flags_added") or (words is not None and
                                                                  tuple(words[:len(path)]) != path):
            return
        add_flags(sub, command.all_flags())
        sub.set_defaults(flags_added=True)

    walk(parser, ())


def load_from_args(command: ConfigCommand, args: argparse.Namespace) -> Any:
    """The command's config from its parsed command line (and ``args.options`` when it has an options dataclass);
    every check runs, nothing loads."""
    flag_overrides = list(getattr(args, "flag_overrides", None) or [])
    sources = dict(getattr(args, "flag_sources", None) or {})
    flags = command.all_flags()
    options = command.option_schema()
    if options is not None:  # its options build it; the items and dotted options build the main config
        keys = {f.name for f in dataclasses.fields(options)}
        own = [o for o in flag_overrides if o.partition("=")[0] in keys]
        args.options = load_command_config(options, [], own, sources, flags)
        flag_overrides = [o for o in flag_overrides if o not in own]
    return load_command_config(command.schema(), args.items, flag_overrides, sources, flags,
                               default_config=command.default_config)


def _handler(command: ConfigCommand) -> Callable[[argparse.Namespace], None]:
    def handle(args: argparse.Namespace) -> None:
        from flowalign.config import format_help

        if args.help_config:
            print(format_help(command.schema(), values=_given_values(command, args)))
            return
        config = load_from_args(command, args)
        if args.print_config:
            print(config_yaml(config), end="")
            return
        command.run(config, args)

    return handle


def _given_values(command: ConfigCommand, args: argparse.Namespace) -> dict[str, Any] | None:
    """The dotted values of the config the command line gives (a CONFIG, overrides, or the command's default run),
    for ``--help-config``; None when it gives none (the schema's defaults are shown)."""
    from flowalign.config import flat_values

    given = (args.items or getattr(args, "flag_overrides", None)
             or (command.default_config is not None and Path(command.default_config).is_file()))
    return flat_values(load_from_args(command, args)) if given else None


def config_yaml(config: Any) -> str:
    """The resolved config as the YAML a run saves (``flowalign.config.save_config``): ``--print-config``."""
    import yaml

    from flowalign.config import to_saved_dict

    text = yaml.safe_dump(to_saved_dict(config), sort_keys=False, default_flow_style=None)
    return f"# fully resolved {type(config).__name__}\n{text}"


# ------------------------------------------------------------------------------------------------ loading


def config_and_overrides(items: Sequence[str], default: str | None = None) -> tuple[str | None, list[str]]:
    """``[CONFIG] [KEY=VALUE ...]`` -> (config path, overrides). A named config must exist; without one, ``default``
    (the command's default run, relative to the working directory) is the config, and must exist too."""
    from flowalign.config import ConfigError

    path, overrides = default, list(items)
    if overrides and "=" not in overrides[0]:
        path = overrides.pop(0)
        if not Path(path).is_file():
            raise ConfigError(f"config file {path!r} does not exist")
    elif default is not None and not Path(default).is_file():
        raise ConfigError(f"no CONFIG given and the default run's config {default!r} is not in {os.getcwd()}: run "
                          "from the repository root, or name a config first (e.g. "
                          "configs/methods/flow_grpo_fast.yaml or configs/models/sd35_medium.yaml)")
    stray = [item for item in overrides if "=" not in item]
    if stray:
        raise ConfigError(f"expected key=value after the config file, got {stray[0]!r} (only the first item may be a "
                          "config file; options are --key VALUE)")
    return path, overrides


def _component_first(overrides: Sequence[str], cls: type) -> list[str]:
    """Overrides naming a component (``sampler.name=fk``) first: a layer that names one starts its section afresh."""
    sections = {f.name for f in dataclasses.fields(cls) if "registry" in f.metadata and not f.metadata.get("map")}
    naming = [o for o in overrides if o.partition("=")[0] in {f"{s}.name" for s in sections}]
    return naming + [o for o in overrides if o not in naming]


def load_command_config(cls: type, items: Sequence[str], flag_overrides: Sequence[str],
                        sources: dict[str, str] | None = None, flags: dict[str, Flag] | None = None, *,
                        default_config: str | None = None) -> Any:
    """``load_config(cls, CONFIG, overrides)`` for a command line (module docstring); its ConfigErrors name the
    options as typed. Without a CONFIG, ``default_config`` (when given) is the config file."""
    from flowalign.config import ConfigError, load_config

    path, item_overrides = config_and_overrides(items, default_config)
    overrides = _component_first([*flag_overrides, *item_overrides], cls)
    try:
        return load_config(cls, path, overrides)
    except ConfigError as error:
        raise _explain(error, sources or {}, flags or {}) from None
    except TypeError as error:  # a field without a default that no layer set
        missing = re.findall(r"'(\w+)'", str(error).partition(":")[2])
        if not missing or "required" not in str(error):
            raise
        named = ", ".join(f"{m} ({_option_of(m, flags or {})} VALUE)" for m in missing)
        raise ConfigError(f"missing required setting{'s' if len(missing) > 1 else ''} {named}", key=missing[0]) \
            from None


def _option_of(key: str, flags: dict[str, Flag]) -> str:
    return next((f.option for f in flags.values() if f.key == key), _dashed(key))


def _explain(error: Exception, sources: dict[str, str], flags: dict[str, Flag]) -> Exception:
    """The loader's error with each override an option made shown as typed, and a setting the chosen component lacks
    explained by the components that have it."""
    from flowalign.config import ConfigError

    message, key = str(error), getattr(error, "key", None)
    for text, typed in sources.items():
        message = message.replace(f"override {text!r}", typed)
    if key is not None and "[from " not in message:  # a validate() error: say where the key came from
        typed = next((typed for text, typed in sources.items() if text.partition("=")[0] == key), None)
        if typed is not None:
            message += f" [from {typed}]"
    elif key is None:
        lead = re.match(r"[a-z_][\w.]*", message)
        typed = lead and next((t for text, t in sources.items() if text.partition("=")[0] == lead.group(0)), None)
        if typed:
            message += f" [from {typed}]"
    owner_flag = next((f for f in flags.values() if f.key == key and f.owners), None)
    chosen = re.search(r"'([^']*)' has no setting", message)
    if owner_flag is not None and chosen is not None:
        section = next((f.option for f in flags.values() if f.key == f"{owner_flag.section}.name"),
                       f"{owner_flag.section}.name=")
        source = re.search(r" \[from [^\]]*\]$", message)
        message = (f"{owner_flag.option} applies to {section} {' / '.join(owner_flag.owners)}, not "
                   f"{chosen.group(1)!r}: it has no setting {key.rsplit('.', 1)[-1]!r}{source.group(0) if source else ''}")
    return ConfigError(message, key=key)


# ------------------------------------------------------------------------------------------------ the raw argv


def dotted_options(argv: Sequence[str]) -> list[str]:
    """``--a.b VALUE`` and ``--a.b=VALUE`` (a dotted key) as the item ``a.b=VALUE``; other tokens unchanged."""
    out: list[str] = []
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, sep, value = token[2:].partition("=")
        if token.startswith("--") and "." in name and not name.startswith("."):
            key = name.replace("-", "_")
            if not sep and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                i += 1
                value = tokens[i]
            elif not sep:
                value = "true"  # a dotted switch: --a.flag
            out.append(f"{key}={value}")
        else:
            out.append(token)
        i += 1
    return out


def unknown_option(token: str, flags: dict[str, Flag], command: str) -> str:
    """The message for an option the command does not have, with the closest one."""
    name = token.partition("=")[0]
    options = sorted({*flags, "--help", "--help-config"})
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    if not close:  # a field name typed with underscores or a key typed as an option
        by_key = {f.key: f.option for f in flags.values()}
        bare = name.lstrip("-").replace("-", "_")
        close = [by_key[k] for k in difflib.get_close_matches(bare, list(by_key), n=1, cutoff=0.6)]
    hint = f"did you mean {close[0]}?" if close else f"`flowalign {command} --help` lists the options"
    return f"unrecognized option {name}: {hint}"
