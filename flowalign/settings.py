"""Helpers for settings dataclasses: fields with help strings, and range checks that raise ``ConfigError``.

Every config section and every component's settings (``flowalign.components``) declare their fields with ``option``
and check them in ``validate`` with ``check``, ``at_least`` and ``finite``, which name the key at fault: a top-level
section names its dotted key (``optim.lr``), a component its own setting (``fusion``), to which the loader puts the
section in front.
"""

from __future__ import annotations

import copy
import math
from dataclasses import field
from typing import Any

from flowalign.config import ConfigError

__all__ = ["at_least", "check", "finite", "option", "parse_json_object", "parse_sigma_band", "redefault", "flagged", "section"]

_MISSING = object()


def option(default: Any, help: str, *, flag: str | None = None, flag_value: Any = _MISSING, parse: Any = None,
           metavar: str | None = None) -> Any:
    """A field with a help string; list and dict defaults are copied for each instance.

    The rest describes the field's command-line option (``flowalign.cli.options``), which is ``--<name>`` with
    dashes by default: ``flag`` another name (``flag="out"`` for ``out_dir``); ``flag_value`` makes the option a
    switch that sets this value (a bool field's option is a switch setting ``True`` unless told otherwise, e.g.
    ``flag="binary-reward", flag_value=False``); ``parse`` turns one typed value into the field's (``"0.8:0.3"`` ->
    ``[0.8, 0.3]``), raising ValueError with a message for the user; ``metavar`` names the value in ``--help``.
    """
    metadata: dict[str, Any] = {"help": help}
    if flag is not None:
        metadata["flag"] = flag
    if flag_value is not _MISSING:
        metadata["flag_value"] = flag_value
    if parse is not None:
        metadata["parse"] = parse
    if metavar is not None:
        metadata["metavar"] = metavar
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def redefault(cls: type, name: str, default: Any) -> Any:
    """Field ``name`` of the settings dataclass ``cls`` (its help and option) with another default, for a subclass
    that changes only the default (``steps: int = redefault(SamplingRun, "steps", 10)``)."""
    from dataclasses import fields

    (parent,) = [f for f in fields(cls) if f.name == name]
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=parent.metadata)
    return field(default=default, metadata=parent.metadata)


def flagged(component_field: Any, flag: str) -> Any:
    """A ``flowalign.config.component`` field whose name is also set by the option ``--<flag>``
    (``sampler: ComponentConfig = flagged(component(...), "guidance")``: ``--guidance fk`` is ``sampler.name=fk``)."""
    return field(default_factory=component_field.default_factory, metadata={**component_field.metadata, "flag": flag})


def section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


def check(ok: bool, key: str, message: str) -> None:
    """``ConfigError("<key> <message>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} {message}", key=key)


def at_least(key: str, value: int | None, low: int) -> None:
    """Integers with a lower bound (``None`` passes: it means 'not set')."""
    if value is not None:
        check(value >= low, key, f"must be >= {low}, got {value}")


def finite(key: str, value: float, low: float, *, strict: bool = False, high: float | None = None,
           note: str = "") -> None:
    """Floats in ``[low, high]`` (``(low, high]`` when ``strict``), finite unless ``high`` is ``math.inf``."""
    if math.isnan(value) or (math.isinf(value) and high != math.inf):
        raise ConfigError(f"{key} must be a finite number, got {value}", key=key)
    lower = "> " if strict else ">= "
    accepted = f"{lower}{low:g}" if high is None else f"in {'(' if strict else '['}{low:g}, {high:g}]"
    in_range = (value > low if strict else value >= low) and (high is None or value <= high)
    check(in_range, key, f"must be {accepted}, got {value:g}{note}")


def parse_sigma_band(text: str) -> list[float]:
    """``SIGMA:SCALE`` (e.g. ``0.8:0.3``) as ``[sigma, scale]``, two finite numbers."""
    try:
        sigma, scale = (float(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"expected SIGMA:SCALE such as 0.8:0.3, got {text!r}") from None
    if not (math.isfinite(sigma) and math.isfinite(scale)):
        raise ValueError(f"expected finite numbers, got {text!r}")
    return [sigma, scale]


def parse_json_object(text: str) -> dict:
    """A JSON object (``'{"device": "cpu"}'``) as a dict, e.g. a reward's constructor arguments."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"expected a JSON object such as '{{\"device\": \"cpu\"}}', got {text!r} "
                         f"({error.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object ({{...}}), got {type(value).__name__} {text!r}")
    return value
