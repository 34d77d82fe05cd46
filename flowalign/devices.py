"""Device and dtype names: the one place that turns config strings into torch objects."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "resolve_device", "resolve_dtype"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its name (``fp32``, ``bf16``, ``fp16`` or the long forms); a dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``device``, or CUDA when it is available and the CPU otherwise."""
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
