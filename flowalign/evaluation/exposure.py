"""The exposure-bias probe: how far the model's clean-image prediction drifts from the data on its own trajectories.

A model trained only on the forward process (teacher forcing: ``x_s = (1 - s) z0 + s eps``) is evaluated on states
its own sampler produced, which are off that process (exposure bias, the failure SOAR targets). For real pairs
``(z0, c)`` (rows ``0..count-1`` of an image-caption dataset, with noise ``eps`` keyed by ``(seed, row)``):

    x_a        = (1 - s_a) z0 + s_a eps                        (on the data's trajectory at the start sigma s_a)
    x_m        = the model's own ODE from x_a down to s_m       (Euler, ``steps`` steps, guidance g)
    x_m*       = (1 - s_m) z0 + s_m eps                        (where the data's trajectory is at s_m)
    x0_hat(x)  = x - s_m v(x, s_m, c)
    generated  = mean((x0_hat(x_m)  - z0)^2)                   (the error on the generated trajectory)
    teacher    = mean((x0_hat(x_m*) - z0)^2)                   (the error under teacher forcing)

per pair, in latent space; ``gap = generated - teacher`` is the part the model's own steps add. Run it with the same
settings before and after training (the reference under ``model.reference()``, then the trained weights) and compare
the rows pairwise (``paired_rows``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from flowalign.data.images import open_image_dataset
from flowalign.samplers import predict_x0
from flowalign.seeding import generator

__all__ = ["exposure_bias", "paired_rows"]

PROBE_KEY = 4409  # the probe's noise: generator(seed, PROBE_KEY, row), apart from every training purpose


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


@torch.no_grad()
def exposure_bias(model, data: str = "toy", *, count: int = 32, start_sigma: float = 0.8, mid_sigma: float = 0.5,
                  steps: int = 3, guidance_scale: float = 1.0, seed: int = 0, image_size=None,
                  batch_size: int = 16) -> dict[str, Any]:
    """The probe of the module docstring on ``count`` pairs of ``data`` (a dataset name ``open_image_dataset`` takes).

    Returns ``generated``, ``teacher`` and ``gap`` (means over the pairs) with their standard errors (``*_se``), the
    per-pair ``rows`` (``{"row", "generated", "teacher"}``) and the settings."""
    if not 0.0 < mid_sigma <= start_sigma <= 1.0:
        raise ValueError(f"need 0 < mid_sigma <= start_sigma <= 1, got mid_sigma={mid_sigma}, start_sigma={start_sigma}")
    if count < 1 or steps < 1 or batch_size < 1:
        raise ValueError(f"count, steps and batch_size must be >= 1, got {count}, {steps}, {batch_size}")
    size = image_size if image_size is not None else model.default_image_size
    dataset = open_image_dataset(data, size if isinstance(size, (tuple, list)) else (size, size))
    sigmas = torch.linspace(start_sigma, mid_sigma, steps + 1, dtype=torch.float32)
    cfg = model.uses_cfg(guidance_scale)
    rows = []
    for start in range(0, count, batch_size):
        index = [r % len(dataset) for r in range(start, min(count, start + batch_size))]
        images, prompts = dataset.batch(index)
        z0 = model.encode_images(images, dtype=torch.float32)
        eps = torch.cat([model.prepare_noise(1, size, generator=generator(seed, PROBE_KEY, start + k),
                                             dtype=torch.float32) for k in range(len(index))])
        cond = model.encode(prompts, negative_prompts=[""] * len(prompts) if cfg else None)

        def velocity(x, sigma):
            return model.velocity(x, torch.full((len(x),), float(sigma)), cond, guidance_scale).float()

        x = (1 - sigmas[0]) * z0 + sigmas[0] * eps
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            if s_next < s:
                x = x + velocity(x, s) * (s_next - s)
        s_m = sigmas[-1]
        teacher_state = (1 - s_m) * z0 + s_m * eps
        errors = []
        for state in (x, teacher_state):
            x0_hat = predict_x0(state, velocity(state, s_m), s_m)
            errors.append((x0_hat - z0).pow(2).flatten(1).mean(1))
        rows += [{"row": start + k, "generated": float(g), "teacher": float(t)}
                 for k, (g, t) in enumerate(zip(*errors))]
    report: dict[str, Any] = {"count": count, "data": data, "start_sigma": start_sigma, "mid_sigma": mid_sigma,
                              "steps": steps, "guidance_scale": guidance_scale, "seed": seed, "rows": rows}
    for key, values in (("generated", [r["generated"] for r in rows]), ("teacher", [r["teacher"] for r in rows]),
                        ("gap", [r["generated"] - r["teacher"] for r in rows])):
        report[key], report[f"{key}_se"] = _mean_se(values)
    return report


def paired_rows(before: dict[str, Any], after: dict[str, Any], key: str = "generated") -> dict[str, float]:
    """``after - before`` of a probe quantity (``generated``, ``teacher`` or ``gap``) over the same pairs: mean, SE."""
    if [r["row"] for r in before["rows"]] != [r["row"] for r in after["rows"]]:
        raise ValueError("the two probes ran on different pairs: use the same data, count and seed")
    value = (lambda r: r["generated"] - r["teacher"]) if key == "gap" else (lambda r: r[key])
    diff, se = _mean_se([value(b) - value(a) for a, b in zip(before["rows"], after["rows"])])
    return {"before": before[key], "after": after[key], "diff": diff, "se": se}
