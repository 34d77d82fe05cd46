"""What caching the transformer's device and dtype (``flowalign.models.placement``) saves, as a ratio in one run.

diffusers' ``ModelMixin.device`` / ``dtype`` walk every submodule on each read; ``FlowModel`` reads them on every
transformer call. For each config, one process builds the trainer once and runs ``1 + 2 * pairs`` iterations with
``Trainer.step``: the first warms up, then each pair runs one iteration with diffusers' walk on every read
(``placement.ENABLED = False``, "before") and one with the cache ("after"), the order alternating from pair to pair,
so the load of a shared machine falls on both arms alike. The cache returns diffusers' own answers, so both arms
compute the same numbers (the golden runs pin that); only the time differs. The saving is about 1%, below the
noise of whole iterations on a shared machine, so the script also counts the reads an iteration makes, times one
read of ``model.device`` and of ``model.dtype`` each way, and gives the ratio those imply.

    OMP_NUM_THREADS=1 python bench/velocity_overhead.py [--pairs 6] [--configs default flow_grpo_fast]
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
import json, sys, time
import flowalign.models.placement as placement
from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer
config = load_config(TrainConfig, sys.argv[1] or None, sys.argv[3:])
pairs = int(sys.argv[2])
trainer = Trainer(config)
model = trainer.model

def reads(enabled, name, n=200):
    placement.ENABLED = enabled
    clock = time.perf_counter()
    for _ in range(n):
        getattr(model, name)
    return (time.perf_counter() - clock) / n

counts = {"device": 0, "dtype": 0}  # the reads an iteration makes (counted around the cache's two entry points)
for name in counts:
    def counted(self, module, _read=getattr(placement.Placement, name), _name=name):
        counts[_name] += 1
        return _read(self, module)
    setattr(placement.Placement, name, counted)

def timed(enabled):
    placement.ENABLED = enabled
    clock = time.perf_counter()
    trainer.step()
    return time.perf_counter() - clock

timed(True)  # warm-up
counts.update(device=0, dtype=0)
before, after = [], []
for pair in range(pairs):
    for enabled in ((False, True) if pair % 2 == 0 else (True, False)):
        (after if enabled else before).append(timed(enabled))
per_iteration = {name: count / (2 * pairs) for name, count in counts.items()}
cost = {name: {"before_s": reads(False, name), "after_s": reads(True, name)} for name in counts}
saved = sum(per_iteration[name] * (cost[name]["before_s"] - cost[name]["after_s"]) for name in counts)
modules = sum(1 for _ in model.transformer.modules())
print("RESULT " + json.dumps({"before": before, "after": after, "reads_per_iteration": per_iteration,
                              "read_cost": cost, "saved_s": saved, "modules": modules}))
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
    # The same ratio from the reads an iteration makes and what each costs either way: steadier than the wall
    # times of whole iterations on a shared machine.
    before = sum(row["before"]) / len(row["before"])
    row["ratio_from_reads"] = (before - row["saved_s"]) / before
    return row


def table(rows: dict[str, dict]) -> str:
    lines = ["| config | iteration s, walk (before) | iteration s, cached (after) | after / before, timed | "
             "paired ratios | reads an iteration (device, dtype) | one read, before → after (device; dtype) | "
             "after / before, from the reads |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        before, after = sum(row["before"]) / len(row["before"]), sum(row["after"]) / len(row["after"])
        pairs = ", ".join(f"{r:.3f}" for r in row["pair_ratios"])
        count = row["reads_per_iteration"]
        cost = "; ".join(f"{c['before_s'] * 1e3:.2f} ms → {c['after_s'] * 1e6:.0f} µs"
                         for c in (row["read_cost"]["device"], row["read_cost"]["dtype"]))
        lines.append(f"| {name} | {before:.2f} | {after:.2f} | {row['ratio']:.3f} | {pairs} | "
                     f"{count['device']:.0f}, {count['dtype']:.0f} | {cost} | {row['ratio_from_reads']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6)
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
