"""Fused Triton GRPO transition loss: forward and backward kernels behind one ``torch.autograd.Function``.

The math is ``loss_reference``'s. With the affine mean ``mu = c_x x_t + c_v v`` of ``sde_triton``, everything a row's
loss needs from its ``D`` elements is two sums: ``Q = sum (x_next - mu)^2`` (its log-prob) and, with a reference
velocity, ``R = sum (v - v_ref)^2`` (its KL: ``c_v^2 R / (2 s^2 D)`` for the latent-mean KL, since
``mu - mu_ref = c_v (v - v_ref)``, with ``1 / s^2 = (sigma - sigma_next) / std^2`` under ``kl_std: std_t`` and
``1 / std^2`` under ``transition`` or for ``cps``; and ``R / D`` for the velocity MSE). So:

* forward, pass 1 (one program per row chunk): ``mu``, and the chunk's parts of ``Q`` and ``R``;
* forward, pass 2 (one program per row): log-prob, ratio, PPO clip, weight and KL -> the row's loss, and the two
  per-row factors of the gradient, ``g_Q = dL/dlog_prob * c_v / (std^2 [D])`` and ``g_R`` (``beta c_v^2 / (s^2 D)``
  or ``2 beta / D``), where ``dL/dlog_prob = -w A ratio`` when the unclipped branch is the minimum and 0 otherwise;
* backward (one program per row chunk): ``dL/dv = grad_row * (g_Q (x_next - mu) + g_R (v - v_ref))``, recomputing
  ``mu`` from the inputs instead of storing any per-element intermediate.

PPO ties (ratio inside the clip range, where both branches are equal) pass the full gradient, as torch autograd does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flowalign.kernels.sde_triton as sde_triton  # its block sizes are read when called (tests set them)
from .loss_reference import TransitionLoss
from .sde_triton import KIND_CODES, load_block, load_row_coefficients, row_log_prob, row_sum


@triton.jit
def _loss_forward_kernel(x_ptr, x_next_ptr, v_ptr, v_ref_ptr, squares_ptr, ref_squares_ptr,
                         sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D, num_chunks,
                         KIND: tl.constexpr, HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk, offsets, mask, c_x, c_v, _, x, v = load_block(
        x_ptr, v_ptr, sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D, KIND, BLOCK)
    x_next = tl.load(x_next_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.where(mask, x_next - (c_x * x + c_v * v), 0.0)
    tl.store(squares_ptr + row * num_chunks + chunk, tl.sum(residual * residual, axis=0))
    if HAS_REF:
        v_ref = tl.load(v_ref_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        difference = tl.where(mask, v - v_ref, 0.0)
        tl.store(ref_squares_ptr + row * num_chunks + chunk, tl.sum(difference * difference, axis=0))


@triton.jit
def _loss_finish_kernel(squares_ptr, ref_squares_ptr, old_log_prob_ptr, advantage_ptr, weight_ptr,
                        sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr,
                        loss_ptr, policy_ptr, log_prob_ptr, kl_ptr, grad_q_ptr, grad_r_ptr,
                        num_chunks, n, clip_range, beta,
                        KIND: tl.constexpr, MEAN: tl.constexpr, HAS_REF: tl.constexpr, LATENT_KL: tl.constexpr,
                        KL_STD_T: tl.constexpr, FINISH: tl.constexpr):
    row = tl.program_id(0)
    _, c_v, std = load_row_coefficients(sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, row, KIND)
    stochastic = std > 0
    safe_std = tl.where(stochastic, std, 1.0)
    inverse_variance = tl.where(stochastic, 1.0 / (safe_std * safe_std), 0.0)
    log_prob = row_log_prob(row_sum(squares_ptr, row, num_chunks, FINISH), std, n, MEAN)
    advantage = tl.load(advantage_ptr + row)
    weight = tl.load(weight_ptr + row)
    ratio = tl.exp(log_prob - tl.load(old_log_prob_ptr + row))
    unclipped = advantage * ratio
    clipped = advantage * tl.minimum(tl.maximum(ratio, 1.0 - clip_range), 1.0 + clip_range)
    policy = weight * -tl.minimum(unclipped, clipped)
    d_log_prob = tl.where(unclipped <= clipped, -weight * unclipped, 0.0)
    grad_q = d_log_prob * c_v * inverse_variance
    if MEAN:
        grad_q = grad_q / n
    kl = 0.0
    grad_r = 0.0
    if HAS_REF:
        ref_squares = row_sum(ref_squares_ptr, row, num_chunks, FINISH)
        if LATENT_KL:
            kl_inverse_variance = inverse_variance
            if KL_STD_T:  # 1 / std_t^2 = |dt| / std^2 (loss_reference.kl_std_scale)
                kl_inverse_variance = inverse_variance * (tl.load(sigma_ptr + row) - tl.load(sigma_next_ptr + row))
            kl = 0.5 * c_v * c_v * ref_squares * kl_inverse_variance / n
            grad_r = beta * c_v * c_v * kl_inverse_variance / n
        else:
            kl = ref_squares / n
            grad_r = 2.0 * beta / n
    tl.store(loss_ptr + row, policy + beta * kl)
    tl.store(policy_ptr + row, policy)
    tl.store(log_prob_ptr + row, log_prob)
    tl.store(kl_ptr + row, kl)
    tl.store(grad_q_ptr + row, grad_q)
    tl.store(grad_r_ptr + row, grad_r)


@triton.jit
def _loss_backward_kernel(grad_loss_ptr, grad_q_ptr, grad_r_ptr, x_ptr, x_next_ptr, v_ptr, v_ref_ptr, grad_v_ptr,
                          sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D,
                          KIND: tl.constexpr, HAS_REF: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk, offsets, mask, c_x, c_v, _, x, v = load_block(
        x_ptr, v_ptr, sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D, KIND, BLOCK)
    grad_loss = tl.load(grad_loss_ptr + row)
    x_next = tl.load(x_next_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad_v = (grad_loss * tl.load(grad_q_ptr + row)) * (x_next - (c_x * x + c_v * v))
    if HAS_REF:
        v_ref = tl.load(v_ref_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad_v += (grad_loss * tl.load(grad_r_ptr + row)) * (v - v_ref)
    tl.store(grad_v_ptr + offsets, grad_v.to(grad_v_ptr.dtype.element_ty), mask=mask)


class FusedTransitionLoss(torch.autograd.Function):
    """Per-transition GRPO loss whose gradient w.r.t. ``v`` comes from ``_loss_backward_kernel``.

    Inputs must be contiguous and validated (``flowalign.kernels.grpo_transition_loss`` does both). Only the first
    output, the loss, is differentiable; the policy term, log-prob and KL are returned for logging.
    """

    @staticmethod
    def forward(ctx, v, x_t, x_next, v_ref, rows, old_log_prob, advantages, weights, settings):
        kind, reduce, clip_range, beta, kl, kl_std, block = settings
        batch = v.shape[0]
        size = v.numel() // batch
        num_chunks = triton.cdiv(size, block)
        has_ref = v_ref is not None
        code = KIND_CODES[kind]
        squares = torch.empty((batch, num_chunks), dtype=torch.float32, device=v.device)
        ref_squares = torch.empty_like(squares) if has_ref else squares
        _loss_forward_kernel[(batch, num_chunks)](
            x_t, x_next, v, v_ref if has_ref else v, squares, ref_squares, *rows, size, num_chunks,
            KIND=code, HAS_REF=has_ref, BLOCK=block,
        )
        loss, policy, log_prob, divergence, grad_q, grad_r = (
            torch.empty(batch, dtype=torch.float32, device=v.device) for _ in range(6)
        )
        _loss_finish_kernel[(batch,)](
            squares, ref_squares, old_log_prob, advantages, weights, *rows,
            loss, policy, log_prob, divergence, grad_q, grad_r, num_chunks, float(size), float(clip_range), float(beta),
            KIND=code, MEAN=reduce == "mean", HAS_REF=has_ref, LATENT_KL=kl == "latent_mean",
            KL_STD_T=kl_std == "std_t" and kind != "cps", FINISH=sde_triton.FINISH_BLOCK,
        )
        ctx.save_for_backward(v, x_t, x_next, v_ref if has_ref else None, *rows, grad_q, grad_r)
        ctx.settings = (code, has_ref, block, num_chunks)
        ctx.mark_non_differentiable(policy, log_prob, divergence)
        return loss, policy, log_prob, divergence

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        v, x_t, x_next, v_ref, *rows, grad_q, grad_r = ctx.saved_tensors
        code, has_ref, block, num_chunks = ctx.settings
        grad_v = None
        if ctx.needs_input_grad[0]:
            grad_v = torch.empty_like(v)
            size = v.numel() // v.shape[0]
            _loss_backward_kernel[(v.shape[0], num_chunks)](
                grad_loss.float().contiguous(), grad_q, grad_r, x_t, x_next, v, v_ref if has_ref else v, grad_v,
                *rows, size, KIND=code, HAS_REF=has_ref, BLOCK=block,
            )
        return grad_v, None, None, None, None, None, None, None, None


def grpo_transition_loss_triton(v, x_t, x_next, v_ref, rows, old_log_prob, advantages, weights, *, kind, reduce,
                                clip_range, beta, kl, kl_std="std_t") -> TransitionLoss:
    """Run ``FusedTransitionLoss``; ``rows`` holds the fp32 ``[batch]`` sigma, sigma_next, noise level and scale."""
    settings = (kind, reduce, clip_range, beta, kl, kl_std, sde_triton.BLOCK)
    return TransitionLoss(*FusedTransitionLoss.apply(v, x_t, x_next, v_ref, rows, old_log_prob, advantages, weights,
                                                     settings))
