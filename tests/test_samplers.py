"""sde_step log-probs, ODE steps, noise schedules, rollouts and their bad-input errors."""

import pytest
import torch

from flowalign.samplers import (
    ConstantNoise,
    PerStepNoise,
    SDEWindow,
    check_sigmas,
    noise_schedule,
    ode_step,
    rollout,
    sde_step,
)

KINDS = ("flow_grpo", "dance", "cps")


def batch(seed=0, shape=(4, 3, 8, 8), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_log_prob_is_the_gaussian_density_of_the_sample(kind, reduce):
    x, v = batch()
    out = sde_step(x, v, 0.8, 0.7, kind=kind, noise_level=0.7, reduce=reduce, generator=torch.Generator().manual_seed(1))
    std = out.std.reshape(-1, 1, 1, 1).expand_as(x)
    expected = torch.distributions.Normal(out.mean, std).log_prob(out.prev_sample)
    expected = expected.mean(dim=(1, 2, 3)) if reduce == "mean" else expected.sum(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    assert out.log_prob.shape == (4,) and out.std.shape == (4,)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_log_prob_gives_ratio_exactly_one(kind, dtype):
    x, v = batch(dtype=dtype)
    first = sde_step(x, v, 0.9, 0.8, kind=kind, noise_level=0.7, generator=torch.Generator().manual_seed(3))
    assert first.prev_sample.dtype == dtype and first.log_prob.dtype == torch.float32
    again = sde_step(x, v, 0.9, 0.8, kind=kind, noise_level=0.7, prev_sample=first.prev_sample)
    assert torch.equal(torch.exp(again.log_prob - first.log_prob), torch.ones(4))


def test_step_math_runs_in_fp32_for_bf16_inputs():
    x, v = batch()
    noise = torch.randn_like(x)
    full = sde_step(x, v, 0.5, 0.4, kind="flow_grpo", noise_level=0.7, noise=noise)
    half = sde_step(x.bfloat16(), v.bfloat16(), 0.5, 0.4, kind="flow_grpo", noise_level=0.7, noise=noise)
    assert half.mean.dtype == torch.float32
    # the only difference is the rounding of the inputs, not bf16 arithmetic
    ref = sde_step(x.bfloat16().float(), v.bfloat16().float(), 0.5, 0.4, kind="flow_grpo", noise_level=0.7, noise=noise)
    assert torch.equal(half.mean, ref.mean)
    assert (half.mean - full.mean).abs().max() < 0.05


def test_per_sample_sigmas_match_scalar_steps():
    x, v = batch()
    noise = torch.randn_like(x)
    sig, nxt = torch.tensor([1.0, 0.8, 0.5, 0.2]), torch.tensor([0.9, 0.7, 0.4, 0.1])
    out = sde_step(x, v, sig, nxt, kind="flow_grpo", noise_level=torch.tensor([0.7, 0.7, 0.3, 1.0]), noise=noise)
    for i, level in enumerate([0.7, 0.7, 0.3, 1.0]):
        one = sde_step(x[i : i + 1], v[i : i + 1], sig[i], nxt[i], kind="flow_grpo", noise_level=level, noise=noise[i : i + 1])
        torch.testing.assert_close(out.prev_sample[i : i + 1], one.prev_sample)
        torch.testing.assert_close(out.log_prob[i : i + 1], one.log_prob)


def test_flow_grpo_at_sigma_one_uses_next_sigma_in_denominator():
    x, v = batch()
    out = sde_step(x, v, 1.0, 0.9, kind="flow_grpo", noise_level=0.7, noise=torch.zeros_like(x))
    std_t = 0.7 * (1.0 / (1 - 0.9)) ** 0.5
    assert out.std[0].item() == pytest.approx(std_t * 0.1**0.5, rel=1e-6)
    assert torch.isfinite(out.log_prob).all()


def test_zero_noise_sde_step_is_the_ode_step():
    x, v = batch()
    for kind in KINDS:
        out = sde_step(x, v, 0.6, 0.5, kind=kind, noise_level=0.0)
        torch.testing.assert_close(out.prev_sample, ode_step(x, v, 0.6, 0.5), rtol=1e-6, atol=1e-6)
        assert torch.equal(out.log_prob, torch.zeros(4))


def test_ode_step_matches_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(5)
    x, v = batch()
    expected = x
    ours = x
    for i, t in enumerate(scheduler.timesteps):
        expected = scheduler.step(v, t, expected, return_dict=False)[0]
        ours = ode_step(ours, v, scheduler.sigmas[i], scheduler.sigmas[i + 1])
    assert torch.equal(ours, expected)


# --- bad input --------------------------------------------------------------------------------------------------


def test_unknown_kind_names_the_options():
    x, v = batch()
    with pytest.raises(ValueError, match=r"unknown SDE kind 'ddpm'.*flow_grpo, dance, cps"):
        sde_step(x, v, 0.5, 0.4, kind="ddpm", noise_level=0.5)


def test_negative_noise_level_is_rejected():
    x, v = batch()
    with pytest.raises(ValueError, match=r"noise_level must be >= 0.*-0.1"):
        sde_step(x, v, 0.5, 0.4, kind="flow_grpo", noise_level=-0.1)
    with pytest.raises(ValueError, match=r"noise_level must be >= 0.*-0.2"):
        ConstantNoise(-0.2)
    with pytest.raises(ValueError, match=r"'cps' must lie in \[0, 1\].*1.5"):
        sde_step(x, v, 0.5, 0.4, kind="cps", noise_level=1.5)


def test_non_decreasing_sigmas_are_rejected():
    x, v = batch()
    with pytest.raises(ValueError, match=r"sigma=0.4 and sigma_next=0.5"):
        sde_step(x, v, 0.4, 0.5, kind="flow_grpo", noise_level=0.5)
    with pytest.raises(ValueError, match=r"sigmas\[1\]=0.5 is followed by sigmas\[2\]=0.5"):
        check_sigmas([1.0, 0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match=r"strictly decrease"):
        rollout(lambda x, s: x, torch.zeros(2, 3), torch.tensor([0.0, 0.5, 1.0]), torch.zeros(2))


def test_step_values_are_checked_together_with_each_message_kept():
    """``check_step_values`` reduces every condition first (one device sync on CUDA) and then names the failed one."""
    from flowalign.kernels.sde_reference import check_step_values

    rows = torch.tensor([0.9, 0.5]), torch.tensor([0.8, 0.4]), torch.tensor([0.7, 0.0]), torch.tensor([1.0, 2.0])
    check_step_values(*rows, kind="flow_grpo")  # per-row tensors, a deterministic row: fine
    check_step_values(1.0, 0.9, 1.0, kind="cps")
    with pytest.raises(ValueError, match=r"noise_level must be >= 0.*nan"):
        check_step_values(0.5, 0.4, float("nan"))
    with pytest.raises(ValueError, match=r"'cps' must lie in \[0, 1\]"):
        check_step_values(*rows[:2], torch.tensor([0.5, 1.2]), kind="cps")
    with pytest.raises(ValueError, match=r"1 >= sigma > sigma_next >= 0.*sigma=\[0.9, 0.5\].*sigma_next=\[0.8, 0.6\]"):
        check_step_values(rows[0], torch.tensor([0.8, 0.6]), 0.7)
    with pytest.raises(ValueError, match=r"noise_scale must be > 0, got \[1.0, 0.0\]"):
        check_step_values(*rows[:3], torch.tensor([1.0, 0.0]))
    x, v = batch()
    with pytest.raises(ValueError, match=r"noise_scale must be > 0, got -1"):
        sde_step(x, v, 0.5, 0.4, kind="dance", noise_level=0.5, noise_scale=-1.0)


def test_bad_reduction_and_shapes_are_rejected():
    x, v = batch()
    with pytest.raises(ValueError, match=r"reduction 'max'.*mean, sum"):
        sde_step(x, v, 0.5, 0.4, kind="dance", noise_level=0.5, reduce="max")
    with pytest.raises(ValueError, match=r"prev_sample has shape \(1, 2\)"):
        sde_step(x, v, 0.5, 0.4, kind="dance", noise_level=0.5, prev_sample=torch.zeros(1, 2))


# --- noise schedules -------------------------------------------------------------------------------------------


def test_constant_schedule_keeps_last_step_ode_by_default():
    assert ConstantNoise(0.7).levels(4).tolist() == pytest.approx([0.7, 0.7, 0.7, 0.0])
    assert ConstantNoise(0.7, last_step_ode=False).levels(4).tolist() == pytest.approx([0.7] * 4)
    assert ConstantNoise(0.7).stochastic(3).tolist() == [True, True, False]


def test_per_step_table():
    assert PerStepNoise([0.1, 0.2, 0.0]).levels(3).tolist() == pytest.approx([0.1, 0.2, 0.0])
    with pytest.raises(ValueError, match="3 entries but the rollout has 4 steps"):
        PerStepNoise([0.1, 0.2, 0.0]).levels(4)


def test_fixed_random_and_sliding_windows():
    fixed = SDEWindow(0.9, size=2, first=3)
    assert fixed.levels(10).nonzero().flatten().tolist() == [3, 4]
    rand = SDEWindow(0.9, size=2, start="random", first=0, last=4)
    g = torch.Generator().manual_seed(0)
    starts = {int(rand.levels(10, generator=g).nonzero()[0]) for _ in range(200)}
    assert starts == {0, 1, 2, 3, 4}
    slide = SDEWindow(0.9, size=3, start="sliding")
    assert [int(slide.levels(10, progress=p).nonzero()[0]) for p in (0.0, 0.5, 1.0)] == [0, 3, 6]  # 9 usable steps
    windowed_table = SDEWindow(PerStepNoise([0.1 * i for i in range(6)]), size=2, first=2)
    assert windowed_table.levels(6).tolist() == pytest.approx([0, 0, 0.2, 0.3, 0, 0])


def test_window_larger_than_steps_is_rejected():
    with pytest.raises(ValueError, match=r"window size 12 is larger than the 9 usable steps of a 10-step rollout"):
        SDEWindow(0.7, size=12).levels(10)
    with pytest.raises(ValueError, match=r"starts 0..9 do not fit"):
        SDEWindow(0.7, size=2, start="random", last=9).levels(10)
    with pytest.raises(ValueError, match=r"unknown SDE window start 'middle'"):
        SDEWindow(0.7, size=2, start="middle")


def test_a_window_owns_its_start_arithmetic():
    """The config reads the window's starts, its latest start and whether it moves from ``SDEWindow``."""
    assert SDEWindow(0.7, size=2, first=3).starts(10) == range(3, 4)
    assert SDEWindow(0.7, size=2, start="random", first=1).starts(10) == range(1, 8)
    assert SDEWindow(0.7, size=2, start="sliding", last=4).starts(10) == range(0, 5)
    assert SDEWindow(0.7, size=2).latest_start(10) == 7 and SDEWindow(0.7, size=2, last_step_ode=False).latest_start(
        10) == 8
    assert SDEWindow(0.7, size=12).latest_start(10) < 0
    assert [SDEWindow(0.7, size=2, start=s).reads_progress() for s in ("fixed", "random", "sliding")] == [
        False, False, True]
    assert not ConstantNoise(0.7).reads_progress() and not PerStepNoise([0.1, 0.0]).reads_progress()
    levels = [0.0, 0.7, 0.7, 0.7, 0.7, 0.0]  # the stochastic steps of each rollout: a window start each
    assert SDEWindow(0.7, size=2, start="random").stochastic_step_sets(levels, 6) == [{1}, {1, 2}, {2, 3}, {3, 4}]
    assert ConstantNoise(0.7).stochastic_step_sets(levels, 6) == [{1, 2, 3, 4}]


def test_each_sde_kind_bounds_its_noise_level():
    from flowalign.kernels.sde_kinds import sde_kind
    from flowalign.kernels.sde_reference import check_noise_level

    assert [sde_kind(kind).max_noise_level for kind in KINDS] == [None, None, 1.0]
    check_noise_level(5.0, "flow_grpo")
    with pytest.raises(ValueError, match=r"noise_level for kind 'cps' must lie in \[0, 1\]"):
        check_noise_level(1.5, "cps")


def test_schedule_from_config():
    assert isinstance(noise_schedule(0.7), ConstantNoise)
    assert isinstance(noise_schedule([0.1, 0.0]), PerStepNoise)
    win = noise_schedule({"level": 0.9, "window": 2, "window_start": "random", "window_last": 3})
    assert isinstance(win, SDEWindow) and win.start_range(10) == (0, 3)
    with pytest.raises(ValueError, match=r"unknown noise schedule keys \['levle'\]"):
        noise_schedule({"levle": 0.7})


# --- rollouts --------------------------------------------------------------------------------------------------


def test_rollout_transitions_carry_everything_the_trainer_needs():
    calls = []

    def velocity(x, sigma):
        calls.append(x.shape[0])
        return -x

    x0 = torch.randn(6, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    levels = SDEWindow(0.7, size=2, first=1).levels(4)
    out = rollout(velocity, x0, sigmas, levels, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), prompt_ids=torch.tensor([5, 5, 5, 7, 7, 7]))
    t = out.transitions
    assert len(t) == 6 * 4 and out.nfe == 24 and calls == [6] * 4
    assert t.stochastic.tolist() == [s in (1, 2) for s in t.step.tolist()]
    assert torch.equal(t.x_t[t.step == 0], x0)
    assert torch.equal(t.x_next[t.step == 3], out.final)
    # consecutive steps chain: the destination of step k is the source of step k + 1
    assert torch.equal(t.dst[t.step == 1], t.src[t.step == 2])
    assert (t.std[~t.stochastic] == 0).all() and (t.std[t.stochastic] > 0).all()
    assert (t.log_prob[~t.stochastic] == 0).all()
    assert t.sigma[t.step == 2].unique().tolist() == [0.5] and t.sigma_next[t.step == 2].unique().tolist() == [0.25]
    assert t.group_id[t.sample_id == 4].unique().tolist() == [1] and t.prompt_id[t.sample_id == 4].unique().tolist() == [7]
    # stored log-probs are reproduced from the stored states
    st = t.select(t.stochastic)
    again = sde_step(st.x_t, velocity(st.x_t, None), st.sigma, st.sigma_next, kind=t.kind, noise_level=st.noise_level, prev_sample=st.x_next)
    assert torch.equal(again.log_prob, st.log_prob)
    assert torch.equal(again.std, st.std)


def test_rollout_counts_cfg_evaluations():
    def velocity(x, sigma):
        return -x

    velocity.evals_per_sample = 2
    out = rollout(velocity, torch.zeros(3, 4), torch.tensor([1.0, 0.5, 0.0]), torch.zeros(2))
    assert out.nfe == 12


def test_rollout_is_reproducible_with_a_generator():
    x0 = torch.randn(4, 8)
    args = (lambda x, s: -x, x0, torch.tensor([1.0, 0.6, 0.3, 0.0]), ConstantNoise(0.8).levels(3))
    a = rollout(*args, kind="dance", generator=torch.Generator().manual_seed(9))
    b = rollout(*args, kind="dance", generator=torch.Generator().manual_seed(9))
    assert torch.equal(a.final, b.final) and torch.equal(a.transitions.log_prob, b.transitions.log_prob)


def test_per_row_generators_make_noise_independent_of_batch_layout():
    x = torch.randn(4, 2, 3, 3)
    args = (lambda x, s: -x, torch.tensor([1.0, 0.5, 0.2, 0.0]), ConstantNoise(0.7).levels(3))
    whole = rollout(args[0], x, *args[1:], generator=[torch.Generator().manual_seed(i) for i in range(4)])
    halves = [
        rollout(args[0], x[i : i + 2], *args[1:], generator=[torch.Generator().manual_seed(j) for j in range(i, i + 2)])
        for i in (0, 2)
    ]
    assert torch.equal(whole.final, torch.cat([h.final for h in halves]))
    with pytest.raises(ValueError, match="got 3 generators for a batch of 4"):
        rollout(args[0], x, *args[1:], generator=[torch.Generator()] * 3)
