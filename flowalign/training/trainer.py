"""GRPO fine-tuning of a flow-matching text-to-image model: the loop behind ``flowalign train``.

The trainer builds the components its config names (``TrainConfig.components``: rollout shape, credit estimator, step
selection and weighting, loss terms, objectives) and runs one iteration as a straight pass:

    prompts -> rollout (the shape grows this process's batches) -> rewards (gathered, group-normalised)
            -> credit (per-transition advantages and weights) -> minibatches of micro-batches and data units
            -> loss terms and objectives on one policy forward each -> optimizer step, EMA -> callbacks

Layout and determinism. The ``P * K`` samples of an iteration are numbered prompt-major and each process takes a
contiguous slice; every random draw is keyed by what it is for (``flowalign.seeding.Purpose``). A 2-process run
therefore equals a 1-process run at the same global batch, and a resumed run equals an uninterrupted one. Training
forward passes run on micro-batches of one rollout batch at one step (``flowalign.training.policy``), so the first
recomputed log-prob ratio of an iteration is exactly 1. Log-probs are always fp32.

An objective-only run (no loss terms: ``loss: {grpo: null}``, and at least one objective, e.g. SFT or SOAR on data)
has no rollout, rewards or credit: each iteration is the objectives' units, in ``optim.minibatches`` optimizer steps.
An objective on rollouts (DiffusionNFT, AWM, online DPO: ``Objective.trains_on_rollouts``) makes the iteration roll
out and score as for GRPO; without loss terms there is no credit and no transition is trained (an ODE rollout will
do), and the objective gets the final samples and their rewards (``ObjectiveContext.rollout``).

Policy copies (``Component.policy_copies``) are lagging copies of the trainable weights kept for the components
(``flowalign.training.copies``): moved at the end of every iteration by their schedule, evaluated at the units of the
objective that declares them, and, for the component naming one in ``sampling_policy()`` (or ``"reference"``), the
weights the rollout samples with.
``nfe`` counts every per-sample model evaluation: the rollout's and the completions', plus, with objectives, the
forwards their units cost (``nfe/objectives``: what making a unit spent, ``DataUnit.nfe``, and the trainer's
evaluations of it in every inner epoch, doubled under CFG and with the reference).

Everything method-specific lives in the components; this module knows none of them by name.
"""

from __future__ import annotations

import logging
import signal
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor

from flowalign.components import IterationContext
from flowalign.config import to_dict
from flowalign.credit import CreditContext
from flowalign.data.condition_images import encode_kwargs
from flowalign.errors import RunStopped, setup_phase
from flowalign.kernels import use_backend
from flowalign.lr_schedule import learning_rate_scale
from flowalign.models import FlowModel
from flowalign.components import REFERENCE_POLICY
from flowalign.objectives import ObjectiveContext, RolloutSamples
from flowalign.rewards import bind_reward_model
from flowalign.rollout import RolloutContext, per_row_velocity
from flowalign.samplers import noise_schedule
from flowalign.seeding import Purpose, generator
from flowalign.training.callbacks import RunLog, summarize_records
from flowalign.training.checkpointer import Checkpointer
from flowalign.training.collapse import CollapseMetrics
from flowalign.training.config import TrainConfig
from flowalign.training.copies import PolicyCopies
from flowalign.training.divergence import check_finite
from flowalign.training.distributed import agreed, check_distributed_type, check_ranks_agree, summed
from flowalign.training.engine import build_engine
from flowalign.training.ema import EMA
from flowalign.training.evaluation import evaluate_before_after
from flowalign.training.minibatches import minibatch_units
from flowalign.training.policy import micro_batch, policy_output, unit_output
from flowalign.training.scoring import ChunkScoring, score_iteration, state_reward
from flowalign.training.builder import build_rewards, check_prompts_fit_model, check_prompts_fit_rewards, load_policy

logger = logging.getLogger(__name__)

__all__ = ["GRPOTrainer"]


class GRPOTrainer:
    """``GRPOTrainer(config).train()``. ``rewards`` (reward callables ``(images, prompts, metadata) -> scores``, a
    mapping of names to them, or ``(name, weight, fn)`` triples) replace ``config.reward.rewards``; ``model`` (a
    ``FlowModel``) replaces loading ``model.path``."""

    def __init__(self, config: TrainConfig, *, rewards=None, model: FlowModel | None = None, accelerator=None):
        with setup_phase():  # every mistake of the user's surfaces here, as a SetupError, before any update
            self._set_up(config, rewards, model, accelerator)

    def _set_up(self, config: TrainConfig, rewards, model, accelerator) -> None:
        from accelerate import Accelerator

        from flowalign.data.prompts import PromptSampler, load_prompts

        self.config, cfg = config, config.train
        self.accelerator = accelerator or Accelerator(
            mixed_precision=config.model.mixed_precision, log_with=None if cfg.tracker == "none" else cfg.tracker,
            project_dir=cfg.out_dir)
        check_distributed_type(self.accelerator)
        check_ranks_agree(self.accelerator, to_dict(config))
        self.layout = config.check_batch(self.accelerator.num_processes)
        self.out_dir, self.checkpointer = Path(cfg.out_dir), Checkpointer(self)
        self.checkpoint = self.checkpointer.check_run_directory()  # the checkpoint to resume; before any model loads
        self.parts = config.components()
        self.schedule = noise_schedule(config.noise_schedule_spec())
        train_prompts = load_prompts(config.data.train_prompts)
        if rewards is None:
            check_prompts_fit_rewards(config, train_prompts)
        check_prompts_fit_model(config, train_prompts, model)
        self.prompts = PromptSampler(train_prompts, seed=cfg.seed, count=config.data.prompts_per_iteration,
                                     sampling=config.data.prompt_sampling)
        self.rewards = build_rewards(config, rewards, self.layout)
        CollapseMetrics.check_prompts(config, train_prompts)
        self.collapse = CollapseMetrics(config, rewards_given=rewards is not None)  # before the LoRA's seed
        for part in self.parts.all():
            part.start_up()
            part.check_model(config.model.path if model is None else None)
        self.engine = build_engine(config)
        if model is None:
            self.engine.check(config)
        torch.manual_seed(cfg.seed)  # the LoRA initialisation, identical on every process and layout
        self.model = load_policy(config, self.accelerator.device, model)
        for _, _, reward in self.rewards:  # a reward conditioned on the model's text embeddings takes them from it
            bind_reward_model(reward, self.model)
        self.params = self.engine.prepare(self)  # wrapped or sharded before the optimizer is built on them
        optim = config.optim
        self.optimizer = self.engine.optimizer(self, self.params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                               weight_decay=optim.weight_decay)
        self.ema = EMA(self.trainable_state(), optim.ema_decay) if optim.ema_decay > 0 else None
        self.copies = PolicyCopies(self.trainable_state(), [c for part in self.parts.all() for c in part.policy_copies()])
        self.iteration, self.history, self.stop_requested, self.last_advantages = 0, [], False, None
        self.optimizer_steps, self.iteration_cond, self.stop_signal = 0, None, None
        for part in self.parts.all():
            part.set_up(self)
        if self.checkpoint is not None:  # loading it is set-up too: a file that does not fit is the user's to fix
            self.checkpointer.resume(self.checkpoint)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def rolls_out(self) -> bool:
        """Whether an iteration rolls out and scores: a loss term trains transitions, or an objective trains on the
        rollouts."""
        return bool(self.parts.losses) or any(o.trains_on_rollouts for o in self.parts.objectives.values())

    def sampling_weights(self):
        """Context in which the model holds the weights the rollouts sample with (``Component.sampling_policy``)."""
        name = self.parts.sampling_policy()
        if name is None:
            return nullcontext()
        if name == REFERENCE_POLICY:
            return self.model.reference()
        return self.copies.swapped_in(name)

    @property
    def computes_kl(self) -> bool:
        """Whether a loss term reads the reference velocity (a KL penalty, the velocity MSE logged, RG-OPD's x0)."""
        return any(term.wants_reference() for term in self.parts.losses.values())

    def reference_policy(self):
        """The context in which the model's passes are the run's reference policy's (``reference``)."""
        return self.parts.reference.active(self.model)

    def trainable_state(self) -> dict[str, Tensor]:
        return {n: p for n, p in self.model.transformer.named_parameters() if p.requires_grad}

    def progress(self, iteration: int) -> float:
        return min(1.0, iteration / max(1, self.config.train.iterations - 1))

    # --------------------------------------------------------------------------------------------- the loop
    def train(self) -> list[dict[str, float]]:
        log, cfg = RunLog(self), self.config.train
        log.start()
        previous = {s: signal.signal(s, self._request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for iteration in range(self.iteration, cfg.iterations):
                try:
                    metrics, prompts, batches, scores = self.train_iteration(iteration)
                except RunStopped as stopped:  # e.g. a reward server that refuses for good: save, then stop
                    raise self._stopped(stopped) from None
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
            for s, handler in previous.items():
                signal.signal(s, handler)
            log.close()
        if cfg.eval_at_end and self.iteration == cfg.iterations and not self.stop_requested:
            evaluate_before_after(self)
        log.end()
        return self.history

    def step(self) -> dict[str, float]:
        """Run the next iteration (``self.iteration``) without checkpoints, logs or grids; returns its metrics."""
        metrics, *_ = self.train_iteration(self.iteration)
        self.iteration += 1
        self.history.append(metrics)
        return metrics

    def train_iteration(self, iteration: int):
        """One iteration: ``(metrics, prompts, batches, scores)``."""
        if not self.rolls_out:
            return self.objective_iteration(iteration)
        clock = time.perf_counter()
        prompts = self.prompts.prompts_for(iteration)
        self.model.transformer.eval()
        overlap = ChunkScoring(self) if self.config.reward.overlap else None  # reward.overlap: score during rollout
        with self.sampling_weights(), overlap or nullcontext():
            batches = self.rollout(iteration, prompts, on_chunk=overlap)
        timings = {"time/rollout": time.perf_counter() - clock}
        clock = time.perf_counter()
        scores = score_iteration(self, batches, overlap)
        self.last_advantages = scores.global_advantages
        steps, completion_nfe, credit_stats = [], 0, {}
        if self.parts.losses:  # credit for the transitions the loss terms train
            steps = self.trained_steps(iteration, batches)
            completion_nfe, credit_stats = self.assign_credit(iteration, batches, scores, steps)
        timings["time/reward"] = time.perf_counter() - clock
        clock = time.perf_counter()
        collapse = self.collapse.measure(self, batches, scores)
        timings["time/collapse"] = time.perf_counter() - clock
        clock = time.perf_counter()
        context = self.iteration_context(iteration, batches, scores)
        prepared = self.prepare_update(context)
        rollout_nfe = sum(b.rollout.nfe for b in batches) * self.accelerator.num_processes
        completion_nfe = summed(self.accelerator, completion_nfe)
        invalid = scores.stats["reward_invalid"] / self.layout.global_samples
        if invalid > self.config.reward.skip_invalid_fraction:
            warnings.warn(f"iteration {iteration}: {invalid:.0%} of the samples have an invalid reward, more than "
                          f"reward.skip_invalid_fraction = {self.config.reward.skip_invalid_fraction:g}; skipping "
                          "the update")
            update = {"skipped": 1.0}
        elif scores.stats["zero_std_frac"] >= 1.0:
            warnings.warn(f"iteration {iteration}: every group has zero reward variance; skipping the update")
            update = {"skipped": 1.0}
        else:
            self.model.transformer.train()
            self.set_learning_rate(iteration)
            update = {**self.update(iteration, batches, steps, scores), "skipped": 0.0}
        update.update(self.end_iteration())
        timings["time/train"] = time.perf_counter() - clock
        objective_nfe = update.get("nfe/objectives", 0.0)
        metrics = {"iteration": float(iteration), **scores.stats, **credit_stats, **prepared, **update, **collapse,
                   **timings, "nfe": float(rollout_nfe + completion_nfe + objective_nfe),
                   "nfe/rollout": float(rollout_nfe), "nfe/completion": float(completion_nfe),
                   "lr": self.optimizer.param_groups[0]["lr"]}
        metrics.update(self.after_update(context, metrics))
        return metrics, prompts, batches, scores

    def objective_iteration(self, iteration: int):
        """An iteration of an objective-only run (module docstring): ``(metrics, [], [], None)``."""
        clock = time.perf_counter()
        context = self.iteration_context(iteration, [], None)
        prepared = self.prepare_update(context)
        self.model.transformer.train()
        self.set_learning_rate(iteration)
        update = {**self.update(iteration, [], []), **self.end_iteration()}
        metrics = {"iteration": float(iteration), **prepared, **update, "skipped": 0.0,
                   "time/train": time.perf_counter() - clock, "nfe": update["nfe/objectives"],
                   "lr": self.optimizer.param_groups[0]["lr"]}
        metrics.update(self.after_update(context, metrics))
        return metrics, [], [], None

    def end_iteration(self) -> dict[str, float]:
        """Move the policy copies by their schedules; their ``eta`` as metrics (``copies/<name>/eta``)."""
        return {f"copies/{name}/eta": eta for name, eta in self.copies.end_iteration(self.optimizer_steps).items()}

    # ------------------------------------------------------------------------- around the optimizer steps
    def iteration_context(self, iteration: int, batches, scores) -> IterationContext:
        accelerator = self.accelerator

        def mean_over_processes(value: float) -> float:
            if accelerator.num_processes == 1:
                return float(value)
            gathered = accelerator.gather(torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device))
            return float(gathered.mean())

        return IterationContext(iteration, self.config, batches, scores, accelerator.process_index,
                                accelerator.num_processes, mean_over_processes)

    def prepare_update(self, context: IterationContext) -> dict[str, float]:
        """Every component's ``prepare_update`` (``flowalign.components``), its stats merged."""
        stats = {}
        for part in self.parts.all():
            stats.update(part.prepare_update(context))
        return stats

    def after_update(self, context: IterationContext, metrics: dict[str, float]) -> dict[str, float]:
        """Every component's ``after_update`` with the iteration's metrics, its stats merged."""
        stats = {}
        for part in self.parts.all():
            stats.update(part.after_update(context, metrics))
        return stats

    # ---------------------------------------------------------------------------------- rollout and credit
    @torch.no_grad()
    def rollout(self, iteration: int, prompts: list[dict], schedule=None, on_chunk=None) -> list:
        """This process's batches, grown by the rollout shape from prompts every process encodes in full (so the
        text encoders see the same batch whatever the process layout); ``schedule`` replaces the config's noise
        schedule (DenseGRPO's calibration); ``on_chunk(batch)`` is called with each batch as soon as it is grown
        (``reward.overlap``: ``flowalign.training.scoring.ChunkScoring``)."""
        cfg, model = self.config, self.model
        levels = (schedule or self.schedule).levels(cfg.sampling.num_steps, progress=self.progress(iteration),
                                      generator=generator(cfg.train.seed, iteration, Purpose.WINDOW))
        sigmas = model.sigmas(cfg.sampling.num_steps, cfg.sampling.image_size)
        texts = [entry["prompt"] for entry in prompts]
        cond = model.encode(texts, negative_prompts=[""] * len(texts) if model.uses_cfg(
            cfg.sampling.guidance_scale) else None, **encode_kwargs(prompts))  # an editing prompt's images
        hooks = [hook for part in self.parts.all() for hook in part.rollout_hooks()]
        fields = frozenset().union(*(part.rollout_fields() for part in self.parts.all()))
        context = RolloutContext(model, cfg, iteration, sigmas, levels, hooks, prompts, fields)
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

    def trained_steps(self, iteration: int, batches) -> list[int]:
        t = batches[0].rollout.transitions
        stochastic = sorted({int(s) for s in t.step[t.stochastic]})
        return self.parts.step_selection.select(stochastic, self.config.train.seed, iteration)

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

    def credit_context(self, iteration: int, steps: list[int]) -> CreditContext:
        return CreditContext(self.config, self.model, iteration, self.progress(iteration), steps,
                             state_reward(self.rewards), self.accelerator.autocast,
                             lambda cond: per_row_velocity(self.model, cond, self.config.sampling.guidance_scale))

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
                    sync = n == len(work) - 1 or self.accelerator.num_processes == 1
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
            summary["nfe/objectives"] = float(summed(self.accelerator, self.objective_nfe(data)))
        return summary

    def objective_nfe(self, data: dict[str, list]) -> int:
        """This process's per-sample evaluations for its objectives' units (module docstring)."""
        evals = 2 if self.model.uses_cfg(self.config.sampling.guidance_scale) else 1
        total = 0
        for name, units in data.items():
            objective = self.parts.objectives[name]
            passes = 1 + int(objective.needs_reference) + len(objective.policy_copies())
            per_row = evals * passes * self.config.optim.inner_epochs
            total += sum(unit.nfe + per_row * len(unit) for unit in units)
        return total

    def micro_batch_loss(self, batch, step: int) -> tuple[Tensor, dict]:
        """The sum of the loss terms on one batch at one step, on one policy forward."""
        micro = micro_batch(batch, step)
        policy = policy_output(self.model, micro, guidance_scale=self.config.sampling.guidance_scale,
                               autocast=self.accelerator.autocast, reference=self.computes_kl,
                               reference_policy=self.reference_policy, cfg_gradient=self.config.sampling.cfg_gradient)
        loss, stats = None, {}
        for term in self.parts.losses.values():
            value, term_stats = term.loss(micro, policy)
            loss = value if loss is None else loss + value
            stats.update(term_stats)
        return loss, stats

    @torch.no_grad()
    def objective_units(self, iteration: int, batches=(), scores=None) -> dict[str, list]:
        rollout = self.rollout_samples(batches, scores) if batches and scores is not None else None
        context = ObjectiveContext(self.model, self.config, self.config.train.seed, iteration,
                                   self.accelerator.process_index, self.accelerator.num_processes,
                                   self.accelerator.device, rollout)
        return {name: objective.units(iteration, context) for name, objective in self.parts.objectives.items()}

    def rollout_samples(self, batches, scores) -> RolloutSamples:
        """This process's final samples and their rewards, for the objectives on rollouts."""
        ids = torch.cat([b.sample_ids for b in batches])
        return RolloutSamples(
            x0=torch.cat([b.rollout.final for b in batches]), sample_ids=ids,
            group_ids=ids // self.config.data.group_size, advantages=scores.advantages, rewards=scores.combined,
            valid=scores.valid, cond=self.iteration_cond, prompt_index=ids // self.config.samples_per_prompt(),
            sigmas=self.model.sigmas(self.config.sampling.num_steps, self.config.sampling.image_size))

    def objective_loss(self, name: str, unit) -> tuple[Tensor, dict]:
        objective = self.parts.objectives[name]
        # objectives on data regress the conditional velocity, whatever CFG the rollouts sample with
        copies = {copy.name: self.copies.swapped_in for copy in objective.policy_copies()}
        policy = unit_output(self.model, unit, guidance_scale=1.0, autocast=self.accelerator.autocast,
                             reference=objective.needs_reference, copies=copies,
                             reference_policy=self.reference_policy)
        return objective.loss(unit, policy)

    def set_learning_rate(self, iteration: int) -> None:
        """Linear warmup over ``optim.warmup_iterations``, then ``optim.lr_schedule`` (``flowalign.lr_schedule``)."""
        optim = self.config.optim
        scale = learning_rate_scale(iteration, self.config.train.iterations, warmup=optim.warmup_iterations,
                                    schedule=optim.lr_schedule, floor=optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = optim.lr * scale

    # ------------------------------------------------------------------------------------- run, evaluation
    def _request_stop(self, signum, frame) -> None:
        self.stop_requested, self.stop_signal = True, signum  # the command line exits 128 + signum

    def _stopped(self, stopped: RunStopped) -> RunStopped:
        """A ``RunStopped`` inside an iteration: as on SIGTERM, the checkpoint of the last whole iteration is saved
        (the failed iteration changed no weight); the message adds which one and how to resume."""
        path = self.out_dir / f"checkpoint-{self.iteration:06d}"
        if not path.is_dir():
            self.checkpointer.save()
        return RunStopped(f"{stopped}; the run stopped in iteration {self.iteration} with {path.name} saved: resume "
                          "with train.resume=latest once that is fixed")

    def save(self) -> Path | None:
        return self.checkpointer.save()

    @property
    def eval_seed(self) -> int:
        """The final evaluation's sample seed: ``train.eval_seed``, else ``train.seed + 10000``."""
        seed = self.config.train.eval_seed
        return self.config.train.seed + 10_000 if seed is None else seed

    def ema_weights(self):
        """Context in which the trainable weights are their EMA (a no-op without EMA)."""
        return self.ema.swapped_in() if self.ema is not None else nullcontext()

