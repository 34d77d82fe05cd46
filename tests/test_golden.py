"""Golden runs: the trainer as a whole, pinned for every method preset and both model presets.

Each run trains 2 iterations in one CPU thread and must reproduce the recorded digests of its weights, EMA, optimizer
state and metrics exactly on the platform they were recorded on, and the recorded reference values within the
tolerances of ``tests/golden_runs.py`` elsewhere. How to re-record (a reviewed change): see that module's docstring.
"""

import pytest
import torch

from flowalign.models.tiny import tiny_flux_pipeline, tiny_sd3_pipeline
from flowalign.toy.prompts import split_prompts

from golden_runs import (
    COSINE_MIN,
    NORM_RATIO_TOLERANCE,
    RUNS,
    compare_digests,
    compare_values,
    fingerprint,
    load_baselines,
    load_reference,
    mode,
    record,
    run_golden,
)


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    """The tiny SD3 and FLUX pipelines (seed 0), a register checkpoint (seed 0) for register_grpo and a discriminator
    checkpoint (seed 0) for drl and drl_adjoint."""
    from diffusers import SD3Transformer2DModel

    from flowalign.reward_models.latent_registers import LatentRegisters

    train, test = split_prompts()
    words = sorted({w for e in train + test for w in e["prompt"].split()})
    root = tmp_path_factory.mktemp("golden")
    tiny_sd3_pipeline(words, seed=0).save_pretrained(root / "sd3")
    tiny_flux_pipeline(words, seed=0).save_pretrained(root / "flux")
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel.from_pretrained(root / "sd3" / "transformer")
    registers = LatentRegisters.for_transformer(transformer, num_registers=4, width=32).save(root / "registers.pt")
    from flowalign.reward_models.discriminator import untrained_discriminator
    from test_shell_lcc import tiny_manifold

    discriminator = untrained_discriminator(root / "sd3", root / "discriminator.safetensors", image_size=32, width=16)
    manifold = tiny_manifold(root / "sd3", root / "manifold.safetensors")  # seeded; for the shell_lcc presets
    return {"sd3": root / "sd3", "flux": root / "flux", "registers": registers, "discriminator": discriminator,
            "manifold": manifold, "root": root, "words": words}


def shell_lcc_settings(name, manifold):
    """The shell_lcc presets' small runs read the seeded manifold (the reward replaces brightness there)."""
    if name == "shell_lcc":
        return {"reward.rewards": f"[{{name: shell_lcc, kwargs: {{path: {manifold}, variant: band}}}}]"}
    if name == "shell_lcc_objective":
        return {"objectives.shell_lcc.path": str(manifold), "objectives.shell_lcc.batch_size": 2}
    return {}


# The model presets of the families beyond SD3 and FLUX run on their tiny pipelines, built when first asked for.
FAMILY_PRESETS = {"qwen_image": "qwen_image", "z_image": "z_image", "flux2_klein": "flux2_klein", "flux2_dev": "flux2",
                  "flux_kontext": "flux_kontext", "qwen_image_edit_plus": "qwen_image_edit_plus"}


def _model(name, golden_models):
    if name not in FAMILY_PRESETS:
        return golden_models["flux" if name == "flux_dev" else "sd3"]
    family = FAMILY_PRESETS[name]
    path = golden_models["root"] / family
    if not path.is_dir():
        from model_families import FAMILIES

        FAMILIES[family].build(golden_models["words"], seed=0).save_pretrained(path)
    return path


def _run(name, golden_models, out, extra=None):
    model = _model(name, golden_models)
    registers = golden_models["registers"] if name == "register_grpo" else None
    extra = {**shell_lcc_settings(name, golden_models["manifold"]), **(extra or {})}
    if name == "drl":  # scored by an (untrained, seed 0) discriminator made for the tiny SD3
        spec = "[{name: discriminator, kwargs: {path: " + str(golden_models["discriminator"]) + "}}]"
        extra = {**extra, "reward.rewards": spec}
    if name == "drl_adjoint":  # adjoint matching on the same discriminator's gradient
        extra = {**extra, "objectives.adjoint_matching.reward_kwargs": f"{{path: {golden_models['discriminator']}}}"}
    return run_golden(name, model, out, extra=extra, registers=registers)


@pytest.mark.float_sensitive  # recorded floats: .ci/run runs these again under the `default` CPU kernels
@pytest.mark.parametrize("name", RUNS)
def test_golden_run(name, golden_models, tmp_path):
    digests, values = _run(name, golden_models, tmp_path / name)
    if mode() != "check":
        record(name, digests, values, reference=mode() == "reference")
        return
    recorded = load_baselines()["digests"].get(fingerprint(), {}).get(name)
    if recorded is not None:  # the platform the digests were recorded on: bitwise
        moved = compare_digests(digests, recorded)
        assert not moved, (f"{name}: the digests of {moved} moved. If the change of the math is intended, re-record "
                           "(tests/golden_runs.py) and say in the commit which runs moved and why")
    else:  # another platform: the reference values within the documented tolerances
        problems = compare_values(values, load_reference(name))
        assert not problems, f"{name} on {fingerprint()}: " + "; ".join(problems)


# Checks against the record: not while it is being written (FLOWALIGN_GOLDEN=record|reference, never in CI).
checking = pytest.mark.skipif(mode() != "check", reason="recording golden runs")


@checking
@pytest.mark.parametrize("change", [{"optim.lr": 3.15e-4}, {"advantage.std": "global"}], ids=["lr+5%", "global-std"])
def test_both_checks_catch_a_real_change_of_the_math(change, golden_models, tmp_path):
    """A 5% larger learning rate or another advantage normalisation moves the digests and fails the tolerances."""
    digests, values = _run("flow_grpo", golden_models, tmp_path / "changed", extra=change)
    recorded = load_baselines()["digests"].get(fingerprint(), {}).get("flow_grpo")
    if recorded is not None:
        assert compare_digests(digests, recorded)
    assert compare_values(values, load_reference("flow_grpo"))


def _flipped(update, fraction, step, seed=0):
    """``update`` with Adam's first step (``step = lr`` per element) turned round on ``fraction`` of its elements:
    what a gradient that is zero up to rounding, and so of either sign, does on another CPU."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(update):
        tensor = update[name]
        flip = torch.rand(tensor.shape, generator=generator) < fraction
        out[name] = torch.where(flip, tensor - 2 * step * torch.sign(tensor), tensor)
    return out


def test_the_tolerance_ignores_a_few_sign_flips_and_catches_a_turned_or_scaled_update():
    reference = load_reference("flow_grpo")
    base = {"weights": reference["weights"], "ema": reference["ema"], "metrics": reference["metrics"]}
    assert compare_values(base, reference) == []
    lr = reference["metrics"][0]["lr"]
    for fraction, fails in ((0.002, False), (0.05, True)):  # 0.2% of the elements flipped pass, 5% do not
        flipped = {**base, "weights": _flipped(base["weights"], fraction, lr)}
        assert bool(compare_values(flipped, reference)) is fails, fraction
    for scale, fails in ((1 + NORM_RATIO_TOLERANCE / 2, False), (1 + 2 * NORM_RATIO_TOLERANCE, True)):
        scaled = {**base, "weights": {k: v * scale for k, v in base["weights"].items()}}
        assert bool(compare_values(scaled, reference)) is fails, scale
    turned = {**base, "weights": {k: -v for k, v in base["weights"].items()}}  # an advantage of the wrong sign
    assert any("cosine -1.0000" in p for p in compare_values(turned, reference))
    metrics = [dict(m) for m in base["metrics"]]
    metrics[0]["nfe"] += 1  # a count is exact on any machine
    assert any("nfe" in p for p in compare_values({**base, "metrics": metrics}, reference))
    metrics = [dict(m) for m in base["metrics"]]
    metrics[0]["reward"] *= 1.01  # iteration 0's reward is forward-only: 1% is far beyond rounding
    assert any("reward" in p for p in compare_values({**base, "metrics": metrics}, reference))
    # reward_std is held to the rewards' own tolerance (1e-3 of the mean reward), absolute
    allowed = 1e-3 * abs(base["metrics"][0]["reward"])
    for shift, fails in ((0.5 * allowed, False), (2 * allowed, True)):
        metrics = [dict(m) for m in base["metrics"]]
        metrics[0]["reward_std"] += shift
        assert any("reward_std" in p for p in compare_values({**base, "metrics": metrics}, reference)) is fails, shift
    assert 0 < COSINE_MIN < 1


@checking
def test_other_float_kernels_move_the_digests_but_stay_within_the_tolerance(golden_models, tmp_path):
    """Two threads instead of one change the order of float reductions, as another CPU's kernels do: the digests of
    dense_grpo move (measured), and the tolerance check still accepts the run."""
    digests, values = run_golden("dense_grpo", golden_models["sd3"], tmp_path / "two-threads", threads=2)
    recorded = load_baselines()["digests"].get(fingerprint(), {}).get("dense_grpo")
    if recorded is not None:
        assert compare_digests(digests, recorded)
    assert compare_values(values, load_reference("dense_grpo")) == []
