"""Supervised flow matching on (image, prompt) pairs: the rectified-flow loss the models were pre-trained with.

For a unit of ``B`` pairs, with clean latents ``x0 = encode_images(image)`` (the VAE posterior mean), noise
``eps ~ N(0, I)`` and noise levels ``sigma``:

    x      = (1 - sigma) x0 + sigma eps          (the forward process of flowalign.samplers.sde)
    target = eps - x0                            (the velocity d x / d sigma the models predict: x0 = x - sigma v)
    loss   = weight * mean((v(x, sigma, prompt) - target)^2)

``sigma`` is uniform in (0, 1) or logit-normal, ``sigmoid(m + s n)`` with ``n ~ N(0, 1)`` (Esser et al. 2024,
"Scaling Rectified Flow Transformers", SD3's default training density), optionally shifted,
``shift sigma / (1 + (shift - 1) sigma)`` (SD3's training scripts index the scheduler's shifted timesteps, shift 3).

Every draw is keyed, so any process layout gives the same units: unit ``u`` of iteration ``i`` takes the pairs at
positions ``(i U + u) B + k`` (``k < B``) of a stream that visits the dataset in a fresh keyed permutation each epoch,
and draws its ``sigma`` (then its noise) from the generator keyed ``(seed, i, u, OBJECTIVE)``. Process ``p`` of ``P``
makes the units ``unit_keys`` gives it (its contiguous slice ``u in [p U/P, (p+1) U/P)`` when ``optim.minibatches`` is
1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.data.images import ImageCaptionDataset, ToySceneDataset, check_image_dataset, open_image_dataset
from flowalign.errors import SetupError
from flowalign.models.base import as_image_size
from flowalign.objectives.base import DataUnit, Objective, ObjectiveContext, PolicyOutput, register_objective, unit_keys
from flowalign.seeding import Purpose, numpy_rng
from flowalign.settings import check, finite, option

OBJECTIVE = int(Purpose.OBJECTIVE)

_PICKS = 0  # sub-key of the epoch permutations (keyed (seed, epoch, OBJECTIVE, _PICKS), not by iteration)

logger = logging.getLogger(__name__)

__all__ = ["DataObjectiveConfig", "FlowMatching", "FlowMatchingConfig", "draw_sigmas"]


DATA_NAMES = ("toy (the toy world's exact scenes of the training prompts), toy:N (N renders per prompt), a JSONL file "
              "of {\"image\": path, \"prompt\": text} lines (paths relative to it), or a folder with metadata.jsonl")


@dataclass
class DataObjectiveConfig(ComponentConfig):
    """The settings every objective on image-caption pairs shares: its data, its weight and its keyed data units."""

    data: str = option("", "the image-caption pairs (required): toy / toy:N (the toy world's exact scenes, N per "
                           "training prompt), a JSONL file of {\"image\": path, \"prompt\": text} lines (paths "
                           "relative to it) or a folder with metadata.jsonl; checked at start-up")
    weight: float = option(1.0, "weight of this objective's loss")
    batch_size: int = option(4, "image-caption pairs per data unit")
    units_per_iteration: int = option(1, "data units per iteration, split over the processes (a multiple of their "
                                         "number)")
    image_size: int | None = option(None, "images are resized (cover, centre crop) to this side; null = "
                                          "sampling.image_size, else the model's default")
    sample_posterior: bool = option(False, "draw x0 from the VAE posterior (keyed) instead of taking its mean")

    def validate(self) -> None:
        check(isinstance(self.data, str) and bool(self.data), "data",
              f"is not set: this objective trains on image-caption pairs; set it to {DATA_NAMES}")
        finite("weight", self.weight, 0.0, strict=True)
        for key in ("batch_size", "units_per_iteration"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                  f"must be an integer >= 1, got {value!r}")
        check(self.image_size is None or (isinstance(self.image_size, int) and self.image_size >= 1), "image_size",
              f"must be a positive integer or null, got {self.image_size!r}")


@dataclass
class FlowMatchingConfig(DataObjectiveConfig):
    sigma_sampling: Literal["uniform", "logit_normal"] = option(
        "logit_normal", "density of the noise levels: uniform in (0, 1), or sigmoid(logit_mean + logit_std * n) "
                        "(SD3's training default)")
    logit_mean: float = option(0.0, "mean of the logit-normal density's normal")
    logit_std: float = option(1.0, "standard deviation of the logit-normal density's normal")
    shift: float = option(1.0, "shift of the drawn noise levels, shift s / (1 + (shift - 1) s); 1 = none "
                               "(SD3's scripts train at the scheduler's shift, 3)")

    def validate(self) -> None:
        super().validate()
        check(self.sigma_sampling in ("uniform", "logit_normal"), "sigma_sampling",
              f"must be 'uniform' or 'logit_normal', got {self.sigma_sampling!r}")
        finite("logit_mean", self.logit_mean, -float("inf"))
        finite("logit_std", self.logit_std, 0.0, strict=True)
        finite("shift", self.shift, 0.0, strict=True)


def draw_sigmas(config: FlowMatchingConfig, batch: int, generator: torch.Generator) -> Tensor:
    """``[batch]`` fp32 noise levels in (0, 1) from ``config``'s density (module docstring)."""
    if config.sigma_sampling == "uniform":
        sigma = torch.rand(batch, generator=generator, dtype=torch.float32)
    else:
        normal = torch.randn(batch, generator=generator, dtype=torch.float32)
        sigma = torch.sigmoid(config.logit_mean + config.logit_std * normal)
    if config.shift != 1.0:
        sigma = config.shift * sigma / (1 + (config.shift - 1) * sigma)
    return sigma


@register_objective("flow_matching", config=FlowMatchingConfig)
class FlowMatching(Objective):
    """Supervised flow matching on an image-caption dataset.

    The loss and its data units are described in the module docstring."""

    config: FlowMatchingConfig

    def __init__(self, config: FlowMatchingConfig | None = None):
        super().__init__(config)
        self._datasets: dict[tuple[int, int], ImageCaptionDataset | ToySceneDataset] = {}
        self._permutations: dict[int, list[int]] = {}

    def start_up(self) -> None:
        """The dataset index exists, every line is valid and names an existing image."""
        try:
            check_image_dataset(self.config.data)
        except (FileNotFoundError, ValueError) as error:
            raise SetupError(f"objective {self.name or 'flow_matching'!r}, data = {self.config.data!r}: {error}") \
                from error

    # --- the data ---------------------------------------------------------------------------------------------------
    def image_size(self, context: ObjectiveContext) -> tuple[int, int]:
        size = self.config.image_size
        if size is None:
            size = getattr(getattr(context.config, "sampling", None), "image_size", None)
        return as_image_size(size, context.model.default_image_size)

    def dataset(self, context: ObjectiveContext) -> ImageCaptionDataset | ToySceneDataset:
        size = self.image_size(context)
        if size not in self._datasets:
            self._datasets[size] = open_image_dataset(self.config.data, size)
            logger.info("flow_matching: %d image-prompt pairs from %s at %dx%d", len(self._datasets[size]),
                        self.config.data, *size)
        return self._datasets[size]

    def permutation(self, seed: int, epoch: int, count: int) -> list[int]:
        """The dataset order of ``epoch``: a keyed permutation (the last few are cached)."""
        if epoch not in self._permutations:
            if len(self._permutations) >= 4:
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = numpy_rng(seed, epoch, OBJECTIVE, _PICKS).permutation(count).tolist()
        return self._permutations[epoch]

    def indices(self, seed: int, iteration: int, unit: int, count: int) -> list[int]:
        """The dataset rows of unit ``unit`` of ``iteration`` (positions ``(i U + u) B + k`` of the epoch stream)."""
        batch = self.config.batch_size
        start = (iteration * self.config.units_per_iteration + unit) * batch
        return [self.permutation(seed, p // count, count)[p % count] for p in range(start, start + batch)]

    # --- the objective ------------------------------------------------------------------------------------------------
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        """This process's share of the iteration's ``units_per_iteration`` units (``unit_keys``)."""
        return [self.unit(iteration, u, context) for u in unit_keys(self.config.units_per_iteration, context)]

    @torch.no_grad()
    def unit(self, iteration: int, index: int, context: ObjectiveContext) -> DataUnit:
        """Unit ``index`` of ``iteration``, the same on every process layout."""
        model, cfg = context.model, self.config
        dataset = self.dataset(context)
        rows = self.indices(context.seed, iteration, index, len(dataset))
        images, prompts = dataset.batch(rows)
        draws = context.generator(index, OBJECTIVE)
        sigma = draw_sigmas(cfg, len(rows), draws)
        noise = model.prepare_noise(len(rows), self.image_size(context), generator=draws, dtype=torch.float32)
        x0 = model.encode_images(images, sample=cfg.sample_posterior, generator=draws, dtype=torch.float32)
        device = context.device if context.device is not None else model.device
        sigma, noise, x0 = sigma.to(device), noise.to(device), x0.to(device)
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x = (1 - s) * x0 + s * noise
        return DataUnit(x=x, sigma=sigma, cond=model.encode(prompts),
                        data={"x0": x0, "noise": noise, "target": noise - x0,
                              "rows": torch.tensor(rows, dtype=torch.long)})

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        """``weight * mean((v - (eps - x0))^2)`` in fp32, and its statistics."""
        target = unit.data["target"]
        if tuple(policy.v.shape) != tuple(target.shape):
            raise ValueError(f"flow_matching: the policy velocity has shape {tuple(policy.v.shape)}, the unit's "
                             f"target {tuple(target.shape)}")
        mse = (policy.v.float() - target.float()).pow(2).mean()
        loss = self.config.weight * mse
        stats = {"loss": float(loss.detach()), "mse": float(mse.detach()), "sigma_mean": float(unit.sigma.mean())}
        return loss, stats
