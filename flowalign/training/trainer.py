"""The training loop behind ``flowalign train``: ``Trainer(config)`` (built by ``flowalign.training.builder``) runs
one iteration as a straight pass:

    prompts -> rollout (the shape grows this process's batches) -> rewards (gathered, group-normalised)
            -> credit (per-transition advantages and weights) -> minibatches of micro-batches and data units
            -> loss terms and objectives on one policy forward each -> optimizer step, EMA -> callbacks

Each process takes a contiguous slice of the prompt-major samples and every random draw is keyed by its purpose
(``flowalign.seeding.Purpose``), so a 2-process run equals a 1-process run and a resumed run an uninterrupted one. A
micro-batch is one rollout batch at one step (``flowalign.training.policy``): the first log-prob ratio is exactly 1.
An objective-only run has no rollout, rewards or credit; policy copies move at the end of every iteration.

Everything method-specific lives in the components, which declare the method's policies too: whether an iteration
without reward variance skips its update (``Components.skip_without_signal``) and an objective's guidance scale
(``Objective.guidance_scale``). Contexts: ``training.contexts``; NFEs: ``training.nfe``; stops: ``training.stopping``.
"""

from __future__ import annotations

import logging
import time
import warnings
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from flowalign.deprecation import moved_names
from flowalign.errors import RunStopped, setup_phase
from flowalign.kernels import use_backend
from flowalign.lr_schedule import set_learning_rate
from flowalign.models import FlowModel
from flowalign.seeding import Purpose, generator
from flowalign.training.builder import build_trainer
from flowalign.training.callbacks import RunLog, summarize_records
from flowalign.training.config import TrainConfig
from flowalign.training.contexts import credit_context, iteration_context, objective_context, rollout_context
from flowalign.training.copies import sampling_weights
from flowalign.training.divergence import check_finite
from flowalign.training.collectives import agreed, summed, world_of
from flowalign.training.evaluation import evaluate_before_after
from flowalign.training.minibatches import minibatch_units
from flowalign.training.nfe import iteration_nfe, objective_nfe
from flowalign.training.policy import micro_batch, policy_output, unit_output
from flowalign.training.run_summary import TrainResult
from flowalign.training.scoring import ChunkScoring, score_iteration, skip_reason
from flowalign.training.stopping import stop_on_signals, stopped_with_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["Trainer"]


class Trainer:
    """``Trainer(config).train()``: the training loop of every method.

    Args:
        config: the run's ``TrainConfig`` (``flowalign.load_config``).
        rewards: callables ``(images, prompts, metadata) -> scores`` (a mapping of names to them, or ``(name, weight,
            fn)`` triples) that replace ``config.reward.rewards``; None builds the configured ones.
        model: a ``FlowModel`` to train instead of loading ``config.model.path``; None loads it.
        accelerator: an ``accelerate.Accelerator`` to run on; None builds one from the config.
    """

    def __init__(self, config: TrainConfig, *, rewards=None, model: FlowModel | None = None, accelerator=None):
        with setup_phase():  # every mistake of the user's surfaces here, as a SetupError, before any update
            build_trainer(self, config, rewards, model, accelerator)

    # --------------------------------------------------------------------------------------------- the loop
    def train(self) -> TrainResult:
        """Run the remaining iterations to ``train.iterations``, checkpointing and logging as configured, then the
        final evaluation (``train.eval_at_end``) and a summary of the run's paths; SIGINT or SIGTERM stops after the
        current iteration, with a checkpoint. Where nobody configured logging (a notebook) the lines go to stdout.

        Returns:
            Every iteration's metrics (a list), with ``evaluation`` and ``paths`` (``training.run_summary``).
        """
        log, cfg = RunLog(self), self.config.train
        log.start()
        try:
            with stop_on_signals(self):
                for iteration in range(self.iteration, cfg.iterations):
                    try:
                        metrics, prompts, batches, scores = self.train_iteration(iteration)
                    except RunStopped as stopped:  # e.g. a reward server that refuses for good: save, then stop
                        raise stopped_with_checkpoint(self, stopped) from None
                    check_finite(self, iteration, metrics, batches)  # a diverged iteration is neither logged nor saved
                    self.iteration = iteration + 1
                    self.history.append(metrics)
                    log.iteration(metrics, prompts, batches, scores)
                    stop = agreed(self.accelerator, self.stop_requested)
                    if self.iteration == cfg.iterations or stop or (cfg.checkpoint_every and
                                                                     self.iteration % cfg.checkpoint_every == 0):
                        self.checkpointer.save()
                    if stop:
                        if self.is_main:
                            logger.warning("stopped by signal after iteration %d; checkpoint saved, resume with "
                                           "train.resume=latest", iteration)
                        break
        finally:
            log.close()
        finished = self.iteration == cfg.iterations
        evaluation = evaluate_before_after(self) if cfg.eval_at_end and finished and not self.stop_requested else None
        return TrainResult(self.history, evaluation, log.end(evaluation, finished))

    def step(self) -> dict[str, float]:
        """Run the next iteration (``self.iteration``) without checkpoints, logs or grids; returns its metrics.

        Returns:
            The iteration's metrics (also appended to ``history``).
        """
        metrics, *_ = self.train_iteration(self.iteration)
        self.iteration += 1
        self.history.append(metrics)
        return metrics

    def train_iteration(self, iteration: int):
        """One iteration: ``(metrics, prompts, batches, scores)``."""
        if not self.parts.rolls_out():
            return self.objective_iteration(iteration)
        clock = time.perf_counter()
        prompts = self.prompts.prompts_for(iteration)
        self.model.transformer.eval()
        overlap = ChunkScoring(self) if self.config.reward.overlap else None  # reward.overlap: score during rollout
        with sampling_weights(self.model, self.copies, self.parts.sampling_policy()), overlap or nullcontext():
            batches = self.rollout(iteration, prompts, on_chunk=overlap)
        timings = {"time/rollout": time.perf_counter() - clock}
        clock = time.perf_counter()
        scores = score_iteration(self, batches, overlap)
        self.last_advantages = scores.global_advantages
        steps, completion_nfe, credit_stats = [], 0, {}
        if self.parts.losses:  # credit for the transitions the loss terms train
            steps = self.parts.trained_steps(batches[0].rollout.transitions, self.config.train.seed, iteration)
            completion_nfe, credit_stats = self.assign_credit(iteration, batches, scores, steps)
        timings["time/reward"] = time.perf_counter() - clock
        clock = time.perf_counter()
        collapse = self.collapse.measure(self, batches, scores)
        timings["time/collapse"] = time.perf_counter() - clock
        clock = time.perf_counter()
        context = iteration_context(self, iteration, batches, scores)
        prepared = self.parts.prepare_update(context)
        skip = skip_reason(self.config, self.parts, scores, self.layout.global_samples)
        if skip is not None:
            warnings.warn(f"iteration {iteration}: {skip}; skipping the update")
            update = {"skipped": 1.0}
        else:
            self.model.transformer.train()
            set_learning_rate(self.optimizer, self.config.optim, iteration, self.config.train.iterations)
            update = {**self.update(iteration, batches, steps, scores), "skipped": 0.0}
        update.update(self.copies.end_iteration_metrics(self.optimizer_steps))
        timings["time/train"] = time.perf_counter() - clock
        nfe = iteration_nfe(self, batches, completion_nfe, update.get("nfe/objectives", 0.0))
        metrics = {"iteration": float(iteration), **scores.stats, **credit_stats, **prepared, **update, **collapse,
                   **timings, **nfe, "lr": self.optimizer.param_groups[0]["lr"]}
        metrics.update(self.parts.after_update(context, metrics))
        return metrics, prompts, batches, scores

    def objective_iteration(self, iteration: int):
        """An iteration of an objective-only run (module docstring): ``(metrics, [], [], None)``."""
        clock = time.perf_counter()
        context = iteration_context(self, iteration, [], None)
        prepared = self.parts.prepare_update(context)
        self.model.transformer.train()
        set_learning_rate(self.optimizer, self.config.optim, iteration, self.config.train.iterations)
        update = {**self.update(iteration, [], []), **self.copies.end_iteration_metrics(self.optimizer_steps)}
        metrics = {"iteration": float(iteration), **prepared, **update, "skipped": 0.0,
                   "time/train": time.perf_counter() - clock, "nfe": update["nfe/objectives"],
                   "lr": self.optimizer.param_groups[0]["lr"]}
        metrics.update(self.parts.after_update(context, metrics))
        return metrics, [], [], None

    # ---------------------------------------------------------------------------------- rollout and credit
    @torch.no_grad()
    def rollout(self, iteration: int, prompts: list[dict], schedule=None, on_chunk=None) -> list:
        """This process's batches, grown by the rollout shape (``flowalign.training.contexts.rollout_context``);
        ``schedule`` replaces the config's noise schedule (DenseGRPO's calibration); ``on_chunk(batch)`` is called
        with each batch as soon as it is grown (``reward.overlap``: ``flowalign.training.scoring.ChunkScoring``)."""
        cfg = self.config
        context, cond = rollout_context(self, iteration, prompts, schedule)
        n = self.layout.samples_per_process
        ids = torch.arange(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        per_prompt, batches = cfg.samples_per_prompt(), []
        with self.accelerator.autocast(), use_backend(cfg.model.kernels):
            for chunk in ids.split(self.layout.rollout_batch_size):
                batch = self.parts.shape.grow(context, chunk, cond)
                batch.metadata = [prompts[i] for i in batch.prompt_index.tolist()]
                batch.sample_metadata = [prompts[int(j) // per_prompt] for j in batch.sample_ids]
                batches.append(batch)
                if on_chunk is not None:
                    on_chunk(batch)
        self.iteration_cond = cond  # one row per prompt: what objectives on rollouts condition on
        return batches

    def assign_credit(self, iteration: int, batches, scores, steps: list[int]) -> tuple[int, dict[str, float]]:
        """Every transition's advantage and weight (the step weighting's times the credit's); the NFEs spent."""
        context = self.credit_context(iteration, steps)
        nfe, stats = 0, {}
        for batch, share in zip(batches, scores.slices(batches)):
            weights = self.parts.step_weighting.weights(batch.rollout.transitions, steps)
            credit = self.parts.credit.assign(batch, share, context)
            batch.advantages = credit.advantages
            batch.weights = weights if credit.weights is None else weights * credit.weights
            nfe += credit.nfe
            stats.update(credit.stats)
        return nfe, stats

    # ---------------------------------------------------------------------------------------------- update
    def update(self, iteration: int, batches, steps: list[int], scores=None) -> dict[str, float]:
        """Inner epochs of optimizer steps; a minibatch is a share of the trained steps over all batches, or every
        trained step of a share of the batches (``optim.minibatch_split``, ``flowalign.training.minibatches``; the
        same draws on every process), and the same share of each objective's data units."""
        cfg = self.config
        data = self.objective_units(iteration, batches, scores)
        shares = cfg.optim.minibatches
        module = self.model.forward_module or self.model.transformer
        records, objective_records, norms = [], {name: [] for name in data}, []
        for epoch in range(cfg.optim.inner_epochs):
            order = torch.randperm(len(steps), generator=generator(cfg.train.seed, iteration, epoch, Purpose.SHUFFLE))
            minibatches = minibatch_units(
                cfg.optim.minibatch_split, [steps[k] for k in order.tolist()], len(batches),
                self.accelerator.process_index * len(batches), shares,
                generator(cfg.train.seed, iteration, epoch, Purpose.MINIBATCH_SHARES))
            for m, minibatch in enumerate(minibatches):
                work = [(None, unit, len(minibatch)) for unit in minibatch]
                for name, items in data.items():
                    share = items[m * len(items) // shares:(m + 1) * len(items) // shares]
                    work += [(name, unit, len(share)) for unit in share]
                for n, (name, unit, count) in enumerate(work):
                    sync = n == len(work) - 1 or world_of(self.accelerator).num_processes == 1
                    with nullcontext() if sync else self.accelerator.no_sync(module):
                        loss, stats = (self.micro_batch_loss(batches[unit[0]], unit[1]) if name is None
                                       else self.objective_loss(name, unit))
                        self.accelerator.backward(loss / count)
                    (records if name is None else objective_records[name]).append({**stats, "epoch": epoch})
                norms.append(self.engine.clip_grad_norm(self, self.params, cfg.optim.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.optimizer_steps += 1
                if self.ema is not None:
                    self.ema.update()
        summary = summarize_records(records, objective_records, norms)
        if data:
            summary["nfe/objectives"] = float(summed(self.accelerator, objective_nfe(self, data)))
        return summary

    def micro_batch_loss(self, batch, step: int) -> tuple[Tensor, dict]:
        """The sum of the loss terms on one batch at one step, on one policy forward."""
        micro, sampling = micro_batch(batch, step), self.config.sampling
        policy = policy_output(self.model, micro, guidance_scale=sampling.guidance_scale,
                               autocast=self.accelerator.autocast, reference=self.parts.reads_reference(),
                               reference_policy=partial(self.parts.reference.active, self.model),
                               cfg_gradient=sampling.cfg_gradient)
        loss, stats = None, {}
        for term in self.parts.losses.values():
            value, term_stats = term.loss(micro, policy)
            loss = value if loss is None else loss + value
            stats.update(term_stats)
        return loss, stats

    @torch.no_grad()
    def objective_units(self, iteration: int, batches=(), scores=None) -> dict[str, list]:
        context = objective_context(self, iteration, batches, scores)
        return {name: objective.units(iteration, context) for name, objective in self.parts.objectives.items()}

    def objective_loss(self, name: str, unit) -> tuple[Tensor, dict]:
        """Objective ``name``'s loss on one data unit, its policy evaluated at the objective's guidance scale."""
        objective = self.parts.objectives[name]
        copies = {copy.name: self.copies.swapped_in for copy in objective.policy_copies() if copy.evaluated}
        policy = unit_output(self.model, unit, guidance_scale=objective.guidance_scale,
                             autocast=self.accelerator.autocast, reference=objective.needs_reference, copies=copies,
                             reference_policy=partial(self.parts.reference.active, self.model))
        return objective.loss(unit, policy)

    # --------------------------------------------------------------- what the rest of the run reads of it
    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def credit_context(self, iteration: int, steps: list[int]):
        return credit_context(self, iteration, steps)

    def trainable_state(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.model.transformer.named_parameters() if p.requires_grad}

    def progress(self, iteration: int) -> float:
        return min(1.0, iteration / max(1, self.config.train.iterations - 1))

    def save(self) -> Path | None:
        return self.checkpointer.save()

    def ema_weights(self):
        """Context in which the trainable weights are their EMA (a no-op without EMA)."""
        return self.ema.swapped_in() if self.ema is not None else nullcontext()


# GRPOTrainer is the name before 0.2 (the trainer trains every method, not only GRPO), for one release.
__getattr__ = moved_names(__name__, {"GRPOTrainer": f"{__name__}:Trainer"})
