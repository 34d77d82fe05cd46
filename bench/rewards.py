"""Rewards out of process: per-iteration wall time of the toy default run with in-process scoring, sequential remote
scoring and overlapped remote scoring (``reward.overlap``), and a reward server's throughput at requests of 1, 8 and
32 images.

A reward server (``flowalign serve-reward``) runs in a subprocess on 127.0.0.1 and serves ``toy_geneval`` (partial
credit, the default run's reward) and ``brightness`` (almost no compute: the cost of the transport itself). Each
training mode builds a trainer from the default config (``--prompts`` x ``--group`` samples, ``--steps`` steps, rollout
chunks of ``--chunk`` samples: overlap scores a chunk while the next rolls out) and runs one warm-up iteration; then
``--iterations`` rounds run one iteration of every mode in turn (interleaved, so all modes see the same machine
state), and the table gives the medians of the iteration's wall time and of its rollout and reward phases. ``--delay-ms`` adds two rows scored by a reward that sleeps that long per image on
the server (a slow reward model or judge, whose cost grows with the images: the case overlap is for). Throughput: ``--clients`` threads send requests of 1, 8 and 32 toy images
for ``--seconds`` each (safetensors encoding, server batch size 32).

    python bench/rewards.py [--iterations 3] [--prompts 4] [--group 16] [--steps 10] [--chunk 16] [--delay-ms 0]
                            [--out bench/results/rewards.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The server process: the CLI, plus toy_geneval behind a delay per image (a slow reward, for --delay-ms).
SERVER = """
import sys, time
import flowalign
from flowalign.rewards import build_reward

class Delayed:
    name = "delayed_toy_geneval"
    def __init__(self, delay_ms=0.0):
        self.delay, self.inner = delay_ms / 1000, build_reward("toy_geneval", partial_credit=True)
    def __call__(self, images, prompts, metadata):
        time.sleep(self.delay * len(prompts))
        return self.inner(images, prompts, metadata)

flowalign.register_reward("delayed_toy_geneval", Delayed)
from flowalign.cli import main
main(sys.argv[1:])
"""


def table(result: dict) -> str:
    """The markdown tables of one result (``result`` as this script writes it)."""
    rows = ["| scoring | iteration s | rollout s | reward s | vs in-process |", "|---|---|---|---|---|"]
    base = result["training"][0]["iteration_s"]
    for row in result["training"]:
        rows.append(f"| {row['mode']} | {row['iteration_s']:.2f} | {row['rollout_s']:.2f} | {row['reward_s']:.2f} | "
                    f"{row['iteration_s'] / base:.2f} |")
    rows += ["", "| reward | images per request | requests | images/s |", "|---|---|---|---|"]
    for row in result["throughput"]:
        rows.append(f"| {row['reward']} | {row['batch']} | {row['requests']} | {row['images_per_s']:.0f} |")
    return "\n".join(rows)


def start_server(directory: Path, delay_ms: float) -> tuple[subprocess.Popen, str]:
    port_file = directory / "port"
    config = {"rewards": [{"name": "toy_geneval", "kwargs": {"partial_credit": True}}, {"name": "brightness"},
                          {"name": "delayed_toy_geneval", "kwargs": {"delay_ms": delay_ms}}],
              "host": "127.0.0.1", "port": 0, "port_file": str(port_file), "batch_size": 32, "threads": 1}
    (directory / "server.yaml").write_text(json.dumps(config))
    log = open(directory / "server.log", "w")
    process = subprocess.Popen([sys.executable, "-c", SERVER, "serve-reward", str(directory / "server.yaml")],
                               cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                               stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the reward server did not start: {(directory / 'server.log').read_text()}")
        time.sleep(0.1)
    return process, f"http://127.0.0.1:{int(port_file.read_text())}"


def build_trainer(mode: str, entry: dict, args, out: Path, extra: dict):
    from flowalign.config import load_config
    from flowalign.training.config import TrainConfig
    from flowalign.training.trainer import Trainer

    values = {"reward.rewards": json.dumps([entry]), "data.prompts_per_iteration": args.prompts,
              "data.group_size": args.group, "sampling.num_steps": args.steps, "sampling.batch_size": args.chunk,
              "train.iterations": args.iterations + 1, "train.tracker": "none", "train.eval_at_end": "false",
              "train.sample_every": 0, "train.out_dir": str(out / mode.replace(" ", "_")),
              "collapse.enabled": "false",  # its held-out reward follows the trained reward's name: not comparable
              **extra}
    return Trainer(load_config(TrainConfig, None, [f"{k}={v}" for k, v in values.items()]))


def time_training(modes: list[tuple[str, dict, dict]], args, out: Path) -> list[dict]:
    """Every mode's trainer, one warm-up iteration each, then ``args.iterations`` rounds of one iteration per mode,
    interleaved so that every mode sees the same machine state; the medians per mode."""
    trainers = [build_trainer(mode, entry, args, out, extra) for mode, entry, extra in modes]
    for trainer in trainers:
        trainer.step()  # warm-up
    readings = [{"iteration_s": [], "rollout_s": [], "reward_s": []} for _ in modes]
    for _ in range(args.iterations):
        for trainer, reading in zip(trainers, readings):
            start = time.perf_counter()
            metrics = trainer.step()
            reading["iteration_s"].append(time.perf_counter() - start)
            reading["rollout_s"].append(metrics["time/rollout"])
            reading["reward_s"].append(metrics["time/reward"])
    return [{"mode": mode, **{key: statistics.median(values) for key, values in reading.items()},
             "iterations": args.iterations} for (mode, _, _), reading in zip(modes, readings)]


def throughput(url: str, reward: str, batch: int, args) -> dict:
    import torch

    from flowalign.data.prompts import load_prompts
    from flowalign.remote.transport import request
    from flowalign.remote.wire import encode_request

    prompts = load_prompts(REPO / "assets/prompts/train.jsonl")[:batch]
    prompts = (prompts * batch)[:batch]
    images = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    body, kind = encode_request([reward], images, [p["prompt"] for p in prompts], prompts)
    counts = [0] * args.clients
    stop = time.monotonic() + args.seconds

    def client(k: int) -> None:
        while time.monotonic() < stop:
            request(f"{url}/v1/score", data=body, headers={"Content-Type": kind}, timeout=60)
            counts[k] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return {"reward": reward, "batch": batch, "requests": sum(counts), "images_per_s": sum(counts) * batch / elapsed,
            "clients": args.clients, "seconds": elapsed}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per mode (after one warm-up)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=16, help="sampling.batch_size: samples per rollout chunk")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="server-side delay per image scored")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput reading")
    parser.add_argument("--out", default=str(REPO / "bench/results/rewards.json"))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        server, url = start_server(directory, args.delay_ms)
        try:
            remote = {"name": "remote", "kwargs": {"url": url, "reward": "toy_geneval"}}
            overlap = {"reward.overlap": "true"}
            modes = [("in-process", {"name": "toy_geneval", "kwargs": {"partial_credit": True}}, {}),
                     ("remote, sequential", remote, {}), ("remote, overlapped", remote, overlap)]
            if args.delay_ms:  # a slow reward: the server sleeps delay_ms per image
                slow = {"name": "remote", "kwargs": {"url": url, "reward": "delayed_toy_geneval"}}
                label = f"remote + {args.delay_ms:g} ms per image"
                modes += [(f"{label}, sequential", slow, {}), (f"{label}, overlapped", slow, overlap)]
            training = time_training(modes, args, directory)
            readings = [throughput(url, reward, batch, args) for reward in ("toy_geneval", "brightness")
                        for batch in (1, 8, 32)]
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    result = {"training": training, "throughput": readings, "threads": torch.get_num_threads(),
              "delay_ms": args.delay_ms, "prompts": args.prompts, "group": args.group, "steps": args.steps, "chunk": args.chunk,
              "clients": args.clients}
    print(table(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
