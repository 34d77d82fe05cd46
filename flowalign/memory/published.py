"""The models the planner knows without their files: the published transformer configs and frozen-component sizes
shipped in ``configs/published/*.json`` (one file per model, each naming its source), and the same facts read from a
local model directory's config files (``model_spec``).

A spec holds what memory depends on: the transformer configs (two for Wan2.2 A14B's experts), the parameter counts of
the frozen components a run holds (text encoders, VAE), the latent geometry (the VAE's spatial and temporal
compression, the transformer's patch, the text tokens) and the published resolution and frame count.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from flowalign.config import ConfigError

__all__ = ["PUBLISHED_DIR", "ModelSpec", "model_spec", "published_models"]

PUBLISHED_DIR = Path(__file__).resolve().parents[2] / "configs" / "published"
# Families whose pipeline packs 2x2 latent patches into the channels (the transformer's config says patch 1).
PACKED_FAMILIES = {"flux": 2, "flux_kontext": 2, "chroma": 2, "flux2": 2, "flux2_klein": 2}
SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                           "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class ModelSpec:
    """What the planner knows of a model without its weights (module docstring)."""

    name: str
    family: str
    transformers: dict[str, dict]
    frozen: dict[str, int]
    geometry: dict
    published: dict = field(default_factory=dict)
    source: str = ""
    directory: Path | None = None  # a local model directory

    def image_tokens(self, height: int, width: int, num_frames: int | None = None) -> int:
        """Latent tokens of one sample: ``frames' x (H / (s p)) x (W / (s p))`` with ``frames' = ((F - 1) / t + 1)
        / p_t`` for video (``F`` frames, VAE compression ``s`` and ``t``, patch ``p`` and ``p_t``), times two when the
        model appends a condition image's latents (FLUX.1 Kontext)."""
        g = self.geometry
        step = g["vae_spatial"] * g["patch"]
        frames = 1
        if num_frames is not None and g.get("vae_temporal"):
            frames = math.ceil(((num_frames - 1) // g["vae_temporal"] + 1) / g.get("patch_t", 1))
        return frames * math.ceil(height / step) * math.ceil(width / step) * (1 + g.get("condition_images", 0))


def _spec_from_file(path: Path, everything: dict[str, dict]) -> ModelSpec:
    data = everything[path.stem]
    base = everything[data["same_as"]] if "same_as" in data else data
    return ModelSpec(name=data["name"], family=data["family"], transformers=base["transformers"],
                     frozen={k: v["parameters"] for k, v in base["frozen"].items()}, geometry=data["geometry"],
                     published=data["published"], source=data["source"])


def published_models() -> dict[str, ModelSpec]:
    """Every shipped model, by its file's name (``wan21_t2v_14b``) and by its hub id."""
    files = sorted(PUBLISHED_DIR.glob("*.json"))
    everything = {path.stem: json.loads(path.read_text()) for path in files}
    models = {}
    for path in files:
        spec = _spec_from_file(path, everything)
        models[path.stem] = spec
        models[everything[path.stem]["hub"]] = spec
    return models


def _safetensors_parameters(folder: Path) -> int:
    """Parameters in a folder's ``*.safetensors`` files, read from their headers alone (8-byte length, then JSON)."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100_000_000:
                raise ConfigError(f"model.path: {file} has a safetensors header of {length} bytes, which is not "
                                  "plausible", key="model.path")
            header = json.loads(handle.read(length))
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total


def _vae_compression(config: dict) -> tuple[int, int]:
    spatial = config.get("scale_factor_spatial") or config.get("spatial_compression_ratio")
    if spatial is None:
        spatial = 2 ** (len(config.get("block_out_channels", [0])) - 1)
    temporal = config.get("scale_factor_temporal") or config.get("temporal_compression_ratio") or 0
    return int(spatial), int(temporal)


def _local_spec(directory: Path, family: str | None) -> ModelSpec:
    from flowalign.models.loading import adapter_class

    adapter = adapter_class(str(directory), family)
    family = family or next(name for name, cls in _families() if cls is adapter)
    transformers = {}
    for name in ("transformer", "transformer_2"):
        config_file = directory / name / "config.json"
        if config_file.is_file():
            transformers[name] = json.loads(config_file.read_text())
    if not transformers:
        raise ConfigError(f"model.path: {directory} has no transformer/config.json to build the model from",
                          key="model.path")
    index = json.loads((directory / "model_index.json").read_text())
    frozen = {name: _safetensors_parameters(directory / name) for name in sorted(index)
              if (name.startswith("text_encoder") or name in ("vae", "image_encoder")) and (directory / name).is_dir()}
    spatial, temporal = _vae_compression(json.loads((directory / "vae" / "config.json").read_text()))
    config = transformers["transformer"]
    patch = config.get("patch_size", 1)
    patch_t = config.get("patch_size_t", 1)
    if isinstance(patch, (list, tuple)):
        patch_t, patch = patch[0], patch[-1]
    geometry = {"vae_spatial": spatial, "vae_temporal": temporal,
                "patch": PACKED_FAMILIES.get(family, patch), "patch_t": patch_t or 1, "text_tokens": None,
                "condition_images": 1 if getattr(adapter, "takes_condition_images", False) else 0}
    # the pipeline's default size where the transformer's config states it (latent pixels x the VAE's factor), as the
    # adapters' default_image_size reads it: the toy models' 32 px, not a published model's
    sample_size = config.get("sample_size")
    published = {"height": sample_size * spatial, "width": sample_size * spatial} if isinstance(sample_size, int) else {}
    return ModelSpec(name=directory.name, family=family, transformers=transformers, frozen=frozen, geometry=geometry,
                     published=published, source=f"{directory}'s config files", directory=directory)


def _families():
    from flowalign.models.base import MODEL_FAMILIES

    return [(name, MODEL_FAMILIES.get(name)) for name in MODEL_FAMILIES.names()]


def model_spec(path: str, family: str | None = None) -> ModelSpec:
    """The spec of ``model.path``: a shipped published model (its file name or hub id), or a local model directory
    read from its config files (no weights read: the frozen components are counted from their safetensors headers).

    Raises:
        ConfigError: naming ``model.path`` when it is neither, or ``model.family`` when it contradicts the model.
    """
    models = published_models()
    if path in models:
        spec = models[path]
        if family is not None and family != spec.family:
            raise ConfigError(f"model.family = {family!r}, but {path} is a {spec.family!r} model", key="model.family")
        return spec
    directory = Path(path)
    if directory.is_dir() and (directory / "model_index.json").is_file():
        try:
            return _local_spec(directory, family)
        except ValueError as error:  # the loader's own words for an unsupported pipeline or family
            raise ConfigError(f"model.family: {error}", key="model.family") from None
    known = sorted(name for name in models if "/" in name)
    raise ConfigError(f"model.path = {path!r} is neither a local model directory (with model_index.json) nor a model "
                      f"whose config ships with flowalign (configs/published): {', '.join(known)}", key="model.path")
