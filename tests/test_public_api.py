"""``import flowalign``: cheap (lazy exports, PEP 562), exporting the names a user needs, each documented with\n``Args:`` and ``Returns:`` sections (Google style) where it takes parameters or returns a value."""

import ast
import inspect
import json
import re
import subprocess
import sys
import textwrap

import pytest

import flowalign

EXPORTS = {
    "TrainConfig": ("flowalign.training.config", "TrainConfig"),
    "load_config": ("flowalign.config", "load_config"),
    "Trainer": ("flowalign.training.trainer", "Trainer"),
    "load_flow_model": ("flowalign.models", "load_flow_model"),
    "FlowModel": ("flowalign.models", "FlowModel"),
    "Reward": ("flowalign.rewards", "Reward"),
    "register_reward": ("flowalign.rewards", "register_reward"),
    "Registry": ("flowalign.registry", "Registry"),
    "register_credit": ("flowalign.credit", "register_credit"),
    "register_loss": ("flowalign.losses", "register_loss"),
    "register_objective": ("flowalign.objectives", "register_objective"),
    "register_shape": ("flowalign.rollout", "register_shape"),
    "register_sampler": ("flowalign.inference", "register_sampler"),
    "GuidedSampler": ("flowalign.inference", "GuidedSampler"),
}

# A fresh interpreter times the import itself, then reports what it loaded.
PROBE = """
import json, sys, time
start = time.perf_counter()
import flowalign
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "heavy": sorted(m for m in ("torch", "diffusers", "transformers", "numpy",
                                                                  "flowalign.training.trainer") if m in sys.modules),
                  "dir": dir(flowalign), "all": flowalign.__all__}))
"""


def probe() -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_import_flowalign_is_cheap_and_loads_no_torch():
    runs = [probe() for _ in range(3)]  # the best of three: a loaded machine slows one run, not the import
    assert all(run["heavy"] == [] for run in runs), runs[0]["heavy"]
    assert min(run["seconds"] for run in runs) < 0.3, [run["seconds"] for run in runs]
    assert set(EXPORTS) <= set(runs[0]["dir"]) and sorted(runs[0]["all"]) == sorted(EXPORTS)


def test_every_export_resolves_to_its_defining_object():
    import importlib

    assert sorted(flowalign.__all__) == sorted(EXPORTS)
    for name, (module, attribute) in EXPORTS.items():
        assert getattr(flowalign, name) is getattr(importlib.import_module(module), attribute), name
    from flowalign import Trainer, Registry, register_reward  # noqa: F401 - ``from`` imports work too

    assert set(EXPORTS) <= set(dir(flowalign)) and "__version__" in dir(flowalign)


def test_an_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'flowalign' has no attribute 'register_credits'"):
        flowalign.register_credits  # noqa: B018
    assert not hasattr(flowalign, "nope")


# --- docstrings: every exported name documents its parameters and return value (Google style, as the API page's
# mkdocstrings renders them into tables) ----------------------------------------------------------------------------

# The trainer's public API is its constructor, ``train`` and ``step``; its other methods are the loop's parts.
METHODS_OF = {"Trainer": ("train", "step")}
SECTION = re.compile(r"^(Args|Returns|Yields):\s*$")
ENTRY = re.compile(r"^    (\*{0,2}\w+)(?: \([^)]*\))?:(?: |$)")


def sections(doc: str) -> dict[str, list[str]]:
    """The Google-style sections of a cleaned docstring: section name -> its lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        match = SECTION.match(line)
        if match:
            current = found.setdefault(match.group(1), [])
        elif current is not None and (line.startswith(" ") or not line):
            current.append(line)
        else:
            current = None
    return found


def documented_arguments(doc: str) -> set[str]:
    return {match.group(1).lstrip("*") for line in sections(doc).get("Args", []) if (match := ENTRY.match(line))}


def returns_a_value(function) -> bool:
    """Whether ``function`` returns something: its return annotation, else a ``return <value>`` of its own body."""
    annotation = inspect.signature(function).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError):
        return False
    body = tree.body[0]
    nested = {node for child in ast.walk(body) if child is not body
              and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for node in ast.walk(child)}
    return any(isinstance(node, ast.Return) and node.value is not None and node not in nested
               and not (isinstance(node.value, ast.Constant) and node.value.value is None) for node in ast.walk(body))


def parameters(signature: inspect.Signature, method: bool = False) -> list[str]:
    """The parameter names a docstring documents: all, but a method's ``self`` or ``cls``."""
    names = list(signature.parameters)
    return names[1:] if method and names[:1] in (["self"], ["cls"]) else names


def callable_problems(label: str, function, doc: str | None, method: bool = False) -> list[str]:
    if not doc:
        return [f"{label} has no docstring"]
    problems = []
    missing = [name for name in parameters(inspect.signature(function), method)
               if name not in documented_arguments(doc)]
    if missing:
        problems.append(f"{label}: its docstring's Args: section does not document {', '.join(missing)}")
    wrapped = inspect.unwrap(function)
    if returns_a_value(wrapped) and not ({"Returns", "Yields"} & set(sections(doc))):
        problems.append(f"{label} returns a value but its docstring has no Returns: (or Yields:) section")
    return problems


def class_problems(name: str, cls: type) -> list[str]:
    problems = []
    doc = inspect.getdoc(cls)
    if not doc:
        return [f"flowalign.{name} has no docstring"]
    # a Protocol's constructor is typing's placeholder (*args, **kwargs): it has no parameters of its own
    arguments = [] if typing_protocol(cls) else parameters(inspect.signature(cls))  # bound: no self
    init_doc = cls.__dict__["__init__"].__doc__ if "__init__" in cls.__dict__ else None
    documented = documented_arguments(doc) | documented_arguments(inspect.cleandoc(init_doc or ""))
    missing = [argument for argument in arguments if argument not in documented]
    if missing:
        problems.append(f"flowalign.{name}: the class docstring's Args: section does not document "
                        f"{', '.join(missing)} (its constructor's parameters)")
    for member, value in public_members(name, cls):
        label = f"flowalign.{name}.{member}"
        if isinstance(value, property):
            if not (value.__doc__ or "").strip():
                problems.append(f"{label} (a property) has no docstring")
            continue
        function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        problems += callable_problems(label, function, inspect.getdoc(function), method=True)
    return problems


def typing_protocol(cls: type) -> bool:
    return bool(getattr(cls, "_is_protocol", False))


def public_members(name: str, cls: type):
    """The public methods and properties ``cls`` defines itself (``__call__`` counts as public)."""
    only = METHODS_OF.get(name)
    for member, value in vars(cls).items():
        if member.startswith("_") and member != "__call__":
            continue
        if only is not None and member not in only:
            continue
        if isinstance(value, (property, classmethod, staticmethod)) or inspect.isfunction(value):
            yield member, value


def test_every_export_documents_its_parameters_and_return_value():
    problems = []
    for name in sorted(flowalign.__all__):
        value = getattr(flowalign, name)
        if inspect.isclass(value):
            problems += class_problems(name, value)
        else:
            problems += callable_problems(f"flowalign.{name}", value, inspect.getdoc(value))
    assert not problems, "\n".join(problems)


def test_the_docstring_check_sees_a_missing_argument_and_a_missing_returns():
    def documented(a, b):
        """Add.

        Args:
            a: one.
            b (int): the other.

        Returns:
            The sum.
        """
        return a + b

    def undocumented(a, *, scale=1):
        """Scale ``a``; no sections."""
        return a * scale

    assert callable_problems("documented", documented, inspect.getdoc(documented)) == []
    assert callable_problems("undocumented", undocumented, inspect.getdoc(undocumented)) == [
        "undocumented: its docstring's Args: section does not document a, scale",
        "undocumented returns a value but its docstring has no Returns: (or Yields:) section"]
