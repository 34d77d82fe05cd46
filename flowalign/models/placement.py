"""A module's device and dtype, read once and kept while its parameters stay where they were.

diffusers' ``ModelMixin.device`` and ``ModelMixin.dtype`` walk every submodule on each read (looking for group
offloading and layerwise-casting hooks) before they answer from the first parameter: about 0.9 ms on the toy's
LoRA-wrapped transformer (458 modules), more on real models. ``FlowModel`` reads both on every transformer call
(``timestep``, the inputs' casts), so the walk costs a few percent of a rollout.

``Placement`` keeps diffusers' answer together with a *signature* that costs a few microseconds to read: the module
itself, its first parameter or buffer (the tensor diffusers' device comes from) and its first floating parameter
outside ``_keep_in_fp32_modules`` (the one its dtype comes from), each as the same tensor object with the same device
and dtype. Whatever moves or casts the weights changes the signature, so the next read walks again:

- ``module.to(device)`` / ``.to(dtype)`` / ``.float()``: the parameters' device or dtype change;
- ``param.data = param.data.float()`` (a full fine-tune's fp32 master weights): the dtype changes;
- FSDP2's ``fully_shard`` and peft's LoRA wrapping of a first layer: new parameter objects;
- another module behind the same name (Wan2.2's expert pair, a swapped transformer): another module.

What the signature cannot see is a diffusers hook added later that changes the answer without touching a parameter
(``enable_layerwise_casting``, ``enable_group_offload``; flowalign uses neither): call ``forget()`` after adding one.
The cached values are diffusers' own, so every number computed with them is the same as without the cache.
"""

from __future__ import annotations

import itertools
import weakref

import torch

# A benchmark's switch (bench/velocity_overhead.py): False reads diffusers' properties on every call, as before.
ENABLED = True


def _signature_tensors(module: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The tensor diffusers' ``device`` answers from (the first parameter or buffer) and the one its ``dtype``
    answers from when no hook decides it (the first floating parameter outside ``_keep_in_fp32_modules``); None where
    there is none. Both are found by walking the parameters lazily from the start: a few modules, not all."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    floating = None
    for name, param in module.named_parameters():
        if keep and any(kept in name for kept in keep):
            continue
        if param.is_floating_point():
            floating = param
            break
    return first, floating


def _signature(tensors: tuple, module: torch.nn.Module) -> tuple:
    """What must stay the same for a cached answer to hold: the module and each signature tensor's identity, device
    and dtype."""
    parts: list = [id(module), type(module)]
    for tensor in tensors:
        parts.append(None if tensor is None else (id(tensor), tensor.device, tensor.dtype))
    return tuple(parts)


class Placement:
    """The device and dtype of the module ``device()`` and ``dtype()`` are given, cached while its signature holds
    (module docstring)."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._device: torch.device | None = None
        self._dtype: torch.dtype | None = None

    def forget(self) -> None:
        """Drop the cached answer: the next read asks the module again."""
        self._key, self._refs, self._device, self._dtype = None, (), None, None

    def _check(self, module: torch.nn.Module) -> None:
        """Forget the cached answer unless ``module``'s signature is the one it was read under."""
        tensors = _signature_tensors(module)
        key = _signature(tensors, module)
        # ids alone could be reused by a new object at a freed address: the weak references must also still be alive
        # (then the ids are the same objects').
        if key == self._key and all(ref() is not None for ref in self._refs):
            return
        self.forget()
        self._key = key
        self._refs = tuple(weakref.ref(t) for t in (*tensors, module) if t is not None)

    def device(self, module: torch.nn.Module) -> torch.device:
        """``module.device`` (diffusers' answer), walked only when the signature changed."""
        if not ENABLED:
            return module.device
        self._check(module)
        if self._device is None:
            self._device = module.device
        return self._device

    def dtype(self, module: torch.nn.Module) -> torch.dtype:
        """``module.dtype`` (diffusers' answer), walked only when the signature changed."""
        if not ENABLED:
            return module.dtype
        self._check(module)
        if self._dtype is None:
            self._dtype = module.dtype
        return self._dtype
