"""The ``flowalign train configs/models/...`` command lines of the documentation (docs/ and README.md, continuation
lines joined, comments dropped), for tests/test_refused_inputs.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESET_RUN = re.compile(r"\btrain (configs/models/\S+\.yaml)")


def pages() -> list[Path]:
    return sorted(p for p in [*REPO.glob("docs/**/*.md"), REPO / "README.md"] if "reference" not in p.parts)


def preset_runs(page: Path) -> list[tuple[int, str, list[str]]]:
    """``(line number, the command, [CONFIG, KEY=VALUE ...])`` of each model-preset training command of ``page``."""
    lines, found, i = page.read_text().split("\n"), [], 0
    while i < len(lines):
        start = i
        while lines[i].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
        command = " ".join(line.rstrip().rstrip("\\") for line in lines[start:i + 1])
        i += 1
        match = PRESET_RUN.search(command)
        if not match or "`" in command or command.lstrip().startswith(("base:", "|", "- ")):
            continue
        words = shlex.split(command, comments=True)
        after = words[words.index(match.group(1)):]
        found.append((start + 1, command, [after[0], *(w for w in after[1:] if "=" in w and not w.startswith("-"))]))
    return found
