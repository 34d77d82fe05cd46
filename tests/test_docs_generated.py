"""The generated blocks of the docs (docs/generate.py) are what the code and docs/data/ generate now: the model-family
tables from the registry, the comparison tables with flowalign's cells derived from the registries and presets.

In-process and cheap: the generator reads the registries already imported, and leaves out what a test registered."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from conftest import module_from_file

ROOT = Path(__file__).resolve().parents[1]


generate = module_from_file("docs_generate", ROOT / "docs/generate.py")


@pytest.fixture
def repo_copy(tmp_path):
    """The generator's inputs and pages in a scratch repository."""
    for page in generate.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    shutil.copytree(ROOT / "docs/data", tmp_path / "docs/data")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    return tmp_path


def test_the_generated_blocks_are_fresh():
    diffs = generate.stale()
    assert not diffs, "".join(diffs.values()) + f"\nstale: {list(diffs)}: run `{generate.REGENERATE}` and commit."


def test_a_stale_block_is_shown_as_a_diff_and_rewritten_in_place(repo_copy):
    page = repo_copy / "docs/guides/adding-a-model.md"
    committed = page.read_text()
    row = next(line for line in committed.splitlines() if line.startswith("| `mochi` |"))
    page.write_text(committed.replace(row + "\n", "").replace("## The families", "## The families (edited)"))
    diffs = generate.stale(repo_copy)
    assert list(diffs) == ["docs/guides/adding-a-model.md"] and f"\n+{row}\n" in diffs["docs/guides/adding-a-model.md"]
    assert generate.write(repo_copy) == ["docs/guides/adding-a-model.md"]
    # The block is back; the hand-written prose outside it is kept.
    assert page.read_text() == committed.replace("## The families", "## The families (edited)")
    assert generate.stale(repo_copy) == {} and generate.write(repo_copy) == []


def test_the_family_tables_follow_the_registry_and_the_presets(repo_copy):
    from flowalign.models import MODEL_FAMILIES

    tables = generate.families_image(generate.Inputs(repo_copy)) + generate.families_video(generate.Inputs(repo_copy))
    rows = {line.split(" | ")[0].strip("| `"): line for line in tables.splitlines() if line.startswith("| `")}
    assert set(rows) == set(MODEL_FAMILIES.names())
    for name in MODEL_FAMILIES.names():
        assert f"| `{MODEL_FAMILIES.get(name).pipeline_class_name}` |" in rows[name]
    assert "| `high`, `low` |" in rows["wan22"] and "| the first frame, required |" in rows["wan_i2v"]
    assert rows["sd3"].endswith("| `configs/models/sd35_medium.yaml` |") and rows["chroma"].endswith("| — |")
    # A new preset naming a family shows up in its row.
    (repo_copy / "configs/models/chroma_hd.yaml").write_text("model:\n  family: chroma\n")
    assert generate.families_image(generate.Inputs(repo_copy)).count("`configs/models/chroma_hd.yaml`") == 1


def test_a_family_a_test_registers_is_left_out():
    from flowalign.models import MODEL_FAMILIES, SD3Model

    class DocsProbeModel(SD3Model):
        family = "docs_probe"

    MODEL_FAMILIES.register("docs_probe", DocsProbeModel)
    try:
        assert "docs_probe" not in generate.families_image(generate.Inputs(ROOT))
    finally:
        MODEL_FAMILIES.unregister("docs_probe")


def test_a_registered_family_without_an_entry_is_named(repo_copy):
    data = repo_copy / "docs/data/families.yaml"
    facts = yaml.safe_load(data.read_text())
    del facts["mochi"]
    facts["sd4"] = facts["sd3"]
    data.write_text(yaml.safe_dump(facts, allow_unicode=True))
    with pytest.raises(generate.DocsDataError, match=r"families\.yaml.*\['mochi'\].*\['sd4'\]"):
        generate.families_video(generate.Inputs(repo_copy))


def test_a_registered_component_without_a_label_is_named(repo_copy):
    data = repo_copy / "docs/data/comparison.yaml"
    comparison = yaml.safe_load(data.read_text())
    del comparison["labels"]["guided_samplers"]["satisdive"]
    comparison["labels"]["rewards"]["deqa"] = "DeQA"
    data.write_text(yaml.safe_dump(comparison, allow_unicode=True, sort_keys=False))
    inputs = generate.Inputs(repo_copy)
    with pytest.raises(generate.DocsDataError, match=r"labels\.guided_samplers: add \['satisdive'\]"):
        generate.comparison_summary(inputs)
    with pytest.raises(generate.DocsDataError, match=r"labels\.rewards: remove \['deqa'\] \(not registered\)"):
        generate.comparison_features(inputs)


def test_flowalign_cells_are_derived_from_the_registries():
    from flowalign.inference import SAMPLERS
    from flowalign.objectives import OBJECTIVES

    comparison = yaml.safe_load((ROOT / "docs/data/comparison.yaml").read_text())
    features = {row.split(" | ")[0].strip("| "): row.split(" | ")[1]
                for row in generate.comparison_features(generate.Inputs(ROOT)).splitlines()[2:]}
    labels = comparison["labels"]
    assert all(labels["guided_samplers"][name] in features["Inference-time guided sampling"]
               for name in SAMPLERS.names() if labels["guided_samplers"][name])
    assert all(labels["objectives"][name] in features["Other objectives"] for name in OBJECTIVES.names())
    assert "Euphonium" in features["Inference-time guided sampling"] and "SatisDive" in features[
        "Inference-time guided sampling"]
    assert "GRPO-Guard" in features["GRPO family"] and "DiffusionNFT" not in features["GRPO family"]
    assert "in-process" in features["Reward execution"] and "serve-reward" in features["Reward execution"]


def test_an_unknown_block_name_is_refused(repo_copy):
    page = repo_copy / "docs/comparison.md"
    page.write_text(page.read_text() + "\n<!-- generated: families-audio -->\n<!-- end generated -->\n")
    with pytest.raises(generate.DocsDataError, match="unknown generated block 'families-audio'"):
        generate.stale(repo_copy)
