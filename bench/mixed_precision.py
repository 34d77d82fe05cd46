"""Does training re-score a rollout with the log-probs the rollout stored? In fp32 and bf16, Triton and torch paths.

PPO's ratio ``exp(log_prob_train - log_prob_rollout)`` must be exactly 1 on the first minibatch of an iteration,
before any update: the clip range of Flow-GRPO is 1e-4, so a precision mismatch of that size between the rollout's
forward and the training forward already clips transitions that the policy never moved. This runs a few iterations of
the default toy run in each configuration (a process each) and reports the first minibatch's ratio statistics:

- ``first |log ratio| rms``: ``sqrt(2 approx_kl)`` over the first minibatch (0 when the log-probs agree exactly);
- ``first clip frac``: the share of its transitions outside the clip range before any update;
- per-iteration time and peak memory (the first iteration is dropped as warm-up).

    python bench/mixed_precision.py [--iterations 3] [--out bench/results/mixed_precision.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from train_iteration import REPO, format_table, iteration_cost, run_config, run_each

SETTINGS = {  # name: overrides
    "fp32 / torch": ["model.kernels=torch"],
    "fp32 / triton": ["model.kernels=triton"],
    "bf16 autocast / torch": ["model.mixed_precision=bf16", "model.kernels=torch"],
    "bf16 autocast / triton": ["model.mixed_precision=bf16", "model.kernels=triton"],
    "bf16 weights / triton": ["model.dtype=bf16", "model.mixed_precision=bf16", "model.kernels=triton"],
}


def summarize(result: dict) -> dict:
    history = result["history"]
    worst = max(history, key=lambda m: m["first_approx_kl"])
    return {
        "device": result["device"],
        "first_ratio_max": max(m["first_ratio_max"] for m in history),
        "first_ratio_mean": [m["first_ratio_mean"] for m in history],
        "first_log_ratio_rms": math.sqrt(2 * worst["first_approx_kl"]),
        "first_clip_frac": max(m["first_clip_frac"] for m in history),
        "reward": [m["reward"] for m in history],
        "seconds_per_iteration": iteration_cost(history)["time/total"],
        "peak_mib": result["peak_bytes"] / 2**20,
    }


def precision_table(rows: dict[str, dict]) -> str:
    """The first minibatch's ratio statistics of each setting (``rows`` as this script writes them)."""
    return format_table(
        "setting", ["device", "first ratio max", "first |log ratio| rms", "first clip frac", "s / iteration",
                    "peak MiB"], rows,
        lambda row: [row["device"], f"{row['first_ratio_max']:.7f}", f"{row['first_log_ratio_rms']:.2e}",
                     f"{row['first_clip_frac']:.3f}", f"{row['seconds_per_iteration']:.2f}", f"{row['peak_mib']:.0f}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS), metavar="NAME")
    parser.add_argument("--out", default=str(REPO / "bench/results/mixed_precision.json"))
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    out, header = Path(args.out), {"iterations": args.iterations, "overrides": args.overrides}
    # A setting that fails (triton on a machine without CUDA, say) is reported and the others still run.
    rows = run_each(args.settings, lambda name: summarize(
        run_config(None, args.iterations, SETTINGS[name] + args.overrides)), out, header)
    print(precision_table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
