"""``flowalign prep calibrate``: DenseGRPO's per-step noise calibration, written as a config ``flowalign train`` takes.

Reference: Deng et al. 2026, "DenseGRPO" (arXiv:2601.20218), Algorithm 1, and docs/design/math.md#calibration. Before
training, each
round samples a batch of trajectories (the training config's prompts, group size and reward) with the current
per-step noise levels ``psi``, scores the full ODE completion of every state (``R_0 .. R_T``), takes the dense
rewards ``dR_t = R_{t+1} - R_t`` and updates every stochastic step's level with
:func:`flowalign.credit.step_rewards.calibrate_noise` (``+eps2`` where the signs of ``dR_t`` are balanced within ``eps1``,
``-eps2`` otherwise). The paper's ``psi`` is the SDE's diffusion coefficient itself; here it is the noise *level*
``a`` of ``sampling.kind`` per step (for ``flow_grpo`` the coefficient is ``a sqrt(s / (1 - s))``), so the table
plugs into ``sampling.noise_table`` and works for every SDE kind.

The output is a YAML config: ``base:`` the input config (when there is one), the command-line overrides, and
``sampling.noise_table`` with the calibrated levels, plus the per-round history as comments. Train with it directly:
``flowalign train calibrated.yaml``. Calibration runs SDE on every stochastic step of the base levels (an SDE window
in the config is kept for training but ignored while calibrating, so every step is measured).

What calibration needs of the training config's parts, each part declares: the rollout shape that it grows
independent trajectories (``RolloutShape.independent_trajectories``: chains do, trees and probed trunks share a
trunk and do not), and the SDE kind the largest noise level it accepts
(the SDE kind's ``max_noise_level``, ``flowalign.kernels.sde_kinds``: 1 for ``cps``), to which the calibrated levels are clamped.

On several processes (``torchrun ... flowalign prep calibrate``) every round gathers the dense rewards of all processes'
trajectories before updating the levels, so every process holds the same table (the one a single process computes
from the same samples), and only the main process writes the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import tempfile

import os
from pathlib import Path

import torch
import yaml

from flowalign.config import parse_yaml
from flowalign.credit.step_credit import intermediate_rewards
from flowalign.credit.step_rewards import calibrate_noise, dense_increments
from flowalign.kernels.sde_kinds import sde_kind
from flowalign.rollout import SHAPES
from flowalign.samplers import PerStepNoise
from flowalign.training.config import TrainConfig

__all__ = ["calibrate", "write_calibrated_config"]

logger = logging.getLogger(__name__)


def calibrate(config: TrainConfig, *, rounds: int, eps1: float = 2.0, eps2: float = 0.01) -> tuple[list[float], list[dict]]:
    """Run ``rounds`` calibration rounds; returns ``(levels, history)`` (one entry per round: levels used, the counts
    of positive and negative ``dR`` per step)."""
    from flowalign.errors import SetupError
    from flowalign.training.scoring import score_iteration
    from flowalign.training.trainer import Trainer

    if rounds < 1:
        raise SetupError(f"rounds must be >= 1, got {rounds}")
    if not _independent_trajectories(config.rollout.name):
        growing = ", ".join(repr(n) for n in SHAPES.names() if _independent_trajectories(n))
        raise SetupError(f"calibration samples independent trajectories: rollout.name must be a shape that grows "
                         f"them ({growing}), got {config.rollout.name!r}")
    # Calibration samples with the trainer's parts but is no training run: it writes nothing into train.out_dir, so
    # the trainer gets an empty scratch directory (its run-directory checks then never refuse it), the same one on
    # every process (they check that they run one config).
    with _scratch_directory() as scratch:
        run = dataclasses.replace(config.train, out_dir=scratch, resume=None, tracker="none", overwrite=False)
        trainer = Trainer(dataclasses.replace(config, train=run))
    num_steps = config.sampling.num_steps
    levels = torch.tensor(config.sampling.base_levels(), dtype=torch.float64)
    stochastic = [t for t in range(num_steps) if levels[t] > 0]
    high = sde_kind(config.sampling.kind).max_noise_level  # the SDE kind's bound on its noise level, if any
    history = []
    trainer.model.transformer.eval()
    for r in range(rounds):
        prompts = trainer.prompts.prompts_for(r)
        batches = trainer.rollout(r, prompts, schedule=PerStepNoise(tuple(float(x) for x in levels)))
        scores = score_iteration(trainer, batches)
        context = trainer.credit_context(r, stochastic)
        increments = [dense_increments(intermediate_rewards(batch, set(range(num_steps + 1)), share, context)[0])
                      for batch, share in zip(batches, scores.slices(batches))]
        # every process's trajectories, in sample order: the same dR, so the same levels, on every process
        dr = trainer.accelerator.gather(torch.cat(increments).to(trainer.accelerator.device)).cpu()
        history.append({
            "round": r,
            "levels": [round(float(x), 4) for x in levels],
            "positive": [int((dr[:, t] > 0).sum()) for t in range(num_steps)],
            "negative": [int((dr[:, t] < 0).sum()) for t in range(num_steps)],
        })
        levels = calibrate_noise(levels, dr, eps1=eps1, eps2=eps2, steps=stochastic, high=high)
        logger.info("round %d: dR>0 %s, dR<0 %s -> levels %s", r, history[-1]["positive"], history[-1]["negative"],
                    [round(float(x), 3) for x in levels])
    return [round(float(x), 6) for x in levels], history


def _independent_trajectories(shape: str) -> bool:
    """Whether the rollout shape ``shape`` declares that it grows independent trajectories (``RolloutShape``)."""
    return bool(getattr(SHAPES.get(shape), "independent_trajectories", False))


@contextlib.contextmanager
def _scratch_directory():
    """A temporary directory the main process makes and names to every process; removed on exit."""
    from accelerate.utils import broadcast_object_list

    from flowalign.training.collectives import process_state

    state = process_state()
    name = [tempfile.mkdtemp(prefix="flowalign-calibrate-") if state.is_main_process else None]
    if state.num_processes > 1:
        broadcast_object_list(name)
    try:
        yield name[0]
    finally:
        state.wait_for_everyone()
        if state.is_main_process:
            shutil.rmtree(name[0], ignore_errors=True)


def write_calibrated_config(out: str | os.PathLike, levels: list[float], history: list[dict], *,
                            base: str | None, overrides: list[str], eps1: float, eps2: float) -> Path:
    """Write the calibrated config (see the module docstring); the file is written whole or not at all."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    body: dict = {}
    if base is not None:
        body["base"] = os.path.relpath(Path(base).resolve(), out.parent.resolve())
    for item in overrides:
        key, _, value = item.partition("=")
        node = body
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = parse_yaml(value, f"override {key}", lines=False)
    body.setdefault("sampling", {})["noise_table"] = levels
    lines = [f"# flowalign calibrate: DenseGRPO noise calibration, {len(history)} rounds, eps1={eps1}, eps2={eps2}"]
    for entry in history:
        lines.append(f"# round {entry['round']}: levels {entry['levels']} dR>0 {entry['positive']} "
                     f"dR<0 {entry['negative']}")
    text = "\n".join(lines) + "\n" + yaml.safe_dump(body, sort_keys=False)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    return out
