"""The toy video world's main job over training seeds, and a second method at the same wall time.

Each run is a plain ``flowalign train`` of ``configs/video/default.yaml`` (DiffusionNFT on the toy Wan, ``toy_video``'s
joint credit) with ``train.seed=K``, or of the same file with its ``base:`` swapped for another method preset
(``--runs default,flow_grpo_fast``: the run's config is written to ``<out>/configs/<method>.yaml``; every other
setting is the video main job's). Each run ends with the main job's own held-out evaluation, so its gain is paired
against the base model on the same clips and seeds (``eval/before_after.json``; the evaluation's seeds follow
``train.seed``). ``--iterations METHOD=N`` sets a method's iterations: the equal-wall comparison gives the second
method the iterations that cost the main job's training wall time (its seconds per iteration measured beside it).

The table (``<out>/video_runs.md`` and ``.json``) gives per method: the seeds, the iterations, the mean held-out gain
of the exact verifier over seeds with ``bench/methods.py``'s SE (the larger of the seed SE and the evaluation SE) and
z, the per-seed gains, the gain in the trained reward (``toy_video`` as the run configures it), the mean
training wall time (the sum of the iterations' ``time/*``) and the whole command's wall time. ``--jobs 2`` runs two
at once, each on one thread (``OMP_NUM_THREADS=1``): the wall times are then each run's on one core, the other core
busy with the other run.

Runs are resumable: a run whose record ``<out>/records/<method>-seed<k>.json`` exists is skipped; ``--report`` only
rebuilds the table.

    python bench/video_runs.py --runs default --seeds 0,1,2 --jobs 2
    python bench/video_runs.py --runs flow_grpo_fast --iterations flow_grpo_fast=40 --seeds 0,1,2 --jobs 2
    python bench/video_runs.py --report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from methods import seed_mean  # noqa: E402 - the benchmarks' shared SE over seeds

MAIN_JOB = REPO / "configs/video/default.yaml"
COMMON = ["train.tracker=none", "train.sample_every=0", "train.checkpoint_every=0"]


def run_config(method: str, out: Path) -> Path:
    """The config file of ``method``: the main job's, or the main job's with ``base`` the method preset."""
    if method == "default":
        return MAIN_JOB
    preset = REPO / "configs/methods" / f"{method}.yaml"
    if not preset.is_file():
        raise SystemExit(f"--runs: no method preset {preset}")
    config = yaml.safe_load(MAIN_JOB.read_text())
    config["base"] = str(preset)
    config.pop("objectives", None)
    path = out / "configs" / f"{method}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(f"# bench/video_runs.py: the video main job ({MAIN_JOB.relative_to(REPO)}) with {method}'s preset\n"
                   + yaml.safe_dump(config, sort_keys=False))
    os.replace(tmp, path)
    return path


def run_folder(method: str, seed: int, out: Path) -> Path:
    """Where one run writes: ``<out>/<method>-seed<seed>``."""
    return out / f"{method}-seed{seed}"


def train_command(method: str, seed: int, iterations: int | None, out: Path) -> list[str]:
    """The ``flowalign train`` command line of one run (its output in ``run_folder``)."""
    command = [sys.executable, "-m", "flowalign.cli", "train", str(run_config(method, out)), f"train.seed={seed}",
               f"train.out_dir={run_folder(method, seed, out)}", "train.overwrite=true", *COMMON]
    return command + ([f"train.iterations={iterations}"] if iterations is not None else [])


def run_one(method: str, seed: int, iterations: int | None, out: Path, threads: int | None) -> dict:
    """Train and evaluate one run; returns (and writes) its record."""
    record_path = out / "records" / f"{method}-seed{seed}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    run_dir = run_folder(method, seed, out)
    command = train_command(method, seed, iterations, out)
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    log = out / "logs" / f"{method}-seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as stream:
        subprocess.run(command, cwd=REPO, env=env, stdout=stream, stderr=subprocess.STDOUT, check=True)
    record = run_record(method, seed, run_dir, time.perf_counter() - start, threads)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = record_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, record_path)
    print(f"{method} seed {seed}: {record['iterations']} iterations, train {record['train_wall_s']:.0f} s, "
          f"wall {record['wall_s']:.0f} s, gain {record['paired']['diff']:+.3f} (SE {record['paired']['se']:.3f})",
          flush=True)
    return record


def run_record(method: str, seed: int, run_dir: Path, wall: float, threads: int | None) -> dict:
    """One finished run's record, read from the trainer's own files: ``metrics.jsonl`` (the training wall time as the
    sum of each iteration's ``time/*``, the first and last-10 mean ``reward``) and ``eval/before_after.json`` (the
    paired exact-verifier gain per tag and overall, and the paired trained reward from its ``rewards`` table)."""
    report = json.loads((run_dir / "eval/before_after.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_wall = sum(v for row in rows for k, v in row.items() if k.startswith("time/") and isinstance(v, float))
    return {"method": method, "seed": seed, "iterations": len(rows), "train_wall_s": train_wall, "wall_s": wall,
            "threads": threads, "load_average_at_end": list(os.getloadavg()),
            "paired": report["paired"]["overall"], "tags": report["paired"]["tags"],
            "paired_trained": report["rewards"]["toy_video"]["overall"],
            "reward_first": rows[0]["reward"], "reward_last10": _mean(r["reward"] for r in rows[-10:])}


def _mean(values) -> float | None:
    kept = [v for v in values if isinstance(v, (int, float))]
    return sum(kept) / len(kept) if kept else None


def summarise(records: list[dict]) -> dict:
    """Per method (the main job first): its seeds, iterations, the mean exact gain over seeds with its SE
    (``bench/methods.py``'s ``seed_mean``), the per-seed gains, the mean gain in the trained reward, the mean training
    and command wall times, and the mean before and after scores."""
    methods = sorted({r["method"] for r in records}, key=lambda m: (m != "default", m))
    summary = {}
    for method in methods:
        group = sorted((r for r in records if r["method"] == method), key=lambda r: r["seed"])
        gains = [r["paired"]["diff"] for r in group]
        mean, se, spread = seed_mean(gains, [r["paired"]["se"] for r in group])
        summary[method] = {"seeds": [r["seed"] for r in group], "iterations": sorted({r["iterations"] for r in group}),
                           "gain": mean, "se": se, "seed_sd": spread, "gains": gains,
                           "trained_gain": _mean(r["paired_trained"]["diff"] for r in group if r.get("paired_trained")),
                           "train_wall_s": _mean(r["train_wall_s"] for r in group),
                           "wall_s": _mean(r["wall_s"] for r in group),
                           "before": _mean(r["paired"]["mean_a"] for r in group),
                           "after": _mean(r["paired"]["mean_b"] for r in group)}
    return summary


def table(summary: dict) -> str:
    """The markdown table of ``summarise``'s result (``video_runs.md``, and docs/results/video.md's)."""
    lines = ["| method | seeds | iterations | before | after | held-out gain (exact) | SE | z | per seed | "
             "trained reward's gain | train wall s | command wall s |", "|" + "---|" * 12]
    for method, row in summary.items():
        z = row["gain"] / row["se"] if row["se"] else math.nan
        trained = "" if row["trained_gain"] is None else format(row["trained_gain"], "+.3f")
        lines.append(f"| {method} | {len(row['seeds'])} | {'/'.join(map(str, row['iterations']))} | "
                     f"{row['before']:.3f} | {row['after']:.3f} | {row['gain']:+.3f} | {row['se']:.3f} | {z:.1f} | "
                     f"{', '.join(f'{g:+.3f}' for g in row['gains'])} | {trained} | {row['train_wall_s']:.0f} | "
                     f"{row['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def report(out: Path) -> str:
    """Rebuild ``video_runs.md`` / ``.json`` from the records."""
    summary = summarise([json.loads(p.read_text()) for p in sorted((out / "records").glob("*.json"))])
    text = table(summary)
    for name, content in (("video_runs.md", text), ("video_runs.json", json.dumps(summary, indent=1))):
        tmp = out / f"{name}.tmp"
        tmp.write_text(content)
        os.replace(tmp, out / name)
    return text


def strips(run_dir: Path, out: Path, rows: int = 2) -> list[Path]:
    """The first ``rows`` rows of a run's ``eval/grid_before.png`` and ``grid_after.png`` (the same held-out clips on
    the same seeds, each clip's frames side by side, captioned with its verdict) as ``out/strips_before.png`` and
    ``strips_after.png``. The grids hold the first 64 evaluation clips, ``save_grid``'s 8 to a row."""
    from PIL import Image

    report = json.loads((run_dir / "eval/before_after.json").read_text())
    grid_rows = math.ceil(min(report["samples"], 64) / 8)
    written = []
    for name in ("before", "after"):
        with Image.open(run_dir / "eval" / f"grid_{name}.png") as grid:
            height = grid.height // grid_rows * min(rows, grid_rows)
            path = out / f"strips_{name}.png"
            tmp = path.with_suffix(".png.tmp")
            grid.crop((0, 0, grid.width, height)).save(tmp, format="PNG")
            os.replace(tmp, path)
            written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="default", help="methods: default (the main job) or method presets")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--iterations", action="append", default=[], metavar="METHOD=N")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each on one thread when > 1)")
    parser.add_argument("--out", default=str(REPO / "bench/results/video"))
    parser.add_argument("--report", action="store_true", help="only rebuild the table from the records")
    parser.add_argument("--strips", metavar="RUN", help="write the results page's before/after strips from the run "
                        "METHOD-seedK under --out (e.g. default-seed0)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        iterations = {k: int(v) for k, v in (item.split("=", 1) for item in args.iterations)}
        jobs = [(m, int(s)) for m in args.runs.split(",") for s in args.seeds.split(",")]
        threads = 1 if args.jobs > 1 else None
        with ThreadPoolExecutor(args.jobs) as pool:
            for future in [pool.submit(run_one, m, s, iterations.get(m), out, threads) for m, s in jobs]:
                future.result()
    if args.strips:
        print("\n".join(map(str, strips(out / args.strips, out))))
    print(report(out))


if __name__ == "__main__":
    main()
