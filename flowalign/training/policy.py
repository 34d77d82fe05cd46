"""The policy's forward passes in training: one per micro-batch (a rollout batch at one step) and one per data unit.

A micro-batch evaluates the velocity once per distinct source state, in the rollout's own order (a tree's split
children share their parent's evaluation), so the batch matches the rollout's forward and the first recomputed
log-prob ratio of an iteration is exactly 1. The reference velocity (LoRA off) is computed once, without gradient,
when any loss term needs it. Loss terms and objectives only ever see the ``PolicyOutput``.

With CFG in training (``sampling.guidance_scale`` > 1 on a family with true CFG), the guided policy velocity
``u + g (c - u)`` backpropagates through both branches (``sampling.cfg_gradient: both``: flow_grpo's current
``train_sd3.py``, commit 74db691) or through the conditional one only, ``u`` detached (``conditional``: its
``train_sd3.py`` of July 2025, from commit 2d76907; still in ac4c86e). Values, and so log-probs and ratios, are the
same.
"""

from __future__ import annotations

import torch

from flowalign.losses import MicroBatch, PolicyOutput
from flowalign.models.base import unconditional_detached

__all__ = ["CFG_GRADIENTS", "micro_batch", "policy_output", "unit_output", "velocities"]

CFG_GRADIENTS = ("both", "conditional")


def micro_batch(batch, step: int) -> MicroBatch:
    """The transitions of ``batch`` at ``step``, with their unique sources."""
    t = batch.rollout.transitions
    sel = t.step == step
    st = t.select(sel)
    sources, inverse = torch.unique(st.src, return_inverse=True)
    rows = torch.empty_like(sources).scatter_(0, inverse, st.prompt_id)
    return MicroBatch(
        batch=batch, step=step, transitions=st, advantages=batch.advantages[sel], weights=batch.weights[sel],
        sources=sources, inverse=inverse, rows=rows, x=t.states[sources], sigma=st.sigma[:1].expand(len(sources)),
        sigma_next=st.sigma_next[:1].expand(len(sources)), cond=batch.cond.index(rows),
        metadata=[batch.metadata[r] for r in rows.tolist()],
    )


def velocities(model, x, sigma, cond, *, guidance_scale: float, autocast, reference: bool, reference_policy=None,
               cfg_gradient: str = "both"):
    """The policy velocity at ``x`` (with gradient) and, when ``reference``, the reference's (no gradient; else None):
    inside ``reference_policy()`` (the run's reference, ``flowalign.losses.reference``), by default the base model
    (``model.reference()``: the LoRA off). The reference runs first, so a reference that swaps weights in (GARDO's
    adaptive one) has put the live weights back before the policy's forward, and nothing changes them before its
    backward. With CFG, ``cfg_gradient`` (``sampling.cfg_gradient``) says which branches of the guided policy
    velocity carry the gradient: ``both``, or ``conditional`` (the unconditional prediction detached)."""
    if cfg_gradient not in CFG_GRADIENTS:
        raise ValueError(f"unknown cfg_gradient {cfg_gradient!r}: expected one of {', '.join(CFG_GRADIENTS)}")
    v_ref = None
    if reference:
        with torch.no_grad(), (reference_policy() if reference_policy else model.reference()), autocast():
            v_ref = model.velocity(x, sigma, cond, guidance_scale)
    with autocast(), unconditional_detached(cfg_gradient == "conditional"):
        v = model.velocity(x, sigma, cond, guidance_scale)
    return v, v_ref


def policy_output(model, micro: MicroBatch, *, guidance_scale: float, autocast, reference: bool,
                  reference_policy=None, cfg_gradient: str = "both") -> PolicyOutput:
    """The policy velocity at the micro-batch's sources (per transition too), and the reference's when asked."""
    v_sources, v_ref_sources = velocities(model, micro.x, micro.sigma, micro.cond, guidance_scale=guidance_scale,
                                          autocast=autocast, reference=reference, reference_policy=reference_policy,
                                          cfg_gradient=cfg_gradient)
    return PolicyOutput(v=v_sources[micro.inverse], v_sources=v_sources,
                        v_ref=None if v_ref_sources is None else v_ref_sources[micro.inverse],
                        v_ref_sources=v_ref_sources)


def unit_output(model, unit, *, guidance_scale: float, autocast, reference: bool, copies=None,
                reference_policy=None) -> PolicyOutput:
    """The policy (and reference) velocity at an objective's data unit; ``copies`` maps the names of policy copies
    to evaluate to a context manager factory swapping each in (``PolicyCopies.swapped_in``). The copies run first,
    without gradient, so no weight changes between the policy's forward and its backward."""
    v_copies = {}
    for name, swapped_in in (copies or {}).items():
        with torch.no_grad(), swapped_in(name), autocast():
            v_copies[name] = model.velocity(unit.x, unit.sigma, unit.cond, guidance_scale)
    v, v_ref = velocities(model, unit.x, unit.sigma, unit.cond, guidance_scale=guidance_scale, autocast=autocast,
                          reference=reference, reference_policy=reference_policy)
    return PolicyOutput(v=v, v_sources=v, v_ref=v_ref, v_ref_sources=v_ref, v_copies=v_copies)
