"""CFG in training: which branches of the guided policy velocity carry the gradient (``sampling.cfg_gradient``).

With guidance ``g`` the guided velocity is ``u + g (c - u)``. ``both`` (flow_grpo's current ``train_sd3.py``)
backpropagates ``(1 - g) du + g dc``; ``conditional`` (its ``train_sd3.py`` of July 2025, which detaches ``u``)
backpropagates ``g dc`` only. The value is the same either way."""

from __future__ import annotations

from dataclasses import replace
from contextlib import nullcontext

import pytest
import torch

from flowalign.config import ConfigError, load_config
from flowalign.models import wrap_pipeline
from flowalign.models.base import guided, unconditional_detached
from flowalign.training.config import TrainConfig
from flowalign.training.policy import velocities

SCALE = 4.5


def test_guided_hand_computed_gradients_of_both_readings():
    for detached, (grad_c, grad_u) in ((False, (SCALE, 1 - SCALE)), (True, (SCALE, None))):
        c = torch.tensor([2.0], requires_grad=True)
        u = torch.tensor([0.5], requires_grad=True)
        with unconditional_detached(detached):
            value = guided(c, u, SCALE)
        value.backward()
        assert value.item() == 0.5 + SCALE * 1.5  # 7.25 in both readings
        assert c.grad.item() == grad_c
        assert (u.grad is None) if grad_u is None else u.grad.item() == grad_u
    with unconditional_detached():  # the context ends with its block
        pass
    u = torch.tensor([0.5], requires_grad=True)
    guided(torch.tensor([2.0]), u, SCALE).backward()
    assert u.grad.item() == 1 - SCALE


def _grad(model, loss_of_v) -> torch.Tensor:
    weight = model.transformer.proj_out.weight
    weight.grad = None
    loss_of_v().backward()
    return weight.grad.clone()


def test_the_policy_velocity_backpropagates_through_the_branches_the_setting_names(sd3_pipe):
    """On the tiny SD3: the gradient of a loss of the guided policy velocity (one batched CFG forward) equals
    ``(1 - g) grad(u) + g grad(c)`` under ``both`` and ``g grad(c)`` under ``conditional``, with ``c`` and ``u`` the
    conditional and unconditional velocities evaluated on their own; the velocity itself is the same."""
    model = wrap_pipeline(sd3_pipe)
    model.transformer.requires_grad_(True)
    cond = model.encode(["a red circle", "two blue squares"], negative_prompts=["", ""])
    uncond = replace(cond, embeds=cond.negative_embeds, pooled=cond.negative_pooled)
    x = model.prepare_noise(2, 32, generator=torch.Generator().manual_seed(0))
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.full((2,), 0.6)

    def loss(c, **kwargs):
        v, _ = velocities(model, x, sigma, c, autocast=nullcontext, reference=False, **kwargs)
        return (v.float() * probe).sum()

    grad_c = _grad(model, lambda: loss(cond, guidance_scale=1.0))
    grad_u = _grad(model, lambda: loss(uncond, guidance_scale=1.0))
    both = _grad(model, lambda: loss(cond, guidance_scale=SCALE))
    conditional = _grad(model, lambda: loss(cond, guidance_scale=SCALE, cfg_gradient="conditional"))
    scale = float(grad_c.abs().max())
    torch.testing.assert_close(both, (1 - SCALE) * grad_u + SCALE * grad_c, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(conditional, SCALE * grad_c, rtol=1e-4, atol=1e-5 * scale)
    assert (both - conditional).abs().max() > 100 * 1e-5 * scale  # the two readings differ
    with torch.no_grad():
        v_both, _ = velocities(model, x, sigma, cond, guidance_scale=SCALE, autocast=nullcontext, reference=False)
        v_cond, _ = velocities(model, x, sigma, cond, guidance_scale=SCALE, autocast=nullcontext, reference=False,
                               cfg_gradient="conditional")
    assert torch.equal(v_both, v_cond)


def test_the_setting_is_refused_without_cfg_and_defaults_to_both():
    assert load_config(TrainConfig, None, []).sampling.cfg_gradient == "both"
    config = load_config(TrainConfig, None, ["sampling.guidance_scale=4.5", "sampling.cfg_gradient=conditional"])
    assert config.sampling.cfg_gradient == "conditional"
    with pytest.raises(ConfigError, match=r"sampling.cfg_gradient.*guidance_scale = 1"):
        load_config(TrainConfig, None, ["sampling.cfg_gradient=conditional"])
    with pytest.raises(ConfigError, match="cfg_gradient"):
        load_config(TrainConfig, None, ["sampling.guidance_scale=4.5", "sampling.cfg_gradient=uncond"])
