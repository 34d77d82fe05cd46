"""The full crash matrix: SIGKILL training at every kill point of a checkpoint save, then ``--resume latest``.

For each engine, every ``(point, rank)`` a save passes (``tests/crash_matrix.py``'s ``cases``; the points are
``flowalign.training.kill_points.KILL_POINTS``) is one case: train ``ITERATIONS`` iterations with
``FLOWALIGN_FAULT=kill:<point>:2:<rank>``, check every checkpoint left under its normal name against the
uninterrupted run's, resume with ``--resume latest`` at the same process count and compare the final checkpoint
bitwise. Engines:

* ``single``: one process (``flowalign train``, ddp engine);
* ``single-resave``: one process that re-saves its last iteration after ``train()`` (``trainer.save()``), killed
  during the re-save (forked from this process);
* ``ddp``: 2 processes, ``torchrun`` on CPU with gloo, ddp engine;
* ``fsdp2``: 2 processes, ``torchrun`` on CPU with gloo, fsdp2 engine.

Prints per engine the kill points tried and the losses (the goal is 0), and writes the cases to ``--out``.

    python bench/crash_matrix.py [--engines single single-resave ddp fsdp2] [--out bench/results/crash_matrix.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import crash_matrix as matrix  # noqa: E402 - tests/crash_matrix.py

ENGINES = {"single": ("ddp", 1), "single-resave": ("ddp", 1), "ddp": ("ddp", 2), "fsdp2": ("fsdp2", 2)}


def tiny_model(root: Path) -> Path:
    from flowalign.models.tiny import tiny_sd3_pipeline
    from flowalign.toy.prompts import split_prompts

    train, test = split_prompts()
    path = root / "tiny-sd3"
    tiny_sd3_pipeline(sorted({w for e in train + test for w in e["prompt"].split()}), seed=0).save_pretrained(path)
    return path


def run_engine(name: str, model: Path, root: Path) -> list[dict]:
    engine, nproc = ENGINES[name]
    resave = name == "single-resave"
    reference = root / name / "reference"
    if resave:
        import torch

        torch.set_num_threads(1)
        code = matrix.train_in_fork(model, reference, engine, **{"train.keep_checkpoints": 9})
    else:
        code = matrix.launch(model, reference, engine, nproc, **{"train.keep_checkpoints": 9}).returncode
    if code != 0:
        raise SystemExit(f"{name}: the uninterrupted run failed (exit {code})")
    results = []
    points = [(p, 0) for p in matrix.RESAVE] if resave else matrix.cases(engine, nproc)
    for point, rank in points:
        run = root / name / f"{point}-{rank}"
        start = time.time()
        if resave:
            fault = matrix.fault(point, rank, iteration=matrix.ITERATIONS)
            code = matrix.train_in_fork(model, run, engine, fault, resave=True)
        else:
            killed = matrix.launch(model, run, engine, nproc, fault=matrix.fault(point, rank))
            code = killed.returncode
        case = {"engine": name, "point": point, "rank": rank, "killed_exit": code}
        if code == 0:
            case["reached"] = False  # the save never passed this point on this process (nothing was killed)
        else:
            case["reached"] = True
            problems = matrix.losses_after_kill(run, reference)
            if resave:
                code, tail = matrix.train_in_fork(model, run, engine, **{"train.resume": "latest"}), ""
            else:
                resumed = matrix.launch(model, run, engine, nproc, **{"train.resume": "latest"})
                code, tail = resumed.returncode, resumed.stderr.strip().splitlines()[-1:]
            if code != 0:
                problems.append(f"--resume latest failed: exit {code} {tail}")
            else:
                problems += matrix.final_differences(run, reference)
            case["problems"] = problems
        case["seconds"] = round(time.time() - start, 1)
        results.append(case)
        print(json.dumps(case), flush=True)
        shutil.rmtree(run, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/crash_matrix.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="crash-matrix-") as scratch:
        root = Path(scratch)
        model = tiny_model(root)
        for name in args.engines:
            results += run_engine(name, model, root)
    print("\n| engine | kill points tried | losses |\n|---|---|---|")
    summary = {}
    for name in args.engines:
        tried = [c for c in results if c["engine"] == name and c["reached"]]
        losses = [c for c in tried if c["problems"]]
        summary[name] = {"tried": len(tried), "losses": len(losses),
                         "not_reached": [f"{c['point']}@{c['rank']}" for c in results
                                         if c["engine"] == name and not c["reached"]]}
        print(f"| {name} | {len(tried)} | {len(losses)} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
