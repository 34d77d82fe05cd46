"""The checks of a run's video settings that run before any model loads, reading only the model's config files.

* ``sampling.num_frames`` (and ``model.vae_batch`` / ``model.vae_tiling``) on an image model is refused: they mean
  nothing there.
* On a video model, the frame count must be one the family's VAE takes: the causal video VAEs compress ``t`` frames
  into one after the first, so ``num_frames = k t + 1`` (``t`` is ``scale_factor_temporal`` in ``vae/config.json``).
* The objectives that train on image-caption pairs (``objectives.flow_matching``, ``objectives.soar``: a
  ``data`` key) have no video data source yet, so a video model refuses them.
* **The memory budget.** ``sampling.max_latent_elements`` bounds the latent elements of one micro-batch: the rows of
  one forward pass (``sampling.batch_size``, the whole local batch when null; an objective's own ``batch_size``)
  times ``C x f x h x w``, with ``C`` the VAE's latent channels, ``f = (num_frames - 1) / t + 1`` and
  ``h x w = sampling.image_size / s`` for the VAE's spatial factor ``s``. Activations grow with it (a transformer's
  tokens are ``f h w / patch``), so it is the one number that bounds a layout's memory before anything runs.

Each refusal is a ``ConfigError`` naming the key and the fix. A hub id (no local config files) is checked when the
model loads instead (the adapter's ``check_num_frames``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flowalign.config import ConfigError

__all__ = ["VaeLayout", "check_video_run", "micro_batch_rows", "vae_layout"]

# Where the diffusers video VAEs' configs keep their factors (Wan, SkyReels: scale_factor_*; LTX, HunyuanVideo,
# Mochi: *_compression_ratio) and their latent channels (z_dim; latent_channels).
_TEMPORAL_KEYS = ("scale_factor_temporal", "temporal_compression_ratio")
_SPATIAL_KEYS = ("scale_factor_spatial", "spatial_compression_ratio")
_CHANNEL_KEYS = ("z_dim", "latent_channels")


@dataclass(frozen=True)
class VaeLayout:
    """A video VAE's latent geometry, read from its ``config.json``: latent ``channels``, the ``temporal`` and
    ``spatial`` compression factors, and the transformer's ``sample_size`` (latent pixels; None when it has none)."""

    channels: int
    temporal: int
    spatial: int
    sample_size: int | None = None

    def latent_elements(self, frames: int, height: int, width: int) -> int:
        """``C x f x h x w`` of one video of ``frames`` pixel frames at ``height x width`` pixels."""
        return self.channels * ((frames - 1) // self.temporal + 1) * (height // self.spatial) * (width // self.spatial)


def _first(config: dict, keys: tuple[str, ...]):
    return next((config[k] for k in keys if config.get(k) is not None), None)


def vae_layout(model_path: str) -> VaeLayout | None:
    """The ``VaeLayout`` of the pipeline directory ``model_path`` (its ``vae/config.json`` and
    ``transformer/config.json``), or None when it is not a local directory with them (a hub id) or its VAE config
    names none of the known factors."""
    folder = Path(model_path).expanduser()
    vae_file, transformer_file = folder / "vae" / "config.json", folder / "transformer" / "config.json"
    if not vae_file.is_file():
        return None
    vae = json.loads(vae_file.read_text())
    transformer = json.loads(transformer_file.read_text()) if transformer_file.is_file() else {}
    channels, spatial = _first(vae, _CHANNEL_KEYS), _first(vae, _SPATIAL_KEYS)
    if channels is None or spatial is None:
        return None
    temporal = _first(vae, _TEMPORAL_KEYS) or 1
    sample = transformer.get("sample_size")
    return VaeLayout(int(channels), int(temporal), int(spatial), int(sample) if isinstance(sample, int) else None)


def micro_batch_rows(config, layout) -> list[tuple[int, str]]:
    """``(rows, key)`` of every forward pass a run makes on a batch of samples: the rollout chunk (also the training
    micro-batch: one chunk at one step) and each objective's own ``batch_size``."""
    rows = [(layout.rollout_batch_size, "sampling.batch_size")]
    for name, objective in config.components().objectives.items():
        size = getattr(objective.config, "batch_size", None)
        if isinstance(size, int):
            rows.append((size, f"objectives.{name}.batch_size"))
    return rows


def check_video_run(config, prompts: list[dict], adapter: type, layout) -> None:
    """Refuse, before the model loads, the video settings a run on ``adapter`` (the model's adapter class, from its
    ``model_index.json``) cannot take (module docstring). ``layout``: the run's ``BatchLayout``."""
    model, sampling = config.model, config.sampling
    if getattr(adapter, "modality", "image") != "video":
        for key, value, default in (("sampling.num_frames", sampling.num_frames, None),
                                    ("model.vae_batch", model.vae_batch, None),
                                    ("model.vae_tiling", model.vae_tiling, False)):
            if value != default:
                raise ConfigError(f"{key} = {value!r} is for video models, but {model.path} is an image model "
                                  f"({adapter.__name__}): drop {key}", key=key)
        return
    _check_data_objectives(config, adapter)
    vae = vae_layout(model.path)
    if vae is None:
        return
    frames = adapter.default_num_frames if sampling.num_frames is None else sampling.num_frames
    if (frames - 1) % vae.temporal:
        below = (frames - 1) // vae.temporal * vae.temporal + 1
        source = "sampling.num_frames" if sampling.num_frames is not None else f"{adapter.__name__}.default_num_frames"
        raise ConfigError(f"sampling.num_frames = {frames} ({source}): the {adapter.family} VAE compresses "
                          f"{vae.temporal} frames into one after the first, so the frame count must be "
                          f"{vae.temporal}k+1: set sampling.num_frames to {below} or {below + vae.temporal}",
                          key="sampling.num_frames")
    _check_budget(config, vae, frames, layout)


def _check_data_objectives(config, adapter) -> None:
    for name, objective in config.components().objectives.items():
        if isinstance(getattr(objective.config, "data", None), str):
            raise ConfigError(
                f"objectives.{name}.data = {objective.config.data!r}: this objective trains on image-caption pairs, "
                f"and there is no video data source yet, so it cannot train the video model {config.model.path} "
                f"({adapter.__name__}): drop objectives.{name}, or train with a method on rollouts",
                key=f"objectives.{name}.data")


def _check_budget(config, vae: VaeLayout, frames: int, layout) -> None:
    budget = config.sampling.max_latent_elements
    if budget is None:
        return
    size = config.sampling.image_size
    if size is None and vae.sample_size is None:
        raise ConfigError(f"sampling.max_latent_elements = {budget} needs the frame size, and {config.model.path} "
                          "names no default: set sampling.image_size", key="sampling.image_size")
    side = size if size is not None else vae.sample_size * vae.spatial
    per_video = vae.latent_elements(frames, side, side)
    video = f"sampling.num_frames = {frames} frames at sampling.image_size = {side}"
    fix = "sampling.num_frames or sampling.image_size, or raise sampling.max_latent_elements"
    if per_video > budget:
        raise ConfigError(f"sampling.max_latent_elements = {budget}: one video of {video} holds {per_video} latent "
                          f"elements, over the budget: lower {fix}", key="sampling.max_latent_elements")
    shape = (f"{vae.channels} channels x {(frames - 1) // vae.temporal + 1} latent frames x {side // vae.spatial} x "
             f"{side // vae.spatial}")
    for rows, key in micro_batch_rows(config, layout):
        if rows * per_video > budget:
            raise ConfigError(
                f"sampling.max_latent_elements = {budget}: a micro-batch of {rows} videos ({key}) of {video} holds "
                f"{rows} x {per_video} = {rows * per_video} latent elements ({shape}): lower {key} to at most "
                f"{budget // per_video}, or {fix}", key="sampling.max_latent_elements")
