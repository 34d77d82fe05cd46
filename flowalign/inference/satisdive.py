"""SatisDive as a guided sampler (``--guidance satisdive``): K candidates per prompt, each pushed above a
batch-relative reward floor ``max_k r_k - Delta`` while the accepted set keeps the generator's feature diversity.

The numerics are ``flowalign.samplers.satisdive`` (the formulas, the NFE count and the two departures from the
reference code); this module builds what they take from the model: the differentiable guide reward
(``--rgs-reward``, as RGS), and ``velocity_features(x, sigma, rows) -> (v, phi)``, the velocity and the feature of a
transformer block from the same forward (``block_features``). The method page is docs/methods/satisdive.md.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from flowalign.config import ConfigError
from flowalign.samplers.satisdive import (
    STEP_SCALES,
    VELOCITY_MODES,
    clone_steps,
    default_scoring_steps,
    satisdive_nfe,
)
from flowalign.settings import check, finite, option

from .base import GradientSource, GuidedProblem, GuidedSampler, register_sampler

__all__ = ["SatisDive", "SatisDiveSettings", "block_features", "feature_blocks", "pooled_block_feature"]

_DIFFERENTIABLE = "toy_geneval_soft, pickscore, hps, clipscore, aesthetic, imagereward"


# ------------------------------------------------------------------------------------------------ features


def feature_blocks(transformer: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer's ``transformer_blocks`` (SD3, FLUX's joint blocks, SANA, Qwen-Image, ...), else its
    ``blocks`` (Wan's video DiT: one token stream over every latent frame); ValueError naming ``--feature-block`` for
    a transformer without either."""
    blocks = getattr(transformer, "transformer_blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        blocks = getattr(transformer, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"SatisDive reads its diversity feature from a block of the transformer's "
                         f"transformer_blocks (or blocks), and {type(transformer).__name__} has none: this model "
                         "cannot give SatisDive's feature (--feature-block)")
    return blocks


def pooled_block_feature(output: Any) -> Tensor:
    """A block output's image tokens mean-pooled to ``[rows, d]`` (fp32, with the graph): diffusers' joint blocks
    return ``(encoder_hidden_states, hidden_states)``, so a tuple's second element; a plain tensor ``[rows, tokens,
    d]`` otherwise (a 4-D ``[rows, d, h, w]`` map is pooled over ``h w``)."""
    hidden = output[1] if isinstance(output, (tuple, list)) else output
    if not isinstance(hidden, Tensor) or hidden.ndim < 2:
        raise ValueError(f"cannot read image tokens from a block output of type {type(output).__name__}")
    hidden = hidden.float()
    if hidden.ndim == 3:
        return hidden.mean(dim=1)
    if hidden.ndim == 4:
        return hidden.flatten(2).mean(dim=2)
    return hidden


@contextlib.contextmanager
def block_features(velocity, transformer: torch.nn.Module, block: int | None = None) -> Iterator[Any]:
    """``velocity_features(x, sigma, rows) -> (v, phi [n, d])`` for as long as the context lasts: ``velocity``'s
    own forward, with a forward hook on ``transformer.transformer_blocks[block]`` (default: the middle one,
    ``len // 2``) reading the block's image tokens, mean-pooled (``pooled_block_feature``) and L2-normalised.

    No extra pass: the feature comes from the velocity's forward, and keeps its graph when called under grad (pass B
    differentiates it). With classifier-free guidance the block runs on the conditional and the unconditional rows
    (one batch of ``2 n`` or two calls of ``n``); their pooled features are averaged before the normalisation.
    ``evals_per_sample`` is the velocity's."""
    blocks = feature_blocks(transformer)
    index = len(blocks) // 2 if block is None else int(block)
    if not 0 <= index < len(blocks):
        raise ValueError(f"--feature-block {block} is out of range: the transformer has {len(blocks)} blocks "
                         f"(0..{len(blocks) - 1})")
    captured: list[Tensor] = []
    armed = [False]

    def hook(module, args, output):
        if armed[0]:
            captured.append(pooled_block_feature(output))

    handle = blocks[index].register_forward_hook(hook)

    def velocity_features(x: Tensor, sigma: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        captured.clear()
        armed[0] = True
        try:
            v = velocity(x, sigma, rows)
        finally:
            armed[0] = False
        n = x.shape[0]
        pooled = torch.cat(captured) if captured else None
        captured.clear()
        if pooled is None or pooled.shape[0] % n:
            raise RuntimeError(f"the feature block saw {0 if pooled is None else pooled.shape[0]} rows for a batch of "
                               f"{n}")
        phi = pooled.reshape(pooled.shape[0] // n, n, -1).mean(dim=0)
        return v, F.normalize(phi, dim=-1)

    velocity_features.evals_per_sample = getattr(velocity, "evals_per_sample", 1)
    velocity_features.block = index
    try:
        yield velocity_features
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------ the sampler


@dataclass
class SatisDiveSettings(GradientSource):
    """SatisDive's settings (docs/methods/satisdive.md); the steering reward's (``reward``, ``reward_kwargs``,
    ``gradient``) are RGS's options."""

    delta: float = option(0.25, "SatisDive's floor Delta in --rgs-reward's units: each candidate is pushed above "
                          "max_k r_k - Delta (0.25 for toy_geneval_soft; the reference: 1.5 HPSv3, 0.5 ImageReward)")
    scoring_steps: list[int] | None = option(None, "the steps at which SatisDive scores, updates and may clone its "
                                             "candidates (default: round(j T / 7) for j = 1..6)", metavar="STEP")
    clone_from: float = option(0.5, "SatisDive clones hopeless candidates at scoring steps with i / (T - 1) >= this "
                               "(above 1: never)")
    sde_a: float = option(0.3, "SatisDive's SDE noise: eta(s) = a sqrt(s (1 - s))")
    lam_r: float = option(1.0, "SatisDive's weight of the reward-floor direction")
    lam_d: float = option(1.0, "SatisDive's weight of the diversity direction")
    delta_scale: float = option(1.0, "SatisDive's diversity cutoff: this times the lower median feature distance at "
                                "the first scoring step")
    step: float | None = option(None, "SatisDive's update size (default: 0.03 with --step-scale relative, 1.0 with "
                                "absolute)", flag="step-size")
    step_scale: Literal[STEP_SCALES] = option("relative", "SatisDive's --step-size in units of the mean latent norm "
                                              "at the first scoring step (relative) or in latent units (absolute, "
                                              "the reference)")
    feature_block: int | None = option(None, "the transformer block whose image tokens are SatisDive's diversity "
                                       "feature (default: the middle of transformer_blocks)")
    grad_chunk: int | None = option(None, "candidates per SatisDive pass-B forward and backward (default: all of the "
                                    "batch at once; 1 holds one candidate's graph at a time, as the reference)")
    velocity: Literal[VELOCITY_MODES] = option("recompute", "SatisDive's SDE step after an update or a clone: with "
                                               "the velocity at the new latents (recompute, one forward per "
                                               "candidate at scoring steps before --clone-from) or pass A's "
                                               "(stale, the reference)", flag="satisdive-velocity")

    def validate(self) -> None:
        if self.reward is None:
            raise ConfigError("guidance 'satisdive' steers with the gradient of a differentiable reward: pass "
                              f"--rgs-reward NAME ({_DIFFERENTIABLE})", key="reward")
        GradientSource.validate(self)
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not math.isfinite(self.delta):
            raise ConfigError(f"delta (--delta, SatisDive's floor Delta in --rgs-reward's units) must be a finite "
                              f"number >= 0, got {self.delta!r}", key="delta")
        finite("delta", self.delta, 0, note=" (--delta: the floor sits Delta below the best candidate's reward)")
        finite("clone_from", self.clone_from, 0, high=math.inf)
        finite("sde_a", self.sde_a, 0)
        finite("lam_r", self.lam_r, 0)
        finite("lam_d", self.lam_d, 0)
        finite("delta_scale", self.delta_scale, 0, strict=True)
        if self.step is not None:
            finite("step", self.step, 0, strict=True, note=" (--step-size)")
        if self.feature_block is not None:
            check(isinstance(self.feature_block, int) and self.feature_block >= 0, "feature_block",
                  f"must be a block index >= 0, got {self.feature_block!r}")
        if self.grad_chunk is not None:
            check(isinstance(self.grad_chunk, int) and not isinstance(self.grad_chunk, bool) and self.grad_chunk >= 1,
                  "grad_chunk", f"must be a number of candidates >= 1, got {self.grad_chunk!r}")
        if self.scoring_steps is not None:
            steps = list(self.scoring_steps)
            check(bool(steps) and all(isinstance(i, int) and i >= 0 for i in steps) and len(set(steps)) == len(steps),
                  "scoring_steps", f"must be distinct step indices >= 0 (--scoring-steps), got {self.scoring_steps!r}")

    def steps_for(self, num_steps: int) -> list[int]:
        """The scoring steps of a ``num_steps``-step run."""
        return sorted(self.scoring_steps) if self.scoring_steps is not None else default_scoring_steps(num_steps)


@register_sampler("satisdive", config=SatisDiveSettings)
class SatisDive(GuidedSampler):
    """SatisDive (Zhai et al.): a reward floor with set diversity for ``--candidates K`` (>= 2) per prompt.

    The budget is an upper bound the run must fit: it spends exactly ``satisdive_nfe`` per prompt (reported in
    ``nfe``) and is refused, naming ``--budget`` and the NFEs it needs, when the budget is smaller."""

    def requirements(self) -> frozenset[str]:
        return frozenset({"reward", "differentiable_reward"})

    def differentiable_reward(self):
        return self.config.differentiable_reward()

    def needed_nfe(self, config, evals_per_sample: int = 1) -> int:
        """NFEs per prompt at ``config``'s steps and candidates (``evals_per_sample`` 2 with CFG)."""
        settings = self.config
        return satisdive_nfe(config.steps, settings.steps_for(config.steps), int(getattr(config, "candidates", 1)),
                             clone_from=settings.clone_from, velocity=settings.velocity, gradient=settings.gradient,
                             evals_per_sample=evals_per_sample)

    def check(self, config) -> None:
        k = getattr(config, "candidates", 1)
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise ConfigError(f"guidance 'satisdive' steers a set of candidates per prompt (its floor and its diversity "
                              f"are relative to the set): pass --candidates K with K >= 2 (the reference: 4), got "
                              f"{k!r}", key="candidates")
        steps = self.config.steps_for(config.steps)
        if steps[-1] > config.steps - 1:
            raise ConfigError(f"sampler.scoring_steps must lie in 0..{config.steps - 1} (--scoring-steps: steps of the "
                              f"{config.steps}-step run), got {steps}", key="sampler.scoring_steps")
        # one NFE per pass here: CFG's second pass (not FLUX.1-dev's guidance embedding) is counted once the model
        # is loaded, where satisdive_sampling refuses the budget again with the exact count
        need = self.needed_nfe(config)
        if config.budget < need:
            clones = len(clone_steps(steps, config.steps, self.config.clone_from))
            raise ConfigError(f"budget={config.budget} NFEs per prompt cannot pay for SatisDive's {k} candidates: "
                              f"{config.steps} steps with {len(steps)} scoring steps ({clones} of them clone steps) "
                              f"cost {need} NFEs per prompt; raise --budget to at least {need}", key="budget")

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.satisdive import satisdive_sampling

        settings = self.config
        if problem.guide_reward is None:
            raise ValueError("guidance 'satisdive' needs a differentiable reward: pass guide_reward= (--rgs-reward)")
        guide = problem.latent_reward(problem.guide_reward, differentiable=True)
        with block_features(problem.velocity, problem.model.transformer, settings.feature_block) as features:
            result = satisdive_sampling(
                features, guide, problem.sigmas, problem.shape, problem.generators, problem.candidates,
                margin=settings.delta, final_reward=problem.reward, budget=problem.budget,
                scoring_steps=settings.steps_for(problem.config.steps), clone_from=settings.clone_from,
                sde_a=settings.sde_a, lam_r=settings.lam_r, lam_d=settings.lam_d, delta_scale=settings.delta_scale,
                step=settings.step, step_scale=settings.step_scale, velocity=settings.velocity,
                gradient=settings.gradient, grad_chunk=settings.grad_chunk, device=problem.device)
            result.info["feature_block"] = features.block
        return result
