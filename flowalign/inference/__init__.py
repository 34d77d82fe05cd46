"""Inference: guided samplers as registered components, and ``flowalign sample`` (``flowalign.inference.sample``).

A ``GuidedSampler`` spends at most ``budget`` NFEs per prompt to draw what it returns for each prompt of a batch:
best-of-N, Feynman-Kac steering (Singhal et al. 2025, "A General Framework for Inference-time Scaling and Steering of
Diffusion Models"), diffusion tree search (DTS / DTS*, Jain et al. 2025) and reward-gradient guidance (RGS) are the
built-in ones (``flowalign.inference.guided``). Each is registered in ``SAMPLERS`` with its settings, a subclass of
``ComponentConfig``; in a config ``sampler: {name: fk, lam: 10}`` (``sampler.lam=10``, or the option ``--lam 10``)::

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
from typing import Any, Callable, ClassVar

from flowalign.components import Component
from flowalign.registry import Registry

__all__ = ["NEEDS", "SAMPLERS", "GuidedProblem", "GuidedSampler", "register_sampler"]

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
        from flowalign.inference.sample import latent_reward

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


# The built-in samplers register themselves on import.
from flowalign.inference import guided  # noqa: E402,F401
