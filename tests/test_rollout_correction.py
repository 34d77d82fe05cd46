"""Rollout correction (flowalign.losses.rollout_correction; loss.grpo.rollout_is / rollout_rs): truncated and IcePop
importance weights, their mean-1 normalisation, every rejection family, chaining, the +-20 clamp and bypass mode on
small float64 tensors worked out by hand (the bypass cases with the loss and d loss / d log_prob by autograd), the
settings refused before anything loads, and a rollout/training mismatch made on purpose (a bf16 rollout forward, an
fp32 training forward on the tiny SD3) with what the correction does to the first ratio."""

import math

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.losses.grpo import grpo_loss
from flowalign.losses.rollout_correction import rollout_correction_weights
from flowalign.training.config import TrainConfig

F64 = torch.float64
E = math.exp


def t(values):
    return torch.tensor(values, dtype=F64)


# lr = log p_old - log p_rollout = [[0.5, -1.0], [2.0, 0.1]] (2 samples x 2 steps)
OLD, ROLLOUT = t([[0.5, -1.0], [2.0, 0.1]]), t([[0.0, 0.0], [0.0, 0.0]])


def weights(**options):
    return rollout_correction_weights(OLD, ROLLOUT, **options)


def close(a, b, rel=1e-13):
    return torch.allclose(a, t(b) if not isinstance(b, torch.Tensor) else b, rtol=rel, atol=0)


def test_token_and_sequence_truncated_is():
    """token: exp(lr), truncated at 2: [[e^.5, e^-1], [2, e^.1]]; sequence: exp(sum lr) = [e^-.5, e^2.1] -> [e^-.5, 2]
    for both steps. No rejection: the keep mask is all ones."""
    w, keep, stats = weights(rollout_is="token", rollout_is_threshold=2.0)
    assert close(w, [[E(0.5), E(-1.0)], [2.0, E(0.1)]]) and torch.equal(keep, torch.ones(2, 2, dtype=F64))
    assert stats["rollout_corr/is_max"] == 2.0 and stats["rollout_corr/is_raw_above"] == 0.25
    w, _, _ = weights(rollout_is="sequence", rollout_is_threshold=2.0)
    assert close(w, [[E(-0.5), E(-0.5)], [2.0, 2.0]])
    w, _, _ = weights(rollout_is="token", rollout_is_threshold="3.0")  # a numeric string is TIS too
    assert close(w, [[E(0.5), E(-1.0)], [3.0, E(0.1)]])
    assert weights(rollout_is=None)[0] is None and weights(rollout_is="token", rollout_is_threshold=None)[0] is None


def test_icepop_zeroes_the_weights_outside_the_band():
    """'0.5_2.0': token keeps e^.5 and e^.1, zeroes e^-1 (< 0.5) and e^2 (> 2); sequence keeps e^-.5, zeroes e^2.1."""
    w, _, stats = weights(rollout_is="token", rollout_is_threshold="0.5_2.0")
    assert close(w, [[E(0.5), 0.0], [0.0, E(0.1)]]) and stats["rollout_corr/is_out_of_bounds"] == 0.5
    w, _, _ = weights(rollout_is="sequence", rollout_is_threshold="0.5_2.0")
    assert close(w, [[E(-0.5), E(-0.5)], [0.0, 0.0]])


def test_mean_one_normalisation_with_the_released_epsilon():
    """token: divide by sum / (4 + 1e-8) over all elements; sequence: by the mean over samples of each sample's
    sum / (2 + 1e-8) (verl's masked_mean keeps 1e-8 in the denominator; it moves a 2-step mean by 5e-9)."""
    w, _, stats = weights(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    raw = [E(0.5), E(-1.0), 2.0, E(0.1)]
    mean = sum(raw) / (4 + 1e-8)
    assert close(w, [[raw[0] / mean, raw[1] / mean], [raw[2] / mean, raw[3] / mean]], rel=1e-15)
    assert stats["rollout_corr/is_batch_norm_factor"] == pytest.approx(mean, rel=1e-15)
    w, _, _ = weights(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    mean = (2 * E(-0.5) / (2 + 1e-8) + 2 * 2.0 / (2 + 1e-8)) / 2
    assert close(w, [[E(-0.5) / mean] * 2, [2.0 / mean] * 2], rel=1e-15)
    # all zero (IcePop rejects everything): the mean is <= 1e-8, the weights stay 0
    w, _, stats = weights(rollout_is="token", rollout_is_threshold="10_20", rollout_is_batch_normalize=True)
    assert torch.equal(w, torch.zeros(2, 2, dtype=F64)) and stats["rollout_corr/is_batch_norm_factor"] == 1.0


# Per element: k1 = -lr = [[-0.5, 1], [-2, -0.1]]; k2 = lr^2 / 2 = [[.125, .5], [2, .005]];
# k3 = e^lr - 1 - lr = [[e^.5 - 1.5, e^-1], [e^2 - 3, e^.1 - 1.1]] = [[.1487, .3679], [4.389, .00517]].
REJECTION = [
    ("token_k1", "0.5_2.0", [[1, 0], [0, 1]]),  # log bounds +-0.693
    ("token_k1", 2.0, [[1, 0], [0, 1]]),  # one float u: l = 1/u, the same band
    ("token_k1", 3.0, [[1, 1], [0, 1]]),  # +-1.0986 keeps k1 = 1
    ("token_k2", 0.2, [[1, 0], [0, 1]]),
    ("token_k3", 0.2, [[1, 0], [0, 1]]),
    ("seq_sum_k1", "0.5_2.0", [[1, 1], [0, 0]]),  # sums [0.5, -2.1]
    ("seq_sum_k2", 0.7, [[1, 1], [0, 0]]),  # sums [0.625, 2.005]
    ("seq_sum_k2", 0.6, [[0, 0], [0, 0]]),
    ("seq_sum_k3", 0.6, [[1, 1], [0, 0]]),  # sums [0.5166, 4.394]
    ("seq_mean_k1", 1.5, [[1, 1], [0, 0]]),  # means [0.25, -1.05] against +-0.405
    ("seq_mean_k2", 0.3, [[0, 0], [0, 0]]),  # means [0.3125, 1.0025]
    ("seq_mean_k2", 0.35, [[1, 1], [0, 0]]),
    ("seq_mean_k3", 0.3, [[1, 1], [0, 0]]),  # means [0.2583, 2.197]
    ("seq_max_k2", 0.4, [[0, 0], [0, 0]]),  # maxima [0.5, 2.0]
    ("seq_max_k2", 0.6, [[1, 1], [0, 0]]),
    ("seq_max_k3", 0.4, [[1, 1], [0, 0]]),  # maxima [0.3679, 4.389]
    ("token_k2,seq_mean_k1", "0.2,1.5", [[1, 0], [0, 0]]),  # chained: both must pass
    ("seq_mean_k1, token_k3", 1.5, [[1, 1], [0, 0]]),  # one threshold for both: k3 <= 1.5 rejects e^2 - 3 only
]


@pytest.mark.parametrize("mode, threshold, expected", REJECTION, ids=[f"{m}@{t}" for m, t, _ in REJECTION])
def test_rejection_families(mode, threshold, expected):
    w, keep, stats = weights(rollout_rs=mode, rollout_rs_threshold=threshold)
    assert w is None and torch.equal(keep, t(expected))
    assert stats["rollout_corr/rs_rejected"] == pytest.approx(1 - sum(map(sum, expected)) / 4)
    w, keep, _ = weights(rollout_is="token", rollout_is_threshold=2.0, rollout_rs=mode, rollout_rs_threshold=threshold)
    assert close(w, t([[E(0.5), E(-1.0)], [2.0, E(0.1)]]) * t(expected))  # the weights include the rejection


def test_the_safety_clamp_at_20():
    """lr beyond +-20 is clamped before exp: token weights e^20 and e^-20 (threshold 1e9 > e^20); a sequence of
    15 + 10 gives e^20; k3 at lr = -30 is e^-20 - 1 + 20, k1 at lr = 30 is -20."""
    w, _, _ = rollout_correction_weights(t([[30.0, -30.0]]), t([[0.0, 0.0]]), rollout_is="token",
                                         rollout_is_threshold=1e9)
    assert close(w, [[E(20.0), E(-20.0)]])
    w, _, _ = rollout_correction_weights(t([[15.0, 10.0]]), t([[0.0, 0.0]]), rollout_is="sequence",
                                         rollout_is_threshold=1e9)
    assert close(w, [[E(20.0), E(20.0)]])
    k3 = E(-20.0) - 1 + 20  # 19.000000002: kept at 19.1, rejected at 19.0 (unclamped it would be 29)
    for bound, kept in ((19.1, 1.0), (19.0, 0.0)):
        _, keep, _ = rollout_correction_weights(t([[-30.0]]), t([[0.0]]), rollout_rs="token_k3",
                                                rollout_rs_threshold=bound)
        assert float(keep[0, 0]) == kept, k3
    _, keep, _ = rollout_correction_weights(t([[30.0]]), t([[0.0]]), rollout_rs="token_k1",
                                            rollout_rs_threshold=f"{E(-20.5)}_{E(-19.5)}")
    assert float(keep[0, 0]) == 1.0  # k1 = -20 (clamped) lies in [-20.5, -19.5]


def bypass(log_ratio, advantages, clip_range, **options):
    """Bypass mode: the rollout's log-prob is the old one; rejection on (log_prob, rollout) per step ([B] = [B, 1]),
    only its keep mask enters grpo_loss. Returns the loss, d loss / d log_prob and the correction's weights."""
    rollout = t([0.0] * len(log_ratio))
    log_prob = t(log_ratio).requires_grad_(True)
    w, keep, _ = rollout_correction_weights(log_prob, rollout, **options)
    loss, _ = grpo_loss(log_prob, rollout, t(advantages), clip_range=clip_range, weights=keep)
    loss.backward()
    return float(loss.detach()), log_prob.grad, w, keep


def test_bypass_token_k1():
    """lr = [0, 1, -0.2], k1 = [0, -1, 0.2] against +-0.693: the middle step is rejected. A = [1, 1, -1], clip 0.2:
    loss = (-1 + 0 + e^-0.2) / 3 (the third ratio 0.8187 is inside the clip); gradient [-1, 0, e^-0.2] / 3."""
    loss, grad, _, keep = bypass([0.0, 1.0, -0.2], [1.0, 1.0, -1.0], 0.2, rollout_rs="token_k1",
                                 rollout_rs_threshold="0.5_2.0")
    assert keep.tolist() == [1.0, 0.0, 1.0]
    assert loss == pytest.approx((-1 + E(-0.2)) / 3, rel=1e-13)
    assert torch.allclose(grad, t([-1.0, 0.0, E(-0.2)]) / 3, rtol=1e-13, atol=0)


def test_bypass_seq_max_k3_on_one_step_sequences():
    """lr = [0.3, -0.5, 0.05]: k3 = [0.0499, 0.1065, 0.0013] against 0.1 rejects the middle. A = [-2, 1, 3], clip 0.1:
    the first ratio e^.3 is outside the clip but on the side where A < 0 keeps the unclipped term (2 e^.3), the third
    inside: loss = (2 e^.3 + 0 - 3 e^.05) / 3, gradient [2 e^.3, 0, -3 e^.05] / 3."""
    loss, grad, _, keep = bypass([0.3, -0.5, 0.05], [-2.0, 1.0, 3.0], 0.1, rollout_rs="seq_max_k3",
                                 rollout_rs_threshold=0.1)
    assert keep.tolist() == [1.0, 0.0, 1.0]
    assert loss == pytest.approx((2 * E(0.3) - 3 * E(0.05)) / 3, rel=1e-13)
    assert torch.allclose(grad, t([2 * E(0.3), 0.0, -3 * E(0.05)]) / 3, rtol=1e-13, atol=0)


def test_bypass_importance_weights_are_diagnostics_only():
    """rollout_is in bypass mode: the PPO ratio is already the importance weight, so the weights (here [2, e^-.1],
    truncated) are reported and not applied. lr = [0.9, -0.1], A = [1, -1], clip 0.2: the first ratio is clipped
    (no gradient), loss = (-1.2 + e^-0.1) / 2, gradient [0, e^-0.1 / 2]."""
    loss, grad, w, keep = bypass([0.9, -0.1], [1.0, -1.0], 0.2, rollout_is="token", rollout_is_threshold=2.0)
    assert close(w, [2.0, E(-0.1)]) and torch.equal(keep, t([1.0, 1.0]))
    assert loss == pytest.approx((-1.2 + E(-0.1)) / 2, rel=1e-13)
    assert torch.allclose(grad, t([0.0, E(-0.1) / 2]), rtol=1e-13, atol=0)


def test_decoupled_weights_multiply_each_clipped_element_and_the_mean_counts_all():
    """grpo_loss(weights=...) on [B, S]: each element's clipped loss times its weight, the mean over all 4 elements
    (a rejected element still counts). Ratios 1 (log_prob = old), A = [[1, 1], [-1, -1]], IcePop weights
    [[e^.5, 0], [0, e^.1]]: loss = (-e^.5 + 0 + 0 + e^.1) / 4, gradient -A w / 4."""
    w, keep, _ = weights(rollout_is="token", rollout_is_threshold="0.5_2.0")
    log_prob = OLD.clone().requires_grad_(True)
    advantages = t([[1.0, 1.0], [-1.0, -1.0]])
    loss, _ = grpo_loss(log_prob, OLD, advantages, clip_range=0.2, weights=w * keep)
    loss.backward()
    assert float(loss.detach()) == pytest.approx((-E(0.5) + E(0.1)) / 4, rel=1e-13)
    assert torch.allclose(log_prob.grad, t([[-E(0.5), 0.0], [0.0, E(0.1)]]) / 4, rtol=1e-13, atol=0)


def test_bad_modes_and_thresholds_are_refused():
    with pytest.raises(ValueError, match="unknown rollout_is 'seq'"):
        weights(rollout_is="seq")
    with pytest.raises(ValueError, match="unknown rollout_rs mode 'token_k4'"):
        weights(rollout_rs="token_k1,token_k4", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="seq_max_k1"):
        weights(rollout_rs="seq_max_k1", rollout_rs_threshold=2.0)  # released: no k1 max
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        weights(rollout_rs="token_k2")
    with pytest.raises(ValueError, match="without '_'"):
        weights(rollout_rs="token_k2", rollout_rs_threshold="0.1_0.2")
    with pytest.raises(ValueError, match="2 thresholds for 3"):
        weights(rollout_rs="token_k1,token_k2,token_k3", rollout_rs_threshold="2.0,0.1")
    with pytest.raises(ValueError, match="lower bound"):
        weights(rollout_is="token", rollout_is_threshold="3_2")
    with pytest.raises(TypeError, match="not a bool"):
        weights(rollout_is="token", rollout_is_threshold=True)


@pytest.mark.parametrize("setting, key", [
    ("loss.grpo.rollout_is=seq", "loss.grpo.rollout_is"),
    ("loss.grpo.rollout_is_threshold=abc", "loss.grpo.rollout_is_threshold"),
    ("loss.grpo.rollout_is_threshold='3_2'", "loss.grpo.rollout_is_threshold"),
    ("loss.grpo.rollout_rs=token_k1,tokn_k2", "loss.grpo.rollout_rs"),
    ("loss.grpo.rollout_rs=token_k2", "loss.grpo.rollout_rs_threshold"),
    ("loss.grpo.rollout_rs_threshold=2.0", "loss.grpo.rollout_rs_threshold"),
])
def test_settings_are_checked_before_anything_loads(setting, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TrainConfig, None, [setting])


def test_k1_bounds_and_chained_thresholds_read_from_the_config():
    """A band 'l_u' must be quoted in YAML (unquoted, 0.5_2 reads as the number 0.52); lower > upper is refused."""
    with pytest.raises(ConfigError, match="loss.grpo.rollout_rs_threshold.*lower <= upper"):
        load_config(TrainConfig, None, ["loss.grpo.rollout_rs=token_k1", "loss.grpo.rollout_rs_threshold='2_0.5'"])
    config = load_config(TrainConfig, None, ["loss.grpo.rollout_rs=token_k1,seq_max_k3",
                                             "loss.grpo.rollout_rs_threshold='0.5_2.0,0.01'"])
    assert config.loss["grpo"].rollout_rs_threshold == "0.5_2.0,0.01"


MISMATCH_PROMPTS = ["a photo of a red circle", "two blue squares left of a triangle"] * 4


def test_a_bf16_rollout_against_an_fp32_training_forward(sd3_pipe):
    """The mismatch rollout correction is for, made on purpose on the tiny SD3: the rollout's velocity under bf16
    autocast, the training forward in fp32, 8 samples x 3 SDE steps (flow_grpo, eta 0.7), 32 px. Without correction
    the first ratio exp(log p_fp32 - log p_bf16) is off 1 (figures printed; docs/methods/rollout_correction.md); the
    same forward reproduces the rollout's log-prob exactly (ratio 1). Decoupled mode recomputes the old log-prob with
    the training forward, so its first PPO ratio is exactly 1 and the mismatch moves into the importance weights
    exp(log p_old - log p_rollout) (TIS truncates them, IcePop zeroes those outside a band); rejection drops the same
    outliers (token_k1 with the band IcePop uses keeps exactly IcePop's non-zero elements)."""
    from flowalign.kernels.sde_reference import gaussian_log_prob, per_sample, sde_mean_std
    from flowalign.models import wrap_pipeline
    from flowalign.samplers import noise_schedule, rollout

    model = wrap_pipeline(sd3_pipe)
    cond = model.encode(MISMATCH_PROMPTS)
    fp32 = model.velocity_fn(cond, 1.0)

    def bf16(x, sigma):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fp32(x, sigma).float()

    steps, n = 4, len(MISMATCH_PROMPTS)
    x = model.prepare_noise(n, 32, generator=torch.Generator().manual_seed(0))
    out = rollout(bf16, x, model.sigmas(steps, 32), noise_schedule(0.7).levels(steps), kind="flow_grpo",
                  generator=torch.Generator().manual_seed(1))
    tr = out.transitions

    def log_probs(velocity):
        rows = []
        for step in sorted({int(s) for s in tr.step[tr.stochastic]}):
            sel = tr.select(tr.step == step)
            assert torch.equal(sel.sample_id, torch.arange(n))
            with torch.no_grad():
                mean, std = sde_mean_std(sel.x_t, velocity(sel.x_t, sel.sigma), sel.sigma, sel.sigma_next,
                                         kind=sel.kind, noise_level=sel.noise_level)
                rows.append(gaussian_log_prob(sel.x_next, mean, std * per_sample(sel.noise_scale, sel.x_t)))
        return torch.stack(rows, dim=1).double()  # [B, S]

    rollout_lp = torch.stack([tr.select(tr.step == s).log_prob for s in range(steps - 1)], dim=1).double()
    assert torch.equal(log_probs(bf16), rollout_lp)  # the rollout's own forward: ratio exactly 1
    old = log_probs(fp32)
    assert torch.equal(log_probs(fp32), old)  # decoupled mode's recompute: its first PPO ratio is exactly 1
    log_ratio = old - rollout_lp
    ratio = torch.exp(log_ratio)
    spread = float(log_ratio.abs().max())
    ordered = log_ratio.abs().flatten().sort().values
    half = len(ordered) // 2  # a band between the two middle |log ratio|s: half the steps inside, none on its edge
    median = float((ordered[half - 1] + ordered[half]) / 2)
    outside = float(((ratio - 1).abs() > 1e-4).double().mean())
    print(f"\nbf16 rollout vs fp32 training, first ratio: |log ratio| median {median:.3g} max {spread:.3g}; ratio in "
          f"[{float(ratio.min()):.6f}, {float(ratio.max()):.6f}], mean {float(ratio.mean()):.6f}; outside Flow-GRPO's "
          f"clip 1e-4: {outside:.1%}; k3 KL {float((ratio - 1 - log_ratio).mean()):.3g}; per step |log ratio| max "
          f"{[round(float(v), 7) for v in log_ratio.abs().max(dim=0).values]}")
    assert 1e-7 < spread < 0.5 and ratio.std() > 0

    w, keep, stats = rollout_correction_weights(old, rollout_lp, rollout_is="token", rollout_is_threshold=2.0)
    assert torch.allclose(w, ratio.clamp(max=2.0), rtol=1e-12, atol=0) and bool(keep.all())
    band = f"{math.exp(-median)}_{math.exp(median)}"
    w, _, stats = rollout_correction_weights(old, rollout_lp, rollout_is="token", rollout_is_threshold=band)
    zeroed = float((w == 0).double().mean())
    _, keep, rs = rollout_correction_weights(old, rollout_lp, rollout_rs="token_k1", rollout_rs_threshold=band)
    assert torch.equal(keep.bool(), w > 0) and 0.3 < zeroed < 0.7
    _, seq_keep, seq = rollout_correction_weights(old, rollout_lp, rollout_rs="seq_mean_k1", rollout_rs_threshold=band)
    sequence_w, _, _ = rollout_correction_weights(old, rollout_lp, rollout_is="sequence", rollout_is_threshold=2.0)
    print(f"IcePop / token_k1 at the median band [e^-{median:.3g}, e^{median:.3g}]: {zeroed:.0%} of the steps zeroed; "
          f"seq_mean_k1 rejects {seq['rollout_corr/rs_samples_rejected']:.0%} of the samples; sequence IS weights in "
          f"[{float(sequence_w.min()):.6f}, {float(sequence_w.max()):.6f}]")
    # bypass mode at the first step is the same comparison: rejection on (log p_theta = log p_fp32, log p_rollout)
    _, bypass_keep, _ = rollout_correction_weights(old[:, 0], rollout_lp[:, 0], rollout_rs="token_k1",
                                                   rollout_rs_threshold=band)
    assert torch.equal(bypass_keep, keep[:, 0])
