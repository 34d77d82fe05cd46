"""The schema of ``flowalign train``: GRPO fine-tuning of a flow-matching text-to-image model.

Defaults are the toy-world default run. Load with ``load_config(TrainConfig, path, overrides)`` (flowalign.config),
which checks keys and types and then runs the ``validate`` methods below: each section checks its own ranges, and
``TrainConfig.validate`` checks what spans sections, including the batch arithmetic for one process. The trainer
calls ``check_batch(num_processes)`` again once it knows how many processes it runs on.

The rollout shape, the credit estimator, the step selection and weighting, the loss terms and the objectives are
registered components (``flowalign.components``): each section names one (``credit: {name: tree, fusion: mean}``) and
holds that component's settings, and each component checks what it needs of the rest of the config.

Vocabulary: a rollout samples ``group_size`` images for each of ``prompts_per_iteration`` prompts, in chunks of
``sampling.batch_size`` samples. Its stochastic (SDE) steps are the trainable ones; a *transition* is one
(sample, trained step) pair. The training forward pass runs on *micro-batches* of one rollout chunk at one step: the
same batch composition as the rollout's own forward, so the first recomputed log-prob ratio is exactly 1. Each inner
epoch shuffles the trained steps and splits them into ``optim.minibatches`` equal shares; a minibatch is its share
of steps over all samples (on every process), one optimizer step each, with the gradients accumulated over its
micro-batches. Splitting by steps rather than samples keeps the updates independent of the process count.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from flowalign.components import REFERENCE_POLICY
from flowalign.config import ConfigError, names
from flowalign.settings import at_least as _at_least, check as _check, finite as _finite, option, section
from flowalign.training.batch_layout import BatchLayout, batch_layout
from flowalign.training.kinds import Components, component_sections

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DataConfig",
    "SamplingConfig",
    "RewardSpec",
    "RewardConfig",
    "AdvantageConfig",
    "OptimConfig",
    "RunConfig",
    "BatchLayout",
]


# The packages a tracker logs through, any one of which will do (accelerate's own choice for tensorboard).
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}


def _installed(package: str) -> bool:
    """Whether ``package`` can be imported, found without importing it (an entry of None in ``sys.modules``, Python's
    way to block an import, counts as absent)."""
    import importlib.util

    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules with no __spec__
        return True


# ------------------------------------------------------------------------------------------------ sections


@dataclass
class ModelConfig:
    """Which model to fine-tune, in which precision, and the LoRA adapter trained on it."""

    resumable: ClassVar[tuple[str, ...]] = ("kernels",)  # the same math on either backend

    path: str = option("assets/toy-sd3", "model directory (diffusers layout) or hub id")
    family: str | None = option(None, "model family (a registered adapter: sd3, flux, ...); null = detect from the "
                                "model's files")
    dtype: Literal["fp32", "bf16", "fp16"] = option("fp32", "dtype of the frozen base weights")
    mixed_precision: Literal["no", "bf16", "fp16"] = option("no", "autocast dtype for forward passes; no = off")
    finetune: Literal["lora", "full"] = option(
        "lora", "what trains: a LoRA adapter on frozen weights, or every transformer weight (full: fp32 master "
        "weights, a frozen copy of the base as the reference policy)")
    reference_offload: bool = option(False, "full fine-tuning: keep the frozen reference copy on the CPU between "
                                            "reference passes (moved to the device for each); under FSDP2 its shards "
                                            "stay in CPU memory (FSDP2's CPU offload)")
    lora_rank: int = option(8, "LoRA rank")
    lora_alpha: float = option(16.0, "LoRA alpha (the update is scaled by alpha / rank)")
    lora_targets: list[str] | None = option(None, "module names LoRA wraps; null = the model family's defaults")
    lora_experts: list[str] | None = option(
        None, "models with several experts (Wan2.2 A14B): the experts the LoRA trains, from [high, low] (high: "
        "transformer, the high-noise expert; low: transformer_2); null = every expert")
    guidance_scale_2: float | None = option(
        None, "models with two experts (Wan2.2 A14B): the low-noise expert's CFG scale (the pipeline's "
        "guidance_scale_2); null = sampling.guidance_scale")
    gradient_checkpointing: bool = option(False, "recompute transformer activations in backward to save memory")
    vae_batch: int | None = option(None, "video models: videos per VAE call when decoding (and encoding) a batch, so "
                                         "the VAE holds at most vae_batch x sampling.num_frames frames at once; null "
                                         "= the adapter's default (1); image models refuse it")
    vae_tiling: bool = option(False, "video models: decode and encode with the VAE's own spatial tiling "
                                     "(vae.enable_tiling()); image models refuse it")
    attention: Literal["sdpa", "xformers"] = option("sdpa", "attention kernel")
    kernels: Literal["auto", "triton", "torch"] = option(
        "auto", "SDE step and GRPO loss: fused Triton kernels (CUDA), the torch reference, or auto = Triton on CUDA "
        "when triton is installed, torch otherwise; auto defers to the FLOWALIGN_KERNELS environment variable"
    )
    max_sequence_length: int | None = option(None, "text tokens kept per prompt; null = the model's default")

    def validate(self) -> None:
        if self.family is not None:
            from flowalign.models.base import MODEL_FAMILIES

            close = MODEL_FAMILIES.closest(self.family) if self.family not in MODEL_FAMILIES else None
            _check(self.family in MODEL_FAMILIES, "model.family",
                   f"= {self.family!r} is not a registered model family; known: {', '.join(MODEL_FAMILIES.names())}"
                   + (f"; did you mean {close!r}?" if close else ""))
        _at_least("model.lora_rank", self.lora_rank, 1)
        _finite("model.lora_alpha", self.lora_alpha, 0.0, strict=True)
        if self.lora_targets is not None:
            _check(len(self.lora_targets) > 0, "model.lora_targets", "must list at least one module (or be null)")
            _check(all(self.lora_targets), "model.lora_targets", f"has an empty module name: {self.lora_targets}")
        if self.lora_experts is not None:
            from flowalign.models.wan_experts import check_expert_names

            try:
                check_expert_names(self.lora_experts)
            except ValueError as error:
                raise ConfigError(str(error), key="model.lora_experts") from None
            _check(self.finetune == "lora", "model.lora_experts",
                   "chooses the experts a LoRA trains; with model.finetune = 'full' every weight of every expert "
                   "trains: drop model.lora_experts")
        if self.guidance_scale_2 is not None:
            _finite("model.guidance_scale_2", self.guidance_scale_2, 0.0, strict=True)
        _at_least("model.max_sequence_length", self.max_sequence_length, 1)
        _at_least("model.vae_batch", self.vae_batch, 1)
        _check(self.finetune == "full" or not self.reference_offload, "model.reference_offload",
               "= true offloads a full fine-tune's reference copy; with model.finetune = 'lora' the reference is the "
               "LoRA-disabled model itself: set model.finetune: full, or drop reference_offload")
        _check(self.finetune == "lora" or self.dtype == "fp32" or self.mixed_precision != "no",
               "model.mixed_precision",
               f"= 'no' with model.finetune = 'full' and model.dtype = {self.dtype!r}: a full fine-tune trains fp32 "
               f"master weights, so {self.dtype} compute needs autocast: set model.mixed_precision: {self.dtype}")
        _check(
            self.dtype == "fp32" or self.mixed_precision in ("no", self.dtype),
            "model.mixed_precision",
            f"= {self.mixed_precision!r} contradicts model.dtype = {self.dtype!r}: with reduced-precision weights "
            "use the same autocast dtype, or 'no'",
        )


@dataclass
class DataConfig:
    """Where the prompts come from and how many images a rollout makes."""

    train_prompts: str = option("assets/prompts/train.jsonl", "training prompts: .txt (one prompt a line) or .jsonl "
                                "({prompt, ...} a line; GenEval metadata for the GenEval rewards; images: condition "
                                "image paths, relative to the file, for an editing model)")
    eval_prompts: str = option("assets/prompts/test.jsonl", "held-out prompts for the evaluation at the end")
    prompts_per_iteration: int = option(4, "distinct prompts per rollout, over all processes")
    group_size: int = option(16, "images per prompt; advantages compare images within a group")
    prompt_sampling: Literal["tag_balanced", "uniform"] = option(
        "uniform",
        "draw each iteration's prompts with every prompt equally likely, or with every metadata 'tag' equally likely "
        "(tag_balanced: GenEval's overall is the unweighted mean of its tags); prompts without a tag form one group",
    )

    def validate(self) -> None:
        _at_least("data.prompts_per_iteration", self.prompts_per_iteration, 1)
        _check(
            self.group_size >= 2,
            "data.group_size",
            f"must be >= 2 (GRPO compares the images of one prompt with each other), got {self.group_size}",
        )


@dataclass
class SamplingConfig:
    """How rollouts are sampled: the SDE, which steps are stochastic (and so trained), and at what noise level."""

    num_steps: int = option(10, "denoising steps per rollout")
    kind: str = option("flow_grpo", "SDE used on the stochastic steps: flow_grpo, dance, cps, or a kind registered "
                       "with flowalign.samplers.register_sde_kind")
    noise_level: float = option(0.7, "noise level of the stochastic steps (0 = ODE); at most 1 for cps")
    noise_table: list[float] | None = option(
        None, "one noise level per step (0 = ODE step), used as given; overrides noise_level"
    )
    window_size: int | None = option(2, "number of consecutive SDE steps; null = every step but the last")
    window_start: Literal["fixed", "random", "sliding"] = option(
        "random",
        "where the SDE window starts: window_first (fixed), uniform in window_first..window_last for each rollout "
        "(random, Flow-GRPO-Fast), or moving from window_first to window_last over training (sliding, MixGRPO)",
    )
    window_first: int = option(0, "first (or only) step the SDE window may start at")
    window_last: int | None = option(
        4, "last step the window may start at (random/sliding); null = the latest that fits"
    )
    guidance_scale: float = option(1.0, "classifier-free guidance scale; 1 = no guidance")
    cfg_gradient: Literal["both", "conditional"] = option(
        "both", "with CFG in training (guidance_scale > 1): the policy loss backpropagates through both branches of the "
        "guided velocity (both: flow_grpo's current train_sd3.py) or through the conditional one only, the "
        "unconditional prediction detached (conditional: its train_sd3.py of July 2025)")
    shared_noise: bool = option(False, "give the images of a group the same initial noise")
    image_size: int | None = option(None, "image height and width in pixels; null = the model's default")
    num_frames: int | None = option(None, "video models: frames per sampled video (the VAE's kt+1 counts, e.g. 5, "
                                          "9, 81 for Wan); null = the family's default; image models refuse it")
    max_latent_elements: int | None = option(
        None, "memory budget: the most latent elements one micro-batch may hold (its rows x C x f x h x w, from the "
        "model's config files), checked before the model loads; null = no budget")
    log_prob_reduce: Literal["mean", "sum"] = option("mean", "how a transition's log-prob reduces over latent dims")
    batch_size: int | None = option(None, "rollout forward batch per process; null = the whole local batch at once")
    base_tail_steps: int = option(
        0, "the last this many steps of every rollout are taken by the base model (the LoRA disabled), as MixGRPO's "
        "inference does; they must be ODE steps (never trained); 0 = none")

    def base_levels(self) -> list[float]:
        """Levels before any window: the table, or the constant level with the last step an ODE step."""
        if self.noise_table is not None:
            return list(self.noise_table)
        return [self.noise_level] * (self.num_steps - 1) + [0.0]

    def noise_schedule(self):
        """The rollouts' noise schedule (``flowalign.samplers.noise_schedule``), which owns the window arithmetic."""
        from flowalign.samplers import noise_schedule

        return noise_schedule(self.noise_schedule_spec())

    def _stochastic_step_sets(self) -> list[set[int]]:
        """The stochastic steps of every rollout the schedule can make (one set per SDE window start)."""
        return self.noise_schedule().stochastic_step_sets(self.base_levels(), self.num_steps)

    def _stochastic_counts(self) -> set[int]:
        return {len(steps) for steps in self._stochastic_step_sets()}

    def stochastic_steps(self) -> int:
        """How many steps of a rollout are stochastic (the same for every rollout of a valid config)."""
        return min(self._stochastic_counts())

    def noise_schedule_spec(self) -> dict[str, Any]:
        """The dict ``flowalign.samplers.noise_schedule`` builds the schedule from."""
        spec: dict[str, Any] = (
            {"table": list(self.noise_table)} if self.noise_table is not None else {"level": self.noise_level}
        )
        if self.window_size is not None:
            spec.update(window=self.window_size, window_start=self.window_start, window_first=self.window_first)
            if self.window_last is not None:
                spec["window_last"] = self.window_last
        return spec

    def validate(self) -> None:
        n = self.num_steps
        _at_least("sampling.num_steps", n, 1)
        from flowalign.samplers import sde_kind  # the registry of SDE kinds, with a did-you-mean

        try:
            high = sde_kind(self.kind).max_noise_level
        except ValueError as error:
            raise ConfigError(f"sampling.kind: {error}", key="sampling.kind") from None
        note = f" for kind {self.kind!r}" if high is not None else ""
        _finite("sampling.noise_level", self.noise_level, 0.0, high=high, note=note)
        if self.noise_table is not None:
            size = len(self.noise_table)
            message = f"has {size} entries but sampling.num_steps = {n}: give one level per step"
            _check(size == n, "sampling.noise_table", message)
            for i, level in enumerate(self.noise_table):
                _finite(f"sampling.noise_table[{i}]", level, 0.0, high=high, note=note)
        self._validate_window()
        _finite("sampling.guidance_scale", self.guidance_scale, 0.0)
        _check(self.cfg_gradient == "both" or self.guidance_scale > 1, "sampling.cfg_gradient",
               f"= {self.cfg_gradient!r} chooses the gradient of CFG in training, but sampling.guidance_scale = "
               f"{self.guidance_scale:g} (no CFG): set sampling.guidance_scale > 1, or drop it")
        _at_least("sampling.image_size", self.image_size, 1)
        _at_least("sampling.num_frames", self.num_frames, 1)
        _at_least("sampling.max_latent_elements", self.max_latent_elements, 1)
        _at_least("sampling.batch_size", self.batch_size, 1)
        self._validate_base_tail()

        counts = self._stochastic_counts()
        _check(
            len(counts) == 1,
            "sampling.noise_table",
            f"has zero entries where the SDE window can start, so rollouts would have {sorted(counts)} stochastic "
            "steps depending on the window position: make the table positive over the window's range",
        )

    def check_trainable(self) -> None:
        """A run with loss terms trains the stochastic steps: there must be one (an ODE rollout trains nothing; it
        serves objectives on rollouts, which need no transition)."""
        source = "sampling.noise_table" if self.noise_table is not None else "sampling.noise_level"
        _check(self.stochastic_steps() > 0, source,
               "leaves no stochastic step: every step is ODE and nothing would be trained (an ODE rollout serves "
               "only objectives on rollouts, with no loss term: loss.grpo=null)")

    def possibly_stochastic_steps(self) -> set[int]:
        """Steps that are stochastic in some rollout (wherever the SDE window starts)."""
        return set().union(*self._stochastic_step_sets())

    def _validate_base_tail(self) -> None:
        tail, n = self.base_tail_steps, self.num_steps
        _check(isinstance(tail, int) and not isinstance(tail, bool) and 0 <= tail < n, "sampling.base_tail_steps",
               f"must be an integer in 0..{n - 1} (sampling.num_steps - 1), got {tail!r}")
        if tail:
            trained = sorted(s for s in self.possibly_stochastic_steps() if s >= n - tail)
            _check(not trained, "sampling.base_tail_steps",
                   f"= {tail} hands steps {n - tail}..{n - 1} to the base model, but steps {trained} are stochastic "
                   "(trained) in some rollout, and a trained step's log-prob must come from the policy: shorten the "
                   "tail or end the SDE window earlier")

    def always_stochastic_steps(self) -> set[int]:
        """Steps that are stochastic wherever the SDE window starts (the only steps a tree may split at)."""
        return set.intersection(*self._stochastic_step_sets())

    def _validate_window(self) -> None:
        n = self.num_steps
        if self.window_size is None:
            for key, value, default in (
                ("window_start", self.window_start, "fixed"),
                ("window_first", self.window_first, 0),
                ("window_last", self.window_last, None),
            ):
                _check(value == default, f"sampling.{key}", f"= {value!r} needs sampling.window_size to be set")
            return
        _check(
            1 <= self.window_size <= n - 1,
            "sampling.window_size",
            f"must be in 1..{n - 1} (sampling.num_steps - 1: the last step is always ODE), got {self.window_size}",
        )
        from flowalign.samplers.schedules import SDEWindow

        latest = SDEWindow(0.0, self.window_size).latest_start(n)
        fits = f"a window of {self.window_size} steps in a {n}-step rollout can start at 0..{latest}"
        _check(0 <= self.window_first <= latest, "sampling.window_first", f"= {self.window_first} does not fit: {fits}")
        if self.window_last is not None:
            _check(
                self.window_start != "fixed",
                "sampling.window_last",
                "is only used with sampling.window_start 'random' or 'sliding' (a fixed window starts at window_first)",
            )
            _check(
                self.window_first <= self.window_last <= latest,
                "sampling.window_last",
                f"= {self.window_last} must be in sampling.window_first..{latest} = {self.window_first}..{latest}: "
                f"{fits}",
            )


@dataclass
class RewardSpec:
    """One reward model and its weight in the total reward."""

    name: str = names("flowalign.rewards:REWARDS", option(
        "toy_geneval", "registered reward name, or a class of your own: module.path:Class or path/to/file.py:Class"))
    weight: float = option(1.0, "weight of this reward in the combination")
    kwargs: dict[str, Any] = option({}, "keyword arguments for the reward's constructor")
    frames: dict[str, Any] | None = option(
        None, "video models: score an image reward over a video's frames, {aggregate: mean|min|weights, weights: "
        "[...], every: k | count: n} (flowalign.reward_models.frames); null = the reward's own input")


@dataclass
class RewardConfig:
    """The rewards and how they are combined."""

    rewards: list[RewardSpec] = option(
        [RewardSpec(kwargs={"partial_credit": True})], "reward models, each {name, weight, kwargs, frames}"
    )
    combine: Literal["sum_then_normalize", "normalize_then_sum", "gdpo"] = option(
        "sum_then_normalize",
        "weight-sum the raw rewards and then normalize within groups; or normalize each reward first (population std "
        "+ 1e-4), sum, and normalize the sum within groups again; or gdpo (GDPO, flowalign.gdpo): normalize each "
        "reward within its group with reward.gdpo_variant's rule, sum, and renormalize over the batch. gdpo's output "
        "is the final advantage: only advantage.clip follows (advantage.std does not apply), and only credit.name "
        "group takes it",
    )
    gdpo_variant: Literal["nvlabs", "flow_factory", "pref_grpo"] = option(
        "nvlabs", "reward.combine gdpo: whose rule (flowalign.gdpo): nvlabs (unbiased stds + 1e-4; one reward falls "
        "back to GRPO), flow_factory (population stds floored at 1e-6), pref_grpo (unbiased stds + 1e-8)")
    gdpo_aggregation: Literal["gdpo", "sum"] = option(
        "gdpo", "reward.combine gdpo: gdpo (per-reward group normalization, then the batch step) or sum (the variant's "
        "GRPO rule: no batch step; pref_grpo's --apply_gdpo off)")
    gdpo_scale_rewards: bool = option(
        True, "reward.combine gdpo, variant nvlabs, GRPO rule: divide by the group std (false: subtract the mean only)")
    gdpo_global_std: bool = option(
        True, "reward.combine gdpo, variant flow_factory, aggregation sum: the std over the batch (false: the group's)")
    max_invalid_fraction: float = option(
        1.0, "stop the run with an error when more than this fraction of an iteration's samples has an invalid "
        "reward (NaN: a remote reward whose request failed, a judge's unparseable answer); 1 = never stop. Invalid "
        "samples are always masked out of the advantages and counted (reward_invalid)")
    skip_invalid_fraction: float = option(
        1.0, "skip the iteration's update (no optimizer step; logged as skipped) when more than this fraction of its "
        "samples has an invalid reward; 1 = never for this reason (an iteration with no valid sample skips anyway: "
        "every group has zero variance)")
    overlap: bool = option(
        False, "decode and score each rollout chunk on a worker thread while the next chunk rolls out (one call of "
        "each reward per chunk instead of one per iteration: the same scores for rewards that score each image on "
        "its own, bit for bit)")

    resumable: ClassVar[tuple[str, ...]] = ("max_invalid_fraction",)  # a stop rule: no math

    def validate(self) -> None:
        _check(len(self.rewards) > 0, "reward.rewards", "must list at least one reward")
        for i, spec in enumerate(self.rewards):
            _check(bool(spec.name), f"reward.rewards[{i}].name", "must not be empty")
            _check(math.isfinite(spec.weight), f"reward.rewards[{i}].weight", f"must be finite, got {spec.weight}")
            if spec.frames is not None:  # its form; whether it fits the model: rewards.check_reward_modality
                from flowalign.reward_models.frames import parse_frames

                parse_frames(spec.frames, f"reward.rewards[{i}].frames")
        if self.combine == "gdpo" and self.gdpo_variant == "nvlabs" and len(self.rewards) == 1 and (
                self.gdpo_aggregation == "gdpo"):
            raise ConfigError(
                "reward.combine = 'gdpo' with one reward and reward.gdpo_variant = 'nvlabs': the released code only "
                "applies GDPO with more than one reward and falls back to GRPO; set reward.gdpo_aggregation: sum to "
                "ask for that GRPO rule, add a reward, or use reward.gdpo_variant flow_factory or pref_grpo (which "
                "still normalise over the batch)", key="reward.gdpo_aggregation")
        for key in ("max_invalid_fraction", "skip_invalid_fraction"):
            value = getattr(self, key)
            _check(math.isfinite(value) and 0.0 <= value <= 1.0, f"reward.{key}", f"must be in [0, 1], got {value}")


@dataclass
class AdvantageConfig:
    """How rewards become advantages."""

    std: Literal["group", "global"] = option("group", "divide by the std of the prompt's group or of the whole batch")
    clip: float = option(5.0, "clip advantages to [-clip, clip]; .inf = no clipping")

    def validate(self) -> None:
        _finite("advantage.clip", self.clip, 0.0, strict=True, high=math.inf)


@dataclass
class OptimConfig:
    """AdamW on the LoRA weights, and how each rollout's transitions are cut into optimizer steps."""

    lr: float = option(5e-4, "learning rate")
    weight_decay: float = option(1e-4, "AdamW weight decay")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    eps: float = option(1e-8, "AdamW epsilon")
    max_grad_norm: float = option(1.0, "clip the gradient norm to this")
    inner_epochs: int = option(1, "passes over each rollout's transitions")
    minibatches: int = option(1, "optimizer steps per inner epoch: the transitions are split into this many parts")
    minibatch_split: Literal["steps", "samples"] = option(
        "steps", "what a minibatch is a share of: the trained steps, at every sample (steps: minibatches must divide "
        "the trained steps), or the samples, at every trained step (samples: flow_grpo's released train_sd3.py, whose "
        "num_batches_per_epoch / gradient_accumulation_steps optimizer steps per epoch are minibatches here; the "
        "rollout chunks per process, samples / sampling.batch_size, must be a multiple of minibatches)")
    ema_decay: float = option(
        0.99, "EMA of the LoRA weights, updated every optimizer step (used for sampling grids and eval); 0 = no EMA")
    warmup_iterations: int = option(0, "linear learning-rate warmup, in iterations")
    lr_schedule: Literal["constant", "cosine"] = option(
        "constant", "after the warmup: a constant rate, or a cosine decay to min_lr_ratio x lr at train.iterations")
    min_lr_ratio: float = option(0.0, "the cosine schedule's final rate as a fraction of lr, in [0, 1]")

    def validate(self) -> None:
        _finite("optim.lr", self.lr, 0.0, strict=True)
        _finite("optim.weight_decay", self.weight_decay, 0.0)
        _check(len(self.betas) == 2, "optim.betas", f"must hold two numbers, got {self.betas}")
        for i, beta in enumerate(self.betas):
            _check(0.0 <= beta < 1.0, f"optim.betas[{i}]", f"must be in [0, 1), got {beta:g}")
        _finite("optim.eps", self.eps, 0.0, strict=True)
        _finite("optim.max_grad_norm", self.max_grad_norm, 0.0, strict=True)
        _at_least("optim.inner_epochs", self.inner_epochs, 1)
        _at_least("optim.minibatches", self.minibatches, 1)
        _check(0.0 <= self.ema_decay < 1.0, "optim.ema_decay", f"must be in [0, 1), got {self.ema_decay:g}")
        _at_least("optim.warmup_iterations", self.warmup_iterations, 0)
        _check(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio:g}")


@dataclass
class RunConfig:
    """Length of the run, logging, checkpoints and the final evaluation."""

    # Settings a resumed run may change: none changes an update (train.iterations is checked on its own: it may
    # change only when no feature depends on the run's progress).
    resumable: ClassVar[tuple[str, ...]] = (
        "resume", "iterations", "eval_at_end", "log_every", "sample_every", "tracker", "eval_images_per_tag",
        "eval_images_per_prompt", "eval_steps", "eval_guidance", "eval_seed", "keep_checkpoints", "checkpoint_every",
        "out_dir", "overwrite", "restart_ema", "video_fps", "strip_frames", "project", "run_name", "wandb_entity",
        "threads")

    iterations: int = option(330, "training iterations (one rollout and its optimizer steps each)")
    seed: int = option(0, "random seed")
    threads: int | None = option(
        None, "torch's intra-op CPU threads; null = auto: torch's count lowered to the CPUs free to the process (its "
        "CPU affinity and cgroup CPU quota), or left as OMP_NUM_THREADS set it (flowalign.training.threads). On a "
        "machine shared without quotas, 1 avoids spinning OpenMP threads"
    )
    out_dir: str = option("outputs/train", "where logs, sample grids, checkpoints and the resolved config go")
    log_every: int = option(1, "log metrics every this many iterations")
    sample_every: int = option(10, "save a sample grid every this many iterations; 0 = never")
    video_fps: float | None = option(None, "a video model's sample grid mp4 frame rate; null = the model's fps, else 16")
    strip_frames: int = option(8, "frames in each frame strip of a video model's sample grid PNG, evenly spaced from "
                               "first to last; 0 = all")
    checkpoint_every: int = option(50, "save a checkpoint every this many iterations; 0 = only at the end")
    keep_checkpoints: int = option(2, "how many of the latest checkpoints to keep")
    eval_at_end: bool = option(True, "evaluate on data.eval_prompts after training")
    eval_images_per_tag: int | None = option(
        None,
        "images per tag in the final evaluation, split evenly over the tag's prompts (GenEval's overall is the "
        "unweighted mean of tags, so equal tag sizes minimise its standard error); null = by the run: 528 for a run "
        "of at least 50 iterations started from the command line (the default run's), 24 for a shorter one or a run "
        "started from Python",
    )
    eval_images_per_prompt: int | None = option(
        None, "images per prompt in the final evaluation instead of train.eval_images_per_tag; null = per tag"
    )
    eval_steps: int = option(10, "ODE steps per image in the final evaluation")
    eval_guidance: float | None = option(
        None, "classifier-free guidance scale of the final evaluation; null = sampling.guidance_scale (the run is "
        "judged as it samples)")
    eval_seed: int | None = option(
        None, "seed of the final evaluation's samples; null = train.seed + 10000. With train.resume pointing at a "
        "finished run's last checkpoint, only the evaluation runs: a re-reading on other seeds"
    )
    tracker: Literal["tensorboard", "wandb", "none"] = option(
        "tensorboard", "where metrics, sample grids and the before/after evaluation are logged")
    project: str = option("flowalign", "the tracker's project (wandb's project)")
    run_name: str | None = option(None, "the run's name in the tracker: wandb's run name; TensorBoard's events go to "
                                  "<train.out_dir>/flowalign/<run_name>; null = the tracker's own")
    wandb_entity: str | None = option(None, "wandb's entity (a user or team) the run is logged under; null = the "
                                      "logged-in user's default")
    resume: str | None = option(None, "checkpoint directory to resume from (or latest: train.out_dir's newest); its "
                                "config must match this one")
    overwrite: bool = option(
        False, "start a new run in a train.out_dir that already holds one, deleting that run's files (its checkpoints "
        "and the files it recorded in run-files.jsonl, nothing else) once the new run's inputs are checked (without "
        "it, such a run is refused)"
    )
    restart_ema: bool = option(
        False, "resume (train.resume) a checkpoint that holds no EMA (a deleted ema.safetensors, or a run without "
        "optim.ema_decay) with a fresh EMA that starts from the resumed weights; without it such a resume is refused, "
        "naming the missing file. A checkpoint that holds its EMA resumes it whatever this says"
    )

    def validate(self) -> None:
        for name, low in (
            ("iterations", 1),
            ("seed", 0),
            ("log_every", 1),
            ("sample_every", 0),
            ("checkpoint_every", 0),
            ("keep_checkpoints", 1),
            ("eval_images_per_tag", 1),
            ("eval_images_per_prompt", 1),
            ("eval_steps", 1),
            ("eval_seed", 0),
            ("strip_frames", 0),
            ("threads", 1),
        ):
            _at_least(f"train.{name}", getattr(self, name), low)
        if self.eval_guidance is not None:
            _finite("train.eval_guidance", self.eval_guidance, 0.0)
        if self.video_fps is not None:
            from flowalign.evaluation.videos import check_fps

            try:
                check_fps(self.video_fps, "train.video_fps")
            except ValueError as error:
                raise ConfigError(str(error), key="train.video_fps") from None
        _check(self.run_name is None or (bool(re.fullmatch(r"[\w.-]+", self.run_name))
                                         and self.run_name not in (".", "..")), "train.run_name",
               f"= {self.run_name!r} names a folder of the run's tracker: letters, digits, '_', '-' and '.' only")
        packages = TRACKER_PACKAGES.get(self.tracker, ())
        _check(not packages or any(_installed(p) for p in packages), "train.tracker",
               f"= {self.tracker!r} needs the {packages[0] if packages else ''} package, which is not installed: "
               "install the tracking extra (pip install -e '.[tracking]'), or set train.tracker=none")


@dataclass
class CollapseConfig:
    """Collapse metrics logged every iteration (``flowalign.training.collapse``): within-group diversity of the
    samples, the fraction of saturated pixels, and the reward of a held-out reward model the run does not optimise."""

    resumable: ClassVar[tuple[str, ...]] = ("enabled", "embedding", "embedding_kwargs", "saturation_margin",
                                            "held_out", "held_out_kwargs")  # measurements: no math changes

    enabled: bool = option(True, "log collapse/* metrics every iteration")
    embedding: str = option("auto", "image embedding of the within-group diversity (flowalign.embeddings: auto = "
                            "toy_scene on the toy world, pixels elsewhere; clip, dreamsim)")
    embedding_kwargs: dict[str, Any] = option({}, "constructor arguments of the embedding (dreamsim: {path: DIR})")
    saturation_margin: float = option(
        1.0 / 255, "a pixel channel within this of 0 or 1 counts as saturated (1/255: the values 8-bit images round "
        "to 0 or 255)")
    held_out: str | None = option(
        "auto", "a registered reward the run does not optimise, logged as collapse/held_out/<name>; auto = on the toy "
        "world the exact (binary) toy_geneval when training on toy_geneval_soft or partial-credit toy_geneval, and "
        "toy_geneval_soft when training on the binary one; none otherwise; null = none")
    held_out_kwargs: dict[str, Any] = option({}, "constructor arguments of the held-out reward")

    def validate(self) -> None:
        _finite("collapse.saturation_margin", self.saturation_margin, 0.0, high=0.5)
        if self.enabled:
            from flowalign.embeddings import check_embedding

            check_embedding(self.embedding, self.embedding_kwargs, key="collapse.embedding")
        if self.held_out not in (None, "auto"):
            from flowalign.rewards import REWARDS

            close = REWARDS.closest(self.held_out) if self.held_out not in REWARDS else None
            _check(self.held_out in REWARDS, "collapse.held_out",
                   f"= {self.held_out!r} is not a registered reward; known: auto, null, {', '.join(REWARDS.names())}"
                   + (f"; did you mean {close!r}?" if close else ""))
        _check(self.held_out not in (None, "auto") or not self.held_out_kwargs, "collapse.held_out_kwargs",
               "are the constructor arguments of collapse.held_out: name a reward there")


@dataclass
class ContextParallelConfig:
    """Context parallelism: every sample's token sequence split over a group of ``ulysses * ring`` processes
    (``flowalign.training.context_parallel``, through diffusers' ``enable_parallelism``). The processes form a
    2D mesh, data x context: the context-parallel degree divides the process count, the data-parallel degree is the
    quotient, and the processes of one context group hold the same samples."""

    ulysses: int = option(
        1, "Ulysses (all-to-all) degree: each process attends over all tokens for num_heads / ulysses heads; the heads "
           "must divide by it")
    ring: int = option(
        1, "ring-attention degree: each process keeps its tokens' queries and attends to the others' keys and "
           "values in turn (needs an attention backend that returns the log-sum-exp: not on CPU)")

    @property
    def degree(self) -> int:
        """The context-parallel degree: how many processes share one sample's sequence (1: off)."""
        return self.ulysses * self.ring

    def validate(self) -> None:
        """Each degree >= 1 (the process count and the sequence lengths are checked at start-up)."""
        _at_least("distributed.context_parallel.ulysses", self.ulysses, 1)
        _at_least("distributed.context_parallel.ring", self.ring, 1)


@dataclass
class DistributedConfig:
    """How the model is laid out over the processes (``flowalign.training.parallel_engines``)."""

    # a sharded checkpoint resumes at another context-parallel layout as at another process count (DCP reshards)
    resumable: ClassVar[tuple[str, ...]] = ("context_parallel.ulysses", "context_parallel.ring")

    engine: Literal["ddp", "fsdp2"] = option(
        "ddp", "ddp: the whole model on every process, gradients all-reduced; fsdp2: parameters, gradients and "
        "optimizer state sharded per transformer block (FSDP2), sharded checkpoints that resume at any process count")
    reshard_after_forward: bool = option(
        True, "fsdp2: free each block's gathered weights after its forward (less memory, one more all-gather in "
              "the backward)")
    context_parallel: ContextParallelConfig = section(
        ContextParallelConfig, "context parallelism: each sample's sequence split over ulysses x ring processes "
                               "(off at 1 x 1)")
    activation_checkpointing: int = option(
        0, "selective activation checkpointing: recompute the activations of every N-th transformer block in the "
           "backward instead of keeping them (1 = every block, 2 = every other block, ...); 0 = off. Either engine; "
           "model.gradient_checkpointing is the same as 1 through diffusers")
    cpu_offload: bool = option(
        False, "fsdp2: keep the parameter, gradient and optimizer-state shards (and a full fine-tune's reference "
               "copy) in CPU memory, moved to the device block by block for each forward and backward; the optimizer "
               "steps on the CPU (FSDP2's CPUOffloadPolicy)")
    replicate: int = option(
        1, "fsdp2: HSDP, hybrid sharding: the processes form replicate x (processes / replicate) groups; each group "
           "of consecutive processes holds one sharded copy (set to the node count: shard within a node, replicate "
           "across nodes) and gradients are all-reduced across the copies; 1 = shard over all processes")

    def validate(self) -> None:
        _at_least("distributed.activation_checkpointing", self.activation_checkpointing, 0)
        _at_least("distributed.replicate", self.replicate, 1)
        for key, on in (("cpu_offload", self.cpu_offload), ("replicate", self.replicate > 1)):
            _check(self.engine == "fsdp2" or not on, f"distributed.{key}",
                   f"= {getattr(self, key)!r} is a setting of FSDP2: set distributed.engine: fsdp2, or drop it")

    def check_processes(self, num_processes: int) -> None:
        """The process count divides into the HSDP groups (``replicate``), checked once the count is known."""
        _check(num_processes % self.replicate == 0, "distributed.replicate",
               f"= {self.replicate} does not divide the {num_processes} processes: HSDP needs replicate x shard = "
               "the process count (set it to the node count)")


# ------------------------------------------------------------------------------------------------ the whole config


@dataclass
@component_sections(after="advantage")
class TrainConfig:
    """Everything ``flowalign train`` needs; see the module docstring for the vocabulary.

    Each field is a section of the YAML file and of the dotted overrides (``train.iterations=2``); the keys of every
    section are in the config reference (``docs/reference/config.md``, or ``flowalign train --help-config``).

    Args:
        model: the model and its LoRA adapter (``ModelConfig``).
        data: the prompts and the rollout's size (``DataConfig``).
        sampling: rollout sampling and the noise schedule (``SamplingConfig``).
        rollout: the rollout shape, a registered component: independent chains, branching trees or probed trunks.
        credit: the credit estimator, a registered component: how rewards become per-transition advantages.
        step_selection: which stochastic steps are trained each iteration (a registered component).
        step_weighting: the weight of each trained step's loss (a registered component).
        reward: the reward models and how their scores combine (``RewardConfig``).
        advantage: the advantage normalization (``AdvantageConfig``).
        loss: the loss terms on the rollout's transitions by name, summed; none (every term null) with an
            objective is an objective-only run.
        objectives: the losses on data units by name, interleaved into the minibatches.
        reference: the reference policy the KL terms read (a registered component).
        collapse: the collapse metrics: within-group diversity, saturated pixels, a held-out reward.
        optim: the optimizer and the minibatching (``OptimConfig``).
        train: run length, logging, checkpoints and evaluation (``RunConfig``).
        distributed: the distributed engine: DDP or FSDP2 sharding (``DistributedConfig``).
    """

    model: ModelConfig = section(ModelConfig, "the model and its LoRA adapter")
    data: DataConfig = section(DataConfig, "prompts and rollout size")
    sampling: SamplingConfig = section(SamplingConfig, "rollout sampling and noise schedule")
    reward: RewardConfig = section(RewardConfig, "reward models")
    advantage: AdvantageConfig = section(AdvantageConfig, "advantage normalization")
    # then one section per kind of component (flowalign.training.kinds.COMPONENT_KINDS): rollout, credit,
    # step_selection, step_weighting, loss, objectives, reference
    collapse: CollapseConfig = section(CollapseConfig, "collapse metrics: within-group diversity, saturated pixels, "
                                       "a held-out reward")
    optim: OptimConfig = section(OptimConfig, "optimizer and minibatching")
    train: RunConfig = section(RunConfig, "run length, logging, checkpoints, evaluation")
    distributed: DistributedConfig = section(DistributedConfig, "the distributed engine: DDP or FSDP2 sharding")

    @classmethod
    def migrate(cls, layer: Any) -> tuple[Any, list[str]]:
        """Keys of the schema before the component redesign, moved to their components (``flowalign.training.
        migration``).

        Args:
            layer: one layer of a config (a YAML file's mapping, or one override's).

        Returns:
            ``(the migrated layer, one notice per key moved)``.
        """
        from flowalign.training.migration import migrate_layer

        return migrate_layer(layer)

    def components(self) -> Components:
        """The registered parts this config names (``flowalign.training.kinds.COMPONENT_KINDS``), built from their
        settings.

        Returns:
            The built parts (cheap: nothing is loaded).
        """
        return Components.build(self)

    def noise_schedule_spec(self) -> dict[str, Any]:
        """The dict ``flowalign.samplers.noise_schedule`` accepts.

        Returns:
            The noise schedule's specification from the ``sampling`` section.
        """
        return self.sampling.noise_schedule_spec()

    def progress_dependent(self) -> list[str]:
        """The features that read the run's progress ``iteration / train.iterations``: with any of them on, a run
        resumed with another ``train.iterations`` would equal no uninterrupted run.

        Returns:
            One description per such feature that is on; empty when none is.
        """
        features = []
        if self.sampling.noise_schedule().reads_progress():
            features.append(f"sampling.window_start = {self.sampling.window_start!r} (the SDE window moves with the "
                            "run's progress)")
        for part in self.components().all():
            features.extend(part.progress_dependent())
        if self.optim.lr_schedule != "constant":
            features.append(f"optim.lr_schedule = {self.optim.lr_schedule!r}")
        return features

    def resumable_keys(self) -> list[str]:
        """The dotted keys a resumed run may change: what each section (``resumable`` of its class) and each
        component (``Component.resumable``) declares changes no math.

        Returns:
            The dotted keys (``train.iterations``, ``loss.grpo.KEY``, ...).
        """
        owners = [(f.name, getattr(self, f.name)) for f in fields(self) if hasattr(getattr(self, f.name), "resumable")]
        owners += list(self.components().named().items())
        return [f"{prefix}.{key}" for prefix, owner in owners for key in owner.resumable]

    def samples_per_prompt(self) -> int:
        """Final images per prompt: data.group_size, times the probe steps for probes.

        Returns:
            The number of final images per prompt.
        """
        return self.components().shape.samples_per_prompt(self.data.group_size)

    def check_batch(self, num_processes: int) -> BatchLayout:
        """Check that an iteration's samples and transitions split evenly over ``num_processes``; return the sizes
        (``flowalign.training.batch_layout``).

        Args:
            num_processes: the number of processes the run trains on.

        Returns:
            The ``BatchLayout``: the samples, transitions and micro-batches per process. A split that does not
            divide is a ``ConfigError`` naming the key to change.
        """
        return batch_layout(self, num_processes)

    def validate(self) -> None:
        """Cross-section checks; runs after every section's own ``validate``: each component checks what it needs
        of the other sections (``Component.check``), the credit the rollout shape it accepts."""
        parts = self.components()
        _check(bool(self.loss) or bool(self.objectives), "loss",
               "is empty and no objective is on, so nothing would be trained: keep a loss term (loss.grpo) or add "
               "an objective (objectives.flow_matching.data=toy, objectives.soar.data=toy) for an objective-only run")
        if self.loss:
            self.sampling.check_trainable()
        copies = [copy.name for part in parts.all() for copy in part.policy_copies()]
        clash = sorted({name for name in copies if copies.count(name) > 1})
        _check(not clash, "objectives", f"declare the policy copy {clash[0]!r} twice: use one of them"
               if clash else "")
        policy = parts.sampling_policy()
        _check(policy in (None, REFERENCE_POLICY, *copies), "objectives",
               f"sample the rollouts with the policy {policy!r}, which no component keeps as a copy")
        _check(not (self.sampling.base_tail_steps and policy == REFERENCE_POLICY), "sampling.base_tail_steps",
               "hands the rollout's last steps to the base model, but the rollouts already sample with the reference "
               "model (a component's sampling policy): drop it")
        parts.credit.check_shape(self)
        _check(self.reward.combine != "gdpo" or self.credit.name == "group", "reward.combine",
               f"= 'gdpo' gives the final advantages (normalised per reward and over the batch), but credit.name = "
               f"{self.credit.name!r} normalises the combined reward per group again: use credit.name group with gdpo, "
               "or reward.combine sum_then_normalize with this credit")
        for part in parts.all():
            part.check(self)
        for section, part in parts.named().items():
            missing = sorted(part.rollout_fields() - parts.shape.fields)
            _check(not missing, section if section != "rollout" else "rollout.name",
                   f"needs the rollout to keep {missing}, which rollout.name = {self.rollout.name!r} cannot store")
        _check(
            self.optim.warmup_iterations <= self.train.iterations,
            "optim.warmup_iterations",
            f"= {self.optim.warmup_iterations} exceeds train.iterations = {self.train.iterations}",
        )
        _check(not (self.model.gradient_checkpointing and self.distributed.activation_checkpointing),
               "distributed.activation_checkpointing",
               f"= {self.distributed.activation_checkpointing} with model.gradient_checkpointing = true: both "
               "checkpoint the transformer's blocks; keep one (model.gradient_checkpointing is every block)")
        self.check_batch(1)
