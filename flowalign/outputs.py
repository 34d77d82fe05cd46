"""Where a command writes its outputs: whole files, new paths, and folders that never mix two runs.

The rules, for every command:

* **Whole files.** A file is written to a temporary sibling (``.tmp-NAME-PID``) and renamed into place
  (``os.replace``): a reader, or a crash, sees the old state or the new file whole, never a part
  (``write_atomically``).
* **New file outputs.** A command whose output is a fixed file (``fit-manifold``, ``train-discriminator``: a
  ``.safetensors`` with its ``.json`` sidecar) refuses a path that exists, as ``flowalign export`` refuses a used
  folder: nothing in it is overwritten, and the message suggests a free path (``check_new_files``).
* **Output folders never mix two runs.** A folder holding an earlier run's outputs (a file whose name the command
  writes: ``OutputFolder.patterns``) is refused, naming the three ways out: write elsewhere with ``--out DIR``,
  replace that run's outputs with ``--overwrite`` (deletes the files named by the patterns, and nothing else), or
  move the folder away yourself. Other files in the folder are never touched (``OutputFolder``).
* **Writable, checked first.** An output path that is a file, lies under a file, or cannot be written is refused
  before any model loads (``check_writable_dir``).
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from flowalign.errors import SetupError

__all__ = ["OutputFolder", "check_new_files", "check_writable_dir", "free_path", "write_atomically"]


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def write_atomically(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it is flushed and renamed onto ``path``, on a
    failure it is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def free_path(path: str | os.PathLike) -> Path:
    """The first of ``NAME-2.EXT``, ``NAME-3.EXT``, ... next to ``path`` that does not exist."""
    path = Path(path)
    suffix = "".join(path.suffixes[-1:])
    stem = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    return next(candidate for n in range(2, 100_000)
                if not (candidate := path.with_name(f"{stem}-{n}{suffix}")).exists())


def check_new_files(path: str | os.PathLike, *, also: Sequence[Path] = (), key: str = "--out") -> Path:
    """``path`` when neither it nor its companions ``also`` (a sidecar) exist; otherwise a SetupError in
    ``flowalign export``'s words: nothing is overwritten, choose a new path (one is suggested)."""
    path = Path(path).expanduser()
    taken = [p for p in (path, *also) if p.exists() or p.is_symlink()]
    if taken:
        names = " and ".join(repr(str(p)) for p in taken)
        raise SetupError(f"{key} {str(path)!r}: {names} already exist{'s' if len(taken) == 1 else ''}: nothing is "
                         f"overwritten; choose a new path, e.g. {key} {free_path(path)}")
    check_writable_dir(path.parent, key=key)
    return path


def check_writable_dir(directory: str | os.PathLike, *, key: str) -> Path:
    """``directory`` when it is (or can be made) a writable directory: refused, naming ``key``, when it is a file,
    lies under a file, or its nearest existing folder takes no new file (probed by creating and removing one, so the
    answer holds for root and for read-only file systems too). Creates nothing that stays."""
    directory = Path(directory).expanduser()
    if directory.exists() and not directory.is_dir():
        raise SetupError(f"{key} = {str(directory)!r} is a file, not a folder: choose another path")
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise SetupError(f"{key} = {str(directory)!r} lies under the file {str(existing)!r}: choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SetupError(f"{key} = {str(directory)!r}: {str(existing)!r} is not writable: choose another path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".flowalign-probe-", dir=existing)
    except OSError as error:
        raise SetupError(f"{key} = {str(directory)!r}: cannot write into {str(existing)!r} "
                         f"({error.strerror or error}): choose another path") from None
    os.close(fd)
    os.unlink(probe)
    return directory


@dataclass(frozen=True)
class OutputFolder:
    """A command's output folder (``--out``) and the files it writes there, as glob ``patterns`` relative to it."""

    path: Path
    patterns: tuple[str, ...]
    command: str
    flag: str = "--out"

    def earlier_outputs(self) -> list[Path]:
        """The files of an earlier run in the folder (those the patterns name), sorted."""
        if not self.path.is_dir():
            return []
        return sorted({p for pattern in self.patterns for p in self.path.glob(pattern) if p.is_file()})

    def check(self, *, overwrite: bool) -> bool:
        """Before any model loads: refuse a folder holding an earlier run's outputs unless ``overwrite``; True
        when there are outputs to replace (``replace_earlier`` deletes them just before the first write)."""
        check_writable_dir(self.path, key=self.flag)
        found = self.earlier_outputs()
        if not found:
            return False
        if overwrite:
            return True
        shown = ", ".join(str(p.relative_to(self.path)) for p in found[:3]) + (", ..." if len(found) > 3 else "")
        raise SetupError(
            f"{self.flag} {str(self.path)!r} already holds the outputs of an earlier {self.command} ({shown}): a new "
            f"run would mix its files with those. Either write elsewhere with {self.flag} {free_path(self.path)}, "
            "replace them with --overwrite (deletes that run's outputs, and only those), or move the folder away yourself")

    def replace_earlier(self) -> None:
        """Delete the earlier run's outputs (the files the patterns name) and the folders this leaves empty."""
        parents = set()
        for path in self.earlier_outputs():
            path.unlink()
            parents.update(p for p in path.parents if self.path in p.parents)
        for folder in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
