"""The generated tables of docs/results/ equal what the benchmarks' JSON gives (``bench/results_pages.py``).

The script runs in a process of its own (it puts bench/ on sys.path). It only reads JSON and PNG files, so these tests take about a second.
"""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench/results_pages.py"


def run_check(pages: Path | None = None) -> subprocess.CompletedProcess:
    """``results_pages.py --check``, on the committed pages or on a copy of them at ``pages``."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import results_pages as r\n"
            "if len(sys.argv) > 2: r.PAGES = r.Path(sys.argv[2]); r.IMAGES = r.PAGES / 'img'\n"
            "sys.argv = ['results_pages.py', '--check']; raise SystemExit(r.main())")
    args = [sys.executable, "-c", code, str(SCRIPT.parent)] + ([str(pages)] if pages else [])
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_committed_tables_and_plots_are_current():
    result = run_check()
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:] + (
        "\nregenerate with: python bench/results_pages.py")


def test_a_hand_edited_table_is_named_stale(tmp_path):
    pages = tmp_path / "results"
    shutil.copytree(REPO / "docs/results", pages)
    methods = pages / "methods.md"
    text = methods.read_text()
    start = text.index("<!-- generated: tree_rollout -->")
    edited = text[start:].replace("| 1.00 |", "| 1.01 |", 1)
    methods.write_text(text[:start] + edited)
    (pages / "img/guided.png").write_bytes(b"not the plot")
    result = run_check(pages)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "methods.md: table 'tree_rollout'" in result.stdout
    assert "img/guided.png" in result.stdout
    assert "guided_sampling.md" not in result.stdout  # the untouched tables are not named


def test_a_table_without_its_markers_fails(tmp_path):
    pages = tmp_path / "results"
    shutil.copytree(REPO / "docs/results", pages)
    page = pages / "gpu_kernels.md"
    page.write_text(page.read_text().replace("<!-- generated: kernels_check -->", "<!-- gone -->"))
    result = run_check(pages)
    assert result.returncode == 1
    assert "no markers for table 'kernels_check'" in result.stdout
