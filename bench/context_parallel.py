"""Context parallel 2 on two GPUs (``bench/device_check.sh``'s stage; unverified until a machine with two GPUs runs
it): the runs of tests/test_context_parallel.py on CUDA with NCCL instead of CPU processes with gloo.

    python bench/context_parallel.py --out bench/results/device/context_parallel.json

Two processes (``torchrun``, tests/context_parallel_worker.py) train one iteration of the tiny FLUX and the tiny
Wan2.1 with Ulysses 2, and of the tiny FLUX with ring attention 2 in bf16 (cuDNN's attention, which returns the
log-sum-exp ring attention merges by; not available on CPU); this process trains the same iterations on one GPU
without context parallelism. Written per run: the relative differences of the rollout's log-probs, the rewards, the
loss, the gradient norm and the update (tests/context_parallel_runs.py), the first ratio, the tokens each process's
first block saw against one process's, and the peak GPU memory of this process's one-GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PAIRS = {"flux-cp2": "flux-cp2", "wan-cp2": "wan-cp2", "flux-ring2": "flux-bf16"}  # split run -> its one-GPU run
OFF = {"distributed.context_parallel.ulysses": 1, "distributed.context_parallel.ring": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"context parallel 2 needs two GPUs; this machine has {torch.cuda.device_count()}: skipped")
        return
    from safetensors.torch import load_file

    from conftest import WORDS
    from context_parallel_runs import one_iteration, relative, trainer_for, update_difference
    from flowalign.models.tiny import tiny_flux_pipeline
    from video_families import tiny_video_pipeline

    root = Path(tempfile.mkdtemp(prefix="context-parallel-"))
    tiny_flux_pipeline(WORDS, seed=0).save_pretrained(root / "flux")
    tiny_video_pipeline("wan").save_pretrained(root / "wan")
    out = root / "runs"
    out.mkdir()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(REPO / "tests/context_parallel_worker.py"), str(root), str(out), *PAIRS],
                          cwd=REPO / "tests", env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"the two-GPU launch failed with exit status {done.returncode}")
    results = {}
    for split_name, whole_name in PAIRS.items():
        split = load_file(str(out / f"{split_name}.safetensors"))
        torch.cuda.reset_peak_memory_stats()
        whole = one_iteration(trainer_for(root, whole_name, root / f"one-{whole_name}", **OFF))
        results[split_name] = {
            "log_probs": relative(split["log_probs"], whole["log_probs"]),
            "rewards": relative(split["rewards"], whole["rewards"]),
            "loss": relative(split["loss"], whole["loss"]), "grad_norm": relative(split["grad_norm"],
                                                                                  whole["grad_norm"]),
            "update": update_difference(split, whole), "first_ratio_max": float(split["first_ratio_max"]),
            "block_tokens": [int(split["layout/block_tokens"]), int(whole["layout/block_tokens"])],
            "one_gpu_peak_mib": torch.cuda.max_memory_allocated() / 2**20}
        print(split_name, json.dumps(results[split_name]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".tmp-{args.out.name}")
    tmp.write_text(json.dumps({"device": torch.cuda.get_device_name(), "runs": results}, indent=1) + "\n")
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
