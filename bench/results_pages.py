"""Render the tables of docs/results/ from the benchmarks' JSON, and keep the pages' result plots in sync.

Each generated table sits in its page between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; this
script rewrites what lies between the markers with the table that NAME's JSON gives, using the benchmarks' own
formatters (``bench/guided.py``'s ``table``, ``bench/methods.py``'s ``summary_table`` and ``curve_table``,
``bench/train_iteration.py``'s ``cost_table``, ``bench/mixed_precision.py``'s ``precision_table``,
``bench/tree_rollout.py``'s ``table``, ``bench/scaling.py``'s ``table``, ``bench/vgpo_signal.py``'s and
``bench/equal_wall.py``'s ``table``, ``bench/video_runs.py``'s ``table``, ``bench/kernel_tables.py``). It also copies
the plots the pages show from ``bench/results/`` into ``docs/results/img/`` when they differ. It only reads JSON and
PNG files: no model, no torch.

    python bench/results_pages.py           # rewrite the generated tables and copy changed plots
    python bench/results_pages.py --check   # exit 1, naming each stale table or plot, if anything would change

Tables whose figures exist only as prose (no JSON) are written by hand on the pages, with their date, commit and
command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
PAGES = REPO / "docs/results"
IMAGES = PAGES / "img"
# The plots the pages show: bench/results/NAME -> docs/results/img/NAME.
PLOTS = ("guided.png", "guided_fk_add.png", "guided_fk_rgs.png", "guided_sets.png", "hacking/hacking.png",
         "hacking/hacking_proxy.png", "hacking/hacking_diversity.png", "hacking/hacking_saturated.png",
         "drl/samples.png", "drl_adjoint/samples.png", "scaling/scaling_time.png", "scaling/scaling_memory.png",
         "video/strips_before.png", "video/strips_after.png")
MARKER = re.compile(r"(<!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.DOTALL)


def _read(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _guided(path: str) -> str:
    import guided

    return guided.table(_read(path)["rows"])


def _methods_summary() -> str:
    import methods

    return methods.summary_table(methods.load_runs(RESULTS / "methods"))[0].rstrip("\n")


def _methods_curves(*, seeds: int) -> str:
    """The curve table over the presets that have ``seeds`` seeds (seed 0 only when ``seeds`` is 1)."""
    import methods

    runs = methods.load_runs(RESULTS / "methods")
    if seeds == 1:
        return methods.curve_table([r for r in runs if r["seed"] == 0])
    counts = {p: sum(r["preset"] == p for r in runs) for p in {r["preset"] for r in runs}}
    return methods.curve_table([r for r in runs if counts[r["preset"]] >= seeds])


def _cost(path: str) -> str:
    import train_iteration

    return train_iteration.cost_table(_read(path)["rows"])


def _precision(path: str) -> str:
    import mixed_precision

    return mixed_precision.precision_table(_read(path)["rows"])


def _tree() -> str:
    import tree_rollout

    return tree_rollout.table(_read("tree_rollout.json"))


def _vgpo_signal() -> str:
    import vgpo_signal

    return vgpo_signal.table(_read("vgpo_signal.json"))


def _equal_wall(presets: tuple[str, ...] | None = None, path: str = "equal_wall/equal_wall.json") -> str:
    """The equal-wall table of ``path``, of ``presets`` only when given."""
    import equal_wall

    summary = _read(path)
    return equal_wall.table({k: v for k, v in summary.items() if presets is None or k in presets})


def _equal_wall_matched() -> str:
    """The runs with a matched EMA and a measured budget (``equal_wall_matched/``) under Flow-GRPO-Fast's rows, whose
    EMA of 0.99 over 330 iterations is already the matched one."""
    import equal_wall

    reference = {k: v for k, v in _read("equal_wall/equal_wall.json").items() if k == equal_wall.REFERENCE}
    return equal_wall.table({**reference, **_read("equal_wall_matched/equal_wall.json")})


def _methods_objectives() -> str:
    """The equal-NFE curves of Flow-GRPO-Fast (the budget's reference), the best training-side methods and the
    forward-process objectives."""
    import methods

    keep = ("flow_grpo_fast", *TRAINING_SIDE, *OBJECTIVES)
    return methods.curve_table([r for r in methods.load_runs(RESULTS / "methods") if r["preset"] in keep])


def _hacking() -> str:
    import hacking

    return hacking.table(_read("hacking/hacking.json")["curves"])


def _guided_sets() -> str:
    import guided_sets

    result = _read("guided_sets.json")
    return guided_sets.table(result["rows"], result["settings"]["candidates"], result["settings"]["embedding"])


def _guided_compose() -> str:
    import guided_compose

    return guided_compose.table(_read("guided_compose.json")["rows"])


def _soar() -> str:
    import soar

    reports = [json.loads(path.read_text()) for path in sorted((RESULTS / "soar").glob("soar-seed*.json"))]
    return "\n\n".join(soar.table(report) for report in reports)


def _shell_lcc() -> str:
    import shell_lcc

    return shell_lcc.table(_read("shell_lcc/shell_lcc.json")["runs"])


def _drl_stage2() -> str:
    import drl

    runs = [("drl (GRPO)", "drl/drl.json"), ("drl_adjoint", "drl_adjoint/drl.json"),
            ("drl_adjoint", "drl_adjoint/seed1/drl.json"), ("drl_adjoint", "drl_adjoint/seed2/drl.json"),
            ("drl_adjoint, lambda 1", "drl_adjoint/lambda1/drl.json")]
    return drl.table([(name, _read(path)) for name, path in runs if (RESULTS / path).is_file()])


def _rewards() -> str:
    import rewards

    return rewards.table(_read("rewards.json"))


def _kernels_gpu() -> str:
    import kernel_tables

    return kernel_tables.gpu_table([_read("device/kernels_bf16.json"), _read("device/kernels_fp32.json")])


def _scaling() -> str:
    import scaling

    data = _read("scaling/scaling.json")
    return scaling.table(data["rows"], data["exponents"])


def _video_runs() -> str:
    import video_runs

    return video_runs.table(_read("video/video_runs.json"))


def _kernels_check() -> str:
    import kernel_tables

    return kernel_tables.check_table(_read("kernels_check.json")["checks"])


GUIDED = ("guided", "guided_bon160", "guided_fk_add", "guided_fk_confirm_40", "guided_bon_confirm_80", "guided_fk_rgs",
          "guided_fk_rgs_confirm_40", "guided_rgs_high", "guided_rgs_mid", "guided_rgs_confirm", "guided_rgs_scale2",
          "guided_rgs_soft", "guided_rgs_soft_confirm", "guided_rgs_soft_full", "guided_euphonium",
          "guided_fk_reference")
OBJECTIVES = ("diffusion_nft", "awm", "dpo")  # the forward-process objectives of docs/results/objectives.md
# The training-side methods objectives.md compares them with, in both of its tables: the three that gained most at
# the wall budget (equal_wall/: DRL, VGPO, Shell-LCC) and the one that gained most at equal NFEs (methods/: TP-GRPO).
TRAINING_SIDE = ("drl", "vgpo", "shell_lcc", "tp_grpo")
# NAME: (page, the table's source under bench/results/, a function rendering it)
TABLES = {
    "train_iteration": ("methods.md", "train_iteration.json", lambda: _cost("train_iteration.json")),
    "train_iteration_new": ("methods.md", "train_iteration_new.json", lambda: _cost("train_iteration_new.json")),
    "train_iteration_methods24": ("methods.md", "train_iteration_methods24.json",
                                  lambda: _cost("train_iteration_methods24.json")),
    "methods_seed0": ("methods.md", "methods/*-seed0.json", lambda: _methods_curves(seeds=1)),
    "methods_three_seeds": ("methods.md", "methods/*-seed*.json", lambda: _methods_curves(seeds=3)),
    "methods_summary": ("methods.md", "methods/*-seed*.json", _methods_summary),
    "tree_rollout": ("methods.md", "tree_rollout.json", _tree),
    "vgpo_signal": ("methods.md", "vgpo_signal.json", _vgpo_signal),
    "equal_wall": ("methods.md", "equal_wall/equal_wall.json", _equal_wall),
    "soar": ("methods.md", "soar/soar-seed*.json", _soar),
    "shell_lcc": ("methods.md", "shell_lcc/shell_lcc.json", _shell_lcc),
    "drl_stage2": ("methods.md", "drl{,_adjoint}/**/drl.json", _drl_stage2),
    "train_iteration_adjoint": ("methods.md", "train_iteration_adjoint.json",
                                lambda: _cost("train_iteration_adjoint.json")),
    "train_iteration_methods3": ("methods.md", "train_iteration_methods3.json",
                                 lambda: _cost("train_iteration_methods3.json")),
    "default_run_seeds": ("default_run.md", "equal_wall_nft_lr/equal_wall.json",
                          lambda: _equal_wall(path="equal_wall_nft_lr/equal_wall.json")),
    "objectives_equal_wall": ("objectives.md", "equal_wall/equal_wall.json",
                              lambda: _equal_wall(("flow_grpo_fast", *TRAINING_SIDE, *OBJECTIVES))),
    "objectives_equal_wall_matched": ("objectives.md", "equal_wall{,_matched}/equal_wall.json", _equal_wall_matched),
    "objectives_equal_nfe": ("objectives.md", "methods/*-seed*.json", _methods_objectives),
    "hacking": ("objectives.md", "hacking/hacking.json", _hacking),
    **{name: ("guided_sampling.md", f"{name}.json", lambda name=name: _guided(f"{name}.json")) for name in GUIDED},
    "guided_sets": ("guided_sampling.md", "guided_sets.json", _guided_sets),
    "guided_compose": ("guided_sampling.md", "guided_compose.json", _guided_compose),
    "rewards": ("rewards.md", "rewards.json", _rewards),
    "kernels_check": ("gpu_kernels.md", "kernels_check.json", _kernels_check),
    "scaling": ("scaling.md", "scaling/scaling.json", _scaling),
    "video_runs": ("video.md", "video/video_runs.json", _video_runs),
    "device_kernels": ("gpu_kernels.md", "device/kernels_{bf16,fp32}.json", _kernels_gpu),
    "device_mixed_precision": ("gpu_kernels.md", "device/mixed_precision.json",
                               lambda: _precision("device/mixed_precision.json")),
    "device_train_iteration": ("gpu_kernels.md", "device/train_iteration.json",
                               lambda: _cost("device/train_iteration.json")),
}


def render_page(text: str, page: str) -> tuple[str, list[str]]:
    """``text`` with every generated table of ``page`` re-rendered, and the names of the tables that changed."""
    changed = []

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in TABLES or TABLES[name][0] != page:
            raise SystemExit(f"docs/results/{page}: unknown generated table {name!r}")
        body = "\n" + TABLES[name][2]().strip("\n") + "\n\n"
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[4]

    return MARKER.sub(replace, text), changed


def stale_plots() -> list[str]:
    return [name for name in PLOTS
            if not (IMAGES / name).exists() or (IMAGES / name).read_bytes() != (RESULTS / name).read_bytes()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table or plot is stale")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH))  # the benchmarks' formatters (none of them imports torch at module level)
    stale, seen = [], set()
    for page in sorted({page for page, _, _ in TABLES.values()}):
        path = PAGES / page
        text, changed = render_page(path.read_text(), page)
        seen.update(m["name"] for m in MARKER.finditer(text))
        stale += [f"docs/results/{page}: table {name!r} differs from bench/results/{TABLES[name][1]}"
                  for name in changed]
        if changed and not args.check:
            path.write_text(text)
    missing = [f"docs/results/{page}: no markers for table {name!r}" for name, (page, _, _) in TABLES.items()
               if name not in seen]
    if missing:
        print("\n".join(missing))
        return 1
    for name in stale_plots():
        stale.append(f"docs/results/img/{name}: differs from bench/results/{name}")
        if not args.check:
            (IMAGES / name).parent.mkdir(parents=True, exist_ok=True)
            (IMAGES / name).write_bytes((RESULTS / name).read_bytes())
    for line in stale:
        print(("stale: " if args.check else "updated: ") + line)
    if args.check and stale:
        print("run `python bench/results_pages.py` to regenerate them")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
