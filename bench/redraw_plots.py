"""Re-draw the benchmarks' recorded plots from their JSON, without re-running a benchmark.

Each PNG under bench/results/ that a benchmark drew is drawn again from the JSON that the same run wrote beside it,
by the benchmark's own ``plot`` function (matplotlib, ``bench/plot.py``); then ``python bench/results_pages.py``
copies the changed ones into docs/results/img/.

    python bench/redraw_plots.py && python bench/results_pages.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
# PNG -> (the benchmark module that drew it, the JSON it drew it from)
GUIDED = ("guided.png", "guided_fk_add.png", "guided_fk_rgs.png", "guided_fk_rgs_confirm_40.png", "guided_rgs_soft.png")
SETS = ("guided_sets.png",)
HACKING = "hacking/hacking.json"
SCALING = "scaling/scaling.json"


def redraw() -> list[Path]:
    """Draw every recorded plot again; returns the PNGs written."""
    sys.path.insert(0, str(BENCH))
    import guided
    import guided_sets
    import hacking
    import scaling

    written = []
    for module, names in ((guided, GUIDED), (guided_sets, SETS)):
        for name in names:
            png = RESULTS / name
            module.plot(json.loads(png.with_suffix(".json").read_text())["rows"], png)
            written.append(png)
    out = RESULTS / Path(HACKING).parent
    hacking.plot(json.loads((RESULTS / HACKING).read_text())["curves"], out)
    written += [out / f"hacking{suffix}.png" for suffix, _ in hacking.PLOTS.values()]
    out = RESULTS / Path(SCALING).parent
    scaling.plot(json.loads((RESULTS / SCALING).read_text())["rows"], out)
    written += [out / "scaling_time.png", out / "scaling_memory.png"]
    return written


if __name__ == "__main__":
    for path in redraw():
        print(f"drew {path.relative_to(BENCH.parent)} ({path.stat().st_size // 1024} KB)")
