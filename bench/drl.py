"""DRL on the toy world: train the discriminator, run the drl preset on its logit, and report the distance to the data
before and after.

1. ``flowalign prep train-discriminator`` (``--disc key=value`` overrides its settings) against the base model.
2. The ``drl`` preset (``--set key=value`` overrides) for ``--iterations`` iterations, scored by that checkpoint.
3. Before (LoRA off) and after (EMA weights when there are any), on the held-out toy prompts, the same captions and
   seeds: the Fréchet distance in the discriminator's frozen feature space between exact renders of the prompts and
   the model's ODE samples (``flowalign.evaluation.frechet``), the mean discriminator logit of the samples, and
   toy-GenEval with the paired gain and its SE.

    python bench/drl.py --out bench/results/drl [--iterations 40] [--images-per-prompt 4] [--seed 0]
    python bench/drl.py --out /tmp/drl-smoke --tiny      # a few seconds' check that the pipeline runs end to end
    python bench/drl.py --out bench/results/drl --reuse-discriminator   # step 1 from an earlier run's checkpoint
    python bench/drl.py --out bench/results/drl_adjoint --preset drl_adjoint --iterations 240 \
        --discriminator bench/results/drl/discriminator.safetensors      # the same discriminator as the drl run

``--preset drl_adjoint`` runs stage 2 as the paper does (adjoint matching, an objective on the discriminator's
gradient) instead of GRPO on its logit.

Writes ``<out>/drl.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_DISC = ["max_steps=10", "batch_size=16", "buffer_batches=1", "epochs=5", "validate_every=5", "sample_steps=4",
             "data=toy:1", "val_fraction=0.1", "lr=1e-2"]
TINY_RUN = {"drl": ["data.prompts_per_iteration=2", "data.group_size=4", "sampling.batch_size=8"],
            "drl_adjoint": ["objectives.adjoint_matching.batch_size=2",
                            "objectives.adjoint_matching.units_per_iteration=1"]}


def reward_overrides(preset: str, checkpoint: Path) -> list[str]:
    """The run's reward: the discriminator's logit in GRPO (drl), or the gradient adjoint matching follows."""
    if preset == "drl_adjoint":
        return [f"objectives.adjoint_matching.reward_kwargs.path={checkpoint}"]
    return ["reward.rewards=[{name: discriminator, kwargs: {path: " + str(checkpoint) + "}}]"]


def render_held_out(metadata: list[dict], per_prompt: int, size: int) -> torch.Tensor:
    """Exact toy scenes of the held-out prompts, ``per_prompt`` layouts each, prompt-major (keyed by row)."""
    from flowalign.seeding import numpy_rng
    from flowalign.toy.scenes import render, scene_for

    images = [render(scene_for(entry, numpy_rng(104_729, p, k), size), size)
              for p, entry in enumerate(metadata) for k in range(per_prompt)]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255


@torch.no_grad()
def measure(model, reward, metadata, renders, *, images_per_prompt: int, seed: int, size: int) -> dict:
    """FD to the renders in the discriminator's feature space and in pooled pixels, the samples' mean logit and
    toy-GenEval."""
    from flowalign.evaluation.frechet import frechet_distance
    from flowalign.evaluation.toy_eval import evaluate

    results, summary, images = evaluate(model, metadata, steps=10, images_per_prompt=images_per_prompt,
                                        seed=seed, image_size=size)
    prompts = [entry["prompt"] for entry in metadata for _ in range(images_per_prompt)]
    feats = torch.cat([reward.features(images[i:i + 64].to(reward.device)).cpu() for i in range(0, len(images), 64)])
    data = torch.cat([reward.features(renders[i:i + 64].to(reward.device)).cpu() for i in range(0, len(renders), 64)])
    logits = reward(images, prompts, [{}] * len(prompts))
    return {"fd": frechet_distance(data, feats), "pixel_fd": frechet_distance(pooled(renders), pooled(images)),
            "logit": float(logits.mean()), "overall": summary["overall"], "results": results, "images": images}


def pooled(images: torch.Tensor) -> torch.Tensor:
    """A feature space the discriminator never saw: the images average-pooled to 4 x 4 RGB (48 numbers)."""
    return torch.nn.functional.adaptive_avg_pool2d(images.float(), 4).flatten(1).double()


def table(records: list[tuple[str, dict]]) -> str:
    """The markdown table of ``(run name, drl.json record)`` rows: before -> after in both feature spaces, the logit,
    the mean pixel change and the paired toy-GenEval gain."""
    lines = ["| run | seed | iterations | training s | feature FD to data | pixel FD to data | mean logit "
             "| mean pixel change | toy-GenEval gain |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in records:
        b, a, g = r["before"], r["after"], r["geneval_gain"]
        seed = next(int(o.split("=")[1]) for o in r["overrides"] if o.startswith("train.seed="))
        pixel = f"{b['pixel_fd']:.4f} → {a['pixel_fd']:.4f}" if "pixel_fd" in b else "not measured"
        change = f"{r['pixel_change']:.4f}" if "pixel_change" in r else "not measured"
        lines.append(f"| {name} | {seed} | {r['iterations']} | {r['train_s']:.0f} | {b['fd']:.3f} → {a['fd']:.3f} "
                     f"| {pixel} | {b['logit']:+.2f} → {a['logit']:+.2f} | {change} "
                     f"| {g['diff']:+.3f} ± {g['se']:.3f} |")
    return "\n".join(lines)


def save_samples(path: Path, metadata: list[dict], renders, before, after, *, per_prompt: int, prompts: int = 8):
    """A grid of the first ``prompts`` held-out prompts, one column each: an exact render, the base model's first
    sample and the trained model's first sample (the same seed)."""
    from flowalign.evaluation.images import save_grid

    first = [p * per_prompt for p in range(prompts)]
    render_rows = [p * max(2, per_prompt) for p in range(prompts)]
    images = torch.cat([renders[render_rows], before["images"][first].float(), after["images"][first].float()])
    captions = [f"data: {metadata[p]['prompt']}" for p in range(prompts)] + ["base"] * prompts + ["trained"] * prompts
    save_grid(images, captions, path, columns=prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/drl")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--images-per-prompt", type=int, default=4)
    parser.add_argument("--eval-prompts", type=int, default=None, help="first N held-out prompts (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=sorted(TINY_RUN), default="drl", help="stage 2: GRPO on the logit (drl) "
                        "or adjoint matching on its gradient (drl_adjoint)")
    parser.add_argument("--disc", action="append", default=[], help="train-discriminator setting key=value")
    parser.add_argument("--discriminator", type=Path, default=None,
                        help="a discriminator trained earlier (its .json beside it) instead of training one")
    parser.add_argument("--evaluate", type=Path, default=None,
                        help="measure the final checkpoint of an earlier run (its EMA weights) instead of training")
    parser.add_argument("--set", action="append", default=[], help="drl preset override key=value")
    parser.add_argument("--tiny", action="store_true", help="tiny settings: checks that it runs, measures nothing")
    parser.add_argument("--reuse-discriminator", action="store_true",
                        help="use <out>/discriminator.safetensors from an earlier run instead of training one")
    args = parser.parse_args()

    from flowalign.config import load_config
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import default_prompts_path, paired_difference
    from flowalign.reward_models.discriminator import DiscriminatorReward
    from flowalign.rewards import bind_reward_model
    from flowalign.training.config import TrainConfig
    from flowalign.prep.train_discriminator import DiscriminatorTrainConfig, train_discriminator
    from flowalign.training.trainer import Trainer

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = args.discriminator or out / "discriminator.safetensors"
    disc_settings = [f"model={REPO / 'assets/toy-sd3'}", "image_size=32", f"seed={args.seed}", f"out={checkpoint}",
                     *(TINY_DISC if args.tiny else []), *args.disc]
    clock = time.perf_counter()
    sidecar = checkpoint.with_suffix(".json")
    if args.discriminator is not None and not (checkpoint.is_file() and sidecar.is_file()):
        raise SystemExit(f"--discriminator {checkpoint}: no such checkpoint with its .json beside it")
    if (args.reuse_discriminator or args.discriminator) and checkpoint.is_file() and sidecar.is_file():  # made before
        disc = json.loads(sidecar.read_text())
        print(f"reusing {checkpoint} (validation accuracy {disc['val_accuracy']:.3f})", flush=True)
    else:
        disc = train_discriminator(load_config(DiscriminatorTrainConfig, None, disc_settings))
    disc_s = time.perf_counter() - clock
    iterations = 2 if args.tiny else args.iterations
    resume = [f"train.resume={args.evaluate}"] if args.evaluate else []  # nothing left to train: measured as it is
    overrides = [f"model.path={REPO / 'assets/toy-sd3'}", "sampling.image_size=32", f"train.iterations={iterations}",
                 f"train.seed={args.seed}", f"train.out_dir={out / ('evaluated' if args.evaluate else 'run')}", *resume, "train.tracker=none",
                 "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0",
                 *reward_overrides(args.preset, checkpoint), *(TINY_RUN[args.preset] if args.tiny else []), *args.set]
    trainer = Trainer(load_config(TrainConfig, REPO / f"configs/methods/{args.preset}.yaml", overrides))
    reward = DiscriminatorReward(str(checkpoint), device=trainer.model.device)
    bind_reward_model(reward, trainer.model)  # a text-conditioned discriminator embeds the prompts with the run's model
    metadata = load_metadata(default_prompts_path())[: (2 if args.tiny else args.eval_prompts)]
    per_prompt = 1 if args.tiny else args.images_per_prompt
    renders = render_held_out(metadata, max(2, per_prompt), 32)
    kwargs = dict(images_per_prompt=per_prompt, seed=10_000 + args.seed, size=32)
    trainer.model.transformer.eval()
    with trainer.model.reference():
        before = measure(trainer.model, reward, metadata, renders, **kwargs)
    clock = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - clock
    if args.evaluate and (out / "drl.json").is_file():  # the training's wall time, from the run's own record
        train_s = json.loads((out / "drl.json").read_text()).get("train_s", train_s)
    trainer.model.transformer.eval()
    with trainer.ema_weights():
        after = measure(trainer.model, reward, metadata, renders, **kwargs)
    paired = paired_difference(before["results"], after["results"])["overall"]
    save_samples(out / "samples.png", metadata, renders, before, after, per_prompt=per_prompt,
                 prompts=min(8, len(metadata)))
    summary = {
        "tiny": args.tiny, "discriminator": {k: disc[k] for k in ("val_accuracy", "val_loss", "selected_step", "steps")},
        "discriminator_s": disc_s, "train_s": train_s, "iterations": iterations, "eval_prompts": len(metadata),
        "images_per_prompt": per_prompt, "preset": args.preset,
        "before": {k: before[k] for k in ("fd", "pixel_fd", "logit", "overall")},
        "after": {k: after[k] for k in ("fd", "pixel_fd", "logit", "overall")}, "geneval_gain": paired,
        "pixel_change": float((after["images"].float() - before["images"].float()).abs().mean()),
        "evaluated": str(args.evaluate) if args.evaluate else None,
        "disc_settings": disc_settings, "overrides": overrides,
    }
    (out / "drl.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    print(f"| | feature FD to data | pixel FD to data | mean logit | toy-GenEval |\n|---|---:|---:|---:|---:|\n"
          f"| base | {before['fd']:.3f} | {before['pixel_fd']:.4f} | {before['logit']:+.3f} | {before['overall']} |\n"
          f"| {args.preset} ({iterations} it.) | {after['fd']:.3f} | {after['pixel_fd']:.4f} | {after['logit']:+.3f} "
          f"| {after['overall']} |\n\nmean pixel change {summary['pixel_change']:.4f}; "
          f"toy-GenEval gain {paired['diff']:+.3f} ± {paired['se']:.3f}; discriminator validation accuracy "
          f"{disc['val_accuracy']:.3f} ({disc_s:.0f} s), training {train_s:.0f} s")


if __name__ == "__main__":
    main()
