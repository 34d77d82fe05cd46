"""``flowalign sample``: reward-guided sampling with a registered guided sampler, built from ``SampleConfig``.

``--guidance NAME`` is ``sampler.name=NAME``; each setting of a registered sampler is an option too (``--lam 10`` is
``sampler.lam=10``, ``--dts-soft`` is ``sampler.soft=true``), generated from the samplers' settings dataclasses, so
a sampler registered by a user brings its own options."""

from __future__ import annotations

import argparse

from .options import ConfigCommand, add_config_command

__all__ = ["add_sample"]



def _run_sample(config, args: argparse.Namespace) -> None:
    from flowalign.inference.sample import run_sample

    summary = run_sample(config)
    line = f"{summary['prompts']} prompts, mean reward {summary['mean_reward']}, mean NFEs {summary['mean_nfe']:.1f}"
    if "geneval" in summary:
        line += f", toy GenEval overall {summary['geneval']['overall']:.3f}"
    print(f"wrote {config.out_dir}: {line}")


def add_sample(commands) -> None:
    add_config_command(
        commands, "sample", ConfigCommand("flowalign.inference.sample:SampleConfig", _run_sample),
        help="reward-guided sampling under an NFE budget (best-of-N, FK steering, DTS*, RGS, or a registered sampler)",
        description="Sample every prompt with a guided sampler that spends at most --budget NFEs per prompt; writes "
        "images/, grid.png, results.json (each chosen sample's reward and NFEs) and summary.md to --out; a video model "
        "writes videos/ (an mp4 and a frame strip PNG per sample) and grid.mp4 instead of images/.",
    )
