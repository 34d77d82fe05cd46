"""Memory that scales, and the planner that says whether a run fits (``flowalign plan``).

* ``checkpointing``: selective activation checkpointing per transformer block
  (``distributed.activation_checkpointing``).
* ``activations``: the bytes the autograd graph saves for the backward, measured with ``saved_tensors_hooks`` on a
  small model and scaled to a configured resolution by a documented rule.
* ``published``: the published transformer configs and component sizes shipped in ``configs/published``.
* ``planner``: per-process memory of a training config at a process count, and the verdict.
* ``resident``: a process's resident memory and its peak since a reset, from ``/proc`` (the benchmarks' and tests'
  measure of what a stretch of work took).
"""
