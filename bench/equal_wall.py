"""Method presets at one wall-time budget, several training seeds each: the toy world's 15-minute budget, which is
Flow-GRPO-Fast's 330 iterations (the default run until DiffusionNFT replaced it, and the reference every budget is
counted from).

Wall time is what a busy machine changes, so the budget is set in iterations: a preset whose iteration costs ``r``
times Flow-GRPO-Fast's (``time/total`` ratios measured in one ``bench/train_iteration.py`` run, ``--costs``) trains
``round(330 / r)`` iterations (``--iterations PRESET=N`` fixes one by hand). Every run is a plain
``flowalign train`` of the preset with its seed and ends with the default run's held-out evaluation (3,168 images,
the same captions and seeds before and after), so each gain is paired against the base model; the table gives, per
preset, the mean gain over seeds with ``bench/methods.py``'s SE (the larger of the seed SE and the evaluation SE),
the seed SD, the per-seed gains and the mean training wall time. Each run is also evaluated on its own training
prompts (``flowalign eval toy``, 16 images per prompt, its last checkpoint's EMA weights against the base model on
the same seeds), and its collapse metrics (``collapse/*``: within-group diversity, saturated pixels, the held-out
verifier's reward) are averaged over its last 10 iterations.

Runs are resumable: each writes ``<out>/<preset>-seed<k>/`` (ignored by git) and, once its evaluation is done, a small
record ``<out>/records/<preset>-seed<k>.json`` (kept in the repository: the paired gain, per-tag gains, iterations,
training wall time, the training-prompt gain and the collapse metrics at the end). A run with a record is skipped, so
seeds measured in one checkout add up with those of later ones; ``--report`` only rebuilds ``<out>/equal_wall.md`` and
``.json`` from the records. ``default`` is the default run (``flowalign train`` with no file: ``configs/default.yaml``,
its own iterations and EMA). ``--match-ema`` gives each run the EMA decay that averages the same share of its
iterations as Flow-GRPO-Fast's 0.99 does of 330 (``matched_ema``); keep such runs in their own ``--out``, since a
preset's rows are pooled over its records. Records made before the default changed name Flow-GRPO-Fast's runs
``flow_grpo_fast`` (the same config; their command has no config file).

    python bench/equal_wall.py --presets flow_grpo_fast,vgpo --seeds 0,1,2 [--jobs 2] [--costs bench/results/X.json]
    python bench/equal_wall.py --presets diffusion_nft --seeds 0 --match-ema --out bench/results/equal_wall_ema
    python bench/equal_wall.py --report
    python bench/equal_wall.py --record ../other-checkout/bench/results/equal_wall/default-seed1   # one run's record
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

REFERENCE = "flow_grpo_fast"  # the budget's reference: its preset and its name in bench/train_iteration.py
REFERENCE_ITERATIONS = 330  # Flow-GRPO-Fast's train.iterations (TrainConfig's default): the 15-minute budget
REFERENCE_EMA = 0.99  # TrainConfig's optim.ema_decay, which every method preset keeps
DEFAULT_RUN = REPO / "configs/default.yaml"  # ``default``: flowalign train with no config file
TRAIN_PROMPTS = REPO / "assets/prompts/train.jsonl"  # the toy world's data.train_prompts
TRAIN_PROMPT_IMAGES = 16  # per training prompt: 174 x 16 = 2,784 paired images
COMMON = ["train.tracker=none", "train.sample_every=0", "train.checkpoint_every=0"]


def costs(path: Path) -> dict[str, float]:
    """``time/total`` per preset from a ``bench/train_iteration.py`` JSON."""
    rows = json.loads(path.read_text())["rows"]
    return {name: float(row["time/total"]) for name, row in rows.items()}


def iterations_for(preset: str, cost: dict[str, float], fixed: dict[str, int]) -> int:
    """The preset's iterations at the budget (the default run: its own)."""
    if preset in fixed:
        return fixed[preset]
    if preset == "default":
        return int(default_run()["train"]["iterations"])
    if preset == REFERENCE:
        return REFERENCE_ITERATIONS
    if preset not in cost or REFERENCE not in cost:
        raise SystemExit(f"no measured cost for {preset!r} (or {REFERENCE!r}) in --costs: run "
                         f"bench/train_iteration.py --presets {REFERENCE} {preset}, or give "
                         f"--iterations {preset}=N")
    return max(1, round(REFERENCE_ITERATIONS * cost[REFERENCE] / cost[preset]))


def default_run() -> dict:
    """The default run's config (``configs/default.yaml`` over TrainConfig), as nested dicts."""
    from flowalign.config import load_config, to_dict
    from flowalign.training.config import TrainConfig

    return to_dict(load_config(TrainConfig, DEFAULT_RUN))


def _one_thread() -> dict[str, str]:
    """The environment for a child run: one intra-op thread unless ``OMP_NUM_THREADS`` says otherwise."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def matched_ema(iterations: int, decay: float = REFERENCE_EMA) -> float:
    """The EMA decay that averages the same share of a run of ``iterations`` as ``decay`` does of Flow-GRPO-Fast's 330:
    ``decay ** (330 / iterations)`` (0.99 over 330 iterations keeps ``0.99^330 = 0.04`` of the start; over 85 it would
    keep 0.43, so a preset with fewer, costlier iterations would be evaluated mostly on its starting weights)."""
    return decay ** (REFERENCE_ITERATIONS / iterations)


def run_one(preset: str, seed: int, iterations: int, out: Path, extra: list[str]) -> None:
    """``flowalign train`` of the preset into ``out/<preset>-seed<k>`` (its log beside it)."""
    run = out / f"{preset}-seed{seed}"
    config = [] if preset == "default" else [str(REPO / "configs/methods" / f"{preset}.yaml")]
    command = [str(Path(sys.executable).with_name("flowalign")), "train", *config, *COMMON,
               f"train.iterations={iterations}", f"train.seed={seed}", f"train.out_dir={run}", *extra]
    start = time.perf_counter()
    with open(out / f"{preset}-seed{seed}.log", "w") as log:
        done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env=_one_thread())
    if done.returncode != 0:
        raise SystemExit(f"{preset} seed {seed} failed (exit {done.returncode}): see {out / f'{preset}-seed{seed}.log'}")
    (run / "bench.json").write_text(json.dumps({"preset": preset, "seed": seed, "iterations": iterations,
                                                "command": command[1:], "wall_s": time.perf_counter() - start}))
    record(run, out)
    print(f"{preset} seed {seed}: done", flush=True)


def _toy_eval(out_dir: Path, seed: int, lora: Path | None = None) -> list[dict]:
    """``flowalign eval toy`` on the training prompts (``TRAIN_PROMPT_IMAGES`` each, ODE, evaluation seed
    ``10000 + seed`` as the trainer's own evaluation), of the base model or of ``lora``'s EMA weights; its results."""
    if not (out_dir / "results.json").exists():
        command = [str(Path(sys.executable).with_name("flowalign")), "eval", "toy", "--prompts", str(TRAIN_PROMPTS),
                   "--images-per-prompt", str(TRAIN_PROMPT_IMAGES), "--seed", str(10_000 + seed), "--out",
                   str(out_dir), *(["--lora", str(lora)] if lora else [])]
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=_one_thread())
    return json.loads((out_dir / "results.json").read_text())["results"]


def train_prompt_gain(run: Path, out: Path, seed: int) -> dict | None:
    """The paired gain on the training prompts: the run's last checkpoint (its EMA weights) against the base model on
    the same seeds (``flowalign.evaluation.toy_eval.paired_difference``); None when the run kept no checkpoint. The
    base model's results are shared by every run of the seed (``out/train-prompts-base-seed<k>/``)."""
    from flowalign.evaluation.toy_eval import paired_difference

    checkpoints = sorted(run.glob("checkpoint-*"))
    if not checkpoints:
        return None
    base = _toy_eval(out / f"train-prompts-base-seed{seed}", seed)
    after = _toy_eval(run / "eval-train-prompts", seed, checkpoints[-1])
    return paired_difference(base, after)["overall"]


def collapse_at_end(history: list[dict], last: int = 10) -> dict:
    """The collapse metrics (``collapse/*``, ``flowalign.training.collapse``) averaged over the last ``last``
    iterations that logged them; empty for a run that logged none."""
    ends = {}
    for key in sorted({k for m in history for k in m if k.startswith("collapse/")}):
        values = [float(m[key]) for m in history if key in m][-last:]
        ends[key] = sum(values) / len(values)
    return ends


def record(run: Path, out: Path) -> dict:
    """Write the finished run's record ``out/records/<run>.json``: its ``bench.json`` with the EMA decay of its saved
    config, the paired overall gain,
    the per-tag gains, the training wall time (the three phases of every iteration, no evaluation), the paired gain on
    the training prompts and the collapse metrics at the end."""
    info = json.loads((run / "bench.json").read_text())
    paired = json.loads((run / "eval" / "before_after.json").read_text())["paired"]
    metrics = run / "metrics.jsonl"
    history = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    train_s = sum(float(m.get(k, 0.0)) for m in history for k in ("time/rollout", "time/reward", "time/train"))
    config = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").exists() else {}
    entry = {**info, **({"ema_decay": config["optim"]["ema_decay"]} if config else {}),
             "overall": paired["overall"], "tags": {t: v["diff"] for t, v in paired["tags"].items()},
             "train_s": train_s, "train_prompts": train_prompt_gain(run, out, info["seed"]),
             "collapse": collapse_at_end(history)}
    (out / "records").mkdir(exist_ok=True)
    (out / "records" / f"{run.name}.json").write_text(json.dumps(entry, indent=1) + "\n")
    return entry


def finished(out: Path) -> list[dict]:
    """The finished runs: a record for every run folder with an evaluation (written now if missing), and the records
    of runs whose folders are gone (an earlier checkout's)."""
    for bench in sorted(out.glob("*-seed*/bench.json")):
        if (bench.parent / "eval" / "before_after.json").exists() and not (out / "records" / f"{bench.parent.name}.json").exists():
            record(bench.parent, out)
    return [json.loads(path.read_text()) for path in sorted((out / "records").glob("*-seed*.json"))]


def ema_decay(run: dict) -> float:
    """The EMA decay a run trained with: as recorded from its config, else (older records) its command's
    ``optim.ema_decay=`` override (``--match-ema``), else TrainConfig's, which every method preset keeps."""
    if "ema_decay" in run:
        return float(run["ema_decay"])
    overrides = [arg.split("=", 1)[1] for arg in run.get("command", []) if arg.startswith("optim.ema_decay=")]
    return float(overrides[-1]) if overrides else REFERENCE_EMA


def summarize(runs: list[dict]) -> dict:
    """Per preset (the default first): iterations, EMA decay, seeds, the mean gain with its SE and seed SD, the
    per-seed gains and per-tag gains, and the mean training wall time (the three phases of every iteration, no
    evaluation). A preset's records must share one EMA decay and one iteration budget: runs with and without
    ``--match-ema``, or at different ``--iterations``, are not pooled."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["preset"], []).append(run)
    summary = {}
    for preset in sorted(groups, key=lambda p: (p != "default", p != REFERENCE, p)):
        group = sorted(groups[preset], key=lambda r: r["seed"])
        decays, budgets = {round(ema_decay(r), 6) for r in group}, {r["iterations"] for r in group}
        if len(decays) > 1 or len(budgets) > 1:
            raise SystemExit(f"{preset}: records with different EMA decays {sorted(decays)} or iterations "
                             f"{sorted(budgets)} in one --out; give each setting its own --out")
        gain, se, sd = seed_mean([r["overall"]["diff"] for r in group], [r["overall"]["se"] for r in group])
        walls = [r["train_s"] for r in group if r["train_s"]]
        on_train = [r for r in group if r.get("train_prompts")]
        ends = [r["collapse"] for r in group if r.get("collapse")]
        summary[preset] = {"iterations": group[0]["iterations"], "ema_decay": decays.pop(),
                           "seeds": [r["seed"] for r in group], "gain": gain,
                           "se": se, "seed_sd": sd, "gains": [r["overall"]["diff"] for r in group],
                           "train_s": sum(walls) / len(walls) if walls else None, "tags": [r["tags"] for r in group],
                           "train_prompts": None if not on_train else {
                               "seeds": [r["seed"] for r in on_train],
                               "gain": sum(r["train_prompts"]["diff"] for r in on_train) / len(on_train),
                               "gains": [r["train_prompts"]["diff"] for r in on_train]},
                           "collapse": None if not ends else {
                               "seeds": [r["seed"] for r in group if r.get("collapse")],
                               **{key: sum(e[key] for e in ends) / len(ends) for key in ends[0]}}}
    return summary


def _of_seeds(entry: dict | None, value: str, seeds: list[int]) -> str:
    """A table cell: ``value``, naming the seeds it covers when that is not every seed of the row."""
    if entry is None:
        return ""
    return value if entry["seeds"] == seeds else f"{value} (seed {', '.join(map(str, entry['seeds']))})"


def table(summary: dict) -> str:
    """The summary as a Markdown table."""
    lines = ["| preset | iterations | EMA | seeds | gain (mean over seeds) | SE | z | seed SD | per-seed gains | "
             "training s (mean) | training-prompt gain | at the end: diversity / saturated / held-out verifier |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for preset, row in summary.items():
        se, sd, wall = row["se"], row["seed_sd"], row["train_s"]
        on_train, ends = row.get("train_prompts"), row.get("collapse")
        held_out = next((v for k, v in (ends or {}).items() if k.startswith("collapse/held_out/")), None)
        end_cell = "" if ends is None else (f"{ends.get('collapse/diversity', float('nan')):.3f} / "
                                            f"{ends.get('collapse/saturated_frac', float('nan')):.3f} / "
                                            f"{'' if held_out is None else f'{held_out:.3f}'}")
        train_cell = _of_seeds(on_train, f"{on_train['gain']:+.3f}", row["seeds"]) if on_train else ""
        lines.append(f"| {preset} | {row['iterations']} | {row.get('ema_decay', REFERENCE_EMA):.3g} | "
                     f"{len(row['seeds'])} | {row['gain']:+.3f} | {se:.3f} | "
                     f"{row['gain'] / se if se else float('nan'):.1f} | {'' if sd is None else f'{sd:.3f}'} | "
                     f"{', '.join(f'{g:+.3f}' for g in row['gains'])} | {'' if wall is None else f'{wall:.0f}'} | "
                     f"{train_cell} | {_of_seeds(ends, end_cell, row['seeds'])} |")
    return "\n".join(lines) + "\n"


def report(out: Path) -> str:
    """Rebuild ``equal_wall.md`` / ``.json`` in ``out`` from its finished runs; returns the table."""
    summary = summarize(finished(out))
    text = table(summary)
    (out / "equal_wall.md").write_text(text)
    (out / "equal_wall.json").write_text(json.dumps(summary, indent=1) + "\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="default")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--costs", default=str(REPO / "bench/results/train_iteration_new.json"))
    parser.add_argument("--iterations", action="append", default=[], metavar="PRESET=N")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one core each)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    parser.add_argument("--out", default=str(REPO / "bench/results/equal_wall"))
    parser.add_argument("--match-ema", action="store_true",
                        help="optim.ema_decay = 0.99 ** (330 / iterations) per run (matched_ema); recorded in "
                             "the run's command")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--record", action="append", default=[], metavar="RUN_DIR",
                        help="(re)write the record of a finished run folder (another checkout's too), then report")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for run in args.record:
        record(Path(run), out)
    if not args.report and not args.record:
        fixed = {k: int(v) for k, v in (item.split("=", 1) for item in args.iterations)}
        cost = costs(Path(args.costs)) if Path(args.costs).exists() else {}
        jobs = []
        for seed in (int(s) for s in args.seeds.split(",")):
            for preset in args.presets.split(","):
                if any(path.exists() for path in (out / f"{preset}-seed{seed}" / "eval" / "before_after.json",
                                                  out / "records" / f"{preset}-seed{seed}.json")):
                    print(f"{preset} seed {seed}: done, skipped")
                    continue
                jobs.append((preset, seed, iterations_for(preset, cost, fixed)))
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for future in [pool.submit(run_one, p, s, n, out,
                                       [*([f"optim.ema_decay={matched_ema(n):.6g}"] if args.match_ema else []),
                                        *args.set]) for p, s, n in jobs]:
                future.result()
    print(report(out))


if __name__ == "__main__":
    main()
