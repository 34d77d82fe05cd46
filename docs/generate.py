"""The generated blocks of the docs: the model-family tables and the comparison tables.

A page marks a generated block with two comments; everything outside them is hand-written and left alone::

    <!-- generated: families-image (python docs/generate.py) -->
    ...the table, rewritten by the generator...
    <!-- end generated -->

Each block is rendered from the code where the code knows the answer, and from a data file under ``docs/data/`` where
it does not:

* ``families-image``, ``families-video`` (docs/guides/adding-a-model.md) and ``video-families`` (docs/guides/video.md):
  one row per family registered with ``@register_model_family``, in the order of ``docs/data/families.yaml``. The
  pipeline class, the condition images (``takes_condition_images``, ``max_condition_images``,
  ``requires_condition_images``), the experts (``experts``) and the preset (the ``configs/models/*.yaml`` whose
  ``model.family`` names the family) come from the code; what a reader cannot get from a class attribute (the text
  encoders, the time convention, what the tests check) from ``families.yaml``.
* ``comparison-sources``, ``comparison-features`` (docs/comparison.md) and ``comparison-summary`` (README.md): the
  peers' cells verbatim from ``docs/data/comparison.yaml``; flowalign's cells are text there, ``{derive: NAME}`` or a
  list of such parts. A derived part lists the labels (from the same file) of what is registered: model families,
  the method presets that train with the GRPO loss, objectives and loss terms, SDE kinds, rewards, guided samplers,
  engines (``DERIVED``).

Only built-in components count (a component a test or a user registered in this process is left out), so the output
does not depend on what else ran. A registered name without an entry in the data file, or an entry naming nothing
registered, is an error naming the file, the key and the name.

    python docs/generate.py           # rewrite the blocks in place
    python docs/generate.py --check   # exit 1 with a diff of each stale block; write nothing
"""

from __future__ import annotations

import argparse
import difflib
import functools
import hashlib
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python docs/generate.py"
DATA = Path("docs/data")
WIDTH = 120  # the prose width of the pages
# The pages that may hold generated blocks (relative to the repository root).
PAGES = ("README.md", "docs/comparison.md", "docs/guides/adding-a-model.md", "docs/guides/video.md")
# A generated block: the opening comment (its name, then free text), the body, the closing comment.
BLOCK = re.compile(r"<!-- generated: (?P<name>[a-z-]+)[^\n]*?-->\n(?P<body>.*?)(?P<close><!-- end generated -->)",
                   re.DOTALL)


class DocsDataError(ValueError):
    """A data file under docs/data/ disagrees with the code (a missing or unknown name) or is malformed."""


# ------------------------------------------------------------------------------------------------ helpers


def _builtin(module: str) -> bool:
    """A component the package registers itself: defined in ``flowalign`` or its ``kernels``."""
    return module.split(".")[0] in ("flowalign", "kernels")


def _registered(registry: Any) -> list[str]:
    """The built-in names of a ``flowalign.registry.Registry``, sorted."""
    return [name for name in registry.names() if _builtin(getattr(registry.get(name), "__module__", ""))]


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, one line."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _row(cells: Iterable[str]) -> str:
    return "|" + "|".join(f" {_cell(cell)} " if cell else " " for cell in cells) + "|"


def _table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = [_row(header), "|" + "---|" * len(header), *(_row(row) for row in rows)]
    return "\n".join(lines) + "\n"


def _load(name: str, root: Path) -> Any:
    path = root / DATA / name
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise DocsDataError(f"{DATA / name}: cannot read it ({error})") from None


def _labels(names: Iterable[str], labels: dict[str, Any], where: str) -> list[str]:
    """The labels of ``names`` (every one must have an entry in ``labels``; null leaves it out), in the order of
    ``labels``, each label once (several names may share one), and an error for a label of no registered name."""
    names = list(names)
    missing = [name for name in names if name not in labels]
    unknown = [name for name in labels if name not in names]
    if missing or unknown:
        raise DocsDataError(f"{where}: " + "; ".join(
            part for part in (f"add {missing} (registered, no label; null to leave one out)" if missing else "",
                              f"remove {unknown} (not registered)" if unknown else "") if part))
    out: list[str] = []
    for name, label in labels.items():
        if label is not None and label not in out:
            out.append(str(label))
    return out


# ------------------------------------------------------------------------------------------------ the families


def _families(modality: str | None = None) -> dict[str, type]:
    from flowalign.models import MODEL_FAMILIES

    adapters = {name: MODEL_FAMILIES.get(name) for name in _registered(MODEL_FAMILIES)}
    return {name: adapter for name, adapter in adapters.items() if modality in (None, adapter.modality)}


def _family_facts(modality: str, root: Path) -> list[tuple[str, type, dict[str, Any]]]:
    """``(name, adapter, facts)`` of each registered family of ``modality``, in ``families.yaml``'s order."""
    data = _load("families.yaml", root) or {}
    adapters = _families(modality)
    unknown = [name for name in data if name not in _families()]
    missing = [name for name in adapters if name not in data]
    if missing or unknown:
        raise DocsDataError(f"{DATA / 'families.yaml'}: " + "; ".join(
            part for part in (f"add an entry for the registered families {missing}" if missing else "",
                              f"remove {unknown} (no such family is registered)" if unknown else "") if part))
    return [(name, adapters[name], facts) for name, facts in data.items() if name in adapters]


def _presets(root: Path) -> dict[str, list[str]]:
    """The model presets of each family: ``configs/models/*.yaml`` by ``model.family``."""
    out: dict[str, list[str]] = {}
    for path in sorted((root / "configs/models").glob("*.yaml")):
        family = ((yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("model") or {}).get("family")
        if family:
            out.setdefault(family, []).append(f"`configs/models/{path.name}`")
    return out


def _fact(facts: dict[str, Any], name: str, key: str) -> str:
    if key not in facts:
        raise DocsDataError(f"{DATA / 'families.yaml'}: {name}.{key} is missing")
    return str(facts[key])


def _condition_images(adapter: type) -> str:
    if not adapter.takes_condition_images:
        return "—"
    count = "any number" if adapter.max_condition_images is None else str(adapter.max_condition_images)
    if adapter.requires_condition_images:
        return "the first frame, required" if adapter.modality == "video" and count == "1" else f"{count}, required"
    return f"{count}, optional"


def _experts(adapter: type) -> str:
    experts = getattr(adapter, "experts", None)
    return ", ".join(f"`{name}`" for name in experts) if experts else "one"


def _families_table(modality: str, root: Path) -> str:
    presets = _presets(root)
    rows = []
    for name, adapter, facts in _family_facts(modality, root):
        row = [f"`{name}`", _fact(facts, name, "model"), f"`{adapter.pipeline_class_name}`", _condition_images(adapter)]
        if modality == "video":
            row.append(_experts(adapter))
        row += [_fact(facts, name, key) for key in ("text_encoders", "time", "guidance", "parity", "lora", "trains")]
        row.append(", ".join(presets.get(name, [])) or "—")
        rows.append(row)
    header = ["family", "model", "diffusers pipeline", "condition images", *(["experts"] if modality == "video" else []),
              "text encoder(s)", "time the transformer takes, sign", "guidance", "bitwise ODE parity", "LoRA round trip",
              "trains", "preset"]
    return _table(header, rows)


def families_image(inputs: "Inputs") -> str:
    return _families_table("image", inputs.root)


def families_video(inputs: "Inputs") -> str:
    return _families_table("video", inputs.root)


def video_families(inputs: "Inputs") -> str:
    """The short table of docs/guides/video.md: what a user picks a video family by."""
    root = inputs.root
    presets = _presets(root)
    rows = [[f"`{name}`", _fact(facts, name, "model"), f"`{adapter.pipeline_class_name}`", _condition_images(adapter),
             _experts(adapter), str(adapter.default_num_frames), ", ".join(presets.get(name, [])) or "—"]
            for name, adapter, facts in _family_facts("video", root)]
    return _table(["family", "model", "pipeline", "condition image", "experts", "frames by default", "preset"], rows)


# ------------------------------------------------------------------------------------------------ flowalign's column


def _family_labels(modality: str, root: Path) -> list[str]:
    out: list[str] = []
    for name, _, facts in _family_facts(modality, root):
        label = _fact(facts, name, "label")
        if label not in out:
            out.append(label)
    return out


_GRPO_PRESETS: dict[str, list[str]] = {}  # by the digest of configs/methods/: resolving 20-odd presets takes a second


def _grpo_presets(root: Path) -> list[str]:
    """The ``configs/methods/*.yaml`` presets (file stems) whose resolved config trains with the GRPO loss
    (``loss.grpo`` set; ``loss: {grpo: null}`` turns it off)."""
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig

    paths = sorted((root / "configs/methods").glob("*.yaml"))
    digest = hashlib.sha256(b"".join(path.name.encode() + b"\0" + path.read_bytes() + b"\0" for path in paths))
    key = digest.hexdigest()
    if key not in _GRPO_PRESETS:
        _GRPO_PRESETS[key] = [path.stem for path in paths if "grpo" in load_config(TrainConfig, path, []).loss]
    return _GRPO_PRESETS[key]


def _grpo_methods(labels: dict[str, Any], root: Path) -> list[str]:
    """The method presets that train with the GRPO loss (``loss.grpo`` set), by their labels."""
    return _labels(_grpo_presets(root), labels, f"{DATA / 'comparison.yaml'} labels.grpo_presets")


def _objectives(labels: dict[str, Any], root: Path) -> list[str]:
    """The registered objectives, then the loss terms beside the GRPO loss, by their labels."""
    from flowalign.losses import LOSSES
    from flowalign.objectives import OBJECTIVES

    names = _registered(OBJECTIVES) + [f"loss.{name}" for name in _registered(LOSSES) if name != "grpo"]
    return _labels(names, labels, f"{DATA / 'comparison.yaml'} labels.objectives")


def _sde_kinds(labels: dict[str, Any], root: Path) -> list[str]:
    from flowalign.samplers import registered_sde_kinds, sde_kind

    names = [name for name in registered_sde_kinds() if _builtin(sde_kind(name).mean_std.__module__)]
    return _labels(names, labels, f"{DATA / 'comparison.yaml'} labels.sde_kinds")


def _rewards(labels: dict[str, Any], root: Path) -> list[str]:
    from flowalign.rewards import REWARDS

    return _labels(_registered(REWARDS), labels, f"{DATA / 'comparison.yaml'} labels.rewards")


def _guided_samplers(labels: dict[str, Any], root: Path) -> list[str]:
    from flowalign.inference import SAMPLERS

    return _labels(_registered(SAMPLERS), labels, f"{DATA / 'comparison.yaml'} labels.guided_samplers")


def _engines(labels: dict[str, Any], root: Path) -> list[str]:
    from flowalign.training.parallel_engines import ENGINES

    return _labels(_registered(ENGINES), labels, f"{DATA / 'comparison.yaml'} labels.engines")


# derive: NAME -> (the labels section it reads, or None; the function giving the cell's items)
DERIVED: dict[str, tuple[str | None, Callable[[dict[str, Any], Path], list[str]]]] = {
    "image_families": (None, lambda labels, root: _family_labels("image", root)),
    "video_families": (None, lambda labels, root: _family_labels("video", root)),
    "grpo_methods": ("grpo_presets", _grpo_methods),
    "objectives": ("objectives", _objectives),
    "sde_kinds": ("sde_kinds", _sde_kinds),
    "rewards": ("rewards", _rewards),
    "guided_samplers": ("guided_samplers", _guided_samplers),
    "engines": ("engines", _engines),
}


class _Comparison:
    """docs/data/comparison.yaml, with flowalign's derived cells computed once each."""

    def __init__(self, root: Path):
        self.root = root
        self.data = _load("comparison.yaml", root) or {}
        self.projects = [project["key"] for project in self.data.get("projects", [])]
        self._cache: dict[str, str] = {}

    def cell(self, row: dict[str, Any], project: str, where: str) -> str:
        if project not in row:
            raise DocsDataError(f"{DATA / 'comparison.yaml'}: {where} has no cell for {project!r}")
        value = row[project]
        if isinstance(value, list):  # parts, each text or a derived list
            return "".join(self._part(part, f"{where}.{project}") for part in value)
        return self._part(value, f"{where}.{project}")

    def _part(self, value: Any, where: str) -> str:
        if not isinstance(value, dict):
            return str(value)
        name = value.get("derive")
        if name not in DERIVED:
            raise DocsDataError(f"{DATA / 'comparison.yaml'}: {where}.derive = {name!r}: use one of "
                                f"{sorted(DERIVED)}")
        if name not in self._cache:
            section, derive = DERIVED[name]
            labels = (self.data.get("labels") or {}).get(section, {}) if section else {}
            self._cache[name] = ", ".join(derive(labels, self.root))
        return self._cache[name]

    def table(self, section: str) -> str:
        rows = self.data.get(section) or []
        titles = {project["key"]: project.get("title", project["key"]) for project in self.data["projects"]}
        return _table(["Feature" if section == "features" else "", *titles.values()],
                      ([row["feature"], *(self.cell(row, p, f"{section}[{row['feature']!r}]") for p in self.projects)]
                       for row in rows))


def comparison_sources(inputs: "Inputs") -> str:
    projects = inputs.comparison.data["projects"]
    return "".join(textwrap.fill(project["source"], WIDTH, initial_indent="- ", subsequent_indent="  ",
                                     break_on_hyphens=False, break_long_words=False) + "\n"
                   for project in projects if project.get("source"))


def comparison_features(inputs: "Inputs") -> str:
    return inputs.comparison.table("features")


def comparison_summary(inputs: "Inputs") -> str:
    return inputs.comparison.table("summary")


class Inputs:
    """What one run renders from: the repository at ``root``, each data file read once."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cached_property
    def comparison(self) -> _Comparison:
        return _Comparison(self.root)


BLOCKS: dict[str, Callable[[Inputs], str]] = {
    "families-image": families_image,
    "families-video": families_video,
    "video-families": video_families,
    "comparison-sources": comparison_sources,
    "comparison-features": comparison_features,
    "comparison-summary": comparison_summary,
}


# ------------------------------------------------------------------------------------------------ pages


def _blocks(text: str, page: str) -> Iterator[re.Match]:
    for match in BLOCK.finditer(text):
        if match["name"] not in BLOCKS:
            raise DocsDataError(f"{page}: unknown generated block {match['name']!r}: use one of {sorted(BLOCKS)}")
        yield match


def render(text: str, page: str, inputs: Inputs, cache: dict[str, str]) -> str:
    """``text`` with each generated block's body rendered anew (``cache``: the blocks rendered so far, by name)."""
    out, last = [], 0
    for match in _blocks(text, page):
        name = match["name"]
        if name not in cache:
            cache[name] = BLOCKS[name](inputs)
        out += [text[last:match.start("body")], cache[name]]
        last = match.start("close")
    return "".join(out) + text[last:]


def generate(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """``{page: (committed, generated)}`` of every page in ``PAGES``; an error when a block is on no page."""
    cache: dict[str, str] = {}
    inputs = Inputs(root)
    pages = {}
    for page in PAGES:
        text = (root / page).read_text(encoding="utf-8")
        pages[page] = (text, render(text, page, inputs, cache))
    absent = sorted(set(BLOCKS) - set(cache))
    if absent:
        raise DocsDataError(f"no page of {list(PAGES)} holds the generated blocks {absent}: put "
                            f"'<!-- generated: NAME -->' ... '<!-- end generated -->' where each belongs")
    return pages


def stale(root: Path = ROOT) -> dict[str, str]:
    """``{page: unified diff}`` of each page whose generated blocks differ from what the code generates now."""
    return {page: "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{page} (committed)",
                                               f"{page} (generated)"))
            for page, (old, new) in generate(root).items() if old != new}


def write(root: Path = ROOT) -> list[str]:
    """Rewrite the stale pages (each through a temporary file renamed into place); returns them."""
    changed = []
    for page, (old, new) in generate(root).items():
        if old != new:
            path = root / page
            temporary = path.with_name(f".{path.name}.tmp")
            temporary.write_text(new, encoding="utf-8")
            temporary.replace(path)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description="Rewrite (or check) the generated blocks of the "
                                     "docs: the model-family tables and the comparison tables.")
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff when a page is stale; write nothing")
    args = parser.parse_args(argv)
    try:
        if args.check:
            diffs = stale()
            if diffs:
                print("".join(diffs.values()), end="")
                print(f"stale: {', '.join(diffs)}; regenerate with `{REGENERATE}`", file=sys.stderr)
                return 1
            print("generated docs up to date")
            return 0
        changed = write()
    except DocsDataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(changed)}" if changed else "generated docs up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
