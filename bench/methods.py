"""Sample efficiency of the method presets on the toy world, under one NFE budget or one wall-time budget.

Every preset trains from the same toy model with the same shared settings (``--set key=value`` adds more) until its
cumulative NFEs (rollout evaluations plus intermediate-state completions) reach ``--budget``, or, with
``--wall-budget SECONDS``, until its training wall time reaches that (the comparison at the default run's wall time:
run it on an otherwise idle machine, since wall time is what a busy machine changes). At ``--curve-points``
evenly spaced fractions of the budget the policy (its EMA weights when there are any) is evaluated on the held-out
toy prompts with the ODE, on the same captions and seeds as the base model, so every point is a *paired* gain with
its standard error. Wall time counts training only (the evaluations are excluded).

Each (preset, seed) runs in its own process and writes ``<out>/<preset>-seed<k>.json``; finished runs are skipped on
a rerun, so the benchmark can be resumed and can run in the background across sessions. ``--report`` only rebuilds
``<out>/methods.md`` and ``<out>/methods.json`` from the finished runs.

    python bench/methods.py --presets flow_grpo,branch_grpo --seeds 0 [--budget 25600] [--images-per-prompt 16]
    python bench/methods.py --presets flow_grpo,vgpo --seeds 0,1,2 --wall-budget 1500 --out bench/results/methods_wall
    python bench/methods.py --report [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("flow_grpo", "flow_grpo_fast", "dance_grpo", "mix_grpo", "branch_grpo", "tempflow_grpo", "dense_grpo",
           "tp_grpo", "euphonium", "register_grpo", "drl", "drl_adjoint", "shell_lcc", "shell_lcc_objective", "soar",
           "sft",
           "diffusion_nft", "awm", "dpo", "grpo_guard", "gardo")
# register_grpo reads outputs/registers/registers.pt (flowalign prep registers); drl and drl_adjoint read
# outputs/discriminator/discriminator.safetensors (flowalign prep train-discriminator); shell_lcc and
# shell_lcc_objective read outputs/manifolds/shell_lcc.safetensors (flowalign prep fit-manifold); soar and sft are
# data objectives alone, their nfe counts every training forward (bench/soar.py compares them); diffusion_nft, awm and
# dpo count their rollout and every training forward of their objectives (the policy's, the old or reference
# policy's and the KL's)
# Shared by every run: short logs, no checkpoints or grids, the run's own evaluation off (the bench evaluates).
# EMA 0.9, not the default 0.99: a 16-100 iteration run would be evaluated mostly on its starting weights.
COMMON = ["train.tracker=none", "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0",
          "optim.lr=5e-4", "optim.ema_decay=0.9"]


def run_one(preset: str, seed: int, budget: float, points: int, images_per_prompt: int, extra: list[str],
            out: Path, unit: str = "nfe") -> dict:
    """Train ``preset`` until ``budget`` NFEs (``unit="nfe"``) or seconds of training (``unit="wall_s"``), evaluating
    at ``points`` fractions of it (runs in a child process)."""
    from flowalign.config import load_config
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import evaluate, paired_difference
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    overrides = [*COMMON, f"train.seed={seed}", f"train.out_dir={out / f'{preset}-seed{seed}.run'}", *extra]
    config = load_config(TrainConfig, REPO / "configs/methods" / f"{preset}.yaml", overrides)
    trainer = Trainer(config)
    metadata = load_metadata(config.data.eval_prompts)
    kwargs = dict(steps=10, images_per_prompt=images_per_prompt, seed=10_000 + seed)
    trainer.model.transformer.eval()
    with trainer.model.reference():
        base, _, _ = evaluate(trainer.model, metadata, **kwargs)
    targets = [budget * (k + 1) / points for k in range(points)]
    curve, nfe, wall, iteration = [], 0, 0.0, 0
    while targets:
        start = time.perf_counter()
        metrics = trainer.step()
        wall += time.perf_counter() - start
        if iteration == 0:  # the schedule's progress (sliding windows) needs the run length: estimated from the first
            spent_first = metrics["nfe"] if unit == "nfe" else wall
            config.train.iterations = max(2, math.ceil(budget / spent_first))
        iteration += 1
        nfe += int(metrics["nfe"])
        spent = nfe if unit == "nfe" else wall
        if spent >= targets[0]:
            while targets and spent >= targets[0]:
                targets.pop(0)
            trainer.model.transformer.eval()
            with trainer.ema_weights():
                after, _, _ = evaluate(trainer.model, metadata, **kwargs)
            paired = paired_difference(base, after)
            curve.append({"iteration": iteration, "nfe": nfe, "wall_s": wall, "overall": paired["overall"],
                          "tags": paired["tags"]})
            print(f"{preset} seed {seed}: {nfe} NFEs, {wall:.0f} s, gain {paired['overall']['diff']:+.3f} "
                  f"± {paired['overall']['se']:.3f}", flush=True)
    return {"preset": preset, "seed": seed, "budget": budget, "budget_unit": unit, "overrides": overrides,
            "iterations": iteration,
            "nfe": nfe, "wall_s": wall, "images_per_prompt": images_per_prompt, "curve": curve}


def report(out: Path) -> None:
    """Rebuild ``methods.md`` / ``methods.json`` from the finished runs in ``out``."""
    runs = load_runs(out)
    if not runs:
        print(f"no finished runs in {out}")
        return
    text, summary = summary_table(runs)
    text += "\nThe curve of each run with seed 0, gain ± SE at each quarter of the budget:\n\n"
    text += curve_table([r for r in runs if r["seed"] == 0]) + "\n"
    (out / "methods.md").write_text(text)
    (out / "methods.json").write_text(json.dumps(summary, indent=1))
    print(text)


def load_runs(out: Path) -> list[dict]:
    """The finished runs' JSON (``<preset>-seed<k>.json``) in ``out``, in file-name order."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("*-seed*.json"))]


def by_preset(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs grouped by preset, in the order of ``PRESETS``."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["preset"], []).append(run)
    return {preset: groups[preset] for preset in PRESETS if preset in groups}


def summary_table(runs: list[dict]) -> tuple[str, dict]:
    """``methods.md``'s table and ``methods.json``'s content: per preset, the final paired gain (mean over seeds),
    wall time, and the NFE at which it first reached flow_grpo's final score."""
    groups = by_preset(runs)
    reference = groups.get("flow_grpo")
    target = None
    if reference:
        target = sum(r["curve"][-1]["overall"]["diff"] for r in reference) / len(reference)
    unit = budget_unit(runs)
    label = "NFE" if unit == "nfe" else "training s"
    lines = [f"| preset | seeds | {label} budget | iterations | final gain | SE | z | seed SD | wall s | {label} to reach "
             "flow_grpo's final gain (share of budget) |", "|---|---|---|---|---|---|---|---|---|---|"]
    table = {}
    for preset, group in groups.items():
        finals = [r["curve"][-1]["overall"] for r in group]
        gain, se, spread = seed_mean([f["diff"] for f in finals], [f["se"] for f in finals])
        reached = None
        if target is not None:
            mean_curve = [sum(r["curve"][k]["overall"]["diff"] for r in group) / len(group)
                          for k in range(min(len(r["curve"]) for r in group))]
            hit = next((k for k, value in enumerate(mean_curve) if value >= target), None)
            if hit is not None:
                reached = sum(r["curve"][hit][unit] for r in group) / len(group)
        budget = group[0]["budget"]
        wall = sum(r["wall_s"] for r in group) / len(group)
        iterations = sum(r["iterations"] for r in group) / len(group)
        reach = "not reached" if reached is None else f"{reached:.0f} ({reached / budget:.0%})"
        shown_spread = "" if spread is None else f"{spread:.3f}"
        lines.append(f"| {preset} | {len(group)} | {budget:g} | {iterations:.0f} | {gain:+.3f} | {se:.3f} | "
                     f"{gain / se if se else float('nan'):.1f} | {shown_spread} | {wall:.0f} | {reach} |")
        table[preset] = {"seeds": [r["seed"] for r in group], "final_gain": gain, "se": se, "seed_sd": spread,
                         "finals": [f["diff"] for f in finals], "wall_s": wall, f"{unit}_to_reach_flow_grpo": reached,
                         "curves": [r["curve"] for r in group]}
    text = "\n".join(lines) + "\n"
    if target is not None and target <= 0:
        text += (f"\nflow_grpo's final gain is {target:+.3f} (not above the base), so every curve point at or above it "
                 "'reaches' it: the last column is no evidence of sample efficiency here.\n")
    return text, {"budget_unit": unit, "flow_grpo_final_gain": target, "presets": table}


def budget_unit(runs: list[dict]) -> str:
    """``"nfe"`` or ``"wall_s"``: what the runs' budget counts (runs of both kinds are never compared)."""
    units = {r.get("budget_unit", "nfe") for r in runs}
    if len(units) != 1:
        raise SystemExit(f"runs with NFE and wall-time budgets are mixed in one folder ({sorted(units)}): use --out")
    return units.pop()


def curve_table(runs: list[dict]) -> str:
    """Per preset, the paired gain at each curve point (mean over the given runs' seeds) and the final gain with its
    SE (``seed_mean``), z, seed SD and mean wall time; the curve points are labelled by their NFE target."""
    groups = by_preset(runs)
    points = min(len(r["curve"]) for r in runs)
    budget = runs[0]["budget"]
    if budget_unit(runs) == "nfe":
        labels = " / ".join(f"{budget * (k + 1) / points / 1000:g}k" for k in range(points)) + " NFEs"
    else:
        labels = " / ".join(f"{budget * (k + 1) / points:.0f}" for k in range(points)) + " training s"
    lines = [f"| preset | seeds | iterations | gain at {labels} | final gain ± SE (z) | seed SD | wall s |",
             "|---|---|---|---|---|---|---|"]
    for preset, group in groups.items():
        curve = [sum(r["curve"][k]["overall"]["diff"] for r in group) / len(group) for k in range(points)]
        finals = [r["curve"][-1]["overall"] for r in group]
        gain, se, spread = seed_mean([f["diff"] for f in finals], [f["se"] for f in finals])
        iterations = sum(r["iterations"] for r in group) / len(group)
        wall = sum(r["wall_s"] for r in group) / len(group)
        seeds = ", ".join(str(r["seed"]) for r in group)
        lines.append(f"| {preset} | {seeds} | {iterations:.0f} | {' / '.join(f'{g:+.3f}' for g in curve)} | "
                     f"{gain:+.3f} ± {se:.3f} ({gain / se if se else float('nan'):.1f}) | "
                     f"{'' if spread is None else f'{spread:.3f}'} | {wall:.0f} |")
    return "\n".join(lines)


def seed_mean(gains: list[float], ses: list[float]) -> tuple[float, float, float | None]:
    """``(mean gain, its SE, seed SD)`` over seeds. With one seed the SE is the evaluation's paired SE (SD None); with
    several it is ``max(SD / sqrt(n), sqrt(sum se^2) / n)``: the spread between seeds already contains the evaluation
    noise and the training noise, and the floor keeps a lucky agreement of few seeds from looking exact."""
    n = len(gains)
    mean = sum(gains) / n
    evaluation = math.sqrt(sum(se**2 for se in ses)) / n
    if n == 1:
        return mean, evaluation, None
    spread = math.sqrt(sum((g - mean) ** 2 for g in gains) / (n - 1))
    return mean, max(spread / math.sqrt(n), evaluation), spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--budget", type=int, default=25_600, help="NFEs per run (40 flow_grpo iterations of 640)")
    parser.add_argument("--wall-budget", type=float, default=None, metavar="SECONDS",
                        help="budget every run by training wall time instead of NFEs")
    parser.add_argument("--curve-points", type=int, default=4)
    parser.add_argument("--images-per-prompt", type=int, default=16)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    parser.add_argument("--out", default=str(REPO / "bench/results/methods"))
    parser.add_argument("--report", action="store_true", help="only rebuild the tables from finished runs")
    parser.add_argument("--child", nargs=2, metavar=("PRESET", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        preset, seed = args.child[0], int(args.child[1])
        budget, unit = (args.budget, "nfe") if args.wall_budget is None else (args.wall_budget, "wall_s")
        result = run_one(preset, seed, budget, args.curve_points, args.images_per_prompt, args.set, out, unit)
        (out / f"{preset}-seed{seed}.json").write_text(json.dumps(result, indent=1))
        return
    if not args.report:
        unknown = sorted(set(args.presets.split(",")) - set(PRESETS))
        if unknown:
            parser.error(f"unknown presets {unknown}: choose from {', '.join(PRESETS)}")
        for seed in (int(s) for s in args.seeds.split(",")):
            for preset in args.presets.split(","):
                if (out / f"{preset}-seed{seed}.json").exists():
                    print(f"{preset} seed {seed}: done, skipped")
                    continue
                command = [sys.executable, __file__, "--child", preset, str(seed), "--budget", str(args.budget),
                           "--curve-points", str(args.curve_points), "--images-per-prompt",
                           str(args.images_per_prompt), "--out", str(out)]
                if args.wall_budget is not None:
                    command += ["--wall-budget", str(args.wall_budget)]
                for item in args.set:
                    command += ["--set", item]
                done = subprocess.run(command, cwd=REPO)
                if done.returncode != 0:
                    raise SystemExit(f"{preset} seed {seed} failed (exit {done.returncode})")
    report(out)


if __name__ == "__main__":
    main()
