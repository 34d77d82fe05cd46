"""SOAR against SFT on the toy world: at equal optimizer steps and at equal forward passes, guidance 1 and 3.

Both train from the toy model on the same data (the exact scenes of the training prompts, configs/methods/soar.yaml
and sft.yaml). SOAR trains ``--iterations`` iterations; SFT trains the same number (equal optimizer steps, evaluated
there) and then continues until its cumulative NFEs reach SOAR's (equal forward passes: SOAR spends about 9 per pair,
SFT 1). Each point is evaluated with held-out toy GenEval (the exact verifier, 10 ODE steps, the EMA weights) at every
``--guidance`` on the same captions and seeds as the base model, so gains are paired with their standard errors, and
SOAR is also paired directly against SFT. The exposure-bias probe (``flowalign.evaluation.exposure``: the ``x0_hat``
error against the data at mid-noise on the model's own ODE trajectory, and its gap over teacher forcing) runs before
and after at every guidance.

    python bench/soar.py [--iterations 200] [--images-per-prompt 16] [--probe-count 64] [--seeds 0 1 2]
                         [--guidance 1 3] [--out bench/results/soar] [--set key=value ...]
                         [--soar-set key=value ...] [--sft-set key=value ...]

Writes ``<out>/soar-seed<k>.json`` per seed and ``<out>/soar.md`` (every seed's table).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["train.tracker=none", "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0",
          "train.overwrite=true"]


def _trainer(preset: str, seed: int, iterations: int, out: Path, extra: list[str]):
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    overrides = [*COMMON, f"train.seed={seed}", f"train.iterations={iterations}",
                 f"train.out_dir={out / f'{preset}-seed{seed}.run'}", *extra]
    return Trainer(load_config(TrainConfig, REPO / "configs/methods" / f"{preset}.yaml", overrides))


def _evaluate(trainer, metadata, guidance: list[float], args, seed: int, *, reference: bool) -> dict:
    """Toy GenEval results and the probe at each guidance, of the reference (LoRA off) or the EMA weights."""
    from flowalign.evaluation.exposure import exposure_bias
    from flowalign.evaluation.toy_eval import evaluate

    model = trainer.model
    model.transformer.eval()
    out = {}
    with model.reference() if reference else trainer.ema_weights():
        for g in guidance:
            results, _, _ = evaluate(model, metadata, steps=10, images_per_prompt=args.images_per_prompt,
                                     seed=10_000 + seed, guidance_scale=g, batch_size=args.batch_size)
            probe = exposure_bias(model, trainer.config.objectives[next(iter(trainer.config.objectives))].data,
                                  count=args.probe_count, guidance_scale=g, seed=20_000 + seed,
                                  image_size=trainer.config.sampling.image_size, batch_size=args.batch_size)
            out[g] = {"results": results, "probe": probe}
    return out


def _train(trainer, iterations: int, state: dict) -> None:
    """``iterations`` more steps; ``state`` accumulates ``iterations``, ``nfe`` and ``wall_s``."""
    for _ in range(iterations):
        start = time.perf_counter()
        metrics = trainer.step()
        state["wall_s"] += time.perf_counter() - start
        state["iterations"] += 1
        state["nfe"] += int(metrics["nfe"])
        state.setdefault("nfe_per_iteration", metrics["nfe"])


def _point(name: str, state: dict, base: dict, after: dict) -> dict:
    from flowalign.evaluation.exposure import paired_rows
    from flowalign.evaluation.toy_eval import paired_difference

    point = {"run": name, **{k: state[k] for k in ("iterations", "nfe", "wall_s")}, "guidance": {}}
    for g in base:
        paired = paired_difference(base[g]["results"], after[g]["results"])
        point["guidance"][g] = {"geneval": paired["overall"], "tags": paired["tags"],
                                "probe_generated": paired_rows(base[g]["probe"], after[g]["probe"], "generated"),
                                "probe_gap": paired_rows(base[g]["probe"], after[g]["probe"], "gap")}
    return point


def run_seed(seed: int, args) -> dict:
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import paired_difference

    out = Path(args.out)
    soar = _trainer("soar", seed, args.iterations, out, [*args.set, *args.soar_set])
    metadata = load_metadata(soar.config.data.eval_prompts)
    base = _evaluate(soar, metadata, args.guidance, args, seed, reference=True)
    soar_state = {"iterations": 0, "nfe": 0, "wall_s": 0.0}
    _train(soar, args.iterations, soar_state)
    soar_after = _evaluate(soar, metadata, args.guidance, args, seed, reference=False)
    del soar

    sft = _trainer("sft", seed, args.iterations, out, [*args.set, *args.sft_set])
    sft_state = {"iterations": 0, "nfe": 0, "wall_s": 0.0}
    _train(sft, args.iterations, sft_state)
    steps_after = _evaluate(sft, metadata, args.guidance, args, seed, reference=False)
    points = [_point("soar", soar_state, base, soar_after), _point("sft, equal steps", sft_state, base, steps_after)]
    more = max(0, math.ceil((soar_state["nfe"] - sft_state["nfe"]) / sft_state["nfe_per_iteration"]))
    sft.config.train.iterations = sft_state["iterations"] + more
    _train(sft, more, sft_state)
    nfe_after = _evaluate(sft, metadata, args.guidance, args, seed, reference=False) if more else steps_after
    points.append(_point("sft, equal NFEs", sft_state, base, nfe_after))
    head_to_head = {}
    for name, other in (("equal steps", steps_after), ("equal NFEs", nfe_after)):
        head_to_head[name] = {g: paired_difference(other[g]["results"], soar_after[g]["results"])["overall"]
                              for g in args.guidance}
    return {"seed": seed, "settings": vars(args), "points": points, "soar_minus_sft": head_to_head,
            "base": {g: {k: base[g]["probe"][k] for k in ("generated", "teacher", "gap")} for g in args.guidance}}


def table(report: dict) -> str:
    lines = [f"seed {report['seed']}", "",
             "| run | iterations | NFEs | guidance | GenEval gain ± SE | probe x0_hat error: before → after (paired ± SE) "
             "| probe gap over teacher forcing: before → after |", "|---|---:|---:|---:|---|---|---|"]
    for point in report["points"]:
        for g, entry in point["guidance"].items():
            gen, pg, gap = entry["geneval"], entry["probe_generated"], entry["probe_gap"]
            lines.append(f"| {point['run']} | {point['iterations']} | {point['nfe']} | {float(g):g} | {gen['diff']:+.3f} ± "
                         f"{gen['se']:.3f} | {pg['before']:.4f} → {pg['after']:.4f} ({pg['diff']:+.4f} ± "
                         f"{pg['se']:.4f}) | {gap['before']:+.4f} → {gap['after']:+.4f} |")
    lines += ["", "| SOAR − SFT (paired) | guidance | GenEval diff ± SE |", "|---|---:|---|"]
    for name, by_guidance in report["soar_minus_sft"].items():
        for g, entry in by_guidance.items():
            lines.append(f"| {name} | {float(g):g} | {entry['diff']:+.3f} ± {entry['se']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200, help="SOAR's optimizer steps (SFT: as many, then more)")
    parser.add_argument("--images-per-prompt", type=int, default=16, help="held-out toy GenEval images per prompt")
    parser.add_argument("--probe-count", type=int, default=64, help="pairs the exposure-bias probe reads")
    parser.add_argument("--guidance", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--batch-size", type=int, default=64, help="evaluation batch")
    parser.add_argument("--out", default=str(REPO / "bench/results/soar"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both presets")
    parser.add_argument("--soar-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for soar.yaml")
    parser.add_argument("--sft-set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for sft.yaml")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = []
    for seed in args.seeds:
        report = run_seed(seed, args)
        (out / f"soar-seed{seed}.json").write_text(json.dumps(report, indent=1) + "\n")
        tables.append(table(report))
        print(tables[-1], flush=True)
    (out / "soar.md").write_text("\n\n".join(tables) + "\n")


if __name__ == "__main__":
    main()
