"""The files a training run wrote into its directory, recorded as it writes them: what ``train.overwrite`` deletes.

A run records each file in ``run-files.jsonl`` (one JSON string a line, the path relative to the run directory)
*before* it writes the file, so a crash never leaves a written file unrecorded: ``config.yaml``, ``metrics.jsonl``,
the sample grids, the final evaluation's files and the tracker's logs (``flowalign/``: every file that appears there
while the run tracks, recorded just after the tracker writes it, since the tracker writes on its own). Its
checkpoints (``checkpoint-NNNNNN/`` and their temporary siblings) are the run's by name.
Each line is appended whole with a single write; a torn last line (a crash while appending) is ignored.

``delete()`` removes the recorded files, then the folders this leaves empty, then the record itself; nothing else.
A recorded path that is absolute or leaves the run directory (``..``) is never deleted: the record is input too. A
run written before runs recorded their files has no record: only the files whose names the run writes are deleted
(``LEGACY_FILES``), and the tracker's logs are kept (with a warning).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["LEGACY_FILES", "RECORD", "RunFiles", "TrackedFolder"]

logger = logging.getLogger(__name__)

RECORD = "run-files.jsonl"

# The files a run writes under fixed names, deleted from a run that kept no record (flowalign before the record).
LEGACY_FILES = ("config.yaml", "metrics.jsonl", "samples/iteration-[0-9][0-9][0-9][0-9][0-9][0-9].png",
                "eval/before_after.md", "eval/before_after.json", "eval/grid_before.png", "eval/grid_after.png")


class RunFiles:
    """The record of the files a run wrote into ``directory``."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / RECORD

    def record(self, *paths: str | os.PathLike) -> None:
        """Record ``paths`` (relative to the run directory) before they are written."""
        names = [Path(p).as_posix() for p in paths]
        if not names:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(name) + "\n" for name in names).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)  # one write: whole lines, or a torn last one that readers drop
            os.fsync(fd)
        finally:
            os.close(fd)

    def recorded(self) -> list[Path] | None:
        """The recorded files inside the run directory (absolute paths), or None when the run kept no record."""
        if not self.path.is_file():
            return None
        root = self.directory.resolve()
        found = []
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                name = json.loads(line)
            except ValueError:
                continue  # a torn line
            if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
                continue
            path = self.directory / name
            if root in path.resolve().parents:
                found.append(path)
        return sorted(set(found))

    def delete(self) -> None:
        """Delete the recorded files (``LEGACY_FILES`` without a record), the folders left empty, and the record."""
        files = self.recorded()
        if files is None:
            files = sorted({p for pattern in LEGACY_FILES for p in self.directory.glob(pattern)})
            if (self.directory / "flowalign").is_dir():
                logger.warning("%s: kept flowalign/ (the tracker's logs?): the replaced run kept no record of the "
                               "files it wrote there", self.directory)
        folders = set()
        for path in files:
            if path.is_file() or path.is_symlink():
                path.unlink()
                folders.update(p for p in path.parents if self.directory in p.parents)
        for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if self.path.exists():
            self.path.unlink()


class TrackedFolder:
    """A folder a tracker writes into (``<run>/flowalign``): the files that appear in it are recorded."""

    def __init__(self, files: RunFiles, folder: Path):
        self.files, self.folder = files, folder
        self.seen = self._files()

    def _files(self) -> set[Path]:
        return {p for p in self.folder.rglob("*") if p.is_file()} if self.folder.is_dir() else set()

    def record_new(self) -> None:
        """Record the files that appeared since the last look (never those that were there before the run)."""
        now = self._files()
        new = sorted(now - self.seen)
        self.seen = now
        self.files.record(*(p.relative_to(self.files.directory) for p in new))
