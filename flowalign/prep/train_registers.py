"""``flowalign prep registers``: fit latent reward registers on the model's own samples
(docs/design/math.md#registers).

Each iteration draws prompts, samples ``K`` trajectories per prompt with the frozen model, labels the final images
with a reward, and keeps the register taps' hidden states of every visited state ``x_t`` (captured by the
registers' read hooks during the sampling passes themselves, so the features cost no extra NFE). Pairs are the
states of two trajectories of the same prompt at the same step whose final rewards differ; the registers minimise
the pairwise Thurstone loss over them (``reward_models.latent_registers.thurstone_loss``) for a few updates per batch.

A validation split of the training prompts (``val_prompt_count``; never the held-out ones) is scored every
``eval_every`` iterations with the mean band accuracy (``selection_score``), and the checkpoint keeps the weights of
the best score: registers fit a batch's pairs long before they generalise, so the last weights are rarely the best.

Evaluation on held-out prompts reports the pairwise accuracy of the register scores per sigma band, next to the
accuracy of the one-step projection baseline ``R(decode(x0_hat))`` with ``x0_hat = x_t - s v`` (the cheapest image
reward of an intermediate state), on the same pairs.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from flowalign.devices import resolve_device
from flowalign.settings import option

__all__ = ["RegisterTrainConfig", "collect_states", "evaluate_registers", "train_registers"]

logger = logging.getLogger(__name__)


@dataclass
class RegisterTrainConfig:
    """Settings of ``flowalign prep registers``."""

    model: str = option("assets/toy-sd3", "diffusers pipeline directory of the frozen model")
    prompts: str | None = option(None, "training metadata jsonl (default: assets/prompts/train.jsonl)")
    eval_prompts: str | None = option(None, "held-out metadata jsonl (default: test.jsonl)")
    reward: str = option("toy_geneval", "registered image reward that labels the final images")
    partial_credit: bool = option(True, "toy_geneval gives partial credit (--binary-reward: it does not)",
                                  flag="binary-reward", flag_value=False)
    iterations: int = option(30, "training iterations")
    prompts_per_iteration: int = option(8, "prompts sampled per iteration")
    samples_per_prompt: int = option(4, "trajectories per prompt (pairs are formed within a prompt)")
    steps: int = option(10, "sampler steps per trajectory")
    noise_level: float = option(0.0, "SDE noise level of the trajectories (0: ODE)")
    updates_per_iteration: int = option(8, "optimizer steps per iteration")
    lr: float = option(1e-3, "learning rate")
    num_registers: int = option(32, "register tokens")
    width: int = option(128, "head width")
    taps: list[int] | None = option(None, "block indices to read (default: 3 evenly spaced)")
    eval_prompt_count: int = option(16, "held-out prompts in the report")
    val_prompt_count: int = option(16, "training prompts held back to pick the best iteration (0: keep the last)")
    eval_every: int = option(5, "validate every this many iterations (and at the last)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    baseline_x0: bool = option(True, "report the x0-projection baseline too (--no-baseline: skip it)",
                               flag="no-baseline", flag_value=False)
    seed: int = option(0, "seed")
    out: str = option("outputs/registers/registers.pt", "checkpoint file to write")
    device: str | None = option(None, "torch device (default: cuda when available, else cpu)")

    def validate(self) -> None:
        for name in ("iterations", "prompts_per_iteration", "steps", "updates_per_iteration", "num_registers",
                     "width", "eval_prompt_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.samples_per_prompt < 2:
            raise ValueError(f"samples_per_prompt must be >= 2 (pairs are formed within a prompt), got "
                             f"{self.samples_per_prompt}")
        if isinstance(self.val_prompt_count, bool) or not isinstance(self.val_prompt_count, int) or \
                self.val_prompt_count < 0:
            raise ValueError(f"val_prompt_count must be an integer >= 0, got {self.val_prompt_count!r}")
        if not (isinstance(self.eval_every, int) and self.eval_every >= 1):
            raise ValueError(f"eval_every must be an integer >= 1, got {self.eval_every!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.noise_level < 0:
            raise ValueError(f"noise_level must be >= 0, got {self.noise_level}")


@dataclass
class StateBatch:
    """Visited states of a batch of trajectories: per-tap features ``[N, L, D]``, ``sigma [N]``, the final reward
    of the state's trajectory ``label [N]``, ``group [N]`` (prompt x step: pairs never cross it), and optionally the
    one-step-projection reward ``x0_reward [N]``."""

    features: list[Tensor]
    sigma: Tensor
    label: Tensor
    group: Tensor
    x0_reward: Tensor | None = None
    final_rewards: Tensor = field(default_factory=lambda: torch.zeros(0))


@torch.no_grad()
def collect_states(model, registers, metadata: Sequence[dict], reward_fn, *, samples_per_prompt: int, steps: int,
                   noise_level: float, seed_key: tuple[int, ...], baseline_x0: bool = False) -> StateBatch:
    """Sample ``K`` trajectories per prompt (registers attached) and keep every state's tapped features."""
    from flowalign.samplers import ode_step, predict_x0, sde_step
    from flowalign.seeding import generator

    k = samples_per_prompt
    prompts = [m["prompt"] for m in metadata]
    rows = torch.arange(len(prompts)).repeat_interleave(k)
    cond = model.encode(prompts).index(rows)
    generators = [generator(*seed_key, int(r), j % k) for j, r in enumerate(rows.tolist())]
    x = model.prepare_noise(len(rows), generator=generators)
    sigmas = model.sigmas(steps)
    per_tap, sigma_of, step_of, x0_states = None, [], [], []
    for t in range(steps):
        v = model.velocity(x, sigmas[t], cond)
        feats = [f.detach().float().cpu() for f in registers.take_features(x.shape[0])]
        per_tap = [[f] for f in feats] if per_tap is None else [acc + [f] for acc, f in zip(per_tap, feats)]
        sigma_of.append(torch.full((x.shape[0],), float(sigmas[t])))
        step_of.append(torch.full((x.shape[0],), t))
        if baseline_x0:
            x0_states.append(predict_x0(x, v, sigmas[t]).to(x.dtype))
        if noise_level > 0:
            noise = torch.stack([torch.randn(x.shape[1:], generator=g) for g in generators]).to(x.device)
            x = sde_step(x, v, sigmas[t], sigmas[t + 1], kind="flow_grpo", noise_level=noise_level, noise=noise).prev_sample
        else:
            x = ode_step(x, v, sigmas[t], sigmas[t + 1])
    images = model.decode(x)
    meta = [metadata[r] for r in rows.tolist()]
    texts = [prompts[r] for r in rows.tolist()]
    final = torch.as_tensor(reward_fn(images, texts, meta), dtype=torch.float64).flatten()
    x0_reward = None
    if baseline_x0:
        x0_reward = torch.cat([torch.as_tensor(reward_fn(model.decode(s), texts, meta), dtype=torch.float64).flatten()
                               for s in x0_states])
    step = torch.cat(step_of)
    return StateBatch(
        features=[torch.cat(chunks) for chunks in per_tap],
        sigma=torch.cat(sigma_of),
        label=final.repeat(steps),
        group=rows.repeat(steps) * steps + step,
        x0_reward=x0_reward,
        final_rewards=final,
    )


def pair_index(labels: Tensor, groups: Tensor) -> tuple[Tensor, Tensor]:
    """All pairs ``i < j`` in the same group with different labels."""
    same = (groups[:, None] == groups[None]) & (labels[:, None] != labels[None])
    i, j = torch.nonzero(torch.triu(same, diagonal=1), as_tuple=True)
    return i, j


def register_loss(registers, batch: StateBatch) -> Tensor:
    from flowalign.reward_models.latent_registers import thurstone_loss

    scores = registers.features_to_scores(batch.features, batch.sigma)[:, 0]
    i, j = pair_index(batch.label, batch.group)
    labels, sigma = batch.label.to(scores.device).float(), batch.sigma.to(scores.device)
    i, j = i.to(scores.device), j.to(scores.device)
    return thurstone_loss(scores[i], scores[j], labels[i], labels[j], sigma[i], sigma[j])


@torch.no_grad()
def evaluate_registers(registers, batch: StateBatch) -> dict:
    """Pairwise accuracy per sigma band of the registers (and of the x0-projection baseline when collected)."""
    from flowalign.reward_models.latent_registers import pairwise_accuracy

    scores = registers.features_to_scores(batch.features, batch.sigma)[:, 0].cpu()
    out = {"registers": pairwise_accuracy(scores, batch.label, batch.group, batch.sigma.cpu())}
    if batch.x0_reward is not None:
        out["x0_projection"] = pairwise_accuracy(batch.x0_reward, batch.label, batch.group, batch.sigma.cpu())
    return out


def selection_score(accuracy: dict[str, dict]) -> float:
    """The validation score that picks the kept iteration: the unweighted mean of the bands' pairwise accuracies
    (so the high-noise bands, where pairs are hardest, count as much as the clean ones)."""
    values = [entry["accuracy"] for entry in accuracy.values() if not math.isnan(entry["accuracy"])]
    return sum(values) / len(values) if values else math.nan


def format_accuracy(report: dict) -> str:
    from flowalign.reward_models.latent_registers import SIGMA_BANDS

    methods = list(report)
    lines = ["| sigma band | pairs | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    for label, _, _ in SIGMA_BANDS:
        pairs = report[methods[0]][label]["pairs"]
        cells = [f"{report[m][label]['accuracy']:.3f}" for m in methods]
        lines.append(f"| {label} | {pairs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_registers(config: RegisterTrainConfig) -> dict:
    """Train, evaluate on held-out prompts, save the checkpoint (with the report) next to ``report.json``."""
    from flowalign.errors import setup_phase

    with setup_phase():  # the user's mistakes, up to a loaded model, are reported as such (exit 2 on the CLI)
        model, reward_fn, train_meta, val_meta, eval_meta, device = _set_up(config)
    return _train_registers(config, model, reward_fn, train_meta, val_meta, eval_meta, device)


def _set_up(config: RegisterTrainConfig):
    """Check the config, read the prompt splits, build the reward and load the model (all the user's to fix)."""
    from flowalign.evaluation.geneval import load_metadata
    from flowalign.evaluation.toy_eval import default_prompts_path
    from flowalign.lora_loading import resolve_model_path
    from flowalign.models.loading import load_flow_model
    from flowalign.rewards import build_reward
    from flowalign.seeding import numpy_rng
    from flowalign.toy.prompts import PROMPT_ASSET_DIR

    config.validate()
    train_meta = load_metadata(config.prompts or Path(PROMPT_ASSET_DIR) / "train.jsonl")
    eval_meta = load_metadata(config.eval_prompts or default_prompts_path())[: config.eval_prompt_count]
    if config.val_prompt_count >= len(train_meta):
        raise ValueError(f"val_prompt_count = {config.val_prompt_count} leaves no training prompts out of "
                         f"{len(train_meta)}; lower it (0 keeps the last iteration without validation)")
    held = set(numpy_rng(config.seed, 11).choice(len(train_meta), size=config.val_prompt_count, replace=False).tolist())
    val_meta = [m for i, m in enumerate(train_meta) if i in held]
    train_meta = [m for i, m in enumerate(train_meta) if i not in held]
    kwargs = {"partial_credit": config.partial_credit} if config.reward == "toy_geneval" else {}
    reward_fn = build_reward(config.reward, **kwargs)
    device = str(resolve_device(config.device))
    model = load_flow_model(resolve_model_path(config.model), device=device)
    return model, reward_fn, train_meta, val_meta, eval_meta, device


def _train_registers(config: RegisterTrainConfig, model, reward_fn, train_meta, val_meta, eval_meta, device) -> dict:
    from flowalign.reward_models.latent_registers import LatentRegisters
    from flowalign.seeding import numpy_rng

    model.transformer.requires_grad_(False)
    torch.manual_seed(config.seed)
    registers = LatentRegisters.for_transformer(model.transformer, heads=[config.reward], taps=config.taps,
                                                num_registers=config.num_registers, width=config.width).to(device)
    registers.attach(model.transformer)
    optimizer = torch.optim.AdamW(registers.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    collect = dict(samples_per_prompt=config.samples_per_prompt, steps=config.steps, noise_level=config.noise_level)

    def states(metadata, seed_key, baseline_x0=False) -> StateBatch:
        batch = collect_states(model, registers, metadata, reward_fn, seed_key=seed_key, baseline_x0=baseline_x0,
                               **collect)
        batch.features = [f.to(device) for f in batch.features]
        batch.sigma = batch.sigma.to(device)
        return batch

    validation = states(val_meta, (config.seed, 10**6 + 1)) if val_meta else None
    history, best = [], None  # best: (score, iteration, weights)
    for iteration in range(config.iterations):
        rng = numpy_rng(config.seed, iteration, 7)
        pick = rng.choice(len(train_meta), size=min(config.prompts_per_iteration, len(train_meta)), replace=False)
        batch = states([train_meta[i] for i in pick], (config.seed, iteration))
        for _ in range(config.updates_per_iteration):
            loss = register_loss(registers, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        record = {"iteration": iteration, "loss": float(loss.detach()), "reward": float(batch.final_rewards.mean())}
        last = iteration == config.iterations - 1
        if validation is not None and ((iteration + 1) % config.eval_every == 0 or last):
            record["val_score"] = selection_score(evaluate_registers(registers, validation)["registers"])
            score = -math.inf if math.isnan(record["val_score"]) else record["val_score"]  # no pairs: never preferred
            if best is None or score > best[0]:
                best = (score, iteration, copy.deepcopy(registers.state_dict()))
        history.append(record)
        shown = f", validation {record['val_score']:.3f}" if "val_score" in record else ""
        logger.info("registers iteration %d: thurstone loss %.4f%s", iteration, record["loss"], shown)
    if best is not None:
        registers.load_state_dict(best[2])
    selected = best[1] if best is not None else config.iterations - 1
    held_out = states(eval_meta, (config.seed, 10**6), baseline_x0=config.baseline_x0)
    report = evaluate_registers(registers, held_out)
    registers.detach()
    summary = {"held_out": report, "selected_iteration": selected, "history": history}
    out = registers.save(config.out, extra={"config": asdict(config), **summary})
    table = format_accuracy(report)
    (out.parent / "report.json").write_text(json.dumps(summary, indent=1))
    chosen = (f"Weights of iteration {selected} (best validation score on {len(val_meta)} held-back training "
              f"prompts, evaluated every {config.eval_every} iterations)." if best is not None else
              f"Weights of the last iteration ({selected}).")
    (out.parent / "report.md").write_text("# Register pairwise accuracy on held-out prompts\n\n" + table + "\n\n"
                                          + chosen + "\n")
    logger.info("%s", table)
    logger.info("%s", chosen)
    return {**summary, "checkpoint": str(out)}
