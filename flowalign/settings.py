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

__all__ = ["at_least", "check", "finite", "option", "section"]


def option(default: Any, help: str) -> Any:
    """A field with a help string; list and dict defaults are copied for each instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


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
