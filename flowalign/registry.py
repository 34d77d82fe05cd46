"""A registry of components by name: the one mechanism behind ``register_reward`` and the later component kinds.

    REWARDS = Registry("reward")
    REWARDS.register("brightness", BrightnessReward)    # a factory: a class, or any callable
    REWARDS.build("brightness", channel=1)              # factory(**kwargs)

A component may be registered with its *config dataclass*; it is then built from one instance of it:

    CREDIT = Registry("credit estimator")

    @CREDIT.register("tree", config=TreeCreditConfig)
    class TreeCredit: ...

    CREDIT.build("tree", TreeCreditConfig(fusion="mean"))   # factory(config)
    CREDIT.build("tree", fusion="mean")                     # the same: TreeCreditConfig(fusion="mean"), validated

Keyword arguments become the dataclass (an unknown key is a ValueError with the closest field), and its
``validate()`` runs when it has one. An unknown name is a ValueError listing the known names, with a did-you-mean
(``difflib``); registering a name twice is refused unless ``overwrite=True``. ``kind`` names the component in every
message ("unknown reward 'nope': known rewards are ...").

A registry answers ``name in registry``, ``len(registry)`` and iterates over its names (sorted), like the dict of
factories it replaces; ``get(name)`` is the factory, ``unregister(name)`` removes it.

Classes of the user's own. Wherever a registered name is looked up, a *reference* ``module.path:ClassName`` or
``path/to/file.py:ClassName`` (``flowalign.user_code``) names a class instead: ``resolve(name, folder)`` loads it
(a relative file path is read from ``folder``, else from the current directory), checks it against the registry's
``protocol`` and registers it under the reference with the file's absolute path, which it returns; ``get``,
``build``, ``config_class`` and ``in`` resolve a reference the same way on first use. Such a class brings its
settings as its ``config_class`` attribute, a dataclass (``flowalign.components.Component.config_class``, which a
built-in gives ``register(config=...)`` instead); without one it is built from keyword arguments. ``names()`` lists
only the registered names.

The ``protocol`` is the class every entry must be: given (``Registry("reward", protocol=Reward)``; a
``typing.Protocol`` is checked member by member, ``flowalign.user_code.missing_members``), or else the most derived
class that every registered class strictly derives from (``CreditEstimator`` for the credit estimators): a class of
the user's own must subclass it.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

from .errors import SetupError
from .user_code import absolute_reference, is_reference, load_class, missing_members

__all__ = ["Registry"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Entry:
    factory: Callable[..., Any]
    config: type | None


class Registry(Generic[T]):
    """Components of one ``kind`` by name (module docstring); ``plural`` defaults to ``kind + "s"``, ``protocol`` is
    the class a user's class must be (inferred from the registered ones when None).

    Args:
        kind: what the registry holds, as error messages name it ("credit estimator").
        plural: its plural in error messages; None is ``kind + "s"``.
        protocol: the class (or ``typing.Protocol``) every entry must be; None infers it from the registered classes.
    """

    def __init__(self, kind: str, *, plural: str | None = None, protocol: type | None = None):
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self._protocol = protocol
        self._entries: dict[str, _Entry] = {}
        self._user: set[str] = set()  # names of classes loaded from references (module docstring)

    # ----------------------------------------------------------------------------------------- registering
    def register(self, name: str, factory: Callable[..., T] | None = None, *, config: type | None = None,
                 overwrite: bool = False) -> Any:
        """Register ``factory`` (a class or callable) under ``name``, built from ``config`` instances when given.

        Returns ``factory``; without one, a decorator that registers what it decorates. A name already registered
        is a ValueError unless ``overwrite``.

        Args:
            name: the name a config uses (``credit: {name: NAME}``); a non-empty string.
            factory: the class or callable to register; None makes this call a decorator.
            config: the settings dataclass the component is built from (``factory(config)``), or None for a
                factory that takes keyword arguments.
            overwrite: replace a name already registered instead of refusing it.

        Returns:
            ``factory``, or, without one, a decorator that registers what it decorates and returns it.
        """
        if factory is None:
            return lambda decorated: self.register(name, decorated, config=config, overwrite=overwrite)
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if not callable(factory):
            raise TypeError(f"{self.kind} {name!r}: the factory must be callable, got {type(factory).__name__}")
        if config is not None and not (isinstance(config, type) and dataclasses.is_dataclass(config)):
            raise TypeError(f"{self.kind} {name!r}: config must be a dataclass type, got {config!r}")
        if name in self._entries and not overwrite:
            raise ValueError(f"{self.kind} {name!r} is already registered (pass overwrite=True to replace it)")
        self._entries[name] = _Entry(factory, config)
        return factory

    def unregister(self, name: str) -> Callable[..., T]:
        """Remove ``name``; returns its factory.

        Args:
            name: a registered name (an unknown one is a ValueError, as in ``get``).

        Returns:
            The factory that was registered under ``name``.
        """
        factory = self.get(name)
        name = self.resolve(name)
        del self._entries[name]
        self._user.discard(name)
        return factory

    # --------------------------------------------------------------------------------------------- looking up
    def names(self) -> list[str]:
        """The registered names, sorted (not the classes loaded from references).

        Returns:
            The names, in sorted order.
        """
        return sorted(n for n in self._entries if n not in self._user)

    @property
    def protocol(self) -> type:
        """The class every entry must be (module docstring): the one given, or the most derived class every registered
        class strictly derives from (``object`` when an entry is not a class).

        Returns:
            The protocol class.
        """
        if self._protocol is not None:
            return self._protocol
        classes = [e.factory for n, e in self._entries.items() if n not in self._user]
        if not classes or not all(isinstance(c, type) for c in classes):
            return object
        common = set(classes[0].__mro__[1:]).intersection(*(c.__mro__[1:] for c in classes[1:]))
        return next(c for c in classes[0].__mro__ if c in common)

    def fits(self, cls: type) -> bool:
        """Whether the class ``cls`` is a ``protocol`` (a subclass, or every member of a ``typing.Protocol``).

        Args:
            cls: the class to check.

        Returns:
            True when ``cls`` fits the protocol.
        """
        protocol = self.protocol
        if getattr(protocol, "_is_protocol", False):
            return not missing_members(cls, protocol)
        return issubclass(cls, protocol)

    def resolve(self, name: str, folder: str | os.PathLike | None = None) -> str:
        """The name ``name`` is registered under: itself, or for a reference (module docstring) the reference with
        the file's absolute path, its class loaded, checked against ``protocol`` and registered on first use.

        An unknown registered name is a ValueError listing the known ones, with a did-you-mean; a reference that does
        not load, or whose class is not a ``protocol`` or has settings that are not a dataclass, a SetupError (a
        ValueError).

        Args:
            name: a registered name or a reference (``module.path:Class`` or ``path/to/file.py:Class``).
            folder: the folder a relative file path is read from; None is the current directory.

        Returns:
            The name the entry is registered under.
        """
        if name in self._entries:
            return name
        if not is_reference(name):
            self._entry(name)  # raises the unknown-name error
        canonical = absolute_reference(name, folder)
        if canonical in self._entries:
            return canonical
        cls = load_class(name, folder, fits=self.fits)
        if not self.fits(cls):
            protocol = self.protocol
            article = "an" if self.kind[:1] in "aeiou" else "a"
            if getattr(protocol, "_is_protocol", False):
                lacks = ", ".join(missing_members(cls, protocol))
                fix = f"it lacks {lacks} of the {protocol.__name__} protocol ({protocol.__module__}): define them"
            else:
                fix = (f"{article} {self.kind} subclasses {protocol.__module__}.{protocol.__qualname__}: write "
                       f"'class {cls.__name__}({protocol.__name__}): ...'")
            raise SetupError(f"{name!r}: {cls.__qualname__} is not {article} {self.kind}: {fix}")
        settings = getattr(cls, "config_class", None)
        if settings is not None and not (isinstance(settings, type) and dataclasses.is_dataclass(settings)):
            raise SetupError(f"{name!r}: {cls.__qualname__}.config_class must be a dataclass of its settings, got "
                             f"{settings!r}")
        self.register(canonical, cls, config=settings)
        self._user.add(canonical)
        return canonical

    def closest(self, name: str) -> str | None:
        """The registered name closest to ``name`` (``difflib``, cutoff 0.6), or None.

        Args:
            name: a name that may be misspelled.

        Returns:
            The closest registered name, or None when none is close enough.
        """
        close = difflib.get_close_matches(str(name), self.names(), n=1, cutoff=0.6)
        return close[0] if close else None

    def get(self, name: str) -> Callable[..., T]:
        """The factory of ``name``; an unknown name is a ValueError listing the known ones, with a did-you-mean.

        Args:
            name: a registered name.

        Returns:
            The class or callable registered under ``name``.
        """
        return self._entry(name).factory

    def config_class(self, name: str) -> type | None:
        """The config dataclass ``name`` was registered with, or None.

        Args:
            name: a registered name.

        Returns:
            Its settings dataclass, or None for a component built from keyword arguments.
        """
        return self._entry(name).config

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None and is_reference(name):
            return self._entries[self.resolve(name)]
        if entry is None:
            close = self.closest(name)
            hint = f"; did you mean {close!r}?" if close is not None and close != name else ""
            raise ValueError(f"unknown {self.kind} {name!r}: known {self.plural} are "
                             f"{', '.join(self.names()) or '(none)'}{hint}")
        return entry

    def __contains__(self, name: object) -> bool:
        """A registered name, or a reference whose class loads and fits (loading it, module docstring)."""
        if name in self._entries:
            return True
        if not is_reference(name):
            return False
        try:
            self.resolve(name)
        except ValueError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"

    # ------------------------------------------------------------------------------------------------ building
    def make_config(self, name: str, values: Mapping[str, Any] | None = None) -> Any:
        """``name``'s config dataclass from ``values``: an unknown key is a ValueError naming the closest field, a
        missing required one a ValueError naming it; the instance's ``validate()`` runs when it has one.

        Args:
            name: a name registered with a config dataclass (a TypeError otherwise).
            values: the settings by field name; None for all defaults.

        Returns:
            The validated config dataclass instance.
        """
        cls = self.config_class(name)
        if cls is None:
            raise TypeError(f"{self.kind} {name!r} has no config dataclass; build it with keyword arguments")
        values = dict(values or {})
        fields = [f.name for f in dataclasses.fields(cls) if f.init]
        for key in values:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"its settings are: {', '.join(fields) or '(none)'}"
                raise ValueError(f"{self.kind} {name!r} has no setting {key!r}: {hint}")
        missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in values
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{self.kind} {name!r} needs the setting{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))}")
        config = cls(**values)
        if callable(getattr(config, "validate", None)):
            config.validate()
        return config

    def build(self, name: str, config: Any = None, /, **kwargs: Any) -> T:
        """Build ``name``: ``factory(**kwargs)``, or, for a component with a config dataclass, ``factory(config)``
        with ``config`` given or made from ``kwargs`` (``make_config``).

        Args:
            name: a registered name.
            config: an instance of ``name``'s config dataclass (positional only); None makes it from ``kwargs``.
            **kwargs: the factory's keyword arguments, or the settings of its config dataclass.

        Returns:
            The built component.
        """
        entry = self._entry(name)
        if entry.config is None:
            if config is not None:
                raise TypeError(f"{self.kind} {name!r} has no config dataclass; build it with keyword arguments")
            return entry.factory(**kwargs)
        if config is None:
            config = self.make_config(name, kwargs)
        elif kwargs:
            raise TypeError(f"{self.kind} {name!r}: pass a config or keyword arguments, not both")
        elif not isinstance(config, entry.config):
            raise TypeError(f"{self.kind} {name!r} is built from a {entry.config.__name__}, got "
                            f"{type(config).__name__}")
        return entry.factory(config)
