"""Every method page ends with "Where it lives", every file it lists exists, and no method-specific file is missing
from the pages (docs/extending.md#footprints counts these lists).

A file is **method-specific** when its name is a method's word. The method words are, mechanically:

* the stem of every method page (``docs/methods/NAME.md`` but ``index.md``) and of every preset
  (``configs/methods/NAME.yaml``);
* every component a preset names: a section's ``name`` (``credit.name``, ``rollout.name``, ``reference.name``,
  ``step_weighting.name``, ...), the keys of its ``loss`` and ``objectives`` maps, its rewards' names and its
  ``sampling.kind``;
* the command words of the one-method tools, ``TOOL_WORDS`` below;

less ``SHARED_NAMES`` below (parts any run may use). A word matches the stem of a file (its name without the
extension, and for a test without ``test_``) equal to it, equal to it with an ``s`` (``trees`` is ``tree``), or
starting with it and ``_`` (``tp_grpo_paper``). The files looked at are every ``*.py`` under ``flowalign/``,
``samplers/``, ``reward_models/`` and ``kernels/``, every preset, and every ``tests/*.py``; the protocol and package
modules ``base.py`` and ``__init__.py`` are never method-specific, and neither is a **deprecated shim**: a module
whose docstring begins ``Deprecated:`` and which warns with ``DeprecationWarning`` (an old import path kept for one
release, docs/reference/moved.md). A shim holds no code of the method, so no page may list it. The test reads text
only (the YAML of the presets, the Markdown of the pages, the source files), so it imports nothing of the package.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
METHODS = ROOT / "docs" / "methods"
PAGES = sorted(page for page in METHODS.glob("*.md") if page.name != "index.md")
PRESETS = sorted((ROOT / "configs" / "methods").glob("*.yaml"))
SECTION = "## Where it lives"
LISTED = re.compile(r"`([\w./-]+\.(?:py|yaml|md))`")

# The command words of the preparation tools, each serving one method, whose modules (``flowalign/prep/``) are named
# after the command, not the method: ``flowalign prep calibrate`` (DenseGRPO), ``prep fit-manifold`` (Shell-LCC),
# ``prep train-discriminator`` (DRL) and ``prep registers`` (Register-GRPO; its module is ``train_registers``).
TOOL_WORDS = {"calibrate", "fit_manifold", "train_discriminator", "train_registers"}
# Parts that presets name but that belong to no one method: rewards any run may score with, the default step
# weighting and the default reference policy.
SHARED_NAMES = {"toy_geneval", "toy_geneval_soft", "jpeg_compressibility", "uniform", "base"}
# The package and protocol modules of every component package.
NEVER_SPECIFIC = {"__init__.py", "base.py"}
SOURCE_FOLDERS = ("flowalign", "samplers", "reward_models", "kernels")


def where_it_lives(page: Path) -> str:
    """The text of the page's "Where it lives" section (empty when it has none)."""
    text = page.read_text(encoding="utf-8")
    start = text.find("\n" + SECTION + "\n")
    if start < 0:
        return ""
    rest = text[start + len(SECTION) + 2:]
    end = rest.find("\n## ")
    return rest if end < 0 else rest[:end]


def listed_files(page: Path) -> list[str]:
    return LISTED.findall(where_it_lives(page))


def preset_names(preset: Path) -> set[str]:
    """The components a preset names (see the module docstring), without those of its ``base:``."""
    data = yaml.safe_load(preset.read_text(encoding="utf-8")) or {}
    names = set()
    for key, section in data.items():
        if not isinstance(section, dict):
            continue
        if isinstance(section.get("name"), str):
            names.add(section["name"])
        if key in ("loss", "objectives"):
            names.update(section)
    for reward in (data.get("reward") or {}).get("rewards") or []:
        names.add(reward["name"])
    kind = (data.get("sampling") or {}).get("kind")
    if kind:
        names.add(kind)
    return names


def method_words() -> dict[str, str]:
    """Each method word and where it comes from."""
    words = {page.stem: f"the page {page.relative_to(ROOT)}" for page in PAGES}
    for preset in PRESETS:
        words.setdefault(preset.stem, f"the preset {preset.relative_to(ROOT)}")
        for name in preset_names(preset):
            words.setdefault(name, f"a component {preset.relative_to(ROOT)} names")
    for word in TOOL_WORDS:
        words.setdefault(word, "a one-method tool's command (TOOL_WORDS)")
    return {word: source for word, source in words.items() if word not in SHARED_NAMES}


def is_deprecated_shim(path: Path) -> bool:
    """An old import path kept for one release (module docstring): its docstring begins ``Deprecated:`` and it warns
    with ``DeprecationWarning``."""
    if path.suffix != ".py":
        return False
    text = path.read_text(encoding="utf-8")
    return text.lstrip().startswith('"""Deprecated:') and "DeprecationWarning" in text


def candidate_files() -> list[Path]:
    files = [path for folder in SOURCE_FOLDERS for path in (ROOT / folder).rglob("*.py")]
    files += PRESETS + sorted((ROOT / "tests").glob("*.py"))
    return sorted(path for path in files if path.name not in NEVER_SPECIFIC and not is_deprecated_shim(path))


def matching_word(path: Path, words) -> str | None:
    stem = path.stem.removeprefix("test_") if path.parent.name == "tests" else path.stem
    for word in sorted(words, key=len, reverse=True):
        if stem in (word, word + "s") or stem.startswith(word + "_"):
            return word
    return None


def test_every_method_page_ends_with_where_it_lives():
    assert PAGES, "no method pages found"
    for page in PAGES:
        headings = re.findall(r"^## .*$", page.read_text(encoding="utf-8"), flags=re.M)
        assert headings and headings[-1] == SECTION, (
            f"{page.relative_to(ROOT)} must end with a '{SECTION}' section (its last section is "
            f"{headings[-1] if headings else 'missing'!r})")
        assert listed_files(page), f"{page.relative_to(ROOT)}'s '{SECTION}' lists no file"


def test_every_listed_file_exists():
    missing = [f"{page.relative_to(ROOT)} lists {path}, which does not exist"
               for page in PAGES for path in listed_files(page) if not (ROOT / path).is_file()]
    assert not missing, "\n".join(missing)


def test_no_page_lists_a_deprecated_shim():
    """A method lives in its new homes: an old path that only re-exports and warns is not where it lives."""
    shims = [f"{page.relative_to(ROOT)} lists {path}, a deprecated shim: list the module it re-exports from "
             "(docs/reference/moved.md)"
             for page in PAGES for path in listed_files(page) if (ROOT / path).is_file()
             and is_deprecated_shim(ROOT / path)]
    assert not shims, "\n".join(shims)


def test_every_method_specific_file_appears_on_some_page():
    listed = {path for page in PAGES for path in listed_files(page)}
    words = method_words()
    unlisted = []
    for path in candidate_files():
        word = matching_word(path, words)
        relative = path.relative_to(ROOT).as_posix()
        if word is not None and relative not in listed:
            unlisted.append(f"{relative} is method-specific (its name matches {word!r}, from {words[word]}) but no "
                            f"docs/methods/*.md lists it under '{SECTION}'")
    assert not unlisted, "\n".join(unlisted)


def test_the_rule_finds_the_method_files_it_is_meant_to_find():
    """The mechanical rule on known cases: a plural, a prefix, a tool, a test, a shared name, a protocol module."""
    words = method_words()
    assert matching_word(ROOT / "flowalign/rollout/trees.py", words) == "tree"
    assert matching_word(ROOT / "tests/test_tp_grpo_released.py", words) == "tp_grpo"
    assert matching_word(ROOT / "flowalign/prep/fit_manifold.py", words) == "fit_manifold"
    assert matching_word(ROOT / "flowalign/prep/train_registers.py", words) == "train_registers"
    assert matching_word(ROOT / "flowalign/objectives/soar_math.py", words) == "soar"
    assert matching_word(ROOT / "tests/test_euphonium.py", words) == "euphonium"
    assert matching_word(ROOT / "reward_models/jpeg.py", words) is None
    assert matching_word(ROOT / "flowalign/losses/reference.py", words) is None
    assert "base" not in words and "discriminator" in words and "adjoint_matching" in words
    assert all(path.name not in NEVER_SPECIFIC for path in candidate_files())
    # a shim is recognised, and is no candidate; its new home is
    assert is_deprecated_shim(ROOT / "flowalign/training/manifold.py")
    assert not is_deprecated_shim(ROOT / "flowalign/prep/fit_manifold.py")
    assert ROOT / "flowalign/training/manifold.py" not in candidate_files()
