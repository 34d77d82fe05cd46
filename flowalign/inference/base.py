"""The protocol of the guided samplers: ``GuidedSampler``, ``GuidedProblem``, the registry ``SAMPLERS`` and
``register_sampler``, and the settings the built-in samplers share (``SDESettings``, ``GradientSource``,
``GradientSettings``, ``NoSettings``).

A ``GuidedSampler`` spends at most ``budget`` NFEs per prompt to draw what it returns for each prompt of a batch; the
built-in ones live one per module beside this one (``flowalign.inference``). Each is registered in ``SAMPLERS`` with
its settings, a subclass of ``ComponentConfig``; in a config ``sampler: {name: fk, lam: 10}`` (``sampler.lam=10``, or the option ``--lam 10``)::

    @register_sampler("mine", config=MySettings)
    class Mine(GuidedSampler):
        needs = frozenset({"reward"})
        def sample(self, problem: GuidedProblem) -> GuidedResult: ...

A sampler declares what it ``needs`` of ``flowalign sample`` (``NEEDS``): ``reward`` (the image reward as
``problem.reward(x0, rows)``, always given), ``differentiable_reward`` (a differentiable image reward, named by
``differentiable_reward()``, as ``problem.guide_reward``), ``registers`` (latent reward registers from the checkpoint
``registers_checkpoint()``, attached to the transformer, as ``problem.registers``) or ``image_embedding`` (the image
embedding of ``--diversity``, ``flowalign.embeddings``, as ``problem.embedding``). ``check(config)`` checks what spans the sampler's settings
and the rest of the ``SampleConfig`` (its steps and budget), before anything loads.

``sample(problem) -> GuidedResult``: one sample per prompt (``final [B, ...]``, ``reward [B]``), or a *set* of ``k``
per prompt (``final [B, k, ...]``, ``reward [B, k]``); ``nfe [B]`` is what each prompt spent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Sequence

import torch
from torch import Tensor

from flowalign.components import Component, ComponentConfig
from flowalign.config import ConfigError
from flowalign.registry import Registry
from flowalign.samplers.rgs import DEFAULT_BANDS
from flowalign.settings import check, finite, option, parse_json_object, parse_sigma_band

__all__ = ["NEEDS", "RGS_GRADIENTS", "SAMPLERS", "GradientSettings", "GradientSource", "GuidedProblem",
           "GuidedSampler", "NoSettings", "SDESettings", "check_process_reward", "latent_reward", "register_sampler"]

SAMPLERS: Registry = Registry("guided sampler")
register_sampler = SAMPLERS.register
"""Register a guided sampler: ``@register_sampler("name", config=Settings)`` on its class, or
``register_sampler("name", factory, config=...)`` (``Registry.register``)."""

# What a sampler may need of ``flowalign sample`` (module docstring).
NEEDS = frozenset({"reward", "differentiable_reward", "registers", "image_embedding"})


@dataclass
class GuidedProblem:
    """One batch of prompts to sample: the model and the plain callables of ``flowalign.samplers``.

    ``velocity(x, sigma, rows)`` (with ``evals_per_sample`` NFEs per row and call), ``reward(x0, rows) -> [n]`` (the
    image reward of decoded latents, no gradient), ``sigmas`` of ``config.steps`` steps, the latent ``shape`` of one
    sample, one generator per prompt (``generators[b]`` keyed ``(seed, prompt_offset + b)``: a prompt's draws do not
    depend on its batch), and what the sampler needs: ``guide_reward`` (the differentiable image reward) or
    ``registers``, and the image ``embedding`` (``--diversity``). ``latent_reward(reward_fn, differentiable=True)`` scores decoded latents with any image reward."""

    model: Any
    metadata: list[dict]
    config: Any
    velocity: Callable
    reward: Callable
    sigmas: Any
    shape: tuple
    generators: list
    device: Any
    registers: Any = None
    guide_reward: Any = None
    embedding: Any = None
    prompt_offset: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def prompts(self) -> list[str]:
        return [entry["prompt"] for entry in self.metadata]

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def candidates(self) -> int:
        """``K``, the candidates to return per prompt (``--candidates``): ``K > 1`` asks for a set ``final [B, K, ...]``,
        ``reward [B, K]``; 1 for one sample per prompt."""
        return int(getattr(self.config, "candidates", 1))

    @property
    def evals_per_sample(self) -> int:
        return getattr(self.velocity, "evals_per_sample", 1)

    def latent_reward(self, reward_fn, *, differentiable: bool = False) -> Callable:
        return latent_reward(self.model, reward_fn, self.prompts, self.metadata, differentiable=differentiable)


class GuidedSampler(Component):
    """A registered guided sampler (module docstring).

    Args:
        config: its settings, an instance of the dataclass it was registered with (None for none).
    """

    needs: ClassVar[frozenset[str]] = frozenset({"reward"})
    # Whether ``SampleConfig.budget`` applies (``none`` spends one trajectory whatever the budget).
    uses_budget: ClassVar[bool] = True
    # The whole trajectories each of the K candidates costs at least (so ``K * steps`` NFEs must fit the budget,
    # checked before the model loads); None for a sampler whose candidates share work (a tree's leaves).
    trajectories_per_candidate: ClassVar[int | None] = 1

    def requirements(self) -> frozenset[str]:
        """What this sampler, with its settings, needs (``needs`` unless the settings decide).

        Returns:
            The needs, a subset of ``NEEDS`` ("reward", "differentiable_reward", "registers", "image_embedding").
        """
        return frozenset(self.needs)

    def check(self, config: Any) -> None:
        """Checks that span the settings and the ``SampleConfig`` (steps, budget); raise ``ConfigError``.

        Args:
            config: the ``SampleConfig`` of the run.
        """

    def differentiable_reward(self) -> tuple[str, dict] | None:
        """The registered differentiable image reward to build, with its constructor arguments, when needed.

        Returns:
            ``(reward name, constructor arguments)``, or None when the sampler follows no reward gradient.
        """
        return None

    def registers_checkpoint(self) -> str | None:
        """The register checkpoint to load, when needed.

        Returns:
            The checkpoint's path, or None when the sampler reads no registers.
        """
        return None

    def sample(self, problem: GuidedProblem):
        """Draw what the sampler returns for each of the problem's prompts, within its NFE budget.

        Args:
            problem: the prompts, the velocity, the reward, the sigmas, the budget and the per-prompt generators.

        Returns:
            A ``GuidedResult``: one sample per prompt (or a set of ``k``), their rewards and the NFEs each prompt
            spent.
        """
        raise NotImplementedError


# ------------------------------------------------------------------------------------------ shared settings

_DEFAULT_BANDS = [list(band) for band in DEFAULT_BANDS]
# Where RGS's gradient on a differentiable image reward is taken: through the velocity (one backward NFE per guided
# step, two with CFG) or on x0_hat alone (free); see samplers.rgs.x0_guide.
RGS_GRADIENTS = ("full", "x0")


@dataclass
class SDESettings(ComponentConfig):
    """What the samplers of SDE particles share (FK, DTS)."""

    noise_level: float = option(0.7, "SDE noise level of FK particles and tree search")
    lam: float = option(10.0, "FK / DTS inverse temperature")

    def validate(self) -> None:
        if not self.noise_level > 0:
            raise ConfigError(f"guidance {self.name!r} needs noise_level > 0 (SDE particles), got {self.noise_level}",
                              key="noise_level")
        finite("noise_level", self.noise_level, 0)
        finite("lam", self.lam, 0)


@dataclass
class GradientSource(ComponentConfig):
    """A differentiable image reward of the decoded x0_hat as a gradient source (RGS, FK's proposals, Euphonium)."""

    reward: str | None = option(None, "differentiable image reward for RGS's gradient on the decoded x0_hat "
                                "(toy_geneval_soft, pickscore, hps, clipscore, aesthetic, imagereward)",
                                flag="rgs-reward")
    reward_kwargs: dict[str, Any] = option({}, "--rgs-reward's constructor arguments as a JSON object, e.g. local "
                                           "weights: '{\"model\": \"/w/PickScore_v1\", \"device\": \"cuda\"}'",
                                           flag="rgs-reward-kwargs", parse=parse_json_object, metavar="JSON")
    gradient: Literal[RGS_GRADIENTS] = option("full", "--rgs-reward's gradient: through the velocity (full, one "
                                             "backward NFE per guided step) or on x0_hat alone (x0, no extra NFE)",
                                             flag="rgs-gradient")

    def validate(self) -> None:
        if self.reward_kwargs and self.reward is None:
            raise ConfigError("--rgs-reward-kwargs are the constructor arguments of --rgs-reward: pass --rgs-reward "
                              "NAME too", key="reward_kwargs")

    def differentiable_reward(self) -> tuple[str, dict] | None:
        return None if self.reward is None else (self.reward, dict(self.reward_kwargs))


@dataclass
class GradientSettings(GradientSource):
    """A gradient source applied in sigma bands (RGS, FK's proposals)."""

    bands: list[list[float]] = option(_DEFAULT_BANDS, "RGS correction scale above each sigma, highest first (no "
                                      "gradient below the last)", flag="rgs-bands", parse=parse_sigma_band,
                                      metavar="SIGMA:SCALE")

    def validate(self) -> None:
        from flowalign.samplers.rgs import check_bands

        GradientSource.validate(self)
        try:
            check_bands(self.bands)
        except ValueError as error:
            raise ConfigError(str(error), key="bands") from None

    def band_pairs(self) -> list[tuple[float, float]]:
        return [(float(sigma), float(scale)) for sigma, scale in self.bands]


def check_process_reward(settings, method: str) -> None:
    """ConfigError unless ``settings`` name exactly one gradient source, register heads (``registers``) or a
    differentiable image reward (``reward``), and a ``gradient`` mode that applies to it."""
    if settings.registers is None and settings.reward is None:
        raise ConfigError(
            f"guidance {method!r} needs a differentiable reward, and the image reward that scores samples has no "
            "gradient: pass --registers CKPT (trained with `flowalign prep registers`), or --rgs-reward NAME "
            "with a differentiable image reward (toy_geneval_soft, pickscore, hps, clipscore, aesthetic, "
            "imagereward), or use --guidance bon|fk|dts", key="registers")
    if settings.registers is not None and settings.reward is not None:
        raise ConfigError(f"pass either --registers or --rgs-reward as {method}'s gradient source, not both",
                          key="reward")
    check(settings.gradient == "full" or settings.reward is not None, "gradient",
          f"{settings.gradient!r} (--rgs-gradient) applies to --rgs-reward only (register heads read x_t itself, so "
          "their gradient always runs through the transformer)")


@dataclass
class NoSettings(ComponentConfig):
    """A sampler without settings of its own."""


def latent_reward(model, reward_fn, prompts: Sequence[str], metadata: Sequence[dict], *, chunk: int = 64,
                  differentiable: bool = False):
    """``reward(x0, rows) -> [n]``: score clean latents with a reward for prompts ``rows``: an image reward scores
    their decoded images, a latent reward (``reads_latents``, e.g. ``shell_lcc``) the latents themselves
    (``flowalign.rewards.score_latents``).

    By default scored without gradients, float64 on the CPU (``differentiable = False``). With ``differentiable``
    (for a reward with the entry point ``forward(inputs, prompts, metadata)``, refused here otherwise), decoding and
    scoring go through ``flowalign.rewards.differentiable_score`` and keep the autograd graph, so ``d reward / d x0``
    flows back (through the VAE decoder for an image reward); scores are float32 on the latents' device.
    """
    from flowalign.rewards import require_differentiable, score_latents

    if differentiable:
        require_differentiable(reward_fn, "reward")

    def reward(x0: Tensor, rows: Tensor) -> Tensor:
        scores = []
        for start in range(0, x0.shape[0], chunk):
            part = rows[start : start + chunk].tolist()
            texts, entries = [prompts[r] for r in part], [metadata[r] for r in part]
            out = score_latents(reward_fn, x0[start : start + chunk], model.decode, texts, entries,
                                differentiable=differentiable)
            scores.append(out.to(x0.device) if differentiable else out)
        return torch.cat(scores)

    reward.differentiable = differentiable
    reward.name = getattr(reward_fn, "name", "reward")
    return reward if differentiable else torch.no_grad()(reward)
