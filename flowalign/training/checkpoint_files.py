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
* ``state.json``: the iteration, the metrics history, the number of processes that wrote the checkpoint
  (``processes``), and anything else the trainer keeps (the components' state: its JSON values under
  ``components``);
* ``components.safetensors``: the tensors of the components' state (``<section>/<key>``: an adaptive reference's
  snapshot), when a component keeps any;
* ``config.yaml``: the resolved config it was made with.

A sharded run (``distributed.engine: fsdp2``) writes ``sharded/`` (``torch.distributed.checkpoint``: every process
its shards of the trainable weights, the EMA, the policy copies and the optimizer state) instead of
``trainable.safetensors``, ``ema.safetensors``, ``copies.safetensors`` and ``optimizer.pt``; the rest is the same
(``flowalign.training.parallel_engines``).

Every process writes its files into a temporary sibling directory ``.tmp-checkpoint-<iteration>``; once they all
agree that every write succeeded, the main process renames it into place (exchanging it atomically with an earlier
save of the same iteration) and deletes old checkpoints through a ``.trash-`` name, so a save killed at any instant
never leaves a partial checkpoint under a normal name: the newest ``checkpoint-*`` is always whole
(``finish_checkpoint``; docs/concepts/reliability.md). ``state.json`` records the number of processes, and a resume at
that number needs every ``rng-<rank>.pt`` (``restore_process_rng``).

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

import errno
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from flowalign.seeding import Purpose, mixed_seed
from flowalign.serialization import read_json, read_safetensors, safe_load
from flowalign.training.kill_points import kill_point

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TEMPORARY_PREFIX = ".tmp-"  # a checkpoint being written
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted (replaced or pruned)
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
    """The newest whole checkpoint of a run (``missing_files``), or None; a newer one that is not whole (written by
    a version before the save protocol of ``finish_checkpoint``, or damaged since) is skipped with a warning."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        missing = missing_files(checkpoint)
        if not missing:
            return checkpoint
        logger.warning("skipping %s: it is not a whole checkpoint (no %s)", checkpoint, ", ".join(missing))
    return None


def missing_files(checkpoint: Path) -> list[str]:
    """The files every whole checkpoint has that ``checkpoint`` lacks: ``state.json``, ``config.yaml``, the weights
    (``trainable.safetensors`` and ``optimizer.pt``, or ``sharded/.metadata``) and the ``rng-<rank>.pt`` of each
    process ``state.json`` records (a ``state.json`` that does not parse is the loader's to report)."""
    needed = ["state.json", "config.yaml"]
    needed += ["sharded/.metadata"] if (checkpoint / "sharded").is_dir() else ["trainable.safetensors", "optimizer.pt"]
    try:
        processes = int(json.loads((checkpoint / "state.json").read_text()).get("processes", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        processes = 1
    needed += [f"rng-{rank}.pt" for rank in range(processes)]
    return [name for name in needed if not (checkpoint / name).is_file()]


def save_checkpoint(run_dir: str | Path, iteration: int, *, keep: int | None = None, **files: Any) -> Path:
    """Write ``run_dir/checkpoint-<iteration>`` of a single process atomically and keep only the newest ``keep``
    checkpoints (``begin_checkpoint``, ``write_checkpoint_files`` with ``files``, its keyword arguments, then
    ``finish_checkpoint``; a run of several processes goes through ``flowalign.training.checkpointer``, which adds
    their RNG files before the rename).

    ``write_model(directory)`` writes the trained weights in diffusers' format into the checkpoint directory
    (``FlowModel.save_trained``: ``lora/`` or ``transformer/``).
    """
    final, tmp = checkpoint_paths(run_dir, iteration)
    begin_checkpoint(tmp)
    write_checkpoint_files(tmp, iteration, **files)
    return finish_checkpoint(tmp, final, keep)


def write_checkpoint_files(
    tmp: Path,
    iteration: int,
    *,
    trainable: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    config_yaml: str,
    ema: dict[str, torch.Tensor] | None = None,
    write_model=None,
    copies: dict[str, torch.Tensor] | None = None,
    component_tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """The main process's files of a whole (``ddp``) checkpoint, written into its temporary directory ``tmp``."""
    save_file({k: v.detach().cpu().contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
    kill_point("trainable", iteration)
    if ema is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in ema.items()}, str(tmp / "ema.safetensors"))
        kill_point("ema", iteration)
    if copies:
        save_file({k: v.detach().cpu().contiguous() for k, v in copies.items()}, str(tmp / "copies.safetensors"))
        kill_point("copies", iteration)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    kill_point("optimizer", iteration)
    save_process_rng(tmp, 0, iteration)
    write_run_files(tmp, iteration, state, config_yaml, component_tensors)
    if write_model is not None:
        write_model(tmp)
        kill_point("model", iteration)


def checkpoint_paths(run_dir: str | Path, iteration: int) -> tuple[Path, Path]:
    """``(final, temporary)`` directories of the checkpoint of ``iteration`` in ``run_dir``."""
    run_dir = Path(run_dir)
    return run_dir / f"checkpoint-{iteration:06d}", run_dir / f"{TEMPORARY_PREFIX}checkpoint-{iteration:06d}"


def begin_checkpoint(tmp: Path) -> None:
    """An empty temporary directory to write a checkpoint into (main process)."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    kill_point("begin", checkpoint_iteration(tmp.name.removeprefix(TEMPORARY_PREFIX)))


def write_run_files(tmp: Path, iteration: int, state: dict[str, Any], config_yaml: str,
                    component_tensors: dict[str, torch.Tensor] | None = None) -> None:
    (tmp / "state.json").write_text(json.dumps({"iteration": iteration, **state}, indent=1))
    kill_point("state", iteration)
    (tmp / "config.yaml").write_text(config_yaml)
    kill_point("config", iteration)
    if component_tensors:
        save_file({k: v.detach().cpu().contiguous() for k, v in component_tensors.items()},
                  str(tmp / "components.safetensors"))
        kill_point("components", iteration)


def load_component_tensors(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's ``components.safetensors`` (empty when it has none)."""
    path = Path(checkpoint) / "components.safetensors"
    return read_safetensors(path, "the components' tensors of a checkpoint") if path.is_file() else {}


def finish_checkpoint(tmp: Path, final: Path, keep: int | None) -> Path:
    """Flush ``tmp`` (whole: every process has written its files into it), rename it to ``final`` and keep only the
    newest ``keep`` checkpoints (main process). The newest complete checkpoint is always whole:

    * re-saving an iteration exchanges the new directory with the old one in one atomic rename
      (``renameat2(RENAME_EXCHANGE)``), so ``final`` never stops naming a whole checkpoint, then deletes the old one
      under ``.trash-checkpoint-N``;
    * a checkpoint beyond ``keep`` is first renamed to ``.trash-checkpoint-N`` and only then deleted, so a kill
      during the deletion leaves no partial checkpoint under a normal name (``list_checkpoints`` ignores the rest,
      and the next save deletes it).
    """
    iteration = checkpoint_iteration(final)
    _fsync_tree(tmp)
    kill_point("flushed", iteration)
    if final.exists():  # re-saving the same iteration (e.g. trainer.save() after train()): swap it in whole
        _exchange(tmp, final)
        kill_point("renamed", iteration)
        _delete(tmp, final.parent)
        kill_point("replaced", iteration)
    else:
        os.replace(tmp, final)
        _fsync_directory(final.parent)
        kill_point("renamed", iteration)
    if keep is not None:
        for old in list_checkpoints(final.parent)[:-keep]:
            trash = final.parent / (TRASH_PREFIX + old.name)
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(old, trash)
            _fsync_directory(final.parent)
            kill_point("prune-set-aside", iteration)
        for trash in final.parent.glob(TRASH_PREFIX + "checkpoint-*"):  # also what an earlier kill left
            shutil.rmtree(trash, ignore_errors=True)
        kill_point("pruned", iteration)
    return final


def _delete(directory: Path, run_dir: Path) -> None:
    """Rename ``directory`` to its trash name, then delete it."""
    trash = run_dir / (TRASH_PREFIX + directory.name.removeprefix(TEMPORARY_PREFIX))
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(directory, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _exchange(a: Path, b: Path) -> None:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); where the
    system or the file system cannot, by three renames through the trash name (a window of two renames)."""
    if not _rename_exchange(a, b):
        trash = b.parent / (TRASH_PREFIX + b.name)
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(b, trash)
        os.replace(a, b)
        os.replace(trash, a)
    _fsync_directory(b.parent)


def _rename_exchange(a: Path, b: Path) -> bool:
    """True when ``renameat2(RENAME_EXCHANGE)`` swapped ``a`` and ``b``; False when this system cannot."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):  # no renameat2 in this C library (not Linux, or glibc < 2.28)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # a kernel or file system without it
        return False
    raise OSError(code, os.strerror(code), str(b))


def save_process_rng(checkpoint: Path, rank: int, iteration: int | None = None) -> None:
    """This process's RNG states as ``rng-<rank>.pt`` in a checkpoint's temporary directory (every process)."""
    torch.save(rng_state(), Path(checkpoint) / f"rng-{rank}.pt")
    if iteration is not None:
        kill_point("rng", iteration, rank)


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


def load_run_state(checkpoint: str | Path, rank: int = 0, *, processes: int = 1, seed: int = 0) -> dict[str, Any]:
    """A checkpoint's ``state.json`` (``read_run_state``), with this process's RNG restored (``restore_process_rng``)."""
    checkpoint = Path(checkpoint)
    state = read_run_state(checkpoint)
    restore_process_rng(checkpoint, state, rank=rank, processes=processes, seed=seed)
    return state


def saved_processes(checkpoint: Path, state: dict[str, Any]) -> int:
    """How many processes wrote ``checkpoint``: ``state.json``'s ``processes``; for a checkpoint written before it
    was recorded, its consecutive ``rng-0.pt``, ``rng-1.pt``, ... files."""
    if "processes" in state:
        return int(state["processes"])
    count = 0
    while (checkpoint / f"rng-{count}.pt").is_file():
        count += 1
    return count


def rng_rekeying(checkpoint: Path, saved: int, processes: int) -> str:
    """The one line a resume at another process count logs: what happens to the RNG streams."""
    return (f"{checkpoint.name} was saved by {saved} process(es) and resumes on {processes}: every draw of the run "
            "(prompts, noise, windows, shuffles) is keyed by (train.seed, iteration, sample, purpose) "
            "(flowalign.seeding) and continues unchanged; the process-global python/numpy/torch RNGs, which no "
            "flowalign draw reads, are not restored from rng-<rank>.pt but re-seeded per process from "
            "(train.seed, iteration, rank)")


def restore_process_rng(checkpoint: Path, state: dict[str, Any], *, rank: int, processes: int, seed: int) -> None:
    """Restore this process's python, numpy and torch RNG states for a resume on ``processes`` processes.

    At the process count the checkpoint was saved with, from ``rng-<rank>.pt``, which must be there (a checkpoint
    without it is refused, naming the file). At another count the saved streams cannot continue one per process:
    every process re-seeds them from ``mixed_seed(seed, iteration, rank, Purpose.PROCESS_RNG)`` instead
    (``rng_rekeying`` says so in one line; the run's own draws are keyed and unaffected).
    """
    saved = saved_processes(checkpoint, state)
    if saved == processes:
        rng_file = checkpoint / f"rng-{rank}.pt"
        if not rng_file.is_file():
            raise FileNotFoundError(
                f"{rng_file} is missing: {checkpoint.name} was saved by {saved} process(es) and each wrote its "
                "RNG state there, so it is not a whole checkpoint. Resume an earlier checkpoint (train.resume=DIR)")
        set_rng_state(safe_load(rng_file, "a checkpoint's RNG states", allow=_numpy_array_globals()))
        return
    key = mixed_seed(seed, int(state["iteration"]), rank, Purpose.PROCESS_RNG)
    random.seed(key)
    np.random.seed(key % 2**32)
    torch.manual_seed(key)


def holds_ema(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` holds an EMA: its ``ema.safetensors``, or for a sharded checkpoint ``ema.*`` entries
    in ``sharded/.metadata`` (read through the allow-list of ``flowalign.sharded_reading``)."""
    checkpoint = Path(checkpoint)
    if (checkpoint / "sharded").is_dir():
        from flowalign.sharded_reading import holds_part

        return holds_part(checkpoint / "sharded", "ema")
    return (checkpoint / EMA_FILE).is_file()


def load_checkpoint(
    checkpoint: str | Path, *, trainable: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, rank: int = 0,
    processes: int = 1, seed: int = 0,
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Restore trainable tensors (in place), the optimizer and this process's RNG (of a resume on ``processes``
    processes of a run seeded with ``seed``: ``restore_process_rng``); return (state, ema or None)."""
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
    return load_run_state(checkpoint, rank, processes=processes, seed=seed), ema


def load_copies(checkpoint: str | Path) -> dict[str, torch.Tensor] | None:
    """A checkpoint's policy copies (``copies.safetensors``), or None when it holds none."""
    path = Path(checkpoint) / "copies.safetensors"
    return read_safetensors(path, "a checkpoint's policy copies") if path.is_file() else None


def _fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename, so a crash cannot leave a renamed but empty checkpoint."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
