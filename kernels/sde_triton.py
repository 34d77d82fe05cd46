"""Fused Triton SDE step: mean, sample from given noise, and the per-row Gaussian log-prob in one pass.

Every SDE kind's mean is affine in the state and the velocity, with per-row coefficients
(docs/design/math.md#sde-steps):

* ``flow_grpo`` (Flow-GRPO, Liu et al. 2025, eq. 9), with ``std_t = a sqrt(s / (1 - s))`` (``1 - s'`` at ``s = 1``):
  ``c_x = 1 + std_t^2 dt / (2 s)``, ``c_v = (1 + std_t^2 (1 - s) / (2 s)) dt``, ``std = std_t sqrt(-dt)``.
* ``dance`` (DanceGRPO, Xue et al. 2025), from ``score = -(x + (1 - s) v) / s``:
  ``c_x = 1 + a^2 dt / (2 s)``, ``c_v = dt + a^2 dt (1 - s) / (2 s)``, ``std = a sqrt(-dt)``.
* ``cps`` (coefficient-preserving sampling, Wang & Yu 2025), with ``std = s' sin(a pi / 2)`` and
  ``r = sqrt(s'^2 - std^2)``: ``c_x = 1 - s' + r``, ``c_v = (1 - s) r - s (1 - s')``.

so ``mu = c_x x + c_v v`` and ``x' = mu + c std eps`` (``c``: the noise scale). A row's coefficients are a handful of
scalar operations each program recomputes, which is what lets one kernel serve a batch that mixes steps, noise levels
and kinds of rows (tree rollouts). The log-prob ``-|x' - mu|^2 / (2 std^2) - D (log std + log sqrt(2 pi))`` (divided by
``D`` for the ``mean`` reduction) needs only the per-row sum of squares, which each program writes for its chunk; a
second small kernel adds a row's chunks in a fixed order, so the result is deterministic (no atomics).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .backend import interpreter_enabled
from .sde_reference import StepOutput

KIND_CODES = {"flow_grpo": 0, "dance": 1, "cps": 2}
# Read at each launch (the tests shrink them to cover many chunks with small latents).
BLOCK = 1024  # elements per program; a row of D elements is cdiv(D, BLOCK) programs
FINISH_BLOCK = 256  # chunk partial sums a finishing program adds per iteration
INTERPRETED = interpreter_enabled()  # read once, as triton does when it decorates the kernels below

LOG_SQRT_2PI: tl.constexpr = tl.constexpr(0.5 * math.log(2 * math.pi))
HALF_PI: tl.constexpr = tl.constexpr(0.5 * math.pi)


@triton.jit
def row_coefficients(s, s_next, level, scale, KIND: tl.constexpr):
    """``(c_x, c_v, std)`` of one row: ``mu = c_x x + c_v v`` and the std (times the noise scale) of ``x'``."""
    dt = s_next - s
    if KIND == 0:
        denominator = tl.where(s >= 1.0, 1.0 - s_next, 1.0 - s)
        std_t = level * tl.sqrt(s / denominator)
        var_t = std_t * std_t
        c_x = 1.0 + var_t * dt / (2.0 * s)
        c_v = (1.0 + var_t * (1.0 - s) / (2.0 * s)) * dt
        std = std_t * tl.sqrt(-dt)
    elif KIND == 1:
        half_var = 0.5 * level * level
        c_x = 1.0 + half_var * dt / s
        c_v = dt + half_var * dt * (1.0 - s) / s
        std = level * tl.sqrt(-dt)
    else:
        std = s_next * tl.sin(level * HALF_PI)
        r = tl.sqrt(tl.maximum(s_next * s_next - std * std, 0.0))
        c_x = 1.0 - s_next + r
        c_v = (1.0 - s) * r - s * (1.0 - s_next)
    return c_x, c_v, std * scale


@triton.jit
def load_row_coefficients(sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, row, KIND: tl.constexpr):
    s = tl.load(sigma_ptr + row)
    s_next = tl.load(sigma_next_ptr + row)
    level = tl.load(level_ptr + row)
    scale = tl.load(scale_ptr + row)
    return row_coefficients(s, s_next, level, scale, KIND)


@triton.jit
def load_block(x_ptr, v_ptr, sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D, KIND: tl.constexpr,
               BLOCK: tl.constexpr):
    """This program's block of its row (grid ``(rows, chunks)``): ``(row, chunk, offsets, mask, c_x, c_v, std, x, v)``
    with ``offsets`` absolute in the flat tensor and ``x``, ``v`` in fp32 (0 past the row's end)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    within = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = within < D
    offsets = row.to(tl.int64) * D + within
    c_x, c_v, std = load_row_coefficients(sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, row, KIND)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return row, chunk, offsets, mask, c_x, c_v, std, x, v


@triton.jit
def row_sum(partial_ptr, row, num_chunks, FINISH: tl.constexpr):
    """The sum of a row's ``num_chunks`` partial sums, always added in the same order."""
    total = tl.zeros([FINISH], dtype=tl.float32)
    for start in range(0, num_chunks, FINISH):
        index = start + tl.arange(0, FINISH)
        total += tl.load(partial_ptr + row * num_chunks + index, mask=index < num_chunks, other=0.0)
    return tl.sum(total, axis=0)


@triton.jit
def row_log_prob(squares, std, n, MEAN: tl.constexpr):
    """Gaussian log-density of a row from its sum of squared residuals; 0 for a deterministic row (``std == 0``)."""
    safe_std = tl.where(std > 0, std, 1.0)
    quadratic = -squares / (2.0 * safe_std * safe_std)
    if MEAN:
        log_prob = quadratic / n - tl.log(safe_std) - LOG_SQRT_2PI
    else:
        log_prob = quadratic - n * (tl.log(safe_std) + LOG_SQRT_2PI)
    return tl.where(std > 0, log_prob, 0.0)


@triton.jit
def _sde_step_kernel(x_ptr, v_ptr, noise_ptr, sample_ptr, mean_ptr, partial_ptr,
                     sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D, num_chunks,
                     KIND: tl.constexpr, DRAW: tl.constexpr, BLOCK: tl.constexpr):
    row, chunk, offsets, mask, c_x, c_v, std, x, v = load_block(
        x_ptr, v_ptr, sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, D, KIND, BLOCK)
    mean = c_x * x + c_v * v
    tl.store(mean_ptr + offsets, mean, mask=mask)
    if DRAW:
        noise = tl.load(noise_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # Score the sample as stored (rounded to x's dtype), so re-scoring it later gives the same log-prob.
        sample = (mean + std * noise).to(sample_ptr.dtype.element_ty)
        tl.store(sample_ptr + offsets, sample, mask=mask)
        sample = sample.to(tl.float32)
    else:
        sample = tl.load(sample_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = tl.where(mask, sample - mean, 0.0)
    tl.store(partial_ptr + row * num_chunks + chunk, tl.sum(residual * residual, axis=0))


@triton.jit
def _sde_finish_kernel(partial_ptr, std_ptr, log_prob_ptr, sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr,
                       num_chunks, n, KIND: tl.constexpr, MEAN: tl.constexpr, FINISH: tl.constexpr):
    row = tl.program_id(0)
    _, _, std = load_row_coefficients(sigma_ptr, sigma_next_ptr, level_ptr, scale_ptr, row, KIND)
    squares = row_sum(partial_ptr, row, num_chunks, FINISH)
    tl.store(std_ptr + row, std)
    tl.store(log_prob_ptr + row, row_log_prob(squares, std, n, MEAN))


def sde_step_triton(
    x: Tensor,
    v: Tensor,
    rows: tuple[Tensor, Tensor, Tensor, Tensor],
    *,
    kind: str,
    reduce: str,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
) -> StepOutput:
    """Launch the fused step on contiguous, validated inputs (``flowalign.kernels.sde_transition`` prepares them).

    ``rows`` holds the fp32 ``[batch]`` sigma, sigma_next, noise level and noise scale. Returns what
    ``sde_step_reference`` returns: the sample in ``x.dtype``, the fp32 mean, and fp32 ``[batch]`` std and log-prob.
    """
    batch, block = x.shape[0], BLOCK
    size = x.numel() // batch
    num_chunks = triton.cdiv(size, block)
    mean = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    draw = prev_sample is None
    sample = torch.empty_like(x) if draw else prev_sample
    partial = torch.empty((batch, num_chunks), dtype=torch.float32, device=x.device)
    std = torch.empty(batch, dtype=torch.float32, device=x.device)
    log_prob = torch.empty(batch, dtype=torch.float32, device=x.device)
    code = KIND_CODES[kind]
    _sde_step_kernel[(batch, num_chunks)](
        x, v, noise if draw else x, sample, mean, partial, *rows, size, num_chunks,
        KIND=code, DRAW=draw, BLOCK=block,
    )
    _sde_finish_kernel[(batch,)](
        partial, std, log_prob, *rows, num_chunks, float(size), KIND=code, MEAN=reduce == "mean", FINISH=FINISH_BLOCK,
    )
    return StepOutput(sample, mean, std, log_prob)
