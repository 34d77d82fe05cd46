"""Adjoint matching's math (DRL's stage 2, ``flowalign.objectives.adjoint_matching``): the local-linear and offset
Euler steps against hand-computed coefficients and the analytic Gaussian flow, the lean adjoint against a linear
velocity and against the pathwise gradient, the loss, the stratified steps and the outlier clipping."""

import math

import pytest
import torch

from flowalign.objectives.adjoint_matching import (
    OutlierClip,
    adjoint_matching_loss,
    diffusion_coefficient,
    lean_adjoint_step,
    lean_adjoints,
    local_linear_coefficients,
    memoryless_step,
    sample_memoryless,
    stratified_steps,
)


def grid(steps: int) -> torch.Tensor:
    """The paper's K uniform steps from noise to data."""
    return torch.linspace(1, 0, steps + 1, dtype=torch.float64)


@pytest.mark.parametrize("sigma,expected", [
    # K = 10, delta = eps = 0.1 (METHODS.md §3's unit case). s = 1 -> 0.9: u = 0.1, u' = 0.2, Phi = 1/2,
    # Omega = 0.2 (1 - 1/4), V = 1.2 (3/4) - (2/3)(0.2 - 0.1/4)
    (1.0, (0.5, 0.15, 0.9 - 2 / 3 * 0.175)),
    # s = 0.5 -> 0.4: u = 0.6, u' = 0.7, Phi = 6/7, 1 - Phi^2 = 13/49
    (0.5, (6 / 7, 0.7 * 13 / 49, 1.2 * 13 / 49 - 2 / 3 * (0.7 - 36 / 49 * 0.6))),
])
def test_local_linear_coefficients_by_hand(sigma, expected):
    phi, omega, variance = local_linear_coefficients(sigma, sigma - 0.1, delta=0.1, eps=0.1)
    assert [float(phi), float(omega), float(variance)] == pytest.approx(expected, abs=1e-12)


def test_one_step_of_each_integrator_by_hand():
    x, v, noise = torch.tensor([[2.0]]), torch.tensor([[-1.0]]), torch.tensor([[0.5]])
    local = memoryless_step(x, v, 0.5, 0.4, noise, delta=0.1, eps=0.1)
    phi, omega, variance = 6 / 7, 0.7 * 13 / 49, 1.2 * 13 / 49 - 2 / 3 * (0.7 - 36 / 49 * 0.6)
    assert float(local) == pytest.approx(phi * 2 + omega + math.sqrt(variance) * 0.5, abs=1e-6)
    euler = memoryless_step(x, v, 0.5, 0.4, noise, delta=0.1, eps=0.1, integrator="euler")
    # X + (-2 v - X / u) dt + sqrt(2 (s + eps) dt / u) xi with u = 0.6, dt = 0.1
    assert float(euler) == pytest.approx(2 + (2 - 2 / 0.6) * 0.1 + math.sqrt(2 * 0.6 * 0.1 / 0.6) * 0.5, abs=1e-6)
    assert float(diffusion_coefficient(0.5, delta=0.1, eps=0.1)) == pytest.approx(math.sqrt(2 * 0.6 / 0.6))


def gaussian_velocity(mean: float, std: float):
    """The exact flowalign velocity ``E[eps - x0 | x_s]`` of data ``N(mean, std^2)``."""
    def velocity(x, sigma):
        s = float(sigma)
        t = 1 - s
        variance = t * t * std * std + s * s
        residual = x - t * mean
        return s / variance * residual - (mean + t * std * std / variance * residual)
    return velocity


def test_the_local_linear_sampler_keeps_the_gaussian_marginal_better_than_euler():
    """K = 100 uniform steps, delta = eps = 1/K, last step a denoising call, data N(1.5, 0.5^2): METHODS.md §3 expects
    mean 1.510 and std 0.502 (local-linear) against std 0.510 (Euler-Maruyama); measured 1.5109 / 0.5020 and 0.5092."""
    noise = torch.randn(400_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    final = {}
    for integrator in ("local_linear", "euler"):
        states = sample_memoryless(gaussian_velocity(1.5, 0.5), noise, grid(100),
                                   generator=torch.Generator().manual_seed(1), integrator=integrator)
        assert len(states) == 101
        final[integrator] = states[-1]
    assert float(final["local_linear"].mean()) == pytest.approx(1.510, abs=0.003)
    assert float(final["local_linear"].std()) == pytest.approx(0.502, abs=0.002)
    assert float(final["euler"].std()) == pytest.approx(0.510, abs=0.002)


def test_the_lean_adjoint_of_a_linear_velocity_uses_its_transposed_matrix():
    """``v_base(x) = A x + c`` makes ``J^T a = A^T a`` exactly: each step is ``Phi (a' - 2 dt A^T a')`` (local-linear)
    or ``a' - dt (2 A^T a' + a' / u')`` (Euler)."""
    A = torch.tensor([[0.3, -1.2], [0.5, 0.8]], dtype=torch.float64)
    c = torch.tensor([0.1, -0.2], dtype=torch.float64)
    sigmas = grid(10)
    states = [torch.randn(3, 2, generator=torch.Generator().manual_seed(k), dtype=torch.float64) for k in range(11)]
    terminal = torch.randn(3, 2, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    for integrator in ("local_linear", "euler"):
        adjoints = lean_adjoints(states, sigmas, terminal, lambda x, s: x @ A.T + c, delta=0.1, eps=0.1,
                                 integrator=integrator)
        expected = terminal
        for k in range(9, -1, -1):
            u, u_next = 1 - float(sigmas[k]) + 0.1, 1 - float(sigmas[k + 1]) + 0.1
            jta = expected @ A
            if integrator == "local_linear":
                expected = u / u_next * (expected - 2 * 0.1 * jta)
            else:
                expected = expected - 0.1 * (2 * jta + expected / u_next)
            assert torch.allclose(adjoints[k], expected, atol=1e-12), (integrator, k)
        assert len(adjoints) == 11 and adjoints[-1] is terminal


def test_the_lean_adjoint_converges_to_the_pathwise_gradient_of_the_noise_free_sampler():
    """With ``a_K = 1`` the adjoint at ``X_0`` is ``d X_K / d X_0`` through the base drift; the sampler's noise-free
    map discretises the same flow, so the two agree up to O(1/K) (fixed offsets 0.05): measured errors 0.042, 0.010,
    0.0026 (local-linear) and 0.017, 0.0040, 0.0010 (Euler) at K = 50, 200, 800."""
    def velocity(x, sigma):
        return -0.7 * x * (1 + float(sigma)) + 0.3

    errors = {"local_linear": [], "euler": []}
    for steps in (50, 200):
        sigmas = grid(steps)
        start = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
        states = [start]
        for k in range(steps):
            v = velocity(states[-1], sigmas[k])
            states.append(states[-1] - float(sigmas[k]) * v if k == steps - 1 else memoryless_step(
                states[-1], v, sigmas[k], sigmas[k + 1], torch.zeros(1, dtype=torch.float64), delta=0.05, eps=0.05))
        (pathwise,) = torch.autograd.grad(states[-1].sum(), start)
        for integrator in errors:
            adjoint = lean_adjoints([s.detach() for s in states], sigmas, torch.ones(1, dtype=torch.float64),
                                    velocity, delta=0.05, eps=0.05, integrator=integrator)[0]
            errors[integrator].append(abs(float(adjoint - pathwise)))
    for integrator, (coarse, fine) in errors.items():
        assert coarse < 0.05 and fine < coarse / 3, (integrator, coarse, fine)


def test_the_loss_by_hand_and_zero_at_the_optimal_control():
    sigma, delta, eps = 0.5, 0.1, 0.1
    scale = math.sqrt(2 * 0.6 / 0.6)
    v_base = torch.tensor([[1.0, -2.0]])
    v_theta = torch.tensor([[1.5, -2.0]])
    adjoint = torch.tensor([[0.2, 0.4]])
    loss = adjoint_matching_loss(v_theta, v_base, adjoint, sigma, delta=delta, eps=eps)
    by_hand = 0.5 * ((2 / scale * 0.5 - scale * 0.2) ** 2 + (scale * 0.4) ** 2)
    assert loss.shape == (1,) and float(loss) == pytest.approx(by_hand, rel=1e-6)
    optimal = v_base + scale ** 2 * adjoint / 2  # v_theta - v_base = sigma^2 a / 2
    assert float(adjoint_matching_loss(optimal, v_base, adjoint, sigma, delta=delta, eps=eps)) == pytest.approx(0, abs=1e-10)


def test_stratified_steps_take_forty_percent_half_on_each_side_of_t_0_6():
    steps = stratified_steps(100, generator=torch.Generator().manual_seed(0))
    assert len(steps) == 40 and len(set(steps.tolist())) == 40 and steps.tolist() == sorted(steps.tolist())
    assert int((steps < 60).sum()) == 20 and int((steps >= 60).sum()) == 20
    again = stratified_steps(100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(steps, again)
    # 10 steps: 4 trained, 2 of t in {0, .., 0.5} and 2 of {0.6, .., 0.9}
    few = stratified_steps(10, generator=torch.Generator().manual_seed(3))
    assert len(few) == 4 and int((few < 6).sum()) == 2
    with pytest.raises(ValueError, match="fraction"):
        stratified_steps(10, fraction=0)


def test_outlier_clipping_follows_the_ema_of_the_capped_quantile():
    clip = OutlierClip(alpha=0.5, rho=0.9, cap=5.0)
    first = clip.mask(torch.tensor([1.0, 2.0, 3.0, 100.0]))  # median 2.5 starts tau
    assert clip.tau == pytest.approx(2.5) and first.tolist() == [True, True, False, False]
    # median 40, capped at 5 tau = 12.5: tau = 0.9 2.5 + 0.1 12.5 = 3.5
    second = clip.mask(torch.tensor([30.0, 50.0, 3.0, 4.0]))
    assert clip.tau == pytest.approx(3.5) and second.tolist() == [False, False, True, False]
    # a quiet batch (median 1) pulls tau down: 0.9 3.5 + 0.1 1 = 3.25
    clip.mask(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert clip.tau == pytest.approx(3.25)


def test_bad_input_names_the_integrator_and_the_states():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="integrator must be one of"):
        memoryless_step(x, x, 0.5, 0.4, x, delta=0.1, eps=0.1, integrator="heun")
    with pytest.raises(ValueError, match="integrator must be one of"):
        lean_adjoint_step(x, x, 0.5, 0.4, delta=0.1, integrator="rk4")
    with pytest.raises(ValueError, match="3 states for 11 sigmas"):
        lean_adjoints([x, x, x], grid(10), x, lambda y, s: y, delta=0.1)
