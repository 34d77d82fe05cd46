"""Wan2.2 A14B's two experts as one module: what trains, shards and saves when a run trains either or both.

Wan2.2 A14B denoises with two transformers of one architecture: ``transformer`` (the high-noise expert) at the
scheduler's timesteps ``t >= boundary_ratio * num_train_timesteps`` and ``transformer_2`` (the low-noise expert)
below (``WanPipeline.__call__``). ``ExpertPair`` holds both as its children ``high`` and ``low`` (the pipeline's own
modules, not copies), so everything that walks "the transformer" sees both: LoRA (on the experts ``lora_experts``
names), ``trainable_parameters``, the distributed wrappers, checkpoints, a full fine-tune's reference copy. Its
``forward(..., expert=...)`` runs the named expert; without ``expert`` it picks each row's expert from its timestep as
the pipeline does. FSDP2 shards it per block of each expert, then each expert, then the pair (``sharding_blocks``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

EXPERTS = ("high", "low")
# The pipeline's component of each expert.
EXPERT_COMPONENTS = {"high": "transformer", "low": "transformer_2"}


def check_expert_names(experts: Sequence[str], key: str = "model.lora_experts") -> tuple[str, ...]:
    """``experts`` as a tuple, or a ValueError naming ``key`` for an empty list, a duplicate or an unknown name.

    Args:
        experts: expert names (``high``: ``transformer``, the high-noise expert; ``low``: ``transformer_2``).
        key: the config key (or argument) they come from, for the message.

    Returns:
        The names in the given order.
    """
    if isinstance(experts, str) or not isinstance(experts, Sequence) or not experts:
        raise ValueError(f"{key} = {experts!r}: list the experts a LoRA trains, from {list(EXPERTS)} (high: "
                         "transformer, the high-noise expert; low: transformer_2), or null for both")
    unknown = [name for name in experts if name not in EXPERTS]
    if unknown:
        raise ValueError(f"{key} names {unknown}, not an expert: Wan2.2's experts are 'high' (transformer, the "
                         "high-noise expert) and 'low' (transformer_2, the low-noise one); use a list of those")
    if len(set(experts)) != len(experts):
        raise ValueError(f"{key} = {list(experts)} names an expert twice: list each once")
    return tuple(experts)


class ExpertPair(torch.nn.Module):
    """The high- and low-noise experts as one module (module docstring).

    Args:
        high: the high-noise expert (the pipeline's ``transformer``).
        low: the low-noise expert (``transformer_2``).
        boundary_timestep: ``boundary_ratio * num_train_timesteps``: timesteps at or above it go to ``high``.
    """

    def __init__(self, high: torch.nn.Module, low: torch.nn.Module, boundary_timestep: float):
        super().__init__()
        self.high = high
        self.low = low
        self.boundary_timestep = float(boundary_timestep)
        self.lora_experts: tuple[str, ...] = ()  # the experts that have a LoRA adapter
        self.adapter_experts: tuple[str, ...] = EXPERTS  # the experts add_adapter puts one on (the adapter sets it)
        # Under a data-parallel wrapper that needs every trainable parameter in every backward (DDP), a pass through
        # one expert adds zero times the other's trainable parameters (set by the adapter).
        self.touch_other = False

    # --- what the adapters read of "the transformer" ----------------------------------------------------------------
    @property
    def config(self):
        """The high-noise expert's config (both experts share the architecture)."""
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        return self.high.dtype

    @property
    def device(self) -> torch.device:
        return self.high.device

    def expert(self, name: str) -> torch.nn.Module:
        """The expert called ``name`` (``high`` or ``low``)."""
        return getattr(self, check_expert_names([name], "expert")[0])

    def is_high(self, timestep: Tensor) -> Tensor:
        """Per row, whether the high-noise expert runs at ``timestep`` (``[B]``): ``t >= boundary``, the pipeline's
        test."""
        return timestep >= self.boundary_timestep

    def sharding_blocks(self) -> list[torch.nn.Module]:
        """FSDP2's units below the pair: every block of each expert, then each expert (its embeddings and head)."""
        blocks = [block for expert in (self.high, self.low) for child in expert.children()
                  if isinstance(child, torch.nn.ModuleList) for block in child if any(True for _ in block.parameters())]
        return [*blocks, self.high, self.low]

    # --- LoRA over the experts ----------------------------------------------------------------------------------
    def add_adapter(self, config, adapter_name: str = "default", experts: Sequence[str] | None = None) -> None:
        """A peft LoRA ``config`` on each expert of ``experts`` (None: ``adapter_experts``)."""
        experts = check_expert_names(self.adapter_experts if experts is None else experts, "experts")
        for name in experts:
            self.expert(name).add_adapter(config, adapter_name=adapter_name)
        self.lora_experts = tuple(name for name in EXPERTS if name in set(self.lora_experts) | set(experts))

    def _lora_modules(self) -> list[torch.nn.Module]:
        return [self.expert(name) for name in self.lora_experts]

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return any(getattr(module, "_hf_peft_config_loaded", False) for module in (self.high, self.low))

    @property
    def peft_config(self) -> dict:
        """The LoRA config of the first expert with one (the same on every expert it is on)."""
        return self._lora_modules()[0].peft_config

    def disable_adapters(self) -> None:
        for module in self._lora_modules():
            module.disable_adapters()

    def enable_adapters(self) -> None:
        for module in self._lora_modules():
            module.enable_adapters()

    def fuse_lora(self, *args, **kwargs) -> None:
        """Fold each expert's LoRA into its weights (``W += (alpha / r) B A``)."""
        for module in self._lora_modules():
            module.fuse_lora(*args, **kwargs)

    def unload_lora(self) -> None:
        for module in self._lora_modules():
            module.unload_lora()
        self.lora_experts = ()

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    # --- the forward pass ---------------------------------------------------------------------------------------
    def forward(self, *, expert: str | None = None, timestep: Tensor, **inputs):
        """The named ``expert``'s forward pass; without one, each row's expert from its ``timestep`` (rows on either
        side run as two batches and are put back in order). Returns what the experts return (``return_dict=False``:
        a tuple whose first entry is the output)."""
        if expert is not None:
            out = self.expert(expert)(timestep=timestep, **inputs)
            return self._touched(out, expert)
        rows = self.is_high(timestep if timestep.ndim == 1 else timestep[:, 0])
        if rows.all() or not rows.any():
            return self.forward(expert="high" if rows.all() else "low", timestep=timestep, **inputs)
        batch = timestep.shape[0]
        parts = {}
        for name, mask in (("high", rows), ("low", ~rows)):
            sub = {k: v[mask] if isinstance(v, Tensor) and v.ndim and v.shape[0] == batch else v
                   for k, v in inputs.items()}
            parts[name] = self.expert(name)(timestep=timestep[mask], **sub)[0]
        out = parts["high"].new_empty((batch, *parts["high"].shape[1:]))
        out = out.index_put((rows.nonzero().squeeze(1),), parts["high"])
        out = out.index_put(((~rows).nonzero().squeeze(1),), parts["low"])
        return (out,)

    def _touched(self, out, expert: str):
        """``out`` plus zero times the other expert's trainable parameters when gradients are recorded and either
        ``touch_other`` is set (a data-parallel wrapper wants a gradient, zero, for every trainable parameter) or
        ``expert`` trains nothing (a LoRA on the other expert only: the loss of a step on this side still has a
        gradient, zero, instead of none)."""
        if not torch.is_grad_enabled():
            return out
        if not self.touch_other and any(p.requires_grad for p in self.expert(expert).parameters()):
            return out
        trainable = [p for p in self.expert("low" if expert == "high" else "high").parameters() if p.requires_grad]
        if not trainable:
            return out
        zero = sum(p.sum() for p in trainable) * 0.0
        return (out[0] + zero.to(out[0].dtype), *out[1:])
