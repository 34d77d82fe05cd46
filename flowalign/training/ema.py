"""An exponential moving average of named parameters (Polyak averaging), kept beside the live weights.

After every optimizer step each average moves toward its parameter:

    avg <- avg + (1 - decay) * (param - avg)        (``avg.lerp_(param, 1 - decay)``)

so with ``decay = 0.9`` an average forgets its past at 10% a step. The averages start as copies of the parameters,
are keyed by the parameters' names (the keys of ``ema.safetensors`` in a checkpoint), and live on each parameter's
device and in its dtype. ``swapped_in()`` puts them into the parameters for a block (evaluation of the EMA weights)
and restores the live weights bitwise afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from torch import Tensor

__all__ = ["EMA"]


class EMA:
    """The EMA of ``named_params`` (name -> parameter, held by reference) with ``decay`` in [0, 1)."""

    def __init__(self, named_params: Mapping[str, Tensor], decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay!r}")
        self.decay = decay
        self.params = dict(named_params)
        self._averages = {name: param.detach().clone() for name, param in self.params.items()}

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """One step of every average toward its parameter (module docstring), with ``decay`` in [0, 1] for this step
        instead of the EMA's own (a policy copy's schedule): 0 copies the parameters, 1 leaves the averages."""
        decay = self.decay if decay is None else float(decay)
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay!r}")
        for name, param in self.params.items():
            self._averages[name].lerp_(param.detach(), 1 - decay)

    def state_dict(self) -> dict[str, Tensor]:
        """The averages by parameter name (the tensors themselves, as ``torch.nn.Module.state_dict``)."""
        return dict(self._averages)

    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Take ``tensors`` as the averages, each copied onto its parameter's device and dtype. Their names must be
        the parameters' (ValueError naming the missing and unexpected ones)."""
        missing = sorted(set(self.params) - set(tensors))
        unexpected = sorted(set(tensors) - set(self.params))
        if missing or unexpected:
            raise ValueError(f"the EMA state does not match its parameters: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self._averages = {name: tensors[name].to(device=param.device, dtype=param.dtype).clone()
                          for name, param in self.params.items()}

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """A block in which the parameters hold their averages; the live values come back (bitwise) on exit."""
        saved = {name: param.detach().clone() for name, param in self.params.items()}
        for name, param in self.params.items():
            param.data.copy_(self._averages[name])
        try:
            yield
        finally:
            for name, param in self.params.items():
                param.data.copy_(saved[name])
