"""Fused tensor math for the hot paths (installed as ``flowalign.kernels``).

Two fused ops, each a Triton kernel with a plain torch reference that is also the CPU implementation:

* ``sde_transition``: one SDE step (mean, sample from given noise, per-row log-prob) for every SDE kind;
* ``grpo_transition_loss``: the per-transition GRPO loss (log-prob, ratio, PPO clip, weight, KL) with a Triton
  backward for ``dL/dv``.

``backend`` picks the path: ``auto`` (Triton for CUDA tensors, torch otherwise), or a forced ``triton`` / ``torch``
through an op's ``backend=`` argument, a ``use_backend(...)`` block, or the ``FLOWALIGN_KERNELS`` environment variable.
The Triton modules are imported only when the Triton path runs.

Never install this folder as a top-level ``kernels`` package: transformers and diffusers probe for the Hugging Face
``kernels`` hub package under that import name (docs/contributing/architecture.md#installed-names).
"""

if __name__ == "kernels":
    # Imported as a top-level ``kernels``: the repository root is on sys.path (``python -m ...`` run from it), and
    # that name belongs to the Hugging Face hub package transformers and diffusers import. Hand the name over to it.
    import importlib as _importlib
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _saved = list(_sys.path)
    _sys.path[:] = [entry for entry in _sys.path if _os.path.abspath(entry or _os.curdir) != _root]
    del _sys.modules["kernels"]
    try:
        _importlib.import_module("kernels")  # the installed hub package, or ModuleNotFoundError as without this folder
    finally:
        _sys.path[:] = _saved
else:
    from .backend import BACKENDS, ENV_VAR, requested_backend, resolve_backend, use_backend
    from .dispatch import grpo_transition_loss, sde_transition
    from .loss_reference import KL_FORMS, TransitionLoss, clipped_policy_loss, grpo_transition_loss_reference
    from .sde_reference import StepOutput, sde_step_reference

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KL_FORMS",
    "StepOutput",
    "TransitionLoss",
    "clipped_policy_loss",
    "grpo_transition_loss",
    "grpo_transition_loss_reference",
    "requested_backend",
    "resolve_backend",
    "sde_step_reference",
    "sde_transition",
    "use_backend",
]
