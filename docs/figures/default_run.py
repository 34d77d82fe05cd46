"""The README's and the landing page's figure: the default run's reward curve, and before/after samples of the
held-out tag that gained most, each image captioned with its reward.

Reads a finished run of ``flowalign train`` (the default run: ``configs/default.yaml``): ``metrics.jsonl`` (the
per-iteration training reward), the last ``checkpoint-*`` (its EMA weights, which the run's evaluation reads), and the
per-tag paired gains, from ``eval/before_after.json`` or, for a run with ``train.eval_at_end=false``, from a record
of the same run (``--gains``, e.g. ``bench/results/equal_wall_matched/records/diffusion_nft-seed0.json``: seed 0 is
the default run bit for bit). It then samples ``--images`` held-out prompts of that tag with the base model and with
the trained one, on the same seeds (ODE, the evaluation's steps), and scores each image with the run's reward (the
partial-credit toy GenEval) and the binary verdict. Needs matplotlib (the ``bench`` extra). Run from the repository
root:

    flowalign train train.out_dir=/tmp/default-run
    python docs/figures/default_run.py /tmp/default-run --out docs/images/default_run.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

TRAILING = 10  # iterations in the reward curve's trailing mean


def tag_gains(run: Path, gains: Path | None) -> dict[str, float]:
    """The paired gain of every tag: the run's own evaluation, else the record ``gains``."""
    report = run / "eval/before_after.json"
    if report.is_file():
        return {tag: entry["diff"] for tag, entry in json.loads(report.read_text())["paired"]["tags"].items()}
    if gains is None:
        raise SystemExit(f"{report} does not exist (a run with train.eval_at_end=false): pass --gains RECORD.json")
    return dict(json.loads(gains.read_text())["tags"])


def tag_scores(run: Path, tag: str) -> tuple[float, float, int] | None:
    """The tag's score before and after, and its image count, on the run's own evaluation (None without one)."""
    report = run / "eval/before_after.json"
    if not report.is_file():
        return None
    entry = json.loads(report.read_text())["paired"]["tags"][tag]
    return entry["mean_a"], entry["mean_b"], entry["n"]


def rewards_per_iteration(run: Path) -> list[float]:
    return [json.loads(line)["reward"] for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def before_after_samples(run: Path, tag: str, count: int, seed: int, steps: int):
    """``count`` held-out prompts of ``tag`` (cycled), one image each, from the base model and from the checkpoint's
    EMA weights on the same seeds: ``(metadata, {name: (images, rewards, verdicts)})``."""
    import torch

    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import evaluate
    from flowalign.lora_loading import load_model, resolve_lora
    from flowalign.toy.reward import ToyGenEvalReward

    checkpoint = sorted(run.glob("checkpoint-*"))[-1]
    lora = resolve_lora(checkpoint, "ema")
    config = yaml.safe_load((run / "config.yaml").read_text())
    prompts = [m for m in load_metadata(config["data"]["eval_prompts"]) if m["tag"] == tag]
    metadata = [prompts[i % len(prompts)] for i in range(count)]
    reward = ToyGenEvalReward(partial_credit=True)
    samples = {}
    for name, source in (("before", None), ("after", lora)):
        model = load_model(lora.model_path, source)
        results, _, images = evaluate(model, metadata, steps=steps, images_per_prompt=1, seed=seed)
        scores = reward(images, [m["prompt"] for m in metadata], metadata)
        samples[name] = (images, torch.as_tensor(scores).tolist(), [r["correct"] for r in results])
    return metadata, samples, checkpoint.name


def draw(path: Path, rewards: list[float], batch: int, gains: dict[str, float], tag: str, metadata, samples,
         checkpoint: str, scores_of_tag: tuple[float, float, int] | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flowalign.outputs import write_atomically

    count = len(metadata)
    figure = plt.figure(figsize=(11, 4.4), dpi=100)
    grid = figure.add_gridspec(2, count + 5, wspace=0.08, hspace=0.3)
    figure.subplots_adjust(top=0.78, bottom=0.13, left=0.07, right=0.99)
    curve = figure.add_subplot(grid[:, :4])
    iterations = range(1, len(rewards) + 1)
    trailing = [statistics.fmean(rewards[max(0, i - TRAILING + 1): i + 1]) for i in range(len(rewards))]
    curve.plot(iterations, rewards, ".", color="#9ecae1", markersize=4, label=f"each iteration ({batch} samples)")
    curve.plot(iterations, trailing, color="#08519c", linewidth=2, label=f"trailing mean of {TRAILING}")
    curve.set_xlabel("iteration")
    curve.set_ylabel("training reward (partial-credit toy GenEval)")
    curve.set_title("reward during training", fontsize=10)
    curve.grid(alpha=0.3)
    curve.legend(fontsize=7, loc="lower right")
    for row, name in enumerate(("before", "after")):
        images, scores, verdicts = samples[name]
        for column in range(count):
            axes = figure.add_subplot(grid[row, 5 + column])
            axes.imshow(images[column].permute(1, 2, 0).clamp(0, 1).numpy())
            axes.set_xticks([])
            axes.set_yticks([])
            axes.set_title(f"{scores[column]:.2f} {'✓' if verdicts[column] else '✗'}", fontsize=8,
                           color="#006d2c" if verdicts[column] else "#a50f15")
            if column == 0:
                axes.set_ylabel(name, fontsize=10)
    mean = {name: statistics.fmean(samples[name][1]) for name in samples}
    correct = {name: sum(samples[name][2]) for name in samples}
    prompts = sorted({m["prompt"] for m in metadata})
    measured = (f"{scores_of_tag[0]:.3f} -> {scores_of_tag[1]:.3f} over {scores_of_tag[2]} images of the run's "
                f"evaluation, paired gain {gains[tag]:+.3f}" if scores_of_tag else
                f"paired gain {gains[tag]:+.3f} on the run's evaluation")
    figure.text(0.62, 0.985, f"held-out tag that gained most: {tag}: {measured}\n{count} of its samples, the same "
                f"seeds: base model {correct['before']} correct (mean reward {mean['before']:.2f}), {checkpoint} EMA "
                f"{correct['after']} correct (mean {mean['after']:.2f})\ncaption: the run's reward and the verdict",
                ha="center", va="top", fontsize=8.5)
    figure.text(0.66, 0.03, "prompts: " + "; ".join(prompts), ha="center", fontsize=7.5, color="#555555")
    with write_atomically(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100, metadata={"Software": None})
    plt.close(figure)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="the run's train.out_dir")
    parser.add_argument("--gains", type=Path, help="a record with per-tag gains, for a run without eval/")
    parser.add_argument("--images", type=int, default=8, help="samples before and after")
    parser.add_argument("--seed", type=int, default=10_000, help="sample seed (the default run's evaluation seed)")
    parser.add_argument("--steps", type=int, default=10, help="ODE steps (the evaluation's)")
    parser.add_argument("--out", type=Path, default=Path("docs/images/default_run.png"))
    args = parser.parse_args(argv)
    gains = tag_gains(args.run, args.gains)
    tag = max(gains, key=gains.get)
    metadata, samples, checkpoint = before_after_samples(args.run, tag, args.images, args.seed, args.steps)
    data = yaml.safe_load((args.run / "config.yaml").read_text())["data"]
    batch = data["prompts_per_iteration"] * data["group_size"]
    draw(args.out, rewards_per_iteration(args.run), batch, gains, tag, metadata, samples, checkpoint,
         tag_scores(args.run, tag))
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB): tag {tag}")
    return args.out


if __name__ == "__main__":
    main()
