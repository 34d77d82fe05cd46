"""Which implementation runs a fused op: the Triton kernel or its plain torch reference.

``auto`` sends CUDA tensors to Triton (when triton imports) and everything else to the torch reference. ``triton`` or
``torch`` forces a path. The choice comes from, first to last, the ``backend=`` argument of an op, the innermost
``use_backend(...)`` block, and the ``FLOWALIGN_KERNELS`` environment variable; the first of them that is not
``auto`` decides. The trainer's ``model.kernels`` config key is passed as the argument.

A forced ``triton`` on CPU tensors runs Triton's interpreter, which needs ``TRITON_INTERPRET=1`` in the environment
before the kernels are first used (triton reads it when it decorates them): that is how the tests run the kernels
without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager

import torch
from torch import Tensor

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "FLOWALIGN_KERNELS"

_scoped: list[str] = []


def check_backend(name: str, source: str = "backend") -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


@contextmanager
def use_backend(name: str):
    """Within the block, ops without an explicit ``backend=`` use ``name`` (``auto`` defers to the environment)."""
    _scoped.append(check_backend(name))
    try:
        yield
    finally:
        _scoped.pop()


def requested_backend(backend: str | None = None) -> str:
    """The first non-``auto`` choice among the argument, the innermost ``use_backend`` block and the environment."""
    if backend is not None and check_backend(backend) != "auto":
        return backend
    if _scoped and _scoped[-1] != "auto":
        return _scoped[-1]
    return check_backend(os.environ.get(ENV_VAR, "auto") or "auto", source=f"the environment variable {ENV_VAR}")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(like: Tensor, backend: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for an op on ``like``'s device; a forced path that cannot run says why."""
    choice = requested_backend(backend)
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if like.is_cuda and triton_available() else "torch"
    if not triton_available():
        raise RuntimeError(f"the triton kernels were requested ({ENV_VAR} or model.kernels = 'triton') but triton is "
                           "not installed: pip install triton, or use 'torch'")
    if not like.is_cuda and not interpreter_enabled():
        raise RuntimeError(f"the triton kernels were requested for tensors on {like.device}: they need CUDA tensors, "
                           "or TRITON_INTERPRET=1 set before the first kernel call to run Triton's CPU interpreter")
    return "triton"


# ------------------------------------------------------------------------------------------ input checks


def check_latent(name: str, tensor: Tensor, like: Tensor | None = None, like_name: str = "x") -> None:
    """A floating ``[batch, ...]`` tensor, with ``like``'s shape and device when ``like`` is given."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
    if like is None:
        if tensor.ndim < 2 or tensor.shape[0] == 0 or tensor.numel() == 0:
            raise ValueError(f"{name} must be a non-empty [batch, ...] tensor with at least 2 dims, got shape "
                             f"{tuple(tensor.shape)}")
        return
    if tensor.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {like_name} has shape {tuple(like.shape)}: "
                         "they must match")
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device} but {like_name} is on {like.device}: move them to one device")


def check_same_dtype(name: str, tensor: Tensor, like: Tensor, like_name: str) -> None:
    if tensor.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype} but {like_name} has dtype {like.dtype}: they must match "
                        f"(cast one with .to({like_name}.dtype))")


def row_values(name: str, value: float | Tensor, like: Tensor, *, scalar_ok: bool = True) -> Tensor:
    """A scalar (when ``scalar_ok``) or ``[batch]`` value as a contiguous fp32 ``[batch]`` tensor on ``like``'s device."""
    batch = like.shape[0]
    if isinstance(value, Tensor):
        if value.device != like.device and value.ndim > 0:
            raise ValueError(f"{name} is on {value.device} but the latents are on {like.device}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be real numbers, got dtype {value.dtype}")
    tensor = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if tensor.ndim == 0 and scalar_ok:
        return tensor.expand(batch).contiguous()
    if tensor.shape != (batch,):
        expected = f"a scalar or a [batch={batch}] tensor" if scalar_ok else f"a [batch={batch}] tensor"
        raise ValueError(f"{name} must be {expected}, got shape {tuple(tensor.shape)}")
    return tensor.contiguous()
