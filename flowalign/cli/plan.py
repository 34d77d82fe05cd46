"""``flowalign plan CONFIG [key=value ...] --gpus N --gpu-memory GiB [--nodes K] [--context-parallel N]``: whether a
training config fits its GPUs, before any weight loads (``flowalign.memory.planner``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from flowalign.settings import at_least, check, option

from .options import ConfigCommand, add_config_command


@dataclass
class PlanOptions:
    """``flowalign plan``'s own settings (the rest of its command line is the training config)."""

    gpus: int = option(1, "GPUs (processes) per node")
    gpu_memory: float = option(80.0, "memory of one GPU in GiB (80 for an H100 80GB, 141 for an H200)")
    nodes: int = option(1, "nodes")
    context_parallel: int | None = option(
        None, "context parallel degree: each process holds 1/N of the sequence and its activations (default: the "
              "config's distributed.context_parallel, ulysses x ring)")

    def validate(self) -> None:
        at_least("gpus", self.gpus, 1)
        at_least("nodes", self.nodes, 1)
        if self.context_parallel is not None:
            at_least("context_parallel", self.context_parallel, 1)
        check(math.isfinite(self.gpu_memory) and self.gpu_memory > 0, "gpu_memory",
              f"must be a positive number of GiB, got {self.gpu_memory!r}")


def _run_plan(config, args: argparse.Namespace) -> None:
    from flowalign.errors import setup_phase
    from flowalign.memory.planner import describe, plan_config

    options = args.options
    with setup_phase():
        result = plan_config(config, gpus=options.gpus, gpu_memory_gib=options.gpu_memory, nodes=options.nodes,
                             context_parallel=options.context_parallel)
    print(describe(result))


def add_plan(commands) -> None:
    add_config_command(
        commands, "plan", ConfigCommand("flowalign.training.config:TrainConfig", _run_plan, options=PlanOptions),
        help="memory per process of a training config on N GPUs, and whether it fits, without loading any weight",
        description="Build the model on the meta device from its config (a local model directory, or a published "
        "model whose config ships in configs/published), measure the activations of a small model of its family "
        "and scale them to the configured resolution and frames, and print per process the parameters, gradients, "
        "optimizer state, reference copy, LoRA, frozen encoders and activations (with and without checkpointing), "
        "then whether it fits --gpu-memory GiB, or the smallest change that does.")
