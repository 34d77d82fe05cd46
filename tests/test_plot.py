"""bench/plot.py draws the results plots with matplotlib, and the committed plots are what their JSON draws."""

import json
import subprocess
import sys
from pathlib import Path

from PIL import Image

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"


def draw(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` with bench/ on sys.path in a process of its own (as the benchmarks run)."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r})\n{code}", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_committed_guided_plot_is_what_its_json_draws(tmp_path):
    out = tmp_path / "guided.png"
    code = ("import json, guided; from pathlib import Path\n"
            "guided.plot(json.loads(Path(sys.argv[1]).read_text())['rows'], Path(sys.argv[2]))")
    result = draw(code, str(BENCH / "results/guided.json"), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.read_bytes() == (BENCH / "results/guided.png").read_bytes()  # no version stamp, no date: reproducible
    assert out.read_bytes() == (REPO / "docs/results/img/guided.png").read_bytes()


def test_line_plot_draws_labelled_points_at_the_requested_size(tmp_path):
    out = tmp_path / "deep" / "plot.png"
    series = {"a": [(0, 0.1), (10, 0.5, "ten")], "b": [(5, 0.3)]}
    code = ("import json, plot; from pathlib import Path\n"
            "plot.line_plot({k: [tuple(p) for p in v] for k, v in json.loads(sys.argv[1]).items()}, Path(sys.argv[2]),"
            " x_label='x', y_label='y', colors={'a': (255, 0, 0)}, width=500, height=300, title='t')")
    result = draw(code, json.dumps(series), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    image = Image.open(out)
    assert image.size == (500, 300)
    pixels = image.convert("RGB").getdata()
    assert any(p[0] > 200 and p[1] < 60 and p[2] < 60 for p in pixels)  # series a in its colour
    assert [p.name for p in out.parent.iterdir()] == ["plot.png"]  # written atomically, no temporary left
