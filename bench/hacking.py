"""Reward hacking on purpose: train on a hackable reward, with and without the defences, and watch it collapse.

Each run is a plain ``flowalign train`` of the toy default (or a preset) whose reward is a hackable proxy
(``--proxy``, default ``brightness``: the mean pixel value, maximised by a white canvas), for ``--iterations``
iterations. The collapse metrics every run logs (``flowalign.training.collapse``) show the hacking as it starts:
``collapse/held_out/toy_geneval`` (the exact verifier, which no run optimises), ``collapse/saturated_frac`` (pixel
channels at 0 or 1) and ``collapse/diversity`` (within-group ``toy_scene`` distance), beside the proxy's own
``reward``. Runs (``--runs``):

* ``plain``: the default run (Flow-GRPO-Fast) on the proxy alone, no KL;
* ``kl``: the same with a KL to the base model (``loss.grpo.beta``, ``--kl-beta``);
* ``gardo``: ``configs/methods/gardo.yaml`` with the proxy in place of ``toy_geneval_soft``: the KL gated to the samples
  whose proxy rank disagrees most with the partial-credit verifier's (an auxiliary of weight 0), the reference reset
  every 16 iterations, and the diversity-weighted advantage.

Writes ``<out>/hacking.json`` (every run's curves), ``hacking.md`` (the first and last iterations' means) and one
plot per curve, one line per run, each a trailing mean of 5 iterations: ``hacking.png`` (the held-out verifier),
``hacking_proxy.png``, ``hacking_diversity.png`` and ``hacking_saturated.png``.

    python bench/hacking.py [--iterations 60] [--runs plain kl gardo] [--out bench/results/hacking]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot import line_plot  # noqa: E402 - bench/plot.py

HELD_OUT = "collapse/held_out/toy_geneval"
CURVES = ("reward", HELD_OUT, "collapse/saturated_frac", "collapse/diversity")
COLORS = {"plain": (214, 39, 40), "kl": (255, 127, 14), "gardo": (31, 119, 180)}
SMOOTH = 5
# curve -> (PNG name suffix, axis label); hacking.png is the held-out verifier
PLOTS = {HELD_OUT: ("", "held-out exact verifier (toy_geneval, binary)\non the training samples"),
         "reward": ("_proxy", "proxy reward"),
         "collapse/diversity": ("_diversity", "within-group diversity (toy_scene)"),
         "collapse/saturated_frac": ("_saturated", "saturated pixel fraction")}
COMMON = ["train.tracker=none", "train.sample_every=0", "train.checkpoint_every=0", "train.eval_at_end=false",
          "collapse.held_out=toy_geneval"]


def plot(curves: dict[str, dict[str, list[float]]], out: Path) -> None:
    """The four PNGs (``PLOTS``) of ``curves`` (run -> curve -> values per iteration) into ``out``."""
    for key, (suffix, label) in PLOTS.items():
        line_plot({name: list(enumerate(smooth(curve[key]))) for name, curve in curves.items()},
                  out / f"hacking{suffix}.png", x_label="iteration",
                  y_label=label, title=f"trailing mean of {SMOOTH} iterations", colors=COLORS)


def run_config(name: str, proxy: str, kl_beta: float) -> tuple[list[str], list[str]]:
    """``(config files, overrides)`` of run ``name`` on the proxy reward."""
    proxy_reward = f"reward.rewards=[{{name: {proxy}, weight: 1.0}}]"
    if name == "plain":
        return [], [proxy_reward]
    if name == "kl":
        return [], [proxy_reward, f"loss.grpo.beta={kl_beta}"]
    if name == "gardo":
        rewards = (f"reward.rewards=[{{name: {proxy}, weight: 1.0}}, "
                   "{name: toy_geneval, weight: 0.0, kwargs: {partial_credit: true}}]")
        return [str(REPO / "configs/methods/gardo.yaml")], [rewards, "loss.gated_kl.auxiliaries=[toy_geneval]"]
    raise SystemExit(f"unknown run {name!r}: expected plain, kl or gardo")


def train(name: str, args, out: Path) -> list[dict]:
    run = out / name
    if not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < args.iterations:
        configs, overrides = run_config(name, args.proxy, args.kl_beta)
        command = [str(Path(sys.executable).with_name("flowalign")), "train", *configs, *COMMON, *overrides,
                   f"train.iterations={args.iterations}", f"train.seed={args.seed}", f"train.out_dir={run}",
                   "train.overwrite=true", *args.set]
        start = time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            done = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if done.returncode != 0:
            raise SystemExit(f"run {name} failed (exit {done.returncode}): see {out / f'{name}.log'}")
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int = SMOOTH) -> list[float]:
    """The trailing mean over ``window`` iterations (each iteration's value is 64 samples of 4 prompts: noisy)."""
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def table(curves: dict[str, dict[str, list[float]]]) -> str:
    lines = [f"Each cell: the mean of the first {SMOOTH} iterations -> the mean of the last {SMOOTH}.", "",
             "| run | iterations | proxy reward | held-out exact verifier | saturated pixels | diversity |",
             "|---|---:|---|---|---|---|"]
    for name, curve in curves.items():
        cells = [f"{statistics.fmean(curve[key][:SMOOTH]):.3f} -> {statistics.fmean(curve[key][-SMOOTH:]):.3f}"
                 for key in CURVES]
        lines.append(f"| {name} | {len(curve[CURVES[0]])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--proxy", default="brightness")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--runs", nargs="+", default=["plain", "kl", "gardo"])
    parser.add_argument("--kl-beta", type=float, default=0.04)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for every run (e.g. optim.lr=2e-3 to hack sooner)")
    parser.add_argument("--out", default=str(REPO / "bench/results/hacking"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {}
    for name in args.runs:
        history = train(name, args, out)[: args.iterations]
        curves[name] = {key: [float(m.get(key, float("nan"))) for m in history] for key in CURVES}
    (out / "hacking.json").write_text(json.dumps({"settings": vars(args), "curves": curves}, indent=1))
    text = table(curves)
    (out / "hacking.md").write_text(text + "\n")
    plot(curves, out)
    print(text)


if __name__ == "__main__":
    main()
