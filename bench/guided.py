"""Held-out toy-GenEval accuracy against the NFE budget for best-of-N, FK steering, DTS* and RGS.

Every method samples the held-out prompts (assets/prompts/test.jsonl) with the same per-prompt randomness, guided by
the toy verifier with partial credit (``toy_geneval``), and its chosen images are judged with the binary GenEval
rules. Plain ODE sampling (``none``, T NFEs) is the reference. RGS needs a gradient source, a register checkpoint
(``--registers``; trained with ``flowalign prep registers``; its stored held-out pairwise accuracy by sigma band is
copied into the results) or a differentiable image reward (``--rgs-reward toy_geneval_soft``, with ``--rgs-gradient
full|x0``), and is skipped without one.

Writes JSON (``--out``), a markdown table (same name, ``.md``) and a PNG plot (``.png``; drawn with matplotlib), and prints
the table. The targets of issue 7 are checked and reported, met or not:

* DTS* or FK reaches best-of-N's accuracy at <= 1/2 of its NFEs;
* RGS beats plain sampling at <= 1.5x its NFEs.

    python bench/guided.py --repeats 8 --steps 10 --budgets 10 20 40 80 [--registers outputs/registers/registers.pt]
    python bench/guided.py --methods fk rgs --fk-guided --rgs-reward toy_geneval_soft --rgs-gradient x0 \
        --rgs-bands 0.2:1.0 --budgets 10 20 40 80     # RGS on the differentiable toy reward, FK with RGS proposals
    python bench/guided.py --max-prompts 2 --repeats 1 --steps 3 --budgets 3 6     # smoke size

FK runs with ``--fk-resampling flowalign`` here unless told otherwise (the scheme of the recorded results);
``--fk-resampling reference`` (``flowalign sample``'s default) with ``--fk-adaptive``, ``--fk-resample-every`` and
``--fk-resample-end`` runs it as the reference code does.

Each held-out prompt is sampled ``--repeats`` times with its own seeds; every method sees the same seeds, so each
row's gain over plain sampling is paired image by image, with its standard error.
"""

from __future__ import annotations

import argparse
import sys
import dataclasses
import json
import math
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot import line_plot  # noqa: E402 - bench/plot.py (imported now: loading a pipeline drops sys.path[0])
METHODS = ("bon", "fk", "dts", "rgs", "euphonium")
COLORS = {"none": (120, 120, 120), "bon": (31, 119, 180), "fk": (255, 127, 14), "dts": (44, 160, 44),
          "rgs": (214, 39, 40), "euphonium": (148, 103, 189)}


def run_method(model, metadata, config, reward_fn, registers, guide_reward=None) -> dict:
    from flowalign.evaluation.geneval import summarize
    from flowalign.inference.sample import sample_prompts
    from flowalign.toy.reward import ToyGenEvalReward

    start_time = time.perf_counter()
    images, rewards, nfes = sample_prompts(model, metadata, config, reward_fn=reward_fn, registers=registers,
                                           guide_reward=guide_reward)
    correct = ToyGenEvalReward()(images, [m["prompt"] for m in metadata], list(metadata))
    rows = [{"prompt_id": p, "prompt": m["prompt"], "tag": m["tag"], "correct": bool(c)}
            for p, (m, c) in enumerate(zip(metadata, correct.tolist()))]
    summary = summarize(rows)
    nfe = nfes.double()
    return {"overall": summary["overall"], "images_correct": summary["images_correct"], "images": rows,
            "mean_reward": float(rewards.nanmean()), "mean_nfe": float(nfe.mean()),
            "max_nfe": int(nfe.max()), "seconds": time.perf_counter() - start_time}


def check_targets(rows: list[dict]) -> dict:
    """The issue's two targets, from the measured rows."""
    by = {(r["method"], r["budget"]): r for r in rows}
    bon = sorted((r for r in rows if r["method"] == "bon"), key=lambda r: r["budget"])
    matches = []
    for target in bon:
        for method in ("dts", "fk"):
            for r in rows:
                if r["method"] == method and r["max_nfe"] <= target["budget"] / 2 and r["overall"] >= target["overall"]:
                    matches.append({"method": method, "budget": r["budget"], "bon_budget": target["budget"]})
    plain = by.get(("none", min((r["budget"] for r in rows if r["method"] == "none"), default=0)))
    # "Improves" means a paired gain of at least two standard errors, not just a higher mean.
    rgs_ok = [r for r in rows if r["method"] == "rgs" and plain and r["max_nfe"] <= 1.5 * plain["max_nfe"]
              and r.get("gain", 0.0) > 2 * r.get("gain_se", math.inf)]
    return {"dts_or_fk_matches_bon_at_half_nfe": bool(matches), "matches": matches,
            "rgs_beats_plain_within_1.5x": bool(rgs_ok) if any(r["method"] == "rgs" for r in rows) else None}


def add_paired_gains(rows: list[dict]) -> None:
    """Each row's paired gain over plain ODE sampling (``none``): the same prompts and seeds, so the difference is
    paired image by image (``toy_eval.paired_difference``: per-tag means, GenEval's unweighted overall, its SE)."""
    from flowalign.evaluation.toy_eval import paired_difference

    def keyed(row):
        return [{**image, "image_index": 0} for image in row["images"]]

    plain = next(r for r in rows if r["method"] == "none")
    for row in rows:
        overall = paired_difference(keyed(plain), keyed(row))["overall"]
        row["gain"], row["gain_se"] = overall["diff"], overall["se"]


def table(rows: list[dict]) -> str:
    lines = ["| method | budget (NFE/prompt) | mean NFE | toy GenEval overall | paired gain over plain | SE | "
             "images correct | mean guide reward |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['budget']} | {r['mean_nfe']:.1f} | {r['overall']:.3f} | {r['gain']:+.3f} | "
                     f"{r['gain_se']:.3f} | {r['images_correct']:.3f} | {r['mean_reward']:.3f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy against mean NFEs, one polyline per method."""
    series: dict[str, list[tuple]] = {}
    for r in rows:
        series.setdefault(r["method"], []).append((r["mean_nfe"], r["overall"]))
    ys = [r["overall"] for r in rows]
    low, high = max(0.0, min(ys) - 0.05), min(1.0, max(ys) + 0.05)
    line_plot(series, path, x_label="NFEs per prompt", y_label="toy GenEval overall (held-out)", colors=COLORS,
              x_range=(0.0, max(r["mean_nfe"] for r in rows) * 1.05 or 1.0),
              y_range=(low, high if high > low else low + 0.1))


def main() -> None:
    from flowalign.cli import sigma_band
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.inference import EuphoniumSettings, FKSettings
    from flowalign.inference.sample import RGS_GRADIENTS, SampleConfig, build_guide_reward
    from flowalign.models.loading import load_flow_model
    from flowalign.samplers.fk import RESAMPLING
    from flowalign.samplers.guided import BudgetTooSmall
    from flowalign.toy.reward import ToyGenEvalReward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "assets/toy-sd3"))
    parser.add_argument("--prompts", default=str(REPO / "assets/prompts/test.jsonl"))
    parser.add_argument("--max-prompts", type=int, default=66, help="the first M held-out prompts")
    parser.add_argument("--repeats", type=int, default=8,
                        help="samples per prompt, each with its own seed (66 x 8 = 528 images per method and budget)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--budgets", type=int, nargs="+", default=[10, 20, 40, 80])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--budget-of", action="append", default=[], metavar="METHOD=BUDGETS",
                        help="this method's budgets instead of --budgets (comma-separated), e.g. bon=80 fk=40")
    parser.add_argument("--registers", default=None, help="register checkpoint for RGS (skipped without)")
    parser.add_argument("--rgs-reward", default=None,
                        help="differentiable image reward for RGS's gradient on x0_hat (e.g. toy_geneval_soft)")
    parser.add_argument("--rgs-gradient", choices=RGS_GRADIENTS, default="full",
                        help="--rgs-reward's gradient through the velocity (full) or on x0_hat alone (x0)")
    parser.add_argument("--fk-guided", action="store_true",
                        help="FK with RGS-guided proposals from --rgs-reward (needs --rgs-gradient x0)")
    parser.add_argument("--rgs-bands", type=sigma_band, nargs="+", default=[tuple(b) for b in FKSettings().bands],
                        metavar="SIGMA:SCALE", help="RGS correction scale above each sigma, highest first")
    parser.add_argument("--noise-level", type=float, default=FKSettings().noise_level, help="FK / DTS SDE noise")
    parser.add_argument("--lam", type=float, default=FKSettings().lam, help="FK / DTS inverse temperature")
    parser.add_argument("--potential", default=FKSettings().potential, help="FK potential")
    parser.add_argument("--fk-resample-start", type=int, default=FKSettings().resample_start,
                        help="first step at which FK may resample")
    parser.add_argument("--fk-resampling", "--fk-semantics", choices=RESAMPLING, default="flowalign",
                        help="FK's resampling scheme (flowalign sample --fk-resampling; --fk-semantics is its old "
                             "name): flowalign, the default here, is the scheme of the recorded results; reference "
                             "is flowalign sample's default")
    parser.add_argument("--fk-adaptive", action="store_true",
                        help="FK (reference resampling): resample only when ESS < N/2")
    parser.add_argument("--fk-resample-every", type=int, default=FKSettings().resample_every,
                        help="FK (reference resampling): steps between resampling steps")
    parser.add_argument("--fk-resample-end", type=int, default=FKSettings().resample_end,
                        help="FK (reference resampling): last scheduled resampling step before the final one")
    parser.add_argument("--euphonium-scale", type=float, default=EuphoniumSettings().scale,
                        help="Euphonium-guided sampling's scale (its gradient source: --rgs-reward / --registers)")
    parser.add_argument("--euphonium-start", type=float, default=EuphoniumSettings().start,
                        help="Euphonium-guided sampling's first guided fraction of the steps")
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench/results/guided.json"))
    args = parser.parse_args()

    metadata = load_metadata(args.prompts)[: args.max_prompts] * args.repeats
    model = load_flow_model(args.model)
    model.transformer.requires_grad_(False)
    reward_fn = ToyGenEvalReward(partial_credit=True)
    registers, register_report = None, None
    guide_reward = build_guide_reward(args.rgs_reward) if args.rgs_reward else None
    if args.registers:
        from flowalign.reward_models.latent_registers import load_registers, read_checkpoint

        registers = load_registers(args.registers, dict(model.transformer.config))
        register_report = read_checkpoint(args.registers)["extra"].get("held_out")

    # Finished rows are kept in <out>.partial.jsonl and reused when the settings match, so a long run can resume.
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compared as JSON sees them (tuples such as the RGS bands come back from the file as lists).
    settings = json.loads(json.dumps({k: v for k, v in vars(args).items() if k != "methods"}))
    partial = out.with_suffix(".partial.jsonl")
    done = {}
    if partial.exists():
        for line in partial.read_text().splitlines():
            row = json.loads(line)
            if row.pop("settings") == settings:
                done[(row["method"], row["budget"])] = row
    rows = []

    def record(method, budget):
        if (method, budget) in done:
            rows.append(done[(method, budget)])
            print(f"{method:>4} budget {budget:>4}: done, reused", flush=True)
            return
        guided = method in ("rgs", "euphonium") or (method == "fk" and args.fk_guided)
        config = SampleConfig(guidance=method, budget=budget, steps=args.steps, seed=args.seed,
                              batch_prompts=args.batch_prompts, registers=args.registers, rgs_bands=args.rgs_bands,
                              rgs_reward=args.rgs_reward if guided else None,
                              rgs_gradient=args.rgs_gradient if guided else "full",
                              noise_level=args.noise_level, lam=args.lam, potential=args.potential,
                              fk_resample_start=args.fk_resample_start)
        if method == "fk":
            config.sampler = dataclasses.replace(config.sampler, resampling=args.fk_resampling,
                                                 adaptive=args.fk_adaptive, resample_every=args.fk_resample_every,
                                                 resample_end=args.fk_resample_end)
        if method == "euphonium":
            config.sampler = dataclasses.replace(config.sampler, scale=args.euphonium_scale,
                                                 start=args.euphonium_start)
        config.validate()
        try:
            result = run_method(model, metadata, config, reward_fn, registers, guide_reward if guided else None)
        except BudgetTooSmall as error:
            print(f"{method:>4} budget {budget:>4}: skipped ({error})", flush=True)
            return
        row = {"method": method, "budget": budget, **result}
        rows.append(row)
        with partial.open("a") as handle:
            handle.write(json.dumps({**row, "settings": settings}) + "\n")
        print(f"{method:>4} budget {budget:>4}: overall {row['overall']:.3f}, mean NFE {row['mean_nfe']:.1f}", flush=True)

    own_budgets = {name: [int(b) for b in budgets.split(",")]
                   for name, budgets in (item.split("=", 1) for item in args.budget_of)}
    record("none", args.steps)
    for method in args.methods:
        if method in ("rgs", "euphonium") and registers is None and guide_reward is None:
            print(f"{method}: skipped (no --registers or --rgs-reward)")
            continue
        for budget in own_budgets.get(method, args.budgets):
            if budget >= args.steps:
                record(method, budget)

    add_paired_gains(rows)
    result = {"settings": vars(args), "prompts": len(metadata), "rows": rows, "targets": check_targets(rows),
              "register_accuracy": register_report}
    out.write_text(json.dumps(result, indent=1))
    text = table(rows)
    if register_report:
        from flowalign.prep.train_registers import format_accuracy

        text += "\n\nRegister pairwise accuracy by sigma band (held-out):\n\n" + format_accuracy(register_report)
    out.with_suffix(".md").write_text(text + "\n")
    plot(rows, out.with_suffix(".png"))
    print(text)
    print("targets:", json.dumps(result["targets"]))


if __name__ == "__main__":
    main()
