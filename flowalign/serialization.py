"""Reading checkpoint files without running code from them, and with an error naming the file when one is damaged.

A pickle may call any function while it loads, so a file from elsewhere could run code. The rules:

* ``.pt`` files (optimizer states, RNG states, register heads): ``safe_load``, torch's restricted unpickler
  (``weights_only=True``), which builds only tensors, numbers, strings and containers;
* a sharded checkpoint (``torch.distributed.checkpoint``, as the FSDP2 engine writes it): ``flowalign.sharded_reading``
  (``read_sharded``), whose reader and planner replace torch's (torch's own unpickle ``.metadata`` and the
  non-tensor items with no restriction);
* safetensors (``read_safetensors``) and JSON (``read_json``) hold no code; a truncated or corrupt one is named.

Whatever is refused, or cannot be read, raises ``CheckpointFileError`` (a ``ValueError``, so the command line reports
it in one line with exit status 2) naming the file; nothing in a refused file runs.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import torch

from flowalign.deprecation import moved_names

__all__ = ["CheckpointFileError", "read_json", "read_safetensors", "safe_load"]


class CheckpointFileError(ValueError):
    """A checkpoint file that is refused (it could run code) or cannot be read (truncated, corrupt); names the file."""


SAVE_AGAIN = "if you wrote it with another tool, save it again with plain tensors and containers"


def untrusted(path, what: str, reason: str, holds: str = "tensors and plain values",
              fix: str = SAVE_AGAIN) -> CheckpointFileError:
    """The refusal of a file that asks for more than ``what`` ever holds (nothing in it ran); ``fix`` ends it."""
    return CheckpointFileError(
        f"refusing to load {str(path)!r}: it does not hold only {holds}, as {what} does ({reason}). Loading it as a "
        f"full pickle could run code from the file: do not trust it; if it came from elsewhere, do not use it, and {fix}")


def damaged(path, what: str, error: BaseException) -> CheckpointFileError:
    """The error for a file that cannot be read as ``what`` (truncated, corrupt)."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return CheckpointFileError(
        f"cannot read {str(path)!r} ({what}): the file is truncated or corrupt ({reason.rstrip('.')}); resume or load "
        "another checkpoint (an earlier checkpoint-*), or copy this one again")


def weights_only_reason(error: BaseException) -> str | None:
    """What torch's restricted unpickler refused, or None when the error is not a refusal (a damaged pickle)."""
    text = str(error)
    if "Weights only load failed" not in text and "WeightsUnpickler error" not in text:
        return None
    # torch's message goes on to suggest allow-listing what the file asked for: not advice for an untrusted file
    return text.split("WeightsUnpickler error:")[-1].strip().splitlines()[0].split(" Please use")[0].rstrip(".")


def safe_load(path: str | Path, what: str, *, allow: list | tuple = ()) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU: tensors, numbers, strings and containers only (plus the
    types in ``allow``). A file that needs anything else (a pickle that would call a function, build an object or run
    code) is refused with a ``CheckpointFileError`` naming the file and ``what`` it should have been; nothing in it
    runs. A truncated or corrupt file is a ``CheckpointFileError`` naming it too."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = weights_only_reason(error)
        if reason is None:
            raise damaged(path, what, error) from None
        raise untrusted(path, what, reason) from None
    except (RuntimeError, EOFError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise damaged(path, what, error) from None


def read_safetensors(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file(path)`` (safetensors holds no code); a truncated or corrupt file is a
    ``CheckpointFileError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as error:
        raise damaged(path, what, error) from None


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file (``state.json``); a truncated or corrupt one is a ``CheckpointFileError`` naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise damaged(path, what, error) from None


# read_sharded moved to flowalign.sharded_reading (the sharded checkpoints' reader): one release with a warning.
__getattr__ = moved_names(__name__, {"read_sharded": "flowalign.sharded_reading:read_sharded"})
