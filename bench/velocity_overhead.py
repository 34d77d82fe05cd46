"""What caching the transformer's device and dtype (``flowalign.models.placement``) saves, as a ratio in one run.

diffusers' ``ModelMixin.device`` / ``dtype`` walk every submodule on each read; ``FlowModel`` reads them on every
transformer call. For each config, one process builds the trainer once and runs ``1 + 2 * pairs`` iterations with
``Trainer.step``: the first warms up, then each pair runs one iteration with diffusers' walk on every read
(``placement.ENABLED = False``, "before") and one with the cache ("after"), the order alternating from pair to pair,
so the load of a shared machine falls on both arms alike. The cache returns diffusers' own answers, so both arms
compute the same numbers (the golden runs pin that); only the time differs. It also times one read of
``model.device`` + ``model.dtype`` each way.

    OMP_NUM_THREADS=1 python bench/velocity_overhead.py [--pairs 4] [--configs default flow_grpo_fast]
        [--out bench/results/velocity_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"default": None, "flow_grpo_fast": "configs/methods/flow_grpo_fast.yaml",
           "flow_grpo": "configs/methods/flow_grpo.yaml"}

CHILD = r"""
import json, statistics, sys, time
import flowalign.models.placement as placement
from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer
config = load_config(TrainConfig, sys.argv[1] or None, sys.argv[3:])
pairs = int(sys.argv[2])
trainer = Trainer(config)
model = trainer.model

def reads(enabled, n=200):
    placement.ENABLED = enabled
    clock = time.perf_counter()
    for _ in range(n):
        model.device, model.dtype
    return (time.perf_counter() - clock) / n

def timed(enabled):
    placement.ENABLED = enabled
    clock = time.perf_counter()
    trainer.step()
    return time.perf_counter() - clock

timed(True)  # warm-up
before, after = [], []
for pair in range(pairs):
    for enabled in ((False, True) if pair % 2 == 0 else (True, False)):
        (after if enabled else before).append(timed(enabled))
read_before, read_after = reads(False), reads(True)
modules = sum(1 for _ in model.transformer.modules())
print("RESULT " + json.dumps({"before": before, "after": after, "read_before_s": read_before,
                              "read_after_s": read_after, "modules": modules}))
"""


def run(name: str, pairs: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"train.iterations={1 + 2 * pairs}", "train.tracker=none", "train.eval_at_end=false",
                     "train.sample_every=0", "train.checkpoint_every=0", f"train.out_dir={out}", *extra]
        config = CONFIGS[name]
        done = subprocess.run([sys.executable, "-c", CHILD, str(REPO / config) if config else "", str(pairs),
                               *overrides], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    row["ratio"] = sum(row["after"]) / sum(row["before"])  # after / before: below 1 is faster
    row["pair_ratios"] = [a / b for a, b in zip(row["after"], row["before"])]
    return row


def table(rows: dict[str, dict]) -> str:
    lines = ["| config | iteration s, walk (before) | iteration s, cached (after) | after / before | "
             "paired ratios | one device+dtype read, before → after | transformer modules |",
             "|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        before, after = sum(row["before"]) / len(row["before"]), sum(row["after"]) / len(row["after"])
        pairs = ", ".join(f"{r:.3f}" for r in row["pair_ratios"])
        reads = f"{row['read_before_s'] * 1e3:.2f} ms → {row['read_after_s'] * 1e6:.0f} µs"
        lines.append(f"| {name} | {before:.2f} | {after:.2f} | {row['ratio']:.3f} | {pairs} | {reads} | "
                     f"{row['modules']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--configs", nargs="*", default=["default", "flow_grpo_fast"], choices=list(CONFIGS))
    parser.add_argument("--out", default=str(REPO / "bench/results/velocity_overhead.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = {name: run(name, args.pairs, args.overrides) for name in args.configs}
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pairs": args.pairs, "overrides": args.overrides,
                               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
