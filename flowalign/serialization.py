"""Reading ``.pt`` files without running code from them (checkpoints, register heads, optimizer states).

A pickle may call any function while it loads, so a file from elsewhere could run code; ``safe_load`` uses torch's
restricted unpickler (``weights_only=True``), which builds only tensors, numbers, strings and containers, and refuses
anything else with an error naming the file.

``read_sharded`` reads a sharded checkpoint's tensors (``torch.distributed.checkpoint``, as the FSDP2 engine writes
them) whole in one process, without a process group.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

__all__ = ["read_sharded", "safe_load"]


def safe_load(path: str | Path, what: str, *, allow: list | tuple = ()) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU: tensors, numbers, strings and containers only (plus the
    types in ``allow``). A file that needs anything else (a pickle that would call a function, build an object or run
    code) is refused with a ValueError naming the file and ``what`` it should have been; nothing in it runs."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message goes on to suggest allow-listing what the file asked for: not advice for an untrusted file
        reason = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()[0].split(" Please use")[0]
        raise ValueError(
            f"refusing to load {str(path)!r}: it does not hold only tensors and plain values, as {what} does "
            f"({reason.rstrip('.')}). Loading it as a full pickle could run code from the file; if it came from "
            "elsewhere, do not use it, and if you wrote it with another tool, save it again with torch.save of plain "
            "tensors and containers"
        ) from None


def read_sharded(directory: str | Path, part: str) -> dict[str, torch.Tensor]:
    """One part (``trainable`` or ``ema``) of a sharded checkpoint's ``sharded/`` folder as whole CPU tensors, read
    in this one process without a process group (``torch.distributed.checkpoint`` with ``no_dist``): the tensors'
    full shapes come from the folder's metadata, whatever the process count that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(directory))
    prefix = f"{part}."
    shapes = {key[len(prefix):]: meta for key, meta in reader.read_metadata().state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not shapes:
        raise ValueError(f"{directory} holds no {part!r} tensors")
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in shapes.items()}
    dcp.load({part: tensors}, storage_reader=reader, no_dist=True)
    return tensors
