"""Helpers of the hand-computed float64 loss tests (tests/test_dgpo.py, tests/test_crd.py): random velocity-shaped
tensors, a value with its autograd gradient, and the per-sample mean squared error ``||a - b||^2_m``."""

import torch

D = torch.float64


def tensors(batch, seed, shape=(2, 2, 3)):
    """Four seeded float64 tensors ``[batch, *shape]``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((batch, *shape), generator=g, dtype=D) for _ in range(4)]


def grad_of(fn, v):
    """``(fn(v), d fn / d v)`` by autograd, both detached."""
    v = v.clone().requires_grad_(True)
    value = fn(v)
    (g,) = torch.autograd.grad(value, v)
    return value.detach(), g


def mse(a, b):
    """The per-sample mean over the latent dimensions of ``(a - b)^2``: ``[B]``."""
    return ((a - b) ** 2).reshape(len(a), -1).mean(1)
