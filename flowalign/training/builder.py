"""How a trainer is built (``Trainer.__init__``): the checks that run before any model loads, its rewards (from the
registry, or callables given to it), its policy (the model with a LoRA adapter on frozen weights), the optimizer, EMA
and policy copies around it, and the checkpoint it resumes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from flowalign.config import to_dict
from flowalign.errors import SetupError
from flowalign.memory.checkpointing import checkpoint_blocks
from flowalign.models import FlowModel, load_flow_model
from flowalign.rewards import bind_reward_model, build_reward, is_groupwise
from flowalign.samplers import noise_schedule
from flowalign.training.checkpointer import Checkpointer
from flowalign.training.collapse import CollapseMetrics
from flowalign.training.copies import PolicyCopies
from flowalign.training.collectives import check_distributed_type, check_ranks_agree, launched_without_accelerator
from flowalign.training.context_parallel import DataParallelView, check_context_parallel, enable_context_parallel
from flowalign.training.ema import EMA
from flowalign.training.parallel_engines import build_engine
from flowalign.training.threads import set_threads

__all__ = ["build_rewards", "build_trainer", "check_prompts_fit_model", "check_prompts_fit_rewards",
           "check_rewards_fit_modality", "check_video_settings", "enable_xformers", "load_policy"]

logger = logging.getLogger(__name__)


def build_trainer(trainer, config, rewards=None, model: FlowModel | None = None, accelerator=None) -> None:
    """Give ``trainer`` everything its loop reads, in the order that refuses bad input before any model loads: the
    accelerator and the batch layout, the run directory and the checkpoint to resume, the components, prompts and
    rewards (``rewards`` replaces ``config.reward.rewards``), the engine; then the policy (``model`` replaces loading
    ``model.path``), the optimizer, the EMA and the policy copies; the components' ``set_up``; the resumed state."""
    from accelerate import Accelerator

    from flowalign.data.prompts import PromptSampler, load_prompts

    t, cfg = trainer, config.train
    t.config = config
    set_threads(cfg.threads)  # before anything computes: the CPUs free to the process, or train.threads
    t.accelerator = accelerator or Accelerator(
        cpu=launched_without_accelerator(), mixed_precision=config.model.mixed_precision,
        log_with=None if cfg.tracker == "none" else cfg.tracker, project_dir=cfg.out_dir)
    check_distributed_type(t.accelerator)
    check_ranks_agree(t.accelerator, to_dict(config))
    context = check_context_parallel(config, t.accelerator.num_processes, t.accelerator.device.type)
    if context is not None:  # the batch is split over the data groups; a context group holds the same samples
        t.accelerator = DataParallelView(t.accelerator, context)
    config.distributed.check_processes(t.accelerator.num_processes)
    t.layout = config.check_batch(t.accelerator.num_processes)
    t.out_dir, t.checkpointer = Path(cfg.out_dir), Checkpointer(t)
    t.checkpoint = t.checkpointer.check_run_directory()  # the checkpoint to resume; before any model loads
    t.parts = config.components()
    t.schedule = noise_schedule(config.noise_schedule_spec())
    train_prompts = load_prompts(config.data.train_prompts, key="data.train_prompts")
    if rewards is None:
        check_prompts_fit_rewards(config, train_prompts)
    check_prompts_fit_model(config, train_prompts, model)
    check_video_settings(config, train_prompts, t.layout, model)
    if rewards is None:
        check_rewards_fit_modality(config, model)
    t.prompts = PromptSampler(train_prompts, seed=cfg.seed, count=config.data.prompts_per_iteration,
                              sampling=config.data.prompt_sampling)
    t.rewards = build_rewards(config, rewards, t.layout)
    CollapseMetrics.check_prompts(config, train_prompts)
    t.collapse = CollapseMetrics(config, rewards_given=rewards is not None)  # before the LoRA's seed
    for part in t.parts.all():
        part.start_up()
        part.check_model(config.model.path if model is None else None)
    t.engine = build_engine(config)
    if model is None:
        t.engine.check(config)
    torch.manual_seed(cfg.seed)  # the LoRA initialisation, identical on every process and layout
    t.model = load_policy(config, t.accelerator.device, model)
    if context is not None:  # before the engine wraps or shards it
        enable_context_parallel(t.model, config.distributed.context_parallel, t.accelerator.device.type)
    for _, _, reward in t.rewards:  # a reward conditioned on the model's text embeddings takes them from it
        bind_reward_model(reward, t.model)
    t.params = t.engine.prepare(t)  # wrapped or sharded before the optimizer is built on them
    optim = config.optim
    t.optimizer = t.engine.optimizer(t, t.params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                                     weight_decay=optim.weight_decay)
    t.ema = EMA(t.trainable_state(), optim.ema_decay) if optim.ema_decay > 0 else None
    t.copies = PolicyCopies(t.trainable_state(), [c for part in t.parts.all() for c in part.policy_copies()])
    t.iteration, t.history, t.stop_requested, t.last_advantages = 0, [], False, None
    t.optimizer_steps, t.iteration_cond, t.stop_signal = 0, None, None
    for part in t.parts.all():
        part.set_up(t)
    if t.checkpoint is not None:  # loading it is set-up too: a file that does not fit is the user's to fix
        t.checkpointer.resume(t.checkpoint)


def check_prompts_fit_rewards(config, prompts: list[dict]) -> None:
    """Before any reward is built: each configured reward can score every training prompt (GenEval metadata where it
    reads it, a quoted text for ``ocr``: ``flowalign.rewards.require_prompt_metadata``), and a reward whose class has
    a ``check_run(kwargs, *, key, model, image_size)`` classmethod (a fitted checkpoint it reads, an extra it needs)
    accepts the run's model path and image size."""
    from flowalign.rewards import check_reward_run, require_prompt_metadata

    for i, spec in enumerate(config.reward.rewards):
        require_prompt_metadata(spec.name, f"reward.rewards[{i}].name", prompts, config.data.train_prompts,
                                spec.kwargs)
        check_reward_run(spec.name, spec.kwargs, key=f"reward.rewards[{i}].kwargs", model=config.model.path,
                         image_size=config.sampling.image_size)


def check_prompts_fit_model(config, prompts: list[dict], model: FlowModel | None = None) -> None:
    """Before the model loads, against its family (``model``'s, else read from ``model.family`` or the model's
    ``model_index.json``; an unreadable or unsupported model is left to the loader, which names it): training prompts
    with condition images need a family that takes them, and an image-to-video family needs one in every prompt
    (``flowalign.data.condition_images.check_family_takes``); ``model.lora_experts`` and ``model.guidance_scale_2``
    need a family with two experts."""
    from flowalign.data.condition_images import check_family_takes, has_condition_images
    from flowalign.models.loading import adapter_class, names_adapter

    if model is not None:
        adapter = type(model)
    elif has_condition_images(prompts) or names_adapter(config.model.path, config.model.family):
        try:
            adapter = adapter_class(config.model.path, config.model.family)
        except (ValueError, FileNotFoundError):
            if has_condition_images(prompts):
                raise
            return
    else:
        return
    check_family_takes(adapter, prompts, "data.train_prompts", config.data.train_prompts)
    check_family_experts(adapter, config)


def check_family_experts(adapter: type, config) -> None:
    """``model.lora_experts`` and ``model.guidance_scale_2`` only on a family with two experts (``adapter.experts``):
    a SetupError naming the key otherwise."""
    if getattr(adapter, "experts", ()):
        return
    family = getattr(adapter, "family", "") or adapter.__name__
    for key, value in (("lora_experts", config.model.lora_experts), ("guidance_scale_2", config.model.guidance_scale_2)):
        if value is not None:
            raise SetupError(f"model.{key} = {value} is a setting of models with two experts, but model family "
                             f"{family!r} ({config.model.path}) has one transformer: drop model.{key}, or use a "
                             "Wan2.2 A14B model")


def check_video_settings(config, prompts: list[dict], layout, model: FlowModel | None = None) -> None:
    """Before the model loads: the video settings fit the model (``flowalign.training.video_checks``), whose adapter
    class comes from ``model_index.json`` (or ``model``); a hub id is checked when it loads."""
    from flowalign.models.loading import adapter_class
    from flowalign.training.video_checks import check_video_run

    if model is None and config.model.family is None and not Path(config.model.path).expanduser().is_dir():
        return
    adapter = type(model) if model is not None else adapter_class(config.model.path, config.model.family)
    check_video_run(config, prompts, adapter, layout)


def build_rewards(config, rewards=None, layout=None) -> list[tuple[str, float, Callable]]:
    """``(name, weight, fn)`` for each reward: ``config.reward.rewards`` built from the registry, or ``rewards``: reward
    callables ``fn(images, prompts, metadata) -> scores`` (weight 1, named after the function or class), a mapping of
    names to callables, or ``(name, weight, fn)`` triples. A groupwise reward needs every process (``layout``) to hold
    whole groups."""
    built = _rewards(config, rewards)
    for name, _, fn in built:
        if is_groupwise(fn) and layout is not None and layout.samples_per_process % config.data.group_size:
            raise SetupError(
                f"reward {name!r} is groupwise (it scores whole groups), but each of the {layout.num_processes} "
                f"processes holds {layout.samples_per_process} samples, not a multiple of data.group_size = "
                f"{config.data.group_size}: change data.prompts_per_iteration or the number of processes")
        if is_groupwise(fn) and layout is not None and config.reward.overlap and (
                layout.rollout_batch_size % config.data.group_size):
            raise SetupError(
                f"reward.overlap scores each rollout chunk of {layout.rollout_batch_size} samples on its own, and "
                f"reward {name!r} is groupwise: a chunk must hold whole groups of data.group_size = "
                f"{config.data.group_size}: set sampling.batch_size to a multiple of it, or reward.overlap: false")
    return built


def _rewards(config, rewards) -> list[tuple[str, float, Callable]]:
    if rewards is None:
        return [(spec.name, spec.weight, _built(spec, f"reward.rewards[{i}]"))
                for i, spec in enumerate(config.reward.rewards)]
    if isinstance(rewards, Mapping):
        rewards = [(name, 1.0, fn) for name, fn in rewards.items()]
    elif callable(rewards):
        rewards = [rewards]
    out = []
    for item in rewards:
        if isinstance(item, tuple):
            name, weight, fn = item
        else:
            fn, weight = item, 1.0
            name = getattr(fn, "__name__", None) or type(fn).__name__
        if not callable(fn):
            raise TypeError(f"reward {name!r} is not callable: a reward is fn(images, prompts, metadata) -> scores")
        out.append((str(name), float(weight), fn))
    logger.info("rewards given to the trainer: %s (config.reward.rewards is not used)", ", ".join(n for n, _, _ in out))
    return out


def _built(spec, key: str) -> Callable:
    """The reward of one ``reward.rewards`` entry: built from the registry, scored over a video's frames when the
    entry has ``frames`` (``flowalign.reward_models.frames.over_frames``)."""
    reward = build_reward(spec.name, **spec.kwargs)
    if getattr(spec, "frames", None) is None:
        return reward
    from flowalign.reward_models.frames import over_frames

    return over_frames(reward, spec.frames, f"{key}.frames")


def check_rewards_fit_modality(config, model: FlowModel | None = None) -> None:
    """Before any reward is built and the model loads: the rewards fit the model's modality, image or video
    (``flowalign.rewards.check_reward_modality``), read from ``model`` or from the model's ``model_index.json``. A
    model path that cannot be read is left to the loader, whose error names it."""
    from flowalign.models.loading import adapter_class
    from flowalign.rewards import check_reward_modality

    try:
        adapter = type(model) if model is not None else adapter_class(config.model.path, config.model.family)
    except FileNotFoundError:
        return
    check_reward_modality(config.reward, getattr(adapter, "modality", "image"),
                          num_frames=getattr(config.sampling, "num_frames", None))


def load_policy(config, device, model: FlowModel | None = None) -> FlowModel:
    """The model of ``model.path`` (or ``model``) with a fresh LoRA adapter on frozen weights, LoRA weights in fp32;
    or, with ``model.finetune: full``, every transformer weight trained as an fp32 master weight beside a frozen
    reference copy of the base (``FlowModel.make_full_finetune``)."""
    cfg = config.model
    if model is None:
        options = {"num_frames": config.sampling.num_frames, "vae_batch": cfg.vae_batch,
                   "vae_tiling": cfg.vae_tiling or None,  # video models only (check_video_settings)
                   "lora_experts": cfg.lora_experts, "guidance_scale_2": cfg.guidance_scale_2}  # two experts only
        options = {k: v for k, v in options.items() if v is not None}
        model = load_flow_model(cfg.path, family=cfg.family, dtype=cfg.dtype, device=device,
                                max_sequence_length=cfg.max_sequence_length, adapter_options=options or None)
    if cfg.attention == "xformers":
        enable_xformers(model)
    if cfg.gradient_checkpointing:
        model.transformer.enable_gradient_checkpointing()
    if cfg.finetune == "full":
        model.make_full_finetune(offload=cfg.reference_offload)
    else:
        if not model.has_lora:
            model.add_lora(rank=cfg.lora_rank, alpha=cfg.lora_alpha, target_modules=cfg.lora_targets)
        model.freeze_base()
        for param in model.transformer.parameters():
            if param.requires_grad:  # LoRA weights train in fp32 whatever the base dtype
                param.data = param.data.float()
    if config.distributed.activation_checkpointing:  # after the reference copy: it runs without gradients
        checkpoint_blocks(model.transformer, config.distributed.activation_checkpointing)
    return model


def enable_xformers(model: FlowModel) -> None:
    """xformers attention needs its extra and a CUDA device; otherwise say which is missing."""
    try:
        import xformers  # noqa: F401
    except ImportError:
        raise ValueError("model.attention='xformers' needs the xformers extra: pip install -e '.[xformers]'") from None
    if model.device.type != "cuda":
        raise ValueError(f"model.attention='xformers' needs a CUDA device, but the model is on {model.device}")
    model.pipe.enable_xformers_memory_efficient_attention()


