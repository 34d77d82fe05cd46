"""The Triton kernels against their torch references: on CPU through Triton's interpreter (TRITON_INTERPRET=1), or
compiled for real on a CUDA machine.

triton chooses between compiling and interpreting when it is imported and when it decorates a kernel, so the
interpreter must be on from the start of the process. Run this file as
``TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py``; in a plain test session it is skipped here and
``tests/test_kernels_interpreter.py`` runs it in a process of its own, so no other test module sees the variable.
The fixture shrinks the block sizes, so the small odd latents here still span several chunks per row and several
finishing iterations.

On a machine with CUDA and without the interpreter, the same tests run the compiled kernels on CUDA tensors:
``python -m pytest tests/test_kernels.py`` there (``bench/device_check.sh`` does it on a lent GPU).
"""

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
if DEVICE == "cpu" and not INTERPRETED:
    pytest.skip("needs CUDA, or TRITON_INTERPRET=1 from the start of the process: tests/test_kernels_interpreter.py "
                "runs it", allow_module_level=True)
triton = pytest.importorskip("triton")

from flowalign.config import ConfigError, load_config  # noqa: E402
from flowalign.kernels import (  # noqa: E402
    grpo_transition_loss,
    grpo_transition_loss_reference,
    requested_backend,
    resolve_backend,
    sde_step_reference,
    sde_transition,
    use_backend,
)
from flowalign.losses.grpo import transition_grpo_loss  # noqa: E402
from flowalign.samplers import sde_step  # noqa: E402
from flowalign.training.config import TrainConfig  # noqa: E402

KINDS = ("flow_grpo", "dance", "cps")
SHAPE = (6, 3, 5, 7)  # 105 elements per row: 4 chunks of 32, the last one partial


@pytest.fixture(scope="module", autouse=True)
def small_blocks():
    from flowalign.kernels import sde_triton

    assert sde_triton.INTERPRETED == INTERPRETED, "triton was imported before TRITON_INTERPRET=1 was set"
    saved = sde_triton.BLOCK, sde_triton.FINISH_BLOCK, os.environ.pop("FLOWALIGN_KERNELS", None)
    sde_triton.BLOCK, sde_triton.FINISH_BLOCK = 32, 2
    yield
    sde_triton.BLOCK, sde_triton.FINISH_BLOCK = saved[:2]
    if saved[2] is not None:
        os.environ["FLOWALIGN_KERNELS"] = saved[2]


def step_inputs(kind, seed=0, dtype=torch.float32):
    """Per-row steps, levels and scales: a row at sigma = 1 (flow_grpo's special case) and a deterministic row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g).to(dtype)
    v = torch.randn(SHAPE, generator=g).to(dtype)
    noise = torch.randn(SHAPE, generator=g)
    sigma = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.3, 0.6])
    sigma_next = torch.tensor([0.95, 0.8, 0.6, 0.45, 0.1, 0.5])
    level = torch.tensor([0.7, 0.9, 0.5, 0.0, 1.0 if kind == "cps" else 1.2, 0.3])
    scale = torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0, 1.5])
    rows = dict(sigma=sigma, sigma_next=sigma_next, noise_level=level, noise_scale=scale)
    return x.to(DEVICE), v.to(DEVICE), noise.to(DEVICE), {k: r.to(DEVICE) for k, r in rows.items()}


def call_step(x, v, rows, backend, **kwargs):
    return sde_transition(x, v, rows["sigma"], rows["sigma_next"], noise_level=rows["noise_level"],
                          noise_scale=rows["noise_scale"], backend=backend, **kwargs)


# --- SDE step -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_sde_kernel_matches_reference(kind, reduce):
    x, v, noise, rows = step_inputs(kind)
    ref = call_step(x, v, rows, "torch", kind=kind, noise=noise, reduce=reduce)
    out = call_step(x, v, rows, "triton", kind=kind, noise=noise, reduce=reduce)
    torch.testing.assert_close(out.mean, ref.mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.prev_sample, ref.prev_sample, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.std, ref.std, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.log_prob, ref.log_prob, rtol=1e-5, atol=1e-5)
    assert out.log_prob[3] == 0 and out.std[3] == 0  # noise level 0: a deterministic row carries no density
    # Scoring a given sample (the training-time recomputation) agrees too.
    scored = call_step(x, v, rows, "triton", kind=kind, prev_sample=ref.prev_sample, reduce=reduce)
    torch.testing.assert_close(scored.log_prob, ref.log_prob, rtol=1e-5, atol=1e-5)
    assert scored.prev_sample is ref.prev_sample or torch.equal(scored.prev_sample, ref.prev_sample)


def test_sde_kernel_scores_the_sample_as_stored_in_bf16():
    x, v, noise, rows = step_inputs("flow_grpo", dtype=torch.bfloat16)
    out = call_step(x, v, rows, "triton", kind="flow_grpo", noise=noise)
    assert out.prev_sample.dtype == torch.bfloat16 and out.mean.dtype == torch.float32
    rescored = sde_step_reference(x, v, rows["sigma"], rows["sigma_next"], kind="flow_grpo",
                                  noise_level=rows["noise_level"], noise_scale=rows["noise_scale"],
                                  prev_sample=out.prev_sample)
    torch.testing.assert_close(out.log_prob, rescored.log_prob, rtol=1e-5, atol=1e-5)


def test_samplers_sde_step_runs_the_kernel_in_a_triton_block(monkeypatch):
    from flowalign.kernels import sde_triton

    launches = []
    launch = sde_triton.sde_step_triton
    monkeypatch.setattr(sde_triton, "sde_step_triton", lambda *a, **k: launches.append(1) or launch(*a, **k))
    x, v, noise, _ = step_inputs("dance")
    sde_step(x, v, 0.7, 0.6, kind="dance", noise_level=0.8, noise=noise)
    assert len(launches) == (DEVICE == "cuda")  # auto: the kernel for CUDA tensors, the reference for CPU ones
    with use_backend("torch"):
        ref = sde_step(x, v, 0.7, 0.6, kind="dance", noise_level=0.8, noise=noise)
    launches.clear()
    with use_backend("triton"):
        out = sde_step(x, v, 0.7, 0.6, kind="dance", noise_level=0.8, noise=noise)
    assert len(launches) == 1
    torch.testing.assert_close(out.prev_sample, ref.prev_sample, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_prob, ref.log_prob, rtol=1e-5, atol=1e-5)


# --- GRPO loss ----------------------------------------------------------------------------------------------------

# Per row: log-prob offset (ratio = exp(offset)) and advantage. With clip 0.05, rows 0 and 3 sit on the clipped side
# of the min (no policy gradient), rows 1 and 2 outside the range on the unclipped side, rows 4 and 5 inside it.
OFFSETS = torch.tensor([0.2, 0.2, -0.2, -0.2, 0.01, -0.01], device=DEVICE)
ADVANTAGES = torch.tensor([1.5, -1.0, 2.0, -0.5, 1.0, -3.0], device=DEVICE)
WEIGHTS = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.25, 1.5], device=DEVICE)


def loss_inputs(kind, reduce, seed=1):
    x, v, noise, rows = step_inputs(kind, seed)
    rows["noise_level"] = rows["noise_level"].clamp_min(0.2)  # every row stochastic
    step = call_step(x, v, rows, "torch", kind=kind, noise=noise, reduce=reduce)
    v_policy = v + 0.05 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed + 7)).to(DEVICE)
    v_ref = v - 0.03 * torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed + 8)).to(DEVICE)
    with torch.no_grad():
        current = grpo_transition_loss_reference(v_policy, x, step.prev_sample, rows["sigma"], rows["sigma_next"],
                                                 step.log_prob, ADVANTAGES, kind=kind, noise_level=rows["noise_level"],
                                                 noise_scale=rows["noise_scale"], reduce=reduce, clip_range=0.05)
    old_log_prob = current.log_prob - OFFSETS
    return v_policy, x, step.prev_sample, rows, old_log_prob, v_ref


def run_loss(backend, v, x, x_next, rows, old, *, kind, reduce, kl, v_ref, beta=0.1, kl_std="std_t"):
    v = v.detach().clone().requires_grad_()
    out = grpo_transition_loss(v, x, x_next, rows["sigma"], rows["sigma_next"], old, ADVANTAGES, kind=kind,
                               noise_level=rows["noise_level"], noise_scale=rows["noise_scale"], reduce=reduce,
                               clip_range=0.05, weights=WEIGHTS, v_ref=v_ref if kl else None,
                               beta=beta if kl else 0.0, kl=kl or "latent_mean", kl_std=kl_std, backend=backend)
    # A non-uniform upstream gradient checks that each row's gradient is scaled by its own grad_output.
    (out.loss * torch.arange(1.0, 7.0, device=DEVICE)).sum().backward()
    return out, v.grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("kl", [None, "latent_mean", "velocity_mse"])
def test_loss_kernel_and_its_gradient_match_reference(kind, reduce, kl):
    v, x, x_next, rows, old, v_ref = loss_inputs(kind, reduce)
    ref, ref_grad = run_loss("torch", v, x, x_next, rows, old, kind=kind, reduce=reduce, kl=kl, v_ref=v_ref)
    out, grad = run_loss("triton", v, x, x_next, rows, old, kind=kind, reduce=reduce, kl=kl, v_ref=v_ref)
    for name in ("loss", "policy", "log_prob", "kl"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name).detach(), rtol=1e-4, atol=1e-6, msg=name)
    ratio = torch.exp(ref.log_prob.detach() - old)
    assert ((ratio - 1).abs() > 0.05).sum() == 4 and ((ratio - 1).abs() < 0.05).sum() == 2  # clipped and not
    policy_rows = ref_grad.flatten(1).abs().amax(1)
    if kl is None:  # the clipped side of the min passes no gradient; the others do
        assert policy_rows[0] == 0 and policy_rows[3] == 0 and (policy_rows[[1, 2, 4, 5]] > 0).all()
    else:
        assert (ref.kl > 0).all()
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4 * float(ref_grad.abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_loss_kernel_reads_the_kl_std_as_the_reference_does(kind):
    """Both readings of the latent-mean KL's std (``kl_std``) in the fused kernel equal the torch reference's, and
    ``std_t`` is the ``transition`` KL times ``sigma - sigma_next`` per row (cps: the same KL)."""
    v, x, x_next, rows, old, v_ref = loss_inputs(kind, "mean")
    outs = {}
    for kl_std in ("std_t", "transition"):
        ref, ref_grad = run_loss("torch", v, x, x_next, rows, old, kind=kind, reduce="mean", kl="latent_mean",
                                 v_ref=v_ref, kl_std=kl_std)
        out, grad = run_loss("triton", v, x, x_next, rows, old, kind=kind, reduce="mean", kl="latent_mean",
                             v_ref=v_ref, kl_std=kl_std)
        for name in ("loss", "kl"):
            torch.testing.assert_close(getattr(out, name), getattr(ref, name).detach(), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4 * float(ref_grad.abs().max()))
        outs[kl_std] = out.kl
    factor = torch.ones_like(outs["std_t"]) if kind == "cps" else rows["sigma"] - rows["sigma_next"]
    torch.testing.assert_close(outs["std_t"], outs["transition"] * factor, rtol=1e-4, atol=1e-7)


def test_loss_kernel_gradient_keeps_the_velocity_dtype():
    v, x, x_next, rows, old, v_ref = loss_inputs("flow_grpo", "mean")
    v, v_ref = v.bfloat16(), v_ref.bfloat16()
    ref, ref_grad = run_loss("torch", v, x, x_next, rows, old, kind="flow_grpo", reduce="mean", kl="latent_mean",
                             v_ref=v_ref)
    out, grad = run_loss("triton", v, x, x_next, rows, old, kind="flow_grpo", reduce="mean", kl="latent_mean",
                         v_ref=v_ref)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2e-2, atol=2e-2 * float(ref_grad.abs().max()))


def test_fused_loss_of_a_fresh_sample_has_ratio_one():
    """The step kernel's log-prob and the loss kernel's recomputation of it agree exactly
    (docs/design/math.md#first-ratio)."""
    x, v, noise, rows = step_inputs("cps")
    step = call_step(x, v, rows, "triton", kind="cps", noise=noise)
    out = grpo_transition_loss(v, x, step.prev_sample, rows["sigma"], rows["sigma_next"], step.log_prob, ADVANTAGES,
                               kind="cps", noise_level=rows["noise_level"], noise_scale=rows["noise_scale"],
                               clip_range=1e-4, backend="triton")
    assert torch.equal(out.log_prob, step.log_prob)


def test_an_optimizer_step_through_the_fused_loss_equals_the_reference_step():
    """A tiny velocity model trained one SGD step (and then AdamW) through the trainer's loss function."""
    v0, x, x_next, rows, old, v_ref = loss_inputs("flow_grpo", "mean")

    def train(backend):
        torch.manual_seed(3)
        model = torch.nn.Conv2d(3, 3, 3, padding=1).to(DEVICE)
        sgd = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        records = []
        for optimizer in (sgd, torch.optim.AdamW(model.parameters(), lr=1e-3)):
            v = v0 + model(x)
            loss, stats = transition_grpo_loss(
                v, x, x_next, rows["sigma"], rows["sigma_next"], old, ADVANTAGES, kind="flow_grpo",
                noise_level=rows["noise_level"], noise_scale=rows["noise_scale"], clip_range=0.05, weights=WEIGHTS,
                v_ref=v_ref, beta=0.2, backend=backend)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            records.append(stats)
        return [p.detach().clone() for p in model.parameters()], records

    torch.manual_seed(3)
    initial = [p.detach().clone().to(DEVICE) for p in torch.nn.Conv2d(3, 3, 3, padding=1).parameters()]
    ref_params, ref_stats = train("torch")
    params, stats = train("triton")
    for p, q, p0 in zip(params, ref_params, initial):
        assert not torch.equal(q, p0)  # the step moved the weights
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for s, r in zip(stats, ref_stats):
        assert s.keys() == r.keys()
        for key in s:
            assert s[key] == pytest.approx(r[key], rel=1e-4, abs=1e-7), key


def test_non_contiguous_inputs_give_the_same_results():
    v, x, x_next, rows, old, v_ref = loss_inputs("dance", "sum")
    strided = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in (v, x, x_next, v_ref)]
    assert not strided[0].is_contiguous()
    dense, dense_grad = run_loss("triton", v, x, x_next, rows, old, kind="dance", reduce="sum", kl="velocity_mse",
                                 v_ref=v_ref)
    out, grad = run_loss("triton", *strided[:3], rows, old, kind="dance", reduce="sum", kl="velocity_mse",
                         v_ref=strided[3])
    torch.testing.assert_close(out.loss, dense.loss, rtol=0, atol=0)
    assert grad.shape == v.shape
    torch.testing.assert_close(grad, dense_grad, rtol=0, atol=0)
    step = call_step(strided[1], strided[0], rows, "triton", kind="dance", noise=strided[2])
    torch.testing.assert_close(step.log_prob, call_step(x, v, rows, "triton", kind="dance", noise=x_next).log_prob,
                               rtol=0, atol=0)


# --- dispatch and bad input ---------------------------------------------------------------------------------------


def test_backend_choice_follows_argument_then_block_then_environment(monkeypatch):
    cpu = torch.zeros(2, 3)
    assert resolve_backend(cpu) == "torch"  # auto: CPU tensors take the reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton on CPU tensors needs the interpreter (read at each call)
    monkeypatch.setenv("FLOWALIGN_KERNELS", "triton")
    assert resolve_backend(cpu) == "triton"
    assert resolve_backend(cpu, "torch") == "torch"
    with use_backend("torch"):
        assert requested_backend() == "torch" and requested_backend("auto") == "torch"
        assert requested_backend("triton") == "triton"
    monkeypatch.setenv("FLOWALIGN_KERNELS", "cuda")
    with pytest.raises(ValueError, match="FLOWALIGN_KERNELS must be one of auto, triton, torch, got 'cuda'"):
        resolve_backend(cpu)
    monkeypatch.setenv("FLOWALIGN_KERNELS", "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need CUDA tensors, or TRITON_INTERPRET=1"):
        resolve_backend(cpu, "triton")


def test_config_key_is_validated():
    assert TrainConfig().model.kernels == "auto"
    assert load_config(TrainConfig, None, ["model.kernels=triton"]).model.kernels == "triton"
    with pytest.raises(ConfigError, match="model.kernels"):
        load_config(TrainConfig, None, ["model.kernels=cuda"])


def test_bad_inputs_are_named_before_any_kernel_runs():
    v, x, x_next, rows, old, v_ref = loss_inputs("flow_grpo", "mean")

    def loss(**changes):
        args = dict(v=v, x_t=x, x_next=x_next, sigma=rows["sigma"], sigma_next=rows["sigma_next"], old_log_prob=old,
                    advantages=ADVANTAGES, kind="flow_grpo", noise_level=rows["noise_level"], clip_range=0.05,
                    v_ref=v_ref, backend="triton")
        args.update(changes)
        return grpo_transition_loss(**args)

    with pytest.raises(ValueError, match=r"x_next has shape \(6, 3, 5, 6\) but v has shape \(6, 3, 5, 7\)"):
        loss(x_next=x_next[..., :6])
    with pytest.raises(TypeError, match=r"v_ref has dtype torch.bfloat16 but v has dtype torch.float32"):
        loss(v_ref=v_ref.bfloat16())
    with pytest.raises(TypeError, match=r"x_t must be a floating-point tensor, got dtype torch.int64"):
        loss(x_t=x.long())
    with pytest.raises(ValueError, match=r"advantages must be a \[batch=6\] tensor, got shape \(5,\)"):
        loss(advantages=ADVANTAGES[:5])
    with pytest.raises(ValueError, match=r"sigma_next must be a scalar or a \[batch=6\] tensor, got shape \(2,\)"):
        loss(sigma_next=torch.tensor([0.5, 0.4], device=DEVICE))
    with pytest.raises(ValueError, match=r"x_t requires grad.*x_t.detach\(\)"):
        loss(x_t=x.clone().requires_grad_())
    with pytest.raises(ValueError, match=r"beta=0.1 needs the reference velocity v_ref"):
        loss(v_ref=None, beta=0.1)
    with pytest.raises(ValueError, match=r"unknown kl 'forward'"):
        loss(kl="forward")
    with pytest.raises(ValueError, match=r"v must be a non-empty \[batch, ...\] tensor"):
        loss(v=v.flatten())
    with pytest.raises(ValueError, match=r"noise has shape \(6, 3, 5, 6\) but x has shape \(6, 3, 5, 7\)"):
        sde_transition(x, v, 0.5, 0.4, kind="dance", noise_level=0.5, noise=x[..., :6], backend="triton")
    with pytest.raises(ValueError, match=r"exactly one of noise .* and prev_sample"):
        sde_transition(x, v, 0.5, 0.4, kind="dance", noise_level=0.5, backend="triton")


# --- the trainer --------------------------------------------------------------------------------------------------


def test_trainer_runs_rollouts_and_loss_through_the_kernels(tmp_path, monkeypatch):
    """One GRPO iteration of a tiny SD3 with ``model.kernels=triton`` against the same run on the torch reference."""
    from flowalign.kernels import loss_triton, sde_triton
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts
    from flowalign.training.trainer import Trainer

    train, test = split_prompts()
    model = tmp_path / "tiny-sd3"
    tiny_sd3_pipeline(sorted({w for e in train + test for w in e["prompt"].split()}), seed=0).save_pretrained(model)
    calls = {"step": 0, "loss": 0}
    step, loss = sde_triton.sde_step_triton, loss_triton.FusedTransitionLoss.apply

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(sde_triton, "sde_step_triton", counted("step", step))
    monkeypatch.setattr(loss_triton.FusedTransitionLoss, "apply", counted("loss", loss))

    def run(kernels):
        overrides = {
            "model.path": str(model), "model.lora_rank": 4, "model.lora_alpha": 8, "model.kernels": kernels,
            "reward.rewards": "[{name: brightness}]", "data.prompts_per_iteration": 1, "data.group_size": 4,
            "sampling.num_steps": 4, "sampling.batch_size": 4, "optim.lr": 3e-3, "optim.eps": 1.0, "loss.grpo.beta": 0.01,
            "sampling.window_size": "null", "sampling.window_start": "fixed", "sampling.window_last": "null",
            "train.iterations": 1, "train.tracker": "none", "train.eval_at_end": "false", "train.sample_every": 0,
            "train.out_dir": str(tmp_path / kernels),
        }
        trainer = Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in overrides.items()]))
        history = trainer.train()
        return history[0], {k: p.detach().clone() for k, p in trainer.trainable_state().items()}

    ref_metrics, ref_params = run("torch")
    assert calls == {"step": 0, "loss": 0}
    metrics, params = run("triton")
    assert calls["step"] == 3 and calls["loss"] == 3  # one chunk (a group of 4) x 3 SDE steps, rollout and update
    assert metrics["first_ratio_max"] == 1.0 and metrics["first_ratio_mean"] == 1.0
    assert metrics["reward"] == pytest.approx(ref_metrics["reward"], abs=1e-5)
    assert metrics["kl"] == pytest.approx(ref_metrics["kl"], rel=1e-3, abs=1e-9)
    assert sum(int((v != 0).sum()) for k, v in params.items() if "lora_B" in k) > 0  # the step moved the zero init
    # With eps = 1 AdamW's first step is lr * g / (|g| + 1) ~ lr * g for these small gradients: the update is smooth in
    # the gradient, so the two paths' fp32 rounding stays at rounding size (with the usual eps = 1e-8 the step is
    # lr * sign(g), and a gradient of ~0 can flip sign between the paths and move an element by 2 lr).
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=1e-4, atol=1e-10, msg=name)


def test_the_kernels_take_video_latents_with_a_frame_axis():
    """A video latent [B, C, f, h, w]: the SDE kernel and the loss kernel (with its gradient) on it are the torch
    reference's, and equal the kernels on the same elements laid out as an image latent [B, C f, h, w]."""
    x, v, noise, rows = step_inputs("flow_grpo")
    video = (6, 3, 1, 5, 7)  # a frame axis of 1 frame keeps SHAPE's elements in order; below, 2 frames of 3 channels
    for shape in (video, (6, 1, 3, 5, 7)):
        step = call_step(x.reshape(shape), v.reshape(shape), rows, "triton", kind="flow_grpo",
                         noise=noise.reshape(shape))
        ref = call_step(x.reshape(shape), v.reshape(shape), rows, "torch", kind="flow_grpo", noise=noise.reshape(shape))
        image = call_step(x, v, rows, "triton", kind="flow_grpo", noise=noise)
        torch.testing.assert_close(step.log_prob, ref.log_prob, rtol=1e-5, atol=1e-5)
        assert torch.equal(step.log_prob, image.log_prob) and torch.equal(step.prev_sample.reshape(SHAPE),
                                                                          image.prev_sample)
    v, x, x_next, rows, old, v_ref = loss_inputs("flow_grpo", "mean")
    shape = (6, 1, 3, 5, 7)
    out, grad = run_loss("triton", v.reshape(shape), x.reshape(shape), x_next.reshape(shape), rows, old,
                         kind="flow_grpo", reduce="mean", kl="latent_mean", v_ref=v_ref.reshape(shape))
    ref, ref_grad = run_loss("torch", v.reshape(shape), x.reshape(shape), x_next.reshape(shape), rows, old,
                             kind="flow_grpo", reduce="mean", kl="latent_mean", v_ref=v_ref.reshape(shape))
    image, image_grad = run_loss("triton", v, x, x_next, rows, old, kind="flow_grpo", reduce="mean",
                                 kl="latent_mean", v_ref=v_ref)
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-4 * float(ref_grad.abs().max()))
    assert torch.equal(out.loss, image.loss) and torch.equal(grad.reshape(SHAPE), image_grad)
