"""The generated reference pages (docs/reference/config.md and cli.md) match what the code generates now.

The pages are generated in a fresh interpreter (no component a test registered in this process shows up), from
another directory, with another terminal width and hash seed: the output depends on none of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flowalign.cli import reference

REPO = Path(__file__).resolve().parents[1]


def test_committed_reference_pages_are_fresh(tmp_path):
    env = {**os.environ, "COLUMNS": "37", "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-m", "flowalign.cli.reference", "--check"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        f"{result.stderr.strip() or result.stdout.strip()}\n"
        f"The generated reference pages are stale: run `{reference.REGENERATE}` and commit docs/reference/.")


def test_check_names_a_stale_page_and_the_command(tmp_path, capsys):
    for relative in reference.PAGES:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text((REPO / relative).read_text())
    page = tmp_path / "docs/reference/config.md"
    page.write_text(page.read_text().replace("| `optim.lr` |", "| `optim.learning_rate` |"))
    stale, _ = reference.check(tmp_path)
    assert "docs/reference/config.md" in stale
    assert set(stale) <= set(reference.write(tmp_path))  # regenerating rewrites the stale pages
    assert reference.check(tmp_path)[0] == []
    assert reference.write(tmp_path) == []  # and is idempotent


def test_pages_are_machine_independent():
    for relative in reference.PAGES:
        text = (REPO / relative).read_text()
        assert "/work" not in text and str(REPO) not in text and "\x1b[" not in text, relative
        for word in ("main job", "the floor", "this session", "issue #", "DESIGN.md"):
            assert word not in text, (relative, word)
