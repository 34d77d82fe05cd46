"""Rollout shapes: how the samples of an iteration are grown from the prompts (chains, trees, probed trunks).

A ``RolloutShape`` is registered in ``SHAPES`` with its settings (``rollout: {name: tree, split_steps: [0, 2]}``) and
declares what the batch arithmetic needs of it: how many final images a prompt gets (``samples_per_prompt``), how many
of a rollout's steps are stochastic and so trainable (``stochastic_steps``), and whether a rollout chunk and a process
must hold whole prompts (``whole_prompts``: a tree or a probed trunk is grown in one batched pass). ``grow(context,
sample_ids, cond) -> Batch`` rolls out one chunk of this process's samples.

Sample numbering. The ``P * K`` samples of an iteration are numbered prompt-major (sample ``j`` belongs to prompt
``j // samples_per_prompt``), and each process takes a contiguous slice. Every random draw is keyed by what it is for
(``flowalign.seeding.Purpose``) and by a sample, group or prompt number, never by a position in a batch, so a chunk
gives the same latents whatever the chunking and the process count.

A ``RolloutHook`` reads the policy's own passes during a chain rollout (the latent-register reader is the first): the
component that needs it (a credit estimator) returns it from ``rollout_hooks()``, and what it read lands in
``Batch.extras[hook.name]``. A ``RolloutGuidance`` (a hook too) shifts the mean of a chain rollout's SDE steps
(``flowalign.samplers.rollout``'s ``guidance``; Euphonium's process-reward guidance is one), and what it recorded lands
in ``Batch.extras[guidance.name]``.

Optional transition fields. A component that needs more of the rollout than the states and log-probs names the
field in ``rollout_fields()`` (``"velocity"``: the rollout policy's velocity at each transition's source, which
GRPO-Guard's RatioNorm needs to rebuild the old transition mean exactly); the context carries the union of them
(``RolloutContext.fields``) and a shape that declares the field in ``fields`` stores it (``keeps(name)``). A config
asking for a field its shape cannot store is refused before anything loads.

Base-model tail (``sampling.base_tail_steps``, as MixGRPO's inference runs): the last steps of a rollout are taken by
the reference model (the LoRA disabled, ``model.reference()``); every shape wraps its velocity with
``RolloutContext.with_base_tail``. Those steps must be ODE steps (checked at load time), so no trained transition's
log-prob comes from the base model and the first ratio stays exactly 1.

The protocol (registry, base class, dataclasses) is ``flowalign.rollout.base``; this package re-exports it and imports
the built-in modules so they register.
"""

from flowalign.rollout.base import (SHAPES, Batch, RolloutContext, RolloutGuidance, RolloutHook, RolloutShape,
                                    per_row_velocity, register_shape)
# The built-in shapes register themselves on import.
from flowalign.rollout import chains, probes, trees  # noqa: F401

__all__ = ["SHAPES", "Batch", "RolloutContext", "RolloutGuidance", "RolloutHook", "RolloutShape", "per_row_velocity",
           "register_shape"]
