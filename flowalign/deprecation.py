"""Old names that keep working for one release after a move (docs/reference/moved.md lists every move).

``moved_names(module, {old: "new.home:name"})`` is a module ``__getattr__`` (PEP 562): reading an old name imports
its new home when first read (so the old module need not depend on it, nor form an import cycle with it), warns with
a ``DeprecationWarning`` naming both places, and returns the object. ``warn_moved`` is that warning, which a moved
module's shim also gives when it is imported.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

__all__ = ["moved_names", "warn_moved"]


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` moved to ``new`` and goes in the next release.

    Args:
        old: the old dotted path (a module, or ``module.name``).
        new: where it lives now.
        stacklevel: as ``warnings.warn``'s; the default points at the code that read the old name.
    """
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release", DeprecationWarning,
                  stacklevel=stacklevel)


def moved_names(module: str, moves: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves the names that moved out of ``module``.

    Args:
        module: the old module's name (``__name__``).
        moves: old name -> its new home, ``"package.module:name"``.

    Returns:
        The ``__getattr__`` function: it warns and returns the moved object, and raises ``AttributeError`` for any
        other name.
    """

    def __getattr__(name: str) -> Any:
        target = moves.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new_name = target.partition(":")
        warn_moved(f"{module}.{name}", f"{home}.{new_name}")
        return getattr(importlib.import_module(home), new_name)

    return __getattr__
