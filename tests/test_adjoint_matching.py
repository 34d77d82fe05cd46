"""Adjoint matching, DRL's stage 2. Its math (``flowalign.objectives.adjoint_matching_math``, the
memoryless SDE ``flowalign.samplers.memoryless``): the local-linear and offset
Euler steps against hand-computed coefficients and the analytic Gaussian flow, the lean adjoint against a linear
velocity and against the pathwise gradient, the loss, the stratified steps and the outlier clipping. Its objective
(``flowalign.objectives.adjoint_matching``, the drl_adjoint preset): units recomputed from their keyed draws and the
same on two processes, the threshold one iteration behind, the unit keys per minibatch, bitwise resume, bad input."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flowalign.config import load_config
from flowalign.losses import PolicyOutput
from flowalign.objectives import ObjectiveContext
from flowalign.seeding import Purpose
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer

from flowalign.objectives.adjoint_matching_math import (
    OutlierClip,
    adjoint_matching_loss,
    lean_adjoint_step,
    lean_adjoints,
    stratified_steps,
)
from flowalign.samplers.memoryless import diffusion_coefficient, local_linear_coefficients, memoryless_step, sample_memoryless

from golden_runs import small_run_values


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


# ------------------------------------------------------------------------------------------ the objective in the trainer

PRESET = Path(__file__).resolve().parents[1] / "configs/methods/drl_adjoint.yaml"


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from flowalign.models.tiny import tiny_sd3_pipeline
    from test_presets import words

    path = tmp_path_factory.mktemp("tiny") / "sd3"
    tiny_sd3_pipeline(words(), seed=0).save_pretrained(path)
    return path


def adjoint_run(model_path, out, **extra):
    """The drl_adjoint preset on the tiny model, its reward the differentiable brightness, 2 units of 2 at K = 4."""
    values = {**small_run_values(model_path, out), "objectives.adjoint_matching.num_steps": 4,
              "objectives.adjoint_matching.reward": "brightness", "objectives.adjoint_matching.reward_kwargs": "{}",
              "objectives.adjoint_matching.batch_size": 2, **extra}
    return load_config(TrainConfig, PRESET, [f"{k}={v}" for k, v in values.items()])


def test_units_are_the_keyed_trajectories_with_the_lean_adjoints_of_the_base_model(tiny_sd3, tmp_path):
    """A unit is recomputed from its keyed draws: the policy's memoryless trajectory (the LoRA moved, so the policy is
    not the base), -lambda grad r of the decoded final state, the lean adjoint with the base model's vector-Jacobian
    products, the stratified steps; two processes' units are the one process's, bitwise."""
    from flowalign.rewards import differentiable_score

    trainer = Trainer(adjoint_run(tiny_sd3, tmp_path / "run"))
    model, objective = trainer.model, trainer.parts.objectives["adjoint_matching"]
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)

    def context(p=0, n=1):
        return ObjectiveContext(model, trainer.config, 7, 3, p, n, model.device)

    single = objective.units(3, context())
    split = [u for p in range(2) for u in objective.units(3, context(p, 2))]
    assert len(single) == len(split) == 2 and [u.data["index"] for u in single] == [0, 1]
    for a, b in zip(single, split):
        assert torch.equal(a.x, b.x) and torch.equal(a.sigma, b.sigma) and torch.equal(a.data["adjoint"],
                                                                                      b.data["adjoint"])
    unit = single[1]
    draws = context().generator(1, Purpose.OBJECTIVE)
    rows = torch.randint(len(objective.prompts), (2,), generator=draws)
    prompts = [objective.prompts[int(r)]["prompt"] for r in rows]
    noise = model.prepare_noise(2, 32, generator=draws, dtype=torch.float32)
    cond, sigmas = model.encode(prompts), torch.linspace(1, 0, 5)

    def velocity(x, s):
        return model.velocity(x, s, cond, 1.0).float()

    with torch.no_grad():
        states = sample_memoryless(velocity, noise, sigmas, generator=draws, integrator="local_linear")
    steps = stratified_steps(4, generator=draws)
    assert torch.equal(unit.data["steps"], steps) and len(steps) == 2  # round(0.4 K), one on each side of t = 0.6
    final = states[-1].detach().requires_grad_(True)
    (gradient,) = torch.autograd.grad(differentiable_score(objective.reward_model, model.decode(final), prompts).sum(),
                                      final)
    with model.reference():
        adjoints = lean_adjoints(states, sigmas, -10.0 * gradient, velocity, delta=0.25, eps=0.25)
    expected_x = torch.stack([states[k] for k in steps.tolist()], 1).flatten(0, 1)
    expected_a = torch.stack([adjoints[k] for k in steps.tolist()], 1).flatten(0, 1)
    torch.testing.assert_close(unit.x, expected_x, rtol=0, atol=1e-6)
    torch.testing.assert_close(unit.data["adjoint"], expected_a, rtol=1e-5, atol=1e-5)
    assert torch.equal(unit.sigma, sigmas[steps].repeat(2)) and unit.nfe == 2 * (2 * 4 - 1)
    with torch.no_grad():  # the base differs from the moved policy at the unit's states
        v, v_ref = model.velocity(unit.x, unit.sigma, unit.cond, 1.0), None
        with model.reference():
            v_ref = model.velocity(unit.x, unit.sigma, unit.cond, 1.0)
    assert (v - v_ref).abs().max() > 1e-4
    loss, stats = objective.loss(unit, PolicyOutput(v=v, v_ref=v_ref))
    per_row = adjoint_matching_loss(v, v_ref, unit.data["adjoint"], unit.sigma, delta=0.25, eps=0.25)
    assert float(loss) == pytest.approx(float(per_row.view(2, 2).mean(1).sum() / 2), rel=1e-6)
    assert stats["kept"] == 1.0  # no threshold before the first update


def test_the_threshold_moves_after_the_update_through_every_units_quantile_in_key_order():
    """tau masks with the previous iterations' threshold; after the update it moves through each unit's first quantile
    of the iteration (a later epoch's loss of the same unit is not counted), in key order, and it is the state a
    checkpoint keeps."""
    from flowalign.objectives import OBJECTIVES, DataUnit

    objective = OBJECTIVES.build("adjoint_matching")

    def unit(index, v):  # 4 samples of one row each at sigma 0.5; loss 0.5 (2 / s_k)^2 v^2 per dimension
        x = torch.zeros(4, 1, 1, 1)
        return DataUnit(x=x, sigma=torch.full((4,), 0.5), cond=None,
                        data={"adjoint": torch.zeros_like(x), "samples": 4, "index": index, "delta": 0.1, "eps": 0.1,
                              "reward": torch.zeros(4)}), PolicyOutput(v=torch.tensor(v).view(4, 1, 1, 1),
                                                                       v_ref=torch.zeros(4, 1, 1, 1))

    scale = 0.5 * 4 / float(diffusion_coefficient(0.5, delta=0.1, eps=0.1)) ** 2
    second, first = unit(1, [1.0, 2.0, 3.0, 4.0]), unit(0, [1.0, 1.0, 1.0, 10.0])
    for item in (second, first, second):  # unit 1 first; its second loss (another epoch) is not its quantile
        loss, stats = objective.loss(*item)
        assert stats["kept"] == 1.0
    losses = [scale * torch.tensor(v) ** 2 for v in ([1.0, 1.0, 1.0, 10.0], [1.0, 2.0, 3.0, 4.0])]
    q0, q1 = (float(torch.quantile(l.double(), 0.9)) for l in losses)
    stats = objective.after_update(None, {})
    assert stats["adjoint_matching/tau"] == pytest.approx(0.9 * q0 + 0.1 * min(q1, 5 * q0))
    assert objective.state_dict() == {"tau": pytest.approx(0.9 * q0 + 0.1 * min(q1, 5 * q0))}
    loss, stats = objective.loss(*unit(0, [1.0, 1.0, 1.0, 10.0]))  # the 10 is above tau now: it counts as zero
    assert stats["kept"] == 0.75 and float(loss) == pytest.approx(float(losses[0][:3].sum() / 4), rel=1e-6)
    fresh = OBJECTIVES.build("adjoint_matching")
    fresh.load_state_dict(objective.state_dict())
    assert fresh.clip.tau == objective.clip.tau
    fresh.load_state_dict({"tau": None})
    assert fresh.clip.tau is None
    off = OBJECTIVES.build("adjoint_matching", clip=False)
    off.load_state_dict(objective.state_dict())
    assert off.loss(*unit(0, [1.0, 1.0, 1.0, 10.0]))[1]["kept"] == 1.0


def test_unit_keys_give_every_minibatch_the_same_units_on_any_process_count():
    from flowalign.config import ConfigError
    from flowalign.objectives import ObjectiveContext, unit_keys

    config = load_config(TrainConfig, PRESET, ["optim.minibatches=3",
                                               "objectives.adjoint_matching.units_per_iteration=4"])

    def keys(p, n, count=6):
        return unit_keys(count, ObjectiveContext(None, config, 0, 0, p, n))

    assert keys(0, 1) == list(range(6))
    assert (keys(0, 2), keys(1, 2)) == ([0, 2, 4], [1, 3, 5])  # minibatch m: units 2m, 2m + 1 as on one process
    assert keys(1, 3, count=9) == [1, 4, 7]
    with pytest.raises(ValueError, match=r"units_per_iteration = 4 must be a multiple of the processes times "
                                         r"optim\.minibatches \(2 x 3\)"):
        keys(0, 2, count=4)
    one = ObjectiveContext(None, load_config(TrainConfig, PRESET, []), 0, 0, 1, 2)
    assert unit_keys(4, one) == [2, 3]  # one minibatch: the contiguous slice
    with pytest.raises(ConfigError, match=r"objectives\.adjoint_matching\.units_per_iteration = 4 must be a multiple "
                                          r"of the processes times optim\.minibatches \(2 x 3\)"):
        config.check_batch(2)  # the batch arithmetic, before any model loads
    config.check_batch(1)


def test_the_drl_adjoint_preset_resumes_bitwise_with_its_threshold(tiny_sd3, tmp_path):
    """3 iterations against the run resumed from its second checkpoint in another directory: the same threshold and
    weights, bitwise; the first iteration masks nothing, later ones may."""
    full = Trainer(adjoint_run(tiny_sd3, tmp_path / "full", **{"train.iterations": 3,
                                                                   "train.checkpoint_every": 1})).train()
    assert full[0]["objectives/adjoint_matching/kept"] == 1.0 and all(h["grad_norm"] > 0 for h in full)
    taus = [h["adjoint_matching/tau"] for h in full]
    assert all(t > 0 for t in taus) and len(set(taus)) == 3
    resumed = Trainer(adjoint_run(tiny_sd3, tmp_path / "split", **{
        "train.iterations": 3, "train.checkpoint_every": 1,
        "train.resume": str(tmp_path / "full" / "checkpoint-000002")})).train()
    assert [h["adjoint_matching/tau"] for h in resumed[2:]] == taus[2:]
    assert [h["objectives/adjoint_matching/loss"] for h in resumed[2:]] == [full[2]["objectives/adjoint_matching/loss"]]
    a = load_file(str(tmp_path / "full" / "checkpoint-000003" / "trainable.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000003" / "trainable.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_rewards_and_settings_are_refused_before_the_model_loads(tiny_sd3, tmp_path, monkeypatch):
    import flowalign.training.builder as builder
    from flowalign.config import ConfigError
    from flowalign.errors import SetupError

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the objective's reward was checked")

    monkeypatch.setattr(builder, "load_flow_model", no_model)
    with pytest.raises(SetupError, match=r"objectives\.adjoint_matching\.reward.*toy_geneval.*gradient"):
        Trainer(adjoint_run(tiny_sd3, tmp_path / "a", **{"objectives.adjoint_matching.reward": "toy_geneval"}))
    absent = tmp_path / "absent.safetensors"
    with pytest.raises(SetupError, match=r"objectives\.adjoint_matching\.reward_kwargs\.path.*absent\.safetensors.*"
                                         r"flowalign prep train-discriminator"):
        Trainer(adjoint_run(tiny_sd3, tmp_path / "b", **{
            "objectives.adjoint_matching.reward": "discriminator",
            "objectives.adjoint_matching.reward_kwargs": "{path: " + str(absent) + "}"}))
    for key, value, message in [("integrator", "heun", "integrator"), ("step_fraction", 0, "step_fraction"),
                                ("reward_scale", -1, "reward_scale"), ("num_steps", 1, "num_steps"),
                                ("clip_quantile", 1.5, "clip_quantile")]:
        with pytest.raises(ConfigError, match=rf"objectives\.adjoint_matching\.{message}"):
            adjoint_run(tiny_sd3, tmp_path / "c", **{f"objectives.adjoint_matching.{key}": value})
