"""The satisfaction-diversity frontier: K candidates per prompt from best-of-N, FK steering, DTS* and SatisDive.

Every configuration samples the held-out prompts (``assets/prompts/test.jsonl``, the first ``--max-prompts``, each
``--repeats`` times with its own seeds; every configuration sees the same seeds) with ``flowalign sample
--candidates K`` (``sample_prompts``), scored by the toy verifier with partial credit (``toy_geneval``, which FK,
DTS and best-of-N choose with; SatisDive steers with the differentiable ``toy_geneval_soft`` and reports
``toy_geneval``). Per set of ``K`` images:

* **worst-candidate reward**: the lowest ``toy_geneval`` reward of the set (the set's reward floor);
* **all correct**: whether every candidate passes the binary GenEval rules;
* **diversity**: the mean pairwise cosine distance of the ``toy_scene`` embeddings (``flowalign.embeddings``).

Rows are method settings at their measured NFEs: best-of-N over N (``--bon-budgets``; K = N is plain sampling),
FK over lambda (``--fk-lams`` at ``--fk-budget``, ``K`` particles), DTS* (``--dts-budget``) and SatisDive over its
floor Delta (``--satisdive-deltas``). Each row's worst-candidate reward is also paired set by set against plain
sampling's (best-of-N at ``N = K``), with its SE. The Pareto check: where SatisDive's and FK's diversity ranges
overlap, is SatisDive's upper envelope (worst reward against diversity, piecewise linear) above every FK point?

Writes JSON (``--out``), a markdown table (``.md``) and a PNG scatter of worst-candidate reward against diversity
(``.png``; matplotlib).

    python bench/guided_sets.py --max-prompts 66 --repeats 2        # 132 sets, 528 images per row
    python bench/guided_sets.py --max-prompts 2 --repeats 1 --steps 3 --fk-budget 12 --bon-budgets 12 \
        --fk-lams 10 --satisdive-deltas 0.25 --dts-budget 12      # smoke size
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot import line_plot  # noqa: E402 - bench/plot.py (imported now: loading a pipeline drops sys.path[0])
COLORS = {"bon": (31, 119, 180), "fk": (255, 127, 14), "dts": (44, 160, 44), "satisdive": (214, 39, 40)}


def measure(model, metadata, config, reward_fn, embedding, guide_reward=None) -> dict:
    """One configuration: per-set worst and mean reward, all-correct, diversity; means and wall time."""
    from flowalign.inference.sample import measure_diversity, sample_prompts, set_summary
    from flowalign.toy.reward import ToyGenEvalReward

    start = time.perf_counter()
    images, rewards, nfes = sample_prompts(model, metadata, config, reward_fn=reward_fn, guide_reward=guide_reward)
    seconds = time.perf_counter() - start
    k = rewards.shape[1]
    flat = images.flatten(0, 1)
    entries = [m for m in metadata for _ in range(k)]
    correct = ToyGenEvalReward()(flat, [m["prompt"] for m in entries], entries).reshape(len(metadata), k).bool()
    diversity = measure_diversity(images, embedding)
    sets = set_summary(rewards, diversity)
    worst = [s["worst_reward"] for s in sets["sets"]]
    return {"worst": worst, "all_correct": correct.all(dim=1).double().tolist(),
            "any_correct": correct.any(dim=1).double().tolist(), "diversity": diversity.tolist(),
            "mean_worst": sets["mean_worst_reward"], "mean_reward": float(rewards.double().nanmean()),
            "mean_all_correct": float(correct.all(dim=1).double().mean()),
            "mean_any_correct": float(correct.any(dim=1).double().mean()),
            "mean_diversity": sets["mean_diversity"], "mean_nfe": float(nfes.double().mean()),
            "max_nfe": int(nfes.max()), "seconds": seconds}


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``b - a`` over sets and its standard error."""
    d = torch.tensor(b, dtype=torch.float64) - torch.tensor(a, dtype=torch.float64)
    return float(d.mean()), float(d.std(unbiased=True) / math.sqrt(d.numel())) if d.numel() > 1 else math.nan


def upper_envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (diversity, worst) not dominated by another (more diverse and at least as good), by diversity."""
    kept = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not kept or y > kept[-1][1]:
            kept.append((x, y))
    return sorted(kept)


def pareto_check(rows: list[dict]) -> dict:
    """Whether SatisDive's frontier lies above FK's points over their overlapping diversity range."""
    sat = [(r["mean_diversity"], r["mean_worst"]) for r in rows if r["method"] == "satisdive"]
    fk = [(r["mean_diversity"], r["mean_worst"], r["label"]) for r in rows if r["method"] == "fk"]
    if len(sat) < 1 or not fk:
        return {"checked": False}
    envelope = upper_envelope(sat)
    lo, hi = min(x for x, _ in sat), max(x for x, _ in sat)
    verdicts = []
    for x, y, label in fk:
        if not lo <= x <= hi:
            verdicts.append({"fk": label, "in_range": False})
            continue
        # the best SatisDive reward at diversity >= x (a point of its frontier that is at least as diverse)
        best = max(sy for sx, sy in envelope if sx >= x)
        verdicts.append({"fk": label, "in_range": True, "fk_worst": y, "satisdive_worst_at_least_as_diverse": best,
                         "dominated": best >= y})
    in_range = [v for v in verdicts if v["in_range"]]
    # each SatisDive point: the baseline points (best-of-N, FK, DTS) at least as diverse and at least as good
    baselines = [(r["mean_diversity"], r["mean_worst"], f"{r['method']} {r['label']}") for r in rows
                 if r["method"] != "satisdive"]
    dominated_by = {label: [b for bx, by, b in baselines if bx >= x and by >= y]
                    for x, y, label in ((r["mean_diversity"], r["mean_worst"], r["label"]) for r in rows
                                        if r["method"] == "satisdive")}
    return {"checked": True, "overlap": [lo, hi], "fk_points": verdicts,
            "satisdive_dominates": bool(in_range) and all(v["dominated"] for v in in_range),
            "satisdive_points_dominated_by": dominated_by}


def table(rows: list[dict], k: int, embedding: str) -> str:
    lines = [f"K = {k} candidates per prompt; diversity: mean pairwise cosine distance of `{embedding}` embeddings.",
             "",
             "| method | setting | mean NFE | worst-candidate reward | paired vs plain | SE | mean reward | "
             "all K correct | any correct | diversity | s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['label']} | {r['mean_nfe']:.1f} | {r['mean_worst']:.3f} | "
                     f"{r['gain']:+.3f} | {r['gain_se']:.3f} | {r['mean_reward']:.3f} | {r['mean_all_correct']:.3f} | "
                     f"{r['mean_any_correct']:.3f} | {r['mean_diversity']:.3f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Worst-candidate reward against diversity, one polyline per method in order of diversity."""
    series: dict[str, list[tuple]] = {}
    for r in rows:
        series.setdefault(r["method"], []).append((r["mean_diversity"], r["mean_worst"], r["label"]))
    line_plot(series, path, x_label="set diversity (toy_scene cosine distance)",
              y_label="worst-candidate reward (toy_geneval, held-out)", colors=COLORS)


def main() -> None:
    from flowalign.embeddings import build_embedding
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.inference import SAMPLERS
    from flowalign.inference.sample import SampleConfig, build_guide_reward
    from flowalign.models.loading import load_flow_model
    from flowalign.toy.reward import ToyGenEvalReward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "assets/toy-sd3"))
    parser.add_argument("--prompts", default=str(REPO / "assets/prompts/test.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=66)
    parser.add_argument("--repeats", type=int, default=2, help="sets per prompt, each with its own seeds")
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bon-budgets", type=int, nargs="*", default=[40, 80, 160])
    parser.add_argument("--fk-budget", type=int, default=40)
    parser.add_argument("--fk-lams", type=float, nargs="*", default=[1.0, 3.0, 10.0, 30.0],
                        help="FK rows as flowalign sample runs it (reference semantics, fixed resampling)")
    parser.add_argument("--fk-adaptive-lams", type=float, nargs="*", default=[],
                        help="FK rows with adaptive resampling (--fk-adaptive: only when ESS < N/2)")
    parser.add_argument("--dts-budget", type=int, default=40, help="0 skips DTS*")
    parser.add_argument("--satisdive-deltas", type=float, nargs="*", default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--satisdive", action="append", default=[], metavar="KEY=VALUE",
                        help="another SatisDive setting for every SatisDive row (e.g. step=0.03)")
    parser.add_argument("--satisdive-variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="SatisDive rows at every delta with these settings too (repeat; '' = the defaults)")
    parser.add_argument("--embedding", default="toy_scene")
    parser.add_argument("--batch-prompts", type=int, default=33)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench/results/guided_sets.json"))
    args = parser.parse_args()

    metadata = load_metadata(args.prompts)[: args.max_prompts] * args.repeats
    model = load_flow_model(args.model)
    model.transformer.requires_grad_(False)
    reward_fn = ToyGenEvalReward(partial_credit=True)
    embedding = build_embedding(args.embedding)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # rows are reused from an earlier run of the same world (prompts, seeds, K, steps, embedding); each row's own
    # settings are in its label, so a later run may add rows (another FK mode, another SatisDive step)
    shared = ("model", "prompts", "max_prompts", "repeats", "candidates", "steps", "embedding", "seed")
    settings = json.loads(json.dumps({key: getattr(args, key) for key in shared}))
    partial = out.with_suffix(".partial.jsonl")
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            row = json.loads(line)
            if row.pop("settings") == settings:
                done[(row["method"], row["label"])] = row
    rows = []

    def record(method: str, label: str, budget: int | None, guide=None, **sampler):
        if (method, label) in done:
            rows.append(done[(method, label)])
            print(f"{method} {label}: reused", flush=True)
            return
        # budget None: the method spends what its settings cost (SatisDive), set below once the sampler is known
        config = SampleConfig(guidance=method, budget=1 if budget is None else budget, steps=args.steps, seed=args.seed,
                              candidates=args.candidates, batch_prompts=args.batch_prompts)
        if sampler:
            config.sampler = dataclasses.replace(config.sampler, **sampler)
        if budget is None:
            config.budget = budget = config.build_sampler().needed_nfe(config)
        config.validate()
        row = {"method": method, "label": label, "budget": budget, "sampler": dataclasses.asdict(config.sampler),
               **measure(model, metadata, config, reward_fn, embedding, guide)}
        rows.append(row)
        with partial.open("a") as handle:
            handle.write(json.dumps({**row, "settings": settings}) + "\n")
        print(f"{method} {label}: worst {row['mean_worst']:.3f}, diversity {row['mean_diversity']:.3f}, "
              f"NFE {row['mean_nfe']:.0f}, {row['seconds']:.0f} s", flush=True)

    k = args.candidates
    for budget in args.bon_budgets:
        record("bon", f"N={budget // args.steps}", budget)
    for lam in args.fk_lams:
        record("fk", f"lam={lam:g}", args.fk_budget, lam=lam)
    for lam in args.fk_adaptive_lams:  # resampling only when the ESS falls below N/2
        record("fk", f"lam={lam:g} adaptive", args.fk_budget, lam=lam, adaptive=True)
    if args.dts_budget:
        record("dts", f"budget={args.dts_budget}", args.dts_budget)
    if "satisdive" in SAMPLERS and args.satisdive_deltas:
        guide = build_guide_reward("toy_geneval_soft")
        extra = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.satisdive)}
        for variant in args.satisdive_variant or [""]:
            settings_of = {**extra, **{key: json.loads(value) for key, value in
                                       (item.split("=", 1) for item in variant.split(",") if item)}}
            suffix = "".join(f" {key}={value}" for key, value in settings_of.items() if key != "gradient")
            for delta in args.satisdive_deltas:
                record("satisdive", f"delta={delta:g}{suffix}", None, guide, reward="toy_geneval_soft",
                       delta=delta, **settings_of)

    plain = next((r for r in rows if r["method"] == "bon" and r["label"] == f"N={k}"), None)
    for row in rows:
        row["gain"], row["gain_se"] = paired(plain["worst"], row["worst"]) if plain else (math.nan, math.nan)
    result = {"settings": vars(args), "sets": len(metadata), "images_per_row": len(metadata) * k, "rows": rows,
              "pareto": pareto_check(rows)}
    out.write_text(json.dumps(result, indent=1))
    text = table(rows, k, args.embedding)
    out.with_suffix(".md").write_text(text + "\n\nPareto check: " + json.dumps(result["pareto"]) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(text)
    print("pareto:", json.dumps(result["pareto"]))


if __name__ == "__main__":
    main()
