"""The examples of docs/extending.md run as written, and do what the page says they do.

Every fenced ``python`` block of the page is preceded by a marker ``<!-- example: NAME -->``; the blocks of one name
are joined and executed as one script in a fresh namespace, from a scratch directory that links the repository's
``assets/`` (so the toy model and prompts resolve as from the root of a clone, and ``outputs/`` lands in the scratch
directory). What an example registered is unregistered afterwards, so its names do not leak into other tests."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "extending.md"
MARKER = re.compile(r"<!-- example: ([a-z_]+) -->\s*\n```python\n(.*?)\n```", re.S)
EXPECTED = {"reward", "credit", "loss", "objective", "sampler", "adapter"}


def examples() -> dict[str, str]:
    """The page's examples by name, the blocks of one name joined in page order."""
    found: dict[str, list[str]] = {}
    for name, code in MARKER.findall(PAGE.read_text()):
        found.setdefault(name, []).append(code)
    return {name: "\n\n".join(blocks) for name, blocks in found.items()}


def registries():
    from flowalign.credit import CREDIT
    from flowalign.inference import SAMPLERS
    from flowalign.losses import LOSSES
    from flowalign.models import MODEL_FAMILIES
    from flowalign.objectives import OBJECTIVES
    from flowalign.rewards import REWARDS
    from flowalign.rollout import SHAPES

    return [REWARDS, CREDIT, LOSSES, OBJECTIVES, SHAPES, SAMPLERS, MODEL_FAMILIES]


def test_every_python_block_is_a_marked_example():
    text = PAGE.read_text()
    assert text.count("```python") == len(MARKER.findall(text)), "a python block of the page has no example marker"
    assert set(examples()) == EXPECTED


@pytest.fixture
def run_example(tmp_path, monkeypatch, capsys):
    """``run_example(name) -> (namespace, printed)``: the example executed from a scratch directory."""
    (tmp_path / "assets").symlink_to(REPO / "assets")
    monkeypatch.chdir(tmp_path)
    before = {registry: set(registry.names()) for registry in registries()}

    made = []

    def run(name: str):
        module = types.ModuleType(f"docs_example_{name}")  # a module of its own, as a copied script would be
        sys.modules[module.__name__] = module
        made.append(module.__name__)
        exec(compile(examples()[name], f"{PAGE}:{name}", "exec", dont_inherit=True), module.__dict__)
        return module.__dict__, capsys.readouterr().out

    yield run
    for name in made:
        del sys.modules[name]
    for registry, names in before.items():
        for added in set(registry.names()) - names:
            registry.unregister(added)


def last(namespace) -> dict:
    (metrics,) = namespace["history"]  # one iteration
    assert metrics["first_ratio_max"] == 1.0  # every new part keeps the first ratio exactly 1
    return metrics


def test_reward(run_example):
    from flowalign.rewards import REWARDS

    namespace, printed = run_example("reward")
    assert "redness" in REWARDS
    value = last(namespace)["rewards/redness/mean"]
    assert 0.0 <= value <= 1.0 and f"redness {value}" in printed


def test_credit_estimator(run_example):
    from flowalign.credit import CREDIT

    namespace, _ = run_example("credit")
    assert "centred_rank" in CREDIT and namespace["config"].credit.scale == 2.0
    assert last(namespace)["credit/rank_abs_mean"] > 0  # the estimator's advantages reached the metrics


def test_loss_term(run_example):
    namespace, printed = run_example("loss")
    assert list(namespace["config"].loss) == ["grpo", "speed_penalty"] and "['grpo', 'speed_penalty']" in printed
    assert last(namespace)["speed"] > 0


def test_objective(run_example):
    namespace, _ = run_example("objective")
    assert list(namespace["config"].objectives) == ["reference_anchor"]
    assert last(namespace)["objectives/reference_anchor/anchor"] == 0.0  # the LoRA starts at zero: policy = reference


def test_guided_sampler(run_example, tmp_path):
    namespace, printed = run_example("sampler")
    out = tmp_path / "outputs" / "extending" / "sample"
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["sampler"] == {"name": "sde_bon", "noise_level": 0.5}
    assert [row["nfe"] for row in results["results"]] == [8, 8]  # 2 SDE samples of 4 steps per prompt
    assert (out / "images" / "0000.png").is_file() and (out / "images" / "0001.png").is_file()
    assert "nfe [8, 8]" in printed


def test_model_adapter(run_example):
    from flowalign.models import MODEL_FAMILIES

    namespace, printed = run_example("adapter")
    assert MODEL_FAMILIES.get("my_sd3") is namespace["MySD3Model"]
    assert isinstance(namespace["model"], namespace["MySD3Model"])
    assert torch.equal(namespace["ours"], namespace["expected"]) and "bitwise equal True" in printed
    last(namespace)
