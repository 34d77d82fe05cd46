"""Loss terms on rollout transitions: the GRPO policy loss (PPO clip + KL) and RG-OPD, as registered components.

The trainer evaluates the policy once per micro-batch (one rollout batch at one step, the rollout's own batch
composition, so the first ratio is exactly 1) and hands every term the same ``MicroBatch`` and ``PolicyOutput``: the
policy velocity at the unique source states (and per transition), and the reference velocity (LoRA off), computed
once when any term ``needs_reference``. A term never runs the policy itself, so no term can re-batch the forward. A
term may hold a teacher set up from the model (RG-OPD's targets on the reference model).

The micro-batch loss is the sum of the terms, in the order of ``loss`` in the config (the default ``grpo`` first), and
the stats of all terms are logged together.

The protocol (registry, base class, dataclasses) is ``flowalign.losses.base``; this package re-exports it and imports
the built-in modules so they register.
"""


from flowalign.deprecation import moved_names
from flowalign.losses.base import LOSSES, LossTerm, MicroBatch, PolicyOutput, register_loss
# The built-in terms register themselves on import.
from flowalign.losses import gated_kl, grpo, reference, rg_opd  # noqa: F401

__all__ = ["LOSSES", "LossTerm", "MicroBatch", "PolicyOutput", "register_loss"]

_MOVED = {name: f"flowalign.objectives.soar_math:{name}" for name in ("soar_aux_points", "soar_loss")}


# soar_aux_points and soar_loss (SOAR's math, not loss terms) moved to flowalign.objectives.soar_math: importable
# from here for one release, with a DeprecationWarning.
__getattr__ = moved_names(__name__, _MOVED)
