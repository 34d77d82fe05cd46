"""What one transformer forward keeps for its backward, measured, and scaled to another resolution.

**Measured** (``saved_activations``): one forward of a real (small) model with gradients on, under
``torch.autograd.graph.saved_tensors_hooks``: every tensor the autograd graph saves for the backward passes through
the pack hook, and is counted once per storage (the same input saved by the q, k and v projections is one tensor),
without the parameters (they are held anyway). Each saved tensor is charged to the transformer block running when it
was saved (``flowalign.models.blocks.transformer_blocks``; forward pre/post hooks), or to the rest of the model (the patch
and timestep embeddings, the output layer); a block's own inputs are recorded too: they are what a checkpointed block
keeps (``flowalign.memory.checkpointing``). Square attention-score tensors ``(B, heads, T, T)``, which CPU's math
attention saves and fused GPU kernels (flash, memory-efficient, cuDNN) do not, are kept apart.

**Scaled** (``ActivationProfile.scaled``): a block's saved bytes are proportional to its tokens ``T`` (image tokens
plus text tokens) times its width ``W`` (the hidden size) times the batch: per block class ``c = saved / (B T W 4)``
is measured in fp32 on a small model of the same family, then the prediction at another shape is
``c B' T' W' s'`` with ``s'`` the compute dtype's bytes (2 for bf16); the attention scores are dropped (fused GPU
kernels keep O(T) statistics, which the linear term covers). The rule is exact for everything linear in the sequence
(projections, norms, MLPs, the fused attention's output), which is what a DiT block saves; its error is what it
leaves out: score tensors on a CPU, the few tensors with fixed size (timestep embeddings), and autocast's fp32 copies
of norm inputs under bf16 (tests/test_memory_plan.py measures the rule against a real forward at another shape).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["ActivationProfile", "BlockActivations", "LivePeak", "saved_activations"]


@dataclass
class BlockActivations:
    """One block's share of a forward: ``saved`` bytes saved inside it, ``inputs`` the bytes of its tensor inputs,
    ``tokens`` and ``width`` of its sequence inputs ``(B, T, W)``."""

    kind: str
    saved: int = 0
    inputs: int = 0
    tokens: int = 0
    width: int = 0


@dataclass
class ActivationProfile:
    """The saved-for-backward bytes of one forward at ``batch`` samples: per block, the rest, the attention scores."""

    batch: int
    blocks: list[BlockActivations] = field(default_factory=list)
    outside: int = 0
    scores: int = 0

    def total(self, every: int = 0, *, scores: bool = True) -> int:
        """Bytes held for the backward at the end of the forward, with every ``every``-th block checkpointed: a
        checkpointed block keeps its inputs, and its activations come back one block at a time in the backward (the
        largest checkpointed block's saved bytes on top)."""
        from flowalign.memory.checkpointing import checkpointed_blocks

        chosen = set(checkpointed_blocks(len(self.blocks), every))
        kept = sum(b.inputs if i in chosen else b.saved for i, b in enumerate(self.blocks))
        recompute = max((self.blocks[i].saved for i in chosen), default=0)
        return self.outside + kept + recompute + (self.scores if scores else 0)

    def coefficients(self) -> dict[str, tuple[float, float]]:
        """Per block class, ``(saved, inputs) / (B T W 4)``: the rule's constants (fp32 measurement)."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for block in self.blocks:
            if not block.tokens:  # a block this forward did not run (the other expert of a pair)
                continue
            unit = self.batch * block.tokens * block.width * 4
            sums[block.kind][0] += block.saved / unit
            sums[block.kind][1] += block.inputs / unit
            sums[block.kind][2] += 1
        return {kind: (s / n, i / n) for kind, (s, i, n) in sums.items()}

    def _unit(self) -> int:
        first = next(block for block in self.blocks if block.tokens)
        return self.batch * first.tokens * first.width * 4

    def outside_coefficient(self) -> float:
        return self.outside / self._unit()

    def scaled(self, kinds: list[str], *, batch: int, tokens: int, width: int, itemsize: int) -> "ActivationProfile":
        """This profile's rule applied to a model whose blocks are ``kinds`` (class names, in order) at ``batch``,
        ``tokens`` per block and ``width``, computing in ``itemsize`` bytes (module docstring); no scores."""
        rule = self.coefficients()
        missing = sorted(set(kinds) - set(rule))
        if missing:
            raise ValueError(f"no measurement for the block classes {missing} (measured: {sorted(rule)})")
        unit = batch * tokens * width * itemsize
        blocks = [BlockActivations(kind, round(rule[kind][0] * unit), round(rule[kind][1] * unit), tokens, width)
                  for kind in kinds]
        return ActivationProfile(batch, blocks, round(self.outside_coefficient() * unit), 0)


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _is_scores(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 4 and tensor.shape[-1] == tensor.shape[-2] and tensor.shape[-1] > 1


@contextmanager
def _recording(transformer: torch.nn.Module, profile: ActivationProfile):
    from flowalign.models.blocks import transformer_blocks

    blocks = transformer_blocks(transformer)
    held = {_storage_key(p) for p in transformer.parameters()} | {_storage_key(b) for b in transformer.buffers()}
    seen: set[tuple[int, int]] = set()
    current: list[BlockActivations] = []
    handles = []

    def enter(record):
        def hook(module, args, kwargs):
            width = max((a.shape[-1] for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.dim() == 3),
                        default=0)
            for value in (*args, *kwargs.values()):
                if torch.is_tensor(value) and value.is_floating_point():
                    record.inputs += value.numel() * value.element_size()
                    if value.dim() == 3 and value.shape[-1] == width:
                        record.tokens += value.shape[1]
            record.width = width
            current.append(record)
        return hook

    def leave(module, args, kwargs, output):
        current.pop()

    for block in blocks:
        record = BlockActivations(type(block).__name__)
        profile.blocks.append(record)
        handles.append(block.register_forward_pre_hook(enter(record), with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))

    def pack(tensor):
        key = _storage_key(tensor)
        if key not in held and key not in seen and key[0] != 0:
            seen.add(key)
            if _is_scores(tensor):
                profile.scores += key[1]
            elif current:
                current[-1].saved += key[1]
            else:
                profile.outside += key[1]
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
    finally:
        for handle in handles:
            handle.remove()


def saved_activations(model, x: torch.Tensor, sigma: torch.Tensor, cond, guidance_scale: float = 1.0
                      ) -> ActivationProfile:
    """The profile of one velocity forward of ``model`` (a ``FlowModel``) at ``x`` (module docstring); the outputs
    are kept until the count is done, so no saved storage is freed and reused meanwhile."""
    profile = ActivationProfile(batch=x.shape[0])
    with torch.enable_grad(), _recording(model.transformer, profile):
        out = model.velocity(x, sigma, cond, guidance_scale)
    del out
    return profile


class LivePeak(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak bytes of tensor storages alive at once among those created inside the context (the tensors' own
    accounting: every op's outputs, each storage counted once until it is freed): a CPU stand-in for
    ``torch.cuda.max_memory_allocated``."""

    def __init__(self, held=()):
        """``held``: tensors that exist already (the parameters): in-place updates of them allocate nothing."""
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()
        self._held = [t.untyped_storage() for t in held]  # kept alive: their ids stay theirs
        self._held_ids = {id(s) for s in self._held}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._tracked or key in self._held_ids or storage.data_ptr() == 0:
            return
        self._tracked.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in torch.utils._pytree.tree_leaves(out):
            # a wrapper subclass (a DTensor) owns no storage: its local tensors come through here themselves
            if isinstance(value, torch.Tensor) and not value.is_meta and not is_traceable_wrapper_subclass(value):
                self._track(value)
        return out
