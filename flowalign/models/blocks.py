"""The blocks of a diffusers transformer: the units FSDP2 shards and activation checkpointing recomputes."""

from __future__ import annotations

import torch

__all__ = ["transformer_blocks"]


def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks: the members of every ``nn.ModuleList`` among its direct children (diffusers keeps
    them there: ``transformer_blocks`` and ``single_transformer_blocks`` in SD3 and FLUX, ``layers``, ``blocks``,
    the refiners of Lumina2 and Z-Image, ...); a module that holds several transformers (Wan2.2's expert pair)
    names its own units (``sharding_blocks()``)."""
    if callable(getattr(transformer, "sharding_blocks", None)):
        return transformer.sharding_blocks()
    return [block for child in transformer.children() if isinstance(child, torch.nn.ModuleList) for block in child
            if any(True for _ in block.parameters())]
