"""Per-iteration cost of each method preset on the toy model: rollout / reward / train time, NFEs, peak memory.

Each preset runs in its own process (so peak memory is its own) for a few iterations of the default toy run; the
first iteration (warm-up) is dropped. Times are reported as seconds *and* as ratios to flow_grpo measured in the same
run, since only the ratios carry over between machines.

    python bench/train_iteration.py [--iterations 4] [--out bench/results/train_iteration.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = ("flow_grpo", "flow_grpo_fast", "dance_grpo", "mix_grpo", "branch_grpo", "tempflow_grpo", "dense_grpo",
           "tp_grpo", "register_grpo")  # register_grpo reads outputs/registers/registers.pt (flowalign registers train)

CHILD = r"""
import json, resource, sys, torch
from flowalign.config import load_config
from flowalign.train_config import TrainConfig
from flowalign.trainer import GRPOTrainer
config = load_config(TrainConfig, sys.argv[1] or None, sys.argv[2:])
history = GRPOTrainer(config).train()
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps({"history": history, "peak_bytes": peak, "device": "cuda" if torch.cuda.is_available() else "cpu"}))
"""


def run_config(config: str | None, iterations: int, extra: list[str]) -> dict:
    """A short run of ``config`` (None = the default) with ``extra`` overrides in a process of its own: its metrics
    history, its peak memory (CUDA allocations, or the CPU process's max RSS) and the device it ran on."""
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"train.iterations={iterations}", "train.tracker=none", "train.eval_at_end=false",
                     "train.sample_every=0", "train.checkpoint_every=0", f"train.out_dir={out}", *extra]
        done = subprocess.run([sys.executable, "-c", CHILD, config or "", *overrides],
                              capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{config or 'the default config'} {' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def run_preset(preset: str, iterations: int, extra: list[str]) -> dict:
    result = run_config(str(REPO / "configs/methods" / f"{preset}.yaml"), iterations, extra)
    timed = result["history"][1:] or result["history"]
    mean = lambda key: sum(m[key] for m in timed) / len(timed)  # noqa: E731
    row = {key: mean(key) for key in ("time/rollout", "time/reward", "time/train", "nfe")}
    row["time/total"] = row["time/rollout"] + row["time/reward"] + row["time/train"]
    row["peak_mib"] = result["peak_bytes"] / 2**20
    row["device"] = result["device"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--presets", nargs="*", default=list(PRESETS), choices=PRESETS, metavar="PRESET")
    parser.add_argument("--out", default=str(REPO / "bench/results/train_iteration.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for preset in args.presets:  # a failed preset is reported and the others still run; the JSON grows as they do
        try:
            rows[preset] = run_preset(preset, args.iterations, args.overrides)
        except RuntimeError as error:
            rows[preset] = {"error": str(error)[-1500:]}
            print(f"{preset}: FAILED\n{rows[preset]['error']}", flush=True)
        out.write_text(json.dumps({"iterations": args.iterations, "overrides": args.overrides, "rows": rows},
                                  indent=1))
    base = rows.get("flow_grpo", {}).get("time/total")
    print("| preset | rollout s | reward s | train s | total s | total vs flow_grpo | NFE/iter | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, row in rows.items():
        if "error" in row:
            print(f"| {preset} | failed |||||||")
            continue
        row["total_ratio"] = row["time/total"] / base if base else None
        ratio = f"{row['total_ratio']:.2f}" if base else "-"
        print(f"| {preset} | {row['time/rollout']:.2f} | {row['time/reward']:.2f} | {row['time/train']:.2f} | "
              f"{row['time/total']:.2f} | {ratio} | {row['nfe']:.0f} | {row['peak_mib']:.0f} |")
    out.write_text(json.dumps({"iterations": args.iterations, "overrides": args.overrides, "rows": rows}, indent=1))

if __name__ == "__main__":
    main()
