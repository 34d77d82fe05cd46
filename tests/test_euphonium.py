"""Euphonium (Zhong et al. 2026): the guidance shift, the guided SDE step, the dual-reward advantages, the preset's
guided log-prob and the bad-input check.

The reference numbers below were computed by the public code's ``euphonium/grpo/grpo_sampling/flux_step.py::
flux_step`` (zerzerzerz/Euphonium) in a scratch folder: sigmas ``sd3_time_shift(5, linspace(1, 0, 17))``, ``eta``
0.25, the dance SDE (``sde_solver=True``), inputs ``x, v, 0.5 G`` drawn in that order from
``torch.Generator().manual_seed(1000 B + step)`` with shape ``[B, 4, 3, 3]``, and the step's noise from
``torch.manual_seed(7)`` (its ``randn_like``). Each entry: (log-prob per row, sum and sum of squares of ``x'`` per row).
The degenerate-group value is the public ``trainer.py`` arithmetic ``(r - mean) / (std + 1e-8)`` in float32.
"""

import math

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.credit import euphonium_advantages
from flowalign.kernels.sde_reference import gaussian_log_prob, sde_step_reference
from flowalign.samplers import euphonium_guidance, rollout, sde_step
from flowalign.training.config import TrainConfig

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
SIGMAS = (lambda t: 5 * t / (1 + 4 * t))(torch.linspace(1, 0, 17))

# case -> (scale, kl_beta, normalize, scale_by_dt, log_prob_under), the public code's flags
CASES = {
    "script": (0.01, None, False, True, "unguided"),            # scripts/train_grpo_hunyuan.sh
    "normalized_guided": (0.1, None, True, False, "guided"),
    "kl": (-1.0, 0.1, True, True, "unguided"),                  # c = eta^2 / (2 kl_beta)
    "zero": (0.01, None, True, True, "guided"),                 # a zero gradient
}
REFERENCE = {
    "script/B1/s0": ([2.232726], [-5.17303], [27.0457]),
    "script/B1/s5": ([1.935451], [-2.96374], [37.8925]),
    "script/B1/s12": ([1.275601], [-3.26395], [37.0883]),
    "script/B1/s15": ([0.759392], [4.85358], [28.493]),
    "script/B2/s0": ([2.130666, 2.083488], [1.63849, 1.86854], [28.5773, 30.5718]),
    "script/B2/s5": ([1.832985, 1.78771], [4.73948, -4.95476], [28.8567, 43.781]),
    "script/B2/s12": ([1.172072, 1.127614], [3.36329, -3.65887], [28.7234, 46.8648]),
    "script/B2/s15": ([0.659181, 0.61229], [-1.37005, -4.84458], [21.6573, 35.1926]),
    "normalized_guided/B1/s0": ([2.232537], [-5.22016], [27.106]),
    "normalized_guided/B1/s5": ([1.936004], [-3.11036], [37.9328]),
    "normalized_guided/B1/s12": ([1.275127], [-3.25386], [37.0463]),
    "normalized_guided/B1/s15": ([0.760318], [4.73128], [28.4639]),
    "normalized_guided/B2/s0": ([2.130342, 2.083931], [1.61495, 1.90759], [28.4743, 30.782]),
    "normalized_guided/B2/s5": ([1.833809, 1.787399], [4.7916, -4.92156], [28.7672, 43.5937]),
    "normalized_guided/B2/s12": ([1.172932, 1.126522], [3.34906, -3.63812], [28.4406, 46.7473]),
    "normalized_guided/B2/s15": ([0.658123, 0.611712], [-1.3687, -4.85523], [21.7166, 35.3045]),
    "kl/B1/s0": ([2.234069], [-5.17477], [27.0476]),
    "kl/B1/s5": ([1.930383], [-2.97356], [37.8946]),
    "kl/B1/s12": ([1.278822], [-3.26132], [37.0755]),
    "kl/B1/s15": ([0.745166], [4.76007], [28.4692]),
    "kl/B2/s0": ([2.132379, 2.080865], [1.63767, 1.86991], [28.5735, 30.579]),
    "kl/B2/s5": ([1.827058, 1.789631], [4.7429, -4.95258], [28.8506, 43.7684]),
    "kl/B2/s12": ([1.165694, 1.13379], [3.35973, -3.65367], [28.6516, 46.8347]),
    "kl/B2/s15": ([0.663022, 0.613623], [-1.36903, -4.8526], [21.7012, 35.2763]),
    "zero/B1/s0": ([2.232537], [-5.17283], [27.0455]),
    "zero/B1/s5": ([1.936004], [-2.96256], [37.8923]),
    "zero/B1/s12": ([1.275127], [-3.2642], [37.0895]),
    "zero/B1/s15": ([0.760318], [4.86289], [28.4959]),
    "zero/B2/s0": ([2.130342, 2.083931], [1.63864, 1.86829], [28.578, 30.5706]),
    "zero/B2/s5": ([1.833809, 1.787399], [4.73899, -4.95507], [28.8576, 43.7829]),
    "zero/B2/s12": ([1.172932, 1.126522], [3.36386, -3.65969], [28.7349, 46.8697]),
    "zero/B2/s15": ([0.658123, 0.611712], [-1.37022, -4.84325], [21.6505, 35.179]),
}
RELEASED_DEGENERATE = 0.8085269927978516  # eight rewards of 0.7: the public code's advantage for each


def inputs(batch, step):
    g = torch.Generator().manual_seed(1000 * batch + step)
    x, v, grad = (torch.randn(batch, 4, 3, 3, generator=g) for _ in range(3))
    torch.manual_seed(7)
    return x, v, 0.5 * grad, torch.randn(batch, 4, 3, 3)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("step", [0, 5, 12, 15])
def test_guided_dance_step_matches_the_public_flux_step(case, batch, step):
    scale, kl_beta, normalize, scale_by_dt, under = CASES[case]
    x, v, grad, noise = inputs(batch, step)
    if case == "zero":
        grad = torch.zeros_like(grad)
    s, s_next = SIGMAS[step], SIGMAS[step + 1]
    shift = euphonium_guidance(grad, s, s_next, noise_level=0.25, scale=scale, normalize=normalize,
                               scale_by_dt=scale_by_dt, kl_beta=kl_beta, norm="batch")  # the public code's norm
    out = sde_step(x, v, s, s_next, kind="dance", noise_level=0.25, noise=noise, mean_shift=shift,
                   log_prob_under=under)
    log_prob, total, squares = REFERENCE[f"{case}/B{batch}/s{step}"]
    torch.testing.assert_close(out.log_prob, torch.tensor(log_prob), rtol=0, atol=2e-6)
    torch.testing.assert_close(out.prev_sample.flatten(1).sum(1), torch.tensor(total), rtol=0, atol=5e-5)
    torch.testing.assert_close(out.prev_sample.flatten(1).pow(2).sum(1), torch.tensor(squares), rtol=1e-5, atol=0)
    if case == "zero":  # no gradient: bitwise the plain dance step
        plain = sde_step(x, v, s, s_next, kind="dance", noise_level=0.25, noise=noise)
        assert torch.equal(shift, torch.zeros_like(shift))
        assert torch.equal(out.prev_sample, plain.prev_sample) and torch.equal(out.log_prob, plain.log_prob)


def test_guidance_hand_cases_and_per_sample_norm():
    grad = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 2.0]])
    # raw: c G with c = scale (sigma - sigma_next); a zero row stays zero
    raw = euphonium_guidance(grad, 0.5, 0.3, noise_level=0.25, scale=0.01, normalize=False, scale_by_dt=True)
    torch.testing.assert_close(raw, 0.01 * 0.2 * grad)
    # per sample: each row to unit norm (+1e-8); the batch norm divides by ||G|| over all rows (sqrt 29)
    unit = euphonium_guidance(grad, 0.5, 0.3, noise_level=0.25, scale=1.0, normalize=True, scale_by_dt=False)
    torch.testing.assert_close(unit, torch.tensor([[0.6, 0.8], [0.0, 0.0], [0.0, 1.0]]))
    whole = euphonium_guidance(grad, 0.5, 0.3, noise_level=0.25, scale=1.0, normalize=True, scale_by_dt=False,
                               norm="batch")
    torch.testing.assert_close(whole, grad / math.sqrt(29))
    # KL mode: c = eta^2 / (2 kl_beta), per-sample sigmas
    kl = euphonium_guidance(grad, torch.tensor([0.5, 0.5, 0.9]), torch.tensor([0.3, 0.3, 0.8]), noise_level=0.5,
                            scale=-1.0, kl_beta=0.25, normalize=False, scale_by_dt=True)
    torch.testing.assert_close(kl, 0.5 * torch.tensor([[0.2], [0.2], [0.1]]) * grad)
    with pytest.raises(ValueError, match="kl_beta > 0"):
        euphonium_guidance(grad, 0.5, 0.3, noise_level=0.25, scale=-1.0, normalize=False, scale_by_dt=True)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_shifted_step_draws_around_the_shifted_mean_and_scores_either_mean(kind):
    g = torch.Generator().manual_seed(3)
    x, v, noise, shift = (torch.randn(2, 4, 4, 4, generator=g) for _ in range(4))
    shift = 0.05 * shift
    plain = sde_step(x, v, 0.6, 0.45, kind=kind, noise_level=0.5, noise=noise)
    assert torch.equal(plain.prev_sample, sde_step_reference(x, v, 0.6, 0.45, kind=kind, noise_level=0.5,
                                                             noise=noise).prev_sample)  # mean_shift None: unchanged
    std = plain.std.reshape(-1, 1, 1, 1)
    for under in ("unguided", "guided"):
        out = sde_step(x, v, 0.6, 0.45, kind=kind, noise_level=0.5, noise=noise, mean_shift=shift, log_prob_under=under)
        assert torch.equal(out.prev_sample, (plain.mean + shift) + std * noise)
        mean = plain.mean + (shift if under == "guided" else 0)
        torch.testing.assert_close(out.log_prob, gaussian_log_prob(out.prev_sample, mean, std), rtol=0, atol=1e-5)
        rescored = sde_step(x, v, 0.6, 0.45, kind=kind, noise_level=0.5, prev_sample=out.prev_sample,
                            mean_shift=shift, log_prob_under=under)
        assert torch.equal(rescored.log_prob, out.log_prob)  # scoring the stored sample again: ratio exactly 1


def test_dance_at_the_flow_grpo_noise_schedule_is_flow_grpo():
    """METHODS identity 1: dance at eta(s) = a sqrt(s / (1 - s)) is flow_grpo at a (for s < 1)."""
    g = torch.Generator().manual_seed(5)
    x, v = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    for s, s_next in ((0.9, 0.8), (0.5, 0.35), (0.2, 0.0)):
        dance = sde_step(x, v, s, s_next, kind="dance", noise_level=0.7 * math.sqrt(s / (1 - s)),
                         noise=torch.zeros_like(x))
        flow = sde_step(x, v, s, s_next, kind="flow_grpo", noise_level=0.7, noise=torch.zeros_like(x))
        torch.testing.assert_close(dance.mean, flow.mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dance.std, flow.std, rtol=1e-6, atol=0)


def test_guided_rollout_stores_the_shift_only_for_the_guided_log_prob():
    x0 = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    velocity = lambda x, sigma: 0.5 * x  # noqa: E731
    sigmas, levels = torch.linspace(1, 0, 5), torch.tensor([0.3, 0.3, 0.3, 0.0])
    guide = lambda x, v, s, s_next, step: torch.ones_like(x) if step >= 2 and step < 3 else None  # noqa: E731
    generator = lambda: [torch.Generator().manual_seed(k) for k in range(2)]  # noqa: E731
    plain = rollout(velocity, x0, sigmas, levels, kind="dance", generator=generator())
    unguided = rollout(velocity, x0, sigmas, levels, kind="dance", generator=generator(), guidance=guide)
    guided = rollout(velocity, x0, sigmas, levels, kind="dance", generator=generator(), guidance=guide,
                     log_prob_under="guided")
    assert unguided.transitions.log_prob_shift is None
    shift = guided.transitions.log_prob_shift
    assert shift.shape == (8, 4, 4, 4) and shift[4:6].eq(1).all() and shift[:4].eq(0).all() and shift[6:].eq(0).all()
    assert torch.equal(plain.transitions.states[:6], unguided.transitions.states[:6])  # steps before the guidance
    assert not torch.equal(plain.final, unguided.final) and torch.equal(unguided.final, guided.final)
    assert guided.transitions.select(torch.tensor([4, 5])).log_prob_shift.eq(1).all()
    with pytest.raises(ValueError, match="step 3, an ODE step"):
        rollout(velocity, x0, sigmas, levels, kind="dance", generator=generator(),
                guidance=lambda x, v, s, s_next, step: torch.ones_like(x))


def advantages(**kw):
    outcome = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.7, 0.7, 0.7, 0.7])
    # states x_0..x_3 (T = 3), guided transitions 1 and 2
    process = torch.tensor([[0, 1, 2, 4], [0, 2, 2, 3], [0, 3, 1, 1], [0, 4, 5, 2]] * 2, dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    return euphonium_advantages(outcome, process, groups, torch.tensor([False, True, True]), **kw)


def test_dual_reward_advantages_by_hand():
    z = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(5 / 3)  # (r - mean) / unbiased std of 1, 2, 3, 4
    out = advantages(eps=1e-12)
    torch.testing.assert_close(out["outcome"][:4], z)
    assert out["outcome"][4:].eq(0).all()  # identical rewards: exactly zero (the public code: +0.8085 each)
    # credit next: transition 1 gets PRM(x_2) = 2, 2, 1, 5; transition 2 gets PRM(x_3) = 4, 3, 1, 2; transition 0 none
    next_1 = torch.tensor([2.0, 2, 1, 5])
    next_1 = (next_1 - 2.5) / next_1.std()
    torch.testing.assert_close(out["process"][:4, 1], next_1)
    assert out["process"][:, 0].eq(0).all()
    torch.testing.assert_close(out["advantages"][:4], z[:, None] + out["process"][:4])
    # released: transition 1 gets PRM(x_1) = 1, 2, 3, 4 (the state before the action)
    released = advantages(eps=1e-12, credit="released")
    torch.testing.assert_close(released["process"][:4, 1], z)
    # increment: transition 2 gets PRM(x_3) - PRM(x_2) = 2, 1, 0, -3
    inc = advantages(eps=1e-12, credit="increment")["process"][:4, 2]
    d = torch.tensor([2.0, 1, 0, -3])
    torch.testing.assert_close(inc, (d - d.mean()) / d.std())


def test_loss_modes_and_weights():
    both = advantages(outcome_weight=0.5, process_weight=2.0)
    none = advantages(mode="none", outcome_weight=0.5)
    only = advantages(mode="only", process_weight=2.0)
    torch.testing.assert_close(none["advantages"], both["outcome"][:, None].expand(-1, 3))
    torch.testing.assert_close(only["advantages"], 2.0 * both["process"])
    torch.testing.assert_close(both["advantages"], 0.5 * both["outcome"][:, None] + 2.0 * both["process"])


def test_degenerate_groups_give_exactly_zero():
    r = torch.full((8,), 0.7, dtype=torch.float32)
    assert ((r - r.mean()) / (r.std() + 1e-8)).tolist() == pytest.approx([RELEASED_DEGENERATE] * 8)  # the public code
    for eps in (1e-8, 1e-4):
        out = euphonium_advantages(r, torch.full((8, 3), 0.3), torch.zeros(8), torch.tensor([True, True]), eps=eps)
        assert out["advantages"].eq(0).all()
    # one valid member, a NaN outcome and a lone group: 0, never NaN
    out = euphonium_advantages(torch.tensor([1.0, float("nan"), 2.0]), torch.zeros(3, 2), torch.tensor([0, 0, 1]),
                               torch.tensor([True]))
    assert out["advantages"].eq(0).all()
    with pytest.raises(ValueError, match="not scored"):
        euphonium_advantages(torch.ones(2), torch.full((2, 3), float("nan")), torch.zeros(2), torch.tensor([True, False]))


def test_a_process_reward_without_a_gradient_fails_at_load_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, REPO / "configs/methods/euphonium.yaml",
                    ["credit.process_reward=toy_geneval", f"model.path={tmp_path / 'missing'}"])
    message = str(error.value)
    assert message.startswith("credit.process_reward") and "not differentiable" in message
    assert "toy_geneval_soft" in message



def test_registers_and_a_process_reward_together_fail_at_load_naming_the_key(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, REPO / "configs/methods/euphonium.yaml",
                    [f"credit.registers={tmp_path / 'r.pt'}", f"model.path={tmp_path / 'missing'}"])
    message = str(error.value)
    assert message.startswith("credit.registers") and "exactly one process reward" in message
    assert "process_reward: null" in message


def test_a_missing_register_checkpoint_fails_before_the_model_loads_naming_the_key(tmp_path):
    from flowalign.errors import SetupError
    from flowalign.training.trainer import Trainer

    config = load_config(TrainConfig, REPO / "configs/methods/euphonium.yaml", [
        "credit.process_reward=null", f"credit.registers={tmp_path / 'r.pt'}", f"model.path={tmp_path / 'missing'}",
        f"train.out_dir={tmp_path / 'run'}", "reward.rewards=[{name: brightness}]"])
    assert config.credit.process_reward is None and config.credit.registers == str(tmp_path / "r.pt")
    with pytest.raises(SetupError) as error:  # model.path does not exist either: the registers are checked first
        Trainer(config)
    message = str(error.value)
    assert message.startswith("credit.registers") and "flowalign prep registers" in message
