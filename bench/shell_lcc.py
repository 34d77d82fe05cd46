"""Shell-LCC on the toy world: fit the manifold, fine-tune with it (plain and band), and measure what it moves.

1. ``flowalign prep fit-manifold`` on the toy model's VAE latents of the toy world's exact scenes (``--data``,
   ``--num-bases``, ``--fit-epochs``); reused when ``<out>/manifold.safetensors`` exists.
2. Each run (``--runs``) trains ``--iterations`` from the same toy model:
   ``plain`` / ``band``: the released objective (``shell_lcc_objective.yaml``, ``objectives.shell_lcc.variant``);
   ``grpo_band``: the manifold as the GRPO reward (``shell_lcc.yaml``).
3. Before (the reference weights) and after (the EMA when there is one), on the held-out toy prompts with the same
   seeds: toy-GenEval (the paired gain with its SE: no composition gain is expected), the pixel statistics of
   ``flowalign.toy.statistics`` (colour purity, edge step, flat canvases), the mean manifold distance of the samples'
   re-encoded latents, and a collapse flag (more than half of the samples a flat canvas).

Writes ``<out>/shell_lcc.json`` and ``<out>/shell_lcc.md``.

    python bench/shell_lcc.py [--iterations 50] [--images-per-prompt 4] [--out bench/results/shell_lcc]
    python bench/shell_lcc.py --iterations 1 --images-per-prompt 1 --max-prompts 4 --fit-epochs 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {"plain": ("shell_lcc_objective", ["objectives.shell_lcc.variant=distance"]),
        "band": ("shell_lcc_objective", ["objectives.shell_lcc.variant=band"]),
        "grpo_band": ("shell_lcc", [])}
COMMON = ["train.tracker=none", "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0",
          "optim.ema_decay=0.9"]


def fit(out: Path, args) -> Path:
    from flowalign.prep.fit_manifold import FitManifoldConfig, fit_model_manifold

    path = out / "manifold.safetensors"
    if not path.is_file():
        fit_model_manifold(FitManifoldConfig(data=args.data, num_bases=args.num_bases, epochs_lcc=args.fit_epochs,
                                             epochs_shell=args.fit_epochs, out=str(path)))
    return path


def measure(model, metadata, manifold, kwargs) -> dict:
    import torch

    from flowalign.evaluation.toy_eval import evaluate
    from flowalign.toy.statistics import image_statistics

    results, summary, images = evaluate(model, metadata, **kwargs)
    with torch.no_grad():
        latents = model.encode_images(images.to(model.device), dtype=torch.float32)
        distance = float(manifold.distance_reward(latents.to(next(manifold.parameters()).device)))
    stats = image_statistics(images)
    return {"results": results, "overall": summary["overall"], "stats": stats, "distance": distance,
            "collapsed": stats["flat_fraction"] > 0.5}


def run(name: str, manifold_path: Path, out: Path, args) -> dict:
    from flowalign.config import load_config
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import paired_difference
    from flowalign.reward_models.shell_lcc import load_manifold
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    preset, extra = RUNS[name]
    paths = ([f"objectives.shell_lcc.path={manifold_path}"] if preset == "shell_lcc_objective" else
             [f"reward.rewards=[{{name: shell_lcc, kwargs: {{path: {manifold_path}, variant: band}}}}]"])
    overrides = [*COMMON, f"train.iterations={args.iterations}", f"train.seed={args.seed}",
                 f"train.out_dir={out / f'{name}.run'}", "train.overwrite=true", *paths, *extra, *args.set]
    trainer = Trainer(load_config(TrainConfig, REPO / "configs/methods" / f"{preset}.yaml", overrides))
    metadata = load_metadata(trainer.config.data.eval_prompts)[: args.max_prompts]
    manifold, _ = load_manifold(manifold_path)
    kwargs = dict(steps=10, images_per_prompt=args.images_per_prompt, seed=10_000 + args.seed)
    trainer.model.transformer.eval()
    with trainer.model.reference():
        before = measure(trainer.model, metadata, manifold, kwargs)
    start = time.perf_counter()
    history = [trainer.step() for _ in range(args.iterations)]
    wall = time.perf_counter() - start
    trainer.model.transformer.eval()
    with trainer.ema_weights():
        after = measure(trainer.model, metadata, manifold, kwargs)
    paired = paired_difference(before["results"], after["results"])["overall"]
    row = {"run": name, "preset": preset, "overrides": overrides, "iterations": args.iterations, "wall_s": wall,
           "geneval_gain": paired, "before": {k: v for k, v in before.items() if k != "results"},
           "after": {k: v for k, v in after.items() if k != "results"},
           "last_metrics": {k: v for k, v in history[-1].items() if not k.startswith("time/")}}
    print(f"{name}: gain {paired['diff']:+.3f} ± {paired['se']:.3f}, distance {before['distance']:.3f} -> "
          f"{after['distance']:.3f}, purity {before['stats']['purity']:.3f} -> {after['stats']['purity']:.3f}, "
          f"edge step {before['stats']['edge_step']:.3f} -> {after['stats']['edge_step']:.3f}, "
          f"collapsed {after['collapsed']}", flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| run | iterations | toy-GenEval gain | SE | distance before → after | purity before → after | "
             "edge step before → after | flat canvases after | collapsed | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['run']} | {r['iterations']} | {r['geneval_gain']['diff']:+.3f} | "
                     f"{r['geneval_gain']['se']:.3f} | {b['distance']:.3f} → {a['distance']:.3f} | "
                     f"{b['stats']['purity']:.3f} → {a['stats']['purity']:.3f} | {b['stats']['edge_step']:.3f} → "
                     f"{a['stats']['edge_step']:.3f} | {a['stats']['flat_fraction']:.2f} | {a['collapsed']} | "
                     f"{r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--images-per-prompt", type=int, default=4)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="toy")
    parser.add_argument("--num-bases", type=int, default=256)
    parser.add_argument("--fit-epochs", type=int, default=5)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for every run")
    parser.add_argument("--out", default=str(REPO / "bench/results/shell_lcc"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifold = fit(out, args)
    rows = [run(name, manifold, out, args) for name in args.runs.split(",")]
    (out / "shell_lcc.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=1))
    text = table(rows)
    (out / "shell_lcc.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
