"""Whether torch's intra-op thread count changes a run's numbers here: the same short run with ``train.threads`` 1
and 2, compared bit for bit (the trained weights, the EMA and every logged metric but the wall times).

Each run is a process of its own: ``iterations`` of the config on the toy world, no evaluation, no checkpoints
between. The answer holds for this machine's CPU and library versions only (docs/guides/training.md, "Threads on a
shared CPU").

    python bench/threads_bitwise.py [--iterations 2] [--configs default flow_grpo_fast dense_grpo]
        [--out bench/results/threads_bitwise.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, torch
from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer
config = load_config(TrainConfig, sys.argv[1] or None, sys.argv[2:])
trainer = Trainer(config)
history = trainer.train()

def digest(tensors):
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode()); h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

weights = digest(trainer.trainable_state())
ema = None if trainer.ema is None else digest(trainer.ema.state_dict())
metrics = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]
metrics = hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()[:16]
print("RESULT " + json.dumps({"threads": torch.get_num_threads(), "weights": weights, "ema": ema, "metrics": metrics}))
"""


def config_path(name: str) -> str:
    return "" if name == "default" else str(REPO / "configs/methods" / f"{name}.yaml")


def run(name: str, threads: int, iterations: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"train.threads={threads}", f"train.iterations={iterations}", "train.tracker=none",
                     "train.eval_at_end=false", "train.sample_every=0", "train.checkpoint_every=0",
                     f"train.out_dir={out}"]
        clock = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, config_path(name), *overrides], capture_output=True,
                              text=True, cwd=REPO)
        wall = time.perf_counter() - clock
    if done.returncode != 0:
        raise RuntimeError(f"{name} with {threads} threads failed:\n{done.stderr[-3000:]}")
    row = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    row["wall_s"] = wall
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--configs", nargs="*", default=["default", "flow_grpo_fast", "dense_grpo"])
    parser.add_argument("--out", default=str(REPO / "bench/results/threads_bitwise.json"))
    args = parser.parse_args()
    rows = {}
    print("| config | weights | EMA | metrics | wall s, 1 thread → 2 threads |\n|---|---|---|---|---|")
    for name in args.configs:
        one, two = run(name, 1, args.iterations), run(name, 2, args.iterations)
        same = {key: one[key] == two[key] for key in ("weights", "ema", "metrics")}
        rows[name] = {"one": one, "two": two, "identical": same}
        cells = " | ".join("identical" if same[key] else "differ" for key in ("weights", "ema", "metrics"))
        print(f"| {name} | {cells} | {one['wall_s']:.0f} → {two['wall_s']:.0f} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"iterations": args.iterations, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
