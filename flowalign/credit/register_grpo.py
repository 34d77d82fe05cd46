"""Step rewards from latent reward registers (Register-GRPO): transition t gets ``dR_t = S(x_{t+1}) - S(x_t)``, the
change of the register score (heads summed), normalised per step within its group.

``register_pass = reference``: one forward of the reference model (LoRA off: the transformer the registers were trained
on) per state, ``T + 1`` NFEs per sample. ``policy``: the registers are read off the rollout's own policy passes by a
rollout hook (``RegisterReader``; its hooks only read, so the velocity is unchanged), and only the final state costs a
forward, 1 NFE per sample (the LoRA shifts the features the heads read; identical to ``reference`` while it is zero).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.credit.base import BatchScores, Credit, CreditContext, CreditEstimator, register_credit
from flowalign.credit.step_credit import normalized_step_credit
from flowalign.credit.step_rewards import dense_increments
from flowalign.errors import SetupError
from flowalign.rollout import RolloutHook
from flowalign.settings import option

__all__ = ["RegisterCredit", "RegisterCreditConfig", "RegisterReader", "check_register_file", "load_for"]


@dataclass
class RegisterCreditConfig(ComponentConfig):
    registers: str = option(
        "outputs/registers/registers.pt",
        "the register checkpoint (`flowalign prep registers`) trained on this model; checked at start-up")
    register_pass: Literal["reference", "policy"] = option(
        "reference",
        "reference = one extra forward of the reference model (LoRA off, the transformer the registers were trained "
        "on) per state, T + 1 NFEs per sample; policy = read the registers off the rollout's own policy passes and "
        "spend one forward on the final state only, 1 NFE per sample (the LoRA shifts the features the heads read; "
        "identical to reference while the LoRA is zero)")


def check_register_file(path: str, key: str) -> None:
    """A start-up error naming ``key`` when the register checkpoint ``path`` does not exist."""
    if not Path(path).is_file():
        raise SetupError(f"{key} = {path!r} does not exist: train registers for this model with `flowalign prep "
                         f"registers --model PATH --out {path}` or point {key} at a register checkpoint")


def load_for(path: str, model):
    """The register heads of ``path`` (checked against ``model``'s transformer), on the model's device."""
    from flowalign.reward_models.latent_registers import load_registers

    registers = load_registers(path, dict(model.transformer.config))
    registers.to(model.device)
    return registers


class RegisterReader(RolloutHook):
    """Collects the register score (heads summed, ``[B]``) of every pass of a chain rollout, in call order."""

    name = "register_scores"

    def __init__(self, registers, transformer):
        self.registers, self.transformer = registers, transformer

    @contextmanager
    def watch(self, velocity):
        scores: list[Tensor] = []

        def reading(x: Tensor, sigma: Tensor) -> Tensor:
            v, read = self.registers.read(velocity, x, sigma)
            scores.append(read.sum(dim=1).double().cpu())
            return v

        reading.evals_per_sample = velocity.evals_per_sample
        self.registers.attach(self.transformer)
        try:
            yield reading, lambda: torch.stack(scores, dim=1)
        finally:
            self.registers.detach()


@register_credit("registers", config=RegisterCreditConfig)
class RegisterCredit(CreditEstimator):
    """the change of the latent-register score across each transition, per step within its group."""

    shapes = ("group",)
    whole_prompts = True

    def __init__(self, config=None):
        super().__init__(config)
        self.registers = None

    def start_up(self) -> None:
        check_register_file(self.config.registers, "credit.registers")

    def set_up(self, parts) -> None:
        self.model = parts.model
        self.registers = load_for(self.config.registers, parts.model)

    def rollout_hooks(self) -> list:
        if self.config.register_pass != "policy":
            return []
        return [RegisterReader(self.registers, self.model.transformer)]

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        rewards, nfe = self.register_rewards(batch, context)
        return normalized_step_credit(batch, context, dense_increments(rewards), nfe)

    @torch.no_grad()
    def register_rewards(self, batch, context: CreditContext) -> tuple[Tensor, int]:
        """``R [B, T + 1]``: the register score of every state of a chain batch, and the NFEs spent."""
        config, model, registers = context.config, context.model, self.registers
        t = batch.rollout.transitions
        size, num_steps = len(batch.sample_ids), config.sampling.num_steps
        sigmas = model.sigmas(num_steps, config.sampling.image_size)
        velocity, rows = context.per_row_velocity(batch.cond), torch.arange(size)
        rewards = torch.empty(size, num_steps + 1, dtype=torch.float64)
        positions = range(num_steps + 1)
        reference = model.reference() if model.has_reference else nullcontext()
        read = batch.extras.get(RegisterReader.name)
        if read is not None:
            rewards[:, :num_steps] = read
            positions, reference = [num_steps], nullcontext()
        with reference, context.autocast():
            registers.attach(model.active_transformer)  # the reference's own module under a full fine-tune
            try:
                for k in positions:
                    states = t.states[k * size: (k + 1) * size]  # node id = step * batch + row
                    _, scores = registers.read(velocity, states, sigmas[k].expand(size), rows)
                    rewards[:, k] = scores.sum(dim=1).double().cpu()
            finally:
                registers.detach()
        return rewards, len(positions) * size * velocity.evals_per_sample
