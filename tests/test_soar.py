"""SOAR's math (flowalign.objectives.soar_math) against the released code's numbers, and the ``soar`` objective.

The reference numbers were computed by running the released code's own functions
(Tencent-Hunyuan/HY-SOAR ``soar/utils/algorithm.py``: ``t_to_sigma_timestep``, ``sigma_to_t``,
``single_step_aux_points`` with ``stochastic_rollout_step``) on diffusers' ``FlowMatchEulerDiscreteScheduler(
num_train_timesteps=1000, shift=3.0)``, with ``torch.rand`` / ``torch.randn_like`` replaced by the explicit draws of
``_case()`` below; the checksums are ``latents.flatten(1) @ [1, 2, 3, 4]`` per point and sample.
"""

import pytest
import torch

from flowalign.objectives import DataUnit
from flowalign.objectives.soar_math import (
    aux_model_sigma,
    aux_sigmas,
    clean_boundary,
    next_time,
    rollout_step,
    soar_aux_points,
    soar_loss,
    table_sigma,
    training_table,
)

# Indices i whose released round trip (first sigma <= sigma_i, t = 1 - i/1000, back to an index) lands on i - 1.
ROUND_TRIP_OFFSETS = [
    1, 2, 5, 6, 10, 11, 14, 15, 16, 19, 20, 24, 25, 28, 29, 30, 33, 34, 38, 39, 42, 43, 47, 48, 52, 53, 56, 57, 58,
    61, 62, 66, 70, 71, 75, 76, 80, 81, 84, 85, 89, 93, 94, 98, 99, 103, 104, 107, 108, 109, 112, 113, 117, 121, 122,
    126, 127, 131, 132, 135, 137, 140, 145, 149, 150, 154, 155, 159, 160, 163, 168, 172, 173, 177, 178, 182, 183, 186,
    188, 191, 196, 200, 201, 205, 206, 209, 210, 211, 214, 219, 223, 224, 228, 229, 233, 234, 237, 239, 242, 246, 247,
    251, 252, 257, 262, 267, 270, 275, 280, 285, 290, 293, 295, 298, 303, 308, 313, 318, 321, 326, 331, 336, 341, 344,
    346, 349, 354, 359, 364, 367, 369, 372, 377, 382, 387, 392, 395, 400, 405, 410, 415, 418, 420, 423, 428, 433, 438,
    443, 446, 451, 456, 461, 466, 469, 471, 474, 479, 484, 489, 492, 494, 497, 502, 506, 511]

# single_step_aux_points, ODE path (6 points x 3 samples): sigma', the model timestep, checksums of z' and v_corr.
ODE_SIGMA = [[0.5609571, 0.9962635, 0.7553922], [0.2123685, 0.9915864, 0.741259], [0.9929159, 0.9992637, 0.8973097],
             [0.9744653, 0.9942281, 0.7886076], [0.9264812, 0.9955383, 0.8909469], [0.7961933, 0.9979956, 0.7883046]]
ODE_TS = [[560.1505, 995.9678, 755.2136], [211.3402, 991.8699, 740.8907], [992.9006, 998.998, 897.1062],
          [974.4218, 993.9272, 789.0994], [926.1668, 995.6288, 890.7393], [795.7746, 998.3278, 787.7493]]
ODE_LAT = [[-1.676002, 3.652275, 2.180961], [1.624927, 3.641206, 2.048752], [-5.766397, 3.659376, 3.508528],
           [-5.591682, 3.647459, 2.491674], [-5.1373, 3.650559, 3.449008], [-3.903551, 3.656374, 2.48884]]
ODE_VC = [[-9.87866, 7.506058, 9.590446], [-10.55041, 7.530299, 9.594944], [-9.700621, 7.490628, 9.553127],
          [-9.704998, 7.51658, 9.580507], [-9.717199, 7.509801, 9.554546], [-9.757747, 7.497138, 9.580595]]
# The second path (samples 1 and 2: sample 0 reaches t1 = 0 and keeps only the ODE path), per kind.
SDE_SIGMA = [[0.9963745, 0.8798895], [0.9998884, 0.8944695], [0.9935141, 0.8517022], [0.9972401, 0.9321558],
             [0.9962721, 0.7758324], [0.9943503, 0.8558948]]
SDE = {
    "flow_sde": ([[-2.074003, 3.137954], [3.48461, 3.299545], [-6.599021, 2.825552], [-0.7047403, 3.717225],
                  [-2.235992, 1.984683], [-5.276242, 2.872019]],
                 [[1.758107, 9.321102], [7.311162, 9.349823], [-2.791389, 9.26279], [3.129633, 9.419895],
                  [1.595693, 9.084785], [-1.458747, 9.271708]]),
    "cps": ([[2.988139, 2.156059], [3.640406, 2.43684], [2.457158, 1.613227], [3.148813, 3.162603],
             [2.969131, 0.1521278], [2.612378, 1.693969]],
            [[6.838669, 8.205173], [7.466976, 8.385335], [6.323911, 7.839376], [6.993852, 8.824908],
             [6.820292, 6.722734], [6.474694, 7.895311]]),
    "simple": ([[3.638782, 3.235227], [3.660431, 3.38501], [3.621158, 2.945652], [3.644114, 3.772169],
                [3.63815, 2.166228], [3.626309, 2.988724]],
               [[7.491679, 9.431654], [7.487002, 9.445371], [7.495509, 9.403803], [7.490523, 9.47884],
                [7.491816, 9.318784], [7.494387, 9.408061]]),
    "sde": ([[1.803225, 0.9289857], [3.603938, 1.358718], [0.3373446, 0.09818496], [2.246798, 2.469493],
             [1.750749, -2.138016], [0.7658591, 0.2217602]],
            [[5.649443, 6.810596], [7.430504, 7.180015], [4.190259, 6.060536], [6.08934, 8.081352],
             [5.597351, 3.77088], [4.617684, 6.175229]]),
}
WEIGHTS = torch.arange(1.0, 5.0)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _case():
    """Three samples: t0 = 0.01 (t1 = 0, the clean boundary), 0.9999 (s0 = 1) and 0.5; latents [3, 1, 2, 2]."""
    shape = (3, 1, 2, 2)
    t0 = torch.tensor([0.01, 0.9999, 0.5])
    z0, z1, v = (torch.randn(shape, generator=_g(s)) for s in (1, 2, 3))
    u_ode, xi, u_sde = torch.rand(6, 3, generator=_g(4)), torch.randn(2, 1, 2, 2, generator=_g(5)), \
        torch.rand(6, 2, generator=_g(6))
    return t0, z0, z1, v, u_ode, xi, u_sde


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=2e-6, atol=2e-6)


def test_the_shift_3_table_matches_diffusers_and_its_round_trip_quirk_the_released_code():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sigmas, timesteps = training_table(3.0)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    assert torch.equal(sigmas, scheduler.sigmas) and torch.equal(timesteps, scheduler.timesteps)
    assert sigmas[0] == 1.0 and abs(float(sigmas[-1]) - 0.002994012) < 1e-9 and len(sigmas) == 1000
    # t -> sigma: entry floor((1 - t) 1000), clamped (t1 = 0 is entry 999, not 0).
    t = torch.tensor([0.0, 0.0001, 0.025, 0.5, 0.9999, 1.0, 0.3, 0.7])
    _close(table_sigma(t, sigmas), [0.002994012, 0.002994012, 0.07142857, 0.75, 1.0, 1.0, 0.5625, 0.87499994])
    # The model sigma at each table entry: the released round trip lands one entry earlier on 165 indices.
    released = aux_model_sigma(sigmas, sigmas)
    landed = torch.searchsorted(-sigmas, -released)
    offsets = (landed != torch.arange(1000)).nonzero().squeeze(1)
    assert offsets.tolist() == ROUND_TRIP_OFFSETS and torch.equal(landed[offsets], offsets - 1)
    assert torch.equal(aux_model_sigma(sigmas, sigmas, "continuous"), sigmas)
    # Between entries: the released timesteps (model sigma x 1000, as the model computes it).
    between = torch.tensor([0.003, 0.5, 0.75, 0.999, 1.0, 0.9990001, 0.2])
    _close(aux_model_sigma(between, sigmas) * 1000, [2.994012, 500.0, 750.0, 998.998, 1000.0, 998.998, 197.91666])
    with pytest.raises(ValueError, match="released"):
        aux_model_sigma(between, sigmas, "exact")


def test_aux_points_of_the_ode_path_match_the_released_code_at_the_boundaries():
    t0, z0, z1, v, u_ode, _, _ = _case()
    sigmas, _ = training_table()
    s0 = table_sigma(t0, sigmas)
    assert s0.tolist()[1] == 1.0 and clean_boundary(t0, 40).tolist() == [True, False, False]
    s1 = table_sigma(next_time(t0, 40), sigmas)
    assert s1[0] == sigmas[-1]  # t1 = 0 reads the table's last entry (about 0.003), not 0
    z_t0 = (1 - s0.view(-1, 1, 1, 1)) * z0 + s0.view(-1, 1, 1, 1) * z1
    z_t1 = rollout_step("ode", z_t0, v, s0, s1)
    sigma_aux = aux_sigmas(s1, u_ode)
    latents, targets = soar_aux_points(z0, z1, z_t1, s1, sigma_aux)
    assert latents.shape == targets.shape == (6, 3, 1, 2, 2)
    _close(sigma_aux, ODE_SIGMA)
    _close(aux_model_sigma(sigma_aux, sigmas) * 1000, ODE_TS)
    _close(latents.flatten(2) @ WEIGHTS, ODE_LAT)
    _close(targets.flatten(2) @ WEIGHTS, ODE_VC)


@pytest.mark.parametrize("kind", sorted(SDE))
def test_aux_points_of_each_sde_path_match_the_released_code(kind):
    t0, z0, z1, v, _, xi, u_sde = _case()
    sigmas, _ = training_table()
    s0, s1 = table_sigma(t0, sigmas), table_sigma(next_time(t0, 40), sigmas)
    z_t0 = (1 - s0.view(-1, 1, 1, 1)) * z0 + s0.view(-1, 1, 1, 1) * z1
    active = (~clean_boundary(t0, 40)).nonzero().squeeze(1)
    assert active.tolist() == [1, 2]
    z_t1 = rollout_step(kind, z_t0[active], v[active], s0[active], s1[active], xi, noise_scale=0.5,
                        sigma_max=float(sigmas[1]))
    sigma_aux = aux_sigmas(s1[active], u_sde)
    latents, targets = soar_aux_points(z0[active], z1[active], z_t1, s1[active], sigma_aux)
    _close(sigma_aux, SDE_SIGMA)
    lat, vc = SDE[kind]
    _close(latents.flatten(2) @ WEIGHTS, lat)
    _close(targets.flatten(2) @ WEIGHTS, vc)


def test_v_corr_is_the_flow_target_on_the_trajectory_and_the_aux_points_reach_the_noise():
    g = _g(0)
    z0, z1 = torch.randn(4, 3, 2, 2, generator=g, dtype=torch.float64), torch.randn(4, 3, 2, 2, generator=g,
                                                                                  dtype=torch.float64)
    s1 = torch.tensor([0.1, 0.4, 0.7, 0.95], dtype=torch.float64)
    on_trajectory = (1 - s1.view(-1, 1, 1, 1)) * z0 + s1.view(-1, 1, 1, 1) * z1
    sigma_aux = aux_sigmas(s1, torch.rand(5, 4, generator=g, dtype=torch.float64))
    latents, targets = soar_aux_points(z0, z1, on_trajectory, s1, sigma_aux)
    torch.testing.assert_close(targets, (z1 - z0).expand_as(targets), rtol=1e-12, atol=1e-12)
    # u = 0 is the one-step state itself, u -> 1 the same noise z1.
    ends = aux_sigmas(s1, torch.tensor([[0.0] * 4, [1.0] * 4], dtype=torch.float64))
    off = on_trajectory + 0.1
    latents, _ = soar_aux_points(z0, z1, off, s1, ends)
    torch.testing.assert_close(latents[0], off, rtol=0, atol=0)
    torch.testing.assert_close(latents[1], z1, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"\[N, B\]"):
        soar_aux_points(z0, z1, off, s1, sigma_aux[0])


def test_the_loss_normalisation_ode_only_and_with_an_sde_path():
    """Released: (sum l_base + lambda sum l_aux) / max(B + lambda N_aux, 1) * processes, counts over processes."""
    base = torch.tensor([1.0, 2.0, 3.0])
    ode = torch.arange(18, dtype=torch.float32) / 10  # 6 points x 3 samples
    # ODE only, lambda = 1: (6 + 15.3) / (3 + 18)
    assert soar_loss(base, ode).item() == pytest.approx(21.3 / 21)
    assert soar_loss(base, ode, lambda_aux=0.5).item() == pytest.approx((6 + 0.5 * 15.3) / (3 + 9))
    # Plus one SDE path on the 2 samples off the clean boundary: 12 more points.
    sde = torch.full((12,), 0.25)
    assert soar_loss(base, torch.cat([ode, sde])).item() == pytest.approx((6 + 15.3 + 3) / 33)
    # Two processes: each normalises by the global counts and multiplies by 2; their mean is the global loss.
    halves = [soar_loss(base[:2], ode[:12], base_count=3, aux_count=18, num_processes=2),
              soar_loss(base[2:], ode[12:], base_count=3, aux_count=18, num_processes=2)]
    assert (sum(halves) / 2).item() == pytest.approx(21.3 / 21)
    assert soar_loss(base[:0], ode[:0]).item() == 0.0  # nothing: max(count, 1) keeps it finite


# --- the soar objective on the tiny real SD3 pipeline ---------------------------------------------------------------
from dataclasses import dataclass, replace  # noqa: E402

from flowalign.config import ConfigError, load_config  # noqa: E402
from flowalign.errors import SetupError  # noqa: E402
from flowalign.models.sd3 import SD3Model  # noqa: E402
from flowalign.objectives import OBJECTIVES, ObjectiveContext  # noqa: E402
from flowalign.training.config import TrainConfig  # noqa: E402


@dataclass
class Policy:
    v: torch.Tensor


def _soar(**settings):
    return OBJECTIVES.build("soar", **{"data": "toy:2", "image_size": 32, "batch_size": 2, "guidance_scale": 3.0,
                                       "points": 2, **settings})


def _context(model, iteration=0, process=0, processes=1):
    return ObjectiveContext(model=model, config=None, seed=5, iteration=iteration, process_index=process,
                            num_processes=processes)


def test_soar_units_are_the_released_construction_and_the_same_on_two_processes(sd3_pipe):
    model = SD3Model(sd3_pipe)
    settings = dict(units_per_iteration=2, rollout_paths=2, sde_kind="cps", logit_mean=-2.5)
    single = _soar(**settings).units(1, _context(model, 1))
    split = [u for p in range(2) for u in _soar(**settings).units(1, _context(model, 1, p, 2))]
    for a, b in zip(single, split, strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.sigma, b.sigma) and a.data["scale"] == b.data["scale"]
        assert torch.equal(a.data["target"], b.data["target"]) and torch.equal(a.cond.embeds, b.cond.embeds)
    # The global count: 2 units x (2 base + 2 ODE points x 2 + 2 SDE points per sample off the clean boundary).
    boundary = [int(clean_boundary(u.data["t0"], 40).sum()) for u in single]
    counts = [2 + 2 * 2 + 2 * (2 - b) for b in boundary]
    assert sum(boundary) > 0  # logit_mean -2.5 puts some t0 below 1/40: SDE rows are dropped there
    assert [len(u) for u in single] == counts and single[0].data["scale"] == pytest.approx(2 / sum(counts))
    assert all(u.nfe == 2 * 2 for u in single)  # the CFG step: 2 evaluations per pair

    # Rows: the base points, then the ODE path's points (point-major), then the SDE path's; the ODE path's are
    # recomputed here from the unit's own base rows and the model.
    unit = single[0]
    sigmas, _ = training_table()
    t0 = unit.data["t0"]
    s0, s1 = table_sigma(t0, sigmas), table_sigma(next_time(t0, 40), sigmas)
    assert torch.equal(unit.sigma[:2], s0)
    z_t0 = unit.x[:2]
    z0 = z_t0 - s0.view(-1, 1, 1, 1) * unit.data["target"][:2]  # target z1 - z0 and z_t0 = z0 + s0 (z1 - z0)
    z1 = z0 + unit.data["target"][:2]
    with torch.no_grad():
        empty = model.encode([""] * 2)  # the negative prompt ''
        cond = replace(unit.cond.index(slice(0, 2)), negative_embeds=empty.embeds, negative_pooled=empty.pooled)
        v_cfg = model.velocity(z_t0, s0, cond, 3.0)
    z_t1 = z_t0 + v_cfg * (s1 - s0).view(-1, 1, 1, 1)
    latents = unit.x[2:6].view(2, 2, *z_t0.shape[1:])
    targets = unit.data["target"][2:6].view_as(latents)
    # The aux sigma from each row's position between z_t1 and z1: a = (s' - s1) / (1 - s1).
    diff = (latents - z_t1).flatten(2)
    alpha = (diff * (z1 - z_t1).flatten(1)).sum(-1) / (z1 - z_t1).flatten(1).pow(2).sum(-1)
    sigma_aux = s1 + alpha * (1 - s1)
    expected = soar_aux_points(z0, z1, z_t1, s1, sigma_aux)
    torch.testing.assert_close(latents, expected.latents, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(targets, expected.targets, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(unit.sigma[2:6], aux_model_sigma(sigma_aux, sigmas).flatten(), rtol=0, atol=2e-3)


def test_soar_loss_is_the_released_normalisation_of_a_unit():
    obj = OBJECTIVES.build("soar", data="toy", lambda_aux=0.5)
    target = torch.zeros(5, 1, 1, 2)
    v = torch.arange(10.0).view(5, 1, 1, 2)  # per-row MSEs: 0.5, 6.5, 20.5, 42.5, 72.5
    weights = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5])
    unit = DataUnit(x=target, sigma=torch.full((5,), 0.5), cond=None,
                    data={"target": target, "weights": weights, "scale": 1 / 3.5, "base_rows": 2,
                          "sigma_t0": torch.tensor([0.5, 0.5])})
    loss, stats = obj.loss(unit, Policy(v))
    # One unit of 2 pairs with 3 aux points: (0.5 + 6.5 + 0.5 (20.5 + 42.5 + 72.5)) / (2 + 0.5 * 3)
    assert loss.item() == pytest.approx(soar_loss(torch.tensor([0.5, 6.5]), torch.tensor([20.5, 42.5, 72.5]),
                                                  lambda_aux=0.5).item())
    assert stats["base_mse"] == 3.5 and stats["aux_mse"] == pytest.approx(135.5 / 3)
    assert stats["aux_points_per_sample"] == 1.5


def test_soar_without_data_fails_at_the_config_naming_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, None, ["loss.grpo=null", "objectives.soar.guidance_scale=3"])
    assert "objectives.soar.data" in str(error.value) and "toy" in str(error.value)
    with pytest.raises(ConfigError, match="sampling.guidance_scale"):
        load_config(TrainConfig, None, ["objectives.soar.data=toy", "sampling.guidance_scale=3"])
    with pytest.raises(ConfigError, match="nothing would be trained"):
        load_config(TrainConfig, None, ["loss.grpo=null"])
    missing = tmp_path / "pairs.jsonl"
    with pytest.raises(SetupError, match="does not exist"):
        OBJECTIVES.build("soar", data=str(missing)).start_up()


def test_exposure_bias_probe_compares_the_models_own_trajectory_with_teacher_forcing(sd3_pipe):
    from flowalign.evaluation.exposure import exposure_bias, paired_rows

    model = SD3Model(sd3_pipe)
    settings = dict(data="toy:1", count=2, image_size=32, batch_size=2, seed=1)
    # No step between the start and mid-noise: the generated state is the data's own, so no gap.
    none = exposure_bias(model, start_sigma=0.5, mid_sigma=0.5, **settings)
    assert none["gap"] == 0.0 and [r["generated"] for r in none["rows"]] == [r["teacher"] for r in none["rows"]]
    # Two steps of the (untrained) model from 0.9 drift off the data's trajectory; the teacher error is unchanged.
    drift = exposure_bias(model, start_sigma=0.9, mid_sigma=0.5, steps=2, guidance_scale=3.0, **settings)
    assert len(drift["rows"]) == 2 and drift["generated"] > 0 and drift["gap"] != 0.0
    assert [r["teacher"] for r in drift["rows"]] != [r["teacher"] for r in none["rows"]]  # guidance 3 vs 1
    assert paired_rows(drift, drift, "gap") == {"before": drift["gap"], "after": drift["gap"], "diff": 0.0, "se": 0.0}
    with pytest.raises(ValueError, match="mid_sigma"):
        exposure_bias(model, start_sigma=0.4, mid_sigma=0.5, **settings)
