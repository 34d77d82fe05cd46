"""GARDO-style regularisers: the diversity-aware advantage, the uncertainty gate and its controller, the gated KL,
the adaptive reference (resets, checkpointed state, bitwise resume), base-model tail sampling, bad input, and one
2-process run of all of them together."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flowalign.components import IterationContext
from flowalign.config import ConfigError, load_config
from flowalign.credit.diversity import diversity_advantages, nearest_neighbour_distances
from flowalign.losses import MicroBatch, PolicyOutput
from flowalign.losses.gated_kl import (GatedKL, GatedKLConfig, RiskController, descending_ranks, gate_fraction,
                                       uncertainty)
from flowalign.losses.reference import AdaptiveReference, AdaptiveReferenceConfig
from flowalign.samplers.rollout import Transitions
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from test_trainer import _assert_same_run, _one_vs_two_processes, final_checkpoint, overrides  # noqa: F401
from test_trainer import tiny_model  # noqa: F401  (the module-scoped tiny SD3 fixture)


# ------------------------------------------------------------------------------------------ the diversity credit
def test_diversity_advantage_of_a_hand_built_group():
    """f0 = f1 = (1, 0) (duplicates), f2 = (0, 1), f3 = (-1, 0): nearest distances d = [0, 0, 1, 1], mean 0.5.
    R = [1, 1, 0.8, 0.2], mean 0.75: samples 0, 1, 2 are at or above it, so w = [0, 0, 2, 1] and
    A = (R - 0.75) w = [0, 0, 0.1, -0.55]: the duplicates earn nothing for their high reward."""
    embeddings = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    torch.testing.assert_close(nearest_neighbour_distances(embeddings), torch.tensor([0.0, 0.0, 1.0, 1.0]).double())
    rewards = torch.tensor([1.0, 1.0, 0.8, 0.2])
    advantages, weights = diversity_advantages(rewards, embeddings, torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(weights, torch.tensor([0.0, 0.0, 2.0, 1.0]).double())
    torch.testing.assert_close(advantages, torch.tensor([0.0, 0.0, 0.05 * 2, -0.55]).double())
    # two groups are independent; an invalid member is left out of its group's mean and distances
    both = torch.cat([embeddings, embeddings])
    valid = torch.tensor([True] * 7 + [False])
    adv2, w2 = diversity_advantages(torch.cat([rewards, rewards]), both, torch.tensor([0] * 4 + [1] * 4), valid)
    torch.testing.assert_close(adv2[:4], advantages)
    # group 1 without sample 3: d = [0, 0, 1], mean 1/3, R mean 14/15: w = [0, 0, 1 (below mean)]
    torch.testing.assert_close(w2[4:], torch.tensor([0.0, 0.0, 1.0, 1.0]).double())
    torch.testing.assert_close(adv2[4:], torch.tensor([0.0, 0.0, 0.8 - 2.8 / 3, 0.0]).double())
    # all duplicates: every distance 0, the weights stay 1
    _, same = diversity_advantages(rewards, torch.ones(4, 2), torch.zeros(4, dtype=torch.long))
    assert torch.equal(same, torch.ones(4, dtype=torch.float64))
    # std: advantage multiplies the given normalised advantage instead of R - mean
    base = torch.tensor([1.5, 1.5, 0.2, -3.0])
    adv3, _ = diversity_advantages(rewards, embeddings, torch.zeros(4, dtype=torch.long), base=base)
    torch.testing.assert_close(adv3, torch.tensor([0.0, 0.0, 0.4, -3.0]).double())


# ------------------------------------------------------------------------------------------- the gate
def test_uncertainty_gate_on_fixed_ranks():
    """main ranks 1..6; aux 1 the reverse, aux 2 = main: mean aux rank 3.5 for all, u = [-2.5, ..., 2.5].
    P = {0.5, 1.5, 2.5}, m = 1.5, q = 0.1 at the first update: tau = the 90th percentile of P = 2.3 (linear), so only
    the last sample (u = 2.5) is gated; flipped, only the first."""
    main = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0])
    aux = torch.stack([main.flip(0), main])
    torch.testing.assert_close(descending_ranks(main), torch.arange(1, 7).double())
    torch.testing.assert_close(descending_ranks(torch.tensor([1.0, 1.0, 2.0])), torch.tensor([2.0, 3.0, 1.0]).double())
    u = uncertainty(main, aux)
    torch.testing.assert_close(u, torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5]).double())
    gate, tau, q = gate_fraction(u, RiskController())
    assert q == 0.1 and tau == pytest.approx(2.3) and tau == pytest.approx(np.percentile([0.5, 1.5, 2.5], 90))
    assert gate.tolist() == [False] * 5 + [True]
    flipped, _, _ = gate_fraction(uncertainty(main, aux, "flipped"), RiskController())
    assert flipped.tolist() == [True] + [False] * 5


def test_the_risk_controller_grows_shrinks_and_clips_the_gated_fraction():
    c = RiskController(fraction=0.1, low=0.02, high=0.2, adapt=0.1, history=3)
    steps = [(1.5, 0.1), (2.0, 0.11), (1.0, 0.099), (1.2, 0.099), (0.5, 0.0891)]  # above max, below min, inside
    for m, q in steps:
        assert c.update(m) == pytest.approx(q)
    assert c.history == [1.0, 1.2, 0.5]  # the last 3
    for k in range(20):
        c.update(10.0 + k)
    assert c.fraction == 0.2  # clipped at fraction_max
    for k in range(40):
        c.update(-10.0 - k)
    assert c.fraction == 0.02


def _micro(sigma=0.5, sigma_next=0.25, n=2):
    """A micro-batch of ``n`` dance-SDE transitions (std_t = a = 1) of samples 0..n-1 of one batch."""
    shape = (n, 1, 2, 2)
    states = torch.zeros(2 * n, *shape[1:])
    t = Transitions(states=states, src=torch.arange(n), dst=torch.arange(n, 2 * n), step=torch.zeros(n, dtype=torch.long),
                    sigma=torch.full((n,), sigma), sigma_next=torch.full((n,), sigma_next), noise_level=torch.ones(n),
                    std=torch.full((n,), (sigma - sigma_next) ** 0.5), noise_scale=torch.ones(n),
                    log_prob=torch.zeros(n), stochastic=torch.ones(n, dtype=torch.bool),
                    sample_id=torch.arange(n), group_id=torch.zeros(n, dtype=torch.long),
                    prompt_id=torch.zeros(n, dtype=torch.long), kind="dance")
    batch = SimpleNamespace(sample_ids=torch.tensor([4, 5]))
    return MicroBatch(batch=batch, step=0, transitions=t, advantages=torch.zeros(n), weights=torch.ones(n),
                      sources=torch.arange(n), inverse=torch.arange(n), rows=torch.arange(n), x=states[:n],
                      sigma=t.sigma, sigma_next=t.sigma_next, cond=None, metadata=[{}] * n)


def test_gated_kl_on_the_gated_samples_by_hand():
    """The dance SDE's mean moves with v by c = dt (1 + a^2 (1 - s) / (2 s)) = -0.25 * 1.5 = -0.375 (s = 0.5,
    s' = 0.25, a = 1), so v - v_ref = 0.2 gives |Delta mu| = 0.075 and KL = 0.075^2 / (2 std_t^2) = 0.0028125
    with std_t = a = 1 (the reference code's); only the gated sample (global id 4) counts; beta 0.07."""
    term = GatedKL(GatedKLConfig(name="gated_kl", beta=0.07, auxiliaries=["aux"]))
    term.gate = torch.zeros(8, dtype=torch.bool)
    term.gate[4] = True
    micro = _micro()
    v = torch.zeros(2, 1, 2, 2, requires_grad=True)
    v_ref = torch.stack([torch.full((1, 2, 2), -0.2), torch.full((1, 2, 2), 5.0)])  # sample 5 is not gated
    loss, stats = term.loss(micro, PolicyOutput(v=v, v_ref=v_ref))
    assert stats["gated_kl"] == pytest.approx(0.0028125) and stats["gated_kl/transitions"] == 1.0
    assert float(loss.detach()) == pytest.approx(0.07 * 0.0028125)
    loss.backward()
    assert v.grad[1].abs().sum() == 0 and v.grad[0].abs().sum() > 0
    # with the transition std (loss.grpo's KL) it is 1 / (-dt) = 4 times larger
    term.config.kl_std = "transition"
    _, stats = term.loss(micro, PolicyOutput(v=v, v_ref=v_ref))
    assert stats["gated_kl"] == pytest.approx(4 * 0.0028125)
    term.gate[:] = False  # nothing gated: 0, and a loss that still backpropagates
    loss, stats = term.loss(micro, PolicyOutput(v=v, v_ref=v_ref))
    assert stats["gated_kl"] == 0.0 and float(loss.detach()) == 0.0 and loss.requires_grad


def test_gated_kl_prepares_its_gate_from_the_gathered_rewards():
    term = GatedKL(GatedKLConfig(name="gated_kl", auxiliaries=["a", "b"]))
    term.main = "main"
    main = torch.tensor([6.0, 5.0, 4.0, 3.0, 2.0, 1.0, float("nan")])
    raw = torch.stack([main, torch.cat([main[:6].flip(0), torch.zeros(1)]), main])
    scores = SimpleNamespace(names=["main", "a", "b"], raw_all=raw, valid_all=torch.isfinite(main))
    stats = term.prepare_update(IterationContext(0, None, [], scores))
    assert term.gate.tolist() == [False] * 5 + [True, False]  # the invalid sample is never gated
    assert stats["gated_kl/fraction"] == 0.1 and stats["gated_kl/tau"] == pytest.approx(2.3)
    assert term.state_dict() == {"fraction": 0.1, "history": [1.5]}


# ------------------------------------------------------------------------------------- the adaptive reference
def test_the_adaptive_reference_resets_periodically_and_when_the_kl_passes_its_threshold():
    weight = torch.nn.Parameter(torch.zeros(3))
    ref = AdaptiveReference(AdaptiveReferenceConfig(name="adaptive", reset_every=3, kl_threshold=3e-4))
    ref.set_up(SimpleNamespace(trainable_state=lambda: {"w": weight}))

    def iteration(k, kl):
        stats = ref.prepare_update(IterationContext(k, None, [], None))
        with torch.no_grad():
            weight.add_(1.0)  # the update
        ref.after_update(IterationContext(k, None, [], None), {"gated_kl": kl, "skipped": 0.0})
        return stats["reference/reset"], ref.snapshot["w"][0].item()

    # 0: start (snapshot 0); 1: no reset; 2: the KL of iteration 1 passed kappa -> reset to the policy (2);
    # 3, 4: no; 5: 3 iterations since the reset at 2 -> periodic reset (5)
    seen = [iteration(0, 0.0), iteration(1, 5e-4), iteration(2, 1e-4), iteration(3, 0.0), iteration(4, 0.0),
            iteration(5, 0.0)]
    assert seen == [(0.0, 0.0), (0.0, 0.0), (1.0, 2.0), (0.0, 2.0), (0.0, 2.0), (1.0, 5.0)]
    # the reference pass sees the snapshot, the live weights come back bitwise
    model = SimpleNamespace()
    with ref.active(model):
        assert weight.tolist() == [5.0] * 3
    assert weight.tolist() == [6.0] * 3
    state = ref.state_dict()
    assert state["last_reset"] == 5 and state["pending"] is False and torch.equal(state["snapshot/w"], torch.full((3,), 5.0))
    with pytest.raises(RuntimeError, match="reference.kl_metric = 'gated_kl' is not a logged statistic"):
        ref.after_update(IterationContext(6, None, [], None), {"kl": 1.0, "skipped": 0.0})


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("setting, key", [
    (["reference.name=adaptive", "reference.reset_every=0", "loss.grpo.beta=0.04"], "reference.reset_every"),
    (["reference.name=adaptive"], "reference.name"),  # nothing reads the reference
    (["credit.name=diversity", "credit.embedding=dinov3"], "credit.embedding"),
    (["collapse.embedding=dinov3"], "collapse.embedding"),
    (["collapse.held_out=toy_genevall"], "collapse.held_out"),
    (["loss.gated_kl.beta=0.07"], "loss.gated_kl.auxiliaries"),
    (["loss.gated_kl.auxiliaries=[jpeg_compressibility]"], "loss.gated_kl.auxiliaries"),  # not in reward.rewards
    (["sampling.base_tail_steps=2", "sampling.window_size=null", "sampling.window_start=fixed",
      "sampling.window_last=null"], "sampling.base_tail_steps"),  # steps 8..9, 8 is trained
    (["sampling.base_tail_steps=10"], "sampling.base_tail_steps"),
])
def test_bad_regulariser_settings_fail_before_any_model_loads_naming_the_key(setting, key):
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, None, setting)
    assert error.value.key == key and key in str(error.value)


def test_base_tail_steps_that_fit_the_window_load():
    # the default window starts at 0..4 and spans 2 steps: steps 6..9 are ODE in every rollout
    assert load_config(TrainConfig, None, ["sampling.base_tail_steps=4"]).sampling.base_tail_steps == 4
    with pytest.raises(ConfigError, match="sampling.base_tail_steps"):
        load_config(TrainConfig, None, ["sampling.base_tail_steps=5"])


# ----------------------------------------------------------------------------------------- base-model tail
def test_the_base_model_takes_the_last_steps_of_the_rollout(tiny_model, tmp_path):  # noqa: F811
    """With a moved LoRA, a rollout with base_tail_steps = 2 (of 4; the SDE on steps 0, 1) keeps the policy's states
    up to x_2 and then steps x_2 -> x_3 -> x_4 with the base model's velocity."""
    from flowalign.samplers import ode_step

    config = load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "run", **{
        "sampling.noise_table": "[0.7, 0.7, 0.0, 0.0]", "sampling.base_tail_steps": 2, "sampling.batch_size": 8}))
    trainer = Trainer(config)
    with torch.no_grad():
        for name, p in trainer.trainable_state().items():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    prompts = trainer.prompts.prompts_for(0)
    (tailed,) = trainer.rollout(0, prompts)
    config.sampling.base_tail_steps = 0
    (plain,) = trainer.rollout(0, prompts)
    t, u = tailed.rollout.transitions, plain.rollout.transitions
    assert torch.equal(t.states[: 3 * 8], u.states[: 3 * 8])  # x_0, x_1, x_2 for the 8 samples
    assert not torch.equal(tailed.rollout.final, plain.rollout.final)
    model, sigmas = trainer.model, trainer.model.sigmas(4, None)
    x = t.states[2 * 8: 3 * 8]
    with torch.no_grad(), model.reference():
        for i in (2, 3):
            x = ode_step(x, model.velocity(x, sigmas[i], tailed.cond, 1.0), sigmas[i], sigmas[i + 1])
    assert torch.equal(x, tailed.rollout.final)
    assert tailed.rollout.nfe == plain.rollout.nfe == 8 * 4


# ------------------------------------------------------------------------------------------ through the trainer
GARDO = {
    "reward.rewards": "[{name: brightness}, {name: jpeg_compressibility, weight: 0.0}, "
                      "{name: jpeg_incompressibility, weight: 0.0}]",
    "credit.name": "diversity", "loss.gated_kl.beta": 1.0,
    "loss.gated_kl.auxiliaries": "[jpeg_compressibility, brightness]", "loss.gated_kl.main": "jpeg_incompressibility",
    "loss.gated_kl.fraction": 0.2, "loss.gated_kl.fraction_max": 0.5,
    "reference.name": "adaptive", "reference.reset_every": 2, "reference.kl_threshold": 1e-9,
    "optim.minibatches": 3,
}


def test_gardo_resumes_bitwise_with_its_reference_and_controller_state(tiny_model, tmp_path):  # noqa: F811
    """4 iterations straight against 2 + a resume: the adaptive reference's snapshot, its reset bookkeeping and the
    gate controller's history come back from the checkpoint, so the weights and metrics are bitwise the same."""
    extra = {**GARDO, "train.iterations": 4, "train.checkpoint_every": 1}
    full = Trainer(load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "full", **extra))).train()
    Trainer(load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "split", **{
        **extra, "train.iterations": 2}))).train()
    checkpoint = tmp_path / "split" / "checkpoint-000002"
    state = json.loads((checkpoint / "state.json").read_text())["components"]
    assert state["loss.gated_kl"]["history"] and "reference" in state
    assert any(k.startswith("reference/snapshot/") for k in load_file(str(checkpoint / "components.safetensors")))
    resumed = Trainer(load_config(TrainConfig, None, overrides(tiny_model, tmp_path / "split", **{
        **extra, "train.resume": "latest"}))).train()
    strip = lambda rows: [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rows]  # noqa: E731
    assert strip(resumed) == strip(full)
    last, expected = 0, []  # the resets follow the rule: the previous iteration's KL above 1e-9, or 2 since the last
    for k, m in enumerate(full):
        reset = k > 0 and (full[k - 1]["reference/kl"] > 1e-9 or k - last >= 2)
        last = k if reset else last
        expected.append(float(reset))
    assert [m["reference/reset"] for m in full] == expected and sum(expected) >= 2
    assert any(m["gated_kl"] > 0 for m in full) and all(m["first_ratio_max"] == 1.0 for m in full)
    a = load_file(str(tmp_path / "full" / "checkpoint-000004" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000004" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = load_file(str(tmp_path / "full" / "checkpoint-000004" / "components.safetensors"))
    d = load_file(str(tmp_path / "split" / "checkpoint-000004" / "components.safetensors"))
    assert c.keys() == d.keys() and all(torch.equal(c[k], d[k]) for k in c)


@pytest.mark.slow
def test_gardo_guard_and_collapse_metrics_on_two_processes_match_one_process(tiny_model, tmp_path):  # noqa: F811
    """torchrun --nproc_per_node 2 (gloo on CPU): the gate (ranked over the gathered batch), the diversity credit
    (whole groups per process), the adaptive reference's KL-triggered reset (the KL averaged over the processes),
    RatioNorm and the collapse metrics (gathered) give the run of one process."""
    settings = {**GARDO, "loss.grpo.ratio_norm": "true", "loss.grpo.step_reweight": "inverse_dt",
                "collapse.held_out": "brightness", "collapse.held_out_kwargs": "{channel: 0}"}
    a, b = _one_vs_two_processes(tiny_model, tmp_path, **settings)
    _assert_same_run(a, b)
    one, two = (json.loads((c / "state.json").read_text()) for c in (a, b))
    for x, y in zip(one["history"], two["history"]):
        for key in ("collapse/diversity", "collapse/saturated_frac", "collapse/held_out/brightness",
                    "gated_kl/gated_frac", "gated_kl/tau", "gated_kl/fraction"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), key
        assert x["reference/reset"] == y["reference/reset"]
    assert one["components"]["loss.gated_kl"] == two["components"]["loss.gated_kl"]
