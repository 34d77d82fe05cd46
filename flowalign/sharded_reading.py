"""Reading a sharded checkpoint (``torch.distributed.checkpoint``) without running code from it.

torch's own ``FileSystemReader`` opens the folder's ``.metadata`` with plain ``pickle.load``, and its
``DefaultLoadPlanner`` loads the non-tensor items (``BYTE_IO``: the optimizer's ``param_groups``) with
``torch.load(weights_only=False)``: a crafted ``.metadata`` or ``.distcp`` file would run its payload while it loads.
The rule here: every sharded checkpoint is read through ``load_sharded``, whose

* ``SafeShardedReader`` unpickles ``.metadata`` through an allow-list of the classes a real metadata file holds
  (``METADATA_GLOBALS``, listed from the checkpoints the FSDP2 engine writes) and accepts only bare file names in its
  storage table, so no entry leads out of the folder;
* ``SafeLoadPlanner`` loads the non-tensor items with ``weights_only=True`` (the tensors already are);
* every failure, on any process, comes back as a ``CheckpointFileError`` (a ``ValueError``) that names the file: a
  refused pickle ("do not trust it"), a truncated or missing data file.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

from flowalign.serialization import CheckpointFileError, damaged, untrusted, weights_only_reason

__all__ = ["METADATA_GLOBALS", "SafeLoadPlanner", "SafeShardedReader", "holds_part", "load_sharded",
           "read_sharded_metadata", "read_sharded"]

METADATA = "the metadata of a sharded checkpoint (torch.distributed.checkpoint)"
METADATA_CLASSES = "the classes of a checkpoint's metadata"
RESUME_ANOTHER = "resume or load another checkpoint (an earlier checkpoint-*)"
DATA = "a data file of a sharded checkpoint (tensors and plain values)"

# Every global a real ``.metadata`` refers to (from the checkpoints the FSDP2 engine writes with torch 2.14: LoRA and
# full fine-tunes, EMA, policy copies, 1 and 2 processes), besides torch's dtypes (``torch.float32``): module -> names.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name (torch.strided), from torch's own table
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),  # the same classes on Python >= 3.13
}


class _Refused(pickle.UnpicklingError):
    """A global outside ``METADATA_GLOBALS``."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes of ``METADATA_GLOBALS`` and torch's dtypes; asking for anything else is refused."""

    def find_class(self, module: str, name: str):
        if name in METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"its pickle asks for {module}.{name}")


def read_sharded_metadata(path: str | Path) -> Metadata:
    """A sharded checkpoint's ``.metadata``, unpickled through the allow-list and checked: a ``Metadata`` whose storage
    table names only files of its own folder; otherwise a ``CheckpointFileError`` naming the file."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except _Refused as error:
        raise untrusted(path, METADATA, str(error), METADATA_CLASSES, RESUME_ANOTHER) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as error:
        raise damaged(path, METADATA, error) from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) or not isinstance(
            storage, dict):
        raise damaged(path, METADATA, ValueError(f"it holds a {type(metadata).__name__}, not a whole Metadata"))
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or Path(name).name != name or name in (
                "", ".", ".."):
            raise untrusted(path, METADATA, f"its storage table names {name!r}, not a file of its own folder",
                            METADATA_CLASSES, RESUME_ANOTHER)
    return metadata


def holds_part(directory: str | Path, part: str) -> bool:
    """Whether the sharded checkpoint folder ``directory`` holds ``part`` (``trainable``, ``ema``, ...): entries
    ``<part>.*`` in its ``.metadata`` (read through the allow-list)."""
    prefix = f"{part}."
    return any(key.startswith(prefix) for key in read_sharded_metadata(Path(directory) / ".metadata").state_dict_metadata)


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, with the non-tensor items (``BYTE_IO``) loaded by ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, map_location="cpu", weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeShardedReader(FileSystemReader):
    """torch's file-system reader with ``.metadata`` read by ``read_sharded_metadata`` (once: ``load_sharded`` reads it
    before torch does), and each data file's failure a ``CheckpointFileError`` naming that file."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self.directory = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # torch's fallback to rank-local metadata, which these folders never have
            raise FileNotFoundError(f"{self.directory} holds no rank-local metadata")
        if self._metadata is None:
            self._metadata = read_sharded_metadata(self.directory / ".metadata")
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            path = self.directory / name
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as error:
                reason = weights_only_reason(error)
                raise (damaged(path, DATA, error) if reason is None else
                       untrusted(path, DATA, reason, fix=RESUME_ANOTHER)) from None
            except FileNotFoundError:
                raise CheckpointFileError(f"{str(path)!r} is missing: this sharded checkpoint is incomplete; resume or "
                                          "load another checkpoint (an earlier checkpoint-*)") from None
            except (RuntimeError, EOFError, OSError, ValueError, AssertionError) as error:
                raise damaged(path, DATA, error) from None
        done: Future = Future()
        done.set_result(None)
        return done


def load_sharded(state_dict: dict, directory: str | Path, *, no_dist: bool = False) -> None:
    """``torch.distributed.checkpoint.load(state_dict)`` from ``directory`` in place, through ``SafeShardedReader`` and
    ``SafeLoadPlanner``. The metadata is checked here first (on every process, before any collective), and a failure
    that torch gathers from the processes (``CheckpointException``) is raised as the ``CheckpointFileError`` it holds."""
    import torch.distributed.checkpoint as dcp

    reader = SafeShardedReader(directory)
    reader.read_metadata()
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as failure:  # a BaseException: a plain error, naming the file when one failed
        errors = [error for error, _ in failure.failures.values()]
        for error in errors:
            if isinstance(error, CheckpointFileError):
                raise CheckpointFileError(str(error)) from None
        first = next((f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}" for e in errors), "")
        raise CheckpointFileError(f"cannot load the sharded checkpoint {str(directory)!r} into this run ({first})"
                                  ) from failure


def read_sharded(directory: str | Path, part: str) -> dict[str, torch.Tensor]:
    """One part (``trainable`` or ``ema``) of a sharded checkpoint's ``sharded/`` folder as whole CPU tensors, read
    in this one process without a process group, (nothing in the folder runs):
    the tensors' full shapes come from the folder's metadata, whatever the process count that wrote it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(directory)
    prefix = f"{part}."
    metadata = read_sharded_metadata(directory / ".metadata")
    shapes = {key[len(prefix):]: meta for key, meta in metadata.state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not shapes:
        raise CheckpointFileError(f"{str(directory / '.metadata')!r} lists no {part!r} tensors: the checkpoint "
                                  f"holds no {part} weights")
    tensors = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in shapes.items()}
    load_sharded({part: tensors}, directory, no_dist=True)
    return tensors
