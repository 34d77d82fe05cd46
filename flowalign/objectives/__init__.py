"""Objectives: losses on data units instead of rollout transitions: on a dataset (supervised flow matching, SOAR,
Shell-LCC) or on the iteration's rollouts (the forward-process objectives DiffusionNFT, AWM, online DPO, DGPO and
CRD).

An ``Objective`` is registered in ``OBJECTIVES`` with its settings (``objectives: {flow_matching: {data: ...}}``, several
may be on). Each iteration it makes this process's ``DataUnit``s (``units(iteration, context)``): latents ``x`` the
policy is evaluated at, their noise levels and conditioning rows, and whatever its loss needs; every draw is keyed by
``(seed, iteration, unit)`` (``context.generator``) and the units are numbered by ``unit_keys``, so a 2-process run
makes the same units as a 1-process run and trains the same ones in each minibatch. The trainer evaluates the policy
(and the reference, when ``needs_reference``) once per unit and calls ``loss(unit, policy)``, a ``PolicyOutput`` as
the loss terms get.

Objectives on rollouts (``trains_on_rollouts = True``) train on the final samples of the iteration's rollout and their
rewards, not on its transitions: the trainer rolls out (with the component's ``sampling_policy``, any sampler, no
log-prob is read), scores and group-normalises as for GRPO, and hands the objective this process's samples in
``context.rollout`` (``RolloutSamples``: final latents, conditioning, rewards, advantages, validity, group ids). Its
draws are keyed by global sample (or group) numbers (``Purpose.FORWARD``), so the units do not depend on the layout;
``samples_per_unit(config)`` tells the batch arithmetic how many consecutive samples a unit holds (each process's
share of the samples must be a multiple of it). A run may be rollout objectives alone (``loss: {grpo: null}``).

Interleaving. The units of an inner epoch are split over the optimizer's minibatches like the trained steps: the
``m``-th minibatch gets the ``m``-th of ``optim.minibatches`` equal shares, and its loss is the mean over its rollout
micro-batches plus, per objective, the mean over that objective's units in it (each objective weighs its own loss).

The protocol (registry, base class, dataclasses) is ``flowalign.objectives.base``; this package re-exports it and imports
the built-in modules so they register.
"""

from flowalign.objectives.base import (OBJECTIVES, DataUnit, Objective, ObjectiveContext, PolicyOutput,
                                       RolloutSamples, process_slice, register_objective, unit_keys)
# The built-in objectives register themselves on import.
from flowalign.objectives import (  # noqa: F401
    adjoint_matching, awm, crd, dgpo, diffusion_nft, dpo, flow_matching, shell_lcc, soar)

__all__ = ["OBJECTIVES", "DataUnit", "Objective", "ObjectiveContext", "PolicyOutput", "RolloutSamples", "process_slice",
           "register_objective", "unit_keys"]
