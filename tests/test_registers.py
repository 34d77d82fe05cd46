"""Latent reward registers: a read-only path (velocity bitwise unchanged), gradients to x_t, the Thurstone loss,
pairwise accuracy, and checkpoints tied to one transformer config."""

import math

import pytest
import torch

from flowalign.models import wrap_pipeline
from flowalign.reward_models.latent_registers import (
    LatentRegisters,
    default_taps,
    load_registers,
    pairwise_accuracy,
    thurstone_loss,
)


def _inputs(model, batch=2, seed=0):
    cond = model.encode(["a red circle", "two blue squares"][:batch])
    x = model.prepare_noise(batch, generator=torch.Generator().manual_seed(seed))
    return x, cond


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_registers_leave_velocity_and_hidden_states_bitwise_unchanged(family, sd3_pipe, flux_pipe):
    model = wrap_pipeline(sd3_pipe if family == "sd3" else flux_pipe)
    x, cond = _inputs(model)
    sigma = torch.tensor(0.6)
    last = list(getattr(model.transformer, "single_transformer_blocks", [])) or model.transformer.transformer_blocks
    seen = []
    probe = last[-1].register_forward_hook(lambda m, a, out: seen.append([o.clone() for o in out if o is not None]))
    with torch.no_grad():
        plain = model.velocity(x, sigma, cond)
        registers = LatentRegisters.for_transformer(model.transformer, num_registers=8, width=32).attach(model.transformer)
        v, scores = registers.read(lambda x, s: model.velocity(x, s, cond), x, sigma)
    probe.remove()
    assert torch.equal(plain, v)
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1]))
    assert scores.shape == (2, 1) and torch.isfinite(scores).all()
    registers.detach()
    with torch.no_grad():
        assert torch.equal(model.velocity(x, sigma, cond), plain)
    assert not registers._hooks


def test_gradients_reach_x_t_through_the_registers(sd3_pipe):
    model = wrap_pipeline(sd3_pipe)
    model.transformer.requires_grad_(False)
    torch.manual_seed(0)
    registers = LatentRegisters.for_transformer(model.transformer, heads=["a", "b"], num_registers=4, width=32)
    registers.attach(model.transformer)
    x, cond = _inputs(model)
    x.requires_grad_(True)
    _, scores = registers.read(lambda x, s: model.velocity(x, s, cond), x, torch.tensor(0.9))
    (grad,) = torch.autograd.grad(scores[:, 1].sum(), x)
    assert scores.shape == (2, 2)
    assert grad.abs().sum(dim=(1, 2, 3)).min() > 0  # every sample's own score moves with its own x_t
    # and only with its own: sample 0's score does not depend on sample 1's latent
    (cross,) = torch.autograd.grad(registers.read(lambda x, s: model.velocity(x, s, cond), x, torch.tensor(0.9))[1][0, 0], x)
    assert cross[1].abs().max() == 0 and cross[0].abs().max() > 0


def test_thurstone_loss_matches_a_hand_computation():
    r_i, r_j = torch.tensor([0.3, -1.0, 0.5]), torch.tensor([0.1, 0.4, 0.5])
    y_i, y_j = torch.tensor([1.0, 0.0, 0.2]), torch.tensor([0.0, 1.0, 0.2])  # the third pair is a tie: skipped
    s_i, s_j = torch.tensor([0.9, 0.1, 0.5]), torch.tensor([0.9, 0.1, 0.5])

    def phi(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    v1, v2 = 2 * 0.81 + 0.05, 2 * 0.01 + 0.05
    p1 = phi((0.3 - 0.1) / math.sqrt(2 * v1))           # y_i > y_j: sign +1
    p2 = phi(-1 * (-1.0 - 0.4) / math.sqrt(2 * v2))     # y_i < y_j: sign -1
    expected = ((1 - math.sqrt(p1)) + (1 - math.sqrt(p2))) / 2
    assert thurstone_loss(r_i, r_j, y_i, y_j, s_i, s_j).item() == pytest.approx(expected, rel=1e-6)
    assert thurstone_loss(r_i[2:], r_j[2:], y_i[2:], y_j[2:], s_i[2:], s_j[2:]).item() == 0.0


def test_pairwise_accuracy_by_sigma_band():
    # group 0 at sigma 0.9 (two pairs: one right, one wrong), group 1 at sigma 0.1 (one right pair, one tie in y)
    scores = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.2, 0.7])
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    sigmas = torch.tensor([0.9, 0.9, 0.9, 0.1, 0.1, 0.1])
    out = pairwise_accuracy(scores, labels, groups, sigmas)
    assert out["sigma>0.8"] == {"accuracy": 0.5, "pairs": 2}
    assert out["sigma<0.2"] == {"accuracy": 0.5, "pairs": 2}
    assert out["0.5-0.8"]["pairs"] == 0 and math.isnan(out["0.5-0.8"]["accuracy"])


def test_default_taps_are_three_evenly_spaced_blocks():
    assert default_taps(24) == (7, 15, 23)
    assert default_taps(4) == (0, 2, 3)
    assert default_taps(2) == (0, 1)


def test_checkpoint_round_trip_and_a_different_transformer_config_is_refused(tmp_path, sd3_pipe, words):
    from flowalign.models.tiny import tiny_sd3_pipeline

    model = wrap_pipeline(sd3_pipe)
    registers = LatentRegisters.for_transformer(model.transformer, num_registers=4, width=32)
    path = registers.save(tmp_path / "r.pt")
    again = load_registers(path, dict(model.transformer.config))
    assert all(torch.equal(a, b) for a, b in zip(registers.state_dict().values(), again.state_dict().values()))

    other = tiny_sd3_pipeline(words, transformer={"num_layers": 3}).transformer
    with pytest.raises(ValueError, match="different transformer config.*num_layers: 2 vs 3"):
        load_registers(path, dict(other.config))
    with pytest.raises(ValueError, match="num_layers"):
        again.attach(other)


def test_registers_train_then_rgs_sampling_through_the_cli(tmp_path):
    """`flowalign prep registers` at a tiny size writes a checkpoint and its held-out report; `flowalign sample
    --guidance rgs` then guides with it within the budget."""
    import json

    from flowalign.cli import main

    checkpoint = tmp_path / "reg" / "registers.pt"
    assert main(["prep", "registers", "--prompts-per-iteration", "2", "--samples-per-prompt", "2",
                 "--steps", "3", "--updates-per-iteration", "2", "--eval-prompt-count", "2", "--num-registers", "4",
                 "--iterations", "3", "--eval-every", "2", "--val-prompt-count", "3", "--out", str(checkpoint)]) == 0
    summary = json.loads((checkpoint.parent / "report.json").read_text())
    report = summary["held_out"]
    assert set(report) == {"registers", "x0_projection"}
    assert set(report["registers"]) == {"sigma>0.8", "0.5-0.8", "0.2-0.5", "sigma<0.2"}
    # Validated after iterations 1 and 2 (the last); the kept weights are those of the better score.
    validated = {h["iteration"]: h["val_score"] for h in summary["history"] if "val_score" in h}
    assert set(validated) == {1, 2}
    assert summary["selected_iteration"] == max(validated, key=lambda k: (validated[k], -k))
    out = tmp_path / "rgs"
    assert main(["sample", "--guidance", "rgs", "--registers", str(checkpoint), "--budget", "6", "--steps", "3",
                 "--max-prompts", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())["results"]
    assert [r["nfe"] for r in results] == [5, 5]  # 3 forwards + 2 backwards (sigmas 1, 0.5 > 0.2; 0.001 unguided)


def test_selection_score_is_the_mean_over_bands_with_pairs():
    from flowalign.prep.train_registers import selection_score

    accuracy = {"sigma>0.8": {"accuracy": 0.6, "pairs": 10}, "0.5-0.8": {"accuracy": 0.8, "pairs": 3},
                "0.2-0.5": {"accuracy": math.nan, "pairs": 0}, "sigma<0.2": {"accuracy": 1.0, "pairs": 1}}
    assert selection_score(accuracy) == pytest.approx(0.8)


def test_registers_train_refuses_a_validation_split_that_takes_every_prompt(tmp_path):
    from flowalign.prep.train_registers import RegisterTrainConfig, train_registers

    with pytest.raises(ValueError, match="val_prompt_count = 174 leaves no training prompts"):
        train_registers(RegisterTrainConfig(val_prompt_count=174, out=str(tmp_path / "r.pt")))
