"""Classes of the user's own where a registered name goes: ``module.path:ClassName`` or ``path/to/file.py:ClassName``.

A *reference* is a name with a colon: the right side is a class name, the left side a module path (imported with
``importlib.import_module``: an installed package, or one on ``PYTHONPATH``; the current directory is not added) or
the path of a Python file (it ends in ``.py``). Registered names never hold a colon, so a name is either one or the
other (``is_reference``).

Trust: naming a file runs it, like ``python file.py``; a module is imported, like ``import module.path``.

Files. A relative path is read from the ``folder`` the caller gives (the config loader gives the folder of the config
file that named it, and the current directory for a command-line override), else from the current directory;
``absolute_reference`` writes the reference with the absolute, normalised path, which is what a saved ``config.yaml``
holds, so a resumed run (and every process of a multi-process run, each of which loads the config) finds the file
again. A file is executed once per process and real path (``spec_from_file_location`` under a module name unique to
that path, ``flowalign_user_code_<stem>_<hash>``, put in ``sys.modules`` so that its dataclasses and type hints
resolve); a file that raises while it runs is not kept, so the next try runs it again.

Every mistake (no such file or module, no such class, a name that is not a class, a file that raises) is a
``flowalign.errors.SetupError`` (exit status 2 on the command line; the config loader makes it a ``ConfigError``
naming the key and the file) that names the reference and says what to fix; a missing class lists the classes the
module defines, with a did-you-mean.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
import types
import typing

from .errors import SetupError

__all__ = ["absolute_reference", "is_reference", "load_class", "missing_members"]

_MODULE_PREFIX = "flowalign_user_code"
_FILES: dict[str, types.ModuleType] = {}  # real path -> the module its execution made, once per process
FORM = "module.path:ClassName or path/to/file.py:ClassName"


def is_reference(name: object) -> bool:
    """Whether ``name`` names a class of the user's own (it holds a colon) rather than a registered component."""
    return isinstance(name, str) and ":" in name


def _split(reference: str) -> tuple[str, str]:
    """``(module or file, class name)``; a SetupError unless both sides are well formed."""
    where, _, attribute = reference.rpartition(":")
    if not where or not attribute.isidentifier():
        raise SetupError(f"{reference!r} is not a reference to a class: write {FORM}")
    if not _is_file(where) and not all(part.isidentifier() for part in where.split(".")):
        raise SetupError(f"{reference!r}: {where!r} is neither a module path (dotted names) nor a Python file "
                         f"(ending in .py): write {FORM}")
    return where, attribute


def _is_file(where: str) -> bool:
    return where.endswith(".py")


def absolute_reference(reference: str, folder: str | os.PathLike | None = None) -> str:
    """``reference`` with a file's path made absolute and normalised (a relative one read from ``folder``, else from
    the current directory); a module reference is returned as it is."""
    where, attribute = _split(reference)
    if not _is_file(where):
        return reference
    path = os.path.expanduser(where)
    if not os.path.isabs(path):
        path = os.path.join(os.path.abspath(folder) if folder is not None else os.getcwd(), path)
    return f"{os.path.normpath(path)}:{attribute}"


def _load_file(path: str, reference: str, folder: str | os.PathLike | None) -> types.ModuleType:
    real = os.path.realpath(path)
    if real in _FILES:
        return _FILES[real]
    if not os.path.isfile(real):
        read_from = f"a relative path is read from {os.path.abspath(folder)}" if folder is not None else (
            "a relative path is read from the current directory")
        raise SetupError(f"{reference!r}: no file {path} ({read_from}): give the path of an existing .py file")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(real))[0])
    name = f"{_MODULE_PREFIX}_{stem}_{hashlib.sha256(real.encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, real)
    if spec is None or spec.loader is None:
        raise SetupError(f"{reference!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and typing.get_type_hints look the module up there
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        sys.modules.pop(name, None)
        if not isinstance(error, Exception):
            raise
        lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == real]
        where = f"{path}, line {lines[-1]}" if lines else path
        raise SetupError(f"{reference!r}: running {where} raised {type(error).__name__}: {error} (fix the file; "
                         "its traceback is chained to this error)") from error
    _FILES[real] = module
    return module


def _import_module(module: str, reference: str) -> types.ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and (module == error.name or module.startswith(error.name + ".")):
            raise SetupError(f"{reference!r}: no module named {error.name!r} (a module path is imported like "
                             "'import module.path': install its package or put its folder on PYTHONPATH; for a "
                             "file, write path/to/file.py:ClassName)") from None
        raise SetupError(f"{reference!r}: importing {module} failed: {error}") from error
    except Exception as error:
        raise SetupError(f"{reference!r}: importing {module} raised {type(error).__name__}: {error}") from error


def load_class(reference: str, folder: str | os.PathLike | None = None,
               fits: typing.Callable[[type], bool] | None = None) -> type:
    """The class ``reference`` names (module docstring), its module imported or its file run on first use.

    A missing name is a SetupError listing the classes the module defines (those ``fits`` accepts, when given),
    with the closest first; a name that is not a class is a SetupError too."""
    where, attribute = _split(reference)
    if _is_file(where):
        path = absolute_reference(reference, folder).rpartition(":")[0]
        module = _load_file(path, reference, folder)
        origin = path
    else:
        module = _import_module(where, reference)
        origin = f"module {where}"
    found = getattr(module, attribute, None)
    if found is None:
        candidates = sorted(name for name, value in vars(module).items()
                            if isinstance(value, type) and value.__module__ == module.__name__
                            and (fits is None or fits(value)))
        close = difflib.get_close_matches(attribute, candidates, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        listed = ", ".join(candidates) if candidates else "(none that fit)"
        raise SetupError(f"{reference!r}: {origin} has no class {attribute!r}; {hint}its classes are: {listed}")
    if not isinstance(found, type):
        raise SetupError(f"{reference!r}: {attribute} in {origin} is a {type(found).__name__}, not a class: name a "
                         "class")
    return found


def missing_members(cls: type, protocol: type) -> list[str]:
    """The members of the ``typing.Protocol`` ``protocol`` that ``cls`` lacks: a method (``__call__`` included) must
    be defined by the class or a base; a data member (``name: str``) be a class attribute or an annotation of the
    class (an attribute its ``__init__`` sets)."""
    methods: set[str] = set()
    data: set[str] = set()
    for base in protocol.__mro__:
        if base in (object, typing.Protocol, typing.Generic) or not getattr(base, "_is_protocol", False):
            continue
        data.update(getattr(base, "__annotations__", {}))
        methods.update(name for name, value in vars(base).items()
                       if callable(value) and (not name.startswith("_") or name == "__call__"))
    defined = {name for klass in cls.__mro__ if klass is not object for name in vars(klass)}
    annotated = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    return sorted({name for name in methods if name not in defined}
                  | {name for name in data - methods if name not in defined and name not in annotated})
