"""One line plot for the benchmarks, drawn with matplotlib (the ``bench`` extra: ``pip install -e ".[bench]"``).

``line_plot(series, path, x_label=..., y_label=...)``: ``series`` maps a name to its points ``(x, y)`` or
``(x, y, label)``; each series is a polyline in x order with its points marked (and labelled), in ``colors[name]``
(RGB, 0-255); ``log=True`` makes both axes logarithmic. The axes get matplotlib's own ticks, a grid and a legend;
the PNG is written atomically.

Re-draw the recorded plots from their JSON, without re-running a benchmark: ``python bench/redraw_plots.py``.
"""

from __future__ import annotations

from pathlib import Path

from flowalign.outputs import write_atomically


def line_plot(series: dict[str, list[tuple]], path: Path, *, x_label: str, y_label: str,
              colors: dict[str, tuple[int, int, int]], x_range: tuple[float, float] | None = None,
              y_range: tuple[float, float] | None = None, width: int = 680, height: int = 440,
              title: str | None = None, log: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: the benchmarks run headless
    import matplotlib.pyplot as plt

    dpi = 100
    figure, axes = plt.subplots(figsize=(width / dpi, height / dpi), dpi=dpi)
    try:
        for name, points in series.items():
            color = tuple(c / 255 for c in colors.get(name, (0, 0, 0)))
            ordered = sorted(points, key=lambda p: p[0])
            axes.plot([p[0] for p in ordered], [p[1] for p in ordered], color=color, marker="o", markersize=4,
                      linewidth=1.8, label=name)
            for point in ordered:
                if len(point) > 2 and point[2]:
                    axes.annotate(str(point[2]), (point[0], point[1]), textcoords="offset points", xytext=(4, 4),
                                  fontsize=7, color=color)
        if log:  # both axes logarithmic: a power law is a straight line whose slope is its exponent
            axes.set_xscale("log")
            axes.set_yscale("log")
        if x_range:
            axes.set_xlim(*x_range)
        if y_range:
            axes.set_ylim(*y_range)
        axes.set_xlabel(x_label)
        axes.set_ylabel(y_label)
        if title:
            axes.set_title(title)
        axes.grid(True, alpha=0.3)
        axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=8)
        figure.tight_layout()
        with write_atomically(path) as tmp:  # no version stamp in the file: the same JSON gives the same bytes
            figure.savefig(tmp, format="png", dpi=dpi, metadata={"Software": None})
    finally:
        plt.close(figure)
