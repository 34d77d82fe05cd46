"""Pre-train the toy video world's tiny Wan2.1 (``WanPipeline``) from scratch on a CPU.

``flowalign toy pretrain-video`` is the source of truth for ``assets/toy-wan``: the same settings and seed rebuild it
(seeded: the clip stream, the initial weights and every noise draw come from ``seed``). Why Wan2.1: of the video
families it is the cheapest to train here, a plain DiT over a causal 3D VAE with one UMT5 text encoder and no other
conditioning (no image stream, no second expert, no audio), whose VAE stays small at small widths and folds pixels
into channels (``patch_size``) as the Wan2.2 VAE does.

The model: 32x32 px clips of 5 frames (``flowalign.toy.clips``); a Wan VAE (``AutoencoderKLWan``) that folds 2x2
pixels into channels (its ``patch_size``, the Wan2.2 VAE's ``patchify``) and does not downsample further, in space or
time: 4 latent channels on a 16x16 grid per frame, 5 latent frames; a 3-layer Wan DiT of width 128 with patches 1x4x4
(80 tokens a clip; a token covers 8x8 pixels, as the released Wan2.1's 8x VAE with 1x2x2 patches covers 16x16); and a
2-layer UMT5 encoder over the toy vocabulary's words.

Why this VAE, and not Wan2.1's 4x time and 4x space: measured on rendered held-out clips, the exact verifier
(``toy_video``) passes the VAE's own reconstructions for 0.10-0.21 of them with 4x in space (4x or 2x in time; the
8x8-pixel shapes become one or two latent pixels and come back as blobs), so no model decoded by it could score much
higher; with the 2x2 patch and no downsampling, 0.55 after 800 steps and 0.89 after the default
1,200 (at learning rate 1.2e-2). The shapes' edges are what the verifier reads
(the detector's fill ratio tells a square from a circle), and a tiny VAE blurs them unless it keeps the resolution.
The posterior's mode is decoded while training (``vae_sample_posterior: false``): the sample's noise slowed the
reconstruction loss's fall about 2x here.

Two stages, on clips rendered from the *training* video prompts only (``assets/prompts/video_train.jsonl``; held-out
captions are never seen):

1. **VAE.** Trained on clips rendered on the fly with an L2 reconstruction loss and a small KL term; then the config's
   per-channel ``latents_mean`` / ``latents_std`` are set from the posterior means, so that the adapter's
   normalisation (``flowalign.models.wan``) hands the transformer zero-mean, unit-variance latents.
2. **Flow matching.** ``latent_clips`` clips are rendered and encoded once (the posterior's mode, normalised): the
   VAE is the costly part of a step on a CPU. The DiT and the text encoder train jointly on them, with the rectified-flow loss
   ``|| v(x_s, s, c) - (eps - x0) ||^2``, ``x_s = (1 - s) x0 + s eps``, ``s`` logit-normal, as the image world's
   ``flowalign toy pretrain``; 10% empty captions (for CFG), AdamW with warmup and cosine decay, and the EMA of the
   weights saved.

The pipeline is written with ``save_pretrained`` (safetensors) into a temporary sibling directory that is then renamed
into place (``flowalign.toy.pretrain.save_atomically``), with ``pretrain_log.json`` (settings, losses, wall times).

**Continuing** (``init_from``): a pipeline written by this command is loaded, its VAE kept as it is (stage 1 is
skipped: its latents and normalisation are unchanged), and stage 2 runs again as one more warmup-and-cosine cycle on
``latent_clips`` clips drawn with this run's ``seed`` (a seed not used before draws clips not seen before), from the
loaded DiT and text encoder, or from a new DiT (``reinit_transformer``: e.g. another ``patch_size``, on the loaded VAE
and text encoder). The new ``pretrain_log.json`` holds its parent's log under ``parent``, so a model trained in cycles
records every cycle's settings, losses and wall time. ``patch_size`` sets the DiT's patch: ``[1, 2, 2]`` makes 320
tokens a clip (each covering 4x4 pixels, as the image world's tokens do) instead of 80, at about 3.3 times a training
step's cost.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..lr_schedule import learning_rate_scale
from ..settings import at_least, finite, option
from .clips import NUM_FRAMES, clip_for, render_clip
from .pretrain import SceneStream, flow_update, save_atomically
from .video_prompts import split_video_prompts

logger = logging.getLogger(__name__)

__all__ = ["VIDEO_ARCHITECTURE", "ClipStream", "VideoPretrainConfig", "continued_pipeline", "pretrain_video",
           "toy_wan_pipeline", "video_architecture"]

FRAME_SIZE = 32
VIDEO_ARCHITECTURE = dict(
    max_length=12,
    t5_dim=64,
    t5_layers=2,
    transformer=dict(num_attention_heads=4, attention_head_dim=32, ffn_dim=512, num_layers=3, freq_dim=64,
                     rope_max_seq_len=32, patch_size=(1, 4, 4)),
    vae=dict(z_dim=4, base_dim=16, spatial_levels=0, temporal_levels=0, patch_size=2),
)


@dataclass
class VideoPretrainConfig:
    """Settings of ``flowalign toy pretrain-video`` (module docstring)."""

    out: str = option("assets/toy-wan", "output pipeline directory")
    seed: int = option(0, "seed")
    num_frames: int = option(NUM_FRAMES, "frames per training clip (k * the VAE's temporal factor + 1)")
    vae_steps: int = option(1200, "VAE training steps")
    vae_batch_size: int = option(16, "VAE batch size (clips)")
    vae_lr: float = option(1.2e-2, "VAE learning rate")
    kl_weight: float = option(1e-6, "weight of the VAE's KL term")
    vae_sample_posterior: bool = option(False, "decode a posterior sample while training the VAE (false: its mode, "
                                               "which trained 2x faster here)")
    calibration_clips: int = option(256, "clips whose latents set the VAE's per-channel mean and std")
    latent_clips: int = option(4096, "clips rendered and encoded once for the flow stage (its data set)")
    steps: int = option(2500, "transformer training steps")
    batch_size: int = option(48, "transformer batch size (clips)")
    lr: float = option(1e-3, "transformer learning rate (AdamW, warmup then cosine decay)")
    warmup_steps: int = option(100, "learning-rate warmup steps")
    weight_decay: float = option(0.01, "AdamW weight decay")
    ema_decay: float = option(0.995, "decay of the saved EMA of the weights")
    empty_caption_prob: float = option(0.1, "probability of the empty caption (for classifier-free guidance)")
    shift: float = option(1.0, "timestep shift of the scheduler")
    threads: int = option(1, "torch CPU threads (1: on a shared CPU, two threads that wait for each other's "
                                 "time slices ran 8x slower than one)")
    tag_weights: dict = option({}, "sampling weight per tag (tags not listed weigh 1)")
    patch_size: list[int] = option([1, 4, 4], "the DiT's patch (latent frames, height, width): [1, 4, 4] makes 80 "
                                              "tokens a clip, [1, 2, 2] 320 (about 3.3x a step's cost)")
    init_from: str = option("", "a pipeline written by this command to continue from: its VAE is kept (no VAE "
                                "stage) and the flow stage trains one more cosine cycle ('': from scratch)")
    reinit_transformer: bool = option(False, "with init_from: a new DiT (patch_size) on the loaded VAE and text "
                                             "encoder instead of the loaded DiT")

    def validate(self) -> None:
        for name in ("vae_steps", "vae_batch_size", "calibration_clips", "latent_clips", "steps", "batch_size", "threads"):
            at_least(name, getattr(self, name), 1)
        at_least("warmup_steps", self.warmup_steps, 0)
        at_least("seed", self.seed, 0)
        at_least("num_frames", self.num_frames, 2)
        factor = 2 ** VIDEO_ARCHITECTURE["vae"]["temporal_levels"]
        if (self.num_frames - 1) % factor:
            from flowalign.config import ConfigError

            below = (self.num_frames - 1) // factor * factor + 1
            raise ConfigError(f"num_frames = {self.num_frames}: the toy Wan VAE compresses {factor} frames into one "
                              f"after the first, so the count must be {factor}k+1: use {below} or {below + factor}",
                              key="num_frames")
        for name in ("vae_lr", "lr"):
            finite(name, getattr(self, name), 0, strict=True)
        for name in ("kl_weight", "weight_decay", "shift"):
            finite(name, getattr(self, name), 0)
        finite("ema_decay", self.ema_decay, 0, high=1)
        finite("empty_caption_prob", self.empty_caption_prob, 0, high=1)
        self._validate_patch()
        self._validate_init()

    def _validate_patch(self) -> None:
        from flowalign.config import ConfigError

        vae = VIDEO_ARCHITECTURE["vae"]
        grid = FRAME_SIZE // (vae["patch_size"] * 2 ** vae["spatial_levels"])
        frames = (self.num_frames - 1) // 2 ** vae["temporal_levels"] + 1
        patch = list(self.patch_size)
        if len(patch) != 3 or not all(isinstance(p, int) and p >= 1 for p in patch):
            raise ConfigError(f"patch_size = {patch}: three positive integers (latent frames, height, width), "
                              "e.g. [1, 4, 4]", key="patch_size")
        if grid % patch[1] or grid % patch[2] or frames % patch[0]:
            raise ConfigError(f"patch_size = {patch}: a clip's latents are {frames} frames of {grid}x{grid}, which "
                              f"the patch must divide: e.g. [1, 4, 4] or [1, 2, 2]", key="patch_size")

    def _validate_init(self) -> None:
        """``init_from`` names a finished pipeline of this command, not ``out`` itself; its DiT's patch is this
        run's unless the DiT is new. Checked before anything loads."""
        from flowalign.config import ConfigError

        if not self.init_from:
            if self.reinit_transformer:
                raise ConfigError("reinit_transformer = true needs init_from (the pipeline whose VAE and text "
                                  "encoder the new DiT trains on); without it every part is new anyway: drop it",
                                  key="reinit_transformer")
            return
        source = Path(self.init_from)
        missing = [name for name in ("model_index.json", "pretrain_log.json", "transformer/config.json")
                   if not (source / name).is_file()]
        if missing:
            raise ConfigError(f"init_from = {self.init_from!r}: not a pipeline written by `flowalign toy "
                              f"pretrain-video` (no {', '.join(missing)}); name the directory of an earlier run",
                              key="init_from")
        class_name = json.loads((source / "model_index.json").read_text()).get("_class_name")
        if class_name != "WanPipeline":
            raise ConfigError(f"init_from = {self.init_from!r} is a {class_name}, not the toy WanPipeline that "
                              "`flowalign toy pretrain-video` writes", key="init_from")
        if source.resolve() == Path(self.out).resolve():
            raise ConfigError(f"init_from = out = {self.out!r}: a run never replaces another run's files; write the "
                              "continued pipeline to a new out", key="out")
        if not self.reinit_transformer:
            patch = list(json.loads((source / "transformer/config.json").read_text())["patch_size"])
            if patch != list(self.patch_size):
                raise ConfigError(f"patch_size = {list(self.patch_size)}, but the DiT of init_from has {patch}: set "
                                  f"patch_size={patch} to continue it, or reinit_transformer=true for a new DiT",
                                  key="patch_size")


class ClipStream(SceneStream):
    """Random (caption, clip) batches from the training video prompts, drawn as ``SceneStream`` draws prompts."""

    def __init__(self, prompts: list[dict], seed: int, tag_weights: dict[str, float] | None = None,
                 num_frames: int = NUM_FRAMES):
        super().__init__(prompts, seed, tag_weights)
        self.num_frames = num_frames

    def batch(self, size: int) -> tuple[list[str], torch.Tensor]:
        """``size`` captions and their clips ``[B, 3, F, H, W]`` in [-1, 1] (the Wan VAE's layout)."""
        captions, clips = [], []
        for _ in range(size):
            entry = self.draw()
            captions.append(entry["prompt"])
            clips.append(render_clip(clip_for(entry, self.rng, self.num_frames, FRAME_SIZE), FRAME_SIZE))
        pixels = torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0
        return captions, pixels


def video_architecture(patch_size=None) -> dict:
    """``VIDEO_ARCHITECTURE`` with the DiT's ``patch_size`` (default: its own)."""
    if patch_size is None:
        return VIDEO_ARCHITECTURE
    return {**VIDEO_ARCHITECTURE, "transformer": {**VIDEO_ARCHITECTURE["transformer"], "patch_size": tuple(patch_size)}}


def toy_wan_pipeline(words, *, shift: float, seed: int, patch_size=None):
    """The untrained toy Wan pipeline (``video_architecture(patch_size)``), its default frame size 32 px
    (``sample_size`` 8 latent pixels, read by the adapter's ``default_image_size``)."""
    from ..models.tiny import tiny_wan_pipeline

    pipe = tiny_wan_pipeline(words, shift=shift, seed=seed, **video_architecture(patch_size))
    scale = pipe.vae.config.scale_factor_spatial
    pipe.transformer.register_to_config(sample_size=FRAME_SIZE // scale)
    return pipe


def train_vae(vae, stream: ClipStream, config: VideoPretrainConfig, log: dict) -> None:
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.vae_lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: learning_rate_scale(s, config.vae_steps, warmup=min(20, config.vae_steps // 10 + 1),
                                                 schedule="cosine"))
    vae.train().requires_grad_(True)
    generator = torch.Generator().manual_seed(config.seed + 2)
    bar = tqdm(range(config.vae_steps), desc="vae", dynamic_ncols=True)
    for step in bar:
        _, pixels = stream.batch(config.vae_batch_size)
        posterior = vae.encode(pixels).latent_dist
        latents = posterior.sample(generator) if config.vae_sample_posterior else posterior.mode()
        recon = vae.decode(latents).sample
        mse = F.mse_loss(recon, pixels)
        loss = mse + config.kl_weight * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == config.vae_steps - 1:
            bar.set_postfix(mse=f"{mse.item():.4f}")
            log["vae_mse"].append((step, mse.item()))
    vae.eval().requires_grad_(False)


@torch.no_grad()
def calibrate_latents(vae, stream: ClipStream, samples: int) -> tuple[list[float], list[float], float]:
    """Set the config's per-channel ``latents_mean`` / ``latents_std`` from posterior means; returns them and the
    reconstruction MSE in [0, 1] pixel units."""
    latents, errors = [], []
    for start in range(0, samples, 64):
        _, pixels = stream.batch(min(64, samples - start))
        z = vae.encode(pixels).latent_dist.mode()
        latents.append(z)
        errors.append(F.mse_loss((vae.decode(z).sample.clamp(-1, 1) + 1) / 2, (pixels + 1) / 2).item())
    z = torch.cat(latents).transpose(0, 1).flatten(1)  # [C, N]
    mean, std = z.mean(dim=1).tolist(), z.std(dim=1).clamp_min(1e-3).tolist()
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return mean, std, float(np.mean(errors))


def trainable_modules(pipe) -> list[torch.nn.Module]:
    return [pipe.transformer, pipe.text_encoder]


@torch.no_grad()
def encode_clips(pipe, stream: ClipStream, count: int, batch: int = 64) -> tuple[list[str], torch.Tensor]:
    """``count`` captions and the normalised latents ``[count, C, f, h, w]`` of their clips (the posterior's mode,
    through the adapter's normalisation): the flow stage's data set, encoded once."""
    from ..models.wan import WanModel

    model = WanModel(pipe, max_sequence_length=VIDEO_ARCHITECTURE["max_length"])
    captions, latents = [], []
    for start in range(0, count, batch):
        names, pixels = stream.batch(min(batch, count - start))
        captions += names
        latents.append(model.from_vae_space(pipe.vae.encode(pixels).latent_dist.mode()))
    return captions, torch.cat(latents)


def train_flow(pipe, data: tuple[list[str], torch.Tensor], config: VideoPretrainConfig, log: dict
               ) -> list[torch.nn.Module]:
    """Joint rectified-flow training of the Wan DiT and the UMT5 encoder on the encoded clips ``data``; returns the
    EMA copies."""
    captions_all, latents = data
    rng = np.random.default_rng(config.seed + 3)
    modules = trainable_modules(pipe)
    params = [p for m in modules for p in m.parameters()]
    for m in modules:
        m.train().requires_grad_(True)
    ema = [copy.deepcopy(m).eval().requires_grad_(False) for m in modules]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: learning_rate_scale(s, config.steps, warmup=config.warmup_steps, schedule="cosine"))
    generator = torch.Generator().manual_seed(config.seed + 1)
    bar = tqdm(range(config.steps), desc="flow", dynamic_ncols=True)
    running = None
    for step in bar:
        rows = rng.integers(len(captions_all), size=config.batch_size)
        captions = [captions_all[r] if rng.random() >= config.empty_caption_prob else "" for r in rows]
        x0 = latents[torch.from_numpy(rows)]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = torch.sigmoid(torch.randn(x0.shape[0], generator=generator))
        s = sigma.view(-1, 1, 1, 1, 1)
        x_s = (1 - s) * x0 + s * noise
        embeds, _ = pipe.encode_prompt(prompt=captions, do_classifier_free_guidance=False,
                                       max_sequence_length=VIDEO_ARCHITECTURE["max_length"],
                                       device=torch.device("cpu"))
        v = pipe.transformer(hidden_states=x_s, timestep=sigma * 1000, encoder_hidden_states=embeds,
                             return_dict=False)[0]
        loss = F.mse_loss(v, noise - x0)
        loss_value = flow_update(loss, optimizer, schedule, params, modules, ema, config.ema_decay)
        running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
        if step % 25 == 0 or step == config.steps - 1:
            bar.set_postfix(loss=f"{running:.4f}", lr=f"{schedule.get_last_lr()[0]:.2e}")
            log["flow_loss"].append((step, running))
    return ema


def continued_pipeline(config: VideoPretrainConfig, words):
    """The pipeline of ``config.init_from`` with the scheduler's shift of ``config``, and a new DiT in place of its
    own where ``config.reinit_transformer``; returns it and the parent's log."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from ..models.loading import load_flow_model

    source = Path(config.init_from)
    pipe = load_flow_model(source, family="wan").pipe
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=config.shift)
    if config.reinit_transformer:
        pipe.transformer = toy_wan_pipeline(words, shift=config.shift, seed=config.seed,
                                            patch_size=config.patch_size).transformer
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval().requires_grad_(False)
    pipe.set_progress_bar_config(disable=True)
    return pipe, json.loads((source / "pretrain_log.json").read_text())


def pretrain_video(config: VideoPretrainConfig) -> Path:
    """Both stages, or the flow stage again from ``init_from`` (module docstring); returns the written pipeline
    directory."""
    config.validate()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    train, test = split_video_prompts()
    words = sorted({w for entry in train + test for w in entry["prompt"].split()})
    stream = ClipStream(train, config.seed, config.tag_weights, config.num_frames)
    log = {"config": asdict(config), "architecture": video_architecture(config.patch_size), "vae_mse": [],
           "flow_loss": [], "load_average_at_start": list(os.getloadavg()), "cpu_count": os.cpu_count()}
    start = time.time()
    if config.init_from:
        pipe, parent = continued_pipeline(config, words)
        log.update(parent=parent, vae_seconds=0.0, vae_recon_mse=parent["vae_recon_mse"],
                   latents_mean=list(pipe.vae.config.latents_mean), latents_std=list(pipe.vae.config.latents_std))
    else:
        pipe = toy_wan_pipeline(words, shift=config.shift, seed=config.seed, patch_size=config.patch_size)
        train_vae(pipe.vae, stream, config, log)
        mean, std, recon = calibrate_latents(pipe.vae, stream, config.calibration_clips)
        log.update(vae_seconds=time.time() - start, latents_mean=mean, latents_std=std, vae_recon_mse=recon)
        logger.info("vae: recon MSE %.4f (pixels in [0,1]) after %.1f min", recon, log["vae_seconds"] / 60)
    data = encode_clips(pipe, stream, config.latent_clips)
    log["encode_seconds"] = time.time() - start - log["vae_seconds"]
    ema = train_flow(pipe, data, config, log)
    for live, avg in zip(trainable_modules(pipe), ema):
        live.load_state_dict(avg.state_dict())
        live.eval().requires_grad_(False)
    log["total_seconds"] = time.time() - start
    log["load_average_at_end"] = list(os.getloadavg())
    out = Path(config.out)
    save_atomically(pipe, out)
    tmp = out / "pretrain_log.json.tmp"
    tmp.write_text(json.dumps(log, indent=1))
    os.replace(tmp, out / "pretrain_log.json")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    logger.info("saved %s (%.1f MB) after %.1f min", out, size, log["total_seconds"] / 60)
    return out
