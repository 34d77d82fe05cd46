"""Atomic, resumable training checkpoints.

A checkpoint is a directory ``checkpoint-<iteration>`` holding everything a run needs to continue exactly:

* ``lora/pytorch_lora_weights.safetensors``: the adapter in diffusers' format (``pipe.load_lora_weights`` reads it);
  or, for a full fine-tune, ``transformer/``: the trained transformer in diffusers' format
  (``<TransformerClass>.from_pretrained`` reads it);
* ``trainable.safetensors``: the trainable tensors by parameter name (what resuming loads; exact, any format);
* ``ema.safetensors``: the EMA of the trainable weights, when EMA is on;
* ``copies.safetensors``: the policy copies the run's components keep (``flowalign.training.copies``), when any;
* ``optimizer.pt``: the optimizer state;
* ``rng-<rank>.pt``: the python, numpy and torch (CPU and CUDA) RNG states of each process (numpy's as plain
  numbers and a tensor, so the file holds no numpy object);
* ``state.json``: the iteration, the metrics history, and anything else the trainer keeps (the components' state:
  its JSON values under ``components``);
* ``components.safetensors``: the tensors of the components' state (``<section>/<key>``: an adaptive reference's
  snapshot), when a component keeps any;
* ``config.yaml``: the resolved config it was made with.

A sharded run (``distributed.engine: fsdp2``) writes ``sharded/`` (``torch.distributed.checkpoint``: every process
its shards of the trainable weights, the EMA, the policy copies and the optimizer state) instead of
``trainable.safetensors``, ``ema.safetensors``, ``copies.safetensors`` and ``optimizer.pt``; the rest is the same
(``flowalign.training.engine``).

It is written to a temporary sibling directory and renamed into place, so an interrupted save never leaves a partial
checkpoint behind: the newest complete ``checkpoint-*`` is always whole.

The ``.pt`` files are read with ``torch.load(weights_only=True)`` (``safe_load``): a pickle may call any function while
it loads, so a checkpoint from elsewhere could run code; the restricted unpickler builds only tensors, numbers,
strings and containers, and refuses anything else with an error naming the file. ``sharded/`` is read through
``flowalign.sharded_reading`` under the same rule. Every file is read through ``flowalign.serialization``, so a
truncated or corrupt one (a safetensors, ``optimizer.pt``, ``.distcp`` file or ``state.json``) is an error naming it.

A checkpoint of a run with EMA (``optim.ema_decay > 0``) must hold its EMA (``holds_ema``): resuming without it would
restart the EMA silently, and ``eval``/``export`` would then read that restart as the run's EMA. The resume refuses it
unless the config says ``train.restart_ema`` (``flowalign.training.run_directory``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from flowalign.serialization import read_json, read_safetensors, safe_load

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
EMA_FILE = "ema.safetensors"


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types ``torch.load(weights_only=True)`` accepts (numpy's MT19937 key as an int64
    tensor instead of an ndarray); ``set_rng_state`` restores them exactly."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)  # a tuple holding an ndarray: checkpoints written before the format above
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list:
    """What unpickling a numpy uint32 array needs (RNG files written before numpy's state was stored as a tensor)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def checkpoint_iteration(path: Path) -> int:
    match = CHECKPOINT_PATTERN.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like checkpoint-000010)")
    return int(match.group(1))


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary directories are ignored)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and CHECKPOINT_PATTERN.match(p.name)]
    return sorted(found, key=checkpoint_iteration)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: str | Path,
    iteration: int,
    *,
    trainable: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    config_yaml: str,
    ema: dict[str, torch.Tensor] | None = None,
    write_model=None,
    keep: int | None = None,
    copies: dict[str, torch.Tensor] | None = None,
    component_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``run_dir/checkpoint-<iteration>`` atomically and keep only the newest ``keep`` checkpoints.

    ``write_model(directory)`` writes the trained weights in diffusers' format into the checkpoint directory
    (``FlowModel.save_trained``: ``lora/`` or ``transformer/``). Call on the main process
    only; other processes save their RNG state with ``save_process_rng``.
    """
    final, tmp = checkpoint_paths(run_dir, iteration)
    begin_checkpoint(tmp)
    save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
    if ema is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in ema.items()}, str(tmp / "ema.safetensors"))
    if copies:
        save_file({k: v.detach().cpu().contiguous() for k, v in copies.items()}, str(tmp / "copies.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng-0.pt")
    write_run_files(tmp, iteration, state, config_yaml, component_tensors)
    if write_model is not None:
        write_model(tmp)
    return finish_checkpoint(tmp, final, keep)


def checkpoint_paths(run_dir: str | Path, iteration: int) -> tuple[Path, Path]:
    """``(final, temporary)`` directories of the checkpoint of ``iteration`` in ``run_dir``."""
    run_dir = Path(run_dir)
    return run_dir / f"checkpoint-{iteration:06d}", run_dir / f".tmp-checkpoint-{iteration:06d}"


def begin_checkpoint(tmp: Path) -> None:
    """An empty temporary directory to write a checkpoint into (main process)."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()


def write_run_files(tmp: Path, iteration: int, state: dict[str, Any], config_yaml: str,
                    component_tensors: dict[str, torch.Tensor] | None = None) -> None:
    (tmp / "state.json").write_text(json.dumps({"iteration": iteration, **state}, indent=1))
    (tmp / "config.yaml").write_text(config_yaml)
    if component_tensors:
        save_file({k: v.detach().cpu().contiguous() for k, v in component_tensors.items()},
                  str(tmp / "components.safetensors"))


def load_component_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's ``components.safetensors`` (empty when it has none)."""
    path = Path(checkpoint) / "components.safetensors"
    return read_safetensors(path, "the components' tensors of a checkpoint") if path.is_file() else {}


def finish_checkpoint(tmp: Path, final: Path, keep: int | None) -> Path:
    """Flush ``tmp``, rename it to ``final`` (replacing an earlier save of the same iteration whole) and keep only
    the newest ``keep`` checkpoints: the newest complete checkpoint is always whole."""
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same iteration (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep is not None:
        for old in list_checkpoints(final.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_process_rng(checkpoint: Path, rank: int) -> None:
    """Non-main processes add their RNG state to a checkpoint the main process wrote."""
    torch.save(rng_state(), Path(checkpoint) / f"rng-{rank}.pt")


def read_run_state(checkpoint: str | Path, *, require: tuple[str, ...] = ()) -> dict[str, Any]:
    """A checkpoint's ``state.json``, checked: a mapping with an integer ``iteration``, a list ``history`` when it has
    one, and every key of ``require``; otherwise a ``ValueError`` naming the file."""
    path = Path(checkpoint) / "state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no state.json)")
    state = read_json(path, "a checkpoint's run state")
    if (not isinstance(state, dict) or isinstance(state.get("iteration"), bool)
            or not isinstance(state.get("iteration"), int) or not isinstance(state.get("history", []), list)
            or any(key not in state for key in require)):
        raise ValueError(f"{str(path)!r} is corrupt: it holds no iteration number, or no metrics history; resume "
                         "another checkpoint (an earlier checkpoint-*)")
    return state


def load_run_state(checkpoint: str | Path, rank: int = 0) -> dict[str, Any]:
    """A checkpoint's ``state.json`` (``read_run_state``), with this process's RNG restored (when the checkpoint has
    its file)."""
    checkpoint = Path(checkpoint)
    state = read_run_state(checkpoint)
    rng_file = checkpoint / f"rng-{rank}.pt"
    if rng_file.is_file():
        set_rng_state(safe_load(rng_file, "a checkpoint's RNG states", allow=_numpy_array_globals()))
    return state


def holds_ema(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` holds an EMA: its ``ema.safetensors``, or for a sharded checkpoint ``ema.*`` entries
    in ``sharded/.metadata`` (read through the allow-list of ``flowalign.sharded_reading``)."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "sharded").is_dir():
        from flowalign.sharded_reading import holds_part

        return holds_part(checkpoint / "sharded", "ema")
    return (checkpoint / EMA_FILE).is_file()


def load_checkpoint(
    checkpoint: str | Path, *, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, rank: int = 0
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Restore trainable tensors (in place), the optimizer and this process's RNG; return (state, ema or None)."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "state.json").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no state.json)")
    if (checkpoint / "sharded").is_dir():
        raise ValueError(f"{checkpoint} is a sharded checkpoint (distributed.engine: fsdp2): resume it with "
                         "distributed.engine: fsdp2")
    saved = read_safetensors(checkpoint / "trainable.safetensors", "a checkpoint's trainable weights")
    missing = sorted(set(trainable) - set(saved))
    unexpected = sorted(set(saved) - set(trainable))
    if missing or unexpected:
        raise ValueError(
            f"{checkpoint} does not match this model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, tensor in trainable.items():
            tensor.copy_(saved[name])
    optimizer.load_state_dict(safe_load(checkpoint / "optimizer.pt", "an optimizer state_dict"))
    ema_file = checkpoint / EMA_FILE
    ema = read_safetensors(ema_file, "a checkpoint's EMA weights") if ema_file.is_file() else None
    return load_run_state(checkpoint, rank), ema


def load_copies(checkpoint: str | Path) -> dict[str, torch.Tensor] | None:
    """A checkpoint's policy copies (``copies.safetensors``), or None when it holds none."""
    path = Path(checkpoint) / "copies.safetensors"
    return read_safetensors(path, "a checkpoint's policy copies") if path.is_file() else None


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename, so a crash cannot leave a renamed but empty checkpoint."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
