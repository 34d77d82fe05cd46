"""VGPO's signal where Flow-GRPO has none: groups whose terminal rewards agree, on a converged prompt subset.

Flow-GRPO normalises each group's terminal rewards, so a group whose rewards all agree (every image right, or every one
wrong) gives zero advantages and is counted in ``zero_std_frac``. VGPO (docs/methods/vgpo.md) also scores the one-step
``x0_hat`` of every intermediate state; the question is whether its advantages stay non-zero in exactly those groups,
and under which variant (``reconstruction``, whose absolute term vanishes with the std, or ``std_free``).

1. The converged subset: the base toy model samples ``--images-per-prompt`` ODE images of every training prompt
   (``flowalign.evaluation.toy_eval.evaluate``); prompts whose images are judged all right or all wrong are kept.
2. ``configs/methods/vgpo.yaml`` trains on that subset for ``--iterations``; each iteration logs ``zero_std_frac`` and,
   per variant, ``vgpo/converged_signal_frac/<variant>`` (the share of the zero-std groups with a non-zero advantage
   on a trained transition) and ``vgpo/signal_frac/<variant>`` (over all groups).

    python bench/vgpo_signal.py [--iterations 6] [--images-per-prompt 8] [--out bench/results/vgpo_signal.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("reconstruction", "std_free")
COMMON = ["train.tracker=none", "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0"]


def converged_subset(config, images_per_prompt: int, seed: int) -> tuple[list[dict], dict]:
    """The training prompts whose base-model images are all right or all wrong, and the counts."""
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import evaluate
    from flowalign.training.trainer import Trainer

    model = Trainer(config).model  # the run's own model loading (the toy checkpoint by default)
    model.transformer.eval()
    metadata = load_metadata(config.data.train_prompts)
    results, _, _ = evaluate(model, metadata, steps=config.sampling.num_steps, images_per_prompt=images_per_prompt,
                             seed=seed)
    verdicts: dict[int, set[bool]] = {}
    for result in results:
        verdicts.setdefault(result["prompt_id"], set()).add(bool(result["correct"]))
    kept = [metadata[p] for p, seen in sorted(verdicts.items()) if len(seen) == 1]
    all_right = sum(1 for seen in verdicts.values() if seen == {True})
    return kept, {"prompts": len(metadata), "kept": len(kept), "all_right": all_right,
                  "all_wrong": len(kept) - all_right}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--images-per-prompt", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "bench/results/vgpo_signal.json"))
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()

    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    preset = REPO / "configs/methods/vgpo.yaml"
    with tempfile.TemporaryDirectory() as scratch:
        base = load_config(TrainConfig, preset, [*COMMON, f"train.out_dir={scratch}/probe", *args.overrides])
        kept, counts = converged_subset(base, args.images_per_prompt, args.seed)
        if not kept:
            raise SystemExit("no training prompt is converged under the base model: nothing to measure")
        subset = Path(scratch) / "converged.jsonl"
        subset.write_text("".join(json.dumps(entry) + "\n" for entry in kept))
        overrides = [*COMMON, f"train.out_dir={scratch}/run", f"train.iterations={args.iterations}",
                     f"train.seed={args.seed}", f"data.train_prompts={subset}", *args.overrides]
        start = time.perf_counter()
        history = Trainer(load_config(TrainConfig, preset, overrides)).train()
        wall = time.perf_counter() - start

    keys = ["zero_std_frac", "vgpo/converged_groups"] + [f"vgpo/{kind}/{v}" for v in VARIANTS
                                                        for kind in ("converged_signal_frac", "signal_frac")]
    rows = [{"iteration": k, **{key: float(m.get(key, math.nan)) for key in keys}} for k, m in enumerate(history)]
    mean = {key: sum(r[key] for r in rows if not math.isnan(r[key])) / max(1, sum(not math.isnan(r[key]) for r in rows))
            for key in keys}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "machine": platform.processor() or
              platform.machine(), "command": "python bench/vgpo_signal.py " + " ".join(
                  [f"--iterations {args.iterations}", f"--images-per-prompt {args.images_per_prompt}",
                   f"--seed {args.seed}", *args.overrides]),
              "subset": counts, "iterations": rows, "mean": mean, "train_wall_s": wall}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


def table(result: dict) -> str:
    """The figure as a Markdown table: per iteration, Flow-GRPO's zero-std share and VGPO's signal in those groups."""
    lines = ["| iteration | zero_std_frac (Flow-GRPO: no signal) | zero-std groups | VGPO signal in them, "
             "reconstruction | VGPO signal in them, std_free | VGPO signal, all groups (reconstruction / std_free) |",
             "|---|---|---|---|---|---|"]

    def cells(row: dict) -> str:
        return (f"{row['zero_std_frac']:.2f} | {round(row['vgpo/converged_groups'], 2):g} | "
                f"{row['vgpo/converged_signal_frac/reconstruction']:.2f} | "
                f"{row['vgpo/converged_signal_frac/std_free']:.2f} | "
                f"{row['vgpo/signal_frac/reconstruction']:.2f} / {row['vgpo/signal_frac/std_free']:.2f}")

    for row in result["iterations"]:
        lines.append(f"| {row['iteration']} | {cells(row)} |")
    lines.append(f"| mean | {cells(result['mean'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
