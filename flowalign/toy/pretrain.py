"""Pre-train the toy world's tiny StableDiffusion3Pipeline from scratch on a CPU.

``flowalign toy pretrain`` is the source of truth for ``assets/toy-sd3``: rerunning it with the same seed
reproduces an equivalent checkpoint. Two stages, both on scenes rendered on the fly from the *training* prompts
only (held-out captions are never seen):

1. **VAE.** ``AutoencoderKL`` (2x downsampling, 4 latent channels) trained on renders with an L2 reconstruction
   loss and a small KL term. Afterwards ``shift_factor`` and ``scaling_factor`` are set from the latent mean and std,
   so the diffusion model sees unit-variance latents.
2. **Flow matching.** The MMDiT and the three text encoders are trained jointly with the rectified-flow loss
   ``|| v_theta(x_s, s, c) - (eps - x0) ||^2`` with ``x_s = (1 - s) x0 + s eps`` and ``s`` logit-normal
   (Esser et al. 2024, "Scaling Rectified Flow Transformers", §3.1). 10% of captions are replaced by the empty
   string so classifier-free guidance works. AdamW with warmup and cosine decay; an EMA of the weights is saved.

Tags are sampled by ``tag_weights`` (then a prompt within the tag uniformly), so the 136 color_attr captions do not
drown the rest. color_attr gets twice the weight of the other tags: it is the hardest tag (two objects, each with its
own shape and colour), and at equal weight it stayed the weakest held-out tag (0.028 at 5,500 steps).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..lr_schedule import learning_rate_scale
from ..models.tiny import tiny_sd3_pipeline
from ..settings import at_least, finite, option
from .prompts import split_prompts
from .scenes import render, scene_for

logger = logging.getLogger(__name__)


@dataclass
class PretrainConfig:
    """Settings of ``flowalign toy pretrain`` (module docstring)."""

    out: str = option("assets/toy-sd3", "output pipeline directory")
    seed: int = option(0, "seed")
    vae_steps: int = option(300, "VAE training steps")
    vae_batch_size: int = option(64, "VAE batch size")
    vae_lr: float = option(2e-3, "VAE learning rate")
    kl_weight: float = option(1e-6, "weight of the VAE's KL term")
    calibration_images: int = option(2048, "images whose latents set the VAE's shift and scale (batches of 256)")
    steps: int = option(6200, "transformer training steps")
    batch_size: int = option(64, "transformer batch size")
    lr: float = option(1e-3, "transformer learning rate (AdamW, warmup then cosine decay)")
    warmup_steps: int = option(200, "learning-rate warmup steps")
    weight_decay: float = option(0.01, "AdamW weight decay")
    ema_decay: float = option(0.999, "decay of the saved EMA of the weights")
    empty_caption_prob: float = option(0.1, "probability of the empty caption (for classifier-free guidance)")
    shift: float = option(1.0, "timestep shift of the scheduler")
    threads: int = option(2, "torch CPU threads")
    tag_weights: dict = option({"color_attr": 2.0}, "sampling weight per tag (tags not listed weigh 1)")

    def validate(self) -> None:
        for name in ("vae_steps", "vae_batch_size", "calibration_images", "steps", "batch_size", "threads"):
            at_least(name, getattr(self, name), 1)
        at_least("warmup_steps", self.warmup_steps, 0)
        at_least("seed", self.seed, 0)
        for name in ("vae_lr", "lr"):
            finite(name, getattr(self, name), 0, strict=True)
        for name in ("kl_weight", "weight_decay", "shift"):
            finite(name, getattr(self, name), 0)
        finite("ema_decay", self.ema_decay, 0, high=1)
        finite("empty_caption_prob", self.empty_caption_prob, 0, high=1)


ARCHITECTURE = dict(
    max_length=12,
    clip_hidden=32,
    clip_layers=2,
    t5_dim=64,
    t5_layers=2,
    transformer=dict(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=128,
        pooled_projection_dim=64,
        pos_embed_max_size=16,
    ),
    vae=dict(block_out_channels=(32, 64), norm_num_groups=16, latent_channels=4),
)


class SceneStream:
    """Random (caption, image) batches from the training prompts: a tag by ``tag_weights`` (default 1), then a prompt
    of that tag uniformly."""

    def __init__(self, prompts: list[dict], seed: int, tag_weights: dict[str, float] | None = None):
        self.by_tag: dict[str, list[dict]] = {}
        for entry in prompts:
            self.by_tag.setdefault(entry["tag"], []).append(entry)
        self.tags = sorted(self.by_tag)
        weights = dict(tag_weights or {})
        unknown = sorted(set(weights) - set(self.tags))
        if unknown:
            raise ValueError(f"tag_weights names tags with no training prompt: {unknown}; the tags are {self.tags}")
        if any(not (math.isfinite(w) and w >= 0) for w in weights.values()) or not any(
            weights.get(t, 1.0) > 0 for t in self.tags
        ):
            raise ValueError(f"tag_weights must be finite and >= 0 with some tag above 0, got {weights}")
        p = np.array([weights.get(t, 1.0) for t in self.tags], dtype=np.float64)
        self.tag_probs = p / p.sum()
        self.rng = np.random.default_rng(seed)

    def draw(self) -> dict:
        """One training prompt: a tag by ``tag_probs``, then one of its prompts uniformly."""
        group = self.by_tag[self.tags[self.rng.choice(len(self.tags), p=self.tag_probs)]]
        return group[self.rng.integers(len(group))]

    def batch(self, size: int) -> tuple[list[str], torch.Tensor]:
        captions, images = [], []
        for _ in range(size):
            entry = self.draw()
            captions.append(entry["prompt"])
            images.append(render(scene_for(entry, self.rng)))
        pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        return captions, pixels


def train_vae(vae, stream: SceneStream, config: PretrainConfig, log: dict) -> None:
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.vae_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: learning_rate_scale(s, config.vae_steps, warmup=min(100, config.vae_steps // 10 + 1),
                                      schedule="cosine")
    )
    vae.train()
    bar = tqdm(range(config.vae_steps), desc="vae", dynamic_ncols=True)
    for step in bar:
        _, pixels = stream.batch(config.vae_batch_size)
        posterior = vae.encode(pixels).latent_dist
        recon = vae.decode(posterior.sample()).sample
        mse = F.mse_loss(recon, pixels)
        loss = mse + config.kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == config.vae_steps - 1:
            bar.set_postfix(mse=f"{mse.item():.4f}")
            log["vae_mse"].append((step, mse.item()))
    vae.eval().requires_grad_(False)


@torch.no_grad()
def calibrate_latents(vae, stream: SceneStream, samples: int = 2048) -> tuple[float, float, float]:
    """Set shift/scaling so the latents of ``samples`` images (drawn in batches of 256) are zero-mean, unit-variance;
    returns (shift, scale, recon MSE in [0,1] units)."""
    latents, errors, sizes = [], [], []
    for start in range(0, samples, 256):
        _, pixels = stream.batch(min(256, samples - start))
        z = vae.encode(pixels).latent_dist.mode()
        latents.append(z)
        errors.append(F.mse_loss((vae.decode(z).sample.clamp(-1, 1) + 1) / 2, (pixels + 1) / 2).item())
        sizes.append(len(pixels))
    z = torch.cat(latents)
    shift, scale = z.mean().item(), 1.0 / z.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return shift, scale, float(np.average(errors, weights=sizes))  # each batch weighs its images


def trainable_modules(pipe) -> list[torch.nn.Module]:
    return [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]


def flow_update(loss, optimizer, schedule, params, modules, ema, ema_decay: float) -> float:
    """One update of the flow pretraining: backward, gradients clipped to norm 1, the optimizer's and the learning-rate
    schedule's step, then each EMA copy ``lerp``-ed towards its live module by ``1 - ema_decay``. Returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    with torch.no_grad():
        for live, avg in zip(modules, ema):
            for p_avg, p in zip(avg.parameters(), live.parameters()):
                p_avg.lerp_(p, 1 - ema_decay)
    return loss.item()


def train_flow(pipe, stream: SceneStream, config: PretrainConfig, log: dict) -> list[torch.nn.Module]:
    """Joint rectified-flow training of the MMDiT and the text encoders; returns the EMA copies."""
    modules = trainable_modules(pipe)
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    ema = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: learning_rate_scale(s, config.steps, warmup=config.warmup_steps, schedule="cosine")
    )
    vae = pipe.vae
    generator = torch.Generator().manual_seed(config.seed + 1)
    bar = tqdm(range(config.steps), desc="flow", dynamic_ncols=True)
    running = None
    for step in bar:
        captions, pixels = stream.batch(config.batch_size)
        captions = [c if stream.rng.random() >= config.empty_caption_prob else "" for c in captions]
        with torch.no_grad():
            x0 = (vae.encode(pixels).latent_dist.sample(generator) - vae.config.shift_factor) * vae.config.scaling_factor
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(x0.shape[0], generator=generator))
        s = sigma.view(-1, 1, 1, 1)
        x_s = (1 - s) * x0 + s * noise
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=captions, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=ARCHITECTURE["max_length"], device=torch.device("cpu"),
        )
        v = pipe.transformer(
            hidden_states=x_s, timestep=sigma * 1000, encoder_hidden_states=embeds, pooled_projections=pooled,
            return_dict=False,
        )[0]
        loss = F.mse_loss(v, noise - x0)
        loss_value = flow_update(loss, optimizer, schedule, params, modules, ema, config.ema_decay)
        running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
        if step % 50 == 0 or step == config.steps - 1:
            bar.set_postfix(loss=f"{running:.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
            log["flow_loss"].append((step, running))
    return ema


def save_atomically(pipe, out: Path) -> None:
    """``save_pretrained`` into a temporary sibling directory, then swap it into place. The configs lose diffusers'
    ``_name_or_path`` (where a loaded pipeline came from: a path on this machine, which a written model must not
    carry)."""
    out = out.resolve()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    for path in [tmp / "model_index.json", *tmp.glob("*/config.json")]:
        config = json.loads(path.read_text())
        if config.pop("_name_or_path", None) is not None:
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)


def pretrain(config: PretrainConfig) -> Path:
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    train, test = split_prompts()
    words = sorted({w for entry in train + test for w in entry["prompt"].split()})
    pipe = tiny_sd3_pipeline(words, shift=config.shift, seed=config.seed, **ARCHITECTURE)
    stream = SceneStream(train, config.seed, config.tag_weights)
    log = {"config": asdict(config), "vae_mse": [], "flow_loss": []}
    start = time.time()
    train_vae(pipe.vae, stream, config, log)
    shift, scale, recon = calibrate_latents(pipe.vae, stream, config.calibration_images)
    log.update(vae_seconds=time.time() - start, latent_shift=shift, latent_scale=scale, vae_recon_mse=recon)
    logger.info("vae: recon MSE %.4f (pixels in [0,1]), latent shift %.3f, scale %.3f", recon, shift, scale)
    ema = train_flow(pipe, stream, config, log)
    for live, avg in zip(trainable_modules(pipe), ema):
        live.load_state_dict(avg.state_dict())
        live.eval().requires_grad_(False)
    log["total_seconds"] = time.time() - start
    out = Path(config.out)
    save_atomically(pipe, out)
    (out / "pretrain_log.json").write_text(json.dumps(log, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    logger.info("saved %s (%.1f MB) after %.1f min", out, size, log["total_seconds"] / 60)
    return out
