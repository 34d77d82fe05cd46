"""The one-file Flow-GRPO (``examples/flow_grpo_minimal.py``) is the ``flow_grpo`` preset's golden run, written out.

Run for 2 iterations on the tiny SD3 in one CPU thread, its LoRA weights must have the digest the golden run of the
``flow_grpo`` preset recorded for this platform (``tests/golden/baselines.json``), bit for bit; on a platform without
recorded digests, its weight update must agree with the recorded reference update within the golden tolerances
(``golden_runs``: the update's cosine and norm ratio). Comparing with the recorded digest, not with a trainer run
beside it, costs one small run instead of two and pins the example to the very number the trainer is pinned to. The
example may use only the math layer: no trainer, registry or config system.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

from golden_runs import (COSINE_MIN, NORM_RATIO_TOLERANCE, _tensors_digest, _update_agreement, fingerprint,
                         load_baselines, load_reference, mode, torch_threads)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flow_grpo_minimal.py"
# What the example may import from flowalign: the model adapter, the SDE step, the advantages, the keyed seeds, and
# the tiny pipeline it builds for --model tiny. No trainer, registry, config system or component.
ALLOWED = ("flowalign", "flowalign.samplers", "flowalign.seeding", "flowalign.advantages", "flowalign.models.tiny",
           "flowalign.toy.prompts")
ALLOWED_ATTRIBUTES = {"load_flow_model", "FlowModel"}  # of the top-level package


@pytest.fixture(scope="module")
def example():
    """The example imported as a module (registered in ``sys.modules`` so its dataclass resolves)."""
    spec = importlib.util.spec_from_file_location("flow_grpo_minimal", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def run(example, *argv: str):
    with torch_threads(1):  # the golden runs' thread count: the float reductions in the same order
        return example.main(example.parse_args(list(argv)))


@pytest.mark.skipif(mode() != "check", reason="recording golden runs")
def test_two_iterations_give_the_flow_grpo_golden_weights(example):
    weights = run(example, "--model", "tiny", "--iterations", "2")
    initial = run(example, "--model", "tiny", "--iterations", "0")
    assert set(weights) == set(initial) and all("lora_" in name for name in weights) and weights
    update = {name: weights[name] - initial[name] for name in weights}
    reference = load_reference("flow_grpo")["weights"]  # the golden run's update of the LoRA weights
    assert set(update) == set(reference)
    # the golden tolerance holds everywhere (on the weights: the example keeps no EMA and logs no metrics)
    cosine, norm_ratio = _update_agreement(update, reference)
    assert cosine >= COSINE_MIN and abs(norm_ratio - 1) <= NORM_RATIO_TOLERANCE, (cosine, norm_ratio)
    recorded = load_baselines()["digests"].get(fingerprint(), {}).get("flow_grpo")
    if recorded is not None:  # the platform the golden digests were recorded on: bit for bit
        assert _tensors_digest(weights) == recorded["weights"], (
            "examples/flow_grpo_minimal.py no longer reproduces the flow_grpo golden run's LoRA weights: the example "
            "or the trainer's math changed; make them agree again")


def test_the_example_uses_only_the_math_layer_and_stays_short():
    source = EXAMPLE.read_text()
    assert len(source.splitlines()) <= 300
    tree = ast.parse(source)
    imported = [(node.lineno, node.module if isinstance(node, ast.ImportFrom) else alias.name)
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names]
    outside = [f"line {line}: {name}" for line, name in imported
               if name.split(".")[0] == "flowalign" and name not in ALLOWED]
    assert not outside, "the example imports beyond the math layer: " + ", ".join(outside)
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "flowalign"}
    assert used <= ALLOWED_ATTRIBUTES, f"the example uses flowalign.{sorted(used - ALLOWED_ATTRIBUTES)}"


def test_every_hyper_parameter_is_a_command_line_option(example):
    args = example.parse_args(["--group-size", "16", "--lr", "3e-4", "--model", "/models/sd35"])
    assert (args.group_size, args.lr, args.model) == (16, 3e-4, "/models/sd35")
    assert example.parse_args([]) == example.Args()


def test_the_clip_is_the_library_loss_where_the_golden_run_never_clips(example):
    """The golden run's ratios stay within 2e-5 of 1 (its clip_frac is 0 at a clip range of 1e-4), so the digest does
    not pin the clip: here the example's loss meets the library's per-transition loss (``flowalign.kernels``) on ratios
    inside and outside the clip range, advantages of both signs, value and gradient bit for bit."""
    import torch

    from flowalign.kernels import clipped_policy_loss

    log_ratio = torch.tensor([0.0, 5e-5, -5e-5, 3e-4, -3e-4, 3e-4, -3e-4, 1e-3])
    advantages = torch.tensor([1.0, -0.5, 2.0, 1.5, 1.5, -1.5, -1.5, 0.0])
    old = torch.linspace(-2.0, 1.0, 8)
    mine = (old + log_ratio).requires_grad_()
    theirs = mine.detach().clone().requires_grad_()
    loss = example.clipped_loss(mine, old, advantages, 1e-4)
    expected = clipped_policy_loss(theirs - old, advantages, 1e-4).mean()
    loss.backward()
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(mine.grad, theirs.grad)
    assert (mine.grad[3:7] == 0).sum() == 2  # two of the four clipped ratios get no gradient: the clip is in play


def test_minibatches_that_do_not_divide_the_chunks_are_refused_before_the_model_loads(example):
    with pytest.raises(ValueError, match=r"--minibatches 3 must divide the 2 rollout chunks"):
        example.main(example.parse_args(["--minibatches", "3", "--model", "/no/such/model"]))
