"""Reward callables, their registry, scoring a batch with several rewards, and combining the scores.

The protocol (trl-style plain callables): a reward is

    reward(images: Tensor [B, 3, H, W] in [0, 1], prompts: list[str], metadata: list[dict]) -> Tensor [B] | list[float]

with a ``name`` attribute. Rewards are scored without gradients (GRPO only needs their values).

A *differentiable* reward also has the entry point

    reward.forward(images: Tensor [B, 3, H, W] in [0, 1], prompts: list[str], metadata: list[dict] | None) -> Tensor [B]

which keeps the autograd graph to ``images`` (the zoo's ``RewardModel`` subclasses, ``toy_geneval_soft``,
``brightness``). Reward-gradient guidance (RGS, FK's RGS proposals) and RG-OPD score through
``differentiable_score(reward, images, prompts, metadata)``, which moves the images to the reward's ``device`` and the
scores back; ``require_differentiable`` checks for the entry point (a ``differentiable = True`` flag alone is not
enough: ``RewardModel.__call__`` scores under ``torch.no_grad()``), and ``build_differentiable_reward`` does so on the
registered class before anything is built or loaded.

A *groupwise* reward (``groupwise = True`` on the callable) scores one GRPO group at a time, so its score may depend on
the whole group (a rank, a diversity bonus, a pairwise preference): ``score_all`` calls it once per group with that
group's images, prompts and metadata, in order, given the batch's ``group_ids``; the trainer requires every process to
hold whole groups for it.

``score_all`` runs every reward on one batch and keeps the raw scores ``[R, B]``. A non-finite score (a reward that
returns NaN for an image it cannot judge) is not an error: the sample is marked invalid (``valid[b]`` is False when
any reward of sample ``b`` is non-finite), counted, and left out of every later mean, std and advantage.

A *latent* reward (``reads_latents = True`` on the callable, e.g. ``shell_lcc``) takes the model's latents
``[B, C, h, w]`` in place of the images, in both entry points; the callers that decode latents to score them
(``score_all`` with ``latents=``, ``score_latents``) hand it the latents instead. A reward whose file was made for one
model declares a ``check_run(kwargs, *, key, model, image_size)`` classmethod, asked before it is built and before that
model loads (``check_reward_run``).

Modality. A reward declares what it scores with ``modality``: ``"image"`` (the default), ``"video"`` (videos
``[B, F, 3, H, W]`` in [0, 1], frames first: ``temporal_consistency``, ``motion``, ``videoalign``) or ``"any"``
(``shell_lcc``, ``remote``, ``vlm_judge``); ``reward_modality`` reads it from the registry without building anything.
An image reward scores a video through its frame aggregation (``reward.rewards[i].frames``,
``flowalign.reward_models.frames``), and ``check_reward_modality`` refuses, before any model loads, a reward that does
not fit the model's modality.

Input and files. A reward that fails on its *input* (a sample's metadata lacks a field it needs) raises
``flowalign.errors.RewardInputError``, not a plain exception: a reward server answers it with a 4xx that the client
does not retry, where any other exception is the reward's own fault (500). A reward may also declare the optional
``check_inputs(prompts, metadata)``, which raises ``RewardInputError`` before anything is scored: the server runs it
on each request before merging requests into a batch, so one client's bad request never fails another's. A reward
that opens files named in its metadata declares ``reads_files``, the metadata keys that hold those paths (a string or
a list of strings per sample; ``source_similarity``: ``("images",)``); a reward server serves it only under an
allow-listed ``files_root`` (``files_read``).

``combine_rewards`` turns ``[R, B]`` scores into one reward per sample. Two modes:

* ``sum_then_normalize``: ``r_b = sum_k w_k s_kb``; the group normalisation happens once, in the advantages. A reward
  with a larger scale then dominates the ranking inside a group.
* ``normalize_then_sum``: ``r_b = sum_k w_k (s_kb - mean_g(s_k)) / (std(s_k) + eps)``, each reward first normalised
  within its group with the same group/global std rule and eps as the advantages
  (``flowalign.advantages.group_normalize``), so the weights, not the scales, set each reward's influence. (The
  advantages then normalise the sum once more, per group.)

``reward.combine: gdpo`` is not a mode of ``combine_rewards``: GDPO's per-reward group normalisation and batch
renormalisation (``flowalign.gdpo.gdpo_advantages``) give the advantages themselves, with the std and eps of the
released code ``reward.gdpo_variant`` names (unbiased stds, NVlabs' + 1e-4 or Pref-GRPO's + 1e-8, or Flow-Factory's
population stds floored at 1e-6), where ``normalize_then_sum`` uses flowalign's population std + 1e-4 and normalises
per group twice.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from flowalign.errors import RunStopped
from flowalign.advantages import STD_MODES, group_normalize
from flowalign.registry import Registry

__all__ = [
    "COMBINE_MODES",
    "REWARDS",
    "Reward",
    "VideoBrightnessReward",
    "RewardScores",
    "build_differentiable_reward",
    "build_reward",
    "combine_rewards",
    "differentiable_rewards",
    "differentiable_score",
    "register_reward",
    "require_differentiable",
    "require_differentiable_reward",
    "reward_class",
    "is_groupwise",
    "bind_reward_model",
    "check_reward_run",
    "check_reward_modality",
    "check_reward_fits",
    "MODALITIES",
    "reward_modality",
    "reads_latents",
    "files_read",
    "score_all",
    "score_range",
    "score_latents",
]

COMBINE_MODES = ("sum_then_normalize", "normalize_then_sum")


@runtime_checkable
class Reward(Protocol):
    """A named callable scoring a batch of images against their prompts and metadata."""

    name: str

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor | list[float]:
        """Score a batch, without gradients.

        Args:
            images: ``[B, 3, H, W]`` in ``[0, 1]``.
            prompts: the ``B`` prompts the images were made for.
            metadata: one dict per image: its prompt's entries from the prompt file.

        Returns:
            ``B`` scores (a tensor or a list of floats); a non-finite score marks an image the reward cannot judge.
        """
        ...


def _toy_geneval_class() -> type:
    from flowalign.toy.reward import ToyGenEvalReward  # imported lazily: it pulls in scipy and the toy world

    return ToyGenEvalReward


def _toy_geneval_soft_class() -> type:
    from flowalign.toy.soft_reward import SoftToyGenEval  # a differentiable surrogate, for reward-gradient guidance

    return SoftToyGenEval


def _toy_geneval(**kwargs: Any) -> Reward:
    return _toy_geneval_class()(**kwargs)


def _toy_geneval_soft(**kwargs: Any) -> Reward:
    return _toy_geneval_soft_class()(**kwargs)


def _toy_video_class() -> type:
    from flowalign.toy.video_reward import ToyVideoReward  # the toy video world's verifier (a video reward)

    return ToyVideoReward


def _toy_video(**kwargs: Any) -> Reward:
    return _toy_video_class()(**kwargs)


_toy_geneval.reward_class = _toy_geneval_class
_toy_video.reward_class = _toy_video_class
_toy_video.score_range = (0.0, 1.0)  # correctness, or the mean of its four checks
_toy_geneval_soft.reward_class = _toy_geneval_soft_class
_toy_geneval.score_range = _toy_geneval_soft.score_range = (0.0, 1.0)  # correctness, or the fraction of clauses


class BrightnessReward:
    """Mean pixel intensity in [0, 1] (optionally of one channel): a cheap, dense, prompt-free smoke-test reward.

    In the spirit of DDPO's prompt-independent rewards (Black et al. 2023): it has variance on any model, random ones
    included, so it exercises the whole GRPO path where a verifier reward would score every sample 0.
    """

    name = "brightness"
    score_range = (0.0, 1.0)

    def __init__(self, channel: int | None = None):
        if channel not in (None, 0, 1, 2):
            raise ValueError(f"brightness channel must be 0, 1, 2 or None (all), got {channel!r}")
        self.channel = channel

    def forward(self, images: Tensor, prompts: Sequence[str] | None = None,
                metadata: Sequence[dict] | None = None) -> Tensor:
        """The score, differentiable in ``images`` (``d score / d pixel = 1 / (C H W)`` for the pixels it reads)."""
        pixels = images.float() if self.channel is None else images[:, self.channel].float()
        return pixels.flatten(1).mean(dim=1)

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return self.forward(images, prompts, metadata)


class VideoBrightnessReward:
    """Mean brightness of a video ``[B, F, 3, H, W]`` in [0, 1]: the mean over its frames of each frame's mean pixel
    intensity (optionally of one channel), one score per video. The video twin of ``brightness``: a cheap,
    differentiable, prompt-free smoke-test reward for training on video models."""

    name = "video_brightness"
    modality = "video"
    score_range = (0.0, 1.0)

    def __init__(self, channel: int | None = None):
        if channel not in (None, 0, 1, 2):
            raise ValueError(f"video_brightness channel must be 0, 1, 2 or None (all), got {channel!r}")
        self.channel = channel

    def forward(self, videos: Tensor, prompts: Sequence[str] | None = None,
                metadata: Sequence[dict] | None = None) -> Tensor:
        """The score, differentiable in ``videos`` (``d score / d pixel = 1 / (F C H W)`` for the pixels it reads)."""
        if videos.ndim != 5:
            raise ValueError(f"video_brightness scores videos [B, F, 3, H, W], got shape {tuple(videos.shape)}")
        pixels = videos.float() if self.channel is None else videos[:, :, self.channel].float()
        per_frame = pixels.flatten(2).mean(dim=2)
        return per_frame.mean(dim=1)

    def __call__(self, videos: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return self.forward(videos, prompts, metadata)


def _lazy(module: str, attribute: str, *, negative_scores: str | None = None,
          score_range: tuple[float, float] | None = None, modality: str | None = None,
          **fixed: Any) -> Callable[..., Reward]:
    """A factory importing ``flowalign.reward_models.<module>.<attribute>`` only when the reward is built.

    Real reward models pull in transformers/open_clip and load weights, so nothing is imported at registry time.
    ``negative_scores`` says why the reward can score below 0 (``negative_scores_reason``), ``score_range`` the
    interval its scores lie in (``score_range``), ``modality`` what it scores (``reward_modality``; None: the class
    says), all known without importing.
    """

    def reward_class() -> type:
        import importlib

        return getattr(importlib.import_module(f"flowalign.reward_models.{module}"), attribute)

    def factory(**kwargs: Any) -> Reward:
        return reward_class()(**fixed, **kwargs)

    factory.reward_class = reward_class  # the class without building it: its entry points, before weights load
    factory.negative_scores = negative_scores
    factory.score_range = score_range
    if modality is not None:
        factory.modality = modality
    factory.__name__ = f"build_{attribute}"
    factory.__doc__ = f"Build flowalign.reward_models.{module}.{attribute} (kwargs: its constructor's)."
    return factory


# name -> factory (flowalign.registry); add with register_reward. A reward named by reference (module.path:Class,
# file.py:Class) is a class of the user's own, checked against the Reward protocol before anything is built.
REWARDS: Registry[Reward] = Registry("reward", protocol=Reward)
REWARDS.register("toy_geneval", _toy_geneval)
REWARDS.register("toy_geneval_soft", _toy_geneval_soft)
REWARDS.register("toy_video", _toy_video)
REWARDS.register("brightness", BrightnessReward)
REWARDS.register("video_brightness", VideoBrightnessReward)
# The reward model zoo (reward_models/); README "Using real models offline" lists the files each one needs.
REWARDS.register("pickscore", _lazy("pickscore", "PickScore"))
REWARDS.register("hps", _lazy("hps", "HPSv2"))
REWARDS.register("imagereward", _lazy("imagereward", "ImageRewardModel",
                                      negative_scores="raw ImageReward scores are often negative"))
REWARDS.register("clipscore", _lazy("clipscore", "CLIPScore"))
REWARDS.register("aesthetic", _lazy("aesthetic", "LaionAesthetic"))
REWARDS.register("jpeg_compressibility", _lazy("jpeg", "JpegCompressibility",
                                               negative_scores="it scores minus the JPEG size in kB, always negative"))
REWARDS.register("jpeg_incompressibility", _lazy("jpeg", "JpegCompressibility", incompressible=True))
REWARDS.register("geneval", _lazy("geneval", "GenEvalReward", score_range=(0.0, 1.0)))
# Flow-GRPO's OCR reward: PP-OCRv4 reads the image, the prompt's first "..." span is the target (the ocr extra).
REWARDS.register("ocr", _lazy("ocr", "OcrReward", score_range=(0.0, 1.0)))
# Editing: how much of its condition image (the prompt line's "images") a sample keeps.
REWARDS.register("source_similarity", _lazy("source_similarity", "SourceSimilarity"))
# DRL's discriminator logit (`flowalign prep train-discriminator` writes the checkpoint its path= names).
REWARDS.register("discriminator", _lazy("discriminator", "DiscriminatorReward",
                                        negative_scores="it is a logit, log q/p_base: negative where a sample looks "
                                        "more like the base model's than the data"))
REWARDS.register("shell_lcc", _lazy("shell_lcc", "ShellLCCReward",
                                    negative_scores="it scores minus the distance to the data manifold"))
# Video rewards (modality video: they score videos [B, F, 3, H, W]; an image reward scores a video through its
# reward.rewards[i].frames, flowalign.reward_models.frames).
REWARDS.register("motion", _lazy("motion", "MotionScore", modality="video",
                                 negative_scores="with a direction it scores the motion along it, negative against it"))
REWARDS.register("videoalign", _lazy("videoalign", "VideoAlign", modality="video",
                                     negative_scores="VideoReward's heads are unbounded real numbers"))


def _temporal_consistency_class() -> type:
    from flowalign.embeddings import TemporalConsistency  # any registered image embedding, over consecutive frames

    return TemporalConsistency


def _temporal_consistency(**kwargs: Any) -> Reward:
    return _temporal_consistency_class()(**kwargs)


_temporal_consistency.reward_class = _temporal_consistency_class
_temporal_consistency.modality = "video"
_temporal_consistency.score_range = (-1.0, 1.0)
_temporal_consistency.negative_scores = "a cosine similarity: negative for frames whose embeddings point apart"
REWARDS.register("temporal_consistency", _temporal_consistency)


def _remote(module: str, attribute: str, *, score_range: tuple[float, float] | None = None) -> Callable[..., Reward]:
    """A factory importing ``flowalign.remote.<module>.<attribute>`` when the reward is built (``_lazy``'s twin for
    the rewards scored out of process)."""

    def reward_class() -> type:
        import importlib

        return getattr(importlib.import_module(f"flowalign.remote.{module}"), attribute)

    def factory(**kwargs: Any) -> Reward:
        return reward_class()(**kwargs)

    factory.reward_class = reward_class
    factory.score_range = score_range
    factory.__name__ = f"build_{attribute}"
    factory.__doc__ = f"Build flowalign.remote.{module}.{attribute} (kwargs: its constructor's)."
    return factory


# Out of process: a reward server's scores (`flowalign serve-reward`), and a VLM judge over chat completions.
REWARDS.register("remote", _remote("client", "RemoteReward"))
REWARDS.register("vlm_judge", _remote("judge", "VLMJudge", score_range=(0.0, 1.0)))


def _pairwise_class() -> type:
    from flowalign.pairwise_reward import PairwisePreference  # Pref-GRPO's win rates from a pairwise judge

    return PairwisePreference


def _pairwise(**kwargs: Any) -> Reward:
    return _pairwise_class()(**kwargs)


_pairwise.reward_class = _pairwise_class
_pairwise.score_range = (0.0, 1.0)
# Groupwise: every pair of a group judged once (a VLM over chat completions, or a local pairwise model).
REWARDS.register("pairwise_preference", _pairwise)


def register_reward(name: str, factory: Callable[..., Reward], *, overwrite: bool = False) -> None:
    """Add a reward factory (a class, or a callable of the reward's keyword arguments) to ``REWARDS`` under
    ``name``; a name already registered is a ValueError unless ``overwrite``.

    Args:
        name: the name ``reward.rewards`` entries use (``{name: NAME, weight: 1.0, kwargs: {...}}``).
        factory: a ``Reward`` class, or a callable that takes the entry's ``kwargs`` and returns a reward.
        overwrite: replace a name already registered instead of refusing it.
    """
    REWARDS.register(name, factory, overwrite=overwrite)


def reward_class(name: str) -> type | None:
    """The class the registered reward ``name`` builds, found without building it (no weights load), or None when
    its factory does not say (a custom ``register_reward`` factory that is not a class). Unknown names: ValueError."""
    factory = REWARDS.get(name)
    if isinstance(factory, type):
        return factory
    find = getattr(factory, "reward_class", None)
    return find() if callable(find) else None


def negative_scores_reason(name: str) -> str | None:
    """Why the registered reward ``name`` can score below 0, or None when it does not say so. A reward declares it
    with a ``negative_scores`` string on its factory or class (no weights load, nothing is imported)."""
    return getattr(REWARDS.get(name), "negative_scores", None) if name in REWARDS else None


def score_range(name: str) -> tuple[float, float] | None:
    """The interval ``(low, high)`` the registered reward ``name``'s scores lie in, when it declares one with a
    ``score_range`` on its factory or class (nothing is imported or loaded), else None (unknown, or unbounded)."""
    if name not in REWARDS:
        return None
    declared = getattr(REWARDS.get(name), "score_range", None)
    return None if declared is None else (float(declared[0]), float(declared[1]))


def reads_latents(reward: Any) -> bool:
    """Whether ``reward`` (an instance or a class) scores the model's latents instead of decoded images."""
    return bool(getattr(reward, "reads_latents", False))


def files_read(reward: Any) -> tuple[str, ...]:
    """The metadata keys whose values are paths that ``reward`` (an instance or a class) opens (its ``reads_files``
    declaration, a key or a tuple of keys); empty when it opens none."""
    keys = getattr(reward, "reads_files", None) or ()
    return (keys,) if isinstance(keys, str) else tuple(keys)


def check_reward_kwargs(cls: type, kwargs: Mapping[str, Any], key: str, name: str | None = None) -> None:
    """The keyword arguments of the reward class ``cls`` (registered as ``name``), checked against its constructor's
    signature: a name it does not take is a ValueError naming ``key.<name>``, the names it takes and the closest one;
    a value that does not fit the parameter's annotation (``partial_credit: maybe`` for a bool) is a ConfigError naming
    ``key.<name>`` (``flowalign.config.check_value``). A constructor with ``**kwargs`` takes any name; a class
    without a constructor of its own takes none."""
    import difflib
    import inspect
    import typing

    from flowalign.config import check_value

    init = cls.__init__
    parameters = inspect.signature(init).parameters
    known = [p for p, spec in parameters.items() if p != "self" and spec.kind not in (spec.VAR_POSITIONAL,
                                                                                        spec.VAR_KEYWORD)]
    # object.__init__'s (self, /, *args, **kwargs) takes nothing: a class without an __init__ of its own
    takes_any = init is not object.__init__ and any(spec.kind is spec.VAR_KEYWORD for spec in parameters.values())
    label = name or getattr(cls, "name", None) or cls.__name__
    for arg in kwargs:
        if arg not in known and not takes_any:
            close = difflib.get_close_matches(arg, known, n=1)
            raise ValueError(f"{key}.{arg} is not a setting of the {label!r} reward; known: "
                             f"{', '.join(known) or '(none)'}"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # an annotation that does not resolve here (a TYPE_CHECKING import): nothing to check by
        return
    for arg, value in kwargs.items():
        if arg in hints:
            check_value(value, hints[arg], f"{key}.{arg}")


def check_reward_run(name: str, kwargs: Mapping[str, Any], *, key: str, model: str | None,
                     image_size: Any = None) -> None:
    """Before the reward is built and before any model loads: its keyword arguments fit its class's constructor
    (``check_reward_kwargs``), and a reward whose class declares a ``check_run(kwargs, *, key, model, image_size)``
    classmethod (files fitted for one model: a discriminator, a manifold) checks them against the run's model path
    and image size, naming ``key`` (its kwargs' config key) in the error; others pass."""
    cls = reward_class(name)
    if cls is not None:
        check_reward_kwargs(cls, kwargs, key, name)
    check = getattr(cls, "check_run", None)
    if callable(check):
        check(kwargs, key=key, model=model, image_size=image_size)


MODALITIES = ("image", "video", "any")


def reward_modality(reward: Any) -> str:
    """What a reward scores: ``"image"`` (``[B, 3, H, W]``, the default), ``"video"`` (``[B, F, 3, H, W]``) or
    ``"any"`` (either, as its input comes: a latent reward, the remote reward, the VLM judge). ``reward`` is a
    registered name (read from its factory or class: nothing is built or loaded), a class or an instance; declared by
    a ``modality`` attribute."""
    if isinstance(reward, str):
        declared = getattr(REWARDS.get(reward), "modality", None)  # a factory's declaration, nothing imported
        if declared is None:
            declared = getattr(reward_class(reward), "modality", None)
    else:
        declared = getattr(reward, "modality", None)
    if declared is None:
        return "image"
    if declared not in MODALITIES:
        raise ValueError(f"reward {reward!r} declares modality {declared!r}; expected one of {', '.join(MODALITIES)}")
    return declared


def check_reward_modality(reward_config: Any, modality: str, *, num_frames: int | None = None,
                          key: str = "reward.rewards") -> None:
    """Before any reward is built and before any model loads: every reward fits a model of ``modality`` (``"image"``
    or ``"video"``). ``reward_config`` is a ``RewardConfig`` (its ``rewards``), or a list of specs (objects or
    mappings with ``name`` and optionally ``frames``, the frame aggregation, ``flowalign.reward_models.frames``).

    Refused, as a ``ConfigError`` naming ``{key}[i].name`` or ``{key}[i].frames`` and the fix: a video reward on an
    image model; ``frames`` on an image model; an image reward on a video model without ``frames``; ``frames`` on a
    video reward or a latent reward (they read the whole clip); a malformed ``frames``; and, when ``num_frames`` (the
    frames sampled) is known, ``frames.weights`` of another length than the frames read."""
    specs = getattr(reward_config, "rewards", reward_config)
    for i, spec in enumerate(specs):
        get = spec.get if isinstance(spec, Mapping) else lambda field, default=None: getattr(spec, field, default)
        check_reward_fits(get("name"), get("frames", None), modality, at=f"{key}[{i}]", num_frames=num_frames)


def check_reward_fits(name: str, frames: Any, modality: str, *, at: str, num_frames: int | None = None,
                      frames_flag: str | None = None) -> None:
    """One entry of ``check_reward_modality``: the reward ``name`` with its ``frames`` (or None) on a model of
    ``modality``; errors name ``{at}.name`` or ``{at}.frames``. On the command line, ``at`` is the reward's flag
    (``--reward``) and ``frames_flag`` the aggregation's (``--reward-frames``), and the errors name those."""
    from flowalign.config import ConfigError
    from flowalign.reward_models.frames import parse_frames

    if modality not in ("image", "video"):
        raise ValueError(f"a model's modality is image or video, got {modality!r}")
    name_key, frames_key = (at, frames_flag) if frames_flag else (f"{at}.name", f"{at}.frames")
    example = (f"{frames_flag} '{{\"aggregate\": \"mean\"}}'" if frames_flag
               else f"{frames_key}: {{aggregate: mean}}")
    kind = reward_modality(name)
    if frames is not None:
        if modality == "image":
            raise ConfigError(f"{frames_key} scores a video's frames, but the model makes images: remove {frames_key}",
                              key=frames_key)
        if kind == "video" or reads_latents(reward_class(name)):
            what = "a video reward" if kind == "video" else "a latent reward"
            raise ConfigError(f"{frames_key} is set, but {name!r} is {what}: it reads the whole clip; remove "
                              f"{frames_key}", key=frames_key)
        aggregation = parse_frames(frames, frames_key)
        if num_frames is not None and aggregation.weights is not None:
            read = len(aggregation.indices(num_frames))
            if len(aggregation.weights) != read:
                raise ConfigError(f"{frames_key}.weights has {len(aggregation.weights)} weights, but the model "
                                  f"samples {num_frames} frames of which {read} are read: give {read} weights",
                                  key=f"{frames_key}.weights")
    elif modality == "image" and kind == "video":
        raise ConfigError(f"{name_key} = {name!r} is a video reward, but the model makes images: use an image reward "
                          "(or a video model)", key=name_key)
    elif modality == "video" and kind == "image":
        raise ConfigError(f"{name_key} = {name!r} scores images, but the model makes videos: say how its frame scores "
                          f"make one, e.g. {example} (or min, or weights: [...])", key=frames_key)


def bind_reward_model(reward: Any, model: Any) -> None:
    """Hand the loaded model to a built reward that declares ``bind_model(model)`` (a reward conditioned on the
    model's own text embeddings: ``discriminator`` with ``conditioning: text``); others are left alone. The layer
    that loads the model calls this, so reward models never load one themselves."""
    bind = getattr(reward, "bind_model", None)
    if callable(bind):
        bind(model)


def score_latents(reward: Any, latents: Tensor, decode: Callable[[Tensor], Tensor], prompts: Sequence[str],
                  metadata: Sequence[dict] | None = None, *, differentiable: bool = False) -> Tensor:
    """A reward's scores of clean latents: a latent reward (``reads_latents``) reads them, any other reward their
    ``decode``d images. ``differentiable``: through ``differentiable_score`` (float32, the graph kept to the
    latents); otherwise the plain ``__call__`` without gradients (float64 on the CPU)."""
    inputs = latents if reads_latents(reward) else decode(latents)
    if differentiable:
        return differentiable_score(reward, inputs, prompts, metadata)
    with torch.no_grad():
        out = reward(inputs, list(prompts), list(metadata) if metadata is not None else [{} for _ in prompts])
    return torch.as_tensor(out, dtype=torch.float64).flatten().cpu()


def _has_entry_point(reward: Any) -> bool:
    return callable(getattr(reward, "forward", None))


def require_prompt_metadata(name: str, key: str, prompts: Sequence[Mapping[str, Any]], path: Any,
                            kwargs: Mapping[str, Any] | None = None) -> None:
    """ValueError naming ``key`` when the registered reward ``name`` cannot score the prompts of ``prompts`` (read
    from ``path``), checked on its class, so nothing is built and no weights load:

    * a reward that scores a prompt by its GenEval metadata (its class says ``reads_geneval_metadata = True``:
      toy_geneval, toy_geneval_soft, geneval) and an entry without it;
    * a reward whose class declares ``check_prompts(prompts, *, kwargs, key, path)`` (``ocr``: every prompt quotes
      the text to render) and refuses them; ``kwargs`` are the reward's constructor arguments."""
    from flowalign.data.prompts import is_geneval_entry

    plain = next((entry for entry in prompts if not is_geneval_entry(entry)), None)
    if plain is not None and getattr(reward_class(name), "reads_geneval_metadata", False):
        raise ValueError(
            f"{key} = {name!r} scores a prompt by its GenEval metadata (tag, include), but {path} has prompts "
            f"without it (e.g. {plain['prompt']!r}): use GenEval-format prompts (docs/guides/rewards.md) or a reward "
            "that reads only the prompt text (pickscore, hps, ...)")
    try:
        cls = reward_class(name)
    except ValueError:  # an unknown name: the checks that build or look up the reward name it
        return
    check = getattr(cls, "check_prompts", None)
    if callable(check):
        check(prompts, kwargs=dict(kwargs or {}), key=key, path=path)


def differentiable_rewards() -> list[str]:
    """The registered rewards whose class has the differentiable entry point ``forward`` (sorted names)."""
    return sorted(name for name in REWARDS if _has_entry_point(reward_class(name)))


def require_differentiable(reward: Any, key: str, *, name: str | None = None) -> Any:
    """``reward`` (an instance or a class) itself; ValueError naming ``key`` and the reward (``name``, else its own
    ``name``) unless it has the differentiable entry point ``forward(images, prompts, metadata)`` (module docstring).
    The flag ``differentiable`` is not consulted."""
    if not _has_entry_point(reward):
        if name is None:
            name = getattr(reward, "name", None)
            name = name if isinstance(name, str) else getattr(reward, "__name__", type(reward).__name__)
        raise ValueError(
            f"{key} {name!r} is not differentiable: it has no forward(images, prompts, metadata) that keeps the "
            "gradient to the images (it only scores them). Use a differentiable reward "
            f"({', '.join(differentiable_rewards())}), or, for RGS, --registers CKPT; or a guidance method that only "
            "needs reward values (bon, fk, dts)"
        )
    return reward


def require_differentiable_reward(name: str, key: str) -> None:
    """ValueError naming ``key`` when the registered reward ``name`` (unknown names too) has a class without the
    differentiable entry point; checked on the class, so nothing is built and no weights load."""
    cls = reward_class(name)
    if cls is not None:
        require_differentiable(cls, key, name=name)


def build_differentiable_reward(name: str, key: str, **kwargs: Any) -> Reward:
    """Build the registered reward ``name`` for a gradient consumer configured by ``key`` (``--rgs-reward``,
    ``loss.rg_opd.reward``): refused (ValueError naming ``key``) before it is built, and so before any weights load,
    when its registered class has no differentiable entry point; checked again on the built instance."""
    require_differentiable_reward(name, key)
    return require_differentiable(build_reward(name, **kwargs), key)


def differentiable_score(reward: Any, images: Tensor, prompts: Sequence[str],
                         metadata: Sequence[dict] | None = None) -> Tensor:
    """``reward.forward(images, prompts, metadata)`` as float32 scores ``[B]`` on ``images``' device, keeping the
    autograd graph to ``images``.

    The images are moved to ``reward.device`` when the reward has one (the zoo's models run where they were built;
    their ``forward`` preprocesses in fp32 and casts to the backbone's dtype itself) and the scores come back, so the
    gradient reaches ``images`` wherever they live. ValueError naming the reward when it has no entry point, returns
    the wrong number of scores, or returns scores without a gradient while ``images`` require one."""
    require_differentiable(reward, "reward")
    name = getattr(reward, "name", type(reward).__name__)
    batch = int(images.shape[0])
    prompts = list(prompts)
    metadata = list(metadata) if metadata is not None else [{} for _ in range(batch)]
    if len(prompts) != batch or len(metadata) != batch:
        raise ValueError(f"reward {name!r}: got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata "
                         "entries")
    device = getattr(reward, "device", None)
    inputs = images.float()
    if isinstance(device, (torch.device, str)):
        inputs = inputs.to(device)
    scores = reward.forward(inputs, prompts, metadata)
    if not isinstance(scores, Tensor) or scores.shape != (batch,):
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(f"reward {name!r}: forward returned {shape} for {batch} images; expected a tensor ({batch},)")
    if images.requires_grad and torch.is_grad_enabled() and not scores.requires_grad:
        raise ValueError(f"reward {name!r}: forward returned scores without a gradient to the images (does it score "
                         "under torch.no_grad() or detach?)")
    return scores.float().to(images.device)


def build_reward(name: str, **kwargs: Any) -> Reward:
    """Build the registered reward ``name`` with ``kwargs``; an unknown name is a ValueError listing the known ones."""
    return REWARDS.build(name, **kwargs)


@dataclass
class RewardScores:
    """The scores of one batch under several rewards.

    ``raw [R, B]`` float32 holds the values as the rewards returned them (non-finite ones included, for inspection);
    ``valid [B]`` is False where any reward is non-finite and ``num_invalid`` counts those samples. Use
    ``combine_rewards`` for the math: it never lets an invalid score through.
    """

    names: list[str]
    weights: Tensor
    raw: Tensor
    valid: Tensor
    num_invalid: int


RewardSpec = tuple[str, float, Callable[..., Any]]


@torch.no_grad()
def score_all(
    rewards: Sequence[RewardSpec], images: Tensor, prompts: Sequence[str], metadata: Sequence[dict],
    group_ids: Tensor | Sequence[int] | None = None, latents: Tensor | None = None,
) -> RewardScores:
    """Run each ``(name, weight, fn)`` on the batch; see the module docstring for invalid scores and for groupwise
    rewards, which need ``group_ids`` (one per image). A latent reward gets ``latents`` (the images' latents) in place
    of the images; without them it is a ValueError naming it.

    A reward that raises is re-raised as RuntimeError naming the reward and the batch's first prompt (the original
    exception is chained), except ``flowalign.errors.RunStopped``, which passes through as it is. A reward that
    returns the wrong number of scores or a non-numeric value is a ValueError naming the reward.
    """
    if not rewards:
        raise ValueError("score_all needs at least one (name, weight, fn) reward")
    batch = int(images.shape[0])
    if len(prompts) != batch or len(metadata) != batch:
        raise ValueError(f"got {batch} images, {len(prompts)} prompts and {len(metadata)} metadata entries")
    names = [spec[0] for spec in rewards]
    if len(set(names)) != len(names):
        raise ValueError(f"reward names must be unique (they key the logs), got {names}")

    rows, weights = [], []
    for name, weight, fn in rewards:
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"reward {name!r}: weight must be a finite number, got {weight!r}")
        first = repr(prompts[0]) if batch else "(empty batch)"
        inputs = images
        if reads_latents(fn):
            if latents is None:
                raise ValueError(f"reward {name!r} scores latents, and this caller has only decoded images (credit "
                                 "estimators that score intermediate states decode them): use it as the terminal "
                                 "reward, or an image reward here")
            inputs = latents
        try:
            out = _groupwise(name, fn, inputs, prompts, metadata, group_ids) if is_groupwise(fn) else fn(
                inputs, list(prompts), list(metadata))
        except RunStopped:  # a clean stop (a reward server refused for good): its message is already the whole line
            raise
        except Exception as error:
            raise RuntimeError(
                f"reward {name!r} failed on a batch of {batch} images (first prompt: {first}): "
                f"{type(error).__name__}: {error}"
            ) from error
        rows.append(_as_scores(name, out, batch).to(images.device))
        weights.append(float(weight))

    raw = torch.stack(rows)
    valid = torch.isfinite(raw).all(dim=0)
    return RewardScores(
        names=names,
        weights=torch.tensor(weights, dtype=torch.float32, device=images.device),
        raw=raw,
        valid=valid,
        num_invalid=int((~valid).sum()),
    )


def is_groupwise(reward: Any) -> bool:
    """Whether ``reward`` scores whole groups (its ``groupwise`` attribute)."""
    return bool(getattr(reward, "groupwise", False))


def _groupwise(name: str, fn, images: Tensor, prompts, metadata, group_ids) -> Tensor:
    """``fn`` called once per group (in the order the groups appear), its scores put back in batch order."""
    if group_ids is None:
        raise ValueError(f"reward {name!r} is groupwise: score_all needs the batch's group_ids")
    group_ids = torch.as_tensor(group_ids)
    scores = torch.empty(len(group_ids), dtype=torch.float64)
    for group in torch.unique_consecutive(group_ids):
        rows = (group_ids == group).nonzero().flatten()
        picked = rows.tolist()
        out = fn(images[rows.to(images.device)], [prompts[r] for r in picked], [metadata[r] for r in picked])
        scores[rows] = _as_scores(name, out, len(picked)).double().cpu()
    return scores


def combine_rewards(
    scores: Tensor,
    weights: Tensor | Sequence[float],
    valid: Tensor,
    group_ids: Tensor,
    *,
    mode: str = "sum_then_normalize",
    std: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """One reward per sample from ``scores [R, B]`` and ``weights [R]`` (modes in the module docstring).

    Invalid samples (``valid`` False, or any non-finite score) get 0 and are excluded from the per-group means and
    stds of ``normalize_then_sum``. Returns ``[B]`` float32.
    """
    if mode not in COMBINE_MODES:
        raise ValueError(f"unknown combine mode {mode!r}: expected one of {', '.join(COMBINE_MODES)}")
    if std not in STD_MODES:
        raise ValueError(f"unknown std mode {std!r}: expected one of {', '.join(STD_MODES)}")
    scores = torch.as_tensor(scores)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [n_rewards, B], got shape {tuple(scores.shape)}")
    weights = torch.as_tensor(weights, dtype=torch.float32, device=scores.device)
    if weights.shape != (scores.shape[0],) or not torch.isfinite(weights).all():
        raise ValueError(f"weights must be {scores.shape[0]} finite numbers, got {weights.tolist()}")
    valid = torch.as_tensor(valid, device=scores.device)
    if valid.shape != (scores.shape[1],) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor of shape ({scores.shape[1]},), got {valid.dtype} "
                         f"{tuple(valid.shape)}")
    valid = valid & torch.isfinite(scores).all(dim=0)
    scores = torch.where(valid, scores.float(), torch.zeros((), device=scores.device))

    if mode == "normalize_then_sum":
        scores = torch.stack([group_normalize(row, group_ids, valid, std=std, eps=eps)[0] for row in scores])
    combined = (weights[:, None] * scores).sum(dim=0)
    return torch.where(valid, combined, torch.zeros_like(combined))


def _as_scores(name: str, out: Any, batch: int) -> Tensor:
    """A reward's output as a float32 ``[batch]`` tensor, or a ValueError naming the reward."""
    if isinstance(out, Tensor):
        if out.is_complex():
            raise ValueError(f"reward {name!r} returned a tensor of dtype {out.dtype}; expected real numbers")
        scores = out.detach().float().cpu()
    elif isinstance(out, np.ndarray):
        if out.dtype.kind not in "biuf":
            raise ValueError(f"reward {name!r} returned an array of dtype {out.dtype}; expected real numbers")
        scores = torch.from_numpy(out.astype(np.float32))
    elif isinstance(out, (list, tuple)):
        values = []
        for index, value in enumerate(out):
            if isinstance(value, Tensor) and value.numel() == 1 and not value.is_complex():
                value = value.item()
            if isinstance(value, np.bool_):
                value = bool(value)
            if not isinstance(value, numbers.Real):
                raise ValueError(
                    f"reward {name!r} returned a non-numeric score at index {index}: {value!r} "
                    f"({type(value).__name__}); expected a real number"
                )
            values.append(float(value))
        scores = torch.tensor(values, dtype=torch.float32)
    else:
        raise ValueError(
            f"reward {name!r} returned {type(out).__name__}; expected a Tensor [B] or a list of B numbers"
        )
    if scores.ndim != 1 or scores.shape[0] != batch:
        raise ValueError(
            f"reward {name!r} returned scores of shape {tuple(scores.shape)} for a batch of {batch} images; "
            f"expected ({batch},)"
        )
    return scores
