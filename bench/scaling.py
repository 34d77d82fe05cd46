"""How one training iteration's cost grows with the work: wall time and peak memory while one size grows.

The measured run is the default run's iteration (``configs/default.yaml``: DiffusionNFT, the toy SD3, LoRA) at a
small base point, ``BASE``: 2 prompts x 8 images, 10 steps, 32 px, the toy transformer, one process, one intra-op
thread, the default run's reward plus brightness (``REWARDS``). Each axis grows one size and keeps the others at
the base:

| axis | key | work (x) |
| --- | --- | --- |
| ``group_size`` | ``data.group_size`` | images per prompt |
| ``prompts`` | ``data.prompts_per_iteration`` | prompts per iteration |
| ``steps`` | ``sampling.num_steps`` | sampling steps |
| ``image_size`` | ``sampling.image_size`` | pixels per image (side squared) |
| ``width`` | ``num_attention_heads`` and ``num_layers`` of the toy transformer | its parameters |
| ``processes`` | ``torchrun --nproc_per_node`` (gloo, DDP) | processes, the same global work |
| ``threads`` | ``train.threads`` | torch's intra-op threads, the same work |

``image_size`` and ``width`` run a transformer built from the toy's own config (``assets/toy-sd3``) with those keys
changed and fresh weights (cost does not depend on the weights): ``image_size`` needs a positional table of 64
patches a side (``pos_embed_max_size``; the toy's 16 stops at 64 px), ``width`` grows heads (of 32 dimensions) and
layers together. Every other point runs the toy pipeline itself.

Each point is its own process (``processes``: a ``torchrun`` launch) that builds the trainer, runs ``--iterations``
iterations (``Trainer.step``) and reports each one's wall time and the peak resident memory of the iterations alone
(``/proc/self/clear_refs`` resets the peak after the set-up; ``flowalign.memory.resident``). The first iteration is
a warm-up and is dropped; the time is the mean of the rest. One more, untimed iteration runs under torch's
``FlopCounterMode``, which counts the floating-point operations of every matrix product and convolution, forward and
backward, against which the time's growth is read (time that grows as the FLOPs do is the arithmetic's; time that
grows slower is a fixed part being amortised). torch's counter has no formula for the CPU's attention kernels
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward); ``attention_formulas`` gives them torch's own
counts for the other attention kernels, so attention is in the count (a row records it: ``attention_counted``; rows
measured before it was are without). For ``processes`` the time is rank 0's, the FLOPs the sum over processes and
the memory each process's peak (the table shows each).

The exponent ``b`` of each axis is the least-squares slope of ``log cost`` against ``log work`` over its points
(``cost ~ a * work^b``: 1 is linear, below 1 means a fixed part that the work amortises, above 1 worse than linear),
and the local exponent between its two largest points, where the fixed part weighs least; the same fit for each
phase (rollout, reward, train: the trainer's own timers) shows which part the axis drives. For the ``processes``
and ``threads`` axes the work is fixed and the exponent is that of time against the count (-1 is perfect scaling).

    python bench/scaling.py [--axes group_size steps ...] [--iterations 3] [--out bench/results/scaling]

``--merge`` measures only ``--axes`` again and keeps the other axes' rows of the ``scaling.json`` in ``--out``; each
row records its own overrides, and the JSON's ``runs`` says when each set of axes ran, with the machine's load.

Writes ``scaling.json`` (after each point, so a cut-short run keeps what it measured), ``scaling.md`` (the table)
and ``scaling_time.png`` / ``scaling_memory.png`` (each relative to its axis's first point, on log-log axes, beside
the line of linear growth).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "assets/toy-sd3"
DEFAULT_RUN = REPO / "configs/default.yaml"  # what `flowalign train` runs without a config (the schema's defaults differ)
# The default run's reward plus brightness: a freshly initialised transformer's images all score 0 on the verifier, and
# a group without a spread trains nothing (``skip_without_signal``); brightness gives every group a spread, so every
# iteration of every point rolls out, scores and trains as the default run's does. At weight 1: the brightness of a
# fresh model's 128-px images spreads by about 1e-3 within a group, which a weight of 0.001 took below the spread
# that counts as none (``flowalign.advantages.ZERO_STD``, 1e-6).
REWARDS = "reward.rewards=[{name: toy_geneval, kwargs: {partial_credit: true}}, {name: brightness}]"
# A learning rate of 1e-9: the same operations as the default's 5e-4 at the same cost, but the weights barely move,
# so every timed iteration measures the same model.
BASE = ["data.prompts_per_iteration=2", "data.group_size=8", "sampling.num_steps=10", "train.threads=1", REWARDS,
        "optim.lr=1e-9", "train.tracker=none", "train.eval_at_end=false", "train.sample_every=0",
        "train.checkpoint_every=0"]
AXES = {
    "group_size": dict(key="data.group_size", points=[4, 8, 16, 32], work="images per prompt"),
    "prompts": dict(key="data.prompts_per_iteration", points=[1, 2, 4, 8], work="prompts per iteration"),
    "steps": dict(key="sampling.num_steps", points=[5, 10, 20, 40], work="sampling steps"),
    "image_size": dict(key="sampling.image_size", points=[32, 48, 64, 96, 128], work="pixels per image"),
    "width": dict(key="transformer", points=[4, 6, 8, 10], work="transformer parameters"),
    "processes": dict(key="nproc_per_node", points=[1, 2], work="processes (same global work)"),
    "threads": dict(key="train.threads", points=[1, 2], work="intra-op threads (same work)"),
}
WIDE_TABLE = 64  # pos_embed_max_size of the image_size axis's transformer: up to 64 patches of 2 latents of 2 px
COLORS = {"group_size": (31, 119, 180), "prompts": (255, 127, 14), "steps": (44, 160, 44),
          "image_size": (214, 39, 40), "width": (148, 103, 189), "processes": (140, 86, 75), "threads": (227, 119, 194),
          "linear": (150, 150, 150)}


def toy_variant(out: Path, **transformer) -> Path:
    """The toy SD3 pipeline with a freshly initialised transformer whose config has ``transformer``'s keys changed
    (``num_attention_heads`` also sets the caption projection's width), saved to ``out``; returns ``out``."""
    import torch
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(TOY)
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    config.update(transformer)
    config["caption_projection_dim"] = config["num_attention_heads"] * config["attention_head_dim"]
    torch.manual_seed(0)
    pipe.transformer = SD3Transformer2DModel(**config)
    pipe.save_pretrained(out)
    return out


def _attention_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """``QK^T`` and ``PV``: ``4 B H S_q S_k D`` (torch's ``sdpa_flop_count``, on the shapes)."""
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query, key, value)


def _attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The scores recomputed, then the gradients of ``V``, the scores, ``Q`` and ``K``: ``10 B H S_q S_k D``."""
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out, query, key, value)


def attention_formulas() -> dict:
    """``FlopCounterMode``'s ``custom_mapping`` for the CPU attention kernels (their arguments begin as the CUDA
    kernels' do: ``query, key, value`` forward, ``grad_out, query, key, value`` backward)."""
    import torch
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    return {cpu_flash: _attention_forward, cpu_flash_backward: _attention_backward}  # packets, as the counter keys them


def worker(iterations: int, result: Path, overrides: list[str]) -> None:
    """One measured process: build the trainer, run ``iterations`` iterations, write this rank's figures."""
    from torch.utils.flop_counter import FlopCounterMode
    from train_iteration import iteration_cost  # bench/ is this script's folder

    from flowalign.config import load_config
    from flowalign.memory.resident import reset_peak, resident
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    trainer = Trainer(load_config(TrainConfig, str(DEFAULT_RUN), overrides))
    parameters = sum(p.numel() for p in trainer.model.transformer.parameters())
    before = reset_peak()
    seconds = []
    for _ in range(iterations):
        clock = time.perf_counter()
        trainer.step()
        seconds.append(time.perf_counter() - clock)
    peak = resident()["VmHWM"]
    phases = iteration_cost(trainer.history)  # the timed iterations' phases, the warm-up dropped
    with FlopCounterMode(display=False, custom_mapping=attention_formulas()) as counter:
        trainer.step()  # one more iteration, untimed: its arithmetic
    rank = int(os.environ.get("RANK", 0))
    figures = {"seconds": seconds, "rss_before": before, "peak_rss": peak, "flops": counter.get_total_flops(),
               "attention_counted": True, "transformer_parameters": parameters, "phases": phases}
    (result / f"rank{rank}.json").write_text(json.dumps(figures))


def measure(axis: str, point: int, iterations: int, scratch: Path) -> dict:
    """Run ``axis`` at ``point`` in a process (or a ``torchrun`` launch) of its own; returns its row."""
    overrides, nproc = list(BASE), 1
    if axis == "width":
        wider = toy_variant(scratch / f"width{point}", num_attention_heads=point, num_layers=point)
        overrides.append(f"model.path={wider}")
    elif axis == "image_size":
        wide = scratch / "wide_table"
        if not wide.exists():
            toy_variant(wide, pos_embed_max_size=WIDE_TABLE)
        overrides += [f"model.path={wide}", f"sampling.image_size={point}"]
    elif axis == "processes":
        nproc = point
    else:
        overrides.append(f"{AXES[axis]['key']}={point}")
    result = scratch / f"{axis}-{point}"
    result.mkdir()
    overrides.append(f"train.out_dir={result / 'run'}")
    script = [str(Path(__file__).resolve()), "--worker", str(iterations), str(result), *overrides]
    if axis == "processes":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *script]
    else:
        command = [sys.executable, *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{axis}={point} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    ranks = [json.loads((result / f"rank{r}.json").read_text()) for r in range(nproc)]
    timed = ranks[0]["seconds"][1:] or ranks[0]["seconds"]
    return {"axis": axis, "point": point, "overrides": overrides[:-1], "nproc": nproc,
            "work": work_of(axis, point, ranks[0]), "seconds": sum(timed) / len(timed),
            "all_seconds": ranks[0]["seconds"], "phases": ranks[0]["phases"],
            "peak_rss": [r["peak_rss"] for r in ranks], "rss_before": [r["rss_before"] for r in ranks],
            "iteration_memory": [max(0, r["peak_rss"] - r["rss_before"]) for r in ranks],
            "transformer_parameters": ranks[0]["transformer_parameters"], "flops": sum(r["flops"] for r in ranks),
            "attention_counted": ranks[0]["attention_counted"]}


def work_of(axis: str, point: int, figures: dict) -> float:
    """The size that ``axis`` grows: pixels for ``image_size``, parameters for ``width``, else the point itself."""
    if axis == "image_size":
        return float(point * point)
    if axis == "width":
        return float(figures["transformer_parameters"])
    return float(point)


def exponent(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``log y`` on ``log x`` over ``points`` ``(x, y)``; None under two points."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else None


def fits(rows: list[dict]) -> dict[str, dict]:
    """Per axis: the exponents of time and of the iterations' memory (total over processes), over all its points
    and between its two largest."""
    out = {}
    for axis in AXES:
        mine = sorted((r for r in rows if r["axis"] == axis and "error" not in r), key=lambda r: r["work"])
        if len(mine) < 2:
            continue
        time_points = [(r["work"], r["seconds"]) for r in mine]
        memory_points = [(r["work"], sum(r["iteration_memory"])) for r in mine if sum(r["iteration_memory"]) > 0]
        out[axis] = {"time": exponent(time_points), "time_last": exponent(time_points[-2:]),
                     "memory": exponent(memory_points), "memory_last": exponent(memory_points[-2:])}
        out[axis]["flops"] = exponent([(r["work"], r["flops"]) for r in mine if r.get("flops")])
        for phase in ("rollout", "reward", "train"):
            out[axis][phase] = exponent([(r["work"], r["phases"][f"time/{phase}"]) for r in mine
                                         if r["phases"].get(f"time/{phase}", 0) > 0])
    return out


def merged(earlier: list[dict], measured: list[dict]) -> list[dict]:
    """The rows of ``earlier`` whose axes were not measured again, and ``measured``, in ``AXES`` order."""
    again = {r["axis"] for r in measured}
    rows = [r for r in earlier if r["axis"] not in again] + measured
    return sorted(rows, key=lambda r: list(AXES).index(r["axis"]))  # stable: each axis's points stay in order


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict], exponents: dict[str, dict]) -> str:
    """The markdown table: one line per point, then one per axis with its exponents."""
    uncounted = " †"  # a row measured before the CPU attention kernels were counted
    lines = ["| axis | point | work | s / iteration | rollout / reward / train s | GFLOP / iteration "
             "| GFLOP/s | peak RSS MiB | iteration's memory MiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['axis']} | {r['point']} | failed: {r['error']} | | | | | | |")
            continue
        phases = r["phases"]
        split = " / ".join(f"{phases.get(k, 0.0):.2f}" for k in ("time/rollout", "time/reward", "time/train"))
        peak = " + ".join(f"{p / 2**20:.0f}" for p in r["peak_rss"])
        grown = " + ".join(f"{m / 2**20:.0f}" for m in r["iteration_memory"])
        lines.append(f"| {r['axis']} | {r['point']} | {r['work']:.4g} | {r['seconds']:.2f} | {split} | "
                     f"{r['flops'] / 1e9:.1f}{'' if r.get('attention_counted') else uncounted} | "
                     f"{r['flops'] / 1e9 / r['seconds']:.1f} | {peak} | {grown} |")
    lines += ["", "| axis | work | time exponent | two largest | rollout | reward | train | FLOP exponent "
              "| memory exponent | two largest |", "|---|---|---|---|---|---|---|---|---|---|"]
    for axis, e in exponents.items():
        keys = ("time", "time_last", "rollout", "reward", "train", "flops", "memory", "memory_last")
        cells = [_fmt(e[k]) for k in keys]
        if not all(r.get("attention_counted") for r in rows if r.get("axis") == axis and "error" not in r):
            cells[5] += uncounted
        lines.append(f"| {axis} | {AXES[axis]['work']} | " + " | ".join(cells) + " |")
    if uncounted in "\n".join(lines):
        lines += ["", f"{uncounted.strip()} without attention: measured before `bench/scaling.py` counted the CPU "
                  "attention kernels."]
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> None:
    """Time and the iterations' memory against work, each relative to its axis's first point, log-log."""
    from plot import line_plot

    good = [r for r in rows if "error" not in r]
    for name, value in (("time", lambda r: r["seconds"]), ("memory", lambda r: sum(r["iteration_memory"]))):
        series = {}
        for axis in AXES:
            mine = sorted((r for r in good if r["axis"] == axis and value(r) > 0), key=lambda r: r["work"])
            if mine:
                series[axis] = [(r["work"] / mine[0]["work"], value(r) / value(mine[0])) for r in mine]
        if not series:
            continue
        largest = max(x for points in series.values() for x, _ in points)
        series["linear"] = [(1.0, 1.0), (largest, largest)]
        line_plot(series, out / f"scaling_{name}.png", x_label="work / the axis's first point (processes, threads: their count)",
                  y_label=f"{'seconds per iteration' if name == 'time' else 'iteration memory'} / the first point's",
                  colors=COLORS, log=True, title=f"one iteration's {name} as the work grows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--axes", nargs="*", default=list(AXES), choices=list(AXES))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "bench/results/scaling"))
    parser.add_argument("--merge", action="store_true",
                        help="keep the other axes' rows of an earlier scaling.json in --out (each row records its "
                             "own overrides; the JSON's runs list says when each axis ran)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = {"axes": args.axes, "base": BASE, "iterations": args.iterations, "cpu_count": os.cpu_count(),
           "cpu": platform.processor() or platform.machine(), "load_average_at_start": list(os.getloadavg()),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    earlier = json.loads((out / "scaling.json").read_text()) if args.merge else {"runs": [], "rows": []}
    header = {"runs": earlier["runs"] + [run]}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for axis in args.axes:
            for point in AXES[axis]["points"]:
                try:
                    rows.append(measure(axis, point, args.iterations, Path(scratch)))
                except RuntimeError as error:
                    rows.append({"axis": axis, "point": point, "error": str(error).splitlines()[0],
                                 "log": str(error)[-1500:]})
                    print(rows[-1]["log"], flush=True)
                print(f"{axis}={point}: " + (f"{rows[-1]['seconds']:.2f} s" if "error" not in rows[-1] else "failed"),
                      flush=True)
                write(out / "scaling.json", {**header, "rows": merged(earlier["rows"], rows)})
    run["load_average_at_end"] = list(os.getloadavg())
    rows = merged(earlier["rows"], rows)
    exponents = fits(rows)
    write(out / "scaling.json", {**header, "rows": rows, "exponents": exponents})
    text = table(rows, exponents)
    write_text(out / "scaling.md", text + "\n")
    plot(rows, out)
    print(text)


def write(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=1) + "\n")


def write_text(path: Path, text: str) -> None:
    from flowalign.outputs import write_atomically

    with write_atomically(path) as tmp:
        Path(tmp).write_text(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        main()
