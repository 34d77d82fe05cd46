"""GRPO fine-tuning of a flow-matching text-to-image model: the loop behind ``flowalign train``.

One iteration is one straight pass through DESIGN.md §3's data flow:

    prompts -> encode -> rollout (SDE on the stochastic steps) -> transitions
            -> decode -> rewards (gathered across processes) -> group advantages -> step weights
            -> PPO-clipped loss on recomputed log-probs (+ KL to the LoRA-disabled reference) -> optimizer

Every method (Flow-GRPO, Flow-GRPO-Fast, DanceGRPO, MixGRPO, ...) is a config of this one loop (configs/methods/).

Layout and determinism. The ``P * K`` samples of an iteration are numbered prompt-major (sample ``j`` belongs to
prompt ``j // K``) and each process takes a contiguous slice, so a group may span processes: rewards are gathered
before normalising. Every random draw is keyed by what it is for (``flowalign.seeding``): prompt choice and SDE windows
by the iteration, noise by the sample number. A 2-process run therefore equals a 1-process run at the same global
batch, and a resumed run equals an uninterrupted one.

Training forward passes run on *micro-batches* of one rollout chunk at one step, the rollout's own batch composition,
so the first recomputed log-prob ratio of an iteration is exactly 1. Log-probs are always fp32.
"""

from __future__ import annotations


import json
import logging
import math
import signal
import time
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowalign.credit.group import group_advantages, group_normalize
from flowalign.credit.tree import Tree, depth_prune_mask, leaf_mean, sliding_prune_steps, tree_advantages, width_prune_mask
from flowalign.training.checkpoint import load_checkpoint, save_checkpoint, save_process_rng
from flowalign.config import to_dict
from flowalign.training.ema import EMA
from flowalign.errors import SetupError, setup_phase
from flowalign.evaluation.geneval import load_metadata
from flowalign.kernels import use_backend
from flowalign.losses.grpo import noise_aware_weights, transition_grpo_loss
from flowalign.lr_schedule import learning_rate_scale
from flowalign.models import FlowModel, load_flow_model
from flowalign.models.base import Cond
from flowalign.rewards import build_differentiable_reward, build_reward, combine_rewards, differentiable_score, score_all
from flowalign.training.run_directory import check_new_run, clear_run, resolve_resume, trim_metrics
from flowalign.samplers import (
    Rollout,
    TreeSchedule,
    noise_schedule,
    probe_rollout,
    rollout,
    tree_rollout,
)
from flowalign.seeding import generator, numpy_rng
from flowalign.training.config import TrainConfig

logger = logging.getLogger(__name__)

# Purposes of random draws (the last element of a seed key).
_PROMPTS, _WINDOW, _INIT_NOISE, _SDE_NOISE, _STEP_SUBSET, _SHUFFLE = range(6)


@dataclass
class Chunk:
    """One rollout chunk of a process: its rollout, its samples' global ids and its conditioning rows.

    ``cond`` has one row per ``transitions.prompt_id``: per sample for groups, per tree for trees. ``advantages`` and
    ``weights`` (one per transition) are filled in by the credit assignment.
    """

    rollout: Rollout
    sample_ids: Tensor  # global sample numbers j of the final images
    cond: Cond
    advantages: Tensor | None = None
    weights: Tensor | None = None
    register_scores: Tensor | None = None  # [B, T] register scores read off the rollout's passes (register_pass policy)
    prompt_index: Tensor | None = None  # the iteration prompt of each ``cond`` row
    metadata: list[dict] | None = None  # that prompt's entry, per ``cond`` row (filled in by ``collect``)


@dataclass
class Scores:
    """The rewards of an iteration: gathered, combined and normalised into per-sample group advantages."""

    advantages: Tensor  # local samples, group-normalised
    combined: Tensor  # local samples, the combined reward before normalisation
    valid: Tensor  # local samples
    stats: dict[str, float]
    images: Tensor  # local decoded images
    display: Tensor  # local weighted reward sums for the sample grids


class GRPOTrainer:
    def __init__(self, config: TrainConfig, *, accelerator=None):
        with setup_phase():  # every mistake of the user's surfaces here, as a SetupError, before any update
            self._set_up(config, accelerator)

    def _set_up(self, config: TrainConfig, accelerator) -> None:
        from accelerate import Accelerator

        self.config = config
        precision = config.model.mixed_precision
        self.accelerator = accelerator or Accelerator(
            mixed_precision=precision, log_with=None if config.train.tracker == "none" else config.train.tracker,
            project_dir=config.train.out_dir,
        )
        check_distributed_type(self.accelerator)
        self.layout = config.check_batch(self.accelerator.num_processes)
        self.out_dir = Path(config.train.out_dir)
        self.checkpoint = self._check_run_directory()  # the checkpoint to resume, or None; before any model loads
        self.schedule = noise_schedule(config.noise_schedule_spec())
        self.prompts = load_metadata(config.data.train_prompts)
        self.prompt_weights = prompt_weights(self.prompts, config.data.prompt_sampling)
        self.rewards = [(spec.name, spec.weight, build_reward(spec.name, **spec.kwargs)) for spec in config.reward.rewards]
        self.opd_reward = self.build_opd_reward() if config.loss.rg_opd_reward is not None else None
        torch.manual_seed(config.train.seed)  # the LoRA initialisation, identical on every process and layout
        self.model = self._load_model()
        if self.accelerator.num_processes > 1:  # wrap before building the optimizer, as FSDP needs
            self.model.forward_module = self.accelerator.prepare(self.model.transformer)
        self.params = [p for p in (self.model.forward_module or self.model.transformer).parameters() if p.requires_grad]
        self.optimizer = self.accelerator.prepare(torch.optim.AdamW(
            self.params, lr=config.optim.lr, betas=tuple(config.optim.betas), eps=config.optim.eps,
            weight_decay=config.optim.weight_decay,
        ))
        self.ema = EMA(self.trainable_state(), config.optim.ema_decay) if config.optim.ema_decay > 0 else None
        self.iteration = 0
        self.history: list[dict[str, float]] = []
        self.stop_requested = False
        if self.checkpoint is not None:  # loading it is set-up too: a file that does not fit is the user's to fix
            self.resume(self.checkpoint)

    # ------------------------------------------------------------------------------------------------- setup
    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def computes_kl(self) -> bool:
        """Whether the loss evaluates the reference velocity for a KL (a penalty, or the velocity MSE logged)."""
        return self.config.loss.beta > 0 or self.config.loss.kl == "velocity_mse"

    def _load_model(self) -> FlowModel:
        cfg = self.config.model
        model = load_flow_model(
            cfg.path, family=cfg.family, dtype=cfg.dtype, device=self.accelerator.device,
            max_sequence_length=cfg.max_sequence_length,
        )
        if cfg.attention == "xformers":
            enable_xformers(model)
        if cfg.gradient_checkpointing:
            model.transformer.enable_gradient_checkpointing()
        model.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_targets)
        model.freeze_base()
        for param in model.transformer.parameters():
            if param.requires_grad:  # LoRA weights train in fp32 whatever the base dtype
                param.data = param.data.float()
        return model

    def trainable_state(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.model.transformer.named_parameters() if p.requires_grad}

    # ----------------------------------------------------------------------------------------------- rollout
    def prompts_for(self, iteration: int) -> list[dict]:
        """The iteration's prompts, the same on every process."""
        count = self.config.data.prompts_per_iteration
        rng = numpy_rng(self.config.train.seed, iteration, _PROMPTS)
        index = rng.choice(len(self.prompts), size=count, replace=count > len(self.prompts), p=self.prompt_weights)
        return [self.prompts[i] for i in index]

    def local_sample_ids(self) -> Tensor:
        n = self.layout.samples_per_process
        start = self.accelerator.process_index * n
        return torch.arange(start, start + n)

    @torch.no_grad()
    def collect(self, iteration: int, prompts: list[dict]) -> list[Chunk]:
        cfg, seed = self.config, self.config.train.seed
        progress = min(1.0, iteration / max(1, cfg.train.iterations - 1))
        levels = self.schedule.levels(cfg.sampling.num_steps, progress=progress, generator=generator(seed, iteration, _WINDOW))
        sigmas = self.model.sigmas(cfg.sampling.num_steps, cfg.sampling.image_size)
        # Every process encodes all the iteration's prompts: the text encoders then see the same batch whatever the
        # process layout, and their outputs are bitwise the same.
        texts = [entry["prompt"] for entry in prompts]
        negatives = [""] * len(texts) if self.model.uses_cfg(cfg.sampling.guidance_scale) else None
        cond = self.model.encode(texts, negative_prompts=negatives)
        grow = {"group": self._sample_chains, "tree": self._grow_trees, "probe": self._probe_trunks}[cfg.rollout.shape]
        with self.accelerator.autocast(), use_backend(cfg.model.kernels):
            chunks = [grow(iteration, ids, cond, sigmas, levels)
                      for ids in self.local_sample_ids().split(self.layout.rollout_batch_size)]
        for chunk in chunks:
            chunk.metadata = [prompts[i] for i in chunk.prompt_index.tolist()]
        return chunks

    def _sample_chains(self, iteration: int, ids: Tensor, cond: Cond, sigmas: Tensor, levels: Tensor) -> Chunk:
        """``len(ids)`` independent trajectories (Flow-GRPO, DanceGRPO, MixGRPO, ...)."""
        cfg, seed, group_size = self.config, self.config.train.seed, self.config.data.group_size
        rows = [int(j) // group_size for j in ids]
        noise_keys = [int(j) // group_size if cfg.sampling.shared_noise else int(j) for j in ids]
        x_init = self.model.prepare_noise(
            len(ids), cfg.sampling.image_size, generator=[generator(seed, iteration, k, _INIT_NOISE) for k in noise_keys]
        )
        chunk_cond = cond.index(rows)
        with self.policy_register_read(self.model.velocity_fn(chunk_cond, cfg.sampling.guidance_scale)) as (velocity,
                                                                                                          scores):
            result = rollout(
                velocity, x_init, sigmas, levels, kind=cfg.sampling.kind, reduce=cfg.sampling.log_prob_reduce,
                generator=[generator(seed, iteration, int(j), _SDE_NOISE) for j in ids],
                group_ids=ids // group_size, prompt_ids=torch.arange(len(ids)),
            )
        return Chunk(result, ids, chunk_cond, register_scores=None if scores is None else torch.stack(scores, dim=1),
                     prompt_index=torch.tensor(rows))

    @contextmanager
    def policy_register_read(self, velocity):
        """The rollout's velocity, and with ``step_reward.register_pass = policy`` a list that collects the register
        score (heads summed, ``[B]``) of every pass in call order: one per step of a chain rollout, read off the
        policy's own forward (the registers' hooks only read, so the velocity is unchanged). Otherwise ``None``."""
        cfg = self.config.step_reward
        if cfg.estimator != "registers" or cfg.register_pass != "policy":
            yield velocity, None
            return
        registers, scores = self.step_registers(), []

        def reading(x: Tensor, sigma: Tensor) -> Tensor:
            v, read = registers.read(velocity, x, sigma)
            scores.append(read.sum(dim=1).double().cpu())
            return v

        reading.evals_per_sample = velocity.evals_per_sample
        registers.attach(self.model.transformer)
        try:
            yield reading, scores
        finally:
            registers.detach()

    def step_registers(self):
        """The latent registers of ``step_reward.registers``, loaded once (checked against this transformer)."""
        from flowalign.reward_models.registers import load_registers

        if getattr(self, "registers", None) is None:
            self.registers = load_registers(self.config.step_reward.registers, dict(self.model.transformer.config))
            self.registers.to(self.model.device)
        return self.registers

    def _grow_trees(self, iteration: int, ids: Tensor, cond: Cond, sigmas: Tensor, levels: Tensor) -> Chunk:
        """One BranchGRPO tree per prompt of the chunk; its leaves are the prompt's ``group_size`` samples."""
        cfg, seed = self.config, self.config.train.seed
        groups = torch.unique_consecutive(ids // cfg.data.group_size)
        roots = self.model.prepare_noise(
            len(groups), cfg.sampling.image_size, generator=[generator(seed, iteration, int(g), _INIT_NOISE) for g in groups]
        )
        chunk_cond = cond.index(groups)
        result = tree_rollout(
            self._per_row_velocity(chunk_cond), roots, sigmas, levels, self.tree_schedule(), kind=cfg.sampling.kind,
            reduce=cfg.sampling.log_prob_reduce, generator=[generator(seed, iteration, int(g), _SDE_NOISE) for g in groups],
            group_ids=groups, prompt_ids=torch.arange(len(groups)),
        )
        return Chunk(result, ids, chunk_cond, prompt_index=groups)

    def _probe_trunks(self, iteration: int, ids: Tensor, cond: Cond, sigmas: Tensor, levels: Tensor) -> Chunk:
        """One ODE trunk per prompt of the chunk, probed at ``rollout.probe_steps`` with ``group_size`` children."""
        cfg, seed = self.config, self.config.train.seed
        owners = torch.unique_consecutive(ids // self.config.samples_per_prompt())
        x_init = self.model.prepare_noise(
            len(owners), cfg.sampling.image_size, generator=[generator(seed, iteration, int(p), _INIT_NOISE) for p in owners]
        )
        chunk_cond = cond.index(owners)
        result = probe_rollout(
            self._per_row_velocity(chunk_cond), x_init, sigmas, levels, cfg.rollout.probe_steps, cfg.data.group_size,
            kind=cfg.sampling.kind, reduce=cfg.sampling.log_prob_reduce,
            generator=[generator(seed, iteration, int(p), _SDE_NOISE) for p in owners], prompt_ids=owners,
        )
        return Chunk(result, ids, chunk_cond, prompt_index=owners)

    def _per_row_velocity(self, cond: Cond):
        """``velocity(x, sigma, row)``: each state with the conditioning row ``row`` of ``cond`` (trees, probes)."""
        scale = self.config.sampling.guidance_scale

        def velocity(x: Tensor, sigma: Tensor, row: Tensor) -> Tensor:
            return self.model.velocity(x, sigma, cond.index(row), scale)

        velocity.evals_per_sample = 2 if self.model.uses_cfg(scale) else 1
        return velocity

    def tree_schedule(self) -> TreeSchedule:
        cfg = self.config.rollout
        return TreeSchedule(tuple(cfg.split_steps), tuple(cfg.factors()), cfg.split_noise_scale)

    def trained_steps(self, iteration: int, chunks: list[Chunk]) -> list[int]:
        """The stochastic steps, or DanceGRPO's random subset of them (the same subset for every sample)."""
        t = chunks[0].rollout.transitions
        stochastic = sorted({int(s) for s in t.step[t.stochastic]})
        subset = self.config.sampling.train_steps_per_rollout
        if subset is None or subset >= len(stochastic):
            return stochastic
        rng = numpy_rng(self.config.train.seed, iteration, _STEP_SUBSET)
        return sorted(int(s) for s in rng.choice(stochastic, size=subset, replace=False))

    # ------------------------------------------------------------------------------------------------ reward
    @torch.no_grad()
    def score(self, prompts: list[dict], chunks: list[Chunk]) -> Scores:
        """Decode, score, gather across processes, combine and group-normalise."""
        cfg = self.config
        images = torch.cat([self.model.decode(c.rollout.final).float() for c in chunks])
        ids = torch.cat([c.sample_ids for c in chunks])
        metadata = [prompts[int(j) // cfg.samples_per_prompt()] for j in ids]
        scores = score_all(self.rewards, images, [m["prompt"] for m in metadata], metadata)
        device = self.accelerator.device
        raw = self.accelerator.gather(scores.raw.T.contiguous().to(device)).T.cpu()
        valid = self.accelerator.gather(scores.valid.to(device)).cpu()
        group_ids = torch.arange(self.layout.global_samples) // cfg.data.group_size
        combined = combine_rewards(raw, scores.weights.cpu(), valid, group_ids, mode=cfg.reward.combine,
                                   std=cfg.advantage.std)
        advantages, adv_stats = group_advantages(combined, group_ids, valid, std=cfg.advantage.std,
                                                 clip=cfg.advantage.clip)
        kept = combined[valid]
        stats = {
            "reward": float(kept.mean()) if len(kept) else math.nan,
            "reward_std": float(kept.std(unbiased=False)) if len(kept) else math.nan,
            "reward_invalid": float((~valid).sum()),
            "zero_std_frac": float(adv_stats["zero_std_frac"]),
        }
        for name, row in zip(scores.names, raw):
            stats[f"rewards/{name}/mean"] = float(row[valid].mean()) if valid.any() else math.nan
        self.last_advantages = advantages
        display = (scores.weights[:, None] * scores.raw).sum(0).cpu()
        return Scores(advantages[ids], combined[ids], valid[ids], stats, images.cpu(), display)

    # ------------------------------------------------------------------------------------------------ credit
    def assign_credit(self, iteration: int, prompts: list[dict], chunks: list[Chunk], scores: Scores) -> int:
        """Give every transition its advantage and weight (DESIGN.md §3: the loss only sees transitions).

        Groups: a trajectory's transitions share its group advantage, or (``step_reward.estimator``) each trained
        transition gets its own step reward from the rewards of intermediate states, normalised per step within its
        group. Trees: an edge gets the depth-wise advantage of the node it leads to
        (``flowalign.credit.tree.tree_advantages``), and pruning zeroes the weights of some edges. Returns the NFEs spent
        on intermediate completions.

        Scores and credit are computed on the CPU; the per-transition advantages and weights live with the
        transitions (on the latents' device), where the loss reads them.
        """
        steps = self.trained_steps(iteration, chunks)
        offset, nfe = 0, 0
        for chunk in chunks:
            t = chunk.rollout.transitions
            device = t.step.device
            count = len(chunk.sample_ids)
            advantages = scores.advantages[offset: offset + count]
            combined, valid = scores.combined[offset: offset + count], scores.valid[offset: offset + count]
            offset += count
            weights = self.step_weights(chunk, steps)
            if self.config.rollout.shape == "tree":
                node_advantages, keep = self.tree_credit(iteration, chunk, combined, valid)
                chunk.advantages = node_advantages.to(device)[t.dst].float()
                chunk.weights = weights * keep.to(device)[t.dst].float()
            elif self.config.step_reward.estimator != "terminal":
                chunk.advantages, keep, spent = self.step_credit(prompts, chunk, steps, combined, valid)
                chunk.weights = weights * keep.float()
                nfe += spent
            else:
                chunk.advantages = advantages.to(device)[t.sample_id]
                chunk.weights = weights
        return nfe

    @torch.no_grad()
    def intermediate_rewards(self, prompts: list[dict], chunk: Chunk, positions: set[int], combined: Tensor,
                             valid: Tensor) -> tuple[Tensor, int]:
        """``R [B, T + 1]`` (float64, NaN where not computed or invalid) of a chain chunk's states, and the NFEs spent.

        ``R_T`` is the terminal reward already computed; ``R_k`` for the other ``positions`` comes from an
        ``IntermediateScorer``: the clean estimate of ``x_k`` (``step_reward.clean``: an ODE completion or the x0
        projection), decoded and scored with the weighted sum of the rewards.
        """
        from flowalign.reward_models.intermediate import IntermediateScorer

        cfg = self.config
        t = chunk.rollout.transitions
        batch, num_steps = len(chunk.sample_ids), cfg.sampling.num_steps
        metadata = [prompts[int(j) // cfg.samples_per_prompt()] for j in chunk.sample_ids]

        def reward(images: Tensor, rows: Tensor) -> Tensor:
            picked = [metadata[int(r)] for r in rows]
            out = score_all(self.rewards, images.float(), [m["prompt"] for m in picked], picked)
            total = (out.weights[:, None] * out.raw).sum(0).double()
            return torch.where(out.valid, total, torch.full_like(total, math.nan))

        sigmas = self.model.sigmas(num_steps, cfg.sampling.image_size)
        scorer = IntermediateScorer(self._per_row_velocity(chunk.cond), self.model.decode, reward, sigmas,
                                    estimate=cfg.step_reward.clean, ode_steps=cfg.step_reward.ode_steps)
        rewards = torch.full((batch, num_steps + 1), math.nan, dtype=torch.float64)
        rewards[:, num_steps] = torch.where(valid, combined.double(), torch.full_like(combined.double(), math.nan))
        rows = torch.arange(batch)
        with self.accelerator.autocast():
            for k in sorted(set(positions) - {num_steps}):
                states = t.states[k * batch: (k + 1) * batch]  # node id = step * batch + row
                rewards[:, k] = scorer.score(states, [k] * batch, rows, keys=[(k, r) for r in range(batch)])
        return rewards, scorer.nfe

    def step_credit(self, prompts: list[dict], chunk: Chunk, steps: list[int], combined: Tensor,
                    valid: Tensor) -> tuple[Tensor, Tensor, int]:
        """Per-transition advantages from the step rewards of ``flowalign.credit.step_rewards``, normalised per
        (group, step); a mask of the trained transitions with a finite step reward; the NFEs of the completions."""
        from flowalign.credit.step_rewards import dense_increments, return_to_go, turning_point_rewards

        cfg = self.config
        num_steps = cfg.sampling.num_steps
        estimator = cfg.step_reward.estimator
        if estimator == "registers":
            rewards, nfe = self.register_rewards(chunk)
            return self.normalized_step_credit(chunk, steps, dense_increments(rewards), nfe)
        if estimator == "turning_point":
            positions = set(range(num_steps + 1))
        elif estimator == "dense":
            positions = {k for s in steps for k in (s, s + 1)}
        else:
            positions = set(steps)
        rewards, nfe = self.intermediate_rewards(prompts, chunk, positions, combined, valid)
        if estimator == "dense":
            values = dense_increments(rewards)
        elif estimator == "return_to_go":
            values = return_to_go(rewards)
        else:
            values, _ = turning_point_rewards(rewards, balanced=cfg.step_reward.balanced,
                                              pools=chunk.sample_ids // cfg.data.group_size)
        return self.normalized_step_credit(chunk, steps, values, nfe)

    def normalized_step_credit(self, chunk: Chunk, steps: list[int], values: Tensor,
                               nfe: int) -> tuple[Tensor, Tensor, int]:
        """Step rewards ``values [B, T]`` as per-transition advantages normalised per (group, step)."""
        cfg = self.config
        t = chunk.rollout.transitions
        per_transition = values.to(t.step.device)[t.sample_id, t.step]  # chain transitions are (step, row) pairs
        finite = torch.isfinite(per_transition) & torch.isin(t.step, torch.tensor(steps, device=t.step.device))
        groups = t.group_id * cfg.sampling.num_steps + t.step
        advantages, _ = group_normalize(torch.where(finite, per_transition, 0.0).float(), groups, finite)
        return advantages.clamp(-cfg.advantage.clip, cfg.advantage.clip), finite, nfe

    @torch.no_grad()
    def register_rewards(self, chunk: Chunk) -> tuple[Tensor, int]:
        """``R [B, T + 1]``: the latent-register score (heads summed) of every state of a chain chunk, and the NFEs.

        ``register_pass = reference``: one forward per state of the reference model (LoRA off: the transformer the
        registers were trained on). ``policy``: states ``0..T-1`` were read during the rollout (``chunk.
        register_scores``), so only the final state costs a forward, of the policy like the others.
        """
        cfg = self.config
        registers = self.step_registers()
        t = chunk.rollout.transitions
        batch, num_steps = len(chunk.sample_ids), cfg.sampling.num_steps
        sigmas = self.model.sigmas(num_steps, cfg.sampling.image_size)
        velocity, rows = self._per_row_velocity(chunk.cond), torch.arange(batch)
        rewards = torch.empty(batch, num_steps + 1, dtype=torch.float64)
        positions = range(num_steps + 1)
        context = self.model.reference() if self.model.has_lora else nullcontext()
        if chunk.register_scores is not None:
            rewards[:, :num_steps] = chunk.register_scores
            positions, context = [num_steps], nullcontext()
        registers.attach(self.model.transformer)
        try:
            with context, self.accelerator.autocast():
                for k in positions:
                    states = t.states[k * batch: (k + 1) * batch]  # node id = step * batch + row
                    _, scores = registers.read(velocity, states, sigmas[k].expand(batch), rows)
                    rewards[:, k] = scores.sum(dim=1).double().cpu()
        finally:
            registers.detach()
        return rewards, len(positions) * batch * velocity.evals_per_sample

    def tree_credit(self, iteration: int, chunk: Chunk, combined: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Per-node advantages (clipped) and per-node 'the edge into it is trained' masks of a chunk's trees.

        A leaf with an invalid reward takes its tree's mean valid reward (so it ranks nowhere) and the edges that
        lead only to invalid leaves are not trained; a tree without a valid leaf trains nothing.
        """
        cfg = self.config
        result = chunk.rollout
        tree = Tree(result.parents)
        leaf_tree = result.tree_of_node[result.leaf_nodes].cpu()
        rewards = combined.double().clone()
        for r in leaf_tree.unique():
            members = leaf_tree == r
            good = members & valid
            rewards[members & ~valid] = rewards[good].mean() if good.any() else 0.0
        edge_log_probs = torch.zeros(len(tree), dtype=torch.float64)
        edge_log_probs[result.transitions.dst.cpu()] = result.transitions.log_prob.double().cpu()
        _, advantages = tree_advantages(tree, rewards, fusion=cfg.rollout.fusion, edge_log_probs=edge_log_probs)
        advantages = advantages.clamp(-cfg.advantage.clip, cfg.advantage.clip)
        keep = torch.tensor([p is not None for p in tree.parents])
        keep &= leaf_mean(tree, valid.double()) > 0
        if cfg.rollout.width_prune != "none":
            keep &= width_prune_mask(tree, advantages, split_depth=cfg.rollout.split_steps[-1] + 1,
                                     mode=cfg.rollout.width_prune, fraction=cfg.rollout.width_prune_fraction)
        if cfg.rollout.depth_prune_steps:
            drop = cfg.rollout.depth_prune_steps
            if cfg.rollout.depth_prune_sliding:
                progress = min(1.0, iteration / max(1, cfg.train.iterations - 1))
                drop = sliding_prune_steps(drop, progress, last_step=cfg.sampling.num_steps - 2)
            keep &= depth_prune_mask(result.node_step.cpu(), drop)
        return advantages, keep

    # ------------------------------------------------------------------------------------------------- train
    def micro_batch_loss(self, chunk: Chunk, step: int) -> tuple[Tensor, dict]:
        """The GRPO loss of one rollout chunk at one step, log-probs recomputed under the current policy.

        The velocity is evaluated once per distinct source state, in the rollout's own order (a tree's split children
        share their parent's evaluation), so the batch matches the rollout's forward and the first ratio is exactly 1.
        """
        cfg = self.config
        t = chunk.rollout.transitions
        sel = t.step == step
        st = t.select(sel)
        sources, inverse = torch.unique(st.src, return_inverse=True)
        rows = torch.empty_like(sources).scatter_(0, inverse, st.prompt_id)
        x, sigma = t.states[sources], st.sigma[:1].expand(len(sources))
        with self.accelerator.autocast():
            v = self.model.velocity(x, sigma, chunk.cond.index(rows), cfg.sampling.guidance_scale)[inverse]
        v_ref = v_ref_sources = None
        if self.computes_kl:
            with torch.no_grad(), self.model.reference(), self.accelerator.autocast():
                v_ref_sources = self.model.velocity(x, sigma, chunk.cond.index(rows), cfg.sampling.guidance_scale)
            v_ref = v_ref_sources[inverse]
        # Log-prob, ratio, clip and KL in one op: fused Triton forward and backward on CUDA (model.kernels).
        loss, stats = transition_grpo_loss(
            v, st.x_t, st.x_next, st.sigma, st.sigma_next, st.log_prob, chunk.advantages[sel], kind=t.kind,
            noise_level=st.noise_level, noise_scale=st.noise_scale, reduce=t.reduce, clip_range=cfg.loss.clip_range,
            weights=chunk.weights[sel], v_ref=v_ref, beta=cfg.loss.beta, kl=cfg.loss.kl, backend=cfg.model.kernels,
        )
        if cfg.loss.rg_opd_weight > 0:
            sigma_next = st.sigma_next[:1].expand(len(sources))
            if cfg.loss.rg_opd_reward is not None:
                target = self.rg_opd_reward_target(x, sigma, sigma_next, chunk.cond.index(rows),
                                                   [chunk.metadata[r] for r in rows.tolist()], v_ref_sources)
            else:
                target = self.rg_opd_target(x, sigma, sigma_next, chunk.cond.index(rows))
            opd = (v.float() - target[inverse]).pow(2).flatten(1).mean(dim=1)
            opd = (opd * chunk.weights[sel]).sum() / chunk.weights[sel].sum().clamp_min(1e-8)
            loss = loss + cfg.loss.rg_opd_weight * opd
            stats = {**stats, "rg_opd": float(opd.detach())}
        return loss, stats

    def rg_opd_target(self, x: Tensor, sigma: Tensor, sigma_next: Tensor, cond: Cond) -> Tensor:
        """RG-OPD (on-policy distillation of RGS): per-state velocity targets ``v_ref + delta / dt`` where ``delta``
        is the RGS correction from the register heads' gradients at ``x`` (``samplers.rgs.rgs_velocity_target``), all
        on the reference model (LoRA off). Detached."""
        from flowalign.samplers.rgs import rgs_velocity_target

        self.step_registers()
        scale = self.config.sampling.guidance_scale
        self.registers.attach(self.model.transformer)
        try:
            with torch.enable_grad(), self.model.reference(), self.accelerator.autocast():
                x_in = x.detach().float().requires_grad_(True)
                v_ref, scores = self.registers.read(lambda x, s: self.model.velocity(x, s, cond, scale), x_in, sigma)
                heads = scores.shape[1]
                grads = [torch.autograd.grad(scores[:, h].sum(), x_in, retain_graph=h < heads - 1)[0]
                         for h in range(heads)]
        finally:
            self.registers.detach()
        bands = [tuple(band) for band in self.config.loss.rg_opd_bands]
        return rgs_velocity_target(x_in.detach(), v_ref.detach(), grads, [1.0] * heads, sigma[0], sigma_next[0],
                                   bands).detach()

    def rg_opd_reward_target(self, x: Tensor, sigma: Tensor, sigma_next: Tensor, cond: Cond, metadata: list[dict],
                             v_ref: Tensor | None = None) -> Tensor:
        """RG-OPD with a differentiable image reward (``loss.rg_opd_reward``) as the gradient source: the gradient of
        the reward of the decoded ``x0_hat = x - s v_ref`` with respect to ``x0_hat`` (``v_ref`` held fixed, as RGS's
        ``--rgs-gradient x0``: no backward through the transformer), turned into the target ``v_ref + delta / dt`` by
        ``rgs_velocity_target`` with the bands ``loss.rg_opd_bands``. Detached."""
        from flowalign.samplers.rgs import rgs_velocity_target, x0_hat_gradient

        cfg = self.config
        if v_ref is None:
            with torch.no_grad(), self.model.reference(), self.accelerator.autocast():
                v_ref = self.model.velocity(x, sigma, cond, cfg.sampling.guidance_scale)
        prompts = [m["prompt"] for m in metadata]
        def score(x0: Tensor, rows) -> Tensor:  # through the reward's differentiable entry point
            return differentiable_score(self.opd_reward, self.model.decode(x0), prompts, metadata)

        grad = x0_hat_gradient(score, x.float(), v_ref.float(), sigma[0], None)
        bands = [tuple(band) for band in cfg.loss.rg_opd_bands]
        return rgs_velocity_target(x.float(), v_ref.float(), [grad], [1.0], sigma[0], sigma_next[0], bands).detach()

    def build_opd_reward(self):
        """``loss.rg_opd_reward`` built from the reward registry; it must have the differentiable entry point
        ``forward`` (checked on its class before it is built: ``rewards.build_differentiable_reward``)."""
        loss = self.config.loss
        return build_differentiable_reward(loss.rg_opd_reward, "loss.rg_opd_reward", **loss.rg_opd_reward_kwargs)

    def step_weights(self, chunk: Chunk, steps: list[int]) -> Tensor:
        """Per-transition weights: 1 (or noise-aware) on the trained steps, 0 elsewhere.

        Noise-aware weights use the SDE's own std, without a tree's split-noise scale.
        """
        t = chunk.rollout.transitions
        trained = torch.isin(t.step, torch.tensor(steps, device=t.step.device))
        if self.config.loss.step_weighting == "noise_aware":
            return noise_aware_weights(t.std / t.noise_scale, trained)
        return trained.float()

    def update(self, iteration: int, chunks: list[Chunk]) -> dict[str, float]:
        cfg = self.config
        steps = self.trained_steps(iteration, chunks)
        per_minibatch = self.layout.micro_batches_per_minibatch
        module = self.model.forward_module or self.model.transformer
        records: list[dict] = []
        for epoch in range(cfg.optim.inner_epochs):
            # Shuffle the steps (identically on every process); a minibatch is a share of them over all samples.
            order = torch.randperm(len(steps), generator=generator(cfg.train.seed, iteration, epoch, _SHUFFLE))
            units = [(i, steps[k]) for k in order.tolist() for i in range(len(chunks))]
            for start in range(0, len(units), per_minibatch):
                minibatch = units[start: start + per_minibatch]
                for n, (i, s) in enumerate(minibatch):
                    sync = n == len(minibatch) - 1 or self.accelerator.num_processes == 1
                    with nullcontext() if sync else self.accelerator.no_sync(module):
                        loss, stats = self.micro_batch_loss(chunks[i], s)
                        self.accelerator.backward(loss / len(minibatch))
                    records.append({**stats, "epoch": epoch})
                grad_norm = self.accelerator.clip_grad_norm_(self.params, cfg.optim.max_grad_norm)
                records[-1]["grad_norm"] = float(grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if self.ema is not None:
                    self.ema.update()
        summary = {key: sum(r[key] for r in records) / len(records)
                   for key in ("loss", "policy_loss", "kl", "approx_kl", "clip_frac", "ratio_mean")}
        summary["ratio_max"] = max(r["ratio_max"] for r in records)
        if "rg_opd" in records[0]:
            summary["rg_opd"] = sum(r["rg_opd"] for r in records) / len(records)
        summary["first_ratio_max"] = records[0]["ratio_max"]
        summary["first_ratio_mean"] = records[0]["ratio_mean"]
        summary["first_approx_kl"] = records[0]["approx_kl"]  # > 0 when training recomputes other log-probs
        summary["first_clip_frac"] = records[0]["clip_frac"]
        summary["grad_norm"] = sum(r["grad_norm"] for r in records if "grad_norm" in r) / max(
            1, sum("grad_norm" in r for r in records))
        return summary

    def set_learning_rate(self, iteration: int) -> None:
        """Linear warmup over ``optim.warmup_iterations``, then ``optim.lr_schedule`` (``flowalign.lr_schedule``)."""
        optim = self.config.optim
        scale = learning_rate_scale(iteration, self.config.train.iterations, warmup=optim.warmup_iterations,
                                    schedule=optim.lr_schedule, floor=optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.optim.lr * scale

    # -------------------------------------------------------------------------------------------- iteration
    def train_iteration(self, iteration: int) -> dict[str, float]:
        timings = {}
        start = time.perf_counter()
        prompts = self.prompts_for(iteration)
        self.model.transformer.eval()
        chunks = self.collect(iteration, prompts)
        timings["time/rollout"] = time.perf_counter() - start
        start = time.perf_counter()
        scores = self.score(prompts, chunks)
        stats = scores.stats
        completion_nfe = self.assign_credit(iteration, prompts, chunks, scores)
        timings["time/reward"] = time.perf_counter() - start
        start = time.perf_counter()
        rollout_nfe = sum(c.rollout.nfe for c in chunks) * self.accelerator.num_processes
        if self.accelerator.num_processes > 1:
            spent = torch.tensor([float(completion_nfe)], device=self.accelerator.device)
            completion_nfe = int(self.accelerator.reduce(spent, "sum").item())
        if stats["zero_std_frac"] >= 1.0:
            warnings.warn(f"iteration {iteration}: every group has zero reward variance; skipping the update")
            update = {"skipped": 1.0}
        else:
            self.model.transformer.train()
            self.set_learning_rate(iteration)
            update = self.update(iteration, chunks)
            update["skipped"] = 0.0
        timings["time/train"] = time.perf_counter() - start
        metrics = {"iteration": float(iteration), **stats, **update, **timings,
                   "nfe": float(rollout_nfe + completion_nfe), "nfe/rollout": float(rollout_nfe),
                   "nfe/completion": float(completion_nfe),
                   "lr": self.optimizer.param_groups[0]["lr"]}
        if self.is_main and self.config.train.sample_every and iteration % self.config.train.sample_every == 0:
            self.save_samples(iteration, prompts, chunks, scores.images, scores.display)
        return metrics

    def save_samples(self, iteration: int, prompts: list[dict], chunks: list[Chunk], images: Tensor,
                     rewards: Tensor) -> None:
        """A grid of this process's first 16 samples captioned ``prompt | reward`` (the scores ``score`` computed)."""
        from flowalign.evaluation.images import save_grid

        ids = torch.cat([c.sample_ids for c in chunks])[:16]
        captions = [f"{prompts[int(j) // self.config.samples_per_prompt()]['prompt']} | {float(r):.2f}"
                    for j, r in zip(ids, rewards[:16])]
        save_grid(images[:16], captions, self.out_dir / "samples" / f"iteration-{iteration:06d}.png", columns=8)

    # ------------------------------------------------------------------------------------------ checkpoints
    def config_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(to_dict(self.config), sort_keys=False)

    def save(self) -> Path | None:
        path = None
        if self.is_main:
            last = getattr(self, "last_advantages", None)
            state = {"history": self.history, "last_advantages": None if last is None else last.tolist()}
            ema = self.ema.state_dict() if self.ema is not None else None
            path = save_checkpoint(
                self.out_dir, self.iteration, trainable=self.trainable_state(), optimizer=self.optimizer.optimizer
                if hasattr(self.optimizer, "optimizer") else self.optimizer, state=state, config_yaml=self.config_yaml(),
                ema=ema, write_lora=self.model.save_lora, keep=self.config.train.keep_checkpoints,
            )
        self.accelerator.wait_for_everyone()
        if not self.is_main:
            save_process_rng(self.out_dir / f"checkpoint-{self.iteration:06d}", self.accelerator.process_index)
        self.accelerator.wait_for_everyone()
        return path

    def _check_run_directory(self) -> Path | None:
        """The checkpoint ``train.resume`` names (checked against this config), or None for a new run, which may not
        write into a directory holding another run (``flowalign.training.run_directory``); ``train.overwrite`` clears it."""
        cfg = self.config.train
        if cfg.resume:
            return resolve_resume(cfg.resume, self.config, self.out_dir,
                                  progress_dependent=self.config.progress_dependent())
        if check_new_run(self.out_dir, overwrite=cfg.overwrite) and self.is_main:
            clear_run(self.out_dir)
        self.accelerator.wait_for_everyone()
        return None

    def resume(self, checkpoint: str | Path) -> None:
        """Load the trainable weights, EMA, optimizer, RNG and history of ``checkpoint`` (checked at set-up)."""
        optimizer = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        state, ema = load_checkpoint(checkpoint, trainable=self.trainable_state(), optimizer=optimizer,
                                     rank=self.accelerator.process_index)
        if self.ema is not None and ema is not None:  # onto each parameter's device and dtype (CUDA runs)
            self.ema.load_state_dict(ema)
        self.iteration = int(state["iteration"])
        self.history = state["history"]

    # ------------------------------------------------------------------------------------------------- run
    def _request_stop(self, signum, frame) -> None:
        self.stop_requested = True

    def _agreed_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, "max").item() > 0)

    def train(self) -> list[dict[str, float]]:
        from tqdm import tqdm

        from flowalign.config import save_config

        cfg = self.config
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.out_dir / "config.yaml")
            trim_metrics(self.out_dir / "metrics.jsonl", self.iteration)
        if cfg.train.tracker != "none":
            self.accelerator.init_trackers("flowalign", config=_flat(to_dict(cfg)))
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        bar = tqdm(range(self.iteration, cfg.train.iterations), initial=self.iteration, total=cfg.train.iterations,
                   desc="train", disable=not self.is_main, dynamic_ncols=True)
        try:
            for iteration in bar:
                metrics = self.train_iteration(iteration)
                self.iteration = iteration + 1
                self.history.append(metrics)
                self.log(metrics)
                postfix = {"reward": f"{metrics['reward']:.3f}"}
                if self.computes_kl and "kl" in metrics:  # a KL to the reference is computed only for these
                    postfix["kl"] = f"{metrics['kl']:.2e}"
                bar.set_postfix(postfix)
                last = self.iteration == cfg.train.iterations
                every = cfg.train.checkpoint_every
                stop = self._agreed_stop()
                if last or stop or (every and self.iteration % every == 0):
                    self.save()
                if stop:
                    if self.is_main:
                        logger.warning("stopped by signal after iteration %d; checkpoint saved, resume with "
                                       "train.resume=latest", iteration)
                    break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            bar.close()
        if cfg.train.eval_at_end and self.iteration == cfg.train.iterations and not self.stop_requested:
            self.evaluate_before_after()
        if cfg.train.tracker != "none":
            self.accelerator.end_training()
        return self.history

    def log(self, metrics: dict[str, float]) -> None:
        if self.config.train.tracker != "none":
            self.accelerator.log({k: v for k, v in metrics.items() if k != "iteration"}, step=int(metrics["iteration"]))
        if self.is_main and int(metrics["iteration"]) % max(1, self.config.train.log_every) == 0:
            with open(self.out_dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(metrics) + "\n")

    # -------------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate_before_after(self) -> dict | None:
        """Held-out toy GenEval of the reference (LoRA off) and the trained policy on identical seeds.

        With several processes each one samples its share of the evaluation's batches (whole batches, so every image
        is computed exactly as on one process) through the unwrapped transformer, whose forward has no collectives;
        the main process gathers the verdicts and writes the report. Returns the report on the main process.
        """
        from accelerate.utils import gather_object

        from flowalign.evaluation.geneval import summarize
        from flowalign.evaluation.toy_eval import evaluate, images_per_tag, paired_difference

        cfg = self.config
        metadata = load_metadata(cfg.data.eval_prompts)
        counts = cfg.train.eval_images_per_prompt or images_per_tag(metadata, cfg.train.eval_images_per_tag)
        shard = (self.accelerator.process_index, self.accelerator.num_processes)
        kwargs = dict(steps=cfg.train.eval_steps, images_per_prompt=counts, seed=self.eval_seed,
                      image_size=cfg.sampling.image_size, shard=shard)
        self.model.transformer.eval()
        wrapped, self.model.forward_module = self.model.forward_module, None
        try:
            with self.model.reference():
                before, _, before_images = evaluate(self.model, metadata, **kwargs)
            with self.ema_weights():
                after, _, after_images = evaluate(self.model, metadata, **kwargs)
        finally:
            self.model.forward_module = wrapped
        if self.accelerator.num_processes > 1:
            order = lambda r: (r["prompt_id"], r["image_index"])  # noqa: E731 - the one-process row order
            before, after = (sorted(gather_object(results), key=order) for results in (before, after))
        report = None
        if self.is_main:  # the first batch, the grids' images, is the main process's
            report = write_before_after(self.out_dir / "eval", before, after, summarize(before), summarize(after),
                                        paired_difference(before, after), before_images, after_images,
                                        seed=self.eval_seed)
        self.accelerator.wait_for_everyone()
        return report

    @property
    def eval_seed(self) -> int:
        """The final evaluation's sample seed: ``train.eval_seed``, else ``train.seed + 10000``."""
        seed = self.config.train.eval_seed
        return self.config.train.seed + 10_000 if seed is None else seed

    def ema_weights(self):
        """Context in which the trainable weights are their EMA (a no-op without EMA)."""
        return self.ema.swapped_in() if self.ema is not None else nullcontext()


def prompt_weights(prompts: list[dict], sampling: str) -> np.ndarray | None:
    """Sampling probabilities of the training prompts: ``None`` (uniform) or equal total mass per ``tag``.

    The toy training split is 77% color_attr captions; drawn uniformly, RL would spend most of its updates on one of
    the six tags that GenEval's overall averages with equal weight.
    """
    if sampling == "uniform":
        return None
    tags = [str(entry.get("tag", "")) for entry in prompts]
    counts = Counter(tags)
    weights = np.array([1.0 / (len(counts) * counts[tag]) for tag in tags])
    return weights / weights.sum()


def write_before_after(out: Path, before, after, before_summary, after_summary, paired, before_images, after_images,
                       *, seed: int | None = None) -> dict:
    """Write ``before_after.md`` / ``.json`` and the two grids; return the report (``seed``: the evaluation's)."""
    from flowalign.evaluation.geneval import TAGS
    from flowalign.evaluation.images import save_grid

    out.mkdir(parents=True, exist_ok=True)
    lines = ["| tag | before | after | paired gain | SE | z |", "|---|---|---|---|---|---|"]
    for tag in [t for t in TAGS if t in paired["tags"]] + ["overall"]:
        entry = paired["overall"] if tag == "overall" else paired["tags"][tag]
        lines.append(f"| {tag} | {entry['mean_a']:.3f} | {entry['mean_b']:.3f} | {entry['diff']:+.3f} | "
                     f"{entry['se']:.3f} | {entry['z']:.1f} |")
    n = len(before)
    lines.append(f"\n{n} held-out samples, the same captions and seeds before and after (evaluation seed {seed}).")
    (out / "before_after.md").write_text("\n".join(lines) + "\n")
    report = {"paired": paired, "before": before_summary, "after": after_summary, "samples": n, "seed": seed}
    (out / "before_after.json").write_text(json.dumps(report, indent=1))
    for name, results, images in (("before", before, before_images), ("after", after, after_images)):
        captions = [f"{r['prompt']} | {'yes' if r['correct'] else 'no'}" for r in results[:64]]
        save_grid(images[:64], captions, out / f"grid_{name}.png")
    print("\n".join(lines))
    return report


# accelerate's distributed types the trainer runs on: one process, or data parallelism over processes (CPU, GPU or
# XPU). FSDP and DeepSpeed need the model and optimizer prepared together and sharded checkpoints: not supported yet.
SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU")


def check_distributed_type(accelerator) -> None:
    """Refuse, before any model loads, an accelerate launch config the trainer cannot run (FSDP, DeepSpeed, ...)."""
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in SUPPORTED_DISTRIBUTED_TYPES:
        raise SetupError(
            f"accelerate distributed_type {kind} is not supported by flowalign train yet: it runs on one process or "
            "with data parallelism (DDP) over processes, on CPU (gloo) or GPU. Launch with "
            "configs/accelerate/ddp.yaml or configs/accelerate/multi_node.yaml, or torchrun")


def enable_xformers(model: FlowModel) -> None:
    """xformers attention needs its extra and a CUDA device; otherwise say which is missing."""
    try:
        import xformers  # noqa: F401
    except ImportError:
        raise ValueError("model.attention='xformers' needs the xformers extra: pip install -e '.[xformers]'") from None
    if model.device.type != "cuda":
        raise ValueError(f"model.attention='xformers' needs a CUDA device, but the model is on {model.device}")
    model.pipe.enable_xformers_memory_efficient_attention()


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
