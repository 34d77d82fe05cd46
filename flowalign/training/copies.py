"""The lagging copies of the trainable weights the run's components ask for (``Component.policy_copies``).

Each copy starts as the trainable weights and moves at the end of every iteration by

    theta_c <- eta theta_c + (1 - eta) theta,        eta = copy.decay(k),  k = optimizer steps taken so far

(``EMA.update(decay=eta)``: ``eta = 0`` copies the weights exactly, ``eta = 1`` leaves the copy). ``swapped_in(name)``
puts a copy into the trainable parameters for a block, restoring the live weights bitwise afterwards: how the trainer
rolls out with a sampling policy and evaluates a copy's velocity at an objective's data units. The copies are saved
in checkpoints (``copies.safetensors``, keys ``<copy>/<parameter>``; a sharded run's ``sharded/``) so a resumed run
continues exactly.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator, Mapping

from torch import Tensor

from flowalign.components import REFERENCE_POLICY, PolicyCopy
from flowalign.training.ema import EMA

__all__ = ["PolicyCopies", "sampling_weights"]


class PolicyCopies:
    """The copies ``specs`` of ``named_params`` (name -> parameter, held by reference)."""

    def __init__(self, named_params: Mapping[str, Tensor], specs: list[PolicyCopy]):
        names = [spec.name for spec in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"two components declare a policy copy named {duplicates[0]!r}")
        self.specs = {spec.name: spec for spec in specs}
        self.copies = {spec.name: EMA(named_params, 0.0) for spec in specs}

    def __bool__(self) -> bool:
        return bool(self.copies)

    def __contains__(self, name: str) -> bool:
        return name in self.copies

    def end_iteration(self, steps: int) -> dict[str, float]:
        """Move every copy by its schedule after ``steps`` optimizer steps in all; returns each copy's ``eta``."""
        etas = {}
        for name, copy in self.copies.items():
            etas[name] = self.specs[name].eta(steps)
            copy.update(decay=etas[name])
        return etas

    def end_iteration_metrics(self, steps: int) -> dict[str, float]:
        """``end_iteration``, its ``eta`` by copy as metrics (``copies/<name>/eta``)."""
        return {f"copies/{name}/eta": eta for name, eta in self.end_iteration(steps).items()}

    @contextmanager
    def swapped_in(self, name: str) -> Iterator[None]:
        """A block in which the trainable parameters hold copy ``name``."""
        with self.copies[name].swapped_in():
            yield

    def state_dict(self) -> dict[str, Tensor]:
        """Every copy's tensors, keyed ``<copy>/<parameter>``."""
        return {f"{name}/{key}": value for name, copy in self.copies.items()
                for key, value in copy.state_dict().items()}

    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Take ``tensors`` (``state_dict``'s keys) as the copies; a copy missing from them is a ValueError."""
        for name, copy in self.copies.items():
            prefix = f"{name}/"
            own = {key[len(prefix):]: value for key, value in tensors.items() if key.startswith(prefix)}
            if not own:
                raise ValueError(f"the checkpoint holds no policy copy {name!r}")
            copy.load_state_dict(own)


def sampling_weights(model: Any, copies: PolicyCopies, name: str | None) -> ContextManager:
    """A block in which ``model`` holds the weights the rollouts sample with, the sampling policy ``name``
    (``Components.sampling_policy``): the trained weights (None), the reference model (``"reference"``), or a copy."""
    if name is None:
        return nullcontext()
    if name == REFERENCE_POLICY:
        return model.reference()
    return copies.swapped_in(name)
