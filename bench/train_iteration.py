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
           "tp_grpo", "tp_grpo_paper", "vgpo", "euphonium", "register_grpo", "drl", "drl_adjoint", "shell_lcc",
           "shell_lcc_objective", "soar", "sft", "diffusion_nft", "awm", "dpo", "grpo_guard", "gardo", "pref_grpo", "flow_dppo",
           "dgpo", "crd")
# register_grpo reads outputs/registers/registers.pt (flowalign prep registers); drl and drl_adjoint read
# outputs/discriminator/discriminator.safetensors (flowalign prep train-discriminator); shell_lcc and
# shell_lcc_objective read outputs/manifolds/shell_lcc.safetensors (flowalign prep fit-manifold); soar and sft are
# objective-only runs (no rollout or reward time); diffusion_nft, awm, dpo, dgpo and crd roll out and score but train
# objectives on the final samples (no credit)

CHILD = r"""
import json, resource, sys, torch
from flowalign.config import load_config
from flowalign.training.config import TrainConfig
from flowalign.training.trainer import Trainer
config = load_config(TrainConfig, sys.argv[1] or None, sys.argv[2:])
history = Trainer(config).train()
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps({"history": history, "peak_bytes": peak, "device": "cuda" if torch.cuda.is_available() else "cpu"}))
"""


def run_config(config: str | None, iterations: int, extra: list[str]) -> dict:
    """A short run of ``config`` (None: the config schema's own defaults, not configs/default.yaml) with ``extra``
    overrides in a process of its own: its metrics history, its peak memory (CUDA allocations, or the CPU process's
    max RSS) and the device it ran on."""
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"train.iterations={iterations}", "train.tracker=none", "train.eval_at_end=false",
                     "train.sample_every=0", "train.checkpoint_every=0", f"train.out_dir={out}", *extra]
        done = subprocess.run([sys.executable, "-c", CHILD, config or "", *overrides],
                              capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        what = config or "the schema's defaults"
        raise RuntimeError(f"{what} {' '.join(extra)} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])


def run_each(names: list[str], run, out: Path, header: dict) -> dict[str, dict]:
    """``run(name)`` for each name in order. A failure (RuntimeError) becomes that row's ``error`` and the rest still
    run; the JSON at ``out`` is rewritten after each, so a benchmark cut short keeps the rows it finished."""
    rows: dict[str, dict] = {}
    for name in names:
        try:
            rows[name] = run(name)
        except RuntimeError as error:
            rows[name] = {"error": str(error).splitlines()[-1], "log": str(error)[-1500:]}
            print(f"{name}: FAILED\n{rows[name]['log']}", flush=True)
        write_rows(out, header, rows)
    return rows


def write_rows(out: Path, header: dict, rows: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")


def format_table(first: str, columns: list[str], rows: dict[str, dict], cells) -> str:
    """A markdown table of ``rows``: ``cells(row)`` gives a row's cells; a failed row shows its error instead."""
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + (f"failed: {row['error']}" if "error" in row else " | ".join(cells(row))) + " |")
    return "\n".join(lines)


def cost_table(rows: dict[str, dict]) -> str:
    """The per-iteration cost of each preset (``rows`` as this script writes them, ``total_ratio`` included)."""
    return format_table(
        "preset", ["rollout s", "reward s", "train s", "total s", "total vs flow_grpo", "NFE/iter", "peak MiB"], rows,
        lambda row: [f"{row['time/rollout']:.2f}", f"{row['time/reward']:.2f}", f"{row['time/train']:.2f}",
                     f"{row['time/total']:.2f}", "-" if row.get("total_ratio") is None else f"{row['total_ratio']:.2f}",
                     f"{row['nfe']:.0f}", f"{row['peak_mib']:.0f}"])


def iteration_cost(history: list[dict]) -> dict[str, float]:
    """Mean rollout / reward / collapse-metric / train seconds, their total and NFEs per iteration; the first
    (warm-up) is dropped."""
    timed = history[1:] or history
    row = {key: sum(m.get(key, 0.0) for m in timed) / len(timed)  # an objective-only run has no rollout or reward
           for key in ("time/rollout", "time/reward", "time/collapse", "time/train", "nfe")}
    row["time/total"] = row["time/rollout"] + row["time/reward"] + row["time/collapse"] + row["time/train"]
    return row


def run_preset(preset: str, iterations: int, extra: list[str]) -> dict:
    result = run_config(str(REPO / "configs/methods" / f"{preset}.yaml"), iterations, extra)
    row = iteration_cost(result["history"])
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
    out, header = Path(args.out), {"iterations": args.iterations, "overrides": args.overrides}
    rows = run_each(args.presets, lambda preset: run_preset(preset, args.iterations, args.overrides), out, header)
    base = rows.get("flow_grpo", {}).get("time/total")
    for row in rows.values():
        if "error" not in row:
            row["total_ratio"] = row["time/total"] / base if base else None
    print(cost_table(rows))
    write_rows(out, header, rows)

if __name__ == "__main__":
    main()
