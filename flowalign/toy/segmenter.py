"""A small differentiable shape segmenter for toy images: per-pixel probabilities of background, circle, square, triangle.

The toy detector (``flowalign.toy.detector``) labels connected components and has no gradient. The segmenter is its
differentiable stand-in for guidance: a dilated CNN (receptive field 31 px, enough to see a whole 9-13 px shape and
its corners) trained by cross-entropy on rendered scenes with exact per-pixel labels.

Training scenes are drawn from *random* metadata (1-4 objects of random classes and colours, sometimes with a position
clause), not from the prompt files, so no caption or attribute combination is favoured. Each render is degraded the
way a decoded one-step estimate ``x0_hat`` is: a Gaussian blur of random width (0-1.5 px), a pull toward the grey
background by a random factor (0-40%, the washed-out mean of several possible images at high noise) and pixel noise.
The label of a pixel is the class of the topmost shape whose mask covers it.

``flowalign toy segmenter --out assets/toy-segmenter`` trains and saves it (``model.safetensors`` + ``config.json``
with the training settings and the measured accuracy); ``load_segmenter()`` loads the embedded copy.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..settings import at_least, finite, option
from .scenes import COLORS, SHAPES, SceneError, render, scene_for, shape_mask

__all__ = ["CLASSES", "DEFAULT_SEGMENTER", "SegmenterConfig", "ShapeSegmenter", "degrade", "load_segmenter",
           "random_metadata", "scene_batch", "train_segmenter"]

CLASSES = ("background", *SHAPES)
DEFAULT_SEGMENTER = Path(__file__).resolve().parents[2] / "assets" / "toy-segmenter"
_RELATIONS = ("left of", "right of", "above", "below")

logger = logging.getLogger(__name__)


class ShapeSegmenter(nn.Module):
    """``forward(images [B, 3, H, W] in [0, 1]) -> logits [B, 4, H, W]`` over ``CLASSES``.

    3x3 convolutions with dilations 1, 2, 4, 8, 1 (SiLU between), then a 1x1 classifier; zero padding, so the
    output keeps the input's size.
    """

    def __init__(self, width: int = 32):
        super().__init__()
        self.width = width
        dilations = (1, 2, 4, 8, 1)
        layers: list[nn.Module] = []
        channels = 3
        for d in dilations:
            layers += [nn.Conv2d(channels, width, 3, padding=d, dilation=d), nn.SiLU()]
            channels = width
        layers.append(nn.Conv2d(width, len(CLASSES), 1))
        self.net = nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images * 2.0 - 1.0)

    def probabilities(self, images: Tensor) -> Tensor:
        """Softmax over ``CLASSES`` per pixel, ``[B, 4, H, W]``."""
        return self.forward(images).softmax(dim=1)


@dataclass
class SegmenterConfig:
    """Training settings (saved with the weights)."""

    seed: int = option(0, "seed")
    steps: int = option(1500, "training steps")
    batch_size: int = option(64, "scenes per step")
    lr: float = option(3e-3, "Adam learning rate")
    width: int = option(32, "channels of the segmenter")
    max_blur: float = option(1.5, "largest Gaussian blur of a training image")
    max_fade: float = option(0.4, "largest fade towards grey of a training image")
    noise: float = option(0.03, "pixel noise of a training image")
    threads: int = option(2, "torch CPU threads")

    def validate(self) -> None:
        for name in ("steps", "batch_size", "width", "threads"):
            at_least(name, getattr(self, name), 1)
        at_least("seed", self.seed, 0)
        finite("lr", self.lr, 0, strict=True)
        for name in ("max_blur", "max_fade", "noise"):
            finite(name, getattr(self, name), 0)


@dataclass
class SegmenterRun(SegmenterConfig):
    """``flowalign toy segmenter``: the training settings and where to save the segmenter."""

    out: str = option("assets/toy-segmenter", "output directory")

    def training(self) -> SegmenterConfig:
        """The training settings alone (what is saved with the weights)."""
        return SegmenterConfig(**{f.name: getattr(self, f.name) for f in fields(SegmenterConfig)})


def random_metadata(rng: np.random.Generator) -> dict:
    """GenEval-style metadata with 1-3 include clauses of random classes, counts (total <= 4) and colours, and a
    position clause in a quarter of the two-clause cases."""
    clauses: list[dict] = []
    total = 0
    for _ in range(int(rng.integers(1, 4))):
        count = int(rng.integers(1, 3)) if total < 3 else 1
        if total + count > 4:
            break
        clause = {"class": SHAPES[int(rng.integers(len(SHAPES)))], "count": count}
        if rng.random() < 0.8:
            clause["color"] = COLORS[int(rng.integers(len(COLORS)))]
        clauses.append(clause)
        total += count
    if len(clauses) == 2 and clauses[1]["count"] == 1 and clauses[0]["count"] == 1 and rng.random() < 0.25:
        clauses[1]["position"] = [_RELATIONS[int(rng.integers(4))], 0]
    return {"tag": "random", "include": clauses, "prompt": "random scene"}


def _labels(shapes, size: int) -> np.ndarray:
    labels = np.zeros((size, size), dtype=np.int64)
    for shape in shapes:  # render order: later shapes lie on top
        labels[shape_mask(shape, size)] = CLASSES.index(shape.kind)
    return labels


def scene_batch(rng: np.random.Generator, size: int, image_size: int = 32) -> tuple[Tensor, Tensor]:
    """``size`` random clean renders ``[B, 3, H, W]`` in [0, 1] and their per-pixel labels ``[B, H, W]``."""
    images, labels = [], []
    while len(images) < size:
        try:
            shapes = scene_for(random_metadata(rng), rng, image_size)
        except SceneError:
            continue
        images.append(render(shapes, image_size))
        labels.append(_labels(shapes, image_size))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255.0
    return pixels, torch.from_numpy(np.stack(labels))


def _blur(images: Tensor, widths: Tensor) -> Tensor:
    """Per-image separable Gaussian blur with standard deviation ``widths[b]`` px (0 = none)."""
    radius = 4
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype)
    w = widths.clamp_min(1e-3)[:, None]
    kernel = torch.exp(-0.5 * (offsets[None] / w) ** 2)
    kernel = kernel / kernel.sum(dim=1, keepdim=True)  # [B, K]
    b, c, h, wd = images.shape
    x = F.pad(images.reshape(1, b * c, h, wd), (radius, radius, radius, radius), mode="replicate")
    k = kernel.repeat_interleave(c, dim=0)  # [B*C, K]
    x = F.conv2d(x, k[:, None, None, :], groups=b * c)
    x = F.conv2d(x, k[:, None, :, None], groups=b * c)
    return x.reshape(b, c, h, wd)


def degrade(images: Tensor, generator: torch.Generator, config: SegmenterConfig) -> Tensor:
    """Blur, fade toward the background grey and add pixel noise, each at a random per-image strength."""
    b = images.shape[0]
    widths = torch.rand(b, generator=generator) * config.max_blur
    out = _blur(images, widths)
    fade = (torch.rand(b, generator=generator) * config.max_fade)[:, None, None, None]
    out = out * (1 - fade) + fade * (128 / 255.0)
    out = out + config.noise * torch.randn(out.shape, generator=generator)
    return out.clamp(0, 1)


def train_segmenter(config: SegmenterConfig, out: str | Path | None = None, *, log_every: int = 250) -> ShapeSegmenter:
    """Train a ``ShapeSegmenter`` (module docstring); with ``out``, save it there with its config and accuracy.

    Runs on ``config.threads`` CPU threads and its own global-RNG state; both are restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return _train(config, out, log_every)
    finally:
        torch.set_num_threads(threads)


def _train(config: SegmenterConfig, out: str | Path | None, log_every: int) -> ShapeSegmenter:
    rng = np.random.default_rng(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    model = ShapeSegmenter(config.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, config.steps)
    start = time.time()
    for step in range(config.steps):
        images, labels = scene_batch(rng, config.batch_size)
        loss = F.cross_entropy(model(degrade(images, generator, config)), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if log_every and (step + 1) % log_every == 0:
            logger.info("segmenter step %d/%d loss %.4f (%.0f s)", step + 1, config.steps, loss.item(),
                        time.time() - start)
    model.eval()
    report = measure(model, np.random.default_rng(config.seed + 1), generator, config)
    if out is not None:
        save_segmenter(model, out, {"training": asdict(config), "held_out": report,
                                    "train_seconds": round(time.time() - start, 1)})
    return model


@torch.no_grad()
def measure(model: ShapeSegmenter, rng: np.random.Generator, generator: torch.Generator, config: SegmenterConfig,
            scenes: int = 512) -> dict:
    """Pixel accuracy on fresh scenes, clean and degraded, and accuracy over object pixels only."""
    images, labels = scene_batch(rng, scenes)
    report = {}
    for name, batch in (("clean", images), ("degraded", degrade(images, generator, config))):
        predicted = model(batch).argmax(dim=1)
        objects = labels > 0
        report[f"{name}_pixel_accuracy"] = round(float((predicted == labels).float().mean()), 4)
        report[f"{name}_object_pixel_accuracy"] = round(float((predicted == labels)[objects].float().mean()), 4)
    return report


def save_segmenter(model: ShapeSegmenter, out: str | Path, info: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"width": model.width, "classes": list(CLASSES), **info}, indent=1))


def load_segmenter(path: str | Path | None = None, device: str | torch.device = "cpu") -> ShapeSegmenter:
    """The segmenter saved at ``path`` (default: the embedded ``assets/toy-segmenter``), frozen, in eval mode."""
    from flowalign.serialization import read_json, read_safetensors

    path = Path(path) if path is not None else DEFAULT_SEGMENTER
    weights, config = path / "model.safetensors", path / "config.json"
    if not weights.is_file() or not config.is_file():
        raise FileNotFoundError(f"no toy segmenter at {path} (expected model.safetensors and config.json): train one "
                                f"with `flowalign toy segmenter --out {path}`")
    info = read_json(config, "a toy segmenter's config")
    if not isinstance(info, dict) or info.get("classes") != list(CLASSES):
        raise ValueError(f"segmenter {path} predicts classes "
                         f"{info.get('classes') if isinstance(info, dict) else None}, expected {list(CLASSES)}")
    model = ShapeSegmenter(int(info["width"]))
    model.load_state_dict(read_safetensors(weights, "a toy segmenter's weights"))
    return model.to(device).eval().requires_grad_(False)
