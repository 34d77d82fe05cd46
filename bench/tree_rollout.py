"""Tree vs independent rollouts at equal leaves on the toy model: NFEs and measured wall-clock ratio.

BranchGRPO's reference schedule (20 steps, splits at 0, 3, 6, 9, factor 2: 16 leaves per tree) against 16 independent
trajectories per prompt, both through the same model and SDE (flow_grpo, noise 0.7, last step ODE), interleaved and
repeated so that both see the same machine state. Reports the median time of each and their ratio.

    python bench/tree_rollout.py [--prompts 4] [--repeats 5] [--out bench/results/tree_rollout.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def table(row: dict) -> str:
    """The markdown table of one result (``row`` as this script writes it)."""
    nfe, median = row["nfe_per_prompt"], row["median_s"]
    splits = ",".join(str(s) for s in row["split_steps"])
    return "\n".join([
        "| rollout | NFE per prompt | median s | speed-up |", "|---|---|---|---|",
        f"| independent ({row['leaves_per_prompt']} trajectories) | {nfe['independent']} | {median['independent']:.2f} "
        "| 1.00 |",
        f"| tree (splits {splits} of {row['steps']}, x2) | {nfe['tree']} | {median['tree']:.2f} | {row['speedup']:.2f} |"])


def main() -> None:
    import torch

    from flowalign.evaluation.geneval import load_metadata
    from flowalign.models import load_flow_model
    from flowalign.samplers import TreeSchedule, noise_schedule, rollout, tree_rollout

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "assets/toy-sd3"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "bench/results/tree_rollout.json"))
    args = parser.parse_args()

    model = load_flow_model(args.model)
    prompts = [e["prompt"] for e in load_metadata(REPO / "assets/prompts/train.jsonl")[: args.prompts]]
    cond = model.encode(prompts)
    schedule = TreeSchedule(split_steps=(0, 3, 6, 9), branching=2)
    leaves = schedule.leaves
    sigmas = model.sigmas(args.steps)
    levels = noise_schedule(0.7).levels(args.steps)
    per_leaf = cond.repeat_interleave(leaves)

    def tree_velocity(x, sigma, tree):
        return model.velocity(x, sigma, cond.index(tree))

    def run_tree():
        roots = model.prepare_noise(len(prompts), generator=torch.Generator().manual_seed(0))
        return tree_rollout(tree_velocity, roots, sigmas, levels, schedule, generator=torch.Generator().manual_seed(1))

    def run_independent():
        x = model.prepare_noise(len(prompts) * leaves, generator=torch.Generator().manual_seed(0))
        return rollout(model.velocity_fn(per_leaf), x, sigmas, levels, generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        run_tree(), run_independent()  # warm-up
        times = {"tree": [], "independent": []}
        nfe = {}
        for _ in range(args.repeats):
            for name, fn in (("tree", run_tree), ("independent", run_independent)):
                start = time.perf_counter()
                result = fn()
                times[name].append(time.perf_counter() - start)
                nfe[name] = result.nfe // len(prompts)
    tree_s, indep_s = statistics.median(times["tree"]), statistics.median(times["independent"])
    row = {"steps": args.steps, "split_steps": list(schedule.split_steps), "leaves_per_prompt": leaves,
           "prompts": len(prompts), "nfe_per_prompt": nfe, "median_s": {"tree": tree_s, "independent": indep_s},
           "speedup": indep_s / tree_s, "nfe_ratio": nfe["independent"] / nfe["tree"], "repeats": args.repeats,
           "threads": torch.get_num_threads()}
    print(table(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
